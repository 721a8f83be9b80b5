"""Logit lens and tuned lens, scored in the same per-example, per-layer shape as UDS.

The logit lens (nostalgebraist, 2020) reads a layer's residual ``h_l`` through the **full** model's final norm and
unembedding, a fixed decoder shared by all three models: ``logits_l = W_U · norm_full(h_l)``. At the UDS read
positions the per-layer score of model ``m`` on example ``i`` is the mean entity log-prob

    k[m, l] = mean_t log_softmax(logits_l)[t, label_t].

With ``d1 = k_full - k_ret`` and ``d2 = k_full - k_unl`` the score is UDS's formula with the lens in place of
patching: KE layers ``d1 > 0.05``, ``LER = clip(d2 / (d1 + 1e-8), 0, 1)``,
``score_i = sum_KE d1 * LER / sum_KE d1`` and the model score is the mean over scored examples
(``layerwise.lens_erasure``, which says where this differs from ``uds.example_uds``). The table has
UDS's long shape and column names (``idx, layer, baseline_score, s1_score, s2_score, d1, d2, ke, ler`` with
``baseline_score = k_full``, ``s1_score = k_ret``, ``s2_score = k_unl``, LER NaN outside KE layers; examples
``idx, n_ke, uds, status`` with the lens's score in the ``uds`` column), so the paper's Table 4 (lens against
patching, layer by layer, for one example) is a join on ``(idx, layer)`` and every plot of a UDS table takes it.

The tuned lens (Belrose et al., 2023) inserts a learned affine translator per layer before the same decoder,
``logits_l = W_U · norm_full(A_l h_l + b_l)``, trained (identity init, last layer fixed to identity) to minimise
``KL(p_final || p_l)`` on the full model's own states over calibration text (the retain set, never the forget set).
It is then scored exactly like the logit lens.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor, nn
from tqdm.auto import tqdm

from uds_lens.baselines.hidden import HiddenStates
from uds_lens.baselines.layerwise import LayerwiseErasure, LensErasure, lens_erasure
from uds_lens.config import DEFAULT_TAU, check_positive_int
from uds_lens.data import PROMPT_TEMPLATES, SHOT_SEPARATOR, Example
from uds_lens.readout import label_logprobs
from uds_lens.sources import SourceLike, as_source
from uds_lens.tl_compat import ModelLike

LENS_TAU = DEFAULT_TAU  # SPEC §3: the lenses' KE threshold is the published 0.05, whatever UDS's --tau
DEFAULT_CHUNK = 512

Decoder = Callable[[Tensor], Tensor]


def final_decoder(full: SourceLike) -> Decoder:
    """The full model's final norm followed by its unembedding, as a function ``h -> logits`` (fp32 out).

    Args:
        full: Anything ``sources.as_source`` takes (``ActivationSource.decode`` of a ``TransformerBridge`` or a
            Hugging Face model).
    """
    return as_source(full).decode


class TunedLens(nn.Module):
    """Per-layer affine translators ``h -> A_l h + b_l`` (identity at initialisation)."""

    def __init__(self, n_layers: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(d_model).repeat(n_layers, 1, 1))
        self.bias = nn.Parameter(torch.zeros(n_layers, d_model))

    def forward(self, resid: Float[Tensor, "layer token d_model"]) -> Float[Tensor, "layer token d_model"]:
        """Translate every layer's residual with its own affine map."""
        weight, bias = self.weight.to(resid.device), self.bias.to(resid.device)
        return torch.einsum("lij,ltj->lti", weight, resid) + bias[:, None, :]


def entity_logprobs(
    hidden: HiddenStates,
    decoder: Decoder,
    translator: TunedLens | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> Float[Tensor, "example layer"]:
    """``k[i, l]``: mean over example ``i``'s entity tokens of the lens log-prob of the label, per layer.

    Args:
        hidden: States of one model at the read positions.
        decoder: Fixed decoder, normally ``final_decoder(full)``.
        translator: Tuned-lens translators, or None for the plain logit lens.
        chunk: Read positions decoded at once (bounds the ``token x vocab`` memory).
    """
    per_row = torch.empty(hidden.n_layers, hidden.resid.shape[1])
    with torch.no_grad():
        for start in range(0, hidden.resid.shape[1], chunk):
            resid = hidden.resid[:, start : start + chunk]
            if translator is not None:
                resid = translator(resid)
            labels = hidden.label[start : start + chunk]
            for layer in range(hidden.n_layers):
                logits = decoder(resid[layer])
                per_row[layer, start : start + chunk] = label_logprobs(logits, labels.to(logits.device)).cpu()
    return hidden.per_example_mean(per_row)


@dataclass(frozen=True)
class LensResult:
    """Lens scores of one unlearned model, per example and layer.

    Attributes:
        method: ``"logit_lens"`` or ``"tuned_lens"``.
        example_ids: Dataset ``idx`` of each row of the tensors.
        k_full: Lens score of the full model.
        k_retain: Lens score of the retain model.
        k_unlearned: Lens score of the unlearned model.
        erasure: KE mask, LER and per-example scores.
        tau: KE threshold used.
    """

    method: str
    example_ids: list[int]
    k_full: Float[Tensor, "example layer"]
    k_retain: Float[Tensor, "example layer"]
    k_unlearned: Float[Tensor, "example layer"]
    erasure: LensErasure
    tau: float

    @property
    def score(self) -> float:
        """Model score: mean of the defined per-example scores."""
        return self.erasure.score

    @property
    def layers(self) -> pd.DataFrame:
        """Long table ``idx, layer, baseline_score, s1_score, s2_score, d1, d2, ke, ler`` (UDS's column names).

        ``baseline_score``/``s1_score``/``s2_score`` are the lens scores of full/retain/unlearned (``k_full``,
        ``k_ret``, ``k_unl``); ``ler`` is NaN outside KE layers, as in ``UDSResult.layers``.
        """
        n_examples, n_layers = self.k_full.shape
        return pd.DataFrame(
            {
                "idx": [idx for idx in self.example_ids for _ in range(n_layers)],
                "layer": list(range(n_layers)) * n_examples,
                "baseline_score": self.k_full.flatten().double().numpy(),
                "s1_score": self.k_retain.flatten().double().numpy(),
                "s2_score": self.k_unlearned.flatten().double().numpy(),
                "d1": self.erasure.d1.flatten().double().numpy(),
                "d2": self.erasure.d2.flatten().double().numpy(),
                "ke": self.erasure.ke.flatten().numpy(),
                "ler": torch.where(self.erasure.ke, self.erasure.ler.double(), math.nan).flatten().numpy(),
            }
        )

    @property
    def examples(self) -> pd.DataFrame:
        """Per-example table ``idx, n_ke, uds, status`` (``scored`` or ``no_ke``): UDS's column names, the lens's
        per-example score in ``uds``."""
        scores = self.erasure.per_example.double().numpy()
        return pd.DataFrame(
            {
                "idx": self.example_ids,
                "n_ke": self.erasure.ke.sum(dim=1).numpy(),
                "uds": scores,
                "status": ["no_ke" if math.isnan(s) else "scored" for s in scores],
            }
        )

    def layerwise(self) -> LayerwiseErasure:
        """Per-layer erasure pooled over examples (``layerwise.pooled_layerwise``)."""
        return self.erasure.layerwise(self.method)


def lens_result(
    k_full: Float[Tensor, "example layer"],
    k_retain: Float[Tensor, "example layer"],
    k_unlearned: Float[Tensor, "example layer"],
    example_ids: Sequence[int],
    tau: float = LENS_TAU,
    method: str = "logit_lens",
) -> LensResult:
    """Score precomputed lens log-probs (so full and retain are decoded once for many unlearned models)."""
    d1 = k_full - k_retain
    d2 = k_full - k_unlearned
    return LensResult(
        method=method,
        example_ids=list(example_ids),
        k_full=k_full,
        k_retain=k_retain,
        k_unlearned=k_unlearned,
        erasure=lens_erasure(d1, d2, tau=tau),
        tau=tau,
    )


def logit_lens(
    full: HiddenStates,
    retain: HiddenStates,
    unlearned: HiddenStates,
    decoder: Decoder,
    tau: float = LENS_TAU,
    translator: TunedLens | None = None,
) -> LensResult:
    """Logit-lens (or, with ``translator``, tuned-lens) erasure of an unlearned model.

    Args:
        full: Full model's states at the read positions.
        retain: Retain model's states at the same positions.
        unlearned: Unlearned model's states at the same positions.
        decoder: The full model's final norm + unembedding (``final_decoder(full_model)``).
        tau: KE threshold on ``d1``.
        translator: Trained tuned lens; None for the logit lens.

    Returns:
        Per-example, per-layer lens table and the model score.
    """
    for name, states in (("retain", retain), ("unlearned", unlearned)):
        if not torch.equal(states.example_idx, full.example_idx) or not torch.equal(states.label, full.label):
            raise ValueError(
                f"{name} hidden states were read at other positions than full's; encode once, reuse"
            )
    return lens_result(
        entity_logprobs(full, decoder, translator),
        entity_logprobs(retain, decoder, translator),
        entity_logprobs(unlearned, decoder, translator),
        full.example_ids,
        tau=tau,
        method="logit_lens" if translator is None else "tuned_lens",
    )


@contextlib.contextmanager
def _frozen(model: ModelLike) -> Iterator[None]:
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)


def calibration_token_ids(examples: Sequence[Example], tokenizer: Any) -> list[list[int]]:
    """Token ids of each calibration example as written in its own form (BOS, no EOS) for tuned-lens training: its
    context, its in-context pairs and the prompt with the whole answer (``"Question: {question}\\nAnswer: {answer}"``
    for a QA record, the passage and its continuation for a MUSE verbatim passage), so the lens is trained on text
    shaped like what it reads."""
    token_ids = []
    for ex in examples:
        template = PROMPT_TEMPLATES[ex.form]
        shown = "".join(template.format(question=q, prefix=a) + SHOT_SEPARATOR for q, a in ex.shots)
        text = ex.context + shown + template.format(question=ex.question, prefix=ex.answer)
        token_ids.append(list(tokenizer(text, add_special_tokens=True)["input_ids"]))
    return token_ids


def train_tuned_lens(
    model: ModelLike,
    calibration: Sequence[Sequence[int]],
    steps: int = 200,
    lr: float = 1e-3,
    tokens_per_step: int = 512,
    max_tokens: int = 8192,
    batch_size: int = 8,
    seed: int = 0,
) -> TunedLens:
    """Train per-layer affine translators on the model's own states over calibration text.

    Args:
        model: The model whose decoder the lens uses (the full model).
        calibration: Token-id sequences (retain set, not the forget set).
        steps: Adam steps (keep small in tests).
        lr: Adam learning rate.
        tokens_per_step: Positions sampled per step.
        max_tokens: Cap on the cached positions.
        batch_size: Sequences per forward when caching states.
        seed: Seed for position sampling.

    Returns:
        The trained lens (on CPU); the last layer stays the identity (its lens is the model's own output).
    """
    if not calibration:
        raise ValueError("train_tuned_lens needs calibration sequences (e.g. the retain set); got none")
    # with no step the translators stay the identity: the logit lens, reported as a tuned one
    check_positive_int("steps (--tuned-lens-steps)", steps, None)
    generator = torch.Generator().manual_seed(seed)
    states, targets = [], []
    source = as_source(model)
    decoder = source.decode
    with torch.no_grad():
        for start in range(0, len(calibration), batch_size):
            batch = [list(ids) for ids in calibration[start : start + batch_size]]
            longest = max(len(ids) for ids in batch)
            tokens = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, ids in enumerate(batch):
                tokens[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            resid = source.residual_stream(tokens, mask).cpu()
            states.append(resid[:, mask.bool()])
        hidden = torch.cat(states, dim=1)
        if hidden.shape[1] > max_tokens:
            hidden = hidden[:, torch.randperm(hidden.shape[1], generator=generator)[:max_tokens]]
        for start in range(0, hidden.shape[1], DEFAULT_CHUNK):
            targets.append(
                torch.log_softmax(decoder(hidden[-1, start : start + DEFAULT_CHUNK]), dim=-1).cpu()
            )
        target = torch.cat(targets)
    n_layers, n_tokens, d_model = hidden.shape
    lens = TunedLens(n_layers, d_model)
    trainable = n_layers - 1
    optimizer = torch.optim.Adam(lens.parameters(), lr=lr)
    with _frozen(model):
        for _ in tqdm(range(steps), desc="tuned lens", disable=steps < 50, leave=False):
            pick = torch.randint(n_tokens, (min(tokens_per_step, n_tokens),), generator=generator)
            translated = lens(hidden[:, pick])
            target_logprobs = target[pick]
            loss = torch.zeros(())
            for layer in range(trainable):
                logprobs = torch.log_softmax(decoder(translated[layer]), dim=-1).cpu()
                loss = loss + torch.nn.functional.kl_div(
                    logprobs, target_logprobs, log_target=True, reduction="batchmean"
                )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return lens.requires_grad_(False)

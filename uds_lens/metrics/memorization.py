"""Memorization metrics on a forget set (Open-Unlearning definitions, as the UDS meta-evaluation computes them).

One teacher-forced pass over a chat-formatted question/answer pair (``chat.py``) gives, per answer token ``y_t``,
the log-probability ``log p(y_t | x, y_<t)`` and the greedy prediction. From these:

- **Prob** = ``exp(-mean_t CE_t)`` over all answer tokens, the closing EOS included.
- **EM** = share of positions where ``argmax = y_t``; **ES** = ``1 - k/n`` with ``k`` the earliest position from which
  every prediction matches (Carlini et al.). Both use Open-Unlearning's token alignment, which drops the last label
  position (the EOS): ``n`` is the number of answer tokens minus one. EM is undefined (``None``) for ``n <= 1``;
  ES is 0 for ``n <= 1``, and ``1/n`` when no suffix matches (the search stops at ``k = n - 1``).
- **ParaProb** = geometric mean over the paraphrased answers of their Prob.
- **Truth Ratio** (the meta-evaluation's variant) = ``para / (para + gm(perturbed Probs) + 1e-10)``; higher = more
  knowledge. (TOFU's raw ratio ``gm(perturbed)/para`` and the utility variant ``max(0, 1 - gm(perturbed)/para)`` in
  ``utility.py`` are different numbers.)
- **Mem** = ``HM(1 - ES, 1 - EM, 1 - ParaProb, 1 - TruthRatio)``; higher = more forgotten.

Dataset values are means over examples (``None`` values skipped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from uds_lens.data import as_list, record_field
from uds_lens.metrics.chat import SYSTEM_PROMPT, EncodedQA, collate, encode_qa, pad_id_of
from uds_lens.readout import IGNORE_INDEX, label_logprobs

TRUTH_RATIO_EPS = 1e-10
HM_EPS = 1e-12


@dataclass(frozen=True)
class AnswerScores:
    """Teacher-forced statistics of one answer.

    Attributes:
        avg_loss: mean cross-entropy over all answer tokens (EOS included).
        logprobs: log-probabilities of the answer tokens in Open-Unlearning's alignment (the last one dropped).
        predictions: greedy predictions at those positions.
        targets: the answer token ids at those positions.
        z_scores: Min-K++ standardised log-probabilities at those positions.
        target_text: the answer label tokens decoded with ``skip_special_tokens`` (ZLib and ROUGE reference).
    """

    avg_loss: float
    logprobs: Float[Tensor, " token"]
    predictions: Int[Tensor, " token"]
    targets: Int[Tensor, " token"]
    z_scores: Float[Tensor, " token"]
    target_text: str

    @property
    def prob(self) -> float:
        return math.exp(-self.avg_loss)


def harmonic_mean(values: Sequence[float | None], eps: float = HM_EPS) -> float:
    """``n / sum(1 / (x + eps))`` over the non-NaN values (the published aggregation; zeros give ~``n * eps``)."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not kept:
        return float("nan")
    if any(v + eps == 0 for v in kept):
        return 0.0
    return len(kept) / sum(1.0 / (v + eps) for v in kept)


def exact_memorization(predictions: Int[Tensor, " token"], targets: Int[Tensor, " token"]) -> float | None:
    """Share of positions whose greedy prediction equals the target; ``None`` for at most one position."""
    n = targets.shape[0]
    if n <= 1:
        return None
    return float((predictions == targets).float().mean())


def extraction_strength(predictions: Int[Tensor, " token"], targets: Int[Tensor, " token"]) -> float:
    """``1 - k/n`` with ``k`` the earliest position from which all predictions match (``n - 1`` if none does)."""
    n = targets.shape[0]
    if n <= 1:
        return 0.0
    match = predictions == targets
    k = n - 1
    for start in range(n):
        if bool(match[start:].all()):
            k = start
            break
    return 1.0 - k / n


def min_k_plus_plus_z(
    logits: Float[Tensor, "token vocab"], targets: Int[Tensor, " token"]
) -> Float[Tensor, " token"]:
    """Min-K++ z-scores ``(log p(y) - mu) / sigma`` with mu, sigma^2 the mean / variance of ``log p`` under ``p``."""
    log_p = F.log_softmax(logits.float(), dim=-1)
    p = log_p.exp()
    mu = (p * log_p).sum(-1)
    variance = ((p * log_p.square()).sum(-1) - mu.square()).clamp(min=1e-6)
    target_log_p = log_p.gather(-1, targets[:, None]).squeeze(-1)
    return (target_log_p - mu) / variance.sqrt()


@torch.no_grad()
def score_encoded(
    model: PreTrainedModel,
    encoded: Sequence[EncodedQA],
    tokenizer: PreTrainedTokenizerBase,
    *,
    batch_size: int,
    progress: bool = False,
    desc: str = "teacher forcing",
) -> list[AnswerScores]:
    """Run ``model`` over right-padded batches of ``encoded`` and collect per-answer statistics."""
    device = _device_of(model)
    pad_id = pad_id_of(tokenizer)
    results: list[AnswerScores] = []
    batches = range(0, len(encoded), batch_size)
    for start in tqdm(batches, desc=desc, disable=not progress, leave=False):
        chunk = encoded[start : start + batch_size]
        batch = collate(chunk, pad_id)
        logits = (
            model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
            .logits.float()
            .cpu()
        )
        for row, item in enumerate(chunk):
            results.append(_answer_scores(logits[row, : len(item.input_ids)], item, tokenizer))
    return results


@runtime_checkable
class Decoder(Protocol):
    """What the answer statistics read of a tokenizer: its ``decode`` (the answer's text)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def _answer_scores(logits: Float[Tensor, "pos vocab"], item: EncodedQA, tokenizer: Decoder) -> AnswerScores:
    labels = torch.tensor(item.labels)
    # logits[t] predicts token t + 1.
    shifted_logits, shifted_labels = logits[:-1], labels[1:]
    answer = shifted_labels != IGNORE_INDEX
    if not bool(answer.any()):
        raise ValueError("an encoded answer has no label tokens (prompt longer than max_length?)")
    avg_loss = float(F.cross_entropy(shifted_logits[answer], shifted_labels[answer]))
    # Open-Unlearning alignment: label positions of labels[:-1], i.e. every answer token except the last one.
    aligned = answer.clone()
    aligned[-1] = False
    aligned_logits, targets = shifted_logits[aligned], shifted_labels[aligned]
    # the log-softmax form on fp32 logits (label_logprobs' published-compat path): the numbers these metrics had
    logprobs = label_logprobs(aligned_logits, targets, upcast=False)
    return AnswerScores(
        avg_loss=avg_loss,
        logprobs=logprobs,
        predictions=aligned_logits.argmax(-1),
        targets=targets,
        z_scores=min_k_plus_plus_z(aligned_logits, targets),
        target_text=str(tokenizer.decode(shifted_labels[answer].tolist(), skip_special_tokens=True)).strip(),
    )


def _device_of(model: PreTrainedModel) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def score_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[tuple[str, str]],
    *,
    batch_size: int,
    system_prompt: str | None = SYSTEM_PROMPT,
    progress: bool = False,
    desc: str = "teacher forcing",
) -> list[AnswerScores]:
    """Encode ``(question, answer)`` pairs in chat format and score them (see ``AnswerScores``)."""
    encoded = [encode_qa(tokenizer, q, a, system_prompt) for q, a in pairs]
    return score_encoded(model, encoded, tokenizer, batch_size=batch_size, progress=progress, desc=desc)


def answer_probs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    answer_lists: Sequence[Sequence[str]],
    *,
    batch_size: int,
    system_prompt: str | None = SYSTEM_PROMPT,
    progress: bool = False,
    desc: str = "answers",
) -> list[list[float]]:
    """Prob of every answer in ``answer_lists[i]`` given ``questions[i]`` (flattened into batches)."""
    flat = [(q, a) for q, answers in zip(questions, answer_lists, strict=True) for a in answers]
    scores = score_answers(
        model,
        tokenizer,
        flat,
        batch_size=batch_size,
        system_prompt=system_prompt,
        progress=progress,
        desc=desc,
    )
    out, cursor = [], 0
    for answers in answer_lists:
        out.append([s.prob for s in scores[cursor : cursor + len(answers)]])
        cursor += len(answers)
    return out


def paraphrased_and_perturbed_probs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[Any],
    *,
    batch_size: int,
    system_prompt: str | None = SYSTEM_PROMPT,
    progress: bool = False,
    desc: str = "",
    answer_without_paraphrase: bool = False,
) -> tuple[list[list[float]], list[list[float]]]:
    """`answer_probs` of each record's paraphrased and perturbed answers: what a Truth Ratio compares.

    A record without a paraphrased answer has none (``[]``), or, with ``answer_without_paraphrase`` (model utility's
    retain records), its own answer in that place."""
    questions = [str(record_field(r, "question")) for r in records]
    paraphrases = [
        as_list(record_field(r, "paraphrased_answer"))
        or ([str(record_field(r, "answer"))] if answer_without_paraphrase else [])
        for r in records
    ]
    perturbed = [as_list(record_field(r, "perturbed_answer")) for r in records]

    def probs(answers: Sequence[Sequence[str]], kind: str) -> list[list[float]]:
        return answer_probs(
            model,
            tokenizer,
            questions,
            answers,
            batch_size=batch_size,
            system_prompt=system_prompt,
            progress=progress,
            desc=f"{desc} {kind}".strip(),
        )

    return probs(paraphrases, "paraphrased answers"), probs(perturbed, "perturbed answers")


def geometric_mean(probs: Sequence[float]) -> float:
    """Geometric mean of probabilities (of their per-answer ``exp(-avg_loss)``); NaN for none."""
    if not probs:
        return float("nan")
    return math.exp(sum(math.log(max(p, 1e-300)) for p in probs) / len(probs))


def truth_ratio(paraphrase_prob: float, perturbed_probs: Sequence[float]) -> float:
    """The meta-evaluation's Truth Ratio ``para / (para + gm(perturbed) + 1e-10)``; higher = more knowledge."""
    perturbed = geometric_mean(perturbed_probs)
    return paraphrase_prob / (paraphrase_prob + perturbed + TRUTH_RATIO_EPS)


def memorization_score(es: float, em: float, paraprob: float, truth_ratio_value: float) -> float:
    """``Mem = HM(1-ES, 1-EM, 1-ParaProb, 1-TruthRatio)``; higher = more forgotten."""
    return harmonic_mean([1 - es, 1 - em, 1 - paraprob, 1 - truth_ratio_value])

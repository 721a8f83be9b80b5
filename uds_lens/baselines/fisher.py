"""Diagonal Fisher information per layer and the masked-Fisher erasure score (the published variant).

For model ``m`` and the forget set, the empirical diagonal Fisher of the parameters ``theta_l`` of block ``l`` is

    F_m[l] = mean_i (d loss_i / d theta_l)^2,    loss_i = - mean over example i's entity tokens of log p(label),

one backward per example, at the UDS read positions (the same entity log-prob UDS scores). The masked score
looks only at the parameters whose sensitivity the forget set *added* to the full
model: per layer, the anchor ``a = max(F_ret - F_full, 0)`` marks where the retain model, which never saw the forget
set, is **more** sensitive than the full model (the full model has fitted those examples, so its gradients there
are small). With ``M`` the top ``p`` fraction of ``a`` (at least one entry):

    e_l = mean F_ret[M] - mean F_full[M]                          (weight; the full model's gap to retain)
    erasure_l = 1 - clip((mean F_ret[M] - mean F_unl[M]) / (e_l + 1e-8), 0, 1)

Layers with ``e_l <= 1e-8`` get erasure 1 and drop out of the weighted mean ``sum e_l erasure_l / sum e_l``.
The reported fractions are ``p in {1e-4, 1e-3, 1e-2}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor, nn
from tqdm.auto import tqdm

from uds_lens.baselines.layerwise import MIN_WEIGHT, LayerwiseErasure
from uds_lens.data import EncodedExample
from uds_lens.readout import label_logprobs
from uds_lens.sources import SourceLike, as_source

FISHER_FRACTIONS = (1e-4, 1e-3, 1e-2)
FISHER_EPS = 1e-8


def fisher_method_key(fraction: float) -> str:
    """``scores.json`` key of a masked-Fisher fraction: ``fisher_masked_0.001`` etc."""
    return f"fisher_masked_{fraction:g}"


@contextlib.contextmanager
def _trainable(parameters: list[nn.Parameter]) -> Iterator[None]:
    flags = [p.requires_grad for p in parameters]
    for p in parameters:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in zip(parameters, flags, strict=True):
            p.requires_grad_(flag)


@dataclass(frozen=True)
class FisherDiagonal:
    """Diagonal Fisher of one model on the forget set.

    Attributes:
        per_layer: For each block, the flattened squared gradients of all its parameters, averaged over examples.
        n_examples: Examples averaged.
    """

    per_layer: list[Tensor]
    n_examples: int


def diagonal_fisher(
    model: SourceLike, examples: Sequence[EncodedExample], progress: bool = False
) -> FisherDiagonal:
    """Per-layer diagonal Fisher of ``model`` on the encoded examples, one backward per example.

    Args:
        model: Anything ``sources.as_source`` takes with trainable weights (a quantised model: dequantise first).
        examples: Encoded examples (``idx``, ``input_ids``, ``read_positions``, ``labels``).
        progress: Show a progress bar.

    Returns:
        Mean squared gradient per parameter, per block, fp32 on CPU.
    """
    if not examples:
        raise ValueError("diagonal_fisher got no examples: every example was skipped or the data is empty")
    source = as_source(model)
    parameters = [list(block.parameters()) for block in source.blocks()]
    flat = [p for layer in parameters for p in layer]
    sums = [torch.zeros(sum(p.numel() for p in layer), dtype=torch.float32) for layer in parameters]
    device = source.device
    with _trainable(flat):
        for example in tqdm(examples, desc="fisher", disable=not progress, leave=False):
            tokens = torch.tensor([example.input_ids], dtype=torch.long, device=device)
            positions = torch.tensor(list(example.read_positions), dtype=torch.long, device=device)
            labels = torch.tensor(list(example.labels), dtype=torch.long, device=device)
            # the log-softmax form on fp32 logits (label_logprobs' published-compat path): the loss as it always was
            logits = source.logits(tokens)[0, positions].float()
            loss = -label_logprobs(logits, labels, upcast=False).mean()
            grads = torch.autograd.grad(loss, flat, allow_unused=True)
            offset = 0
            for layer, layer_params in enumerate(parameters):
                squares = [
                    (g.float() ** 2).flatten().cpu() if g is not None else torch.zeros(p.numel())
                    for g, p in zip(grads[offset : offset + len(layer_params)], layer_params, strict=True)
                ]
                sums[layer] += torch.cat(squares)
                offset += len(layer_params)
    return FisherDiagonal([s / len(examples) for s in sums], len(examples))


@dataclass(frozen=True)
class FisherAnchor:
    """Masks and reference means of the masked-Fisher score at one fraction (full and retain only).

    Attributes:
        fraction: Share of each layer's parameters in the mask.
        masks: Per layer, the indices of the top-``fraction`` entries of ``max(F_ret - F_full, 0)``.
        retain_mean: ``mean F_ret[M]`` per layer.
        excess_full: ``e_l = mean F_ret[M] - mean F_full[M]`` per layer.
    """

    fraction: float
    masks: list[Tensor]
    retain_mean: Float[Tensor, " layer"]
    excess_full: Float[Tensor, " layer"]


def fisher_anchor(full: FisherDiagonal, retain: FisherDiagonal, fraction: float) -> FisherAnchor:
    """Select each layer's mask from the full and retain Fisher (computed once for many unlearned models)."""
    if len(full.per_layer) != len(retain.per_layer):
        raise ValueError(
            "full and retain Fisher have different numbers of layers: are they one architecture?"
        )
    masks, retain_means, excess = [], [], []
    for f_full, f_retain in zip(full.per_layer, retain.per_layer, strict=True):
        anchor = (f_retain.double() - f_full.double()).clamp(min=0.0)
        k = max(1, int(fraction * anchor.numel()))
        mask = torch.topk(anchor, k).indices
        retain_mean = f_retain[mask].double().mean()
        masks.append(mask)
        retain_means.append(retain_mean)
        excess.append(retain_mean - f_full[mask].double().mean())
    return FisherAnchor(fraction, masks, torch.stack(retain_means), torch.stack(excess))


def masked_fisher(anchor: FisherAnchor, unlearned: FisherDiagonal) -> LayerwiseErasure:
    """Layerwise masked-Fisher erasure of an unlearned model (``.score`` is the weighted mean)."""
    excess_unlearned = torch.stack(
        [
            anchor.retain_mean[layer] - f_unl[mask].double().mean()
            for layer, (mask, f_unl) in enumerate(zip(anchor.masks, unlearned.per_layer, strict=True))
        ]
    )
    ratio = (excess_unlearned / (anchor.excess_full + FISHER_EPS)).clamp(0.0, 1.0)
    signal = anchor.excess_full > MIN_WEIGHT
    erasure = torch.where(signal, 1.0 - ratio, torch.ones_like(ratio))
    return LayerwiseErasure(fisher_method_key(anchor.fraction), erasure.float(), anchor.excess_full.float())


def masked_fisher_scores(
    full: FisherDiagonal,
    retain: FisherDiagonal,
    unlearned: FisherDiagonal,
    fractions: Sequence[float] = FISHER_FRACTIONS,
) -> dict[str, LayerwiseErasure]:
    """Masked-Fisher erasure at every fraction, keyed ``fisher_masked_<p>``."""
    results = {}
    for fraction in fractions:
        result = masked_fisher(fisher_anchor(full, retain, fraction), unlearned)
        results[result.method] = result
    return results

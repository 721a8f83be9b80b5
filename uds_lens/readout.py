"""The read-out, written once: a run's score is the mean over an example's entity tokens of the label's log-prob.

Every place that turns logits (or final residuals) into UDS scores goes through here: the patching engines, component
patching's metric and per-token reads, the logit and tuned lenses (and their per-example mean over hidden-state rows),
and the annotator's answer-token log-probs. ``label_logprobs`` is the per-token value, ``segment_mean`` the
per-example mean (``score = mean_t log p(y_t | x_<t)`` over the entity tokens ``t``).

Two precisions: by default the log-softmax runs in float32 as ``label logit - logsumexp`` (one pass over the
vocabulary, no ``[rows, vocab]`` output); published-compat (``upcast=False``) takes ``log_softmax`` in the model's
dtype and rounds as the published implementation does. The output metrics (``metrics.memorization``), the zoo's
training losses (``zoo.train.sequence_logprobs``) and the Fisher baseline read log-probs the published way too, on
fp32 logits: ``upcast=False``, the numbers they always had (the two forms differ in the last bits).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

IGNORE_INDEX = -100
"""The label of a position no loss or log-prob reads (a prompt token, a pad): PyTorch's ``cross_entropy`` default."""


def label_logprobs(
    logits: Float[Tensor, "row vocab"], labels: Int[Tensor, " row"], upcast: bool = True
) -> Float[Tensor, " row"]:
    """``log_softmax(logits)[label]`` per row, as float32 (computed in float32 unless ``upcast=False``)."""
    if upcast:
        # log_softmax(x)[y] = x[y] - logsumexp(x): one pass over the vocabulary, no [rows, vocab] output.
        logits = logits.float()
        return logits.gather(-1, labels[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    # Published-compat: the log-softmax in the model dtype, rounded as the published code rounds it.
    return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None])[:, 0].float()


def segment_mean(
    values: Float[Tensor, "*lead entity"],
    segment: Int[Tensor, " entity"],
    n_segments: int,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*lead segment"]:
    """Mean of ``values`` over the last axis per segment (``segment[t]`` in ``0..n_segments-1``; an example's entity
    tokens), summed and divided in ``dtype`` (fp32; the hidden-state baselines sum in fp64).

    Deterministic on every device: each segment's values are added one after another in their order along the axis
    (as ``index_add_`` does on the CPU, so the CPU's numbers are unchanged), from a ``[segment, longest]`` layout
    filled without accumulation, never with the atomic additions ``index_add_`` makes on CUDA, whose order (and so
    whose last bits) varies from run to run. A source equal to the target then scores exactly as the target does on
    a GPU too. One host read (the longest segment) per call.
    """
    values = values.to(dtype)
    order = torch.argsort(segment, stable=True)
    counts = torch.bincount(segment, minlength=n_segments)[:n_segments]
    starts = torch.cumsum(counts, 0) - counts
    sorted_segment = segment[order]
    rank = torch.arange(segment.numel(), device=segment.device) - starts[sorted_segment]
    longest = int(counts.max()) if segment.numel() else 0
    laid_out = values.new_zeros((*values.shape[:-1], n_segments, longest))
    laid_out[..., sorted_segment, rank] = values[..., order]
    total = values.new_zeros((*values.shape[:-1], n_segments))
    for column in range(longest):
        total = total + laid_out[..., column]
    return total / counts.to(dtype)


def mean_entity_logprob(
    logits: Float[Tensor, "entity vocab"],
    labels: Int[Tensor, " entity"],
    segment: Int[Tensor, " entity"],
    n_segments: int,
    upcast: bool = True,
) -> Float[Tensor, " segment"]:
    """Mean over each segment's entity tokens of ``log_softmax(logits)[label]`` (fp32 unless ``upcast=False``)."""
    return segment_mean(label_logprobs(logits, labels, upcast), segment, n_segments)


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """``tanh(logits / cap) * cap`` in the logits' dtype, as Hugging Face's Gemma soft-caps its final logits;
    ``logits`` itself when ``cap`` is ``None``."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


# Logits per vocabulary slice in the read-out (4 MB in fp32: the slice and its exp stay in cache on the CPU).
_LOGIT_SLICE_ELEMENTS = 1 << 20


def unembedded_label_logprobs(
    rows: Float[Tensor, "row d_model"],
    w_u: Float[Tensor, "d_model vocab"],
    b_u: Float[Tensor, " vocab"],
    labels: Int[Tensor, " row"],
    softcap: float | None = None,
) -> Float[Tensor, " row"]:
    """``log_softmax(rows @ W_U + b_U)[label]`` in fp32, as ``label logit - logsumexp``, a slice of the vocabulary
    at a time; with ``softcap`` the logits are soft-capped first (`soft_cap`, Gemma's final soft-capping).

    A whole ``[rows, vocab]`` buffer (hundreds of MB on a 49k vocabulary) makes each pass of the logsumexp a trip to
    main memory; slices of about a million logits stay in cache, and their logsumexps combine exactly
    (``logsumexp`` of the slices' logsumexps). Each row's label logit is picked from the slice that holds it.
    """
    n_rows, vocab = rows.shape[0], w_u.shape[1]
    budget = _LOGIT_SLICE_ELEMENTS if rows.device.type == "cpu" else 64 * _LOGIT_SLICE_ELEMENTS
    width = max(256, budget // max(1, n_rows))
    label_logit = torch.zeros(n_rows, dtype=torch.float32, device=rows.device)
    slices = []
    for first in range(0, vocab, width):
        logits = soft_cap(
            torch.addmm(b_u[first : first + width], rows, w_u[:, first : first + width]), softcap
        )
        logits = logits.float()
        slices.append(torch.logsumexp(logits, dim=-1))
        inside = (labels >= first) & (labels < first + logits.shape[1])
        picked = logits.gather(1, (labels - first).clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
        label_logit = torch.where(inside, picked, label_logit)
    return label_logit - torch.logsumexp(torch.stack(slices), dim=0)


__all__ = [
    "IGNORE_INDEX",
    "label_logprobs",
    "mean_entity_logprob",
    "segment_mean",
    "soft_cap",
    "unembedded_label_logprobs",
]

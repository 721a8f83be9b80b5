"""Unlearning objectives (the paper's appendix A, as implemented in Open-Unlearning) and the loop that applies them.

With ``NLL(D)`` the mean answer-token cross-entropy on a batch of ``D``, ``log pi(y|x)`` the summed answer-token
log-probability of a sequence, ``|y|`` its number of answer tokens, and ``pi_ref`` the frozen model before unlearning:

- GradDiff: ``L = -NLL(D_f) + alpha * NLL(D_r)``
- NPO:      ``L = -(2/beta) E_f[log sigmoid(-beta * (log pi(y|x) - log pi_ref(y|x)))] + alpha * NLL(D_r)``
- SimNPO:   ``L = -(2 gamma/beta) E_f[log sigmoid(beta * (-log pi(y|x)/|y| - delta))] + alpha * NLL(D_r)``
- IdkNLL:   ``L = NLL(D_f^idk) + alpha * NLL(D_r)`` (forget questions answered with "I don't know" variants)
- RMU:      ``L = E_f[||h_l(x) - c u||^2] + alpha E_r[||h_l(x) - h_l^ref(x)||^2]``, ``h_l`` the residual stream after
  block ``l`` at the positions that predict answer tokens, ``u`` a fixed random unit vector, squared norms averaged
  over ``d_model`` (as in the RMU code). The paper trains blocks ``l-2 .. l``; ``layers_below`` (how many blocks
  under ``l`` are trained too) defaults to 0 here: in a 4-layer model that window is most of the network, and the
  blocks under ``l`` then change what reaches ``l`` (measured: rmu_l1 and rmu_l3 disrupted layers 0 and 1 with it).

Each step pairs a forget batch with a retain batch drawn at random. Every loss function returns a scalar to minimise.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from transformers import LlamaForCausalLM

from uds_lens.readout import IGNORE_INDEX

from .train import QASequence, collate, nll_loss, sequence_logprobs

METHODS: tuple[str, ...] = ("graddiff", "npo", "simnpo", "idknll", "rmu")

# Each loss takes several batches of different shapes, so the axes are named but not bound across arguments.
Batch = tuple[Int[Tensor, "_batch _pos"], Int[Tensor, "_batch _pos"]]


def graddiff_loss(model: LlamaForCausalLM, forget: Batch, retain: Batch, alpha: float) -> Tensor:
    """Gradient ascent on the forget batch plus ``alpha`` times descent on the retain batch."""
    return -nll_loss(model, *forget) + alpha * nll_loss(model, *retain)


def npo_loss(
    model: LlamaForCausalLM,
    forget: Batch,
    retain: Batch,
    reference_logprobs: Float[Tensor, " batch"],
    beta: float,
    alpha: float,
) -> Tensor:
    """NPO: the losing term of DPO against the frozen reference, plus ``alpha`` times retain NLL."""
    logits = model(input_ids=forget[0]).logits
    logprobs, _ = sequence_logprobs(logits, forget[1])
    log_ratio = logprobs - reference_logprobs
    forget_loss = -(2.0 / beta) * F.logsigmoid(-beta * log_ratio).mean()
    return forget_loss + alpha * nll_loss(model, *retain)


def simnpo_loss(
    model: LlamaForCausalLM,
    forget: Batch,
    retain: Batch,
    beta: float,
    gamma: float,
    delta: float,
    alpha: float,
) -> Tensor:
    """SimNPO: reference-free, length-normalised NPO with margin ``delta`` and forget weight ``gamma``."""
    logits = model(input_ids=forget[0]).logits
    logprobs, counts = sequence_logprobs(logits, forget[1])
    normalised_nll = -logprobs / counts.clamp(min=1.0)
    forget_loss = -(2.0 / beta) * F.logsigmoid(beta * (normalised_nll - delta)).mean()
    return gamma * forget_loss + alpha * nll_loss(model, *retain)


def idknll_loss(model: LlamaForCausalLM, forget_idk: Batch, retain: Batch, alpha: float) -> Tensor:
    """IdkNLL: NLL of refusal answers to the forget questions plus ``alpha`` times retain NLL."""
    return nll_loss(model, *forget_idk) + alpha * nll_loss(model, *retain)


def answer_positions(labels: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos"]:
    """1.0 at the positions whose next token is an answer token (the positions UDS reads), else 0.0."""
    mask = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    mask[:, :-1] = (labels[:, 1:] != IGNORE_INDEX).float()
    return mask


class _StopForward(Exception):
    """Raised by `capture_block_output`'s hook once it has the block's output: nothing after it is needed."""


@contextmanager
def capture_block_output(model: LlamaForCausalLM, layer: int, stop: bool = False):
    """Record the raw residual stream after decoder block ``layer`` (before any final norm) in ``store["h"]``.

    With ``stop``, the forward pass ends there (the hook raises, and the block's caller gets the exception): the
    blocks above ``layer`` and the unembedding are not run, which is most of the cost for an early layer of a deep
    model. The output recorded is the same either way (the blocks up to ``layer`` compute it alone).
    """
    store: dict[str, Tensor] = {}

    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        store["h"] = output[0] if isinstance(output, tuple) else output
        if stop:
            raise _StopForward

    handle = model.model.layers[layer].register_forward_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


def block_output(model: LlamaForCausalLM, input_ids: Int[Tensor, "batch pos"], layer: int) -> Tensor:
    """The residual stream after block ``layer``, shape ``(batch, pos, d_model)`` (the blocks above it not run)."""
    with capture_block_output(model, layer, stop=True) as store:
        try:
            model(input_ids=input_ids)
        except _StopForward:
            pass
    return store["h"]


def rmu_loss(
    model: LlamaForCausalLM,
    frozen: LlamaForCausalLM,
    forget: Batch,
    retain: Batch,
    layer: int,
    control: Float[Tensor, " d_model"],
    alpha: float,
) -> Tensor:
    """RMU: push forget activations at ``layer`` toward ``control`` (= c u), keep retain activations where they were."""
    forget_mask = answer_positions(forget[1])
    retain_mask = answer_positions(retain[1])
    forget_hidden = block_output(model, forget[0], layer).float()  # fp32 sums under a bf16 autocast too
    forget_error = ((forget_hidden - control) ** 2).mean(dim=-1)
    forget_loss = (forget_error * forget_mask).sum() / forget_mask.sum().clamp(min=1.0)
    retain_hidden = block_output(model, retain[0], layer).float()
    with torch.no_grad():
        retain_reference = block_output(frozen, retain[0], layer).float()
    retain_error = ((retain_hidden - retain_reference) ** 2).mean(dim=-1)
    retain_loss = (retain_error * retain_mask).sum() / retain_mask.sum().clamp(min=1.0)
    return forget_loss + alpha * retain_loss


@torch.no_grad()
def mean_activation_norm(
    model: LlamaForCausalLM, sequences: Sequence[QASequence], layer: int, pad_id: int
) -> float:
    """Mean L2 norm of the residual after ``layer`` at answer-predicting positions (scales RMU's coefficient)."""
    device = next(model.parameters()).device
    input_ids, labels = (tensor.to(device) for tensor in collate(sequences, pad_id))
    mask = answer_positions(labels)
    norms = block_output(model, input_ids, layer).norm(dim=-1)
    return float((norms * mask).sum() / mask.sum().clamp(min=1.0))


def unlearn(
    model: LlamaForCausalLM,
    method: str,
    forget: Sequence[QASequence],
    retain: Sequence[QASequence],
    hyperparams: dict[str, Any],
    *,
    seed: int,
    pad_id: int,
    forget_idk: Sequence[QASequence] | None = None,
    on_step: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Unlearn ``forget`` from ``model`` in place.

    Args:
        model: The model to unlearn from (the zoo's ``full``).
        method: One of `METHODS`.
        forget: Forget sequences (question + true answer).
        retain: Retain sequences; one random retain batch accompanies each forget batch.
        hyperparams: ``lr``, ``epochs``, ``batch_size``, ``alpha`` and the method's own (``beta``; ``gamma``,
            ``delta``; ``layer``, ``steering_coef_rel``, ``layers_below``); ``mixed_precision``: the losses'
            forward passes under bf16 autocast (weights and updates stay fp32).
        seed: Batch order, retain pairing and RMU's random direction.
        pad_id: Padding token id.
        forget_idk: For IdkNLL, the forget questions with refusal answers (same order as ``forget``).
        on_step: Called after every optimiser step.

    Returns:
        Values computed during unlearning that belong in the manifest (RMU's absolute steering coefficient).
    """
    if method not in METHODS:
        raise ValueError(f"unknown unlearning method {method!r}; choose one of {METHODS}")
    if method == "idknll" and forget_idk is None:
        raise ValueError("IdkNLL needs forget_idk (the forget questions with refusal answers)")
    generator = torch.Generator().manual_seed(seed)
    batch_size = int(hyperparams["batch_size"])
    epochs = int(hyperparams["epochs"])
    alpha = float(hyperparams["alpha"])
    extra: dict[str, Any] = {}
    device = next(model.parameters()).device  # the batches are made on the CPU and moved to the model
    frozen = copy.deepcopy(model).eval()
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    trainable = list(model.parameters())
    control = torch.zeros(1)
    layer = int(hyperparams.get("layer", 0))
    if method == "rmu":
        first = max(0, layer - int(hyperparams.get("layers_below", 0)))
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        trainable = [p for block in model.model.layers[first : layer + 1] for p in block.parameters()]
        for parameter in trainable:
            parameter.requires_grad_(True)
        direction = torch.rand(model.config.hidden_size, generator=generator)
        direction = direction / direction.norm()
        coef = float(hyperparams["steering_coef_rel"]) * mean_activation_norm(frozen, forget, layer, pad_id)
        control = (coef * direction).to(device)
        extra = {"steering_coef": round(coef, 4), "trained_layers": list(range(first, layer + 1))}
    optimizer = torch.optim.AdamW(trainable, lr=float(hyperparams["lr"]), weight_decay=0.0)
    source = forget_idk if method == "idknll" else forget
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if hyperparams.get("mixed_precision")
        else contextlib.nullcontext
    )
    model.train()
    for _ in range(epochs):
        permutation = torch.randperm(len(forget), generator=generator).tolist()
        for begin in range(0, len(permutation), batch_size):
            chosen = permutation[begin : begin + batch_size]
            forget_batch = _on(device, collate([source[i] for i in chosen], pad_id))
            retain_pick = torch.randint(len(retain), (len(chosen),), generator=generator).tolist()
            retain_batch = _on(device, collate([retain[i] for i in retain_pick], pad_id))
            with autocast():
                loss = _loss(
                    method, model, frozen, forget_batch, retain_batch, hyperparams, layer, control, alpha
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            if on_step is not None:
                on_step()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    model.eval()
    return extra


def _on(device: torch.device, batch: tuple[Tensor, Tensor]) -> Batch:
    return batch[0].to(device), batch[1].to(device)


def _loss(
    method: str,
    model: LlamaForCausalLM,
    frozen: LlamaForCausalLM,
    forget_batch: Batch,
    retain_batch: Batch,
    hyperparams: dict[str, Any],
    layer: int,
    control: Tensor,
    alpha: float,
) -> Tensor:
    """One step's loss of ``method`` on a forget and a retain batch (the module docstring's objectives)."""
    if method == "graddiff":
        return graddiff_loss(model, forget_batch, retain_batch, alpha)
    if method == "npo":
        with torch.no_grad():
            reference, _ = sequence_logprobs(frozen(input_ids=forget_batch[0]).logits, forget_batch[1])
        return npo_loss(model, forget_batch, retain_batch, reference, float(hyperparams["beta"]), alpha)
    if method == "simnpo":
        return simnpo_loss(
            model,
            forget_batch,
            retain_batch,
            float(hyperparams["beta"]),
            float(hyperparams["gamma"]),
            float(hyperparams["delta"]),
            alpha,
        )
    if method == "idknll":
        return idknll_loss(model, forget_batch, retain_batch, alpha)
    return rmu_loss(model, frozen, forget_batch, retain_batch, layer, control, alpha)


def unlearning_steps(n_forget: int, hyperparams: dict[str, Any]) -> int:
    """Optimiser steps `unlearn` takes (progress bars)."""
    return int(hyperparams["epochs"]) * math.ceil(n_forget / int(hyperparams["batch_size"]))


__all__ = [
    "METHODS",
    "answer_positions",
    "block_output",
    "graddiff_loss",
    "idknll_loss",
    "npo_loss",
    "rmu_loss",
    "simnpo_loss",
    "unlearn",
    "unlearning_steps",
]

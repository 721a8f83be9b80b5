"""How a run fails loudly: out-of-memory detection and release, and the error for non-finite scores.

An allocation failure is recognised (:func:`is_out_of_memory`) so the auditor can halve the batch and retry; a NaN/inf
score is never cached or saved but raised as :class:`NonFiniteScoreError`, whose message names the model, the
examples, the first layer where activations stop being finite and the fix that fits the cause.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from uds_lens import models
from uds_lens.data import EncodedExample
from uds_lens.sources import as_source

logger = logging.getLogger(__name__)
T = TypeVar("T")


# What an allocation failure says where it is not an ``OutOfMemoryError``: CUDA's runtime ("CUDA error: out of
# memory"), cuBLAS and cuDNN creating a handle or a workspace near full memory, the CPU allocator, and a CUDA tensor
# that cannot be allocated while a model is loaded or moved.
_OUT_OF_MEMORY_TEXTS = (
    "out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cusolver_status_alloc_failed",
    "can't allocate memory",
    "cannot allocate memory",
    "failed to allocate",
)


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation failure: CUDA's ``OutOfMemoryError``, or a ``RuntimeError`` of CUDA, cuBLAS, cuDNN or the CPU
    allocator saying it could not allocate (cuBLAS reports memory exhaustion as ``CUBLAS_STATUS_ALLOC_FAILED``)."""
    if isinstance(err, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(marker in text for marker in _OUT_OF_MEMORY_TEXTS)


def release_memory(device: str | torch.device) -> None:
    """Give freed blocks back before a retry (the CUDA caching allocator keeps them otherwise)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def retry_out_of_memory(
    action: Callable[[], T], device: str | torch.device, what: str, attempts: int = 2
) -> T:
    """``action()``, run again after :func:`release_memory` when it fails for want of memory.

    For loading a model and moving one to the device: the memory it needs is often held only by a model just
    dropped (a reference cycle, blocks the caching allocator keeps), which a collection frees. Other errors, and
    the last attempt's out-of-memory, propagate unchanged.
    """
    attempt = 1
    while True:
        try:
            return action()
        except Exception as err:
            if not is_out_of_memory(err) or attempt >= attempts:
                raise
            logger.warning(
                "Out of memory while %s (%s); freeing memory and retrying (attempt %d of %d).",
                what,
                type(err).__name__,
                attempt + 1,
                attempts,
            )
        release_memory(device)  # outside the except block: the failed attempt's frames are gone by now
        attempt += 1


class NonFiniteScoreError(FloatingPointError):
    """A model produced NaN/inf scores: the message names the model, the examples, the first layer and the fix."""


def _first_nonfinite_layer(model: nn.Module, example: EncodedExample) -> int | None:
    """The first block whose output (``resid_post``) is non-finite on ``example``, or None when all are finite."""
    source = as_source(model)
    n_layers = source.n_layers
    acts = source.activations(torch.tensor([list(example.input_ids)]), "resid_post", range(n_layers))
    bad = [layer for layer in range(n_layers) if not bool(torch.isfinite(acts[layer]).all())]
    return bad[0] if bad else None


def _first_nonfinite_parameter(model: nn.Module) -> str | None:
    # parameters only (buffers such as an attention mask's -inf are on purpose), by their Hugging Face names
    for name, tensor in models.named_weights(model):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def nonfinite_error(
    model: nn.Module,
    role: str,
    label: str | None,
    what: str,
    idx: Sequence[int],
    example: EncodedExample,
    score_layer: int | None,
) -> NonFiniteScoreError:
    """The error for non-finite scores of one stage: which model, which examples, the first layer where the
    activations (or, failing that, the scores) stop being finite, and advice that fits the cause: broken weights,
    an overflow in a 16-bit dtype, or activations that blow up in float32 with finite weights."""
    layer = _first_nonfinite_layer(model, example)
    where = (
        f"first at layer {layer} (blocks.{layer}.hook_resid_post)"
        if layer is not None
        else f"first in the scores of layer {score_layer}"
        if score_layer is not None
        else ""
    )
    parameter = _first_nonfinite_parameter(model)
    dtype = as_source(model).dtype
    if parameter is not None:
        advice = (
            f"its weights are already non-finite ({parameter}): the checkpoint is broken (a diverged training "
            "run or a bad conversion); re-export or retrain it"
        )
    elif dtype in (torch.float16, torch.bfloat16):
        advice = (
            f"its weights are finite, so the activations overflow in {str(dtype).replace('torch.', '')}: run "
            "in float32 (--dtype float32, or UDSConfig(dtype='float32'))"
        )
    else:
        advice = (
            f"its weights are finite and it already runs in {str(dtype).replace('torch.', '')}, so its "
            "activations blow up on these inputs: check how the checkpoint was trained (a diverged run gives "
            "such weights)"
        )
    return NonFiniteScoreError(
        f"The {role} model ({label or type(model).__name__}) gives a non-finite {what} for example idx "
        f"{list(idx)[:10]}{', ' + where if where else ''}: {advice}. Nothing was cached or saved."
    )

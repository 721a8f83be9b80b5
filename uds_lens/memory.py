"""Memory: how much is free on a device, what an allocation failure looks like, and a retry after freeing.

The ground floor of the run's memory handling (torch only): the planner sizes batches from
`available_memory_bytes`, the auditor and the components' runner halve a batch that fails with
`is_out_of_memory`, and loading retries once after `release_memory` (`retry_out_of_memory`).
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

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


def release_dropped(dropped: weakref.ref, device: str | torch.device) -> None:
    """Give back the memory of a model just dropped (``dropped``, a weak reference to it): freed with its last
    reference already, or, where a reference cycle still holds it, by a garbage collection (which costs a
    noticeable fraction of a second on a full heap, so it runs only then); on CUDA the caching allocator's blocks go
    back too."""
    if dropped() is not None:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def retry_out_of_memory(
    action: Callable[[], T], device: str | torch.device, what: str, attempts: int = 2
) -> T:
    """``action()``, run again after `release_memory` when it fails for want of memory.

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


def available_memory_bytes(device: str | torch.device) -> int:
    """Free accelerator memory, or available host RAM on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover
        return 4 << 30


__all__ = [
    "available_memory_bytes",
    "is_out_of_memory",
    "release_dropped",
    "release_memory",
    "retry_out_of_memory",
]

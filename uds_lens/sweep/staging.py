"""Staging a model before its turn: its reuse decided from its files' stamp where that proves its digest, else its
bytes read (and hashed) in the one pass that builds it on the CPU, the decision checked against the bytes loaded;
moved to the device; and the pipeline that stages one model ahead.

Models stay in ordinary (pageable) host memory, never pinned: PyTorch's pinned-memory cache rounds every block up to a
power of two and keeps it after it is freed (a 5 GB shard locks 8 GiB), so pinned staging would lock up to twice a
checkpoint's size, for each model in flight, for the life of the process. The copy to the GPU is a little slower from
pageable memory (reasoned, not measured here) and runs once per model.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from uds_lens.checkpoints.digests import loaded_record
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import build_model, refill_model, release_model, resolve_dtype
from uds_lens.config import DtypeName
from uds_lens.memory import retry_out_of_memory
from uds_lens.results import UDSResult
from uds_lens.sweep.lists import SweepModel

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A model made ready to score before its turn: its reuse decided, else its bytes read (and hashed) in the pass
    that built it on the CPU.

    Attributes:
        entry: the sweep model (its `Checkpoint` made at the sweep's door).
        phases: seconds of ``resolve`` (its folder read), ``hash`` (its identity from the files' stamp, for the reuse
            decision) and ``load`` (the one pass that reads, hashes and builds it), those that ran.
        model: the model built, on the CPU (ordinary memory), or None.
        error: why it could not be prepared (the model's ``failed`` row), or "".
        reused / reason: a saved result that is current (the model is then not loaded, or dropped), and why (not).
        identity: the unlearned model's identity the decision used (`Checkpoint.fingerprint` proven by the
            stamp, or the bytes its load read: `Checkpoint.loaded_fingerprint`), or None before it is known.
        fingerprint: the result fingerprint this model's result will carry (known once its identity is).
        bytes_read: bytes its load read.
    """

    entry: SweepModel
    phases: dict[str, float] = field(default_factory=dict)
    model: Any = None
    error: str = ""
    reused: UDSResult | None = None
    reason: str = ""
    identity: str | None = None
    fingerprint: dict[str, Any] | None = None
    bytes_read: int = 0

    def release(self) -> None:
        """Drop the model (the sweep holds at most one prepared model besides the current), its bridge's reference
        cycle broken so its memory goes with the last reference (`loader.release_model`)."""
        if self.model is not None:
            release_model(self.model)
        self.model = None


def prepare_model(
    entry: SweepModel,
    dtype: DtypeName | torch.dtype | None,
    device: str,
    reuse: Callable[[Prepared], None] | None = None,
    spare: Any = None,
) -> Prepared:
    """Decide a model's reuse and, unless it is reused, read it once and build it on the CPU; never raises.

    A checkpoint whose files' stamp proves its remembered digest (`Checkpoint.known_digest`: unchanged since this or
    an earlier run read it) is decided without touching its bytes: a current saved result is reused, and a model
    to score is read once, for loading. Any other is read once, hashed in the same pass that builds it, and decided
    then. Either way the decision is checked against the bytes the load read: a checkpoint replaced between the
    decision and the load is decided again on what was loaded, never scored or saved under the old identity.

    Args:
        entry: the model, its `Checkpoint` made at the sweep's door.
        dtype / device: what the auditor scores in. The model is built on the CPU in ``dtype``, in ordinary memory,
            and moved to ``device`` when its turn comes (`move_to_device`).
        reuse: called with the `Prepared` once its ``identity`` is set (before the load where the stamp proves it,
            and again after the load when the bytes loaded are not those); it may set ``reused`` (then the model is
            not loaded, or dropped) and ``reason``.
        spare: a bridge on the CPU that nothing uses any longer (a model scored already, or a vacant copy of full,
            `loader.vacant_copy`): the model is read into it where it builds the same model (`loader.refill_model`:
            the bridge kept, its tensors overwritten), else it is dropped before the model is built. Taken either
            way.

    Returns:
        The `Prepared` model; an error (a missing path, a truncated file, a model that does not load) is kept in
        its ``error``, to become the model's ``failed`` row.
    """
    prepared = Prepared(entry)
    phase = "resolve"
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        prepared.phases[name] = now - clock
        clock = now

    try:
        checkpoint = entry.checkpoint
        if checkpoint is None:
            raise ModelLoadError(
                entry.error or f"{entry.source} was not made a checkpoint by the sweep's door."
            )
        if checkpoint.kind == "directory":
            _ = checkpoint.files  # read at the door's comparison already, unless the door could not read it
        lap("resolve")
        phase = "hash"
        if not checkpoint.local or checkpoint.known_digest() is not None:
            prepared.identity = checkpoint.fingerprint  # proven by the stamp: no byte read
            if reuse is not None:
                reuse(prepared)
        lap("hash")
        if prepared.reused is not None:
            return prepared
        phase = "load"
        # built on the CPU in the dtype the auditor's device gets (bf16 by default on a GPU), then moved as is
        torch_dtype = resolve_dtype(dtype, device)
        if spare is not None:
            refilled, spare = refill_model(spare, checkpoint, torch_dtype), None
            if refilled is None:
                gc.collect()  # the spare (another model's shape) leaves before this one is built
            prepared.model = refilled
        if prepared.model is None:
            prepared.model = build_model(checkpoint, dtype=torch_dtype, device="cpu", ahead=True)
        record = loaded_record(prepared.model)
        prepared.bytes_read = record.nbytes if record is not None else 0
        loaded = checkpoint.loaded_fingerprint(prepared.model)
        lap("load")
        if loaded != prepared.identity:
            if prepared.identity is not None:
                logger.warning(
                    "%s (%s) changed between its reuse decision and its load: decided again on the bytes loaded.",
                    entry.name,
                    entry.source,
                )
            prepared.identity = loaded
            if reuse is not None:
                reuse(prepared)
                if prepared.reused is not None:
                    prepared.release()
    except Exception as error:  # this model's failed row; the sweep goes on
        lap(phase)
        logger.warning("%s (%s) failed while %s: %s", entry.name, entry.source, _DOING[phase], error)
        prepared.release()
        prepared.error = f"{type(error).__name__} while {_DOING[phase]} {entry.source}: {error}"
    return prepared


_DOING = {"resolve": "resolving", "hash": "reading", "load": "loading"}


def move_to_device(model: torch.nn.Module, device: str) -> None:
    """Move a model built on the CPU to ``device``; an out-of-memory while moving (the previous model not yet
    collected) frees memory and tries again (``memory.retry_out_of_memory``)."""
    target = torch.device(device)
    if all(p.device == target for p in model.parameters()):
        return
    if target.type == "cuda":
        gc.collect()  # the model scored before this one, if a reference cycle still holds it, leaves the GPU first

    def move() -> None:
        torch.nn.Module.to(model, device=target)
        config = getattr(model, "cfg", None)  # a TransformerLens model records its device there
        if config is not None:
            config.device = device

    retry_out_of_memory(move, target, f"moving {getattr(model, 'uds_source', 'a staged model')} to {device}")


class StagingPipeline:
    """Prepares a sweep's models one ahead on a background thread: while model k computes, k+1 is staged.

    Bounded: when model k is handed out, model k-1 has been released and only k+1 is being staged, so at most one
    model is in memory besides the one computing (``peak`` counts them: 2 with ``ahead``, 1 without). ``prepare``
    should not raise (a model's error belongs in its result); if it does, the error is handed out in its place.

    ``meanwhile``, where given, runs on the consumer's thread while the first model is staged (the worker's own
    preparation, `SweepWorker.warm`), before the first is handed out.

    Examples:
        >>> for entry, prepared, waited in StagingPipeline(worker.prepare, entries, release=Prepared.release):
        ...     outcome = worker.finish(prepared)
    """

    def __init__(
        self,
        prepare: Callable[[Any], Any],
        items: Sequence[Any],
        release: Callable[[Any], None],
        ahead: bool = True,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        self.prepare, self.items, self.release, self.ahead = prepare, list(items), release, ahead
        self.meanwhile = meanwhile
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def _prepare(self, item: Any) -> Any:
        with self._lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
        try:
            return self.prepare(item)
        except Exception as error:  # handed to the consumer, in the model's place
            return error

    def _release(self, prepared: Any) -> None:
        if not isinstance(prepared, Exception):
            self.release(prepared)
        with self._lock:
            self.live -= 1

    def __iter__(self) -> Iterator[tuple[Any, Any, float]]:
        """``(item, prepared, seconds waited for it)`` in order; each is released when the consumer asks for the
        next one."""
        if not self.items:
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uds-sweep-stage")
        try:
            pending: Future | None = pool.submit(self._prepare, self.items[0]) if self.ahead else None
            if self.meanwhile is not None:
                self.meanwhile()
            for number, item in enumerate(self.items):
                started = time.perf_counter()
                prepared = pending.result() if pending is not None else self._prepare(item)
                waited = time.perf_counter() - started
                following = number + 1 < len(self.items)
                pending = (
                    pool.submit(self._prepare, self.items[number + 1]) if self.ahead and following else None
                )
                try:
                    yield item, prepared, waited
                finally:
                    self._release(prepared)
        finally:
            # a consumer that stopped early: let the model being staged finish, then drop it
            pool.shutdown(wait=True, cancel_futures=True)
            if pending is not None and pending.done() and not pending.cancelled():
                self._release(pending.result())

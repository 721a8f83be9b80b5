"""A sweep worker: the work of one model, the same in-process and on a Ray actor."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.loader import release_model, vacant_copy
from uds_lens.config import UDSConfig
from uds_lens.data import Example
from uds_lens.inputs import RunInputs
from uds_lens.results import UDSResult
from uds_lens.scoring import LazyRun
from uds_lens.stage_cache import StageOne
from uds_lens.sweep.lists import SweepError, SweepModel
from uds_lens.sweep.staging import Prepared, move_to_device, prepare_model

logger = logging.getLogger(__name__)


@dataclass
class ShippedStage:
    """What every worker needs besides the full model: Stage 1, the batches it was computed in, the examples and
    the fingerprints. Small (tensors of shape example x layer), so it travels through Ray's object store."""

    full_source: str
    retain_name: str | None
    data_name: str
    config: UDSConfig
    examples: list[Example]
    stage1: StageOne
    batches: list[list[int]]
    payload: dict[str, Any]
    inputs_fingerprint: dict[str, Any]

    @classmethod
    def of(cls, auditor: UDSAuditor) -> ShippedStage:
        return cls(
            full_source=auditor.full_name,
            retain_name=auditor.retain_name,
            data_name=auditor.data_name,
            config=auditor.config,
            examples=list(auditor.examples),
            stage1=auditor.stage1,
            batches=auditor.batches,
            payload=auditor.fingerprint_payload(),
            inputs_fingerprint=auditor.fingerprint(None),
        )

    def fingerprint(self, identity: str | None) -> dict[str, Any]:
        """The result fingerprint a worker records for an unlearned model of this ``identity``
        (``UDSAuditor.fingerprint``): the driver's reuse key ("" for a model that names no checkpoint)."""
        return {**self.inputs_fingerprint, "unlearned": identity if identity is not None else ""}


@dataclass
class ModelOutcome:
    """What scoring one model on a worker gave: a result (``scored``), a saved result reused (``reused``, decided
    while staging it in-process) or an error (``failed``).

    ``phases`` holds the seconds of each phase the model went through (keys of `PHASES`), ``load_seconds``
    and ``seconds`` are the load phase and the model's wall time on the worker, ``wait_seconds`` the part of it the
    worker waited for the model to be staged.
    """

    name: str
    status: str
    result: UDSResult | None = None
    load_seconds: float = math.nan
    seconds: float = math.nan
    worker: str = ""
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    wait_seconds: float = 0.0
    threads: int = 0
    bytes_read: int = 0
    reason: str = ""
    fingerprint: dict[str, Any] | None = None


def _worker_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def score_one(
    auditor: UDSAuditor, model: SweepModel, spare: Any = None, keep: Callable[[Any], None] | None = None
) -> ModelOutcome:
    """Score one unlearned model with ``auditor`` (its result records the inputs' fingerprint).

    Any error (a path that does not load, a model of another architecture, non-finite scores) becomes a ``failed``
    outcome naming it: one bad checkpoint must not end a sweep of a hundred. The checkpoint is read once: its bytes
    are hashed as they are read and the model is built from them (see `Prepared`), or read into ``spare`` (see
    `prepare_model`); ``keep`` takes the model once scored (see `finish_model`).
    """
    prepared = prepare_model(model, auditor.config.dtype, auditor.device, spare=spare)
    try:
        return finish_model(auditor, prepared, keep)
    finally:
        prepared.release()


def available_cpus() -> int:
    """CPU cores this process may run on (its affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` for the duration (None: unchanged), restored afterwards."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def finish_model(
    auditor: UDSAuditor, prepared: Prepared, keep: Callable[[Any], None] | None = None
) -> ModelOutcome:
    """Move a prepared model to the auditor's device and score it (Stage 2); never raises.

    The model reaches the auditor through ``auditor.sources`` under its `Checkpoint`, so ``auditor.score`` neither
    reads nor hashes it again (its fingerprint is the digest its one read computed), and it is dropped from there
    once scored: the worker keeps no model but the one it scores and the one being staged. ``keep``, where given,
    takes the model scored instead of its release (`SweepWorker`: the next model is read into it).
    """
    entry = prepared.entry
    phases = dict(prepared.phases)
    common: dict[str, Any] = {
        "worker": _worker_label(),
        "threads": torch.get_num_threads(),
        "bytes_read": prepared.bytes_read,
        "reason": prepared.reason,
        "fingerprint": prepared.fingerprint,
    }
    if prepared.reused is not None:
        return ModelOutcome(entry.name, "reused", prepared.reused, 0.0, phases=phases, **common)
    load_seconds = phases.get("load", 0.0)
    if prepared.error:
        return ModelOutcome(
            entry.name, "failed", None, load_seconds, error=prepared.error, phases=phases, **common
        )
    started = time.perf_counter()
    result: UDSResult | None = None
    try:
        move_to_device(prepared.model, auditor.device)
        phases["to_device"] = time.perf_counter() - started
        assert entry.checkpoint is not None  # prepared without an error: its checkpoint was made at the door
        auditor.sources[entry.checkpoint] = prepared.model
        prepared.model = None
        result = auditor.score(entry.checkpoint, name=entry.name)
    except Exception as error:  # reported per model in sweep.csv; the sweep goes on
        logger.warning("%s (%s) failed: %s", entry.name, entry.source, error)
        return ModelOutcome(
            entry.name,
            "failed",
            None,
            load_seconds,
            error=f"{type(error).__name__} while scoring {entry.source}: {error}",
            phases=phases,
            **common,
        )
    finally:
        scored = auditor.sources.pop(entry.checkpoint, None) if entry.checkpoint is not None else None
        auditor.last_source = None
        if scored is not None and keep is not None and result is not None:  # a model that failed is not kept
            keep(scored)
        elif scored is not None:  # its memory goes with the last reference, before the next model moves in
            release_model(scored)
    assert result is not None  # a failure returned above
    timings = result.meta["timings"]
    phases["s2"] = timings["s2_seconds"]
    phases["source_forward"] = timings.get("s2_source_forward_seconds", math.nan)
    seconds = sum(prepared.phases.values()) + time.perf_counter() - started
    return ModelOutcome(entry.name, "scored", result, load_seconds, seconds, phases=phases, **common)


@dataclass
class WorkerPlan:
    """What a worker is built from: the run's inputs (full and retain as checkpoints, the examples read once by the
    driver, the settings, the S1 cache directory; compared at the driver's door) and the torch threads (CPU
    workers)."""

    inputs: RunInputs
    threads: int | None = None


def _restarted_actor() -> bool:
    """Whether this process is a Ray actor that Ray restarted after it died."""
    try:
        import ray
    except ImportError:
        return False
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:  # a driver, not an actor
        return False
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


class SweepWorker:
    """A sweep worker (a Ray actor, or the one worker of an in-process sweep): the full model, the encoded forget set
    and Stage 1.

    The first worker computes Stage 1 (``compute_stage=True``: it loads retain for that, uses the S1 cache, then drops
    retain); the driver ships that `ShippedStage` to every worker through the object store (``adopt``), so
    each one scores with the same Stage 1 and the same batches. ``adopt`` checks that the worker sees the same full
    model and the same token layout as the worker that computed Stage 1 (a node with other checkpoint files or another
    tokenizer version would give silently different numbers). Every worker's auditor is built naming the plan's
    retain model and data (``UDSAuditor(..., retain_name=, data_name=)``), so its results name them although only
    the first worker loads retain, and it releases retain itself (``drop_retain``) once Stage 1 is computed.

    ``spares`` is how many unlearned models it may hold at once (2 where one is staged while another computes): on
    the CPU each model is read into a spare bridge (`stock`, `prepare`), never built.
    """

    def __init__(self, plan: WorkerPlan, compute_stage: bool = True, spares: int = 1) -> None:
        if plan.threads:
            torch.set_num_threads(plan.threads)
        # A restarted first worker does not recompute Stage 1: the driver hands it the shipped one again.
        compute_stage = compute_stage and not _restarted_actor()
        inputs = plan.inputs
        retain = inputs.retain
        if compute_stage:
            # full only where the S1 cache's index holds these inputs' Stage 1 (`scoring.LazyRun`), else full and
            # retain, Stage 1 from the cache or computed
            self.auditor = LazyRun(inputs, progress=False).auditor()
        else:  # Stage 1 arrives from the first worker: no retain to load, no cache to read
            inputs = dataclasses.replace(inputs, retain=None, cache_dir=False)
            # every worker's results name the plan's retain model and data file, whether it loaded retain or not
            self.auditor = UDSAuditor.from_inputs(
                inputs, progress=False, retain_name=retain.label if retain is not None else None
            )
        self.shipped: ShippedStage | None = None
        # bridges on the CPU that nothing uses, which the next models are read into (`loader.refill_model`): the
        # bridge TransformerLens builds costs several times the read of a SmolLM2-size model. Vacant copies of full
        # (`stock`), then each model once scored; at most ``spares``, one per model in memory at once.
        self._spares: list[Any] = []
        self._spare_room = spares
        self._spare_lock = threading.Lock()
        if compute_stage:
            self.shipped = ShippedStage.of(self.auditor)
            self.auditor.drop_retain()  # Stage 1 is all a sweep needs the retain model for

    def stage(self) -> ShippedStage:
        """The Stage 1 this worker computed, to ship to the others."""
        if self.shipped is None:
            raise SweepError("This sweep worker was not asked to compute Stage 1.")
        return self.shipped

    def adopt(self, shipped: ShippedStage) -> str:
        """Score with ``shipped`` (Stage 1, its batches, the names); returns ``host:pid``."""
        here = self.auditor.fingerprint_payload()
        for key in ("full", "tokenizer", "layout", "dtype"):
            if here[key] != shipped.payload[key]:
                raise SweepError(
                    f"Worker {_worker_label()} sees a different {key} for the full model {shipped.full_source} "
                    f"({here[key]} vs {shipped.payload[key]} where Stage 1 was computed): give every worker the same "
                    "checkpoint files and package versions, and an explicit --dtype/--device."
                )
        names = (self.auditor.retain_name, self.auditor.data_name)
        if names != (shipped.retain_name, shipped.data_name):
            raise SweepError(
                f"Worker {_worker_label()} was built for retain and data {names}, but the Stage 1 handed to it "
                f"names {(shipped.retain_name, shipped.data_name)}: it belongs to another sweep."
            )
        self.auditor.use_stage1(shipped.stage1, shipped.batches, shipped.inputs_fingerprint)
        self.shipped = shipped
        return _worker_label()

    def prepare(self, model: SweepModel, reuse: Callable[[Prepared], None] | None = None) -> Prepared:
        """Stage one model for this worker (`prepare_model`, into the spare model where there is one); safe to run
        on another thread while it scores."""
        return prepare_model(model, self.auditor.config.dtype, self.auditor.device, reuse, self._take_spare())

    def finish(self, prepared: Prepared) -> ModelOutcome:
        """Score a prepared model (`finish_model`); the model scored becomes a spare a later one is read into,
        where it stays on the CPU (on a GPU it is released, as the device holds one unlearned model at a time)."""
        if self.shipped is None:
            raise SweepError("This sweep worker has no Stage 1 yet: the driver must call adopt() first.")
        return finish_model(self.auditor, prepared, keep=self._keep)

    def _keep(self, model: Any) -> None:
        with self._spare_lock:
            if len(self._spares) < self._spare_room and all(
                p.device.type == "cpu" for p in model.parameters()
            ):
                self._spares.append(model)
                return
        release_model(model)

    def _take_spare(self) -> Any:
        with self._spare_lock:
            return self._spares.pop() if self._spares else None

    def stock(self) -> None:
        """Fill the spares with vacant copies of full (`loader.vacant_copy`: its modules copied, not its weights),
        for the models to be read into instead of each building a bridge. Only on the CPU (on a GPU each model is
        built, see `_keep`) and only while nothing runs full (the copy takes its modules as they are)."""
        if torch.device(self.auditor.device).type != "cpu":
            return
        while len(self._spares) < self._spare_room:
            vacant = vacant_copy(self.auditor.full)
            if vacant is None:  # not a bridge of a safetensors directory: each model is built
                return
            with self._spare_lock:
                self._spares.append(vacant)

    def drop_spare(self) -> None:
        """Release the spare models (the sweep is over)."""
        while (spare := self._take_spare()) is not None:
            release_model(spare)

    def warm(self) -> None:
        """Make full's clean runs of the batches, as many as the plan keeps (`StageRuns.make_clean_runs`), which
        the first model's Stage 2 would make otherwise (a Stage 1 read from the cache made none): the in-process
        sweep calls it while its first model is staged. The same runs: no number changes."""
        self.auditor.runs.make_clean_runs()

    def score(self, model: SweepModel) -> ModelOutcome:
        """Score one unlearned model (`score_one`, read into a spare model: the one scored before, else a vacant
        copy of full)."""
        if self.shipped is None:
            raise SweepError("This sweep worker has no Stage 1 yet: the driver must call adopt() first.")
        self.stock()  # nothing runs full between two models
        return score_one(self.auditor, model, self._take_spare(), self._keep)

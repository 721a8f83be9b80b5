"""Sweeps: score many unlearned models against one (full, retain, forget set), on Ray or in-process, resumable.

The paper's job is a sweep: ~150 unlearned checkpoints, one full/retain pair, one forget set. Stage 1 (``s0``,
the per-layer baselines and ``d1``, see ``uds.py``) depends only on (full, retain, data, settings), so it is computed
once; every unlearned model then costs one source forward and the patched runs of Stage 2. A sweep spreads the
Stage-2 work over workers:

* **Ray** (the ``[sweep]`` extra): one actor per GPU (``gpus_per_worker``) or per CPU slot loads the full model and
  encodes the forget set; the first one also computes Stage 1 (on a worker's device and dtype, exactly as the others
  will score), and the driver ships it to every actor through Ray's object store. Each actor then takes unlearned
  models one at a time. No shared filesystem is needed: the examples travel from the driver, each actor returns its
  ``UDSResult`` through the object store and the driver writes the files. Model paths must be readable where the
  actors run (hub ids always are).
* **In-process** (``workers=1``, or Ray not installed): one such worker in this process, on every core by default,
  paced by compute: while model k computes, model k+1 is resolved, read and hashed in one pass over its bytes
  (``checkpoint.stage``; pinned memory on a GPU) and built on the CPU on a staging thread, at most one model ahead;
  the reuse decision is made there from that digest, and a model that cannot be staged becomes its ``failed`` row.
  On Ray each actor reads and hashes its model in one pass too (the driver hashes it once more for the reuse
  decision, before any actor starts), with no staging ahead.

Both paths write the same files under ``out``:

* ``NAME/`` per model (``summary.json``, ``examples.csv``, ``layers.csv``, ``uds_eval.json``, ``meta.json``), written
  to a temporary directory and renamed into place, so a killed sweep never leaves a half-written result;
* ``sweep.csv``: one row per model, rewritten after every model: ``status`` (``scored`` | ``reused`` | ``failed`` |
  ``pending``), UDS and its 95% CI, the example counts, the seconds of each phase (``PHASES``: resolve, hash, load,
  to_device, source_forward, s2, write), the wait for staging and the model's wall time, ``finished_at`` in Unix
  seconds, the worker and its threads, the fingerprints and the error;
* ``sweep_eval.json``: ``{NAME: {"uds": {"agg_value", "value_by_index"}}}``, the open-unlearning shape per model;
* with ``compare_published``: ``published_uds`` and ``uds_minus_published`` columns and ``published_scatter.html``.

Resume rule (never stale), decided on the driver before any worker loads a model: a finished model is reused only
when the fingerprint saved with its intact result (``fingerprints.result_fingerprint``: full, retain and unlearned
weights by file contents, the data records, tokenizer, settings, and the digest of the Stage 1 values) equals this
run's (``results.check_saved``). A saved result of other inputs is another run's: the sweep refuses it before any model
is loaded (``force`` replaces it, and recomputes always); one that is damaged or used other Stage 1 values is
recomputed with a warning saying why. Model names may not be the sweep's own files (``SWEEP_FILES``). tau is applied
after everything, so a new tau reuses.
A worker that dies (killed, out of memory) has its model retried on another actor, at most ``max_retries`` times; a
model that keeps failing, or fails to load, is reported in ``sweep.csv`` with its error and the sweep goes on.
Numbers do not depend on the number of workers or their order: every worker scores with the batches and the Stage 1
of the one auditor that computed Stage 1, exactly as ``uds-lens score`` would.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from uds_lens import checkpoint, models
from uds_lens.auditor import (
    StageOne,
    UDSAuditor,
    UDSConfig,
    refuse_other_runs,
    result_names,
    source_fingerprint,
)
from uds_lens.data import Example, load_examples
from uds_lens.plotting import published_scatter
from uds_lens.results import (
    OutputConflictError,
    SavedCheck,
    UDSResult,
    check_result_name,
    check_saved,
    conflict_error,
)

logger = logging.getLogger(__name__)

SWEEP_TABLE = "sweep.csv"
SWEEP_JSON = "sweep_eval.json"
SCATTER_HTML = "published_scatter.html"
# What a sweep writes next to the NAME/ directories (and `uds-lens report` adds): no model may be named like them.
SWEEP_FILES = (SWEEP_TABLE, SWEEP_JSON, SCATTER_HTML, "report.html", "roles.json")
REGISTRIES = {"tofu-llama-3.2-1b": "tofu_llama32_1b_registry.csv"}
# Registry rows that are the sweep's own references, not unlearned models: left out unless asked for by method.
ANCHOR_METHODS = ("full", "retain")
# A model's phases, in order: resolve its path, read and hash its bytes (one pass, kept in memory), build the model
# from them, move it to the device, Stage 2 (s2; source_forward is the part of it in the model's own forward), write
# its result and the table. Each is a column ``{phase}_seconds``.
PHASES = ("resolve", "hash", "load", "to_device", "source_forward", "s2", "write")
PHASE_COLUMNS = [f"{phase}_seconds" for phase in PHASES]
# sweep.csv, one row per model: status is scored | reused | failed | pending; uds, ci_low/ci_high (bootstrap 95%) and
# the example counts come from the model's summary; the phase columns (PHASES) time the model's work, wherever it ran
# (in-process, resolve/hash/load run on the staging thread while the previous model computes); wait_seconds is how
# long the worker then still waited for them, and seconds the model's wall time on the worker's critical path
# (wait + to_device + s2 + write and the small rest: the result's assembly); with nothing prefetched, seconds is
# about the sum of the phases (source_forward counted once, inside s2). s1_seconds is the shared Stage 1 (0 from the
# cache), threads the worker's torch threads, bytes_read what the hash phase read; finished_at is Unix time; fp_* are
# its fingerprints (see fingerprint_columns); a registry adds method/epoch and published_* columns.
COLUMNS = [
    "name",
    "source",
    "method",
    "epoch",
    "status",
    "uds",
    "ci_low",
    "ci_high",
    "n_scored",
    "n_no_ke",
    "n_skipped",
    "attempts",
    *PHASE_COLUMNS,
    "wait_seconds",
    "seconds",
    "s1_seconds",
    "threads",
    "bytes_read",
    "finished_at",
    "worker",
    "fp_full",
    "fp_retain",
    "fp_data",
    "fp_settings",
    "fp_unlearned",
    "error",
]


class SweepError(RuntimeError):
    """A sweep cannot run as asked (bad model list, unknown registry, Ray unavailable, workers that cannot start)."""


# ----------------------------------------------------------------------------------------------------------------
# What to sweep


@dataclass(frozen=True)
class SweepModel:
    """One unlearned model of a sweep.

    Attributes:
        name: result name, one path component (``OUT/NAME/``).
        source: local checkpoint directory or hub id.
        method / epoch: from a registry (the unlearning method and its epoch), else None.
        published: the registry's published figures (``published_uds``, ``published_logit_lens``, ...), if any.
    """

    name: str
    source: str
    method: str | None = None
    epoch: str | None = None
    published: Mapping[str, float] = field(default_factory=dict)


def _check_names(entries: Sequence[SweepModel]) -> list[SweepModel]:
    names = [entry.name for entry in entries]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise SweepError(
            f"Two models share the result name(s) {repeated}: give each row a unique name "
            "(`name,path_or_id` rows in the model list)."
        )
    for name in names:
        try:
            check_result_name(name)
        except ValueError as error:
            raise SweepError(str(error)) from None
    own = sorted(name for name in names if name.casefold() in {file.casefold() for file in SWEEP_FILES})
    if own:
        raise SweepError(
            f"The result name(s) {own} are the sweep's own files in the output directory ({', '.join(SWEEP_FILES)}): "
            "rename those models (`name,path_or_id` rows in the model list)."
        )
    if not entries:
        raise SweepError("The sweep has no models: the model list or the registry filter selected none.")
    return list(entries)


def read_model_list(path: str | os.PathLike) -> list[SweepModel]:
    """Models from a file: ``name,path_or_id`` CSV rows (a header row is optional) or one path / hub id per line.

    Blank lines and lines starting with ``#`` are ignored; a bare path is named like ``uds-lens score`` names it
    (a directory's basename, a hub id with ``/`` replaced by ``__``).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"Model list {file} not found: give a file of `name,path_or_id` rows or one path per line."
        )
    rows: list[tuple[str | None, str]] = []
    lines = [line.strip() for line in file.read_text().splitlines()]
    for number, row in enumerate(csv.reader(line for line in lines if line and not line.startswith("#")), 1):
        cells = [cell.strip() for cell in row]
        if len(cells) == 1:
            rows.append((None, cells[0]))
        elif len(cells) == 2:
            if number == 1 and cells[0].lower() == "name":
                continue
            rows.append((cells[0], cells[1]))
        else:
            raise SweepError(
                f"{file}, row {number}: expected `name,path_or_id` or one path, got {len(cells)} cells."
            )
    named = _names_of([source for name, source in rows if name is None])
    return _check_names(
        [SweepModel(name if name is not None else named[source], source) for name, source in rows]
    )


def _names_of(sources: Sequence[str]) -> dict[str, str]:
    """Result names of bare paths, as ``uds-lens score`` gives them (basenames; parents added where two clash)."""
    try:
        return {str(source): name for name, source in result_names(list(sources)).items()}
    except ValueError as error:
        raise SweepError(str(error)) from None


def registry_path(registry: str | os.PathLike) -> Path:
    """The CSV of a registry shipped with the package (``tofu-llama-3.2-1b``), or a registry CSV of your own."""
    if str(registry) in REGISTRIES:
        return Path(str(resources.files("uds_lens") / "registries" / REGISTRIES[str(registry)]))
    path = Path(registry).expanduser()
    if path.is_file():
        return path
    raise SweepError(
        f"Unknown registry {str(registry)!r}: use one of {sorted(REGISTRIES)} or a CSV file with the "
        "columns alias,hub_id,method,epoch (and optional published_* columns)."
    )


def load_registry(
    registry: str | os.PathLike, methods: Sequence[str] | None = None, published_only: bool = False
) -> list[SweepModel]:
    """The unlearned models of a registry (``alias, hub_id, method, epoch, published_*`` rows).

    Args:
        registry: ``tofu-llama-3.2-1b`` (the open-unlearning TOFU checkpoints the paper scored) or a CSV path.
        methods: keep only these methods (``["npo", "rmu"]``); the ``full`` and ``retain`` reference rows are
            kept only when named here.
        published_only: keep only models with a published UDS (the 150 the paper reports).
    """
    table = pd.read_csv(registry_path(registry), dtype={"epoch": str})
    missing = [column for column in ("alias", "hub_id", "method") if column not in table]
    if missing:
        raise SweepError(f"Registry {registry} lacks the column(s) {missing}.")
    known = sorted(table["method"].dropna().unique())
    if methods:
        wanted = [method.strip().lower() for method in methods if method.strip()]
        unknown = sorted(set(wanted) - set(known))
        if unknown:
            raise SweepError(f"Registry {registry} has no method {unknown}; it has {known}.")
        table = table[table["method"].isin(wanted)]
    else:
        table = table[~table["method"].isin(ANCHOR_METHODS)]
    published = [column for column in table.columns if column.startswith("published_")]
    if published_only:
        table = table[table["published_uds"].notna()] if "published_uds" in table else table.iloc[:0]
    entries = []
    for row in table.itertuples(index=False):
        values = row._asdict()
        figures = {column: float(values[column]) for column in published if pd.notna(values[column])}
        epoch = values.get("epoch")
        entries.append(
            SweepModel(
                str(values["alias"]),
                str(values["hub_id"]),
                str(values["method"]),
                None if pd.isna(epoch) else str(epoch),
                figures,
            )
        )
    return _check_names(entries)


def resolve_models(
    models_arg: Any = None, registry: str | os.PathLike | None = None, methods: Sequence[str] | None = None
) -> list[SweepModel]:
    """The sweep's models from exactly one of: a model-list file, a list/dict of models, or a registry."""
    if (models_arg is None) == (registry is None):
        raise SweepError(
            "Give the models to sweep either as a model list (--models FILE) or a registry "
            "(--registry NAME), not both and not neither."
        )
    if registry is not None:
        return load_registry(registry, methods)
    if methods:
        raise SweepError("--methods filters a registry; with --models, list only the models you want.")
    if isinstance(models_arg, (str, os.PathLike)):
        return read_model_list(models_arg)
    if isinstance(models_arg, Mapping):
        return _check_names([SweepModel(str(name), str(source)) for name, source in models_arg.items()])
    named = _names_of([str(item) for item in models_arg if not isinstance(item, SweepModel)])
    return _check_names(
        [
            item if isinstance(item, SweepModel) else SweepModel(named[str(item)], str(item))
            for item in models_arg
        ]
    )


# ----------------------------------------------------------------------------------------------------------------
# Fingerprints and result directories


def _short_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def fingerprint_columns(fingerprint: Mapping[str, Any]) -> dict[str, str]:
    """``sweep.csv``'s fingerprint columns from a result fingerprint (``fingerprints.result_fingerprint``): full,
    retain and unlearned weights, the data (records as scored), the settings (with the tokenizer; tau is not part of them)."""
    return {
        "fp_full": str(fingerprint.get("full")),
        "fp_retain": str(fingerprint.get("retain")),
        "fp_data": str(fingerprint.get("data")),
        "fp_settings": _short_digest(
            [fingerprint.get("settings"), fingerprint.get("tokenizer"), fingerprint.get("format")]
        ),
        "fp_unlearned": str(fingerprint.get("unlearned")),
    }


# ----------------------------------------------------------------------------------------------------------------
# The work of one model, the same in-process and on an actor


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

    def fingerprint(self, unlearned: str) -> dict[str, Any]:
        """The result fingerprint a worker will record for ``unlearned`` (``UDSAuditor.fingerprint``), computed
        here from its files without loading it: the driver's reuse key."""
        return {**self.inputs_fingerprint, "unlearned": source_fingerprint(unlearned)}


@dataclass
class ModelOutcome:
    """What scoring one model on a worker gave: a result (``scored``), a saved result reused (``reused``, decided
    while staging it in-process) or an error (``failed``).

    ``phases`` holds the seconds of each phase the model went through (keys of :data:`PHASES`), ``load_seconds``
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


def score_one(auditor: UDSAuditor, model: SweepModel) -> ModelOutcome:
    """Score one unlearned model with ``auditor`` (its result records the inputs' fingerprint).

    Any error (a path that does not load, a model of another architecture, non-finite scores) becomes a ``failed``
    outcome naming it: one bad checkpoint must not end a sweep of a hundred. The checkpoint is read once: its bytes
    are hashed as they are read and the model is built from them (see :class:`Prepared`).
    """
    prepared = prepare_model(model, auditor.config.dtype, auditor.device)
    try:
        return finish_model(auditor, prepared)
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


@dataclass
class Prepared:
    """A model made ready to score before its turn: resolved, read and hashed in one pass, built on the CPU.

    Attributes:
        entry: the sweep model.
        phases: seconds of ``resolve``, ``hash`` and ``load`` (those that ran).
        staged: the checkpoint's bytes and digest (``checkpoint.Staged``; None for a hub id or after an error).
        model: the model built from them, on the CPU (pinned when it goes to a GPU), or None.
        error: why it could not be prepared (the model's ``failed`` row), or "".
        reused / reason: a saved result that is current (the model is not loaded then), and why (not).
        fingerprint: the result fingerprint this model's result will carry (known once it is hashed).
    """

    entry: SweepModel
    phases: dict[str, float] = field(default_factory=dict)
    staged: checkpoint.Staged | None = None
    model: Any = None
    error: str = ""
    reused: UDSResult | None = None
    reason: str = ""
    fingerprint: dict[str, Any] | None = None

    @property
    def bytes_read(self) -> int:
        return self.staged.nbytes if self.staged is not None else 0

    def release(self) -> None:
        """Drop the staged bytes and the model (the sweep holds at most one prepared model besides the current)."""
        if self.staged is not None:
            self.staged.release()
        self.model = None


def prepare_model(
    entry: SweepModel,
    dtype: str | torch.dtype | None,
    device: str,
    reuse: Callable[[Prepared], None] | None = None,
) -> Prepared:
    """Resolve, read+hash (one pass over the bytes, kept in memory) and load one model on the CPU; never raises.

    Args:
        entry: the model.
        dtype / device: what the auditor scores in. The model is built on the CPU in ``dtype`` (its parameters are
            views of the read bytes when the dtype matches); for a GPU the bytes are read into pinned memory and the
            built model is pinned, so moving it (:func:`finish_model`) is a direct copy.
        reuse: called once the model is hashed, before it is loaded; it may set ``reused`` (and then the model is
            not loaded at all) and ``reason`` on the :class:`Prepared` it is given.

    Returns:
        The :class:`Prepared` model; an error (a missing path, a truncated file, a model that does not load) is
        kept in its ``error``, to become the model's ``failed`` row.
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
        source = models.resolve_source(entry.source)
        lap("resolve")
        phase = "hash"
        on_gpu = torch.device(device).type == "cuda"
        if source.local:
            # the path the fingerprint names (a zoo name resolved), read once; its digest is memoised for it
            prepared.staged = checkpoint.stage(models.resolve_zoo_name(entry.source), pin_memory=on_gpu)
        lap("hash")
        if reuse is not None:
            reuse(prepared)
            if prepared.reused is not None:
                prepared.release()
                return prepared
        phase = "load"
        staged = prepared.staged
        tensors = staged.tensors() if staged is not None and staged.has_weights else None
        # built on the CPU in the dtype the auditor's device gets (bf16 by default on a GPU), then moved as is
        target_dtype = models.resolve_dtype(dtype, device)
        model = models.load_model(entry.source, dtype=target_dtype, device="cpu", tensors=tensors)
        if on_gpu:
            _pin(model)
        if staged is not None:
            staged.buffers = {}  # the model now holds what it needs of them (views, or converted copies)
        prepared.model = model
        lap("load")
    except Exception as error:  # this model's failed row; the sweep goes on
        lap(phase)
        logger.warning("%s (%s) failed while %s: %s", entry.name, entry.source, _DOING[phase], error)
        prepared.release()
        prepared.error = f"{type(error).__name__} while {_DOING[phase]} {entry.source}: {error}"
    return prepared


_DOING = {"resolve": "resolving", "hash": "reading", "load": "loading"}


def _pin(model: torch.nn.Module) -> None:
    """Page-lock every CPU tensor of ``model`` that is not already (views of pinned staged bytes are)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor.data = tensor.data.pin_memory()


def _to_device(model: Any, device: str) -> None:
    """Move a model built on the CPU to ``device`` (from pinned memory: asynchronous, then waited for)."""
    target = torch.device(device)
    if all(p.device == target for p in model.parameters()):
        return
    torch.nn.Module.to(model, device=target, non_blocking=True)
    if getattr(model, "cfg", None) is not None:
        model.cfg.device = device
    if target.type == "cuda":
        torch.cuda.synchronize(target)


def finish_model(auditor: UDSAuditor, prepared: Prepared) -> ModelOutcome:
    """Move a prepared model to the auditor's device and score it (Stage 2); never raises.

    The model reaches the auditor through ``auditor.sources`` under its path, so ``auditor.score`` neither reads
    nor hashes it again (its fingerprint comes from the digest memoised while staging), and it is dropped from
    there once scored: the worker keeps no model but the one it scores and the one being staged.
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
    try:
        _to_device(prepared.model, auditor.device)
        phases["to_device"] = time.perf_counter() - started
        auditor.sources[str(entry.source)] = prepared.model
        prepared.model = None
        result = auditor.score(entry.source, name=entry.name)
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
        auditor.sources.pop(str(entry.source), None)
        auditor.last_source = None
    timings = result.meta["timings"]
    phases["s2"] = timings["s2_seconds"]
    phases["source_forward"] = timings.get("s2_source_forward_seconds", math.nan)
    seconds = sum(prepared.phases.values()) + time.perf_counter() - started
    return ModelOutcome(entry.name, "scored", result, load_seconds, seconds, phases=phases, **common)


@dataclass
class WorkerPlan:
    """What a worker is built from: the sources of full and retain, the examples (read once by the driver), the
    settings, the S1 cache directory and the torch threads (CPU workers)."""

    full: str
    retain: str | None
    examples: list[Example]
    data_name: str
    config: UDSConfig
    cache_dir: str | os.PathLike | bool | None = None
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
    retain); the driver ships that :class:`ShippedStage` to every worker through the object store (``adopt``), so
    each one scores with the same Stage 1 and the same batches. ``adopt`` checks that the worker sees the same full
    model and the same token layout as the worker that computed Stage 1 (a node with other checkpoint files or another
    tokenizer version would give silently different numbers).
    """

    def __init__(self, plan: WorkerPlan, compute_stage: bool = True) -> None:
        if plan.threads:
            torch.set_num_threads(plan.threads)
        # A restarted first worker does not recompute Stage 1: the driver hands it the shipped one again.
        compute_stage = compute_stage and not _restarted_actor()
        retain = plan.retain if compute_stage else None
        self.auditor = UDSAuditor(
            plan.full,
            retain,
            plan.examples,
            config=plan.config,
            cache_dir=plan.cache_dir if compute_stage else False,
            progress=False,
        )
        self.auditor.data_name = plan.data_name
        self.shipped: ShippedStage | None = None
        if compute_stage:
            self.shipped = ShippedStage.of(self.auditor)
            self.auditor.retain = None  # Stage 1 is all a sweep needs the retain model for

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
        self.auditor.use_stage1(shipped.stage1, shipped.batches, shipped.inputs_fingerprint)
        self.auditor.retain_name = shipped.retain_name
        self.auditor.data_name = shipped.data_name
        self.shipped = shipped
        return _worker_label()

    def prepare(self, model: SweepModel, reuse: Callable[[Prepared], None] | None = None) -> Prepared:
        """Stage one model for this worker (:func:`prepare_model`); safe to run on another thread while it scores."""
        return prepare_model(model, self.auditor.config.dtype, self.auditor.device, reuse)

    def finish(self, prepared: Prepared) -> ModelOutcome:
        """Score a prepared model (:func:`finish_model`)."""
        if self.shipped is None:
            raise SweepError("This sweep worker has no Stage 1 yet: the driver must call adopt() first.")
        return finish_model(self.auditor, prepared)

    def score(self, model: SweepModel) -> ModelOutcome:
        """Score one unlearned model (see :func:`score_one`)."""
        if self.shipped is None:
            raise SweepError("This sweep worker has no Stage 1 yet: the driver must call adopt() first.")
        return score_one(self.auditor, model)


class StagingPipeline:
    """Prepares a sweep's models one ahead on a background thread: while model k computes, k+1 is staged.

    Bounded: when model k is handed out, model k-1 has been released and only k+1 is being staged, so at most one
    model is in memory besides the one computing (``peak`` counts them: 2 with ``ahead``, 1 without). ``prepare``
    should not raise (a model's error belongs in its result); if it does, the error is handed out in its place.

    Example:
        >>> for entry, prepared, waited in StagingPipeline(worker.prepare, entries, release=Prepared.release):
        ...     outcome = worker.finish(prepared)
    """

    def __init__(
        self,
        prepare: Callable[[Any], Any],
        items: Sequence[Any],
        release: Callable[[Any], None],
        ahead: bool = True,
    ) -> None:
        self.prepare, self.items, self.release, self.ahead = prepare, list(items), release, ahead
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


# ----------------------------------------------------------------------------------------------------------------
# The driver


@dataclass
class _Ledger:
    """The driver's view of the sweep: one row per model, written to ``sweep.csv`` after every change, and the
    reuse decision (made here, from the models' files, before any worker loads anything)."""

    out: Path
    entries: list[SweepModel]
    shipped: ShippedStage
    tau: float
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    open_unlearning: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for entry in self.entries:
            self.rows[entry.name] = {
                "name": entry.name,
                "source": entry.source,
                "method": entry.method,
                "epoch": entry.epoch,
                "status": "pending",
                "attempts": 0,
                "error": "",
                "s1_seconds": self.shipped.stage1.seconds,
                **dict(entry.published),
            }

    def reusable(self, entry: SweepModel, force: bool) -> tuple[SavedCheck, dict[str, Any]]:
        """What ``entry``'s saved result is worth to this run (:func:`results.check_saved`: the result if it is
        current, why (not), and whether it is another run's), and this run's fingerprint of it (hashing the model's
        files, unless they were just hashed: the digest is memoised)."""
        fingerprint = self.shipped.fingerprint(entry.source)
        if force:
            return SavedCheck(None, "forced"), fingerprint
        return check_saved(self.out / entry.name, fingerprint), fingerprint

    def reuse(self, force: bool) -> list[SweepModel]:
        """Record every model whose saved result is current as ``reused``; returns the models left to score.

        Used where the driver cannot see the workers' reads (Ray): it hashes every model here first. The in-process
        sweep decides per model while staging it instead (:meth:`check_staged`), reading each checkpoint once.

        Raises:
            SweepError: without ``force``, a model's directory holds another run's result (other inputs); nothing
                is written then.
        """
        todo = []
        conflicts = {}
        for entry in self.entries:
            started = time.perf_counter()
            check, fingerprint = self.reusable(entry, force)
            previous, reason = check.result, check.reason
            self.rows[entry.name].update(fingerprint_columns(fingerprint))
            if check.conflicts:
                conflicts[str(self.out / entry.name)] = reason
            if previous is None:
                if (self.out / entry.name).exists():
                    logger.warning("recomputing %s: %s", entry.name, reason)
                todo.append(entry)
                continue
            self.record_reused(entry.name, previous, reason, {"hash": time.perf_counter() - started})
        if conflicts:
            raise SweepError(str(conflict_error(conflicts)))
        self.write()
        return todo

    def check_staged(self, prepared: Prepared, force: bool) -> None:
        """The in-process reuse decision for a model just read and hashed (runs on the staging thread).

        Raises:
            OutputConflictError: its directory holds another run's result (other inputs) and ``force`` is off;
                the model becomes a ``failed`` row naming what differs, and its directory is left as it is.
        """
        check, fingerprint = self.reusable(prepared.entry, force)
        prepared.fingerprint, prepared.reason = fingerprint, check.reason
        if check.conflicts:
            raise conflict_error({str(self.out / prepared.entry.name): check.reason})
        prepared.reused = None if check.result is None else check.result.with_tau(self.tau)

    def record_reused(
        self, name: str, result: UDSResult, reason: str, phases: Mapping[str, float], seconds: float = 0.0
    ) -> None:
        """A current saved result stands for the model: its row is filled from it, nothing is written."""
        logger.info("reusing %s: %s", name, reason)
        self._fill(name, result.with_tau(self.tau), s2_seconds=0.0)
        self.rows[name].update(fingerprint_columns(result.meta["fingerprint"]))
        self.rows[name].update({f"{phase}_seconds": value for phase, value in phases.items()})
        self.rows[name].update(status="reused", load_seconds=0.0, seconds=seconds, finished_at=time.time())

    def record(self, outcome: ModelOutcome, attempts: int, since: float | None = None) -> None:
        """Save a scored model's result (atomically, under its lock) and update its row, timing it as the model's
        ``write`` phase; with ``since`` (``perf_counter`` when the worker asked for the model), the row's
        ``seconds`` become the model's wall time through its result written."""
        started = time.perf_counter()
        row = self.rows[outcome.name]
        if outcome.status == "reused" and outcome.result is not None:
            self.record_reused(outcome.name, outcome.result, outcome.reason, outcome.phases)
            row.update(attempts=attempts, worker=outcome.worker, threads=outcome.threads)
            row.update(bytes_read=outcome.bytes_read)
            row.update(write_seconds=0.0, wait_seconds=outcome.wait_seconds)
            if since is not None:
                row["seconds"] = time.perf_counter() - since
            self.write()
            return
        row.update(
            status=outcome.status,
            attempts=attempts,
            worker=outcome.worker,
            error=outcome.error,
            load_seconds=outcome.load_seconds,
            seconds=outcome.seconds,
            wait_seconds=outcome.wait_seconds,
            threads=outcome.threads or math.nan,
            bytes_read=outcome.bytes_read,
            finished_at=time.time(),
        )
        row.update({f"{phase}_seconds": value for phase, value in outcome.phases.items()})
        if outcome.result is not None:
            outcome.result.save(self.out / outcome.name)
            row.update(fingerprint_columns(outcome.result.meta["fingerprint"]))
            self._fill(outcome.name, outcome.result, outcome.result.meta["timings"]["s2_seconds"])
        elif outcome.fingerprint is not None:  # failed after it was hashed
            row.update(fingerprint_columns(outcome.fingerprint))
        elif pd.isna(row.get("fp_data", math.nan)):
            # failed before it was hashed: the inputs' fingerprints still say what it was run against
            row.update(fingerprint_columns({**self.shipped.inputs_fingerprint, "unlearned": ""}))
        # timed up to the table's own write (milliseconds), which has to hold these figures
        row["write_seconds"] = time.perf_counter() - started
        if since is not None:
            row["seconds"] = time.perf_counter() - since
        self.write()

    def _fill(self, name: str, result: UDSResult, s2_seconds: float) -> None:
        summary = result.summary
        self.rows[name].update(
            uds=summary["uds"],
            ci_low=summary["ci95"][0],
            ci_high=summary["ci95"][1],
            n_scored=summary["n_scored"],
            n_no_ke=summary["n_no_ke"],
            n_skipped=summary["n_skipped"],
            s2_seconds=s2_seconds,
        )
        self.open_unlearning[name] = result.to_open_unlearning()

    def table(self) -> pd.DataFrame:
        frame = pd.DataFrame([self.rows[entry.name] for entry in self.entries])
        extra = [column for column in frame.columns if column not in COLUMNS]
        for column in COLUMNS:
            if column not in frame:
                frame[column] = math.nan
        for column in ("n_scored", "n_no_ke", "n_skipped", "attempts"):
            frame[column] = frame[column].astype("Int64")  # counts stay integers next to failed rows' blanks
        return frame[COLUMNS + extra]

    def write(self) -> None:
        _write_atomic(self.out / SWEEP_TABLE, self.table().to_csv(index=False))
        _write_atomic(
            self.out / SWEEP_JSON,
            json.dumps(
                {
                    entry.name: self.open_unlearning[entry.name]
                    for entry in self.entries
                    if entry.name in self.open_unlearning
                },
                indent=2,
            ),
        )


def _write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)


def ray_available() -> bool:
    """Whether Ray (the ``[sweep]`` extra) can be imported."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def sweep(
    full: str | os.PathLike,
    retain: str | os.PathLike | None,
    data: Any,
    out: str | os.PathLike,
    models_to_score: Any = None,
    registry: str | os.PathLike | None = None,
    methods: Sequence[str] | None = None,
    config: UDSConfig | None = None,
    workers: int | None = None,
    address: str | None = None,
    gpus_per_worker: float | None = None,
    cpus_per_worker: int | None = None,
    max_retries: int = 2,
    cache_dir: str | os.PathLike | bool | None = None,
    limit: int | None = None,
    force: bool = False,
    compare_published: bool = False,
    progress: bool = True,
    use_ray: bool | None = None,
    prefetch: bool = True,
) -> pd.DataFrame:
    """Score many unlearned models against one (full, retain, data); returns the combined table (``sweep.csv``).

    Example:
        >>> table = sweep("ckpt/full", "ckpt/retain", "forget.json", "sweep_out", registry="tofu-llama-3.2-1b",
        ...               methods=["npo", "rmu"], workers=8, gpus_per_worker=1)
        >>> table[["name", "status", "uds", "ci_low", "ci_high"]]

    Args:
        full / retain: the patch target and the Stage-1 source (paths or hub ids; retain None = retain-free mode).
        data: forget-set path, hub id or records (read here once and shipped to the workers).
        out: output directory: ``NAME/`` per model, ``sweep.csv``, ``sweep_eval.json``.
        models_to_score: a model-list file (``name,path_or_id`` CSV rows or one path per line), a list of paths or
            :class:`SweepModel`, or a ``{name: path}`` dict. Exactly one of this and ``registry``.
        registry / methods: a registry name (``tofu-llama-3.2-1b``) or CSV, optionally filtered by method.
        config: :class:`~uds_lens.auditor.UDSConfig` (the same settings as ``uds-lens score``).
        workers: Ray actors; 1 runs in-process; None = one per GPU (``gpus_per_worker``) or per CPU slot
            (``cpus_per_worker``) of the cluster, in-process when Ray is not installed.
        address: an existing Ray cluster (``auto`` or ``HOST:PORT``); None starts a local one (or joins the one this
            process already started).
        gpus_per_worker: GPUs per actor (default 1 when the cluster has GPUs, else 0).
        cpus_per_worker: CPU slots (and torch threads, on CPU) per Ray actor, 1 unless given; in-process, the torch
            threads of the one worker, by default every core this process may use (``available_cpus``), restored
            when the sweep returns.
        max_retries: times a model is resubmitted after its worker died before it is reported ``failed``.
        cache_dir / limit: as for ``uds-lens score`` (S1 cache directory; first N examples only).
        force: recompute every model even when its stored result is current.
        compare_published: add ``published_uds`` and ``uds_minus_published`` (registry models) and write
            ``published_scatter.html`` (ours vs published).
        progress: a tqdm bar over models.
        use_ray: None (default) = on Ray when it is installed and ``workers != 1`` (or an ``address`` is given),
            else in-process; True forces Ray even for one worker (to measure its overhead), False in-process.
        prefetch: in-process, stage the next model (read, hash, load on the CPU) while this one computes; at most
            one model is held besides the computing one. False stages each model only when its turn comes.

    Raises:
        SweepError: bad model list/registry, an address without Ray installed, workers that cannot start.
    """
    config = config or UDSConfig()
    entries = resolve_models(models_to_score, registry, methods)
    if max_retries < 0:
        raise SweepError(f"max_retries must be >= 0, got {max_retries}.")
    if workers is not None and workers < 1:
        raise SweepError(f"workers must be >= 1 (1 = in-process), got {workers}.")
    if limit is not None and limit < 1:
        raise SweepError(f"limit must be a positive number of examples, got {limit}.")
    if (cpus_per_worker is not None and cpus_per_worker < 1) or (
        gpus_per_worker is not None and gpus_per_worker < 0
    ):
        raise SweepError(
            f"cpus_per_worker must be >= 1 and gpus_per_worker >= 0, got {cpus_per_worker} and "
            f"{gpus_per_worker}."
        )
    out_dir = Path(out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise SweepError(f"--out {out_dir} is a file; give a directory for the sweep's results.")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not isinstance(full, (str, os.PathLike)) or not (
        retain is None or isinstance(retain, (str, os.PathLike))
    ):
        raise SweepError("A sweep loads full and retain itself (on every worker): pass paths or hub ids.")
    examples = load_examples(data, limit=limit)
    if not force:
        try:
            # the dtype in the settings follows the workers' device, which the driver may not share: settings are
            # compared by the ledger once a worker has loaded the full model
            refuse_other_runs(
                out_dir,
                [(entry.name, entry.source) for entry in entries],
                full,
                retain,
                examples,
                config,
                tolerate=("settings",),
            )
        except OutputConflictError as error:
            raise SweepError(str(error)) from None
    plan = WorkerPlan(
        str(full),
        None if retain is None else str(retain),
        examples,
        str(data) if isinstance(data, (str, os.PathLike)) else "<records>",
        config,
        cache_dir,
    )
    if use_ray is None:
        use_ray = address is not None or (workers != 1 and ray_available())
    if use_ray and not ray_available():
        raise SweepError(
            "This sweep needs Ray (an --address, or use_ray=True): install it with "
            "`pip install 'uds_lens[sweep]'`, or run in-process (no --address)."
        )
    if workers not in (None, 1) and not use_ray:
        warnings.warn(
            f"Ray is not installed, so the sweep runs in-process instead of on {workers} workers; "
            "`pip install 'uds_lens[sweep]'` enables them.",
            stacklevel=2,
        )
    if use_ray:
        table = _sweep_on_ray(
            plan,
            entries,
            out_dir,
            workers,
            address,
            gpus_per_worker,
            cpus_per_worker or 1,
            max_retries,
            force,
            progress,
        )
    else:
        # in-process, the one worker uses the cores there are, unless told otherwise
        with torch_threads(cpus_per_worker or available_cpus()):
            table = _sweep_in_process(plan, entries, out_dir, force, progress, prefetch)
    if compare_published:
        table = add_published_comparison(table)
        table.to_csv(out_dir / SWEEP_TABLE, index=False)
        published_scatter(table).write_html(out_dir / SCATTER_HTML, include_plotlyjs=True)
    return table


def _sweep_in_process(
    plan: WorkerPlan,
    entries: list[SweepModel],
    out_dir: Path,
    force: bool,
    progress: bool,
    prefetch: bool = True,
) -> pd.DataFrame:
    """One worker in this process, its models staged one ahead (:class:`StagingPipeline`).

    Each model is read and hashed once, on the staging thread, while the previous one computes; the reuse decision
    is made there from that digest (a current result is reused without loading the model); a model that cannot be
    read or loaded becomes its ``failed`` row and the sweep goes on. ``seconds`` of a model is the worker's wall time
    for it, from asking for it to its row written.
    """
    worker = SweepWorker(plan, compute_stage=True)
    ledger = _Ledger(out_dir, entries, worker.stage(), plan.config.tau)
    ledger.write()
    pipeline = StagingPipeline(
        lambda entry: worker.prepare(entry, lambda prepared: ledger.check_staged(prepared, force)),
        entries,
        release=Prepared.release,
        ahead=prefetch,
    )
    with tqdm(total=len(entries), desc="sweep (in-process)", unit="model", disable=not progress) as bar:
        started = time.perf_counter()
        for entry, prepared, waited in pipeline:
            if isinstance(
                prepared, Exception
            ):  # prepare never raises; kept so a bug still yields a failed row
                outcome = ModelOutcome(entry.name, "failed", error=f"{type(prepared).__name__}: {prepared}")
            else:
                outcome = worker.finish(prepared)
            outcome.wait_seconds = waited
            ledger.record(outcome, attempts=1, since=started)
            started = time.perf_counter()
            bar.update()
            bar.set_postfix(Counter(row["status"] for row in ledger.rows.values()))
    table = ledger.table()
    table.attrs["peak_staged"] = pipeline.peak  # models in memory at once, the computing one included
    return table


def _start_ray(address: str | None, workers: int | None, cpus_per_worker: int) -> bool:
    """Join ``address`` or start a local cluster; returns whether this call started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return True
    # A local cluster for one sweep: no dashboard, no usage statistics, a modest object store (results are small).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    num_cpus = workers * cpus_per_worker if workers else os.cpu_count() or 1
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024 * 1024
    )
    return True


def _sweep_on_ray(
    plan: WorkerPlan,
    entries: list[SweepModel],
    out_dir: Path,
    workers: int | None,
    address: str | None,
    gpus_per_worker: float | None,
    cpus_per_worker: int,
    max_retries: int,
    force: bool,
    progress: bool,
) -> pd.DataFrame:
    import ray

    started_here = _start_ray(address, workers, cpus_per_worker)
    try:
        resources_total = ray.cluster_resources()
        if gpus_per_worker is None:
            gpus_per_worker = 1.0 if resources_total.get("GPU", 0) >= 1 else 0.0
        if workers is None:
            slots = (
                resources_total.get("GPU", 0) / gpus_per_worker
                if gpus_per_worker
                else resources_total.get("CPU", 1) / cpus_per_worker
            )
            workers = max(1, int(slots))
        # On CPU each actor's torch gets its own CPU slots; on a GPU torch's CPU threads matter little.
        plan.threads = cpus_per_worker if not gpus_per_worker else None
        worker_class = ray.remote(SweepWorker).options(
            max_restarts=max_retries, max_task_retries=0, num_cpus=cpus_per_worker, num_gpus=gpus_per_worker
        )
        # Every actor loads the full model at once; the first also computes Stage 1 (on a worker's device and
        # dtype, exactly as the others will score), which the others then receive from the object store.
        actors = [
            worker_class.remote(plan, compute_stage=number == 0)
            for number in range(min(workers, len(entries)))
        ]
        stage_ref = actors[0].stage.remote()
        try:
            shipped: ShippedStage = ray.get(stage_ref)
            labels = ray.get([actor.adopt.remote(stage_ref) for actor in actors])
        except ray.exceptions.RayError as error:
            raise SweepError(
                f"The sweep's workers could not start (loading the full model {plan.full} or computing "
                f"Stage 1 with retain {plan.retain}): {error}"
            ) from error
        logger.info("sweep workers: %s", labels)
        ledger = _Ledger(out_dir, entries, shipped, plan.config.tau)
        _dispatch(actors, stage_ref, ledger.reuse(force), max_retries, ledger, progress)
        for actor in actors:
            ray.kill(actor)
        return ledger.table()
    finally:
        if started_here:
            ray.shutdown()


def _dispatch(
    actors: list[Any],
    stage_ref: Any,
    todo: list[SweepModel],
    max_retries: int,
    ledger: _Ledger,
    progress: bool,
) -> None:
    """Hand models to idle actors until every model is scored, reused or failed.

    A model whose actor died is put back at the front of the queue and goes to the next idle actor, at most
    ``max_retries`` times. Ray restarts the dead actor (``max_restarts``); the driver hands it Stage 1 again
    (``adopt``, retried by Ray until the restarted actor is up) and only then gives it models again: a call to an
    actor that is still restarting would fail at once. An actor that cannot come back (it died more often than Ray
    restarts it) is dropped; when none is left, the remaining models are reported as failed.
    """
    import ray
    from ray.exceptions import RayActorError, RayError

    queue = deque(todo)
    idle = deque(range(len(actors)))
    attempts: Counter[str] = Counter()
    pending: dict[
        Any, tuple[SweepModel | None, int]
    ] = {}  # a score call (model, slot) or a recovery (None, slot)
    total = len(ledger.entries)
    with tqdm(
        total=total,
        initial=total - len(todo),
        desc=f"sweep ({len(actors)} Ray workers)",
        unit="model",
        disable=not progress,
    ) as bar:
        while queue or pending:
            while queue and idle:
                entry, slot = queue.popleft(), idle.popleft()
                attempts[entry.name] += 1
                pending[actors[slot].score.remote(entry)] = (entry, slot)
            if not pending:
                for entry in queue:
                    ledger.record(
                        ModelOutcome(
                            entry.name,
                            "failed",
                            error="every sweep worker died; rerun the "
                            "sweep to retry (finished models are reused)",
                        ),
                        attempts[entry.name],
                    )
                    bar.update()
                break
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            entry, slot = pending.pop(ref)
            if entry is None:  # a restarted actor took Stage 1 back, or could not come back
                try:
                    ray.get(ref)
                    idle.append(slot)
                except RayError as error:
                    logger.warning("sweep worker %d is gone for good: %s", slot, error)
                continue
            try:
                outcome = ray.get(ref)
            except RayActorError as error:
                pending[actors[slot].adopt.options(max_task_retries=-1).remote(stage_ref)] = (None, slot)
                if attempts[entry.name] <= max_retries:
                    logger.warning(
                        "worker of %s died (attempt %d); retrying on another worker: %s",
                        entry.name,
                        attempts[entry.name],
                        error,
                    )
                    queue.appendleft(entry)
                    continue
                outcome = ModelOutcome(
                    entry.name,
                    "failed",
                    error=f"its worker died {attempts[entry.name]} times "
                    f"(killed or out of memory): {type(error).__name__}: {error}",
                )
            except RayError as error:
                idle.append(slot)
                outcome = ModelOutcome(entry.name, "failed", error=f"{type(error).__name__}: {error}")
            else:
                idle.append(slot)
            ledger.record(outcome, attempts[entry.name])
            bar.update()
            bar.set_postfix(Counter(row["status"] for row in ledger.rows.values()))


# ----------------------------------------------------------------------------------------------------------------
# Published figures


def add_published_comparison(table: pd.DataFrame) -> pd.DataFrame:
    """``published_uds`` (NaN where the registry has none) and ``uds_minus_published`` = ours - published."""
    frame = table.copy()
    if "published_uds" not in frame:
        frame["published_uds"] = math.nan
    frame["uds_minus_published"] = pd.to_numeric(frame["uds"], errors="coerce") - pd.to_numeric(
        frame["published_uds"], errors="coerce"
    )
    return frame


__all__ = [
    "ANCHOR_METHODS",
    "COLUMNS",
    "REGISTRIES",
    "PHASES",
    "PHASE_COLUMNS",
    "ModelOutcome",
    "Prepared",
    "ShippedStage",
    "StagingPipeline",
    "SweepError",
    "SweepModel",
    "SweepWorker",
    "WorkerPlan",
    "add_published_comparison",
    "available_cpus",
    "finish_model",
    "load_registry",
    "prepare_model",
    "ray_available",
    "read_model_list",
    "fingerprint_columns",
    "registry_path",
    "resolve_models",
    "score_one",
    "sweep",
    "torch_threads",
]

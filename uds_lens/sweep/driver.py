"""The driver: ``sweep()`` runs the models in-process or on Ray actors and keeps the ledger."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import warnings
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from uds_lens.checkpoints.loader import DEVICE_ENV
from uds_lens.config import ConfigError, UDSConfig, check_positive_int
from uds_lens.data import DataArg
from uds_lens.files import write_atomic
from uds_lens.inputs import NOT_GIVEN, S1_CACHE, NotGiven, RunInputs
from uds_lens.outputs import check_outputs_apart, check_writable_dir
from uds_lens.result_store import OutputConflictError, check_result_targets
from uds_lens.scoring import check_output_dir, refuse_other_runs
from uds_lens.stage_cache import s1_cache_dir
from uds_lens.sweep.ledger import Ledger
from uds_lens.sweep.lists import SCATTER_HTML, SWEEP_TABLE, SweepError, SweepModel, resolve_models
from uds_lens.sweep.published import add_published_comparison, write_published_scatter
from uds_lens.sweep.staging import Prepared, StagingPipeline
from uds_lens.sweep.worker import (
    ModelOutcome,
    ShippedStage,
    SweepWorker,
    WorkerPlan,
    available_cpus,
    torch_threads,
)

logger = logging.getLogger(__name__)

# Seconds the driver waits for its Ray actors to load full and compute Stage 1 (an 8B model and 400 examples take
# minutes on a GPU): past it, an actor that cannot be placed is an error rather than a wait without end.
STARTUP_TIMEOUT = 3600.0


def ray_available() -> bool:
    """Whether Ray (the ``[sweep]`` extra) can be imported."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def sweep(
    full: str | os.PathLike | RunInputs,
    retain: str | os.PathLike | None | NotGiven = NOT_GIVEN,
    data: DataArg | NotGiven = NOT_GIVEN,
    out: str | os.PathLike | None = None,
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
    startup_timeout: float | None = STARTUP_TIMEOUT,
    outside_weights: bool = False,
) -> pd.DataFrame:
    """Score many unlearned models against one (full, retain, data); returns the combined table (``sweep.csv``).

    Examples:
        >>> table = sweep("ckpt/full", "ckpt/retain", "forget.json", "sweep_out", registry="tofu-llama-3.2-1b",
        ...               methods=["npo", "rmu"], workers=8, gpus_per_worker=1)
        >>> table[["name", "status", "uds", "ci_low", "ci_high"]]

    Args:
        full / retain: the patch target and the Stage-1 source (paths or hub ids; retain None = retain-free mode),
            or, as ``full``, the run's `inputs.RunInputs` (then its unlearned models are the ones swept, and
            retain, data, config, cache_dir and limit are its own).
        data: forget-set path, hub id or records (read here once and shipped to the workers).
        out: output directory: ``NAME/`` per model, ``sweep.csv``, ``sweep_eval.json``.
        models_to_score: a model-list file (``name,path_or_id`` CSV rows or one path per line), a list of paths or
            `SweepModel`, or a ``{name: path}`` dict. Exactly one of this and ``registry``.
        registry / methods: a registry name (``tofu-llama-3.2-1b``) or CSV, optionally filtered by method.
        config: [`UDSConfig`][uds_lens.auditor.UDSConfig] (the same settings as ``uds-lens score``). Its
            ``stage2_cells`` None (the default) means ``ke`` here: Stage 2 on the KE cells only, the same UDS for
            less work (``d2`` NaN elsewhere); ``stage2_cells="all"`` keeps every layer's ``d2``.
        workers: Ray actors; 1 runs in-process; None = one per GPU (``gpus_per_worker``) or per CPU slot
            (``cpus_per_worker``) of the cluster, in-process when Ray is not installed. More actors than the
            cluster's GPUs (or CPU slots) can hold are cut to that number, with a warning (an actor that can
            never be placed would be waited for forever).
        address: an existing Ray cluster (``auto`` or ``HOST:PORT``); None starts a local one (or joins the one this
            process already started).
        gpus_per_worker: GPUs per actor (default 1 when the cluster has GPUs and the device is CUDA or not named,
            0 for ``device="cpu"``). Each actor sees its own GPU as ``cuda``, so a device index (``cuda:1``) is
            dropped on Ray: Ray chooses the GPU.
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
        startup_timeout: seconds to wait for the Ray actors to start (load full, compute Stage 1) before giving up
            with a `SweepError`; None waits without limit.
        outside_weights: accept weight shards a checkpoint's index names outside its folder.

    Raises:
        SweepError: bad model list/registry, an address without Ray installed, workers that cannot start.
    """
    if isinstance(full, RunInputs):
        if models_to_score is not None or registry is not None:
            raise SweepError("With a RunInputs, the models swept are its unlearned ones: pass no model list.")
        entries = resolve_models({name: checkpoint.given for name, checkpoint in full.unlearned.items()})
    else:
        entries = resolve_models(models_to_score, registry, methods)
    if max_retries < 0:
        raise SweepError(f"max_retries must be >= 0, got {max_retries}.")
    if workers is not None and workers < 1:
        raise SweepError(f"workers must be >= 1 (1 = in-process), got {workers}.")
    try:
        limit = check_positive_int("limit (--limit)", limit, "score every example")
    except ConfigError as error:
        raise SweepError(str(error)) from None
    if (cpus_per_worker is not None and cpus_per_worker < 1) or (
        gpus_per_worker is not None and gpus_per_worker < 0
    ):
        raise SweepError(
            f"cpus_per_worker must be >= 1 and gpus_per_worker >= 0, got {cpus_per_worker} and "
            f"{gpus_per_worker}."
        )
    if out is None:
        raise SweepError("Pass the sweep's output directory (out).")
    out_dir = Path(out).expanduser()
    try:
        check_output_dir(out_dir)
    except ConfigError as err:
        raise SweepError(str(err)) from None
    # The door: every checkpoint made once and compared with full, the forget set read once. A model that names no
    # checkpoint, or whose config cannot be read, becomes its failed row; the others go on.
    inputs = RunInputs.resolve(
        full,
        retain,
        data,
        {entry.name: entry.source for entry in entries},
        config=config,
        limit=limit,
        cache_dir=cache_dir,
        outside_weights=outside_weights,
        skip_unreadable=True,
    )
    try:
        # apart from every input (a checkpoint, the data, the model list) and writable, before any model loads
        check_outputs_apart(
            {"--out": out_dir},
            [
                *inputs.input_paths(),
                ("unlearned checkpoint", [entry.source for entry in entries]),  # the unreadable ones too
                ("model list", models_to_score if isinstance(models_to_score, (str, os.PathLike)) else None),
                ("registry", registry),
            ],
            caches={S1_CACHE: s1_cache_dir(inputs.cache_dir)},
        )
        check_writable_dir(out_dir)
    except ConfigError as err:
        raise SweepError(str(err)) from None
    if inputs.full.model is not None or (inputs.retain is not None and inputs.retain.model is not None):
        raise SweepError("A sweep loads full and retain itself (on every worker): pass paths or hub ids.")
    # many models, one number each: by default Stage 2 runs only the KE cells UDS reads (same UDS, less work)
    inputs = dataclasses.replace(inputs, config=inputs.config.with_stage2_cells("ke"))
    entries = [
        dataclasses.replace(
            entry,
            checkpoint=inputs.unlearned.get(entry.name),
            error="" if entry.name in inputs.unlearned else inputs.unreadable.get(entry.name, ""),
        )
        for entry in entries
    ]
    try:
        check_result_targets(
            out_dir, [entry.name for entry in entries]
        )  # never a folder uds_lens did not write
        if not force:
            # the dtype in the settings follows the workers' device, which the driver may not share: settings are
            # compared by the ledger once a worker has loaded the full model
            refuse_other_runs(out_dir, inputs, tolerate=("settings",))
    except OutputConflictError as error:
        raise SweepError(str(error)) from None
    plan = WorkerPlan(inputs)
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
            startup_timeout,
        )
    else:
        # in-process, the one worker uses the cores there are, unless told otherwise
        with torch_threads(cpus_per_worker or available_cpus()):
            table = _sweep_in_process(plan, entries, out_dir, force, progress, prefetch)
    if compare_published:
        table = add_published_comparison(table)
        # replaced in one step, as the ledger writes it: a reader sees the ledger's table or this one, never a part
        write_atomic(out_dir / SWEEP_TABLE, table.to_csv(index=False))
        write_published_scatter(table, out_dir / SCATTER_HTML)
    return table


def _sweep_in_process(
    plan: WorkerPlan,
    entries: list[SweepModel],
    out_dir: Path,
    force: bool,
    progress: bool,
    prefetch: bool = True,
) -> pd.DataFrame:
    """One worker in this process, its models staged one ahead (`StagingPipeline`).

    Each model is read and hashed once, on the staging thread, while the previous one computes; the reuse decision
    is made there from that digest (a current result is reused without loading the model); a model that cannot be
    read or loaded becomes its ``failed`` row and the sweep goes on. ``seconds`` of a model is the worker's wall time
    for it, from asking for it to its row written.
    """
    # a spare bridge per model in memory at once (`SweepWorker`): the one computing, the one staged
    worker = SweepWorker(plan, compute_stage=True, spares=min(len(entries), 2 if prefetch else 1))
    ledger = Ledger(out_dir, entries, worker.stage(), plan.inputs.config.tau, force)
    ledger.write()
    scoring = ledger.will_score(force)
    if scoring:  # a rerun that may reuse every model makes neither the spares nor full's clean runs
        worker.stock()
    pipeline = StagingPipeline(
        lambda entry: worker.prepare(entry, lambda prepared: ledger.check_staged(prepared, force)),
        entries,
        release=Prepared.release,
        ahead=prefetch,
        meanwhile=worker.warm if scoring else None,  # full's clean runs, while the first model is staged
    )
    with tqdm(total=len(entries), desc="sweep (in-process)", unit="model", disable=not progress) as bar:
        started: float | None = None  # the first model is asked for once the worker is warm
        for entry, prepared, waited in pipeline:
            if started is None:
                started = time.perf_counter() - waited
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
    worker.drop_spare()
    table = ledger.table()
    table.attrs["peak_staged"] = pipeline.peak  # models in memory at once, the computing one included
    return table


@dataclass(frozen=True)
class ActorLayout:
    """How many Ray actors a sweep starts and what each asks for (`plan_actors`)."""

    workers: int
    gpus_per_worker: float
    device: str | None
    cluster_cpus: float
    cluster_gpus: float


def plan_actors(
    resources: Mapping[str, float],
    workers: int | None,
    gpus_per_worker: float | None,
    cpus_per_worker: int,
    device: str | None,
) -> ActorLayout:
    """The actors a cluster with ``resources`` (``ray.cluster_resources()``) can hold at once.

    GPUs are asked for when the device is CUDA, or is not named (``device`` None, no ``$UDS_LENS_DEVICE``) and the
    cluster has GPUs; never for ``device="cpu"``. ``workers`` beyond what the GPUs (and CPU slots) hold are cut to
    that number with a warning: Ray would otherwise keep the extra actors pending, and the sweep would wait for
    them forever. A device index is dropped on GPU actors (Ray makes each actor's GPU its ``cuda:0``).

    Raises:
        SweepError: a CUDA device asked for on a cluster without GPUs, or not even one actor fits.
    """
    cpus, gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
    named = device or os.environ.get(DEVICE_ENV, "").strip() or None
    on_cuda = named is not None and named.split(":")[0] == "cuda"
    if gpus_per_worker is None:
        gpus_per_worker = 1.0 if gpus >= 1 and (named is None or on_cuda) else 0.0
    if on_cuda and not gpus_per_worker:
        raise SweepError(
            f"The sweep runs on {named} but its Ray actors get no GPU (the cluster has {gpus:g}, gpus_per_worker="
            f"{gpus_per_worker:g}): add GPUs to the cluster, pass gpus_per_worker, or use --device cpu."
        )
    fits = math.floor(cpus / cpus_per_worker + 1e-9)
    if gpus_per_worker:
        fits = min(fits, math.floor(gpus / gpus_per_worker + 1e-9))
    if fits < 1:
        raise SweepError(
            f"Not one sweep actor fits the Ray cluster ({cpus:g} CPU, {gpus:g} GPU) when each asks for "
            f"{cpus_per_worker} CPU and {gpus_per_worker:g} GPU: lower cpus_per_worker or gpus_per_worker."
        )
    if workers is None:
        workers = fits
    elif workers > fits:
        warnings.warn(
            f"{workers} sweep workers asked for, but the Ray cluster holds {fits} at once ({cpus:g} CPU, {gpus:g} "
            f"GPU; {cpus_per_worker} CPU and {gpus_per_worker:g} GPU each): starting {fits}.",
            stacklevel=3,
        )
        workers = fits
    if gpus_per_worker and device is not None and ":" in device:
        logger.warning("device %s on Ray: each actor uses the GPU Ray gives it, as cuda.", device)
        device = device.split(":")[0]
    return ActorLayout(workers, float(gpus_per_worker), device, cpus, gpus)


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
    startup_timeout: float | None = STARTUP_TIMEOUT,
) -> pd.DataFrame:
    import ray

    started_here = _start_ray(address, workers, cpus_per_worker)
    try:
        config = plan.inputs.config
        layout = plan_actors(
            ray.cluster_resources(), workers, gpus_per_worker, cpus_per_worker, config.device
        )
        if layout.device != config.device:
            plan.inputs = dataclasses.replace(
                plan.inputs, config=dataclasses.replace(config, device=layout.device)
            )
        # On CPU each actor's torch gets its own CPU slots; on a GPU torch's CPU threads matter little.
        plan.threads = cpus_per_worker if not layout.gpus_per_worker else None
        worker_class = ray.remote(SweepWorker).options(
            max_restarts=max_retries,
            max_task_retries=0,
            num_cpus=cpus_per_worker,
            num_gpus=layout.gpus_per_worker,
        )
        # Every actor loads the full model at once; the first also computes Stage 1 (on a worker's device and
        # dtype, exactly as the others will score), which the others then receive from the object store.
        actors = [
            worker_class.remote(plan, compute_stage=number == 0)
            for number in range(min(layout.workers, len(entries)))
        ]
        stage_ref = actors[0].stage.remote()
        try:
            shipped: ShippedStage = ray.get(stage_ref, timeout=startup_timeout)
            labels = ray.get([actor.adopt.remote(stage_ref) for actor in actors], timeout=startup_timeout)
        except ray.exceptions.GetTimeoutError:
            for actor in actors:
                ray.kill(actor)
            raise SweepError(
                f"The sweep's {len(actors)} workers did not start within {startup_timeout:g} s (each asks for "
                f"{cpus_per_worker} CPU and {layout.gpus_per_worker:g} GPU; the cluster has "
                f"{layout.cluster_cpus:g} CPU and {layout.cluster_gpus:g} GPU): loading full ({plan.inputs.full.label}) and "
                "Stage 1 may need longer (raise startup_timeout), or the actors cannot be placed (lower --workers "
                "or gpus_per_worker)."
            ) from None
        except ray.exceptions.RayError as error:
            raise SweepError(
                f"The sweep's workers could not start (loading the full model {plan.inputs.full.label} or "
                f"computing Stage 1 with retain {plan.inputs.retain}): {error}"
            ) from error
        logger.info("sweep workers: %s", labels)
        ledger = Ledger(out_dir, entries, shipped, plan.inputs.config.tau, force)
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
    ledger: Ledger,
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

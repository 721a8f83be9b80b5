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
  paced by compute: while model k computes, model k+1 is read and hashed in one pass over its bytes
  (``Checkpoint.stage``; ordinary memory, never pinned) and built on the CPU on a staging thread, at most one model
  ahead; it moves to the device only once the model before it has been released; the reuse decision is made there
  from that digest (a digest remembered by file identity decides without reading the model at all), and a model
  that cannot be staged becomes its ``failed`` row. On Ray each actor reads and hashes its model in one pass too
  (the driver decides reuse first, from the remembered digests or one read), with no staging ahead. Every model is
  made a ``Checkpoint`` once, at the driver's door (``RunInputs.resolve``), and travels as that value.

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
when the fingerprint saved with its intact result (``auditor.result_fingerprint``: full, retain and unlearned weights by
file contents, the data records, tokenizer, settings, and the digest of the Stage 1 values) equals this run's
(``results.check_saved``). A saved result of other inputs is another run's: the sweep refuses it before any model
is loaded (``force`` replaces it, and recomputes always); one that is damaged or used other Stage 1 values is
recomputed with a warning saying why. Model names may not be the sweep's own files (``SWEEP_FILES``). tau is applied
after everything, so a new tau reuses.
A worker that dies (killed, out of memory) has its model retried on another actor, at most ``max_retries`` times; a
model that keeps failing, or fails to load, is reported in ``sweep.csv`` with its error and the sweep goes on.
Numbers do not depend on the number of workers or their order: every worker scores with the batches and the Stage 1
of the one auditor that computed Stage 1, exactly as ``uds-lens score`` would.

The package, one concept per module (every name is re-exported here):

* ``lists``: what to sweep (`SweepModel`, model-list files, the shipped registries, result-name checks), the
  names of the sweep's own files (`SWEEP_FILES`) and `SweepError`;
* ``staging``: a model made ready before its turn (`prepare_model`, the move to the device) and the
  `StagingPipeline` that stages one model ahead;
* ``worker``: `SweepWorker` (its auditor, the shipped Stage 1, `finish_model`) and its threads;
* ``ledger``: ``sweep.csv``'s `COLUMNS` and `PHASES`, the rows, the reuse decision and the writes;
* ``driver``: `sweep`, in-process or on Ray (actors, dispatch, retries);
* ``published``: the comparison with the published figures and its scatter (``plotting`` imported only to draw).
"""

from __future__ import annotations

from uds_lens.sweep.driver import ray_available, sweep
from uds_lens.sweep.ledger import COLUMNS, PHASE_COLUMNS, PHASES, fingerprint_columns
from uds_lens.sweep.lists import (
    ANCHOR_METHODS,
    REGISTRIES,
    SCATTER_HTML,
    SWEEP_FILES,
    SWEEP_JSON,
    SWEEP_TABLE,
    SweepError,
    SweepModel,
    load_registry,
    read_model_list,
    registry_path,
    resolve_models,
)
from uds_lens.sweep.published import add_published_comparison
from uds_lens.sweep.staging import Prepared, StagingPipeline, prepare_model
from uds_lens.sweep.worker import (
    ModelOutcome,
    ShippedStage,
    SweepWorker,
    WorkerPlan,
    available_cpus,
    finish_model,
    score_one,
    torch_threads,
)

__all__ = [
    "ANCHOR_METHODS",
    "COLUMNS",
    "SCATTER_HTML",
    "SWEEP_FILES",
    "SWEEP_JSON",
    "SWEEP_TABLE",
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

"""The driver's ledger: ``sweep.csv``'s columns and rows, the reuse decision, and the files it writes."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from uds_lens.files import json_digest, write_atomic
from uds_lens.result_store import conflict_error
from uds_lens.results import SavedCheck, UDSResult, check_saved
from uds_lens.sweep.lists import SWEEP_JSON, SWEEP_TABLE, SweepError, SweepModel
from uds_lens.sweep.staging import Prepared
from uds_lens.sweep.worker import ModelOutcome, ShippedStage

logger = logging.getLogger(__name__)

# A model's phases, in order: resolve its path, read and hash its bytes (one pass, kept in memory), build the model
# from them, move it to the device, Stage 2 (s2; source_forward is the part of it in the model's own forward), write
# its result and the table. Each is a column ``{phase}_seconds``.
PHASES = ("resolve", "hash", "load", "to_device", "source_forward", "s2", "write")
PHASE_COLUMNS = [f"{phase}_seconds" for phase in PHASES]
# sweep.csv, one row per model: status is scored | reused | failed | pending; uds, ci_low/ci_high (bootstrap 95%),
# uds_unclipped and uds_clipped (UDS's two parts: from the KE cells whose ratio is measured, d2 <= d1, and from the
# clipped ones, d2 > d1, each read as fully erased), excess_disruption (how far past retain the model
# disrupts: UDSResult.split) and the example counts come from the model's summary; the phase columns (PHASES) time
# the model's work, wherever it ran
# (in-process, resolve/hash/load run on the staging thread while the previous model computes); wait_seconds is how
# long the worker then still waited for them, and seconds the model's wall time on the worker's critical path
# (wait + to_device + s2 + write and the small rest: the result's assembly); with nothing prefetched, seconds is
# about the sum of the phases (source_forward counted once, inside s2). s1_seconds is the shared Stage 1 (0 from the
# cache), threads the worker's torch threads, bytes_read what the hash phase read; finished_at is Unix time; fp_* are
# its fingerprints (see fingerprint_columns); a registry adds method/epoch and published_* columns. stage2_cells says
# which cells Stage 2 ran (ke: only the KE cells, the sweep's default; all: every layer), stage2_work_share the share
# of every cell's patched-run work those cells cost (1 for all).
COLUMNS = [
    "name",
    "source",
    "method",
    "epoch",
    "status",
    "uds",
    "ci_low",
    "ci_high",
    "uds_unclipped",
    "uds_clipped",
    "excess_disruption",
    "n_scored",
    "n_no_ke",
    "n_skipped",
    "stage2_cells",
    "stage2_work_share",
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


def fingerprint_columns(fingerprint: Mapping[str, Any]) -> dict[str, str]:
    """``sweep.csv``'s fingerprint columns from a result fingerprint (``auditor.result_fingerprint``): full, retain and
    unlearned weights, the data (records as scored), the settings (with the tokenizer; tau is not part of them)."""
    return {
        "fp_full": str(fingerprint.get("full")),
        "fp_retain": str(fingerprint.get("retain")),
        "fp_data": str(fingerprint.get("data")),
        "fp_settings": json_digest(
            [fingerprint.get("settings"), fingerprint.get("tokenizer"), fingerprint.get("format")], 24
        ),
        "fp_unlearned": str(fingerprint.get("unlearned")),
    }


@dataclass
class Ledger:
    """The driver's view of the sweep: one row per model, written to ``sweep.csv`` after every change, and the
    reuse decision (made here, from the models' files, before any worker loads anything)."""

    out: Path
    entries: list[SweepModel]
    shipped: ShippedStage
    tau: float
    force: bool = False  # --force: a result saved meanwhile by another run of other inputs is replaced too
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

    def reusable(
        self, entry: SweepModel, force: bool, identity: str | None = None
    ) -> tuple[SavedCheck, dict[str, Any]]:
        """What ``entry``'s saved result is worth to this run ([`results.check_saved`][uds_lens.results.check_saved]: the result if it is
        current, why (not), and whether it is another run's), and this run's fingerprint of it: of ``identity``
        where given (what staging proved or loaded), else of its files now (hashed unless their stamp proves their
        remembered digest)."""
        if identity is None and entry.checkpoint is not None:
            identity = entry.checkpoint.fingerprint
        fingerprint = self.shipped.fingerprint(identity)
        if force or entry.checkpoint is None:
            return SavedCheck(None, "forced" if force else entry.error), fingerprint
        return check_saved(self.out / entry.name, fingerprint), fingerprint

    def will_score(self, force: bool) -> bool:
        """Whether some model will be scored whatever the reuse decisions: ``force``, or a model that names a
        checkpoint and has no directory of its result here (a rerun where every model has one may reuse them all)."""
        return force or any(
            entry.checkpoint is not None and not (self.out / entry.name).exists() for entry in self.entries
        )

    def reuse(self, force: bool) -> list[SweepModel]:
        """Record every model whose saved result is current as ``reused``; returns the models left to score.

        Used where the driver cannot see the workers' reads (Ray): it hashes every model here first. The in-process
        sweep decides per model while staging it instead (`check_staged`), reading each checkpoint once.

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
        check, fingerprint = self.reusable(prepared.entry, force, prepared.identity)
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
            outcome.result.save(self.out / outcome.name, force=self.force)
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
            uds_unclipped=summary["uds_unclipped"],
            uds_clipped=summary["uds_clipped"],
            excess_disruption=summary["excess_disruption"],
            n_scored=summary["n_scored"],
            n_no_ke=summary["n_no_ke"],
            n_skipped=summary["n_skipped"],
            stage2_cells=result.stage2_cells,
            stage2_work_share=summary["stage2"].get("work_share", math.nan),
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
        write_atomic(self.out / SWEEP_TABLE, self.table().to_csv(index=False))
        write_atomic(
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

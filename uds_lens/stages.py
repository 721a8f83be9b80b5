"""A stage's batches as the auditor runs them: what Stage 1 and Stage 2 compute per batch on the chosen engine.

`StageRuns` binds the engine to one run: the patch target, how a batch is padded, the clean runs kept for the
next stage (`planning.CleanRuns`), the check that every score is finite, and the memory plan (`planning.MemoryPlan`).
`StageRuns.stage_one` and `StageRuns.stage_two` start a stage; each batch is one ``batch(number, members)`` call (the
auditor walks the batches with `planning.run_batches`), and the stage's values are read at its end.

A stage that patches every cell reads its source block first (`SourceReads`): the source's activations of the
next batches, as many as the plan's room for them holds, one block at a time over all of them, so each block of the
source is joined once for them all and the source never holds a whole joined copy. A stage on chosen cells runs the
source per batch on the examples and layers that have a cell, with its joined copies held through the stage where
the plan has room (else a block at a time for each batch): the same numbers either way.

This is the run in the models' own format. A bf16/fp16 run's precision check
([`PrecisionCheck`][uds_lens.precision.PrecisionCheck]) is a `StageRuns` too, whose stages run each batch as these
do and then, in fp32, what rounding could decide: the auditor's loops do not know which of the two they run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from uds_lens.patching.batch import CleanRun, PatchBatch
from uds_lens.patching.engines import PatchEngine
from uds_lens.patching.kernels import fast_engine_refusal, hold_joined_weights
from uds_lens.patching.planning import CleanRuns, MemoryPlan, read_bytes
from uds_lens.sources import as_source
from uds_lens.stage_cache import StageOne
from uds_lens.tl_compat import ModelLike, TLModel

FiniteCheck = Callable[[Tensor, list[int], ModelLike, str, str | None, str], None]
"""``check(values, members, model, role, label, what)``: raise if a batch's scores are not all finite (the auditor's
`failures.require_finite` on its examples)."""


class StageRuns:
    """The chosen engine bound to one run: the stages' batches in the models' own format (the module docstring).

    Attributes:
        engine: the patching engine every stage calls.
        full: the patch target.
        plan: the run's memory plan.
        batches: the run's batches as they are now (a split batch's halves included): what `SourceReads` reads
            ahead.
        clean: the full model's clean runs kept for the next stage (the plan's clean-run share).
        ignored_settings: the settings Stage 1 does not read here, left out of the S1 cache key (in fp32 whether
            the precision check is on).
    """

    ignored_settings: tuple[str, ...] = ("precision_check",)
    # whether a stage runs its source again per batch besides the block-first reads (the precision check's fp32
    # runs): its joined copies are then held through the stage where the plan has room
    reruns_sources: bool = False

    def __init__(
        self,
        engine: PatchEngine,
        full: TLModel,
        plan: MemoryPlan,
        make_batch: Callable[[list[int]], PatchBatch],
        finite: FiniteCheck,
        full_label: str | None,
        batches: Callable[[], list[list[int]]] = list,
    ) -> None:
        self.engine = engine
        self.full = full
        self.plan = plan
        self.make_batch = make_batch
        self.batches = batches
        self.finite = finite
        self.full_label = full_label
        self.clean = CleanRuns(plan.share("clean_runs"))

    def clean_run(self, number: int, batch: PatchBatch) -> CleanRun:
        """The full model's clean run of batch ``number`` (kept within the budget, `planning.CleanRuns`)."""
        return self.clean.get(number, lambda: self.engine.clean_run(self.full, batch))

    def make_clean_runs(self) -> int:
        """Make the full model's clean runs of the first batches ahead of the stage that reads them, as many as the
        clean-run share keeps (a sweep's worker whose Stage 1 came from the cache, while its first model loads);
        stops before a batch that would not be kept, judged by the bytes per token of those kept. The same runs the
        stage would make: no number changes. Returns how many are kept."""
        tokens = 0
        for number, members in enumerate(self.batches() if self.clean.budget > 0 else []):
            batch = self.make_batch(list(members))
            held = self.clean.held()
            if number not in self.clean.runs:
                if tokens and held + held * batch.tokens.numel() // tokens > self.clean.budget:
                    break
                self.clean_run(number, batch)
                if number not in self.clean.runs:
                    break
            tokens += batch.tokens.numel()
        return len(self.clean.runs)

    def forget_clean_runs(self, short_of_memory: bool = True) -> None:
        """The batches changed (a batch that ran out of memory was split, or another plan was adopted): the kept
        clean runs go, and where memory was short less is kept from now on."""
        self.clean.forget(short_of_memory)

    def stage_one(self, retain: ModelLike | None, label: str | None, shape: tuple[int, int]) -> StageOneRun:
        """Stage 1 of ``shape`` ``[example, layer]`` with ``retain`` as the source (None: retain-free, no S1)."""
        return StageOneRun(self, retain, label, shape)

    def stage_two(
        self,
        source: ModelLike,
        label: str | None,
        stage: StageOne,
        cells: Bool[Tensor, "example layer"] | None,
    ) -> StageTwoRun:
        """Stage 2 of ``source`` against ``stage`` on ``cells`` (None: every cell)."""
        return StageTwoRun(self, source, label, stage, cells)

    def hold_source_joins(self, source: ModelLike | None, hold: bool) -> None:
        """Hold a source's joined weights through a stage that runs it per batch (on chosen cells, or again in
        fp32) where the plan has room (else each batch joins a block at a time for its run: the same values), and
        let them go when the stage ends."""
        if source is None:
            return
        model = as_source(source).model
        if model is self.full or fast_engine_refusal(model) is not None or not self.engine.joins_weights:
            return  # the target's own copies, or a model the engine reads through hooks
        hold_joined_weights(model, hold and self.plan.holds_source_joins)

    def source_scores(
        self,
        reads: SourceReads,
        number: int,
        members: list[int],
        batch: PatchBatch,
        clean: CleanRun,
    ) -> Float[Tensor, "batch layer"]:
        """The patched scores of every layer of batch ``number`` from its source activations (``reads``)."""
        acts = reads.of(number, members, batch)
        return self.engine.patched_scores(self.full, batch, acts.to(self.full.cfg.device), clean)


class SourceReads:
    """A source's activations for a stage's batches, read block first a group of batches at a time.

    Asked for batch ``number``'s, it reads that batch's and those of the batches after it, as many as the plan's
    room for a source's reads holds (`planning.MemoryPlan.source_read_bytes`: at most what a joined copy of the
    source would take), in one block-first pass (``engine.source_activations_of``); each is handed over once and
    let go. A batch not read ahead (its batch was split since) is read then.
    """

    def __init__(self, runs: StageRuns, source: ModelLike, timings: dict[str, float]) -> None:
        self.runs = runs
        self.source = source
        self.timings = timings
        self.read: dict[tuple[int, ...], Tensor] = {}

    def of(self, number: int, members: list[int], batch: PatchBatch) -> Tensor:
        """Batch ``number``'s source activations (the examples ``members``, padded as ``batch``)."""
        key = tuple(members)
        if key not in self.read:
            self.read_from(number, members, batch)
        return self.read.pop(key)

    def read_from(self, number: int, members: list[int], batch: PatchBatch) -> None:
        runs = self.runs
        group, room = [(members, batch)], runs.plan.source_read_bytes
        used = self.bytes_of(batch)
        for later in runs.batches()[number + 1 :]:
            ahead = runs.make_batch(later)
            used += self.bytes_of(ahead)
            if used > room:
                break
            group.append((later, ahead))
        acts = runs.engine.timed_source_activations(self.source, [b for _, b in group], self.timings)
        self.read.update((tuple(m), a) for (m, _), a in zip(group, acts, strict=True))

    def bytes_of(self, batch: PatchBatch) -> int:
        """Bytes of a batch's source activations: every layer patched at each window row."""
        return read_bytes(self.runs.full, int(batch.window_len.sum()), len(self.runs.engine.spec.layers))


class StageOneRun:
    """Stage 1 being computed, batch by batch: S0, the per-layer baseline and S1 (retain patched in)."""

    def __init__(
        self, runs: StageRuns, retain: ModelLike | None, label: str | None, shape: tuple[int, int]
    ) -> None:
        self.runs = runs
        self.retain = retain
        self.label = label
        self.shape = shape
        self.s0 = torch.full(shape[:1], float("nan"))
        self.baseline = torch.full(shape, float("nan"))
        self.s1 = torch.full(shape, float("nan")) if retain is not None else None
        self.reads = None if retain is None else SourceReads(runs, retain, {})
        runs.hold_source_joins(retain, runs.reruns_sources)

    def batch(self, number: int, members: list[int]) -> None:
        """Stage 1 of batch ``number`` (the examples ``members``)."""
        self.run(number, members, self.runs.make_batch(members))

    def run(self, number: int, members: list[int], batch: PatchBatch) -> None:
        """S0, baseline and S1 of ``batch``, each checked finite before the next."""
        runs, full = self.runs, self.runs.full
        clean = runs.clean_run(number, batch)
        self.s0[members] = clean.scores.float().cpu()
        runs.finite(self.s0[members], members, full, "full", runs.full_label, "clean score (S0)")
        self.baseline[members] = runs.engine.baseline_scores(full, batch, clean).float().cpu()
        runs.finite(self.baseline[members], members, full, "full", runs.full_label, "baseline score")
        if self.s1 is not None and self.reads is not None:
            self.s1[members] = runs.source_scores(self.reads, number, members, batch, clean).float().cpu()
            runs.finite(
                self.s1[members], members, self.reads.source, "retain", self.label, "patched score (S1)"
            )

    def close(self) -> None:
        """The batches are over (or one failed): what was read of the retain model goes."""
        if self.reads is not None:
            self.reads.read.clear()
        self.runs.hold_source_joins(self.retain, False)

    def finish(self, idx: list[int], batches: list[list[int]], seconds: float) -> StageOne:
        """The Stage 1 computed: its examples' ``idx``, the batches it ran in, its seconds."""
        return StageOne(
            idx=idx, s0=self.s0, baseline=self.baseline, s1=self.s1, batches=batches, seconds=seconds
        )


class StageTwoRun:
    """Stage 2 of one unlearned model being computed, batch by batch: S2 on every cell or on the cells asked for
    (NaN elsewhere; a batch without one runs nothing)."""

    def __init__(
        self,
        runs: StageRuns,
        source: ModelLike,
        label: str | None,
        stage: StageOne,
        cells: Bool[Tensor, "example layer"] | None,
    ) -> None:
        self.runs = runs
        self.source = source
        self.label = label
        self.stage = stage
        self.cells = cells
        self.s2 = torch.full(stage.baseline.shape, float("nan"))
        self.clock: dict[str, float] = {}
        self.reads = SourceReads(runs, source, self.clock)
        runs.hold_source_joins(source, cells is not None or runs.reruns_sources)

    def batch(self, number: int, members: list[int]) -> None:
        """Stage 2 of batch ``number`` (the examples ``members``), on its cells."""
        cells = None if self.cells is None else self.cells[members]
        if cells is not None and not cells.any():
            return  # no cell in this batch: UDS reads none of its d2
        self.run(number, members, self.runs.make_batch(members), cells)

    def run(
        self, number: int, members: list[int], batch: PatchBatch, cells: Bool[Tensor, "batch layer"] | None
    ) -> None:
        """S2 of ``batch`` on ``cells`` (None: every cell), checked finite where it ran."""
        runs, full = self.runs, self.runs.full
        clean = runs.clean_run(number, batch)
        if cells is None:
            self.s2[members] = runs.source_scores(self.reads, number, members, batch, clean).float().cpu()
        elif cells.any():
            self.s2[members] = runs.engine.cell_scores(full, self.source, batch, cells, clean, self.clock)
        ran = torch.ones_like(self.s2[members], dtype=torch.bool) if cells is None else cells
        values = self.s2[members].where(ran, 0.0)
        runs.finite(values, members, self.source, "unlearned", self.label, "patched score (S2)")

    def close(self) -> None:
        """The batches are over (or one failed): what was read of the source, and its joined copies, go."""
        self.reads.read.clear()
        self.runs.hold_source_joins(self.source, False)

    def scores(self) -> Float[Tensor, "example layer"]:
        """S2 as results show it."""
        return self.s2

    def meta(self) -> dict[str, Any]:
        """What results record of this stage beyond S2 (nothing here; the precision check adds its record)."""
        return {}

    def timings(self) -> dict[str, float]:
        """Stage 2's timings: the part spent in the unlearned model's own forward (the rest is the patched runs)."""
        return {"s2_source_forward_seconds": self.clock.get("source_forward_seconds", 0.0)}

    def load_seconds(self) -> float:
        """Seconds this stage spent making models (a load, like the unlearned model's own: not Stage 2)."""
        return 0.0


__all__ = ["FiniteCheck", "SourceReads", "StageOneRun", "StageRuns", "StageTwoRun"]

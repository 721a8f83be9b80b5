"""A stage's batches as the auditor runs them: what Stage 1 and Stage 2 compute per batch on the chosen engine.

`StageRuns` binds the engine to one run: the patch target, how a batch is padded, the clean runs kept for the
next stage (`planning.CleanRuns`), the check that every score is finite, and the memory plan (whether a source's
joined weights are held through its stage, `planning.MemoryPlan`). `StageRuns.stage_one` and
`StageRuns.stage_two` start a stage; each batch is one ``batch(number, members)`` call (the auditor walks the
batches with `planning.run_batches`), and the stage's values are read at its end.

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
from uds_lens.patching.planning import CleanRuns, MemoryPlan
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
        clean: the full model's clean runs kept for the next stage (the plan's clean-run share).
        ignored_settings: the settings Stage 1 does not read here, left out of the S1 cache key (in fp32 whether
            the precision check is on).
    """

    ignored_settings: tuple[str, ...] = ("precision_check",)

    def __init__(
        self,
        engine: PatchEngine,
        full: TLModel,
        plan: MemoryPlan,
        make_batch: Callable[[list[int]], PatchBatch],
        finite: FiniteCheck,
        full_label: str | None,
    ) -> None:
        self.engine = engine
        self.full = full
        self.plan = plan
        self.make_batch = make_batch
        self.finite = finite
        self.full_label = full_label
        self.clean = CleanRuns(plan.share("clean_runs"))

    def clean_run(self, number: int, batch: PatchBatch) -> CleanRun:
        """The full model's clean run of batch ``number`` (kept within the budget, `planning.CleanRuns`)."""
        return self.clean.get(number, lambda: self.engine.clean_run(self.full, batch))

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
        """Hold a source's joined weights through its stage where the plan has room (else each batch joins a block
        at a time for its run: the same values), and let them go when the stage ends."""
        if source is None:
            return
        model = as_source(source).model
        if model is self.full or fast_engine_refusal(model) is not None or not self.engine.joins_weights:
            return  # the target's own copies, or a model the engine reads through hooks
        hold_joined_weights(model, hold and self.plan.holds_source_joins)


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
        runs.hold_source_joins(retain, True)

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
        if self.s1 is not None and self.retain is not None:
            self.s1[members] = runs.engine.source_scores(full, self.retain, batch, clean).float().cpu()
            runs.finite(self.s1[members], members, self.retain, "retain", self.label, "patched score (S1)")

    def close(self) -> None:
        """The batches are over (or one failed): the retain model's joined copies go."""
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
        runs.hold_source_joins(source, True)

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
            scores = runs.engine.source_scores(full, self.source, batch, clean, self.clock)
            self.s2[members] = scores.float().cpu()
        elif cells.any():
            self.s2[members] = runs.engine.cell_scores(full, self.source, batch, cells, clean, self.clock)
        ran = torch.ones_like(self.s2[members], dtype=torch.bool) if cells is None else cells
        values = self.s2[members].where(ran, 0.0)
        runs.finite(values, members, self.source, "unlearned", self.label, "patched score (S2)")

    def close(self) -> None:
        """The batches are over (or one failed): the source's joined copies go."""
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


__all__ = ["FiniteCheck", "StageOneRun", "StageRuns", "StageTwoRun"]

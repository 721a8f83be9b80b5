"""Batch planning and running: which examples share a batch, what a run may hold beyond its models, and the one
runner that walks the batches and halves a batch that runs out of memory (``run_batches``: the auditor's stages and
component patching both run through it).

A run's memory is planned once (`MemoryPlan`): the free memory is measured when the models of Stage 1 are loaded,
and the run's room beyond its two models is that, but at most 0.9 of one model's weights (`RUN_ROOM`, so that a run
peaks near three models; never less than `MIN_ROOM`, so a small model's run is never squeezed). `SHARES` says, in one
table, what part of the room each thing the run keeps may take, and what it keeps is granted in order of what it
saves: the clean runs, a source's activations read ahead, then the joined copies of the patch target (and of a
source) where what the others are expected to hold leaves room for them. Everything held is a copy or a cache of
something that can be computed again, so a share that is short costs time, never a number: a batch smaller, clean
runs computed again, joined weights made a block at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from tqdm.auto import tqdm

from uds_lens import memory
from uds_lens.config import Engine, Scope
from uds_lens.data import EncodedExample
from uds_lens.patching.batch import CleanRun, window_sites
from uds_lens.patching.engines import PatchEngine, engine_class
from uds_lens.tl_compat import TLModel

logger = logging.getLogger(__name__)

Share = Literal["batch", "clean_runs", "source_reads", "held_copies", "fp32_reference"]
"""What a run keeps beyond its models, each with its share of the run's room (`SHARES`)."""

RUN_ROOM = 0.9
"""What a run may hold beyond its two models, in one model's weights (`MemoryPlan.room`): with what the
allocator keeps of memory freed, a run then peaks at about three models' weights (`experiments/bench_scale.py`)."""

MIN_ROOM = 512 << 20
"""The room of a run of a small model: what `RUN_ROOM` gives is never less than this (nor more than is free)."""

SHARES: dict[Share, float] = {
    # one batch's activations at their peak as the engine estimates it (`choose_batch_size`: an upper bound, about
    # three times what a batch holds on a CPU)
    "batch": 0.50,
    # the clean runs kept for the next stage (`CleanRuns`); with the precision check on, half of it is its fp32
    # ones (`precision.PrecisionCheck`)
    "clean_runs": 0.50,
    # a source's activations read ahead, block first, for the next batches (`stages.SourceReads`)
    "source_reads": 0.25,
    # what is held between batches: the clean runs and the reads as expected for the run's examples, then the patch
    # target's joined Q/K/V and gate/up copies (`kernels.hold_joined_weights`) where they fit beside them, and a
    # source's for a stage that runs it per batch where both fit
    "held_copies": 0.75,
    # a whole fp32 copy of a model for the precision check, of the memory free when it is about to be made
    "fp32_reference": 0.90,
}
"""The shares of the run's room it hands out, in one place (`MemoryPlan`)."""


def clean_run_bytes(run: CleanRun) -> int:
    """Bytes a kept clean run holds on its device: scores, each block's prefix keys/values, window activations."""
    tensors = [run.scores, *run.keys, *run.values, *run.window_acts.values()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def plan_batches(
    examples: Sequence[EncodedExample],
    scope: Scope,
    batch_size: int,
    max_waste: float = 0.25,
    min_batch: int = 8,
    engine: Engine = "fast",
) -> list[list[int]]:
    """Group example indices into batches of similar lengths (deterministic).

    Batches are grouped by the engine's ``padded_length``. The fast engine packs the windows (its linear layers see
    only real rows, and the more rows a product has, the better it uses the cores); what it still pads is the
    sequence axis of the clean keys/values and of the attention over them, so it sorts by sequence length and counts
    padding there. The naive engine (the oracle) keeps the
    grouping it has always had, by window length with padding counted in window tokens, so its batches, and with
    them its float noise, are unchanged. A batch of at least ``min_batch`` examples is closed early when
    padding would waste more than ``max_waste`` of its tokens (smaller batches would cost more in per-batch
    overhead than they save).
    """
    padded = engine_class(engine).padded_length

    def padded_length(index: int) -> int:
        return padded(examples[index], scope)

    order = sorted(
        range(len(examples)),
        key=lambda i: (
            padded_length(i),
            len(examples[i].window(scope)),
            examples[i].read_positions.stop,
            i,
        ),
    )
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0  # real tokens of the examples in ``current`` along the padded axis
    for index in order:
        length = padded_length(index)
        if current:
            wasteful = len(current) >= min_batch and (len(current) + 1) * length > (1 + max_waste) * (
                used + length
            )
            if len(current) >= batch_size or wasteful:
                batches.append(current)
                current, used = [], 0
        current.append(index)
        used += length
    if current:
        batches.append(current)
    return batches


def joined_copy_bytes(model: TLModel) -> int:
    """Bytes of the matrices the fast engine joins for one model it runs (``kernels._BlockWeights``): per block
    Q/K/V as one ``[d_model, (head + 2 kv_head) d_head]`` matrix and gate/up as one ``[d_model, 2 d_mlp]``, and the
    zero biases it makes for a family without them: a second copy of about 57% of a Llama's weights, kept while
    its joins are held (`MemoryPlan`); otherwise one block's at a time."""
    cfg = model.cfg
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    d_mlp = cfg.d_mlp or 4 * cfg.d_model
    qkv = (cfg.n_heads + 2 * n_kv) * cfg.d_head
    per_block = cfg.d_model * (qkv + 2 * d_mlp) + qkv + 2 * d_mlp + 2 * cfg.d_model
    return int(cfg.n_layers * per_block * itemsize)


def choose_batch_size(
    model: TLModel,
    examples: Sequence[EncodedExample],
    scope: Scope,
    engine: Engine,
    room: int,
    cap: int = 64,
) -> int:
    """Largest batch whose estimated peak fits in the ``batch`` share (`SHARES`) of ``room`` bytes (at least 1): the
    engine's ``bytes_per_example`` at the longest sequence and window."""
    if not examples:
        return 1
    seq_len = max(ex.read_positions.stop for ex in examples)
    window = max(len(ex.window(scope)) for ex in examples)
    per_example = max(1, engine_class(engine).bytes_per_example(model, seq_len, window))
    return int(max(1, min(cap, math.floor(room * SHARES["batch"] / per_example))))


def expected_clean_bytes(model: TLModel, examples: Sequence[EncodedExample], scope: Scope, site: str) -> int:
    """What the fast engine's clean runs of ``examples`` hold when all are kept (`clean_run_bytes`): each block's
    keys and values before each example's window, and the window activations of its sites (`batch.window_sites`)."""
    cfg = model.cfg
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    prefix = sum(ex.window(scope).start for ex in examples)
    window = sum(len(ex.window(scope)) for ex in examples)
    sites = len(window_sites(site))  # type: ignore[arg-type]
    per_layer = 2 * prefix * n_kv * cfg.d_head + sites * window * cfg.d_model
    return int(cfg.n_layers * per_layer * itemsize)


def read_bytes(model: TLModel, window_rows: int, n_layers: int) -> int:
    """What a source's activations at ``window_rows`` window rows take, ``n_layers`` layers patched: what
    `stages.SourceReads` holds of a batch, and (`expected_read_bytes`) what the plan expects for a run."""
    itemsize = torch.empty((), dtype=model.cfg.dtype).element_size()
    return int(n_layers * window_rows * model.cfg.d_model * itemsize)


def expected_read_bytes(
    model: TLModel, examples: Sequence[EncodedExample], scope: Scope, n_layers: int
) -> int:
    """What a source's activations of ``examples`` at their window rows take (`stages.SourceReads`), ``n_layers``
    layers patched."""
    return read_bytes(model, sum(len(ex.window(scope)) for ex in examples), n_layers)


@dataclass(frozen=True)
class MemoryPlan:
    """What one run may hold beyond its models, decided from one measurement of the free memory (`SHARES` of its
    `room`).

    Measured once, when the models of Stage 1 are loaded (`measure`): Stage 2 holds full and one unlearned model
    where Stage 1 held full and retain, so the same figure serves both stages. Only a precision check that makes a
    whole fp32 copy of an unlearned model measures again, when it is about to make it (`fp32_copy_fits`): once per
    model swap.

    Attributes:
        device: where the run computes.
        free: the bytes free when measured.
        joined_bytes: one model's joined copies (`joined_copy_bytes`; 0 for an engine that joins nothing).
        model_bytes: one model's weights (0: the room is what is free).
        clean_bytes: what the run's clean runs take when all are kept (`expected_clean_bytes`).
        read_bytes: what a source's activations of the run's examples take (`expected_read_bytes`).
    """

    device: str
    free: int
    joined_bytes: int = 0
    model_bytes: int = 0
    clean_bytes: int = 0
    read_bytes: int = 0

    @classmethod
    def measure(
        cls,
        device: str,
        full: TLModel,
        engine: PatchEngine,
        examples: Sequence[EncodedExample] = (),
        scope: Scope = "span",
    ) -> MemoryPlan:
        """The plan of a run on ``device`` whose patch target is ``full`` on ``engine``, over ``examples``, from the
        memory free now."""
        joins = engine.joins_weights
        weights = {p.untyped_storage().data_ptr(): p for p in full.parameters()}.values()
        return cls(
            str(device),
            memory.available_memory_bytes(device),
            joined_copy_bytes(full) if joins else 0,
            sum(p.untyped_storage().nbytes() for p in weights),
            expected_clean_bytes(full, examples, scope, engine.spec.site) if joins else 0,
            expected_read_bytes(full, examples, scope, len(engine.spec.layers)) if joins else 0,
        )

    @property
    def room(self) -> int:
        """What the run may hold beyond its models: `RUN_ROOM` models' weights (at least `MIN_ROOM`), at most what
        is free."""
        if not self.model_bytes:
            return self.free
        return min(self.free, max(int(RUN_ROOM * self.model_bytes), MIN_ROOM))

    def share(self, what: Share) -> int:
        """Bytes of ``what``'s share of the run's room."""
        return int(SHARES[what] * self.room)

    def _kept(self) -> int:
        """What the clean runs and the reads are expected to hold, each within its share."""
        return min(self.clean_bytes, self.share("clean_runs")) + min(
            self.read_bytes, self.share("source_reads")
        )

    @property
    def holds_target_joins(self) -> bool:
        """Whether the patch target's joined copies are held for the run (else made a block at a time): where they
        fit beside the clean runs and the reads in the held-copies share."""
        return 0 < self.joined_bytes <= self.share("held_copies") - self._kept()

    @property
    def holds_source_joins(self) -> bool:
        """Whether a source's joined copies are held through a stage that runs it per batch too (both fit)."""
        return 0 < 2 * self.joined_bytes <= self.share("held_copies") - self._kept()

    @property
    def source_read_bytes(self) -> int:
        """What a stage's source activations read ahead may hold (`stages.SourceReads`)."""
        return self.share("source_reads")

    def batch_size(
        self, model: TLModel, examples: Sequence[EncodedExample], scope: Scope, engine: Engine
    ) -> int:
        """`choose_batch_size` in the run's room."""
        return choose_batch_size(model, examples, scope, engine, self.room)

    def batches(
        self,
        model: TLModel,
        examples: Sequence[EncodedExample],
        scope: Scope,
        engine: Engine,
        batch_size: int | None = None,
    ) -> list[list[int]]:
        """The run's batches (`plan_batches`): ``batch_size`` examples at most, or as many as `batch_size` fits."""
        if not examples:
            return []
        size = batch_size or self.batch_size(model, examples, scope, engine)
        return plan_batches(examples, scope, size, engine=engine)

    def fp32_copy_fits(self, needed: int, made: int = 0, swapped: bool = False) -> tuple[bool, int]:
        """Whether a whole fp32 copy of ``needed`` bytes fits its share of the free memory, and that free figure:
        for a model the plan was measured with (full, retain) the plan's figure less the ``made`` bytes of copies
        made since; for a model swapped in since (an unlearned one) measured again, once per swap."""
        free = memory.available_memory_bytes(self.device) if swapped else max(0, self.free - made)
        return needed <= SHARES["fp32_reference"] * free, free


@dataclass
class CleanRuns:
    """The clean runs of a run's batches kept for the next stage, by batch number, within ``budget`` bytes.

    The first batches that fit are kept and never evicted: the stages walk the batches in order, so evicting the
    oldest would miss every time; the others are computed again when asked for. The auditor keeps one (the
    run's own format) and a bf16/fp16 run's precision check another (its fp32 clean runs).
    """

    budget: int
    runs: dict[int, CleanRun] = field(default_factory=dict)

    def get(self, number: int, make: Callable[[], CleanRun]) -> CleanRun:
        """The clean run of batch ``number``: kept, or made by ``make`` (and kept while within the budget)."""
        run = self.runs.get(number)
        if run is None:
            run = make()
            if self.held() + clean_run_bytes(run) <= self.budget:
                self.runs[number] = run
        return run

    def held(self) -> int:
        """Bytes of the clean runs kept."""
        return sum(clean_run_bytes(run) for run in self.runs.values())

    def forget(self, short_of_memory: bool = True) -> None:
        """Drop the kept runs: the batches changed, so their numbers mean other examples now; and halve the budget
        where memory was short (a batch ran out of it and was split)."""
        self.runs.clear()
        if short_of_memory:
            self.budget //= 2


def consecutive_batches(n: int, size: int) -> list[list[int]]:
    """``range(n)`` in order, ``size`` at a time (component patching keeps its examples in the order asked for)."""
    return [list(range(first, min(n, first + size))) for first in range(0, n, max(1, size))]


def run_batches(
    batches: list[list[int]],
    work: Callable[[int, list[int]], None],
    device: str | torch.device,
    desc: str = "",
    progress: bool = False,
    on_split: Callable[[], None] | None = None,
) -> None:
    """``work(number, members)`` for every batch of ``batches``, in order; a batch that runs out of memory
    (``memory.is_out_of_memory``) is halved and retried.

    The halves replace the batch in ``batches`` (in place), so a caller that keeps the list starts its next stage
    from the size that fitted; ``on_split`` is called after each split (the auditor drops its clean runs, keyed by
    batch number, which the split shifts). ``work`` must leave nothing behind when it fails: it writes its results
    only once the batch is done. A batch of one example that runs out of memory, and any other error, propagate.
    On a CPU with overcommit the kernel may kill the process instead of raising: there the memory-budgeted batch
    size (``choose_batch_size``) is the protection.
    """
    number = 0
    total = sum(len(members) for members in batches)
    with tqdm(total=total, desc=desc, unit="example", disable=not progress) as bar:
        while number < len(batches):
            members = batches[number]
            try:
                work(number, members)
            except Exception as err:
                if not memory.is_out_of_memory(err) or len(members) == 1:
                    raise
                error_name = type(err).__name__
            else:
                bar.update(len(members))
                number += 1
                continue
            # Outside the except block: the failed attempt's frames (and their tensors) are released by now.
            half = len(members) // 2
            logger.warning(
                "Out of memory on a batch of %d examples (%s); retrying as %d + %d.",
                len(members),
                error_name,
                half,
                len(members) - half,
            )
            batches[number : number + 1] = [members[:half], members[half:]]
            if on_split is not None:
                on_split()
            memory.release_memory(device)


__all__ = [
    "MIN_ROOM",
    "RUN_ROOM",
    "SHARES",
    "CleanRuns",
    "MemoryPlan",
    "Share",
    "choose_batch_size",
    "clean_run_bytes",
    "consecutive_batches",
    "expected_clean_bytes",
    "expected_read_bytes",
    "joined_copy_bytes",
    "plan_batches",
    "read_bytes",
    "run_batches",
]

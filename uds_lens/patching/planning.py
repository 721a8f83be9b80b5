"""Batch planning and running: which examples share a batch, what a run may hold beyond its models, and the one
runner that walks the batches and halves a batch that runs out of memory (``run_batches``: the auditor's stages and
component patching both run through it).

A run's memory is planned once (`MemoryPlan`): the free memory is measured when the models of Stage 1 are loaded,
and `SHARES` says, in one table, what part of it each thing the run keeps beyond its models may take. Everything
held is a copy or a cache of something that can be computed again, so a share that is short costs time, never a
number: a batch smaller, clean runs computed again, joined weights made a block at a time.
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
from uds_lens.patching.batch import CleanRun
from uds_lens.patching.engines import PatchEngine, engine_class
from uds_lens.tl_compat import TLModel

logger = logging.getLogger(__name__)

Share = Literal["batch", "clean_runs", "joined_copies", "fp32_reference"]
"""What a run keeps beyond its models, each with its share of the free memory (`SHARES`)."""

SHARES: dict[Share, float] = {
    # one batch's activations at their peak (`choose_batch_size`), of what the held joined copies leave
    "batch": 0.25,
    # the clean runs kept for the next stage (`CleanRuns`); with the precision check on, half of it is its fp32
    # ones (`precision.PrecisionCheck`)
    "clean_runs": 0.10,
    # joined Q/K/V and gate/up copies held between runs (`kernels.hold_joined_weights`): the patch target's for the
    # run, and where both fit a source's for its stage (retain through Stage 1, an unlearned model through its Stage 2)
    "joined_copies": 0.25,
    # a whole fp32 copy of a model for the precision check, of the memory free when it is about to be made
    "fp32_reference": 0.90,
}
"""The shares of the free memory a run hands out, in one place (`MemoryPlan`)."""


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
    free: int,
    held: int = 0,
    cap: int = 64,
) -> int:
    """Largest batch whose estimated peak fits in the ``batch`` share (`SHARES`) of ``free`` bytes less the ``held``
    ones (at least 1): the engine's ``bytes_per_example`` at the longest sequence and window.

    ``held``: what is made after the batch size is chosen and kept while it runs, the fast engine's joined matrices
    (`joined_copy_bytes`) of the models whose joins `MemoryPlan` holds.
    """
    if not examples:
        return 1
    seq_len = max(ex.read_positions.stop for ex in examples)
    window = max(len(ex.window(scope)) for ex in examples)
    per_example = max(1, engine_class(engine).bytes_per_example(model, seq_len, window))
    left = max(0, free - held)
    return int(max(1, min(cap, math.floor(left * SHARES["batch"] / per_example))))


@dataclass(frozen=True)
class MemoryPlan:
    """What one run may hold beyond its models, decided from one measurement of the free memory (`SHARES`).

    Measured once, when the models of Stage 1 are loaded (`measure`): Stage 2 holds full and one unlearned model
    where Stage 1 held full and retain, so the same figure serves both stages. Only a precision check that makes a
    whole fp32 copy of a model measures again, when it is about to make it (`fp32_copy_fits`): once per model.

    Attributes:
        device: where the run computes.
        free: the bytes free when measured.
        joined_bytes: one model's joined copies (`joined_copy_bytes`; 0 for an engine that joins nothing).
    """

    device: str
    free: int
    joined_bytes: int = 0

    @classmethod
    def measure(cls, device: str, full: TLModel, engine: type[PatchEngine] | PatchEngine) -> MemoryPlan:
        """The plan of a run on ``device`` whose patch target is ``full`` on ``engine``, from the memory free
        now."""
        joined = joined_copy_bytes(full) if engine.joins_weights else 0
        return cls(str(device), memory.available_memory_bytes(device), joined)

    def share(self, what: Share) -> int:
        """Bytes of ``what``'s share of the free memory."""
        return int(SHARES[what] * self.free)

    @property
    def holds_target_joins(self) -> bool:
        """Whether the patch target's joined copies are held for the run (else made a block at a time)."""
        return 0 < self.joined_bytes <= self.share("joined_copies")

    @property
    def holds_source_joins(self) -> bool:
        """Whether a source's joined copies are held for its stage too (both the target's and a source's fit)."""
        return 0 < 2 * self.joined_bytes <= self.share("joined_copies")

    def batch_size(
        self, model: TLModel, examples: Sequence[EncodedExample], scope: Scope, engine: Engine
    ) -> int:
        """`choose_batch_size` in what the held joined copies leave of the free memory."""
        held = self.joined_bytes * (int(self.holds_target_joins) + int(self.holds_source_joins))
        return choose_batch_size(model, examples, scope, engine, self.free, held)

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

    def fp32_copy_fits(self, needed: int) -> tuple[bool, int]:
        """Whether a whole fp32 copy of ``needed`` bytes fits its share of the memory free now (measured again: a
        model was swapped in since the run was planned), and that free figure."""
        free = memory.available_memory_bytes(self.device)
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
    "SHARES",
    "CleanRuns",
    "MemoryPlan",
    "Share",
    "choose_batch_size",
    "clean_run_bytes",
    "consecutive_batches",
    "joined_copy_bytes",
    "plan_batches",
    "run_batches",
]

"""Batch planning and running: which examples share a batch, how many fit in memory, and the one runner that
walks the batches and halves a batch that runs out of memory (``run_batches``: the auditor's stages and component
patching both run through it)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from uds_lens import memory
from uds_lens.config import Engine, Scope
from uds_lens.data import EncodedExample
from uds_lens.patching.batch import CleanRun
from uds_lens.patching.engines import engine_class
from uds_lens.sources import as_source
from uds_lens.tl_compat import TLModel

logger = logging.getLogger(__name__)

# The share of the memory free after loading that the auditor's kept clean runs may take, the precision check's fp32
# ones included (half each when the check is on; a quarter is budgeted for one batch's activations,
# choose_batch_size).
CLEAN_CACHE_FRACTION = 0.1
# The share of the memory free after loading that the patch target's joined weights may take to be held between
# runs (`holds_joined_copies`); past it each run makes a block's at a time (the same values, some copying more).
JOINED_FRACTION = 0.25


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
    the model lives where its joins are held (`holds_joined_copies`); otherwise one block's at a time."""
    cfg = model.cfg
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    d_mlp = cfg.d_mlp or 4 * cfg.d_model
    qkv = (cfg.n_heads + 2 * n_kv) * cfg.d_head
    per_block = cfg.d_model * (qkv + 2 * d_mlp) + qkv + 2 * d_mlp + 2 * cfg.d_model
    return int(cfg.n_layers * per_block * itemsize)


def holds_joined_copies(model: TLModel, engine: Engine) -> bool:
    """Whether the patch target's joined weights are held between runs (``kernels.hold_joined_weights``): with
    the fast engine, when they take at most `JOINED_FRACTION` of the memory free now (full and retain loaded: what
    full and one unlearned model will hold in Stage 2). An 8B model on a 48 GB card does not hold them, on an
    80 GB card it does."""
    if not engine_class(engine).joins_weights:
        return False
    free = memory.available_memory_bytes(as_source(model).device)
    return joined_copy_bytes(model) <= JOINED_FRACTION * free


def choose_batch_size(
    model: TLModel,
    examples: Sequence[EncodedExample],
    scope: Scope,
    engine: Engine,
    budget_fraction: float = 0.25,
    cap: int = 64,
    joined_models: int = 1,
) -> int:
    """Largest batch whose estimated peak fits in ``budget_fraction`` of free memory (at least 1): the engine's
    ``bytes_per_example`` at the longest sequence and window.

    The fast engine's joined matrices (`joined_copy_bytes`) are made when the patch target first runs, after the
    batch size is chosen, and are kept while it lives where they are held: ``joined_models`` of them (full, when
    `holds_joined_copies`; a source keeps none) are taken from the free memory first. The naive engine joins
    nothing.
    """
    if not examples:
        return 1
    chosen = engine_class(engine)
    seq_len = max(ex.read_positions.stop for ex in examples)
    window = max(len(ex.window(scope)) for ex in examples)
    per_example = max(1, chosen.bytes_per_example(model, seq_len, window))
    joined = joined_copy_bytes(model) * joined_models if chosen.joins_weights else 0
    free = max(0, memory.available_memory_bytes(as_source(model).device) - joined)
    return int(max(1, min(cap, math.floor(free * budget_fraction / per_example))))


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
    "CLEAN_CACHE_FRACTION",
    "JOINED_FRACTION",
    "choose_batch_size",
    "clean_run_bytes",
    "consecutive_batches",
    "holds_joined_copies",
    "joined_copy_bytes",
    "plan_batches",
    "run_batches",
]

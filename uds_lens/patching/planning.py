"""Batch planning: which examples share a batch, and how many fit in memory."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from uds_lens import memory
from uds_lens.config import ENGINES, Engine, Scope
from uds_lens.data import EncodedExample
from uds_lens.patching.batch import CleanRun
from uds_lens.sources import as_source

# The share of the memory free after loading that the auditor's kept clean runs may take (a quarter is budgeted for
# one batch's activations, choose_batch_size).
CLEAN_CACHE_FRACTION = 0.1


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

    The fast engine packs the windows (its linear layers see only real rows, and the more rows a product has, the
    better it uses the cores); what it still pads is the sequence axis of the clean keys/values and of the attention
    over them, so it sorts by sequence length and counts padding there. The naive engine (the oracle) keeps the
    grouping it has always had, by window length with padding counted in window tokens, so its batches, and with
    them its float noise, are unchanged. A batch of at least ``min_batch`` examples is closed early when
    padding would waste more than ``max_waste`` of its tokens (smaller batches would cost more in per-batch
    overhead than they save).
    """
    if engine not in ENGINES:
        raise ValueError(f"Unknown engine {engine!r}; use one of {ENGINES}.")

    def padded_length(index: int) -> int:
        example = examples[index]
        return len(example.window(scope)) if engine == "naive" else example.read_positions.stop

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


def estimate_bytes_per_example(model: Any, seq_len: int, window: int, engine: Engine) -> int:
    """Rough peak memory of one example in a batch, used to choose batch sizes from a memory budget."""
    cfg = model.cfg
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    layers = cfg.n_layers
    d_mlp = cfg.d_mlp or 4 * cfg.d_model
    if engine == "naive":
        activations = seq_len * (4 * cfg.d_model + 3 * d_mlp + cfg.n_heads * seq_len) * itemsize
        logits = seq_len * cfg.d_vocab * 4
        return int(2 * (activations + logits) + layers * seq_len * cfg.d_model * itemsize)
    kv = 2 * layers * seq_len * n_kv * cfg.d_head * itemsize
    sources = 2 * layers * seq_len * cfg.d_model * itemsize
    runs = layers * window * (4 * cfg.d_model + 3 * d_mlp + cfg.n_heads * (seq_len + window)) * itemsize
    # an upper bound: read_scores holds a slice of the vocabulary (or, published-compat, of the runs) at a time
    logits = layers * window * cfg.d_vocab * 4 * 2
    return int(kv + sources + 2 * runs + logits)


def joined_copy_bytes(model: Any) -> int:
    """Bytes of the matrices the fast engine joins for one model it runs (``kernels._BlockWeights``): per block
    Q/K/V as one ``[d_model, (head + 2 kv_head) d_head]`` matrix and gate/up as one ``[d_model, 2 d_mlp]``, and the
    zero biases it makes for a family without them: a second copy of about 57% of a Llama's weights, kept while
    the model lives."""
    cfg = model.cfg
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    d_mlp = cfg.d_mlp or 4 * cfg.d_model
    qkv = (cfg.n_heads + 2 * n_kv) * cfg.d_head
    per_block = cfg.d_model * (qkv + 2 * d_mlp) + qkv + 2 * d_mlp + 2 * cfg.d_model
    return int(cfg.n_layers * per_block * itemsize)


def choose_batch_size(
    model: Any,
    examples: Sequence[EncodedExample],
    scope: Scope,
    engine: Engine,
    budget_fraction: float = 0.25,
    cap: int = 64,
    joined_models: int = 3,
) -> int:
    """Largest batch whose estimated peak fits in ``budget_fraction`` of free memory (at least 1).

    The fast engine's joined matrices (:func:`joined_copy_bytes`) are made when a model first runs, after the batch
    size is chosen, and are kept while it lives: ``joined_models`` of them (full, retain and the source being
    scored) are taken from the free memory first. The naive engine joins nothing.
    """
    if not examples:
        return 1
    seq_len = max(ex.read_positions.stop for ex in examples)
    window = max(len(ex.window(scope)) for ex in examples)
    per_example = max(1, estimate_bytes_per_example(model, seq_len, window, engine))
    joined = joined_copy_bytes(model) * joined_models if engine == "fast" else 0
    free = max(0, memory.available_memory_bytes(as_source(model).device) - joined)
    return int(max(1, min(cap, math.floor(free * budget_fraction / per_example))))


__all__ = [
    "CLEAN_CACHE_FRACTION",
    "choose_batch_size",
    "clean_run_bytes",
    "estimate_bytes_per_example",
    "joined_copy_bytes",
    "plan_batches",
]

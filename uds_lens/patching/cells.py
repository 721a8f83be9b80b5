"""Stage 2 on chosen cells: patched scores of only the (example, layer) cells asked for, NaN elsewhere.

UDS reads ``d2[l]`` only where ``d1[l] > tau`` (the KE cells, known from Stage 1 before any unlearned model is
loaded), and an example with no KE layer not at all. An engine's ``cell_scores``
(``engines.PatchEngine``) runs exactly those cells:

* the source forward runs only the examples that have a cell, up to the last layer that has one;
* ``fast``: every cell is one *run* of its example's window rows, patched at its layer. The runs of all the cells
  of a batch are packed into one flat row axis (ragged: an example contributes as many runs as it has cells),
  ordered latest start first, so the runs active at a block are a tail of the rows and each block is one call of
  its norms, projections and MLP over exactly the rows that need it. Inside attention each run is laid out as an
  example of its own, reading its example's clean prefix keys and values. The cost is the sum over the cells run
  of ``window x blocks after the patch``: the floor of `stage2_work` priced on those cells;
* ``naive``: one hooked forward per layer over the examples that have a cell at that layer.

A cell is computed from the same inputs and with the same arithmetic as in the every-cell runs
(``engines.fast_patched_scores``, ``engines.NaiveEngine.patched_scores``), in matrix products of other shapes: its score
agrees with theirs to float noise (a reordered sum), not bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from uds_lens.config import EngineSpec
from uds_lens.patching.batch import CleanRun, PatchBatch, WindowPacking
from uds_lens.patching.kernels import (
    AttentionLayout,
    attention_layout,
    block_attention,
    layer_weights,
    mlp_half,
    read_scores,
)
from uds_lens.tl_compat import TLModel

# Read-out rows per call: bounds published-compat's [rows, vocab] logits (the fp32 read-out slices the vocabulary).
_READ_ROWS = 1 << 12


def _starts(lengths: Tensor) -> Tensor:
    """First index of each consecutive segment of these lengths."""
    return torch.cumsum(lengths, 0) - lengths


def _ragged_arange(first: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``cat(arange(f, f + n))`` over the segments, and the segment of each element."""
    segment = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths)
    within = torch.arange(int(lengths.sum()), device=lengths.device) - _starts(lengths)[segment]
    return first[segment] + within, segment


def fast_cell_scores(
    full: TLModel,
    batch: PatchBatch,
    clean: CleanRun,
    acts: Float[Tensor, "layer row d_model"],
    source_rows: list[int],
    spec: EngineSpec,
    cells: Bool[Tensor, "batch layer"],
) -> Float[Tensor, " cell"]:
    """Scores of the ``cells`` (``[batch, layer of spec.layers]``), in ``cells.nonzero()`` order.

    ``acts`` holds the source activations at the window rows of the examples ``source_rows`` (ascending rows of
    ``batch``, every example that has a cell), as ``window_source_activations`` gives them for that sub-batch.
    """
    site, layers = spec.site, list(spec.layers)
    if clean.site != site or not clean.keys:
        raise ValueError("The clean run was made for another site or without keys/values; rebuild it.")
    device = batch.tokens.device
    n_layers = full.cfg.n_layers
    packing = WindowPacking.of(batch)
    window_len = batch.window_len.to(device)
    row_first = _starts(window_len)
    source_first = torch.full_like(row_first, -1)
    source_first[torch.tensor(source_rows, device=device)] = _starts(window_len[source_rows])

    def first_block(layer: int) -> int:
        return layer if site == "resid_pre" else layer + 1

    # One run per cell, latest start first (the runs active at a block are then a tail).
    cell_example, cell_layer = cells.nonzero(as_tuple=True)
    run_start = torch.tensor([first_block(layers[j]) for j in cell_layer.tolist()], device=device)
    order = torch.sort(run_start, descending=True, stable=True).indices
    run_example, run_position, run_start = (
        cell_example.to(device)[order],
        cell_layer.to(device)[order],
        run_start[order],
    )
    run_layer = torch.tensor(layers, device=device)[run_position]
    run_len = window_len[run_example]
    clean_row, row_run = _ragged_arange(row_first[run_example], run_len)
    source_row = source_first[run_example][row_run] + (clean_row - row_first[run_example][row_run])
    row_layer = run_layer[row_run]
    n_runs = int(run_example.shape[0])
    run_row_first = _starts(run_len)

    def clean_values(name: str) -> Float[Tensor, "row d_model"]:
        return clean.window_acts[name][row_layer, clean_row]

    def patched(name: str) -> Float[Tensor, "row d_model"]:
        values = clean_values(name)
        source = acts[run_position[row_run].to(acts.device), source_row.to(acts.device)]
        return torch.where(
            packing.patched[clean_row][:, None], source.to(values.device, values.dtype), values
        )

    with torch.no_grad():
        if site in ("resid_post", "resid_pre"):
            resid = patched(site)
        elif site == "mlp_out":
            resid = clean_values("resid_mid") + patched("mlp_out")
        else:
            resid_mid = (
                patched("resid_mid")
                if site == "resid_mid"
                else clean_values("resid_pre") + patched("attn_out")
            )
            resid = torch.empty_like(resid_mid)
            for layer in torch.unique(run_layer).tolist():
                rows = row_layer == layer
                resid[rows] = mlp_half(layer_weights(full, layer), resid_mid[rows])

        # Each run is an "example" of the attention layout: its window, after its example's clean prefix.
        runs = WindowPacking(
            example=row_run,
            offset=packing.offset[clean_row],
            position=packing.position[clean_row],
            patched=packing.patched[clean_row],
            read_row=torch.zeros(0, dtype=torch.long, device=device),
            width=packing.width,
            prefix_len=packing.prefix_len,
            start=batch.window_start.to(device)[run_example],
        )
        layout = attention_layout(full, runs, resid.dtype, batch.input_length)
        tails: dict[int, AttentionLayout] = {}

        def tail(first_run: int) -> AttentionLayout:
            if first_run not in tails:
                first_slot = first_run * runs.width
                tails[first_run] = dataclasses.replace(
                    layout,
                    n_batch=n_runs - first_run,
                    slot=layout.slot[int(run_row_first[first_run]) :] - first_slot,
                    allowed=layout.allowed[first_run:],
                    slot_position=layout.slot_position[first_slot:],
                    key_position=layout.key_position[first_run:],
                    tables={},  # the rotary tables and window masks of the tail, made on first use
                    masks={},
                )
            return tails[first_run]

        starts = run_start.tolist()
        for block_index in range(min(starts), n_layers):
            first_run = next(r for r, start in enumerate(starts) if start <= block_index)
            first_row = int(run_row_first[first_run])
            examples = run_example[first_run:]
            weights = layer_weights(full, block_index)
            active = resid[first_row:]
            active = (
                active
                + block_attention(
                    weights,
                    active[None],
                    tail(first_run),
                    clean.keys[block_index][examples],
                    clean.values[block_index][examples],
                )[0]
            )
            resid[first_row:] = mlp_half(weights, active)

        # Read rows: each run's entity tokens, from its example's read positions.
        n_entity = torch.bincount(batch.read_batch.to(device), minlength=batch.size)
        entity, read_run = _ragged_arange(_starts(n_entity)[run_example], n_entity[run_example])
        read_row = run_row_first[read_run] + packing.read_row[entity] - row_first[run_example[read_run]]
        scores = torch.empty(n_runs, dtype=torch.float32, device=device)
        read_end = torch.cumsum(n_entity[run_example], 0).tolist()
        first = 0
        while first < n_runs:
            done = read_end[first - 1] if first else 0
            last = first + 1
            while last < n_runs and read_end[last] - done <= _READ_ROWS:
                last += 1
            chosen = slice(done, read_end[last - 1])
            scores[first:last] = read_scores(
                full,
                resid[read_row[chosen]][None],
                batch.read_label.to(device)[entity[chosen]],
                read_run[chosen] - first,
                last - first,
                spec.upcast,
            )[0].float()
            first = last
    result = torch.empty(n_runs, dtype=torch.float32, device=device)
    result[order] = scores
    return result


def stage2_work(
    window_len: Sequence[int], layers: Sequence[int], n_layers: int, site: str, cells: Any = None
) -> int:
    """Token-block evaluations of Stage 2's patched runs: ``sum over cells of window x blocks after the patch``.

    The floor the fast engine is measured against, priced on ``cells`` (``[example, layer]`` booleans; None = every
    cell). Its ratio between the KE cells and every cell is the share of Stage 2 that a KE-only run does.
    """
    first = [layer if site == "resid_pre" else layer + 1 for layer in layers]
    blocks = torch.tensor([n_layers - start for start in first], dtype=torch.long)
    lengths = torch.tensor(list(window_len), dtype=torch.long)
    per_cell = lengths[:, None] * blocks[None, :]
    if cells is not None:
        per_cell = per_cell * torch.as_tensor(cells, dtype=torch.bool)
    return int(per_cell.sum())


def stage2_record(
    window_len: Sequence[int],
    layers: Sequence[int],
    n_layers: int,
    site: str,
    cells: Any,
    tau: float,
) -> dict[str, Any]:
    """What a Stage 2 on ``cells`` (the KE cells chosen with ``tau``; None = every cell) runs, as a result records
    it: ``cells`` (``ke`` or ``all``), ``tau`` (None for ``all``), ``n_cells`` / ``n_cells_run``,
    ``n_examples_run``, and ``work_share``: the share of every cell's `stage2_work` that those cells cost."""
    n, n_cells = len(window_len), len(window_len) * len(layers)
    if cells is None:
        return {
            "cells": "all",
            "tau": None,
            "n_cells": n_cells,
            "n_cells_run": n_cells,
            "n_examples_run": n,
            "work_share": 1.0,
        }
    cells = torch.as_tensor(cells, dtype=torch.bool)
    every = stage2_work(window_len, layers, n_layers, site)
    return {
        "cells": "ke",
        "tau": float(tau),
        "n_cells": n_cells,
        "n_cells_run": int(cells.sum()),
        "n_examples_run": int(cells.any(1).sum()) if n else 0,
        "work_share": stage2_work(window_len, layers, n_layers, site, cells) / every if every else 0.0,
    }


__all__ = ["fast_cell_scores", "stage2_record", "stage2_work"]

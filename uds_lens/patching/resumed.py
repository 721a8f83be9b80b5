"""The fast engine's resumed runs: patched runs that start from the clean run at the patched layer, one kernel.

A patched run at layer ``l`` recomputes only its example's window (the tokens from the first patched position to
the last read one), from the block after the patch (``l`` itself for ``resid_pre``) to the last, its attention
reading the clean run's prefix keys and values (``engines.FastEngine.clean_run``). `resumed_scores` is the one
kernel every such run goes through: it writes the source's activation over the clean one at the patched rows, takes
each block over the runs still active there (runs are ordered latest start first, so those are a tail of the rows
and each block is one call of its norms, projections and MLP over exactly the rows that need it), and reads the
entity log-probs. Which runs there are is a `RunLayout`:

* `LayerRuns`: one run per patched layer, every example's window in each (Stage 1, and Stage 2 on every cell).
  Inside attention each example is laid out once with its runs folded into the rows of one product, so the prefix
  keys and values are read in place;
* `CellRuns`: one run per ``(example, layer)`` cell asked for (KE-only Stage 2): ragged, an example contributes as
  many runs as it has cells, and inside attention each run is laid out as an example of its own, reading its
  example's prefix. The cost is the sum over the cells run of ``window x blocks after the patch``
  (``cells.stage2_work``).

Both layouts put the rows run by run on one flat axis and gather the clean and source values the same way, so a
cell's score is computed from the same inputs with the same arithmetic in either; only the attention's product
shapes and the read-out's slices differ between them (float noise, not bit for bit).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
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

# Read-out rows per call of a `CellRuns` read: bounds published-compat's [rows, vocab] logits (the fp32 read-out
# slices the vocabulary).
_READ_ROWS = 1 << 12


def _first_block(layer: int, spec: EngineSpec) -> int:
    """The first block a run patched at ``layer`` recomputes."""
    return layer if spec.site == "resid_pre" else layer + 1


def _starts(lengths: Tensor) -> Tensor:
    """First index of each consecutive segment of these lengths."""
    return torch.cumsum(lengths, 0) - lengths


def _ragged_arange(first: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``cat(arange(f, f + n))`` over the segments, and the segment of each element."""
    segment = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths)
    within = torch.arange(int(lengths.sum()), device=lengths.device) - _starts(lengths)[segment]
    return first[segment] + within, segment


@dataclass
class RunLayout(ABC):
    """The patched runs of one batch, their rows laid run by run on one flat axis (latest start first).

    Attributes:
        full: the patch target.
        packing: the batch's window rows (``WindowPacking.of``).
        start: each run's first block, descending.
        first_row: each run's first row on the flat axis.
        row_layer: ``[row]`` the layer the run of each row patches.
        clean_row: ``[row]`` the row's place among the batch's window rows (``WindowPacking.of``): its clean
            values and whether it is patched.
        source_layer / source_row: ``[row]`` where its value is in the source activations ``[layer, row,
            d_model]``.
    """

    full: TLModel
    packing: WindowPacking
    start: list[int]
    first_row: list[int]
    row_layer: Int[Tensor, " row"]
    clean_row: Int[Tensor, " row"]
    source_layer: Int[Tensor, " row"]
    source_row: Int[Tensor, " row"]

    @abstractmethod
    def attend(self, weights: Any, active: Tensor, first_run: int, keys: Tensor, values: Tensor) -> Tensor:
        """What the attention of one block (``weights``) adds at the rows ``[row, d_model]`` of the runs from
        ``first_run`` on (``keys``/``values``: the block's clean prefix, ``[batch, kv_head, prefix, d_head]``)."""

    @abstractmethod
    def read(self, resid: Float[Tensor, "row d_model"], batch: PatchBatch, upcast: bool) -> Tensor:
        """The scores of the runs from the final residuals of their rows."""


@dataclass
class LayerRuns(RunLayout):
    """One run per patched layer of ``spec.layers``, every example's window in each; `read` gives ``[batch,
    layer]``."""

    order: list[int] = field(default_factory=list)  # the runs' positions in spec.layers
    layout: AttentionLayout | None = None
    input_length: int = 0  # the batch's whole input length (a length-dependent rotary embedding reads it)

    @classmethod
    def of(cls, full: TLModel, batch: PatchBatch, spec: EngineSpec) -> LayerRuns:
        packing = WindowPacking.of(batch)
        layers = list(spec.layers)
        order = sorted(range(len(layers)), key=lambda i: -_first_block(layers[i], spec))
        rows, device = packing.rows, batch.tokens.device
        position = torch.tensor(order, device=device)
        row = torch.arange(rows, device=device).repeat(len(order))
        return cls(
            full=full,
            packing=packing,
            start=[_first_block(layers[i], spec) for i in order],
            first_row=[run * rows for run in range(len(order))],
            row_layer=torch.tensor(layers, device=device)[position].repeat_interleave(rows),
            clean_row=row,
            source_layer=position.repeat_interleave(rows),
            source_row=row,
            order=order,
            input_length=batch.input_length,
        )

    def attend(self, weights: Any, active: Tensor, first_run: int, keys: Tensor, values: Tensor) -> Tensor:
        if self.layout is None:
            self.layout = attention_layout(self.full, self.packing, active.dtype, self.input_length)
        runs = active.view(len(self.start) - first_run, self.packing.rows, -1)
        return block_attention(weights, runs, self.layout, keys, values).flatten(0, 1)

    def read(self, resid: Float[Tensor, "row d_model"], batch: PatchBatch, upcast: bool) -> Tensor:
        per_run = resid.view(len(self.start), self.packing.rows, -1)
        scores = read_scores(
            self.full,
            per_run[:, self.packing.read_row],
            batch.read_label,
            batch.read_batch,
            batch.size,
            upcast,
        )
        result = torch.empty(batch.size, len(self.order), dtype=scores.dtype, device=scores.device)
        result[:, self.order] = scores.T
        return result


@dataclass
class CellRuns(RunLayout):
    """One run per cell of ``cells`` (``[batch, layer of spec.layers]``), in ``cells.nonzero()`` order once read
    (`read` gives ``[cell]``); the source activations hold the window rows of the examples ``source_rows`` only."""

    run_example: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    order: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    runs: WindowPacking | None = None
    layout: AttentionLayout | None = None
    tails: dict[int, AttentionLayout] = field(default_factory=dict)
    input_length: int = 0

    @classmethod
    def of(
        cls,
        full: TLModel,
        batch: PatchBatch,
        cells: Bool[Tensor, "batch layer"],
        source_rows: list[int],
        spec: EngineSpec,
    ) -> CellRuns:
        device = batch.tokens.device
        packing = WindowPacking.of(batch)
        layers = list(spec.layers)
        window_len = batch.window_len.to(device)
        row_first = _starts(window_len)
        source_first = torch.full_like(row_first, -1)
        source_first[torch.tensor(source_rows, device=device)] = _starts(window_len[source_rows])
        # one run per cell, latest start first (the runs active at a block are then a tail)
        cell_example, cell_layer = cells.nonzero(as_tuple=True)
        run_start = torch.tensor([_first_block(layers[j], spec) for j in cell_layer.tolist()], device=device)
        order = torch.sort(run_start, descending=True, stable=True).indices
        run_example = cell_example.to(device)[order]
        run_position = cell_layer.to(device)[order]
        run_len = window_len[run_example]
        clean_row, row_run = _ragged_arange(row_first[run_example], run_len)
        source_row = source_first[run_example][row_run] + (clean_row - row_first[run_example][row_run])
        # each run is an "example" of the attention layout: its window, after its example's clean prefix
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
        return cls(
            full=full,
            packing=packing,
            start=run_start[order].tolist(),
            first_row=_starts(run_len).tolist(),
            row_layer=torch.tensor(layers, device=device)[run_position][row_run],
            clean_row=clean_row,
            source_layer=run_position[row_run],
            source_row=source_row,
            run_example=run_example,
            order=order,
            runs=runs,
            input_length=batch.input_length,
        )

    def _tail(self, first_run: int, dtype: torch.dtype) -> AttentionLayout:
        """The attention layout of the runs from ``first_run`` on (made on first use, kept for the batch)."""
        if self.layout is None:
            assert self.runs is not None  # made by `of`
            self.layout = attention_layout(self.full, self.runs, dtype, self.input_length)
        if first_run not in self.tails:
            layout, width = self.layout, self.packing.width
            first_slot = first_run * width
            self.tails[first_run] = dataclasses.replace(
                layout,
                n_batch=len(self.start) - first_run,
                slot=layout.slot[self.first_row[first_run] :] - first_slot,
                allowed=layout.allowed[first_run:],
                slot_position=layout.slot_position[first_slot:],
                key_position=layout.key_position[first_run:],
                tables={},  # the rotary tables and window masks of the tail, made on first use
                masks={},
            )
        return self.tails[first_run]

    def attend(self, weights: Any, active: Tensor, first_run: int, keys: Tensor, values: Tensor) -> Tensor:
        examples = self.run_example[first_run:]
        tail = self._tail(first_run, active.dtype)
        return block_attention(weights, active[None], tail, keys[examples], values[examples])[0]

    def read(self, resid: Float[Tensor, "row d_model"], batch: PatchBatch, upcast: bool) -> Tensor:
        """Each run's entity tokens, from its example's read positions, ``_READ_ROWS`` read rows a call."""
        device, n_runs = resid.device, len(self.start)
        run_example, run_first = self.run_example, torch.tensor(self.first_row, device=device)
        row_first = _starts(batch.window_len.to(device))
        n_entity = torch.bincount(batch.read_batch.to(device), minlength=batch.size)
        entity, read_run = _ragged_arange(_starts(n_entity)[run_example], n_entity[run_example])
        read_row = run_first[read_run] + self.packing.read_row[entity] - row_first[run_example[read_run]]
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
                self.full,
                resid[read_row[chosen]][None],
                batch.read_label.to(device)[entity[chosen]],
                read_run[chosen] - first,
                last - first,
                upcast,
            )[0].float()
            first = last
        result = torch.empty(n_runs, dtype=torch.float32, device=device)
        result[self.order] = scores
        return result


def resumed_scores(
    runs: RunLayout,
    batch: PatchBatch,
    clean: CleanRun,
    acts: Float[Tensor, "layer row d_model"] | None,
    spec: EngineSpec,
) -> Tensor:
    """The scores of the patched runs ``runs`` of ``batch`` (the module docstring): the source activations ``acts``
    (``[layer of spec.layers, row, d_model]``, at the rows ``runs`` says) written at the patched rows of each run,
    or, with ``acts=None``, the clean ones written back (the engine's own unpatched baseline); ``clean`` is the
    batch's clean run (``engines.FastEngine.clean_run``)."""
    full, site = runs.full, spec.site
    if clean.site != site or not clean.keys:
        raise ValueError("The clean run was made for another site or without keys/values; rebuild it.")
    patch_rows = runs.packing.patched[runs.clean_row][:, None]

    def clean_values(name: str) -> Float[Tensor, "row d_model"]:
        return clean.window_acts[name][runs.row_layer, runs.clean_row]

    def patched(name: str) -> Float[Tensor, "row d_model"]:
        values = clean_values(name)
        if acts is None:
            return values
        source = acts[runs.source_layer.to(acts.device), runs.source_row.to(acts.device)]
        return torch.where(patch_rows, source.to(values.device, values.dtype), values)

    with torch.no_grad():
        if site in ("resid_post", "resid_pre"):
            resid = patched(site)
        elif site == "mlp_out":
            resid = clean_values("resid_mid") + patched("mlp_out")
        else:  # the patch is inside the block: its MLP half runs on the patched resid_mid
            resid_mid = (
                patched("resid_mid")
                if site == "resid_mid"
                else clean_values("resid_pre") + patched("attn_out")
            )
            resid = torch.empty_like(resid_mid)
            for layer in torch.unique(runs.row_layer).tolist():
                rows = runs.row_layer == layer
                resid[rows] = mlp_half(layer_weights(full, layer), resid_mid[rows])
        for block_index in range(min(runs.start), full.cfg.n_layers):
            first_run = next(r for r, start in enumerate(runs.start) if start <= block_index)
            first_row = runs.first_row[first_run]
            weights = layer_weights(full, block_index)
            active = resid[first_row:]
            active = active + runs.attend(
                weights, active, first_run, clean.keys[block_index], clean.values[block_index]
            )
            resid[first_row:] = mlp_half(weights, active)
        return runs.read(resid, batch, spec.upcast)


__all__ = ["CellRuns", "LayerRuns", "RunLayout", "resumed_scores"]

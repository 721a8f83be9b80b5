"""Stage 2 on chosen cells: what a Stage 2 on only the (example, layer) cells asked for runs, and what results
record of it.

UDS reads ``d2[l]`` only where ``d1[l] > tau`` (the KE cells, known from Stage 1 before any unlearned model is
loaded), and an example with no KE layer not at all. An engine's ``cell_scores`` (``engines.PatchEngine``) runs
exactly those cells, NaN elsewhere:

* the source forward runs only the examples that have a cell, up to the last layer that has one;
* ``fast``: every cell is one resumed run of its example's window, patched at its layer (``resumed.CellRuns``:
  the runs of all the cells of a batch on one ragged row axis, through the same kernel as the every-cell runs,
  ``resumed.resumed_scores``). The cost is the sum over the cells run of ``window x blocks after the patch``: the
  floor of `stage2_work` priced on those cells;
* ``naive``: one hooked forward per layer over the examples that have a cell at that layer.

A cell is computed from the same inputs and with the same arithmetic as in the every-cell runs, in matrix
products of other shapes: its score agrees with theirs to float noise (a reordered sum), not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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


__all__ = ["stage2_record", "stage2_work"]

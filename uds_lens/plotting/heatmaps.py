"""The layer x example heatmap: one per-layer quantity of every example, the KE cells marked.

The shape TransformerLens/ARENA users read activation-patching results in: ``px.imshow`` with y = layer and x =
example, ``d1``/``d2`` on ``RdBu`` with midpoint 0 (``d1[l] = baseline[l] - s1[l]``: blue where patching the retain
model's layer ``l`` in removes the fact, so where the knowledge lives), ``ler`` on a sequential 0-1 scale and blank
outside the KE cells (``d1 > tau``), where ``d2 / d1`` is a ratio of noise. Examples can be sorted by their ``UDS_i``,
by their mean ``d1`` (Stage 1: the same order for every model audited against one full/retain pair, so heatmaps of
several models line up) or grouped by prompt type, and every cell's hover names the example's question and entity.
The KE cells are marked (or, when they are most cells, the cells that are not KE), clipped KE cells (``d2 > d1``,
LER cut to 1: over-disruption) get a red cross on ``d2`` and ``ler`` maps, and a cell without a value is
plain grey, named in the legend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from uds_lens.config import DEFAULT_TAU
from uds_lens.data import Example
from uds_lens.layer_table import one_site
from uds_lens.plotting.style import (
    CLIPPED_MARK,
    DELTA_SCALE,
    LER_SCALE,
    VALUE_LABELS,
    examples_text,
    layer_ticks,
    set_title,
    tau_text,
    value_label,
)
from uds_lens.plotting.tables import Result, ke_cells, result_tables, result_tau

ExampleData: TypeAlias = pd.DataFrame | Sequence[Example | Mapping[str, Any]]
"""Examples whose ``idx, question, entity, prompt_type`` the hover shows: a table, ``Example`` records or dicts."""


def layer_heatmap(
    result: Result,
    value: str = "d1",
    examples: pd.DataFrame | None = None,
    data: ExampleData | None = None,
    sort_by: str | None = None,
    mark_ke: bool | None = None,
    ke_only: bool | None = None,
    site: str | None = None,
    tau: float = DEFAULT_TAU,
    title: str | None = None,
    order: Sequence[Any] | None = None,
    mark_clipped: bool | None = None,
) -> go.Figure:
    """Heatmap of one per-layer quantity, y = layer, x = example, with KE cells marked.

    Args:
        result: a ``UDSResult`` (uses ``.layers`` and ``.examples``) or the long layers table.
        value: ``"d1"``, ``"d2"`` (RdBu, midpoint 0), ``"ler"`` (sequential 0-1) or any numeric column.
        examples: the examples table (for sorting and hover) when ``result`` is a bare layers table.
        data: optional examples with ``idx, question, entity`` (``list[Example]`` or a DataFrame) for hover text.
        sort_by: ``"uds"`` (ascending, undefined last), ``"d1"`` (mean Stage-1 delta over layers, largest first:
            one order for every model of a full/retain pair), ``"prompt_type"`` (grouped, then UDS) or ``"idx"``;
            default ``"uds"`` when an examples table is available, else ``"idx"``.
        mark_ke: mark the KE cells (``ke`` column, else ``d1 > tau``) with an open square, or, when more than half
            of the cells are KE, the other cells with a dot; default: unless ``ke_only``, where the blank non-KE
            cells already mark them.
        ke_only: blank the non-KE cells (default: True for ``ler``, whose value outside KE layers is noise).
        site: which patching site to show when the table has several (default resid_post).
        tau: KE threshold, used only when the table has no ``ke`` column (one that has it shows the tau the result
            was scored with).
        title: figure title (default: the result's model name and the value). Under it the figure always states
            its basis: the number of examples, tau with its unit and the order of the examples.
        order: the examples' ``idx`` in the order to draw them (overrides ``sort_by``): pass one order to every
            heatmap of a notebook.
        mark_clipped: cross the clipped KE cells (``d2 > d1``); default for ``d2`` and ``ler``.

    Returns:
        The figure: trace 0 is the heatmap, then (if any) the KE markers, the clipped-cell crosses and the legend
        entry of the grey no-value cells.
    """
    layers, result_examples = result_tables(result)
    examples = examples if examples is not None else result_examples
    layers = one_site(layers, site)
    if value not in layers.columns:
        raise ValueError(f"column {value!r} is not in the layers table (columns: {list(layers.columns)})")
    if ke_only is None:
        ke_only = value == "ler"
    if mark_ke is None:
        mark_ke = not ke_only
    layers = layers.assign(_ke=ke_cells(layers, tau).to_numpy())
    info = _hover_frame(examples, data)
    if sort_by is None:
        sort_by = "uds" if info is not None and "uds" in info.columns else "idx"
    if order is None:
        order = _example_order(list(pd.unique(layers["idx"])), info, sort_by, layers)
    else:
        order = [idx for idx in order if idx in set(layers["idx"])]
        if not order:
            raise ValueError("order names none of the examples in the layers table")
        layers = layers[layers["idx"].isin(order)]
        sort_by = "given"
    if mark_clipped is None:
        mark_clipped = value in ("d2", "ler")
    layer_ids = sorted(pd.unique(layers["layer"]))

    # One (layer, example) cell per row, placed by integer index: pandas' pivot_table took a third of a report.
    cells = layers.drop_duplicates(["layer", "idx"])
    cell_row = cells["layer"].map({layer: i for i, layer in enumerate(layer_ids)}).to_numpy()
    cell_col = cells["idx"].map({idx: j for j, idx in enumerate(order)}).to_numpy()

    def grid(column: str) -> pd.DataFrame:
        values = np.full((len(layer_ids), len(order)), np.nan)
        values[cell_row, cell_col] = cells[column].to_numpy(dtype=float)
        return pd.DataFrame(values, index=layer_ids, columns=order)

    z = grid(value).astype(float)
    ke = grid("_ke").fillna(False).astype(bool)
    if ke_only:
        z = z.where(ke)
    labels = [str(i) for i in order]

    if value in ("ler", "uds"):
        colour = {"color_continuous_scale": LER_SCALE, "zmin": 0.0, "zmax": 1.0}
    elif value in ("d1", "d2"):
        # d1 and d2 of one result share one symmetric scale, so their heatmaps can be compared cell by cell.
        both = layers[[c for c in ("d1", "d2") if c in layers.columns]].to_numpy(dtype=float)
        bound = float(np.nanmax(np.abs(both))) if np.isfinite(both).any() else 1.0
        colour = {"color_continuous_scale": DELTA_SCALE, "zmin": -bound, "zmax": bound}
    else:
        colour = {"color_continuous_scale": LER_SCALE}
    fig = px.imshow(
        z.to_numpy(),
        x=labels,
        y=layer_ids,
        origin="lower",
        aspect="auto",
        labels={"x": "example (idx)", "y": "layer", "color": value_label(value)},
        **colour,
    )
    if value in ("d1", "d2"):
        fig.update_layout(coloraxis_cmid=0.0)

    # Hover: one row of facts per example, repeated over layers.
    columns: dict[str, list[Any]] = {"uds": [], "prompt_type": [], "question": [], "entity": []}
    for idx in order:
        row = info.loc[idx] if info is not None and idx in info.index else None
        for key in columns:
            item = row.get(key) if row is not None else None
            if key == "uds":
                item = "undefined" if item is None or pd.isna(item) else f"{float(item):.3f}"
            columns[key].append(
                "" if item is None or (isinstance(item, float) and np.isnan(item)) else str(item)
            )
    values = {
        name: grid(name).astype(float).to_numpy() for name in ("d1", "d2", "ler") if name in layers.columns
    }
    custom = np.empty((len(layer_ids), len(order), 9), dtype=object)
    for j, idx in enumerate(order):
        for i in range(len(layer_ids)):
            custom[i, j] = [
                str(idx),
                columns["prompt_type"][j],
                columns["uds"][j],
                columns["question"][j][:120],
                columns["entity"][j],
                _fmt(values.get("d1"), i, j),
                _fmt(values.get("d2"), i, j),
                _fmt(values.get("ler"), i, j),
                "yes" if ke.iat[i, j] else "no",
            ]
    fig.data[0].customdata = custom
    fig.data[0].hovertemplate = (
        "example %{customdata[0]} · layer %{y}<br>"
        "type: %{customdata[1]} · UDS<sub>i</sub>: %{customdata[2]}<br>"
        "Q: %{customdata[3]}<br>entity: %{customdata[4]}<br>"
        "d1 = %{customdata[5]} · d2 = %{customdata[6]} · LER = %{customdata[7]} · KE: %{customdata[8]}"
        "<extra></extra>"
    )

    if mark_ke:
        mostly_ke = ke.to_numpy().mean() > 0.5
        marker = (
            {"symbol": "circle", "size": 4, "color": "rgba(0,0,0,0.6)"}
            if mostly_ke
            else {"symbol": "square-open", "size": 6, "color": "rgba(0,0,0,0.55)", "line": {"width": 1}}
        )
        share = f"{ke.to_numpy().mean():.0%} of cells are KE"
        name = f"not KE (d1 ≤ τ; {share})" if mostly_ke else f"KE layer (d1 > τ; {share})"
        _mark_cells(fig, ~ke.to_numpy() if mostly_ke else ke.to_numpy(), labels, layer_ids, marker, name)
    if mark_clipped and {"d1", "d2"} <= set(layers.columns):
        clipped = ke.to_numpy() & (grid("d2").to_numpy() > grid("d1").to_numpy())
        share = clipped.sum() / max(int(ke.to_numpy().sum()), 1)
        name = f"clipped: d2 > d1, LER cut to 1 ({share:.0%} of KE cells)"
        _mark_cells(fig, clipped, labels, layer_ids, CLIPPED_MARK, name)
    if np.isnan(z.to_numpy()).any():
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker={
                    "symbol": "square",
                    "size": 10,
                    "color": "#e5e5e5",
                    "line": {"width": 1, "color": "#999"},
                },
                name="grey: no value" + (" (not KE)" if ke_only else ""),
                showlegend=True,
            )
        )

    if sort_by == "prompt_type" and info is not None:
        _mark_groups(fig, order, info)

    # Explicit ranges: the KE marker trace would otherwise pad the category axis with an empty column each side.
    fig.update_xaxes(
        type="category", range=[-0.5, len(order) - 0.5], showticklabels=len(order) <= 60, tickangle=-90
    )
    fig.update_yaxes(
        range=[min(layer_ids) - 0.5, max(layer_ids) + 0.5], showgrid=False, **layer_ticks(layer_ids)
    )
    fig.update_xaxes(showgrid=False, zeroline=False)
    fig.update_yaxes(zeroline=False)
    fig.update_layout(
        plot_bgcolor="#e5e5e5",
        # Under the x axis: the title and the prompt-type group labels (on the heatmap's top edge) keep the top.
        legend={"orientation": "h", "y": -0.2, "yanchor": "top", "x": 0.0, "xanchor": "left"},
    )
    scored_tau = result_tau(result, tau) if "ke" in layers.columns else tau
    set_title(
        fig,
        title or f"{_model_prefix(result)}{VALUE_LABELS.get(value, value)} per layer and example",
        [examples_text(len(order)), f"KE: d1 > {tau_text(scored_tau)}", ORDER_TEXT[sort_by]],
    )
    fig.update_layout(margin={"b": 120})
    return fig


ORDER_TEXT = {
    "uds": "examples by UDS_i, lowest first (undefined last)",
    "d1": "examples by mean d1 over layers, largest first",
    "prompt_type": "examples grouped by prompt type, then by UDS_i",
    "idx": "examples by idx",
    "given": "examples in the order given",
}
"""How a heatmap's examples are ordered, as its basis states it (one per ``sort_by``, and ``order=``)."""


def _model_prefix(result: Result) -> str:
    name = getattr(result, "name", None)
    return f"{name}: " if name else ""


def _fmt(grid: np.ndarray | None, i: int, j: int) -> str:
    if grid is None or not np.isfinite(grid[i, j]):
        return "–"
    return f"{grid[i, j]:.3f}"


def _mark_cells(
    fig: go.Figure,
    cells: np.ndarray,
    labels: list[str],
    layer_ids: list[Any],
    marker: dict[str, Any],
    name: str,
) -> None:
    """A marker on every true cell of ``cells`` (``[layer, example]``), one legend entry ``name``, no hover."""
    rows, cols = np.nonzero(cells)
    fig.add_trace(
        go.Scatter(
            x=[labels[j] for j in cols],
            y=[layer_ids[i] for i in rows],
            mode="markers",
            marker=marker,
            name=name,
            hoverinfo="skip",
            showlegend=True,
        )
    )


def _mark_groups(fig: go.Figure, order: list[Any], info: pd.DataFrame) -> None:
    """Separate prompt-type groups with vertical lines and name them above the heatmap."""
    types = info.reindex(order).get("prompt_type")
    if types is None:
        return
    types = types.fillna("(none)").astype(str).tolist()
    start = 0
    for position in range(1, len(order) + 1):
        if position == len(order) or types[position] != types[start]:
            fig.add_annotation(
                x=(start + position - 1) / 2,
                y=1.0,
                yref="paper",
                yanchor="bottom",
                text=types[start],
                showarrow=False,
                font={"size": 10},
            )
            if position < len(order):
                fig.add_vline(x=position - 0.5, line={"color": "white", "width": 2})
            start = position


def _hover_frame(examples: pd.DataFrame | None, data: ExampleData | None) -> pd.DataFrame | None:
    """Per-example hover columns (question, entity, prompt_type, uds) indexed by idx."""
    parts = []
    if isinstance(examples, pd.DataFrame) and "idx" in examples.columns:
        parts.append(examples.set_index("idx"))
    if data is not None:
        if isinstance(data, pd.DataFrame):
            records = data
        else:
            records = pd.DataFrame(
                [
                    {key: getattr(item, key, None) for key in ("idx", "question", "entity", "prompt_type")}
                    if not isinstance(item, Mapping)
                    else dict(item)
                    for item in data
                ]
            )
        if "idx" in records.columns:
            records = records.set_index("idx")
            if parts:  # texts passed explicitly win over those the result carries
                parts[0] = parts[0][[c for c in parts[0].columns if c not in records.columns or c == "uds"]]
                records = records[[c for c in records.columns if c not in parts[0].columns]]
            parts.append(records)
    if not parts:
        return None
    merged = parts[0] if len(parts) == 1 else parts[0].join(parts[1], how="outer")
    return merged[~merged.index.duplicated()]


def _example_order(
    idxs: Sequence[Any], info: pd.DataFrame | None, sort_by: str | None, layers: pd.DataFrame
) -> list[Any]:
    if sort_by in (None, "idx"):
        return sorted(idxs)
    if sort_by == "d1":
        mean_d1 = layers.groupby("idx")["d1"].mean().reindex(idxs)
        keys = pd.DataFrame({"d1": mean_d1.to_numpy(dtype=float), "idx": list(idxs)})
        return list(keys.sort_values(["d1", "idx"], ascending=[False, True], na_position="last")["idx"])
    if info is None:
        raise ValueError(f"sort_by={sort_by!r} needs the examples table (pass examples= or a UDSResult)")
    frame = info.reindex(idxs)
    empty = pd.Series(np.nan, index=frame.index)
    keys = pd.DataFrame(
        {
            "prompt_type": frame.get("prompt_type", empty).fillna("(none)").astype(str).to_numpy(),
            "uds": pd.to_numeric(frame.get("uds", empty), errors="coerce").to_numpy(dtype=float),
            "idx": list(idxs),
        }
    )
    # Undefined UDS (no KE layer) goes last.
    if sort_by == "uds":
        return list(keys.sort_values(["uds", "idx"], na_position="last")["idx"])
    if sort_by == "prompt_type":
        return list(keys.sort_values(["prompt_type", "uds", "idx"], na_position="last")["idx"])
    raise ValueError(f"sort_by must be None, 'idx', 'uds', 'd1' or 'prompt_type', got {sort_by!r}")

"""Plotly figures for UDS results: layers x examples, stages, models, components, lenses, meta-evaluation.

UDS is read per example and per layer. For example ``i`` and layer ``l``, ``d1[l] = s0 - s_S1[l]`` is the drop in the
full model's mean entity log-prob when the retain model's residual is patched in at layer ``l`` (Stage 1, how much
forget-set knowledge layer ``l`` carries), and ``d2[l] = s0 - s_S2[l]`` the same drop with the unlearned model as the
source (Stage 2, how much of it is gone). Layers with ``d1 > tau`` are knowledge-encoding (KE) layers, the layer erasure
ratio there is ``LER = clip(d2 / d1, 0, 1)``, and ``UDS_i = sum_KE d1 * LER / sum_KE d1`` (0 = the knowledge is fully
recoverable, as in ``full``; 1 = erased as deeply as in ``retain``). The symbols are defined once in ``uds.py``.

Every function here takes result tables (the pandas DataFrames of ``UDSResult`` and of the diagnostics, see SPEC §1.8)
or an object that carries them (``.examples``, ``.layers``, ``.summary``) and returns a ``plotly.graph_objects.Figure``;
none of them shows it. The tables they read:

- examples: ``idx, prompt_type, n_entity_tokens, n_ke, uds, status, skip_reason`` (extra columns such as ``question`` and
  ``entity`` are used for hover text when present);
- layers (long): ``idx, layer, site, s0, baseline_score, s1_score, s2_score, d1, d2, ke, ler``;
- components: ``site, layer, mean_d1, mean_d2`` (optionally ``std_d1, std_d2``);
- lens layers: ``idx, layer, d1, d2, ler`` (the logit lens in the same shape as UDS);
- meta-evaluation metrics: ``model, pool`` and one column per metric (or long ``model, pool, metric, value``);
- robustness: ``model, metric, before, after`` (optionally ``role``);
- tokens: ``position, token, logprob_full, logprob_patched, is_entity``.

One convention across figures: **colour** says which thing is compared (model, patching site, readout: the
``PALETTE`` in order, S1 shared by all models in grey), **dash** says which stage (``STAGE_DASH``: S1/``d1`` solid,
S2/``d2`` dashed), thresholds and references are dotted grey lines (``tau``), and the KE layers of one example are a
shaded band. Heatmaps follow the TransformerLens/ARENA convention: ``px.imshow``, y = layer, x = example (or head,
token), ``RdBu`` with midpoint 0 for deltas (as ARENA's ``imshow``: positive deltas, where the patch removed
knowledge, are blue) and a sequential 0-1 scale for LER and UDS. ``save(fig, path)`` writes PNG/SVG/PDF (kaleido,
the ``[figures]`` extra) or self-contained offline HTML.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = [
    "ERASURE_METRICS",
    "STAGE_DASH",
    "component_heatmap",
    "component_patching",
    "example_curves",
    "save",
    "layer_heatmap",
    "lens_vs_uds_example",
    "layerwise_methods",
    "lens_vs_uds_models",
    "model_frame",
    "pool_histograms",
    "prompt_type_bar",
    "published_scatter",
    "rmu_layer_profile",
    "rmu_target_layer",
    "robustness_scatter",
    "stage_curves",
    "tau_curves",
    "token_logprobs",
    "uds_bar",
    "uds_distribution",
]

# Metrics oriented so that high = erased; they are inverted before the P/N AUC (P saw the forget set, so P should
# score *low* on them).
ERASURE_METRICS = frozenset(
    {"uds", "logit_lens", "tuned_lens", "cka", "fisher", "fisher_masked", "rsa", "svcca", "pwcca", "probing"}
)

# Qualitative palette shared by every multi-model figure so one model keeps one colour across figures.
PALETTE = px.colors.qualitative.Plotly
S1_COLOUR = "#444444"
DELTA_SCALE = "RdBu"  # diverging, white at 0 (midpoint set per figure), as TransformerLens/ARENA heatmaps
STAGE_DASH = {"d1": "solid", "d2": "dash"}  # S1 (retain as source) solid, S2 (unlearned as source) dashed
REFERENCE_LINE = {"color": "grey", "dash": "dot", "width": 1}  # tau and other thresholds
KE_BAND = "rgba(255, 190, 0, 0.16)"
LER_SCALE = "Viridis"
VALUE_LABELS = {
    "d1": "Δ<sup>S1</sup> (retain → full)",
    "d2": "Δ<sup>S2</sup> (unlearned → full)",
    "ler": "LER",
    "s1_score": "S1 score",
    "s2_score": "S2 score",
    "s0": "S0 (clean full)",
    "baseline_score": "baseline (unpatched)",
}


# ----------------------------------------------------------------------------------------------------------------------
# Table helpers


def _tables(result: Any) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Return (layers, examples) from a result-like object or a layers DataFrame."""
    if isinstance(result, pd.DataFrame):
        return result, None
    layers = getattr(result, "layers", None)
    if not isinstance(layers, pd.DataFrame):
        raise TypeError(
            f"expected a layers DataFrame or an object with a .layers DataFrame (a UDSResult), got {type(result).__name__}"
        )
    examples = getattr(result, "examples", None)
    return layers, examples if isinstance(examples, pd.DataFrame) else None


def _one_site(layers: pd.DataFrame, site: str | None) -> pd.DataFrame:
    """Keep one patching site of a long layers table (the requested one, else resid_post, else the first)."""
    if "site" not in layers.columns:
        return layers
    sites = list(dict.fromkeys(layers["site"].dropna()))
    if site is None:
        if len(sites) <= 1:
            return layers
        site = "resid_post" if "resid_post" in sites else sites[0]
    if site not in sites:
        raise ValueError(f"site {site!r} is not in the layers table (sites: {sites})")
    return layers[layers["site"] == site]


def _named(results: Any) -> dict[str, Any]:
    """Normalise one result or a mapping/sequence of results to {name: result}."""
    if isinstance(results, Mapping):
        return {str(name): value for name, value in results.items()}
    if isinstance(results, pd.DataFrame) or hasattr(results, "layers") or hasattr(results, "examples"):
        return {_result_name(results, 0): results}
    if isinstance(results, Sequence) and not isinstance(results, str):
        return {_result_name(r, i): r for i, r in enumerate(results)}
    raise TypeError(
        f"expected a result, a list of results or a {{name: result}} mapping, got {type(results).__name__}"
    )


def _result_name(result: Any, position: int) -> str:
    summary = getattr(result, "summary", None)
    if isinstance(summary, Mapping) and summary.get("name"):
        return str(summary["name"])
    return f"model {position}"


def _long_by_model(tables: Any, attribute: str = "layers") -> pd.DataFrame:
    """Concatenate per-model tables into one with a ``model`` column (or pass a table that already has one)."""
    if isinstance(tables, pd.DataFrame) and "model" in tables.columns:
        return tables
    frames = []
    for name, value in _named(tables).items():
        frame = value if isinstance(value, pd.DataFrame) else getattr(value, attribute, None)
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"model {name!r}: expected a DataFrame or an object with .{attribute}")
        frames.append(frame.assign(model=name))
    if not frames:
        raise ValueError("no results given")
    return pd.concat(frames, ignore_index=True)


def _ke_mask(layers: pd.DataFrame, tau: float) -> pd.Series:
    if "ke" in layers.columns:
        return layers["ke"].fillna(False).astype(bool)
    return layers["d1"] > tau


def _layer_ticks(layers: Any) -> dict[str, Any]:
    """Integer layer ticks (plotly would otherwise label 0.5, 1.5 ... on a few-layer model)."""
    values = pd.unique(pd.Series(list(layers)).dropna())
    span = int(values.max() - values.min()) + 1 if len(values) else 1
    return {"tickmode": "linear", "tick0": 0, "dtick": max(1, -(-span // 16))}


def _colour(position: int) -> str:
    return PALETTE[position % len(PALETTE)]


def _rgba(hex_colour: str, alpha: float) -> str:
    red, green, blue = (int(hex_colour.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({red},{green},{blue},{alpha})"


def _band(frame: pd.DataFrame, column: str, band: str | None) -> tuple[pd.Series, pd.Series]:
    """Mean and half-width of the band around it, per layer."""
    grouped = frame.groupby("layer")[column]
    mean = grouped.mean()
    if band is None:
        return mean, mean * 0.0
    std = grouped.std(ddof=1).fillna(0.0)
    if band == "std":
        return mean, std
    count = grouped.count().clip(lower=1)
    sem = std / np.sqrt(count)
    if band == "sem":
        return mean, sem
    if band == "ci95":
        return mean, 1.96 * sem
    raise ValueError(f"band must be 'std', 'sem', 'ci95' or None, got {band!r}")


def _add_band(fig: go.Figure, x: Any, mean: Any, half: Any, colour: str, name: str, **cell: Any) -> None:
    x = list(x)
    upper = list(np.asarray(mean) + np.asarray(half))
    lower = list(np.asarray(mean) - np.asarray(half))
    fig.add_trace(
        go.Scatter(
            x=x + x[::-1],
            y=upper + lower[::-1],
            mode="lines",
            fill="toself",
            fillcolor=_rgba(colour, 0.18),
            line={"width": 0},
            hoverinfo="skip",
            showlegend=False,
            legendgroup=name,
            name=f"{name} band",
        ),
        **cell,
    )


def _bootstrap_ci(values: np.ndarray, n_boot: int = 1000, seed: int = 0) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = rng.choice(values, size=(n_boot, len(values)), replace=True).mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def _ci_pair(ci: Any) -> tuple[float, float] | None:
    if ci is None:
        return None
    if isinstance(ci, Mapping):
        low, high = ci.get("low", ci.get("lo")), ci.get("high", ci.get("hi"))
    elif isinstance(ci, Sequence) and len(ci) == 2:
        low, high = ci
    else:
        return None
    if low is None or high is None:
        return None
    return float(low), float(high)


def model_frame(results: Any, roles: Mapping[str, str] | None = None, n_boot: int = 1000) -> pd.DataFrame:
    """One row per model: UDS, its 95% CI and the example counts.

    Args:
        results: ``{name: result}`` where a result has ``.summary`` (``uds``, ``ci95``, counts) and/or ``.examples``;
            or a DataFrame already holding ``model, uds, ci_low, ci_high``. A missing CI is bootstrapped over examples.
        roles: optional ``{name: role}`` (zoo roles: full, retain, unlearned, ...), added as a ``role`` column.
        n_boot: bootstrap resamples when a CI has to be computed here.

    Returns:
        DataFrame with columns ``model, uds, ci_low, ci_high, n_scored, n_no_ke, n_skipped`` (+ ``role``).
    """
    if isinstance(results, pd.DataFrame):
        frame = results.copy()
        missing = {"model", "uds"} - set(frame.columns)
        if missing:
            raise ValueError(f"model table lacks columns {sorted(missing)}")
    else:
        rows = []
        for name, result in _named(results).items():
            summary = getattr(result, "summary", None) or {}
            examples = getattr(result, "examples", None)
            uds = summary.get("uds")
            ci = _ci_pair(summary.get("ci95"))
            counts = {key: summary.get(key) for key in ("n_scored", "n_no_ke", "n_skipped")}
            if isinstance(examples, pd.DataFrame) and "uds" in examples.columns:
                per_example = pd.to_numeric(examples["uds"], errors="coerce").to_numpy(dtype=float)
                if uds is None:
                    uds = float(np.nanmean(per_example)) if np.isfinite(per_example).any() else float("nan")
                if ci is None:
                    ci = _bootstrap_ci(per_example, n_boot=n_boot)
                if "status" in examples.columns:
                    status = examples["status"].value_counts()
                    for key, label in (
                        ("n_scored", "scored"),
                        ("n_no_ke", "no_ke"),
                        ("n_skipped", "skipped"),
                    ):
                        if counts[key] is None:
                            counts[key] = int(status.get(label, 0))
            rows.append(
                {
                    "model": name,
                    "uds": float("nan") if uds is None else float(uds),
                    "ci_low": float("nan") if ci is None else ci[0],
                    "ci_high": float("nan") if ci is None else ci[1],
                    **counts,
                }
            )
        frame = pd.DataFrame(rows)
    if roles is not None:
        frame["role"] = [roles.get(name) for name in frame["model"]]
    return frame


def _hover_frame(examples: pd.DataFrame | None, data: Any) -> pd.DataFrame | None:
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


def _example_order(idxs: Sequence[Any], info: pd.DataFrame | None, sort_by: str | None) -> list[Any]:
    if sort_by in (None, "idx"):
        return sorted(idxs)
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
    raise ValueError(f"sort_by must be None, 'idx', 'uds' or 'prompt_type', got {sort_by!r}")


# ----------------------------------------------------------------------------------------------------------------------
# Layer x example


def layer_heatmap(
    result: Any,
    value: str = "d1",
    examples: pd.DataFrame | None = None,
    data: Any = None,
    sort_by: str | None = None,
    mark_ke: bool | None = None,
    ke_only: bool | None = None,
    site: str | None = None,
    tau: float = 0.05,
    title: str | None = None,
) -> go.Figure:
    """Heatmap of one per-layer quantity, y = layer, x = example, with KE cells marked.

    Args:
        result: a ``UDSResult`` (uses ``.layers`` and ``.examples``) or the long layers table.
        value: ``"d1"``, ``"d2"`` (RdBu, midpoint 0), ``"ler"`` (sequential 0-1) or any numeric column.
        examples: the examples table (for sorting and hover) when ``result`` is a bare layers table.
        data: optional examples with ``idx, question, entity`` (``list[Example]`` or a DataFrame) for hover text.
        sort_by: ``"uds"`` (ascending, undefined last), ``"prompt_type"`` (grouped, then UDS) or ``"idx"``; default
            ``"uds"`` when an examples table is available, else ``"idx"``.
        mark_ke: overlay a marker on every KE cell (``ke`` column, else ``d1 > tau``); default: unless ``ke_only``,
            where the blank non-KE cells already mark them.
        ke_only: blank the non-KE cells (default: True for ``ler``, whose value outside KE layers is noise).
        site: which patching site to show when the table has several (default resid_post).
        tau: KE threshold, used only when the table has no ``ke`` column.
        title: figure title.

    Returns:
        The figure: trace 0 is the heatmap, trace 1 (if ``mark_ke``) the KE markers.
    """
    layers, result_examples = _tables(result)
    examples = examples if examples is not None else result_examples
    layers = _one_site(layers, site)
    if value not in layers.columns:
        raise ValueError(f"column {value!r} is not in the layers table (columns: {list(layers.columns)})")
    if ke_only is None:
        ke_only = value == "ler"
    if mark_ke is None:
        mark_ke = not ke_only
    layers = layers.assign(_ke=_ke_mask(layers, tau).to_numpy())
    info = _hover_frame(examples, data)
    if sort_by is None:
        sort_by = "uds" if info is not None and "uds" in info.columns else "idx"
    order = _example_order(list(pd.unique(layers["idx"])), info, sort_by)
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
        labels={"x": "example (idx)", "y": "layer", "color": VALUE_LABELS.get(value, value)},
        **colour,
    )
    if value in ("d1", "d2"):
        fig.update_layout(coloraxis_cmid=0.0)

    # Hover: one row of facts per example, repeated over layers.
    columns = {"uds": [], "prompt_type": [], "question": [], "entity": []}
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
        rows, cols = np.nonzero(ke.to_numpy())
        fig.add_trace(
            go.Scatter(
                x=[labels[j] for j in cols],
                y=[layer_ids[i] for i in rows],
                mode="markers",
                marker={
                    "symbol": "square-open",
                    "size": 6,
                    "color": "rgba(0,0,0,0.55)",
                    "line": {"width": 1},
                },
                name="KE layer (d1 > τ)",
                hoverinfo="skip",
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
        range=[min(layer_ids) - 0.5, max(layer_ids) + 0.5], showgrid=False, **_layer_ticks(layer_ids)
    )
    fig.update_xaxes(showgrid=False, zeroline=False)
    fig.update_yaxes(zeroline=False)
    fig.update_layout(
        title=title or f"{VALUE_LABELS.get(value, value)} per layer and example",
        plot_bgcolor="#e5e5e5",
        # Above the prompt-type group labels, which sit on the top edge of the heatmap.
        legend={"orientation": "h", "y": 1.08, "yanchor": "bottom", "x": 1.0, "xanchor": "right"},
        margin={"t": 90},
    )
    return fig


def _fmt(grid: np.ndarray | None, i: int, j: int) -> str:
    if grid is None or not np.isfinite(grid[i, j]):
        return "–"
    return f"{grid[i, j]:.3f}"


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


# ----------------------------------------------------------------------------------------------------------------------
# Stages


def stage_curves(
    results: Any,
    quantity: str = "delta",
    band: str | None = "std",
    site: str | None = None,
    only_scored: bool = True,
    title: str | None = None,
) -> go.Figure:
    """Per-layer mean S1 and S2 curves with bands, one model or several overlaid.

    S1 (retain as source) is the same for every model audited against one full/retain pair, so it is drawn once when
    it agrees across models; S2 gets one curve per model.

    Args:
        results: a ``UDSResult``, a layers table, or ``{name: result}`` for several models.
        quantity: ``"delta"`` (mean d1 / d2) or ``"score"`` (mean S1 / S2 patched log-prob, with the clean full score).
        band: ``"std"`` (±1 standard deviation over examples), ``"sem"``, ``"ci95"`` or None.
        site: patching site when the tables hold several.
        only_scored: drop examples without a KE layer (UDS undefined) when an examples table is available.
        title: figure title.
    """
    if quantity not in ("delta", "score"):
        raise ValueError(f"quantity must be 'delta' or 'score', got {quantity!r}")
    s1_column, s2_column = ("d1", "d2") if quantity == "delta" else ("s1_score", "s2_score")
    named = _named(results)
    frames = {}
    for name, result in named.items():
        layers, examples = _tables(result)
        layers = _one_site(layers, site)
        if only_scored and examples is not None and "status" in examples.columns:
            layers = layers[layers["idx"].isin(examples.loc[examples["status"] == "scored", "idx"])]
        frames[name] = layers
    fig = go.Figure()
    s1_means = [frame.groupby("layer")[s1_column].mean() for frame in frames.values()]
    shared_s1 = all(
        len(m) == len(s1_means[0]) and np.allclose(m.to_numpy(), s1_means[0].to_numpy(), equal_nan=True)
        for m in s1_means
    )
    for position, (name, frame) in enumerate(frames.items()):
        colour = _colour(position)
        if position == 0 or not shared_s1:
            s1_name = "S1 (retain → full)" if shared_s1 else f"S1 · {name}"
            s1_colour = S1_COLOUR if shared_s1 else colour
            mean, half = _band(frame, s1_column, band)
            if band:
                _add_band(fig, mean.index, mean, half, s1_colour, s1_name)
            fig.add_trace(
                go.Scatter(
                    x=mean.index,
                    y=mean,
                    mode="lines+markers",
                    name=s1_name,
                    legendgroup=s1_name,
                    line={"color": s1_colour, "dash": STAGE_DASH["d1"]},
                )
            )
        mean, half = _band(frame, s2_column, band)
        s2_name = f"S2 · {name}" if len(frames) > 1 else "S2 (unlearned → full)"
        if band:
            _add_band(fig, mean.index, mean, half, colour, s2_name)
        fig.add_trace(
            go.Scatter(
                x=mean.index,
                y=mean,
                mode="lines+markers",
                name=s2_name,
                legendgroup=s2_name,
                line={"color": colour, "dash": STAGE_DASH["d2"]},
            )
        )
    first = next(iter(frames.values()))
    if quantity == "score" and "s0" in first.columns:
        fig.add_hline(
            y=float(first.groupby("idx")["s0"].first().mean()),
            line={"color": "black", "dash": "dot"},
            annotation_text="clean full",
        )
    elif quantity == "delta":
        fig.add_hline(y=0.0, line={"color": "black", "width": 1})
    band_text = {"std": " (±1 std)", "sem": " (±1 s.e.m.)", "ci95": " (95% CI)"}.get(band or "", "")
    fig.update_layout(
        title=title
        or f"Mean {'patching delta' if quantity == 'delta' else 'patched score'} per layer{band_text}",
        xaxis={"title": "layer", **_layer_ticks(first["layer"])},
        yaxis_title="mean Δ (nats)" if quantity == "delta" else "mean entity log-prob",
        hovermode="x unified",
    )
    return fig


# ----------------------------------------------------------------------------------------------------------------------
# Models


def uds_distribution(results: Any, kind: str = "violin", title: str | None = None) -> go.Figure:
    """Distribution of per-example UDS for each model (examples with a defined UDS only).

    Args:
        results: ``{name: result}`` (or one result); each needs an examples table (``.examples`` or the DataFrame).
        kind: ``"violin"`` (one violin per model, points shown) or ``"histogram"`` (overlaid, 0-1 bins of 0.05).
        title: figure title.
    """
    frame = _long_by_model(results, attribute="examples")
    frame = frame.assign(uds=pd.to_numeric(frame["uds"], errors="coerce")).dropna(subset=["uds"])
    models = list(dict.fromkeys(frame["model"]))
    fig = go.Figure()
    for position, model in enumerate(models):
        values = frame.loc[frame["model"] == model, "uds"]
        hover = frame.loc[frame["model"] == model, "idx"] if "idx" in frame.columns else None
        if kind == "violin":
            fig.add_trace(
                go.Violin(
                    y=values,
                    x=[model] * len(values),
                    name=model,
                    box_visible=True,
                    meanline_visible=True,
                    points="all",
                    jitter=0.3,
                    pointpos=0.0,
                    marker={"size": 4, "color": "rgba(40,40,40,0.6)"},
                    line={"color": _colour(position)},
                    customdata=hover,
                    hovertemplate="%{x}<br>example %{customdata}: UDS %{y:.3f}<extra></extra>",
                    spanmode="hard",
                )
            )
        elif kind == "histogram":
            fig.add_trace(
                go.Histogram(
                    x=values,
                    name=model,
                    xbins={"start": 0.0, "end": 1.0 + 1e-9, "size": 0.05},
                    opacity=0.6,
                    marker={"color": _colour(position)},
                )
            )
        else:
            raise ValueError(f"kind must be 'violin' or 'histogram', got {kind!r}")
    if kind == "violin":
        fig.update_layout(yaxis={"title": "UDS<sub>i</sub>", "range": [-0.05, 1.05]}, showlegend=False)
    else:
        fig.update_layout(barmode="overlay", xaxis_title="UDS<sub>i</sub>", yaxis_title="examples")
    fig.update_layout(title=title or "Per-example UDS by model")
    return fig


def uds_bar(
    results: Any,
    roles: Mapping[str, str] | None = None,
    sort: bool = False,
    title: str | None = None,
) -> go.Figure:
    """Model UDS as bars with bootstrap 95% CIs.

    Args:
        results: ``{name: result}``, one result, or a model table (``model, uds, ci_low, ci_high`` [, ``role``]) as
            from :func:`model_frame`.
        roles: optional ``{name: role}``; bars are coloured by role when given (or when the table has ``role``).
        sort: order bars by UDS instead of the given order.
        title: figure title.
    """
    frame = model_frame(results, roles=roles)
    if sort:
        frame = frame.sort_values("uds", na_position="last")
    error = {
        "type": "data",
        "symmetric": False,
        "array": (frame["ci_high"] - frame["uds"]).clip(lower=0).to_numpy(),
        "arrayminus": (frame["uds"] - frame["ci_low"]).clip(lower=0).to_numpy(),
        "color": "#333333",
    }
    hover = "%{x}<br>UDS %{y:.3f}<br>95% CI [%{customdata[0]:.3f}, %{customdata[1]:.3f}]<extra></extra>"
    fig = go.Figure()
    if "role" in frame.columns and frame["role"].notna().any():
        frame = frame.assign(role=frame["role"].fillna("other"))
        for position, role in enumerate(dict.fromkeys(frame["role"])):
            part = frame["role"] == role
            fig.add_trace(
                go.Bar(
                    x=frame.loc[part, "model"],
                    y=frame.loc[part, "uds"],
                    name=role,
                    marker={"color": _colour(position)},
                    error_y={
                        key: (v[part.to_numpy()] if key.startswith("array") else v)
                        for key, v in error.items()
                    },
                    customdata=frame.loc[part, ["ci_low", "ci_high"]].to_numpy(),
                    hovertemplate=hover,
                )
            )
        fig.update_layout(legend_title_text="role")
    else:
        fig.add_trace(
            go.Bar(
                x=frame["model"],
                y=frame["uds"],
                name="UDS",
                marker={"color": _colour(0)},
                error_y=error,
                customdata=frame[["ci_low", "ci_high"]].to_numpy(),
                hovertemplate=hover,
            )
        )
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=list(frame["model"]))
    fig.update_layout(
        title=title or "UDS per model (95% bootstrap CI over examples)",
        yaxis={"title": "UDS (0 = knowledge recoverable, 1 = erased like retain)", "range": [0, 1.05]},
        xaxis_title="model",
    )
    return fig


def prompt_type_bar(results: Any, title: str | None = None) -> go.Figure:
    """Mean UDS per prompt type (the paper's Table 5 as a figure), grouped by model, with example counts.

    Args:
        results: ``{name: result}``, one result, an examples table (needs ``prompt_type`` and ``uds``), or the
            summary table of ``analysis.prompt_type_uds`` (``model, prompt_type, n_scored, mean_uds``).
        title: figure title.
    """
    if isinstance(results, pd.DataFrame) and "mean_uds" in results.columns:
        # A summary table (analysis.prompt_type_uds / prompt_types.csv): no per-example spread to show.
        count = results["n_scored"] if "n_scored" in results.columns else results.get("n", np.nan)
        table = pd.DataFrame(
            {
                "model": results["model"] if "model" in results.columns else "model",
                "prompt_type": results["prompt_type"].astype(str),
                "mean": results["mean_uds"],
                "count": count,
                "std": np.nan,
            }
        )
    else:
        frame = _long_by_model(results, attribute="examples")
        frame = frame.assign(
            uds=pd.to_numeric(frame["uds"], errors="coerce"),
            prompt_type=frame["prompt_type"].fillna("(none)").astype(str),
        ).dropna(subset=["uds"])
        table = (
            frame.groupby(["model", "prompt_type"], sort=False)["uds"]
            .agg(["mean", "count", "std"])
            .reset_index()
        )
    fig = go.Figure()
    for position, model in enumerate(dict.fromkeys(table["model"])):
        part = table[table["model"] == model]
        fig.add_trace(
            go.Bar(
                x=part["prompt_type"],
                y=part["mean"],
                name=model,
                marker={"color": _colour(position)},
                text=[f"n={n:.0f}" if pd.notna(n) else "" for n in part["count"]],
                textposition="inside",
                insidetextanchor="start",
                error_y={
                    "type": "data",
                    "array": (part["std"] / np.sqrt(part["count"])).to_numpy(dtype=float),
                    "visible": bool(part["std"].notna().any()),
                },
                hovertemplate="%{x}<br>mean UDS %{y:.3f}<br>%{text}<extra>" + model + "</extra>",
            )
        )
    fig.update_layout(
        barmode="group",
        title=title or "Mean UDS per prompt type" + (" (± s.e.m.)" if table["std"].notna().any() else ""),
        xaxis_title="prompt type",
        yaxis={"title": "mean UDS<sub>i</sub>", "range": [0, 1.1]},
    )
    return fig


# ----------------------------------------------------------------------------------------------------------------------
# Components


def component_patching(
    components: pd.DataFrame,
    stage: str = "d1",
    band: bool | None = None,
    title: str | None = None,
) -> go.Figure:
    """Mean patching delta per layer for each patching site (the paper's appendix D.1 figure).

    Args:
        components: ``site, layer, mean_d1, mean_d2`` (optionally ``std_d1, std_d2`` for ±1 std bands), or a long
            layers table with a ``site`` column (``idx, layer, site, d1, d2``) which is averaged here.
        stage: ``"d1"`` (S1, retain as source: where the knowledge lives), ``"d2"``, or ``"both"`` (d2 dashed).
        band: draw ±1 std bands when standard deviations are available (default: unless ``stage="both"``, where
            eight overlapping bands would hide the curves).
        title: figure title.
    """
    if "mean_d1" not in components.columns:
        if not {"site", "layer", "d1"} <= set(components.columns):
            raise ValueError(
                "components needs columns site, layer, mean_d1[, mean_d2] or a long table with d1/d2"
            )
        stats = {"mean_d1": ("d1", "mean"), "std_d1": ("d1", "std")}
        if "d2" in components.columns:
            stats.update(mean_d2=("d2", "mean"), std_d2=("d2", "std"))
        components = components.groupby(["site", "layer"], sort=False).agg(**stats).reset_index()
    stages = {"d1": ["d1"], "d2": ["d2"], "both": ["d1", "d2"]}.get(stage)
    if band is None:
        band = stage != "both"
    if stages is None:
        raise ValueError(f"stage must be 'd1', 'd2' or 'both', got {stage!r}")
    order = ["attn_out", "mlp_out", "resid_mid", "resid_post", "resid_pre"]
    sites = sorted(
        dict.fromkeys(components["site"]), key=lambda s: (order.index(s) if s in order else len(order), s)
    )
    names = {
        "attn_out": "attention output a<sub>l</sub>",
        "mlp_out": "MLP output",
        "resid_mid": "residual + attention m<sub>l</sub>",
        "resid_post": "layer output h<sub>l</sub> (UDS)",
        "resid_pre": "layer input h<sub>l-1</sub>",
    }
    fig = go.Figure()
    for position, site in enumerate(sites):
        part = components[components["site"] == site].sort_values("layer")
        colour = _colour(position)
        for which in stages:
            column = f"mean_{which}"
            if column not in part.columns:
                raise ValueError(f"components table has no {column!r} column")
            label = names.get(site, site) + (
                f" · {'S1' if which == 'd1' else 'S2'}" if stage == "both" else ""
            )
            std_column = f"std_{which}"
            if band and std_column in part.columns:
                _add_band(fig, part["layer"], part[column], part[std_column].fillna(0.0), colour, label)
            fig.add_trace(
                go.Scatter(
                    x=part["layer"],
                    y=part[column],
                    mode="lines+markers",
                    name=label,
                    legendgroup=label,
                    line={"color": colour, "dash": STAGE_DASH[which] if stage == "both" else "solid"},
                )
            )
    fig.add_hline(y=0.0, line={"color": "black", "width": 1})
    fig.update_layout(
        title=title or "Mean patching delta per layer by patching site",
        xaxis={"title": "layer", **_layer_ticks(components["layer"])},
        yaxis_title="mean Δ (nats)",
    )
    return fig


# ----------------------------------------------------------------------------------------------------------------------
# Observational (logit lens) vs causal (UDS)


def _example_score(table: pd.DataFrame, tau: float) -> float:
    ke = table["d1"] > tau
    if not ke.any():
        return float("nan")
    weights = table.loc[ke, "d1"]
    return float((weights * table.loc[ke, "ler"].clip(0, 1)).sum() / weights.sum())


def lens_vs_uds_example(
    uds_layers: Any,
    lens_layers: pd.DataFrame,
    idx: int,
    tau: float = 0.05,
    site: str | None = None,
    title: str | None = None,
) -> go.Figure:
    """Logit lens vs UDS, layer by layer, for one example (the paper's Table 4 as a figure).

    Top: ΔS1 (solid) and ΔS2 (dashed) per layer for both readouts. Bottom: LER on the KE layers of each
    (``d1 > tau``), with non-KE layers left empty. The per-example scores go in the legend.

    Args:
        uds_layers: UDS layers table (``idx, layer, d1, d2, ler``) or a ``UDSResult``.
        lens_layers: logit-lens layers table in the same shape.
        idx: the example.
        tau: KE threshold for both (SPEC: 0.05 for UDS and for the logit lens).
        site: patching site of the UDS table when it holds several.
        title: figure title.
    """
    uds_table, _ = _tables(uds_layers)
    uds_table = _one_site(uds_table, site)
    tables = {"UDS (patching)": uds_table, "logit lens": lens_layers}
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("Δ per layer (solid: S1 retain, dashed: S2 unlearned)", "LER on KE layers"),
    )
    colours = {"UDS (patching)": _colour(0), "logit lens": _colour(1)}
    for name, table in tables.items():
        rows = table[table["idx"] == idx].sort_values("layer")
        if rows.empty:
            raise ValueError(f"example {idx} is not in the {name} layers table")
        score = _example_score(rows, tau)
        label = f"{name}: score {score:.3f}" if np.isfinite(score) else f"{name}: no KE layer"
        colour = colours[name]
        fig.add_trace(
            go.Scatter(x=rows["layer"], y=rows["d1"], mode="lines+markers", name=f"{name} ΔS1",
                       legendgroup=name, line={"color": colour, "dash": STAGE_DASH["d1"]}),
            row=1, col=1,
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(x=rows["layer"], y=rows["d2"], mode="lines+markers", name=f"{name} ΔS2",
                       legendgroup=name, line={"color": colour, "dash": STAGE_DASH["d2"]}),
            row=1, col=1,
        )  # fmt: skip
        ler = rows["ler"].where(rows["d1"] > tau)
        fig.add_trace(
            go.Bar(x=rows["layer"], y=ler, name=label, legendgroup=name, marker={"color": colour}),
            row=2, col=1,
        )  # fmt: skip
    fig.add_hline(y=tau, line=REFERENCE_LINE, annotation_text="τ", row=1, col=1)
    fig.update_yaxes(title_text="Δ (nats)", row=1, col=1)
    fig.update_yaxes(title_text="LER", range=[0, 1.05], row=2, col=1)
    fig.update_xaxes(**_layer_ticks(uds_table["layer"]))
    fig.update_xaxes(title_text="layer", row=2, col=1)
    fig.update_layout(barmode="group", title=title or f"Observational vs causal, example {idx}", height=620)
    return fig


def _mean_ler_on_ke(layers: pd.DataFrame, tau: float) -> pd.Series:
    ke = _ke_mask(layers, tau) if "ke" in layers.columns else layers["d1"] > tau
    return layers[ke.to_numpy()].groupby("layer")["ler"].mean()


def lens_vs_uds_models(
    uds_layers: Any,
    lens_layers: Any,
    tau: float = 0.05,
    site: str | None = None,
    max_columns: int = 3,
    title: str | None = None,
) -> go.Figure:
    """Mean LER per layer (over KE cells) from the logit lens and from UDS, one panel per model.

    Args:
        uds_layers: ``{model: UDS layers table or result}`` or a long table with a ``model`` column.
        lens_layers: ``{model: logit-lens layers table}`` or a long table with a ``model`` column.
        tau: KE threshold.
        site: patching site of the UDS tables when they hold several.
        max_columns: panels per row.
        title: figure title.
    """
    uds_long = _one_site(_long_by_model(uds_layers), site)
    lens_long = _long_by_model(lens_layers)
    models = [m for m in dict.fromkeys(uds_long["model"]) if m in set(lens_long["model"])]
    if not models:
        raise ValueError("no model is in both the UDS and the logit-lens tables")
    columns = min(max_columns, len(models))
    rows = -(-len(models) // columns)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=models, shared_yaxes=True)
    for position, model in enumerate(models):
        cell = {"row": position // columns + 1, "col": position % columns + 1}
        for name, long, colour in (("UDS", uds_long, _colour(0)), ("logit lens", lens_long, _colour(1))):
            mean = _mean_ler_on_ke(long[long["model"] == model], tau)
            fig.add_trace(
                go.Scatter(x=mean.index, y=mean, mode="lines+markers", name=name, legendgroup=name,
                           showlegend=position == 0, line={"color": colour}),
                **cell,
            )  # fmt: skip
    fig.update_yaxes(range=[0, 1.05])
    fig.update_yaxes(title_text="mean LER (KE cells)", col=1)
    fig.update_xaxes(title_text="layer", **_layer_ticks(uds_long["layer"]))
    fig.update_layout(
        title=title or "Logit lens vs UDS: mean layer erasure ratio per model", height=320 * rows
    )
    return fig


def layerwise_methods(
    layerwise: Any,
    methods: Sequence[str] | None = None,
    max_columns: int = 3,
    title: str | None = None,
) -> go.Figure:
    """Per-layer erasure of several white-box methods, one panel per model (``diagnose``'s ``layerwise.csv``).

    Each method's score is the weighted mean of its per-layer erasure ``e_l`` (1 = retain-like) with weights ``w_l``;
    marker size shows the weight, so the layers that drive the score stand out. With ``methods=("uds",
    "logit_lens")`` this is the observational-vs-causal comparison per model.

    Args:
        layerwise: ``{model: table}`` or a long table with a ``model`` column; tables have ``method, layer, erasure``
            (optionally ``weight``).
        methods: methods to draw (default: all, in table order).
        max_columns: panels per row.
        title: figure title.
    """
    long = _long_by_model(layerwise, attribute="layerwise")
    missing = {"method", "layer", "erasure"} - set(long.columns)
    if missing:
        raise ValueError(f"layerwise table lacks columns {sorted(missing)}")
    all_methods = list(dict.fromkeys(long["method"]))
    methods = [m for m in (methods or all_methods) if m in all_methods]
    if not methods:
        raise ValueError(f"none of the requested methods is in the table (methods: {all_methods})")
    models = list(dict.fromkeys(long["model"]))
    columns = min(max_columns, len(models))
    rows = -(-len(models) // columns)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=models, shared_yaxes=True)
    for position, model in enumerate(models):
        cell = {"row": position // columns + 1, "col": position % columns + 1}
        part = long[long["model"] == model]
        for number, method in enumerate(methods):
            rows_m = part[part["method"] == method].sort_values("layer")
            if rows_m.empty:
                continue
            weight = rows_m["weight"].to_numpy(dtype=float) if "weight" in rows_m.columns else None
            size = 6.0
            if weight is not None and np.nanmax(np.abs(weight), initial=0.0) > 0:
                size = 4 + 10 * np.nan_to_num(weight / np.nanmax(np.abs(weight)))
            fig.add_trace(
                go.Scatter(
                    x=rows_m["layer"],
                    y=rows_m["erasure"],
                    mode="lines+markers",
                    name=method,
                    legendgroup=method,
                    showlegend=position == 0,
                    line={"color": _colour(number), "width": 3 if method == "uds" else 1.5},
                    marker={"size": size},
                    customdata=weight,
                    hovertemplate=f"{method}<br>layer %{{x}}<br>erasure %{{y:.3f}}"
                    + ("<br>weight %{customdata:.3f}" if weight is not None else "")
                    + "<extra></extra>",
                ),
                **cell,
            )
    fig.update_yaxes(range=[-0.05, 1.05])
    fig.update_yaxes(title_text="erasure e<sub>l</sub>", col=1)
    fig.update_xaxes(title_text="layer", **_layer_ticks(long["layer"]))
    fig.update_layout(
        title=title or "Per-layer erasure by method (1 = retain-like; marker size = layer weight)",
        height=320 * rows + 60,
    )
    return fig


def tau_curves(table: pd.DataFrame, default_tau: float = 0.05, title: str | None = None) -> go.Figure:
    """Model UDS as a function of the KE threshold tau, one line per model (appendix D.3).

    Args:
        table: ``analysis.tau_sensitivity`` output / ``tau_sensitivity.csv`` (``model, tau, uds`` [, ``n_no_ke``]).
        default_tau: marked with a dashed vertical line.
        title: figure title.
    """
    missing = {"tau", "uds"} - set(table.columns)
    if missing:
        raise ValueError(f"tau table lacks columns {sorted(missing)}")
    table = table if "model" in table.columns else table.assign(model="model")
    fig = go.Figure()
    for position, model in enumerate(dict.fromkeys(table["model"])):
        part = table[table["model"] == model].sort_values("tau")
        extra = part["n_no_ke"] if "n_no_ke" in part.columns else None
        fig.add_trace(
            go.Scatter(
                x=part["tau"],
                y=part["uds"],
                mode="lines+markers",
                name=str(model),
                line={"color": _colour(position)},
                customdata=extra,
                hovertemplate=f"{model}<br>τ = %{{x}}<br>UDS %{{y:.3f}}"
                + ("<br>no-KE examples %{customdata}" if extra is not None else "")
                + "<extra></extra>",
            )
        )
    fig.add_vline(x=default_tau, line=REFERENCE_LINE, annotation_text=f"τ = {default_tau}")
    fig.update_layout(
        title=title or "UDS under each KE threshold τ",
        xaxis_title="τ (nats)",
        yaxis={"title": "UDS", "range": [0, 1.05]},
    )
    return fig


# ----------------------------------------------------------------------------------------------------------------------
# RMU


def rmu_layer_profile(
    results: Any,
    target_layers: Mapping[str, int] | None = None,
    tau: float = 0.05,
    site: str | None = None,
    title: str | None = None,
) -> go.Figure:
    """Mean LER per layer (over KE cells) for several models, each model's target layer marked.

    RMU steers the residual at one target layer; its erasure profile should rise there. With ``target_layers``
    unset, a target is read from names like ``rmu_l5`` / ``RMU-L10``.

    Args:
        results: ``{name: result or layers table}``.
        target_layers: ``{name: layer}`` to mark; names without an entry are not marked.
        tau: KE threshold when a table has no ``ke`` column.
        site: patching site when the tables hold several.
        title: figure title.
    """
    long = _one_site(_long_by_model(results), site)
    fig = go.Figure()
    for position, model in enumerate(dict.fromkeys(long["model"])):
        colour = _colour(position)
        mean = _mean_ler_on_ke(long[long["model"] == model], tau)
        fig.add_trace(
            go.Scatter(x=mean.index, y=mean, mode="lines+markers", name=model, line={"color": colour})
        )
        target = (target_layers or {}).get(model) if target_layers is not None else rmu_target_layer(model)
        if target is not None:
            fig.add_vline(
                x=target,
                line={"color": colour, "dash": "dash"},
                annotation_text=f"target {model}",
                annotation_textangle=-90,
                annotation_font_color=colour,
            )
    fig.update_layout(
        title=title or "Layer erasure profile (mean LER on KE cells); dashed = RMU target layer",
        xaxis={"title": "layer", **_layer_ticks(long["layer"])},
        yaxis={"title": "mean LER", "range": [0, 1.05]},
    )
    return fig


def rmu_target_layer(name: str) -> int | None:
    """The RMU target layer encoded in a model name (``rmu_l5``, ``RMU-L10``), or None."""
    match = re.search(r"rmu[_\-]?l(\d+)", name, flags=re.IGNORECASE)
    return int(match.group(1)) if match else None


# ----------------------------------------------------------------------------------------------------------------------
# Meta-evaluation


def _metrics_long(metrics: pd.DataFrame, pool_column: str) -> pd.DataFrame:
    if {"metric", "value"} <= set(metrics.columns):
        return metrics
    id_columns = [c for c in metrics.columns if c in (pool_column, "model", "name", "role", "method")]
    value_columns = [
        c for c in metrics.columns if c not in id_columns and pd.api.types.is_numeric_dtype(metrics[c])
    ]
    return metrics.melt(id_vars=id_columns, value_vars=value_columns, var_name="metric", value_name="value")


def _auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(positive > negative) + 0.5 P(tie): the ROC AUC without sklearn."""
    if len(positive) == 0 or len(negative) == 0:
        return float("nan")
    diff = positive[:, None] - negative[None, :]
    return float((diff > 0).mean() + 0.5 * (diff == 0).mean())


def pool_histograms(
    metrics: pd.DataFrame,
    pool_column: str = "pool",
    positive: str = "P",
    invert: Collection[str] | None = None,
    max_columns: int = 4,
    bins: int = 20,
    title: str | None = None,
) -> go.Figure:
    """P vs N pool histograms per metric, with the faithfulness AUC in each panel title (Figure 3 of the paper).

    Args:
        metrics: one row per model with a pool column and one numeric column per metric, or long
            ``model, pool, metric, value``.
        pool_column: column holding the pool label.
        positive: label of the P pool (models that saw the forget set; they should look like they *know*).
        invert: metrics where high = erased, inverted for the AUC only (default :data:`ERASURE_METRICS`).
        max_columns: panels per row.
        bins: histogram bins per panel.
        title: figure title.
    """
    invert = ERASURE_METRICS if invert is None else frozenset(invert)
    long = _metrics_long(metrics, pool_column).dropna(subset=["value"])
    metric_names = list(dict.fromkeys(long["metric"]))
    if not metric_names:
        raise ValueError("no numeric metric columns found")
    pools = list(dict.fromkeys(long[pool_column]))
    titles = []
    for metric in metric_names:
        part = long[long["metric"] == metric]
        sign = -1.0 if metric.lower() in invert else 1.0
        auc = _auc(
            sign * part.loc[part[pool_column] == positive, "value"].to_numpy(dtype=float),
            sign * part.loc[part[pool_column] != positive, "value"].to_numpy(dtype=float),
        )
        titles.append(f"{metric} (AUC {auc:.3f})" if np.isfinite(auc) else metric)
    columns = min(max_columns, len(metric_names))
    rows = -(-len(metric_names) // columns)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=titles)
    pool_colours = {pool: ("#d62728" if pool == positive else "#1f77b4") for pool in pools}
    for position, metric in enumerate(metric_names):
        cell = {"row": position // columns + 1, "col": position % columns + 1}
        part = long[long["metric"] == metric]
        low, high = float(part["value"].min()), float(part["value"].max())
        size = (high - low) / bins if high > low else 1.0
        for pool in pools:
            fig.add_trace(
                go.Histogram(
                    x=part.loc[part[pool_column] == pool, "value"],
                    name=f"{pool} pool",
                    legendgroup=str(pool),
                    showlegend=position == 0,
                    opacity=0.6,
                    marker={"color": pool_colours[pool]},
                    xbins={"start": low, "end": high + size, "size": size},
                ),
                **cell,
            )
    fig.update_layout(
        barmode="overlay",
        title=title or f"Faithfulness: {positive} pool vs the rest per metric",
        height=280 * rows + 80,
    )
    return fig


def robustness_scatter(
    table: pd.DataFrame,
    attack: str = "quantization",
    retain: str | None = "retain",
    max_columns: int = 4,
    title: str | None = None,
) -> go.Figure:
    """Metric value before vs after an attack, per metric, with the y = x reference (paper Figure 2, appendix E).

    For ``attack="relearning"`` the expected line ``y = x + Δ_ret`` (the retain model's own shift) is drawn dashed
    when the retain model is in the table, and the retain model is a red star.

    Args:
        table: long ``model, metric, before, after`` (optionally ``role``).
        attack: ``"quantization"`` or ``"relearning"`` (titles and the Δ_ret line).
        retain: model name of the retain model (also matched by ``role == "retain"``); None to ignore.
        max_columns: panels per row.
        title: figure title.
    """
    if attack not in ("quantization", "relearning"):
        raise ValueError(f"attack must be 'quantization' or 'relearning', got {attack!r}")
    missing = {"model", "metric", "before", "after"} - set(table.columns)
    if missing:
        raise ValueError(f"robustness table lacks columns {sorted(missing)}")
    metric_names = list(dict.fromkeys(table["metric"]))
    columns = min(max_columns, len(metric_names))
    rows = -(-len(metric_names) // columns)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=metric_names)
    for position, metric in enumerate(metric_names):
        cell = {"row": position // columns + 1, "col": position % columns + 1}
        part = table[table["metric"] == metric]
        is_retain = part["model"] == retain if retain is not None else pd.Series(False, index=part.index)
        if "role" in part.columns:
            is_retain = is_retain | (part["role"] == "retain")
        values = part[["before", "after"]].to_numpy(dtype=float)
        low, high = float(np.nanmin(values)), float(np.nanmax(values))
        pad = 0.05 * (high - low) if high > low else 0.05
        low, high = low - pad, high + pad
        fig.add_trace(
            go.Scatter(x=[low, high], y=[low, high], mode="lines", name="y = x", legendgroup="y=x",
                       showlegend=position == 0, line={"color": "black", "dash": "dot", "width": 1}),
            **cell,
        )  # fmt: skip
        if attack == "relearning" and is_retain.any():
            shift = float((part.loc[is_retain, "after"] - part.loc[is_retain, "before"]).mean())
            fig.add_trace(
                go.Scatter(x=[low, high], y=[low + shift, high + shift], mode="lines", name="y = x + Δ_ret",
                           legendgroup="shift", showlegend=position == 0,
                           line={"color": "#d62728", "dash": "dash", "width": 1}),
                **cell,
            )  # fmt: skip
        others = part[~is_retain]
        fig.add_trace(
            go.Scatter(
                x=others["before"],
                y=others["after"],
                mode="markers",
                name="models",
                legendgroup="models",
                showlegend=position == 0,
                marker={"color": _colour(0), "size": 7, "opacity": 0.8},
                text=others["model"],
                hovertemplate="%{text}<br>before %{x:.3f}<br>after %{y:.3f}<extra></extra>",
            ),
            **cell,
        )
        if is_retain.any():
            fig.add_trace(
                go.Scatter(
                    x=part.loc[is_retain, "before"],
                    y=part.loc[is_retain, "after"],
                    mode="markers",
                    name="retain",
                    legendgroup="retain",
                    showlegend=position == 0,
                    marker={"color": "#d62728", "symbol": "star", "size": 13},
                    hovertemplate="retain<br>before %{x:.3f}<br>after %{y:.3f}<extra></extra>",
                ),
                **cell,
            )
        fig.update_xaxes(range=[low, high], **cell)
        fig.update_yaxes(range=[low, high], **cell)
    fig.update_xaxes(title_text="before")
    fig.update_yaxes(title_text="after", col=1)
    label = "NF4 4-bit quantisation" if attack == "quantization" else "1 epoch of relearning"
    fig.update_layout(title=title or f"Robustness: metric before vs after {label}", height=300 * rows + 80)
    return fig


# ----------------------------------------------------------------------------------------------------------------------
# Tokens


def token_logprobs(tokens: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Per-position log-prob of the next token for the clean full run and a patched run, entity tokens highlighted.

    Args:
        tokens: ``position, token, logprob_full, logprob_patched, is_entity``: one row per read position, ``token`` the
            token predicted there (its log-prob is what the columns hold), ``is_entity`` whether it is an entity token
            (those are the positions UDS averages over).
        title: figure title (say which model and layer the patched run used).

    Returns:
        Two rows: grouped bars of the two log-probs, and below a one-row heatmap of ``full - patched`` (RdBu, midpoint
        0) over the same tokens; the entity span is shaded.
    """
    missing = {"position", "token", "logprob_full", "logprob_patched", "is_entity"} - set(tokens.columns)
    if missing:
        raise ValueError(f"tokens table lacks columns {sorted(missing)}")
    tokens = tokens.sort_values("position")
    labels = [f"{p}:{_visible(t)}" for p, t in zip(tokens["position"], tokens["token"], strict=True)]
    entity = tokens["is_entity"].astype(bool).to_numpy()
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.78, 0.22], vertical_spacing=0.04)
    fig.add_trace(
        go.Bar(x=labels, y=tokens["logprob_full"], name="full (clean)", marker={"color": _colour(0)}),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Bar(x=labels, y=tokens["logprob_patched"], name="patched", marker={"color": _colour(1)}),
        row=1,
        col=1,
    )
    drop = (tokens["logprob_full"] - tokens["logprob_patched"]).to_numpy(dtype=float)
    bound = float(np.nanmax(np.abs(drop))) if np.isfinite(drop).any() and np.nanmax(np.abs(drop)) > 0 else 1.0
    fig.add_trace(
        go.Heatmap(
            x=labels,
            y=["full − patched"],
            z=[drop],
            colorscale=DELTA_SCALE,
            zmid=0.0,
            zmin=-bound,
            zmax=bound,
            colorbar={"title": {"text": "Δ"}, "len": 0.25, "y": 0.1},
            hovertemplate="%{x}<br>full − patched = %{z:.3f}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    positions = np.flatnonzero(entity)
    if len(positions):
        fig.add_vrect(
            x0=positions.min() - 0.5,
            x1=positions.max() + 0.5,
            fillcolor="gold",
            opacity=0.2,
            line_width=0,
            annotation_text="entity",
            annotation_position="top left",
            row=1,
            col=1,
        )
    fig.update_xaxes(type="category", tickangle=-60, row=2, col=1)
    fig.update_xaxes(type="category", row=1, col=1)
    fig.update_yaxes(title_text="log p(token)", row=1, col=1)
    fig.update_layout(barmode="group", title=title or "Per-token log-prob: full vs patched", height=520)
    return fig


def _visible(token: Any) -> str:
    """Show leading spaces and newlines in token labels."""
    return str(token).replace("\n", "\\n").replace(" ", "␣")


# ----------------------------------------------------------------------------------------------------------------------
# One example, components, files


def example_curves(
    result: Any, idx: int, site: str | None = None, tau: float | None = None, title: str | None = None
) -> go.Figure:
    """One example's layer curves: ``d1`` (S1, solid) and ``d2`` (S2, dashed), KE layers shaded, UDS in the title.

    Args:
        result: a ``UDSResult`` (or anything with ``.layers``/``.examples``), or the long layers table.
        idx: the example's dataset ``idx``.
        site: patching site when the table holds several.
        tau: KE threshold for the dotted line and, without a ``ke`` column, the band (default the result's).
        title: figure title (default: idx, UDS, entity and question).
    """
    layers, examples = _tables(result)
    layers = _one_site(layers, site)
    rows = layers[layers["idx"] == idx].sort_values("layer")
    if rows.empty:
        raise ValueError(
            f"example {idx} is not in the layers table (it may have been skipped); "
            f"examples there: {sorted(pd.unique(layers['idx']))[:20]}"
        )
    if tau is None:
        tau = (
            float(getattr(result, "settings", {}).get("tau", 0.05))
            if not isinstance(result, pd.DataFrame)
            else 0.05
        )
    ke = _ke_mask(rows, tau).to_numpy()
    info = (
        examples.set_index("idx").loc[idx] if examples is not None and idx in set(examples["idx"]) else None
    )
    uds = info.get("uds") if info is not None else _example_score(rows, tau)
    fig = go.Figure()
    for layer in rows["layer"].to_numpy()[ke]:
        fig.add_vrect(x0=layer - 0.5, x1=layer + 0.5, fillcolor=KE_BAND, line_width=0, layer="below")
    colour = _colour(0)
    for stage, name in (("d1", "d1 · S1 (retain → full)"), ("d2", "d2 · S2 (unlearned → full)")):
        fig.add_trace(
            go.Scatter(
                x=rows["layer"],
                y=rows[stage],
                mode="lines+markers",
                name=name,
                line={"color": colour, "dash": STAGE_DASH[stage]},
            )
        )
    fig.add_trace(
        go.Scatter(
            x=[None],
            y=[None],
            mode="markers",
            name="KE layer (d1 > τ)",
            marker={"symbol": "square", "size": 12, "color": KE_BAND},
        )
    )
    fig.add_hline(y=tau, line=REFERENCE_LINE, annotation_text="τ")
    fig.add_hline(y=0.0, line={"color": "black", "width": 1})
    uds_text = "undefined (no KE layer)" if uds is None or pd.isna(uds) else f"{float(uds):.3f}"
    detail = ""
    if info is not None and isinstance(info.get("entity"), str):
        detail = f"<br><sup>entity: {info['entity']} · Q: {str(info.get('question', ''))[:100]}</sup>"
    fig.update_layout(
        title=title or f"Example {idx}: UDS = {uds_text}{detail}",
        xaxis={"title": "layer", **_layer_ticks(rows["layer"])},
        yaxis_title="Δ (nats)",
        hovermode="x unified",
        margin={"t": 90},
    )
    return fig


def component_heatmap(
    grid: Any,
    layers: Sequence[int],
    axis: str = "head",
    value: str = "component_uds",
    title: str | None = None,
) -> go.Figure:
    """Heatmap of a ``[layer, component]`` grid (heads, entity tokens, patched positions), y = layer.

    Args:
        grid: ``[layer, component]`` values (NaN cells left blank).
        layers: the layer of each row.
        axis: what the columns are (``head``, ``token``, ``position``), for the axis title.
        value: ``d1``/``d2`` (RdBu, midpoint 0) or ``component_uds``/``ler`` (sequential 0-1).
        title: figure title.
    """
    z = np.asarray(grid, dtype=float)
    if value in ("d1", "d2"):
        bound = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() and np.nanmax(np.abs(z)) > 0 else 1.0
        colour = {
            "color_continuous_scale": DELTA_SCALE,
            "color_continuous_midpoint": 0.0,
            "zmin": -bound,
            "zmax": bound,
        }
    else:
        colour = {"color_continuous_scale": LER_SCALE, "zmin": 0.0, "zmax": 1.0}
    fig = px.imshow(
        z,
        y=list(layers),
        x=[str(c) for c in range(z.shape[1])],
        origin="lower",
        aspect="auto",
        labels={"x": axis, "y": "layer", "color": VALUE_LABELS.get(value, value.replace("_", " "))},
        **colour,
    )
    fig.update_xaxes(type="category")
    fig.update_yaxes(**_layer_ticks(layers))
    fig.update_layout(title=title or f"{value} per layer and {axis}")
    return fig


IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp")


def save(
    fig: go.Figure, path: str | Path, width: int | None = None, height: int | None = None, scale: float = 2.0
) -> Path:
    """Write a figure to a file, out of the notebook.

    ``.png``/``.svg``/``.pdf`` (and ``.jpg``/``.webp``) go through kaleido (``pip install 'uds_lens[figures]'``;
    kaleido 1.x also needs a Chrome it can find). Without it, or when it fails, the figure is written as
    self-contained HTML next to the requested name (``fig.png`` -> ``fig.html``, plotly.js inlined, opens offline)
    with a warning saying why. ``.html`` is always written that way.

    Returns:
        The path actually written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    suffix = target.suffix.lower()
    if suffix in (".html", ".htm"):
        fig.write_html(target, include_plotlyjs=True, full_html=True)
        return target
    if suffix not in IMAGE_SUFFIXES:
        raise ValueError(f"Cannot save a figure as {target.name!r}: use one of {IMAGE_SUFFIXES} or .html.")
    try:
        import kaleido  # noqa: F401
    except ImportError:
        reason = "kaleido is not installed (pip install 'uds_lens[figures]')"
    else:
        try:
            fig.write_image(target, width=width, height=height, scale=scale)
            return target
        except Exception as err:  # kaleido without a usable browser, or an old plotly/kaleido pair
            reason = f"kaleido could not render it ({type(err).__name__}: {err})"
    fallback = target.with_suffix(".html")
    fig.write_html(fallback, include_plotlyjs=True, full_html=True)
    warnings.warn(
        f"{target} not written: {reason}. Wrote self-contained HTML to {fallback} instead.", stacklevel=2
    )
    return fallback


def published_scatter(
    table: pd.DataFrame, ours: str = "uds", published: str = "published_uds", title: str | None = None
) -> go.Figure:
    """Our UDS against the published one, one point per model of a sweep (``sweep.csv`` with ``--compare-published``).

    Points on the dashed diagonal agree; the hover names the model and the difference. Models without a published
    value (or without a score of ours) are left out and counted in the title. Colours are the registry's methods.
    """
    frame = table.copy()
    frame[ours] = pd.to_numeric(frame[ours], errors="coerce")
    frame[published] = pd.to_numeric(frame.get(published, np.nan), errors="coerce")
    both = frame.dropna(subset=[ours, published])
    colour = "method" if "method" in both and both["method"].notna().any() else None
    fig = px.scatter(
        both,
        x=published,
        y=ours,
        color=colour,
        hover_name="name",
        hover_data={"uds_minus_published": ":.3f"} if "uds_minus_published" in both else None,
        color_discrete_sequence=PALETTE,
    )
    fig.add_trace(
        go.Scatter(
            x=[0, 1],
            y=[0, 1],
            mode="lines",
            line={"dash": "dash", "color": "grey"},
            name="ours = published",
            hoverinfo="skip",
        )
    )
    left_out = len(frame) - len(both)
    fig.update_layout(
        title=title
        or f"UDS: ours vs published ({len(both)} models"
        + (f", {left_out} without both" if left_out else "")
        + ")",
        xaxis_title="published UDS",
        yaxis_title="our UDS",
        xaxis_range=[-0.05, 1.05],
        yaxis_range=[-0.05, 1.05],
    )
    return fig

"""Figures of the meta-evaluation: P vs N pool histograms with the faithfulness AUC, metric values before vs after an
attack, and a sweep's UDS against the published one.

The tables are the ones `uds_lens.meta_eval` writes. ``metrics.csv``: one row per model, its zoo ``role``
(``pos``: trained with the forget set, ``neg``: never saw it, or ``full``/``retain``/``unlearned``/...) and one column
per metric. ``robustness.csv``: ``metric, model, attack, before, after, score, passed`` with ``attack`` one of
``"quantisation"`` (NF4) and ``"relearning"``, and ``before``/``after`` already oriented as knowledge scores.
Faithfulness is the ROC AUC of the P pool (label 1) against the N pool on knowledge-oriented values: metrics where
high = erased (`ERASURE_METRICS`) are negated first, which ranks models like the meta-evaluation's ``1 - x``.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from sklearn.metrics import roc_auc_score

from uds_lens.metrics import registry
from uds_lens.plotting.style import PALETTE, palette_colour

# Metrics oriented so that high = erased (the registry's direction); negated before the P/N AUC (P saw the forget
# set, so P should score *low*), as the meta-evaluation does.
ERASURE_METRICS = frozenset(registry.names(direction=registry.ERASURE))
ATTACKS = ("quantisation", "relearning")


def _metrics_long(metrics: pd.DataFrame, pool_column: str) -> pd.DataFrame:
    if {"metric", "value"} <= set(metrics.columns):
        return metrics
    id_columns = [c for c in metrics.columns if c in (pool_column, "model", "name", "role", "method")]
    value_columns = [
        c for c in metrics.columns if c not in id_columns and pd.api.types.is_numeric_dtype(metrics[c])
    ]
    return metrics.melt(id_vars=id_columns, value_vars=value_columns, var_name="metric", value_name="value")


def _pool_auc(is_positive: pd.Series, knowledge: np.ndarray) -> float:
    """ROC AUC of the positive pool on knowledge-oriented values; NaN unless both pools have a model."""
    if is_positive.nunique() < 2:
        return float("nan")
    return float(roc_auc_score(is_positive.to_numpy(), knowledge))


def pool_histograms(
    metrics: pd.DataFrame,
    pool_column: str = "role",
    positive: str = "pos",
    negative: str = "neg",
    invert: Collection[str] | None = None,
    max_columns: int = 4,
    bins: int = 20,
    title: str | None = None,
) -> go.Figure:
    """P vs N pool histograms per metric, with the faithfulness AUC in each panel title (Figure 3 of the paper).

    Args:
        metrics: ``metrics.csv`` as ``run_meta_eval`` writes it (one row per model, its ``role`` and one numeric
            column per metric), or long ``model, role, metric, value``. Rows of other roles are left out.
        pool_column: column holding the pool label.
        positive: label of the P pool (models that saw the forget set; they should look like they *know*).
        negative: label of the N pool (models that never saw it).
        invert: metrics where high = erased, negated for the AUC only (default `ERASURE_METRICS`).
        max_columns: panels per row.
        bins: histogram bins per panel.
        title: figure title.
    """
    invert = ERASURE_METRICS if invert is None else frozenset(invert)
    long = _metrics_long(metrics, pool_column).dropna(subset=["value"])
    long = long[long[pool_column].isin([positive, negative])]
    metric_names = list(dict.fromkeys(long["metric"]))
    if not metric_names:
        raise ValueError(
            f"no numeric metric values of the {positive!r} and {negative!r} pools (column {pool_column!r})"
        )
    pools = [positive, negative]
    titles = []
    for metric in metric_names:
        part = long[long["metric"] == metric]
        sign = -1.0 if metric.lower() in invert else 1.0
        auc = _pool_auc(part[pool_column] == positive, sign * part["value"].to_numpy(dtype=float))
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
        title=title or f"Faithfulness: {positive} pool vs {negative} pool per metric",
        height=280 * rows + 80,
    )
    return fig


def robustness_scatter(
    table: pd.DataFrame,
    attack: str = "quantisation",
    retain: str | None = "retain",
    max_columns: int = 4,
    title: str | None = None,
) -> go.Figure:
    """Metric value before vs after an attack, per metric, with the y = x reference (paper Figure 2, appendix E).

    For ``attack="relearning"`` the expected line ``y = x + Δ_ret`` (the retain model's own shift) is drawn dashed
    when the retain model is in the table, and the retain model is a red star.

    Args:
        table: ``robustness.csv`` as ``run_meta_eval`` writes it (``metric, model, attack, before, after, ...``:
            the rows of ``attack`` are drawn), or long ``model, metric, before, after`` of one attack (optionally
            ``role``).
        attack: ``"quantisation"`` or ``"relearning"`` (which rows, the titles and the Δ_ret line).
        retain: model name of the retain model (also matched by ``role == "retain"``); None to ignore.
        max_columns: panels per row.
        title: figure title.
    """
    if attack not in ATTACKS:
        raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")
    missing = {"model", "metric", "before", "after"} - set(table.columns)
    if missing:
        raise ValueError(f"robustness table lacks columns {sorted(missing)}")
    if "attack" in table.columns:
        table = table[table["attack"] == attack]
        if table.empty:
            raise ValueError(f"the robustness table has no {attack!r} rows")
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
                marker={"color": palette_colour(0), "size": 7, "opacity": 0.8},
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
    label = "NF4 4-bit quantisation" if attack == "quantisation" else "1 epoch of relearning"
    fig.update_layout(title=title or f"Robustness: metric before vs after {label}", height=300 * rows + 80)
    return fig


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

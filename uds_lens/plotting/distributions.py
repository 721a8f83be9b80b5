"""Figures of per-example UDS: its distribution per model and its mean per prompt type, each with its clipped part.

A per-example ``UDS_i`` is the sum of two parts (``uds.uds_parts``): the measured part ``uds_unclipped_i`` (KE
layers with ``d2 <= d1``, at their ratio) and the clipped part ``uds_clipped_i`` (KE layers with ``d2 > d1``, each
counted as 1: over-disruption, not erasure). Both figures here show the two apart: the distribution beside the
measured part's own, with the examples that rest mostly on clipped cells marked; the prompt-type means stacked, the
clipped part hatched as in [`uds_bar`][uds_lens.plotting.models.uds_bar].
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from uds_lens.config import DEFAULT_TAU
from uds_lens.plotting.models import CLIPPED_PATTERN
from uds_lens.plotting.style import CLIPPED_MARK, examples_text, model_colour, rgba, set_title, tau_text
from uds_lens.plotting.tables import Results, count_text, long_by_model, named_results, tau_of
from uds_lens.uds import mostly_clipped

CLIPPED_COLOUR = CLIPPED_MARK["color"]
"""The colour of an example whose ``UDS_i`` rests mostly on clipped cells (``uds.mostly_clipped``), the red of the
clipped cells' marks in heatmaps and per-example curves."""


def _with_parts(frame: pd.DataFrame) -> pd.DataFrame:
    """An examples table with numeric ``uds`` and its parts (NaN where a table lacks them), scored rows only."""
    frame = frame.assign(uds=pd.to_numeric(frame["uds"], errors="coerce")).dropna(subset=["uds"])
    for column in ("uds_unclipped", "uds_clipped"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce") if column in frame.columns else np.nan
    return frame.reset_index(drop=True)


def uds_distribution(results: Results, kind: str = "violin", title: str | None = None) -> go.Figure:
    """Distribution of per-example UDS for each model (examples with a defined UDS only), beside its measured part.

    ``violin``: one split violin per model, ``UDS_i`` on the right half (its points drawn, red for each example
    that rests mostly on clipped cells) and the measured part ``uds_unclipped_i`` on the left, paler: where the right
    half sits high and the left low, the scores are clipped cells, not measured erasure.
    ``histogram``: per model, ``UDS_i`` (plain) and its measured part (hatched), overlaid, bins of 0.05.

    Args:
        results: ``{name: result}`` (or one result); each needs an examples table (``.examples`` or the DataFrame).
        kind: ``"violin"`` or ``"histogram"``.
        title: figure title; under it the figure states its basis (examples per model, tau).
    """
    if kind not in ("violin", "histogram"):
        raise ValueError(f"kind must be 'violin' or 'histogram', got {kind!r}")
    frame = _with_parts(long_by_model(results, attribute="examples"))
    has_parts = bool(frame["uds_unclipped"].notna().any())
    fig = go.Figure()
    for model in dict.fromkeys(frame["model"]):
        part = frame[frame["model"] == model]
        colour = model_colour(model)
        if kind == "violin":
            common = {"x": [model] * len(part), "legendgroup": model, "spanmode": "hard", "scalegroup": model}
            if has_parts:
                fig.add_trace(
                    go.Violin(
                        y=part["uds_unclipped"],
                        name=f"{model}: measured part",
                        side="negative",
                        points=False,
                        line={"color": rgba(colour, 0.7), "width": 1},
                        fillcolor=rgba(colour, 0.12),
                        meanline_visible=True,
                        showlegend=False,
                        hovertemplate="%{x}: measured part, mean line and spread<extra></extra>",
                        **common,
                    )
                )
            clipped = mostly_clipped(
                part["uds_unclipped"].to_numpy(float), part["uds_clipped"].to_numpy(float)
            )
            fig.add_trace(
                go.Violin(
                    y=part["uds"],
                    name=model,
                    side="positive" if has_parts else "both",
                    box_visible=not has_parts,
                    meanline_visible=True,
                    points="all",
                    jitter=0.3,
                    pointpos=0.5 if has_parts else 0.0,
                    marker={"size": 4, "color": "rgba(40,40,40,0.6)"},
                    selectedpoints=list(np.flatnonzero(clipped)),
                    selected={"marker": {"color": CLIPPED_COLOUR, "size": 7}},
                    unselected={"marker": {"opacity": 0.6}},
                    line={"color": colour},
                    customdata=part[["idx", "uds_unclipped", "uds_clipped"]].to_numpy(float)
                    if "idx" in part.columns
                    else None,
                    hovertemplate="%{x}<br>example %{customdata[0]:.0f}: UDS %{y:.3f} = measured "
                    "%{customdata[1]:.3f} + clipped %{customdata[2]:.3f}<extra></extra>",
                    showlegend=False,
                    **common,
                )
            )
        else:
            bins = {"start": 0.0, "end": 1.0 + 1e-9, "size": 0.05}
            fig.add_trace(
                go.Histogram(x=part["uds"], name=model, xbins=bins, opacity=0.55, marker={"color": colour})
            )
            if has_parts:
                fig.add_trace(
                    go.Histogram(
                        x=part["uds_unclipped"],
                        name=f"{model}: measured part",
                        xbins=bins,
                        opacity=0.55,
                        marker={"color": rgba(colour, 0.2), "pattern": {"shape": "x", "fgcolor": colour}},
                    )
                )
    if kind == "violin":
        fig.update_layout(
            yaxis={"title": "UDS<sub>i</sub> (right) · measured part (left)", "range": [-0.05, 1.05]},
            showlegend=False,
            violingap=0.15,
            violinmode="overlay",
        )
    else:
        fig.update_layout(
            barmode="overlay", xaxis_title="UDS<sub>i</sub> · measured part", yaxis_title="examples"
        )
    counts = frame.groupby("model")["uds"].count()
    marks = (
        "right: UDS_i, red = rests mostly on clipped cells (d2 > d1); left: its measured part (d2 ≤ d1)"
        if kind == "violin"
        else "plain: UDS_i; hatched: its measured part (d2 ≤ d1)"
    )
    return set_title(
        fig,
        title or "Per-example UDS by model, beside its measured part",
        [
            f"{examples_text(count_text(counts))} per model (scored: a KE layer)",
            tau_of(named_results(results), DEFAULT_TAU) if not isinstance(results, pd.DataFrame) else "",
            marks if has_parts else "the split is not in these tables",
        ],
    )


def prompt_type_bar(results: Results, title: str | None = None, tau: float = DEFAULT_TAU) -> go.Figure:
    """Mean UDS per prompt type (the paper's Table 5 as a figure), grouped by model, each bar split into its
    measured part (plain) and its clipped part (hatched), with example counts.

    Args:
        results: ``{name: result}``, one result, an examples table (needs ``prompt_type`` and ``uds``; with
            ``uds_unclipped`` and ``uds_clipped`` the bars are split), or the summary table of
            ``analysis.prompt_type_uds`` (``model, prompt_type, n_scored, mean_uds``, split when it has
            ``mean_uds_clipped``).
        title: figure title; under it the figure states its basis (examples, tau).
        tau: the KE threshold stated when ``results`` are tables that do not carry it (results do).
    """
    if isinstance(results, pd.DataFrame) and "mean_uds" in results.columns:
        # A summary table (analysis.prompt_type_uds / prompt_types.csv): no per-example spread to show.
        count = results["n_scored"] if "n_scored" in results.columns else results.get("n", np.nan)
        table = pd.DataFrame(
            {
                "model": results["model"] if "model" in results.columns else "model",
                "prompt_type": results["prompt_type"].astype(str),
                "mean": results["mean_uds"],
                "clipped": results["mean_uds_clipped"] if "mean_uds_clipped" in results.columns else np.nan,
                "count": count,
                "std": np.nan,
            }
        )
    else:
        frame = _with_parts(long_by_model(results, attribute="examples"))
        frame["prompt_type"] = frame["prompt_type"].fillna("(none)").astype(str)
        grouped = frame.groupby(["model", "prompt_type"], sort=False)
        table = grouped["uds"].agg(["mean", "count", "std"]).reset_index()
        table["clipped"] = grouped["uds_clipped"].mean().to_numpy()
    split = bool(table["clipped"].notna().any())
    fig = go.Figure()
    for model in dict.fromkeys(table["model"]):
        part = table[table["model"] == model]
        colour = model_colour(str(model))
        measured = part["mean"] - part["clipped"].fillna(0.0) if split else part["mean"]
        hover = "%{x}<br>mean UDS %{customdata[0]:.3f}" + (
            " = measured %{customdata[1]:.3f} + clipped %{customdata[2]:.3f}" if split else ""
        )
        custom = np.column_stack([part["mean"], measured, part["clipped"]])
        fig.add_trace(
            go.Bar(
                x=part["prompt_type"],
                y=measured,
                name=model,
                offsetgroup=str(model),
                legendgroup=str(model),
                marker={"color": colour},
                text=[f"n={n:.0f}" if pd.notna(n) else "" for n in part["count"]],
                textposition="inside",
                insidetextanchor="start",
                customdata=custom,
                hovertemplate=hover + "<br>%{text}<extra>" + str(model) + "</extra>",
            )
        )
        error = {
            "type": "data",
            "array": (part["std"] / np.sqrt(part["count"])).to_numpy(dtype=float),
            "visible": bool(part["std"].notna().any()),
        }
        if split:
            fig.add_trace(
                go.Bar(
                    x=part["prompt_type"],
                    y=part["clipped"],
                    base=measured,
                    name=f"{model}: clipped part",
                    offsetgroup=str(model),
                    legendgroup=str(model),
                    showlegend=False,
                    marker={
                        "color": rgba(colour, 0.28),
                        "pattern": {**CLIPPED_PATTERN, "fgcolor": colour},
                        "line": {"color": colour, "width": 1},
                    },
                    error_y=error,
                    customdata=custom,
                    hovertemplate=hover + "<extra>" + str(model) + "</extra>",
                )
            )
        else:
            fig.data[-1].error_y = error
    fig.update_layout(
        barmode="group", xaxis_title="prompt type", yaxis={"title": "mean UDS<sub>i</sub>", "range": [0, 1.1]}
    )
    totals = table.groupby("model", sort=False)["count"].sum()
    taus = tau_of(named_results(results), tau) if not isinstance(results, pd.DataFrame) else tau_text(tau)
    return set_title(
        fig,
        title or "Mean UDS per prompt type" + (" (± s.e.m.)" if table["std"].notna().any() else ""),
        [
            f"{examples_text(count_text(totals))} per model (scored), n per type on the bars",
            taus,
            "hatched: the part from clipped cells (d2 > d1: over-disruption)"
            if split
            else "the split is not in this table",
        ],
    )


__all__ = ["CLIPPED_COLOUR", "prompt_type_bar", "uds_distribution"]

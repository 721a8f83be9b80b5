"""Figures that compare models: the model table behind them, UDS bars with CIs, per-example distributions, prompt
types, and the RMU layer profile.

A model's UDS is the mean of its defined per-example scores and its 95% CI the bootstrap over examples, both as
[`uds_lens.uds`][uds_lens.uds] computes them (``model_uds``, ``bootstrap_ci``); a result's own ``summary`` is used when it has
them, so a bar shows exactly the number the result reports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from uds_lens.config import DEFAULT_TAU
from uds_lens.layer_table import one_site
from uds_lens.plotting.style import layer_ticks, model_colour
from uds_lens.plotting.tables import HasExamples, Results, long_by_model, mean_ler_on_ke, named_results
from uds_lens.uds import bootstrap_ci, clipped_summary, model_uds


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


def _clipped(result: Any, summary: Mapping[str, Any]) -> dict[str, float]:
    """A result's clipped share and median ``d2 / d1`` (its summary's, else counted from its layers table)."""
    keys = ("clipped_share", "clipped_median_ratio")
    if "clipped_share" in summary:
        return {key: float("nan") if summary.get(key) is None else float(summary[key]) for key in keys}
    layers = getattr(result, "layers", None)
    if isinstance(layers, pd.DataFrame) and {"d1", "d2"} <= set(layers.columns):
        tau = (getattr(result, "settings", None) or summary.get("settings") or {}).get("tau", DEFAULT_TAU)
        counted = clipped_summary(layers["d1"].to_numpy(dtype=float), layers["d2"].to_numpy(dtype=float), tau)
        return {key: counted[key] for key in keys}
    return {key: float("nan") for key in keys}


def model_frame(
    results: Results | Mapping[str, HasExamples], roles: Mapping[str, str] | None = None, n_boot: int = 2000
) -> pd.DataFrame:
    """One row per model: UDS, its 95% CI and the example counts.

    Args:
        results: ``{name: result}`` where a result has ``.summary`` (``uds``, ``ci95``, counts) and/or ``.examples``;
            or a DataFrame already holding ``model, uds, ci_low, ci_high``. A missing CI is bootstrapped over examples.
        roles: optional ``{name: role}`` (zoo roles: full, retain, unlearned, ...), added as a ``role`` column.
        n_boot: bootstrap resamples when a CI has to be computed here (2000, as ``UDSResult.summary`` uses).

    Returns:
        DataFrame with columns ``model, uds, ci_low, ci_high, n_scored, n_no_ke, n_skipped, clipped_share,
        clipped_median_ratio`` (+ ``role``): ``clipped_share`` is the share of KE cells with ``d2 > d1``, whose
        LER the clip cut to 1 (over-disruption; from the summary, else counted from ``.layers``).
    """
    if isinstance(results, pd.DataFrame):
        frame = results.copy()
        missing = {"model", "uds"} - set(frame.columns)
        if missing:
            raise ValueError(f"model table lacks columns {sorted(missing)}")
    else:
        rows = []
        for name, result in named_results(results).items():
            summary = getattr(result, "summary", None) or {}
            examples = getattr(result, "examples", None)
            uds = summary.get("uds")
            ci = _ci_pair(summary.get("ci95"))
            counts = {key: summary.get(key) for key in ("n_scored", "n_no_ke", "n_skipped")}
            if isinstance(examples, pd.DataFrame) and "uds" in examples.columns:
                per_example = pd.to_numeric(examples["uds"], errors="coerce").to_numpy(dtype=float)
                if uds is None:
                    uds = model_uds(per_example)
                if ci is None:
                    ci = bootstrap_ci(per_example, n_boot=n_boot)
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
                    **_clipped(result, summary),
                }
            )
        frame = pd.DataFrame(rows)
    if roles is not None:
        frame["role"] = [roles.get(name) for name in frame["model"]]
    return frame


def uds_bar(
    results: Results | pd.DataFrame,
    roles: Mapping[str, str] | None = None,
    sort: bool = False,
    title: str | None = None,
) -> go.Figure:
    """Model UDS as bars with bootstrap 95% CIs.

    Args:
        results: ``{name: result}``, one result, or a model table (``model, uds, ci_low, ci_high`` [, ``role``]) as
            from [`model_frame`][uds_lens.plotting.models.model_frame].
        roles: optional ``{name: role}``, shown in each bar's hover and label (bars are coloured by model:
            `model_colour`, the same colour as in every other figure).
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
    has_roles = "role" in frame.columns and frame["role"].notna().any()
    role = frame["role"].fillna("") if has_roles else pd.Series("", index=frame.index)
    fig.add_trace(
        go.Bar(
            x=frame["model"],
            y=frame["uds"],
            name="UDS",
            marker={"color": [model_colour(str(model)) for model in frame["model"]]},
            error_y=error,
            customdata=np.column_stack([frame[["ci_low", "ci_high"]].to_numpy(dtype=float), role.to_numpy()]),
            hovertemplate=hover.replace("%{x}<br>", "%{x} %{customdata[2]}<br>"),
            showlegend=False,
        )
    )
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=list(frame["model"]))
    fig.update_layout(
        title=title or "UDS per model (95% bootstrap CI over examples)",
        yaxis={"title": "UDS (0 = knowledge recoverable, 1 = erased like retain)", "range": [0, 1.05]},
        xaxis_title="model",
    )
    return fig


def uds_distribution(results: Results, kind: str = "violin", title: str | None = None) -> go.Figure:
    """Distribution of per-example UDS for each model (examples with a defined UDS only).

    Args:
        results: ``{name: result}`` (or one result); each needs an examples table (``.examples`` or the DataFrame).
        kind: ``"violin"`` (one violin per model, points shown) or ``"histogram"`` (overlaid, 0-1 bins of 0.05).
        title: figure title.
    """
    frame = long_by_model(results, attribute="examples")
    frame = frame.assign(uds=pd.to_numeric(frame["uds"], errors="coerce")).dropna(subset=["uds"])
    models = list(dict.fromkeys(frame["model"]))
    fig = go.Figure()
    for model in models:
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
                    line={"color": model_colour(model)},
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
                    marker={"color": model_colour(model)},
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


def prompt_type_bar(results: Results, title: str | None = None) -> go.Figure:
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
        frame = long_by_model(results, attribute="examples")
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
    for model in dict.fromkeys(table["model"]):
        part = table[table["model"] == model]
        fig.add_trace(
            go.Bar(
                x=part["prompt_type"],
                y=part["mean"],
                name=model,
                marker={"color": model_colour(str(model))},
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


def rmu_layer_profile(
    results: Results,
    target_layers: Mapping[str, int] | None = None,
    tau: float = DEFAULT_TAU,
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
    long = one_site(long_by_model(results), site)
    fig = go.Figure()
    for model in dict.fromkeys(long["model"]):
        colour = model_colour(model)
        mean = mean_ler_on_ke(long[long["model"] == model], tau)
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
        xaxis={"title": "layer", **layer_ticks(long["layer"])},
        yaxis={"title": "mean LER", "range": [0, 1.05]},
    )
    return fig


def rmu_target_layer(name: str) -> int | None:
    """The RMU target layer encoded in a model name (``rmu_l5``, ``RMU-L10``), or None."""
    match = re.search(r"rmu[_\-]?l(\d+)", name, flags=re.IGNORECASE)
    return int(match.group(1)) if match else None

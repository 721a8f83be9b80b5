"""Figures that compare models: the model table behind them, UDS bars with CIs split into the part from measured
ratios and the part from clipped cells, depth against damage, per-example distributions, prompt types, and the RMU
layer profile.

A model's UDS is the mean of its defined per-example scores and its 95% CI the bootstrap over examples, both as
`uds_lens.uds` computes them (``model_uds``, ``bootstrap_ci``); its two parts (``uds_parts``) and its excess
disruption (``excess_disruption``) likewise. A result's own ``summary`` is used when it has them, so a bar shows
exactly the number the result reports.
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
from uds_lens.plotting.style import (
    REFERENCE_LINE,
    examples_text,
    layer_ticks,
    model_colour,
    rgba,
    set_title,
    tau_text,
)
from uds_lens.plotting.tables import (
    HasExamples,
    Results,
    count_text,
    long_by_model,
    mean_ler_on_ke,
    named_results,
    result_tau,
    tau_of,
)
from uds_lens.uds import bootstrap_ci, clipped_summary, model_uds, rescore

SPLIT_KEYS = ("uds_unclipped", "uds_clipped", "uds_clipped_share", "excess_disruption")
"""The model table's columns that say where UDS comes from (``UDSResult.split``)."""
CLIPPED_PATTERN = {"shape": "/", "solidity": 0.45, "size": 8}
"""How the part of a UDS bar that comes from clipped cells is drawn: hatched over a pale fill of the model's colour."""


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


def _split(result: Any, summary: Mapping[str, Any], uds: float) -> dict[str, float]:
    """A result's UDS split and excess disruption (its summary's, else from its examples or layers tables)."""
    if "uds_clipped" in summary:
        return {key: float("nan") if summary.get(key) is None else float(summary[key]) for key in SPLIT_KEYS}
    examples = getattr(result, "examples", None)
    if not (isinstance(examples, pd.DataFrame) and "uds_clipped" in examples.columns):
        layers = getattr(result, "layers", None)
        if not (isinstance(layers, pd.DataFrame) and {"idx", "d1", "d2"} <= set(layers.columns)):
            return {key: float("nan") for key in SPLIT_KEYS}
        examples = rescore(one_site(layers, None), result_tau(result, DEFAULT_TAU))[1]
    means = {
        key: model_uds(pd.to_numeric(examples[key], errors="coerce").to_numpy(dtype=float))
        for key in ("uds_unclipped", "uds_clipped", "excess_disruption")
    }
    means["uds_clipped_share"] = means["uds_clipped"] / uds if uds > 0 else float("nan")
    return means


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
        clipped_median_ratio, uds_unclipped, uds_clipped, uds_clipped_share, excess_disruption, tau`` (+ ``role``):
        ``clipped_share`` is the share of KE cells with ``d2 > d1``, whose LER the clip cut to 1 (over-disruption;
        from the summary, else counted from ``.layers``); ``uds_unclipped + uds_clipped = uds``, the parts of UDS
        from measured ratios and from clipped cells, ``uds_clipped_share`` the second's share of UDS, and
        ``excess_disruption`` how far past retain's disruption the model's goes (``UDSResult.split``); ``tau`` the
        KE threshold the model was scored with.
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
            uds = float("nan") if uds is None else float(uds)
            rows.append(
                {
                    "model": name,
                    "uds": uds,
                    "ci_low": float("nan") if ci is None else ci[0],
                    "ci_high": float("nan") if ci is None else ci[1],
                    **counts,
                    **_clipped(result, summary),
                    **_split(result, summary, uds),
                    "tau": result_tau(result, float("nan")),
                }
            )
        frame = pd.DataFrame(rows)
    if roles is not None:
        frame["role"] = [roles.get(name) for name in frame["model"]]
    return frame


def _ci_bars(frame: pd.DataFrame, **style: Any) -> dict[str, Any]:
    """Error bars from each model's UDS to its 95% CI bounds (``model_frame``'s ``ci_low``/``ci_high``), styled
    with ``style``."""
    return {
        "type": "data",
        "symmetric": False,
        "array": (frame["ci_high"] - frame["uds"]).clip(lower=0).to_numpy(),
        "arrayminus": (frame["uds"] - frame["ci_low"]).clip(lower=0).to_numpy(),
        **style,
    }


def _basis(frame: pd.DataFrame, what: str) -> list[str]:
    """A model figure's basis: the scored examples per model, the KE threshold(s), and ``what`` else it rests on."""
    counts = frame["n_scored"].dropna() if "n_scored" in frame.columns else pd.Series(dtype=float)
    n_text = f"{examples_text(count_text(counts))} per model (scored)" if len(counts) else "n: –"
    taus = frame["tau"].dropna().unique() if "tau" in frame.columns else []
    tau = (
        tau_text(float(taus[0]))
        if len(taus) == 1
        else ("tau = " + ", ".join(f"{t:g}" for t in taus) + " nats")
    )
    return [n_text, tau if len(taus) else tau_text(None), what]


def uds_bar(
    results: Results | pd.DataFrame,
    roles: Mapping[str, str] | None = None,
    sort: bool = False,
    title: str | None = None,
) -> go.Figure:
    """Model UDS as bars with bootstrap 95% CIs, each bar split into where its score comes from.

    The lower, plain part of a bar is ``uds_unclipped`` (KE cells with ``d2 <= d1``: the unlearned model's patch
    disrupts at most as much as retain's, a measured erasure ratio); the upper, hatched part is ``uds_clipped``
    (KE cells with ``d2 > d1``, each read as fully erased although the unlearned activation disrupts *more* than
    retain's: damage, or erasure plus damage), labelled with its share of UDS. A model table without the split
    draws whole bars.

    Args:
        results: ``{name: result}``, one result, or a model table (``model, uds, ci_low, ci_high`` [, ``role``,
            ``uds_unclipped``, ``uds_clipped``, ``uds_clipped_share``]) as from
            [`model_frame`][uds_lens.plotting.models.model_frame].
        roles: optional ``{name: role}``, shown in each bar's hover and label (bars are coloured by model:
            ``style.model_colour``, the same colour as in every other figure).
        sort: order bars by UDS instead of the given order.
        title: figure title; under it the figure states its basis (examples per model, tau, the CI).
    """
    frame = model_frame(results, roles=roles)
    if sort:
        frame = frame.sort_values("uds", na_position="last")
    frame = frame.reset_index(drop=True)
    for key in SPLIT_KEYS:
        if key not in frame.columns:
            frame[key] = float("nan")
    split = bool(frame["uds_clipped"].notna().any())
    has_roles = "role" in frame.columns and frame["role"].notna().any()
    role = frame["role"].fillna("") if has_roles else pd.Series("", index=frame.index)
    colours = [model_colour(str(model)) for model in frame["model"]]
    custom = np.column_stack(
        [
            frame[["uds", "ci_low", "ci_high", "uds_unclipped", "uds_clipped", "excess_disruption"]].to_numpy(
                float
            ),
            (100 * frame["uds_clipped_share"].fillna(0.0)).to_numpy(float),
            role.to_numpy(),
        ]
    )
    hover = (
        "%{x} %{customdata[7]}<br>UDS %{customdata[0]:.3f}, 95% CI [%{customdata[1]:.3f}, %{customdata[2]:.3f}]"
        + (
            "<br>from measured ratios (d2 ≤ d1) %{customdata[3]:.3f}<br>from clipped cells (d2 > d1) "
            "%{customdata[4]:.3f} (%{customdata[6]:.0f}% of UDS)<br>excess disruption %{customdata[5]:.2f}"
            if split
            else ""
        )
        + "<extra></extra>"
    )
    fig = go.Figure()
    common = {"x": frame["model"], "customdata": custom, "hovertemplate": hover, "showlegend": False}
    if split:
        fig.add_trace(go.Bar(y=frame["uds"] - frame["uds_clipped"], name="from measured ratios",
                             marker={"color": colours}, **common))  # fmt: skip
        fig.add_trace(
            go.Bar(
                y=frame["uds_clipped"],
                name="from clipped cells",
                marker={
                    "color": [rgba(colour, 0.28) for colour in colours],
                    "pattern": {**CLIPPED_PATTERN, "fgcolor": colours},
                    "line": {"color": colours, "width": 1},
                },
                **common,
            )
        )
        for label, marker in (
            ("from measured ratios (d2 ≤ d1)", {"color": "#777777"}),
            ("from clipped cells (d2 > d1): hatched",
             {"color": "#dddddd", "pattern": {**CLIPPED_PATTERN, "fgcolor": "#555555"}}),
        ):  # fmt: skip
            fig.add_trace(go.Bar(x=[None], y=[None], name=label, marker=marker, showlegend=True))
    else:
        fig.add_trace(go.Bar(y=frame["uds"], name="UDS", marker={"color": colours}, **common))
    fig.add_trace(
        go.Scatter(
            x=frame["model"],
            y=frame["uds"],
            mode="markers",
            marker={"size": 1, "color": "rgba(0,0,0,0)"},
            error_y=_ci_bars(frame, color="#333333"),
            hoverinfo="skip",
            showlegend=False,
        )
    )
    if split:
        top = np.fmax(frame["ci_high"].to_numpy(float), frame["uds"].to_numpy(float))
        for model, height, share in zip(frame["model"], top, frame["uds_clipped_share"], strict=True):
            if pd.notna(share) and pd.notna(height):
                fig.add_annotation(x=model, y=height, text=f"{share:.0%}", showarrow=False, yanchor="bottom",
                                   yshift=2, font={"size": 11})  # fmt: skip
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=list(frame["model"]))
    fig.update_layout(
        barmode="stack",
        yaxis={"title": "UDS (0 = as full, 1 = as retain)", "range": [0, 1.12]},
        xaxis_title="model",
        legend={
            "orientation": "h",
            "y": -0.25,
            "yanchor": "top",
            "x": 0.0,
            "xanchor": "left",
            "traceorder": "normal",
        },
    )
    what = "95% bootstrap CI over examples" + (
        "; hatched: the part from clipped KE cells (d2 > d1), its share of UDS above each bar"
        if split
        else ""
    )
    return set_title(fig, title or "UDS per model, split by where it comes from", _basis(frame, what))


def _label_sides(x: np.ndarray, y: np.ndarray) -> list[str]:
    """Text positions for point labels: right of each point, alternately above and below it where a neighbour
    (in the order of ``y``) sits close enough for the labels to overlap."""
    sides = ["middle right"] * len(x)
    span_x = max(float(np.nanmax(x) - np.nanmin(x)), 1e-9) if len(x) else 1.0
    previous = None
    for position in np.argsort(y, kind="stable"):
        if (
            previous is not None
            and abs(y[position] - y[previous]) < 0.06
            and abs(x[position] - x[previous]) < 0.15 * span_x
        ):
            sides[position] = "top right" if sides[previous] != "top right" else "bottom right"
        previous = position
    return sides


def depth_vs_damage(
    results: Results | pd.DataFrame, roles: Mapping[str, str] | None = None, title: str | None = None
) -> go.Figure:
    """Each model placed by its UDS (y) and its excess disruption (x): erasure and damage apart.

    Two models can both score UDS near 1: one whose activations disrupt the full model's answer as much as the
    retain model's (top left: erased like retain, excess near 0) and one whose activations disrupt it far more
    (top right: its UDS rests on clipped cells, the hidden state is broken, not cleaned). The excess disruption is
    ``sum_KE max(0, d2 - d1) / sum_KE d1`` per example, averaged over the scored examples (``uds.excess_disruption``);
    the marker's size grows with the share of UDS from clipped cells, the vertical bar is UDS's 95% CI.

    Args:
        results: ``{name: result}``, one result, or a model table as from
            [`model_frame`][uds_lens.plotting.models.model_frame] (with
            ``excess_disruption``).
        roles: optional ``{name: role}`` shown in the hover.
        title: figure title; under it the figure states its basis.
    """
    frame = model_frame(results, roles=roles).reset_index(drop=True)
    if "excess_disruption" not in frame.columns or frame["excess_disruption"].isna().all():
        raise ValueError(
            "depth_vs_damage needs each model's excess_disruption (UDSResult.split, model_frame)"
        )
    frame = frame.dropna(subset=["uds", "excess_disruption"])
    share = frame["uds_clipped_share"].fillna(0.0).to_numpy(float) if "uds_clipped_share" in frame else 0.0
    role = frame["role"].fillna("") if "role" in frame.columns else pd.Series("", index=frame.index)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=frame["excess_disruption"],
            y=frame["uds"],
            mode="markers+text",
            text=frame["model"],
            textposition=_label_sides(
                frame["excess_disruption"].to_numpy(float), frame["uds"].to_numpy(float)
            ),
            marker={
                "size": 10 + 14 * share,
                "color": [model_colour(str(model)) for model in frame["model"]],
                "line": {"width": 1, "color": "#333333"},
            },
            error_y=_ci_bars(frame, color="#999999", thickness=1),
            customdata=np.column_stack([100 * share * np.ones(len(frame)), role.to_numpy()]),
            hovertemplate="%{text} %{customdata[1]}<br>UDS %{y:.3f}<br>excess disruption %{x:.2f}<br>"
            "from clipped cells: %{customdata[0]:.0f}% of UDS<extra></extra>",
            showlegend=False,
        )
    )
    right = max(float(frame["excess_disruption"].max()), 0.5) * 1.15
    fig.add_vline(x=0.0, line=REFERENCE_LINE)
    for x, anchor, text in (
        (0.01, "left", "↖ erased like retain (no excess)"),
        (0.99, "right", "damaged: disrupts beyond retain ↗"),
    ):
        fig.add_annotation(x=x, y=1.0, xref="paper", yref="paper", xanchor=anchor, yanchor="top",
                           text=text, showarrow=False, font={"size": 11, "color": "#555555"})  # fmt: skip
    fig.update_layout(
        xaxis={
            "title": "excess disruption (extra nats of drop per nat of d1, past retain)",
            "range": [-0.05 * right, right],
        },
        yaxis={"title": "UDS", "range": [-0.05, 1.12]},
    )
    what = "marker size: share of UDS from clipped cells (d2 > d1); bars: 95% CI of UDS"
    return set_title(fig, title or "Depth vs damage: UDS against excess disruption", _basis(frame, what))


def uds_distribution(results: Results, kind: str = "violin", title: str | None = None) -> go.Figure:
    """Distribution of per-example UDS for each model (examples with a defined UDS only).

    Args:
        results: ``{name: result}`` (or one result); each needs an examples table (``.examples`` or the DataFrame).
        kind: ``"violin"`` (one violin per model, points shown) or ``"histogram"`` (overlaid, 0-1 bins of 0.05).
        title: figure title; under it the figure states its basis (examples per model, tau).
    """
    frame = long_by_model(results, attribute="examples")
    if "uds_clipped" not in frame.columns:
        frame = frame.assign(uds_clipped=np.nan)
    frame = frame.assign(uds=pd.to_numeric(frame["uds"], errors="coerce")).dropna(subset=["uds"])
    models = list(dict.fromkeys(frame["model"]))
    fig = go.Figure()
    for model in models:
        values = frame.loc[frame["model"] == model, "uds"]
        part = frame.loc[frame["model"] == model]
        hover = part[["idx", "uds_clipped"]].to_numpy(float) if "idx" in frame.columns else None
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
                    hovertemplate="%{x}<br>example %{customdata[0]:.0f}: UDS %{y:.3f}, from clipped cells "
                    "%{customdata[1]:.3f}<extra></extra>",
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
    counts = frame.groupby("model")["uds"].count()
    return set_title(
        fig,
        title or "Per-example UDS by model",
        [
            f"{examples_text(count_text(counts))} per model (scored: a KE layer)",
            tau_of(named_results(results), DEFAULT_TAU) if not isinstance(results, pd.DataFrame) else "",
        ],
    )


def prompt_type_bar(results: Results, title: str | None = None, tau: float = DEFAULT_TAU) -> go.Figure:
    """Mean UDS per prompt type (the paper's Table 5 as a figure), grouped by model, with example counts.

    Args:
        results: ``{name: result}``, one result, an examples table (needs ``prompt_type`` and ``uds``), or the
            summary table of ``analysis.prompt_type_uds`` (``model, prompt_type, n_scored, mean_uds``).
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
        barmode="group", xaxis_title="prompt type", yaxis={"title": "mean UDS<sub>i</sub>", "range": [0, 1.1]}
    )
    totals = table.groupby("model", sort=False)["count"].sum()
    taus = tau_of(named_results(results), tau) if not isinstance(results, pd.DataFrame) else tau_text(tau)
    return set_title(
        fig,
        title or "Mean UDS per prompt type" + (" (± s.e.m.)" if table["std"].notna().any() else ""),
        [f"{examples_text(count_text(totals))} per model (scored), n per type on the bars", taus],
    )


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
        title: figure title; under it the figure states its basis (examples per model, tau).
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
        xaxis={"title": "layer", **layer_ticks(long["layer"])},
        yaxis={"title": "mean LER", "range": [0, 1.05]},
    )
    counts = long.groupby("model")["idx"].nunique()
    taus = tau_of(named_results(results), tau) if not isinstance(results, pd.DataFrame) else tau_text(tau)
    return set_title(
        fig,
        title or "Layer erasure profile (mean LER on KE cells); dashed = RMU target layer",
        [f"{examples_text(count_text(counts))} per model", f"KE cells: d1 > {taus}"],
    )


def rmu_target_layer(name: str) -> int | None:
    """The RMU target layer encoded in a model name (``rmu_l5``, ``RMU-L10``), or None."""
    match = re.search(r"rmu[_\-]?l(\d+)", name, flags=re.IGNORECASE)
    return int(match.group(1)) if match else None

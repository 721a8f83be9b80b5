"""Figures that compare models: the model table behind them, UDS bars with CIs split into the measured part and the
part from clipped cells, the measured part against the excess disruption (depth against over-disruption), and the
RMU layer profile. The per-example distributions and prompt types are in
[`distributions`][uds_lens.plotting.distributions].

A model's UDS is the mean of its defined per-example scores and its 95% CI the bootstrap over examples, both as
`uds_lens.uds` computes them (``model_uds``, ``bootstrap_ci``); its two parts (``uds_parts``), its excess disruption
(``excess_disruption``) and their CIs (``split_ci``) likewise. A result's own ``summary`` is used when it has them,
so a bar shows exactly the number the result reports.
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
    clipped_part_by_layer,
    count_text,
    dtype_text,
    long_by_model,
    mean_ler_on_ke,
    named_results,
    result_dtype,
    result_tau,
    tau_of,
)
from uds_lens.uds import SPLIT_COLUMNS, bootstrap_ci, clipped_summary, model_uds, rescore, split_ci

SPLIT_KEYS = ("uds_unclipped", "uds_clipped", "uds_clipped_share", "excess_disruption")
"""The model table's columns that say where UDS comes from (``UDSResult.split``)."""
SPLIT_CI_COLUMNS = tuple(f"{key}_ci_{end}" for key in SPLIT_COLUMNS for end in ("low", "high"))
"""The model table's bounds of the 95% CIs of the two parts and of the excess (``UDSResult.split_ci95``)."""
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


def _split_examples(result: Any) -> pd.DataFrame | None:
    """A result's per-example split (its examples table, else rescored from its layers table), or None."""
    examples = getattr(result, "examples", None)
    if isinstance(examples, pd.DataFrame) and "uds_clipped" in examples.columns:
        return examples
    layers = getattr(result, "layers", None)
    if not (isinstance(layers, pd.DataFrame) and {"idx", "d1", "d2"} <= set(layers.columns)):
        return None
    return rescore(one_site(layers, None), result_tau(result, DEFAULT_TAU))[1]


def _split(result: Any, summary: Mapping[str, Any], uds: float, n_boot: int) -> dict[str, float]:
    """A result's UDS split, excess disruption and their CIs (its summary's, else from its examples or layers
    tables): `SPLIT_KEYS` and `SPLIT_CI_COLUMNS`."""
    nan = float("nan")
    cis = summary.get("split_ci95") if isinstance(summary.get("split_ci95"), Mapping) else None
    if "uds_clipped" in summary and cis is not None:
        means = {key: nan if summary.get(key) is None else float(summary[key]) for key in SPLIT_KEYS}
        pairs = {key: _ci_pair(cis.get(key)) for key in SPLIT_COLUMNS}
    else:
        examples = _split_examples(result)
        if examples is None:
            return {key: nan for key in (*SPLIT_KEYS, *SPLIT_CI_COLUMNS)}
        means = {
            key: model_uds(pd.to_numeric(examples[key], errors="coerce").to_numpy(dtype=float))
            for key in SPLIT_COLUMNS
        }
        means["uds_clipped_share"] = means["uds_clipped"] / uds if uds > 0 else nan
        pairs = dict(split_ci(examples, n_boot=n_boot))
    for key in SPLIT_COLUMNS:
        low, high = pairs.get(key) or (nan, nan)
        means[f"{key}_ci_low"], means[f"{key}_ci_high"] = low, high
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
        clipped_median_ratio, uds_unclipped, uds_clipped, uds_clipped_share, excess_disruption``, the CI bounds
        `SPLIT_CI_COLUMNS` (``uds_unclipped_ci_low`` ...), ``tau`` and ``dtype`` (+ ``role``): ``clipped_share`` is
        the share of KE cells with ``d2 > d1``, whose LER the clip cut to 1 (over-disruption; from the summary, else
        counted from ``.layers``); ``uds_unclipped + uds_clipped = uds``, the parts of UDS from measured ratios and
        from clipped cells, ``uds_clipped_share`` the second's share of UDS, and ``excess_disruption`` how far past
        retain's disruption the model's goes (``UDSResult.split``, its CIs ``UDSResult.split_ci95``); ``tau`` the
        KE threshold the model was scored with, ``dtype`` the format it ran in (``float32``, ``bfloat16`` ...).
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
                    **_split(result, summary, uds, n_boot),
                    "tau": result_tau(result, float("nan")),
                    "dtype": result_dtype(result),
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
    dtype = dtype_text(frame["dtype"]) if "dtype" in frame.columns else None
    return [n_text, (tau if len(taus) else tau_text(None)) + (f", {dtype}" if dtype else ""), what]


def uds_bar(
    results: Results | pd.DataFrame,
    roles: Mapping[str, str] | None = None,
    sort: bool = False,
    title: str | None = None,
) -> go.Figure:
    """Model UDS as bars with bootstrap 95% CIs, each bar split into where its score comes from.

    The lower, plain part of a bar is ``uds_unclipped`` (KE cells with ``d2 <= d1``: the unlearned model's patch
    disrupts at most as much as retain's, a measured erasure ratio), with its own 95% CI at its top (wide caps);
    the upper, hatched part is ``uds_clipped`` (KE cells with ``d2 > d1``, each read as fully erased although the
    unlearned activation disrupts *more* than retain's: over-disruption), labelled with its share of UDS; UDS's CI
    sits at the top of the bar (narrow caps). The hover gives every part's CI and the excess disruption's. A model
    table without the split draws whole bars.

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
    for key in (*SPLIT_KEYS, *SPLIT_CI_COLUMNS):
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
            frame[list(SPLIT_CI_COLUMNS)].to_numpy(float),
            role.to_numpy(),
        ]
    )
    hover = (
        "%{x} %{customdata[13]}<br>UDS %{customdata[0]:.3f}, 95% CI [%{customdata[1]:.3f}, %{customdata[2]:.3f}]"
        + (
            "<br>measured part (d2 ≤ d1) %{customdata[3]:.3f} [%{customdata[7]:.3f}, %{customdata[8]:.3f}]"
            "<br>clipped part (d2 > d1) %{customdata[4]:.3f} [%{customdata[9]:.3f}, %{customdata[10]:.3f}] "
            "(%{customdata[6]:.0f}% of UDS)<br>excess disruption %{customdata[5]:.2f} "
            "[%{customdata[11]:.2f}, %{customdata[12]:.2f}]"
            if split
            else ""
        )
        + "<extra></extra>"
    )
    fig = go.Figure()
    common = {"x": frame["model"], "customdata": custom, "hovertemplate": hover, "showlegend": False}
    if split:
        measured_ci = {
            "type": "data",
            "symmetric": False,
            "array": (frame["uds_unclipped_ci_high"] - frame["uds_unclipped"]).clip(lower=0).to_numpy(),
            "arrayminus": (frame["uds_unclipped"] - frame["uds_unclipped_ci_low"]).clip(lower=0).to_numpy(),
            "color": "#444444",
            "thickness": 1.5,
            "width": 16,
        }
        fig.add_trace(go.Bar(y=frame["uds"] - frame["uds_clipped"], name="from measured ratios",
                             marker={"color": colours}, error_y=measured_ci, **common))  # fmt: skip
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
            error_y=_ci_bars(frame, color="#222222", width=4),
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
    what = (
        "95% bootstrap CIs over examples: UDS's at the top, the measured part's (wide caps) at the split; hatched: "
        "the part from clipped KE cells (d2 > d1, over-disruption), its share of UDS above each bar"
        if split
        else "95% bootstrap CI over examples; the split is not in this table"
    )
    return set_title(fig, title or "UDS per model, split by where it comes from", _basis(frame, what))


LABEL_SIDES = ("middle right", "middle left", "top right", "bottom left", "bottom right", "top left")
"""The places a point's label takes in turn while the points before it sit too close (`_label_sides`)."""


def _label_sides(x: np.ndarray, y: np.ndarray) -> list[str]:
    """Text positions for point labels: right of each point, and where points sit close enough for their labels to
    overlap (within 0.06 in y and 15% of the x span of one placed before, in the order of ``y``), the next free one
    of `LABEL_SIDES` among those neighbours."""
    sides = ["middle right"] * len(x)
    span_x = max(float(np.nanmax(x) - np.nanmin(x)), 1e-9) if len(x) else 1.0
    placed: list[int] = []
    for position in np.argsort(y, kind="stable"):
        near = [
            other
            for other in placed
            if abs(y[position] - y[other]) < 0.06 and abs(x[position] - x[other]) < 0.15 * span_x
        ]
        taken = {sides[other] for other in near}
        sides[position] = next(
            (side for side in LABEL_SIDES if side not in taken), LABEL_SIDES[len(near) % 6]
        )
        placed.append(position)
    return sides


def _interval(frame: pd.DataFrame, column: str, **style: Any) -> dict[str, Any]:
    """Error bars from ``column``'s values to its CI bounds (``{column}_ci_low``/``_ci_high``), styled with ``style``."""
    low, high = frame[f"{column}_ci_low"], frame[f"{column}_ci_high"]
    return {
        "type": "data",
        "symmetric": False,
        "array": (high - frame[column]).clip(lower=0).to_numpy(),
        "arrayminus": (frame[column] - low).clip(lower=0).to_numpy(),
        **style,
    }


def depth_vs_damage(
    results: Results | pd.DataFrame, roles: Mapping[str, str] | None = None, title: str | None = None
) -> go.Figure:
    """Each model placed by the measured part of its UDS (y) and its excess disruption (x), with a line up to its UDS.

    Total UDS contains the clipped part (KE cells with ``d2 > d1``, each counted as 1), so a model that disrupts the
    forget answer beyond retain's drop climbs in UDS by construction. The measured part (``uds_unclipped``: cells
    with ``d2 <= d1``, at their ratio) does not: it is the y of each filled marker, with its bootstrap 95% CI; a
    thin line in the model's colour runs from it up to the model's UDS (the open marker, with UDS's CI): its length
    is the clipped part. x is the excess disruption, ``sum_KE max(0, d2 - d1) / sum_KE d1`` per example, averaged
    over the scored examples (``uds.excess_disruption``), with its CI. Erasure like retain sits top left (measured
    part near 1, excess near 0); over-disruption to the right, whatever its UDS. That a clipped cell is damage is
    not measured here (only ``d2 > d1`` on the forget answer is): a control such as utility says that. The hover
    gives every value and CI, the clipped part's too.

    Args:
        results: ``{name: result}``, one result, or a model table as from
            [`model_frame`][uds_lens.plotting.models.model_frame] (with ``uds_unclipped``,
            ``excess_disruption`` and their CI bounds).
        roles: optional ``{name: role}`` shown in the hover.
        title: figure title; under it the figure states its basis.
    """
    frame = model_frame(results, roles=roles).reset_index(drop=True)
    needed = ("uds_unclipped", "excess_disruption")
    if any(key not in frame.columns or frame[key].isna().all() for key in needed):
        raise ValueError(
            "depth_vs_damage needs each model's uds_unclipped and excess_disruption (UDSResult.split, model_frame)"
        )
    for key in (*SPLIT_KEYS, *SPLIT_CI_COLUMNS):
        if key not in frame.columns:
            frame[key] = float("nan")
    frame = frame.dropna(subset=["uds", *needed]).reset_index(drop=True)
    x, measured, uds = (frame[key].to_numpy(float) for key in ("excess_disruption", "uds_unclipped", "uds"))
    role = frame["role"].fillna("") if "role" in frame.columns else pd.Series("", index=frame.index)
    colours = [model_colour(str(model)) for model in frame["model"]]
    fig = go.Figure()
    for position, colour in enumerate(colours):  # the clipped part: measured part up to UDS
        fig.add_trace(
            go.Scatter(
                x=[x[position], x[position]],
                y=[measured[position], uds[position]],
                mode="lines",
                line={"color": rgba(colour, 0.55), "width": 3},
                hoverinfo="skip",
                showlegend=False,
            )
        )
    custom = np.column_stack(
        [
            frame[["uds", "ci_low", "ci_high", "uds_clipped", "uds_clipped_share"]].to_numpy(float),
            frame[list(SPLIT_CI_COLUMNS)].to_numpy(float),
            role.to_numpy(),
        ]
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=uds,
            mode="markers",
            name="UDS (measured + clipped part), its 95% CI",
            marker={"size": 9, "symbol": "circle-open", "color": colours, "line": {"width": 2}},
            error_y=_ci_bars(frame, color="#bbbbbb", thickness=1, width=3),
            hoverinfo="skip",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=measured,
            mode="markers+text",
            name="measured part of UDS (d2 ≤ d1), its 95% CI; excess disruption's 95% CI",
            text=frame["model"],
            textposition=_label_sides(x, measured),
            marker={"size": 11, "color": colours, "line": {"width": 1, "color": "#333333"}},
            error_y=_interval(frame, "uds_unclipped", color="#555555", thickness=1.5, width=6),
            error_x=_interval(frame, "excess_disruption", color="#555555", thickness=1.5, width=6),
            customdata=custom,
            hovertemplate="%{text} %{customdata[11]}<br>measured part %{y:.3f} [%{customdata[5]:.3f}, "
            "%{customdata[6]:.3f}]<br>clipped part %{customdata[3]:.3f} [%{customdata[7]:.3f}, %{customdata[8]:.3f}]"
            "<br>UDS %{customdata[0]:.3f} [%{customdata[1]:.3f}, %{customdata[2]:.3f}]<br>excess disruption "
            "%{x:.2f} [%{customdata[9]:.2f}, %{customdata[10]:.2f}]<extra></extra>",
        )
    )
    reach = np.nan_to_num(frame["excess_disruption_ci_high"].to_numpy(float), nan=0.0)
    right = max(float(np.nanmax(np.fmax(x, reach))), 0.5) * 1.15
    fig.add_vline(x=0.0, line=REFERENCE_LINE)
    for x_paper, anchor, text in (
        (0.01, "left", "↖ erased like retain (measured, no excess)"),
        (0.99, "right", "over-disruption: beyond retain's drop ↗"),
    ):
        fig.add_annotation(x=x_paper, y=1.0, xref="paper", yref="paper", xanchor=anchor, yanchor="top",
                           text=text, showarrow=False, font={"size": 11, "color": "#555555"})  # fmt: skip
    fig.update_layout(
        xaxis={
            "title": "excess disruption (extra nats of drop per nat of d1, past retain)",
            "range": [-0.12 * right, right],  # room for a label left of a point at 0
        },
        yaxis={"title": "measured part of UDS (d2 ≤ d1)", "range": [-0.05, 1.12]},
        legend={"orientation": "h", "y": -0.2, "yanchor": "top", "x": 0.0, "xanchor": "left"},
    )
    what = "filled: measured part; open: UDS (the line: its clipped part, d2 > d1); bars: 95% bootstrap CIs"
    return set_title(
        fig,
        title or "Depth vs over-disruption: measured UDS, excess disruption",
        _basis(frame, what),
    )


def rmu_layer_profile(
    results: Results,
    target_layers: Mapping[str, int] | None = None,
    tau: float = DEFAULT_TAU,
    site: str | None = None,
    title: str | None = None,
) -> go.Figure:
    """Mean LER per layer (over KE cells) for several models, each model's target layer marked, and the part of it
    that comes from clipped cells.

    RMU steers the residual at one target layer; its erasure profile should rise there. A clipped KE cell (``d2 >
    d1``) adds exactly 1 to its layer's mean LER however far past retain it goes (the paper's RMU overshoots 57x at
    its target), so a dotted line in each model's colour draws that part: the share of the layer's KE cells that are
    clipped (`tables.clipped_part_by_layer`). The solid line above it is measured erasure only where the two
    separate. With ``target_layers`` unset, a target is read from names like ``rmu_l5`` / ``RMU-L10``.

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
        part = clipped_part_by_layer(long[long["model"] == model], tau).reindex(mean.index)
        fig.add_trace(
            go.Scatter(
                x=part.index,
                y=part,
                mode="lines",
                name=f"{model}: from clipped cells",
                legendgroup=model,
                line={"color": colour, "dash": "dot", "width": 1.5},
                hovertemplate="layer %{x}: %{y:.0%} of KE cells clipped (d2 > d1), each LER 1<extra>"
                + model
                + "</extra>",
            )
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
        [
            f"{examples_text(count_text(counts))} per model",
            f"KE cells: d1 > {taus}",
            "dotted: the part from clipped cells (d2 > d1, each LER 1: over-disruption)",
        ],
    )


def rmu_target_layer(name: str) -> int | None:
    """The RMU target layer encoded in a model name (``rmu_l5``, ``RMU-L10``), or None."""
    match = re.search(r"rmu[_\-]?l(\d+)", name, flags=re.IGNORECASE)
    return int(match.group(1)) if match else None

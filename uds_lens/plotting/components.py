"""Where in a layer the knowledge sits: patching sites per layer, heads / tokens / positions per layer, and the
per-token log-probs of one patched run.

UDS patches a layer's output (``resid_post``); patching ``attn_out``, ``mlp_out`` or ``resid_mid`` instead (the paper's
appendix D.1) shows which sub-layer carries the forget-set knowledge, and ``uds_lens.components`` patches single heads
or entity tokens, giving ``[layer, component]`` grids of deltas or of ``component_uds`` (UDS pooled over the KE cells
of one component).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from numpy.typing import ArrayLike
from plotly.subplots import make_subplots

from uds_lens.config import DEFAULT_TAU
from uds_lens.plotting.style import (
    DELTA_SCALE,
    LER_SCALE,
    REFERENCE_LINE,
    STAGE_DASH,
    add_curve,
    examples_text,
    layer_ticks,
    palette_colour,
    set_title,
    tau_text,
    value_label,
)


def component_patching(
    components: pd.DataFrame,
    stage: str = "d1",
    band: bool | None = None,
    title: str | None = None,
    tau: float = DEFAULT_TAU,
    n_examples: int | str | None = None,
) -> go.Figure:
    """Mean patching delta per layer for each patching site (the paper's appendix D.1 figure).

    Args:
        components: ``site, layer, mean_d1, mean_d2`` (optionally ``std_d1, std_d2`` for ±1 std bands), or a long
            layers table with a ``site`` column (``idx, layer, site, d1, d2``) which is averaged here.
        stage: ``"d1"`` (S1, retain as source: where the knowledge lives), ``"d2"``, or ``"both"`` (d2 dashed).
        band: draw ±1 std bands when standard deviations are available (default: unless ``stage="both"``, where
            eight overlapping bands would hide the curves).
        title: figure title; under it the figure states its basis (the examples averaged, every one of them, and
            the KE threshold, drawn as a dotted line: a site's mean delta above it is a knowledge-carrying one).
        tau: the KE threshold of the layer-level score, in nats.
        n_examples: how many examples the means are over, when ``components`` is already averaged (a long table
            counts its own).
    """
    if "idx" in components.columns and n_examples is None:
        n_examples = int(components["idx"].nunique())
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
        colour = palette_colour(position)
        for which in stages:
            column = f"mean_{which}"
            if column not in part.columns:
                raise ValueError(f"components table has no {column!r} column")
            label = names.get(site, site) + (
                f" · {'S1' if which == 'd1' else 'S2'}" if stage == "both" else ""
            )
            std_column = f"std_{which}"
            half = part[std_column].fillna(0.0) if band and std_column in part.columns else None
            dash = STAGE_DASH[which] if stage == "both" else "solid"
            add_curve(fig, part["layer"], part[column], label, colour, dash, half)
    fig.add_hline(y=0.0, line={"color": "black", "width": 1})
    fig.add_hline(y=tau, line=REFERENCE_LINE, annotation_text=tau_text(tau))
    fig.update_layout(
        xaxis={"title": "layer", **layer_ticks(components["layer"])}, yaxis_title="mean Δ (nats)"
    )
    n_text = examples_text(n_examples) if n_examples is not None else "n: every example of the table"
    return set_title(
        fig,
        title
        or "Mean patching delta per layer by patching site"
        + {"d1": " (S1: retain → full)", "d2": " (S2: unlearned → full)", "both": " (S1 solid, S2 dashed)"}[
            stage
        ],
        [f"{n_text}, every one (KE or not)", f"dotted: KE threshold {tau_text(tau)}"]
        + (["bands ±1 std over examples"] if band and stage != "both" else []),
    )


def component_heatmap(
    grid: ArrayLike,
    layers: Sequence[int],
    axis: str = "head",
    value: str = "component_uds",
    title: str | None = None,
    support: ArrayLike | None = None,
    min_support: int = 0,
    basis: Sequence[str] = (),
) -> go.Figure:
    """Heatmap of a ``[layer, component]`` grid (heads, entity tokens, patched positions), y = layer.

    Args:
        grid: ``[layer, component]`` values (NaN cells left blank on a light grey plot area, so "no value" never
            looks like a colour of the scale).
        layers: the layer of each row.
        axis: what the columns are (``head``, ``token``, ``position``), for the axis title.
        value: ``d1``/``d2`` (RdBu, midpoint 0) or ``component_uds``/``ler`` (sequential 0-1).
        title: figure title.
        support: ``[layer, component]`` number of KE cells behind each value: in the hover, and written on the
            cells when ``min_support`` is set.
        min_support: cells resting on fewer KE cells are not drawn as a value: blank, labelled ``n=k`` (too few).
        basis: what the grid rests on (examples, thresholds), stated under the title.
    """
    z = np.asarray(grid, dtype=float)
    counts = None if support is None else np.asarray(support, dtype=int)
    if counts is not None and min_support > 0:
        z = np.where(counts >= min_support, z, np.nan)
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
        labels={"x": axis, "y": "layer", "color": value_label(value)},
        **colour,
    )
    if counts is not None:
        label = value_label(value).replace("<br>", " ")
        fig.update_traces(
            customdata=counts,
            hovertemplate=f"layer %{{y}}, {axis} %{{x}}<br>{label} = %{{z:.3f}}<br>KE cells: %{{customdata}}"
            "<extra></extra>",
        )
        if min_support > 0:
            text = [
                [
                    f"{v:.2f}<br>n={n}" if n >= min_support else (f"n={n}<br>too few" if n > 0 else "")
                    for v, n in zip(values, row, strict=True)
                ]
                for values, row in zip(z, counts, strict=True)
            ]
            fig.update_traces(text=text, texttemplate="%{text}", textfont={"size": 10})
    fig.update_xaxes(type="category")
    fig.update_yaxes(**layer_ticks(layers))
    fig.update_layout(plot_bgcolor="#e5e5e5")
    return set_title(fig, title or f"{value} per layer and {axis}", basis)


def token_logprobs(tokens: pd.DataFrame, title: str | None = None, basis: Sequence[str] = ()) -> go.Figure:
    """Per-position log-prob of the next token for the clean full run and a patched run, entity tokens highlighted.

    Args:
        tokens: ``position, token, logprob_full, logprob_patched, is_entity``: one row per read position, ``token`` the
            token predicted there (its log-prob is what the columns hold), ``is_entity`` whether it is an entity token
            (those are the positions UDS averages over).
        title: figure title (say which model and layer the patched run used).
        basis: what the figure rests on, stated under the title (the example, the layer and its KE status).

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
        go.Bar(x=labels, y=tokens["logprob_full"], name="full (clean)", marker={"color": palette_colour(0)}),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Bar(x=labels, y=tokens["logprob_patched"], name="patched", marker={"color": palette_colour(1)}),
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
            colorbar={"title": {"text": "Δ [nats]"}, "len": 0.25, "y": 0.1},
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
    fig.update_yaxes(title_text="log p(token) [nats]", row=1, col=1)
    fig.update_layout(barmode="group", height=540)
    return set_title(fig, title or "Per-token log-prob: full vs patched", basis)


def _visible(token: object) -> str:
    """Show leading spaces and newlines in token labels."""
    return str(token).replace("\n", "\\n").replace(" ", "␣")

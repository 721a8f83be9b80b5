"""Per-layer curves: the mean S1/S2 deltas of one or several models, one example's deltas, UDS against tau, and the
observational (logit lens, other white-box methods) readings next to the causal one (UDS).

For example ``i`` and layer ``l``, ``d1[l] = baseline[l] - s1[l]`` is the drop in the full model's mean entity
log-prob (``baseline``: its unpatched score as the engine recomputes it per layer, S0 up to float noise) when the
retain model's activation is patched in at layer ``l`` (Stage 1: how much forget-set knowledge layer ``l`` carries)
and ``d2[l] = baseline[l] - s2[l]`` the same drop with the unlearned model as the source (Stage 2: how much of it is
gone). KE layers are ``d1 > tau``, ``LER = clip(d2 / d1, 0, 1)`` there, and ``UDS_i = sum_KE d1 * LER / sum_KE d1``
([`uds_lens.uds`][uds_lens.uds] defines and computes them; the curves only draw them). S1 is drawn solid and S2 dashed
everywhere, and S1 once in grey when every model shares it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from uds_lens.config import DEFAULT_TAU
from uds_lens.layer_table import one_site
from uds_lens.plotting.style import (
    CLIPPED_MARK,
    KE_BAND,
    REFERENCE_LINE,
    S1_COLOUR,
    STAGE_DASH,
    add_curve,
    examples_text,
    layer_band,
    layer_ticks,
    model_colour,
    palette_colour,
    set_title,
    tau_text,
    wrap_words,
)
from uds_lens.plotting.tables import (
    Result,
    Results,
    clipped_part_by_layer,
    count_text,
    ke_cells,
    long_by_model,
    mean_ler_on_ke,
    named_results,
    result_tables,
    result_tau,
    tau_of,
)
from uds_lens.uds import example_uds, excess_disruption, ke_mask, uds_parts


def stage_curves(
    results: Results,
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
        band: ``"std"`` (±1 standard deviation over examples), ``"sem"``, ``"ci95"`` or None. S1's band is
            plain, S2's hatched, so both stay readable where they overlap.
        site: patching site when the tables hold several.
        only_scored: drop examples without a KE layer (UDS undefined) when an examples table is available.
        title: figure title; under it the figure states its basis (the examples each curve averages, tau, what
            the bands are), and tau is drawn as a dotted line on the delta axis.
    """
    if quantity not in ("delta", "score"):
        raise ValueError(f"quantity must be 'delta' or 'score', got {quantity!r}")
    s1_column, s2_column = ("d1", "d2") if quantity == "delta" else ("s1_score", "s2_score")
    named = named_results(results)
    frames = {}
    for name, result in named.items():
        layers, examples = result_tables(result)
        layers = one_site(layers, site)
        if only_scored and examples is not None and "status" in examples.columns:
            layers = layers[layers["idx"].isin(examples.loc[examples["status"] == "scored", "idx"])]
        frames[name] = layers
    only = getattr(next(iter(named.values())), "name", None) if len(named) == 1 else None
    named_one = f"{only}: " if isinstance(only, str) and only else ""
    fig = go.Figure()
    n_examples = count_text([frame["idx"].nunique() for frame in frames.values()])
    tau = tau_of(named, DEFAULT_TAU)
    s1_means = [frame.groupby("layer")[s1_column].mean() for frame in frames.values()]
    shared_s1 = all(
        len(m) == len(s1_means[0]) and np.allclose(m.to_numpy(), s1_means[0].to_numpy(), equal_nan=True)
        for m in s1_means
    )
    for position, (name, frame) in enumerate(frames.items()):
        colour = model_colour(name)
        if position == 0 or not shared_s1:
            s1_name = "S1 (retain → full)" if shared_s1 else f"S1 · {name}"
            s1_colour = S1_COLOUR if shared_s1 else colour
            mean, half = layer_band(frame, s1_column, band)
            add_curve(fig, mean.index, mean, s1_name, s1_colour, STAGE_DASH["d1"], half if band else None)
        mean, half = layer_band(frame, s2_column, band)
        s2_name = f"S2 · {name}" if len(frames) > 1 else f"S2 ({named_one[:-2] or 'unlearned'} → full)"
        add_curve(fig, mean.index, mean, s2_name, colour, STAGE_DASH["d2"], half if band else None)
    first = next(iter(frames.values()))
    if quantity == "score" and "s0" in first.columns:
        fig.add_hline(
            y=float(first.groupby("idx")["s0"].first().mean()),
            line={"color": "black", "dash": "dot"},
            annotation_text="clean full",
        )
    elif quantity == "delta":
        fig.add_hline(y=0.0, line={"color": "black", "width": 1})
        taus = {result_tau(result, DEFAULT_TAU) for result in named.values()}
        if len(taus) == 1:
            fig.add_hline(y=taus.pop(), line=REFERENCE_LINE, annotation_text=f"{tau} (KE: d1 above)")
    band_text = {
        "std": "bands ±1 std over examples (S2's hatched)",
        "sem": "bands ±1 s.e.m. (S2's hatched)",
        "ci95": "bands 95% CI of the mean (S2's hatched)",
    }.get(band or "", "")
    which = (
        f"scored examples (a KE layer: d1 > {tau})" if only_scored else f"every example (KE at {tau} or not)"
    )
    fig.update_layout(
        xaxis={"title": "layer", **layer_ticks(first["layer"])},
        yaxis_title="mean Δ (nats)" if quantity == "delta" else "mean entity log-prob (nats)",
        hovermode="x unified",
    )
    set_title(
        fig,
        title or f"{named_one}Mean {'patching delta' if quantity == 'delta' else 'patched score'} per layer",
        [f"{examples_text(n_examples)}{' per model' if len(frames) > 1 else ''}: {which}", band_text],
    )
    return fig


def example_curves(
    result: Result, idx: int, site: str | None = None, tau: float | None = None, title: str | None = None
) -> go.Figure:
    """One example's layer curves: ``d1`` (S1, solid) and ``d2`` (S2, dashed), KE layers shaded, UDS in the title.

    Args:
        result: a ``UDSResult`` (or anything with ``.layers``/``.examples``), or the long layers table.
        idx: the example's dataset ``idx``.
        site: patching site when the table holds several.
        tau: KE threshold for the dotted line and, without a ``ke`` column, the band (default the result's).
        title: figure title (default: the model, idx, UDS and the part of it from clipped cells with the excess
            disruption); under it, wrapped to fit a notebook or docs column, the basis (one example, tau) and the
            example's entity and question.
    """
    layers, examples = result_tables(result)
    layers = one_site(layers, site)
    rows = layers[layers["idx"] == idx].sort_values("layer")
    if rows.empty:
        raise ValueError(
            f"example {idx} is not in the layers table (it may have been skipped); "
            f"examples there: {sorted(pd.unique(layers['idx']))[:20]}"
        )
    if tau is None:
        tau = (
            float(getattr(result, "settings", {}).get("tau", DEFAULT_TAU))
            if not isinstance(result, pd.DataFrame)
            else DEFAULT_TAU
        )
    ke = ke_cells(rows, tau).to_numpy()
    info = (
        examples.set_index("idx").loc[idx] if examples is not None and idx in set(examples["idx"]) else None
    )
    uds = info.get("uds") if info is not None else _example_uds(rows, tau)
    d1_row = rows["d1"].to_numpy(dtype=float)[None, :]
    d2_row = rows["d2"].to_numpy(dtype=float)[None, :]
    uds_clipped = float(uds_parts(d1_row, d2_row, tau)[1][0])
    excess = float(excess_disruption(d1_row, d2_row, tau)[0])
    fig = go.Figure()
    for layer in rows["layer"].to_numpy()[ke]:
        fig.add_vrect(x0=layer - 0.5, x1=layer + 0.5, fillcolor=KE_BAND, line_width=0, layer="below")
    model = getattr(result, "name", None) or None
    colour = model_colour(model) if model else palette_colour(0)
    for stage, name in (
        ("d1", "d1 · S1 (retain → full)"),
        ("d2", f"d2 · S2 ({model or 'unlearned'} → full)"),
    ):
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
    clipped = ke & (rows["d2"].to_numpy(dtype=float) > rows["d1"].to_numpy(dtype=float))
    if clipped.any():
        fig.add_trace(
            go.Scatter(
                x=rows["layer"].to_numpy()[clipped],
                y=rows["d2"].to_numpy(dtype=float)[clipped],
                mode="markers",
                name="clipped: d2 > d1 (LER cut to 1)",
                marker={**CLIPPED_MARK, "size": 12},
            )
        )
    fig.add_hline(y=tau, line=REFERENCE_LINE, annotation_text=tau_text(tau))
    fig.add_hline(y=0.0, line={"color": "black", "width": 1})
    uds_text = "undefined (no KE layer)" if uds is None or pd.isna(uds) else f"{float(uds):.3f}"
    if clipped.any():
        uds_text += (
            f"<br>{uds_clipped:.3f} of it from {int(clipped.sum())} of {int(ke.sum())} KE layers clipped (the "
            f"unlearned patch hurts more than retain's), excess disruption {excess:.2f}"
        )
    basis = [examples_text(1), f"KE layers shaded: d1 > {tau_text(tau)}"]
    if info is not None and isinstance(info.get("entity"), str):
        basis += [f"entity: {info['entity']}", f"Q: {_shortened(str(info.get('question', '')), 100)}"]
    fig.update_layout(
        xaxis={"title": "layer", **layer_ticks(rows["layer"])},
        yaxis_title="Δ (nats)",
        hovermode="x unified",
    )
    return set_title(fig, title or f"{model + ': ' if model else ''}example {idx}: UDS = {uds_text}", basis)


def _shortened(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    return wrap_words(text, limit - 1)[0] + "…"


def _example_uds(rows: pd.DataFrame, tau: float) -> float:
    """``UDS_i`` of one example's layer rows (a layers table or a lens table in the same shape)."""
    d1 = rows["d1"].to_numpy(dtype=float)[None, :]
    d2 = rows["d2"].to_numpy(dtype=float)[None, :]
    return float(example_uds(d1, d2, tau)[0])


def tau_curves(
    table: pd.DataFrame,
    default_tau: float = DEFAULT_TAU,
    title: str | None = None,
    n_examples: int | str | None = None,
) -> go.Figure:
    """Model UDS as a function of the KE threshold tau, one line per model (appendix D.3).

    Args:
        table: ``analysis.tau_sensitivity`` output / ``tau_sensitivity.csv`` (``model, tau, uds`` [, ``n_no_ke``]).
        default_tau: marked with a dashed vertical line.
        title: figure title.
        n_examples: the examples each model was scored on, for the figure's basis (the table does not hold it).
    """
    missing = {"tau", "uds"} - set(table.columns)
    if missing:
        raise ValueError(f"tau table lacks columns {sorted(missing)}")
    table = table if "model" in table.columns else table.assign(model="model")
    fig = go.Figure()
    for model in dict.fromkeys(table["model"]):
        part = table[table["model"] == model].sort_values("tau")
        extra = part["n_no_ke"] if "n_no_ke" in part.columns else None
        fig.add_trace(
            go.Scatter(
                x=part["tau"],
                y=part["uds"],
                mode="lines+markers",
                name=str(model),
                line={"color": model_colour(str(model))},
                customdata=extra,
                hovertemplate=f"{model}<br>τ = %{{x}}<br>UDS %{{y:.3f}}"
                + ("<br>no-KE examples %{customdata}" if extra is not None else "")
                + "<extra></extra>",
            )
        )
    fig.add_vline(x=default_tau, line=REFERENCE_LINE, annotation_text=f"default {tau_text(default_tau)}")
    fig.update_layout(xaxis_title="tau (nats)", yaxis={"title": "UDS", "range": [0, 1.05]})
    n_text = examples_text(n_examples) if n_examples is not None else "n: the scored examples at each tau"
    return set_title(
        fig,
        title or "UDS under each KE threshold tau",
        [n_text, f"tau from {table['tau'].min():g} to {table['tau'].max():g} nats (x axis)"],
    )


def lens_vs_uds_example(
    uds_layers: Result,
    lens_layers: pd.DataFrame,
    idx: int,
    tau: float = DEFAULT_TAU,
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
        tau: KE threshold for both (0.05 for UDS and for the logit lens).
        site: patching site of the UDS table when it holds several.
        title: figure title.
    """
    uds_table, _ = result_tables(uds_layers)
    uds_table = one_site(uds_table, site)
    tables = {"UDS (patching)": uds_table, "logit lens": lens_layers}
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("Δ per layer (solid: S1 retain, dashed: S2 unlearned)", "LER on KE layers"),
    )
    colours = {"UDS (patching)": palette_colour(0), "logit lens": palette_colour(1)}
    for name, table in tables.items():
        rows = table[table["idx"] == idx].sort_values("layer")
        if rows.empty:
            raise ValueError(f"example {idx} is not in the {name} layers table")
        score = _example_uds(rows, tau)
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
        d1, d2 = rows["d1"].to_numpy(dtype=float), rows["d2"].to_numpy(dtype=float)
        ke = ke_mask(d1, tau)
        ler = rows["ler"].where(ke)
        clipped = ke & (d2 > d1)
        fig.add_trace(
            go.Bar(x=rows["layer"], y=ler, name=label, legendgroup=name,
                   marker={"color": colour, "pattern": {"shape": ["/" if c else "" for c in clipped],
                                                        "fgcolor": "#ffffff", "solidity": 0.4}},
                   customdata=np.where(clipped, "clipped: d2 > d1, LER cut to 1", "measured: d2 ≤ d1"),
                   hovertemplate="layer %{x}: LER %{y:.3f}, %{customdata}<extra>" + name + "</extra>"),
            row=2, col=1,
        )  # fmt: skip
    fig.add_hline(y=tau, line=REFERENCE_LINE, annotation_text=tau_text(tau), row=1, col=1)
    fig.update_yaxes(title_text="Δ (nats)", row=1, col=1)
    fig.update_yaxes(title_text="LER", range=[0, 1.05], row=2, col=1)
    fig.update_xaxes(**layer_ticks(uds_table["layer"]))
    fig.update_xaxes(title_text="layer", row=2, col=1)
    fig.update_layout(barmode="group", height=620)
    return set_title(
        fig,
        title or f"Observational vs causal, example {idx}",
        [
            examples_text(1),
            f"KE for both readouts: d1 > {tau_text(tau)}",
            "hatched LER bars: clipped (d2 > d1, cut to 1: over-disruption)",
        ],
    )


def lens_vs_uds_models(
    uds_layers: Results,
    lens_layers: pd.DataFrame | Mapping[str, pd.DataFrame],
    tau: float = DEFAULT_TAU,
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
    uds_long = one_site(long_by_model(uds_layers), site)
    lens_long = long_by_model(lens_layers)
    models = [m for m in dict.fromkeys(uds_long["model"]) if m in set(lens_long["model"])]
    if not models:
        raise ValueError("no model is in both the UDS and the logit-lens tables")
    columns = min(max_columns, len(models))
    rows = -(-len(models) // columns)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=models, shared_yaxes=True)
    for position, model in enumerate(models):
        cell = {"row": position // columns + 1, "col": position % columns + 1}
        for name, long, colour in (
            ("UDS", uds_long, palette_colour(0)),
            ("logit lens", lens_long, palette_colour(1)),
        ):
            mean = mean_ler_on_ke(long[long["model"] == model], tau)
            fig.add_trace(
                go.Scatter(x=mean.index, y=mean, mode="lines+markers", name=name, legendgroup=name,
                           showlegend=position == 0, line={"color": colour}),
                **cell,
            )  # fmt: skip
            if name != "UDS":
                continue
            part = clipped_part_by_layer(long[long["model"] == model], tau).reindex(mean.index)
            fig.add_trace(
                go.Scatter(x=part.index, y=part, mode="lines", name=f"{name}: from clipped cells",
                           legendgroup=f"{name} clipped", showlegend=position == 0,
                           line={"color": colour, "dash": "dot", "width": 1.5}),
                **cell,
            )  # fmt: skip
    fig.update_yaxes(range=[0, 1.05])
    fig.update_yaxes(title_text="mean LER (KE cells)", col=1)
    fig.update_xaxes(title_text="layer", **layer_ticks(uds_long["layer"]))
    fig.update_layout(height=320 * rows + 60)
    n_examples = count_text([uds_long.loc[uds_long["model"] == model, "idx"].nunique() for model in models])
    return set_title(
        fig,
        title or "Logit lens vs UDS: mean layer erasure ratio per model",
        [
            f"{examples_text(n_examples)} per model",
            f"KE cells: d1 > {tau_text(tau)}",
            "dotted: the part of UDS's mean LER from clipped cells (d2 > d1, each LER 1)",
        ],
    )


def layerwise_methods(
    layerwise: Results,
    methods: Sequence[str] | None = None,
    max_columns: int = 3,
    title: str | None = None,
    n_examples: int | str | None = None,
    tau: float = DEFAULT_TAU,
    results: Results | None = None,
) -> go.Figure:
    """Per-layer erasure of several white-box methods, one panel per model (``diagnose``'s ``layerwise.csv``).

    Each method's score is the weighted mean of its per-layer erasure ``e_l`` (1 = retain-like) with weights ``w_l``;
    marker size shows the weight, so the layers that drive the score stand out. With ``methods=("uds",
    "logit_lens")`` this is the observational-vs-causal comparison per model. UDS's pooled erasure of a layer counts
    each clipped KE cell (``d2 > d1``) as 1: with ``results`` (the models' UDS results), a dotted line under the
    ``uds`` curve draws that part (`tables.clipped_part_by_layer`, d1-weighted as the pooling is); without them the
    basis line says the clipped cells are not marked.

    Args:
        layerwise: ``{model: table}`` or a long table with a ``model`` column; tables have ``method, layer, erasure``
            (optionally ``weight``).
        methods: methods to draw (default: all, in table order).
        max_columns: panels per row.
        title: figure title.
        n_examples: the examples the tables pool (``layerwise.csv`` does not hold it), for the figure's basis.
        tau: the KE threshold of UDS's rows (the lenses use the published 0.05 nats; CKA, RSA, SVCCA and PWCCA
            have none, Fisher its mask), for the basis.
        results: ``{model: UDS result}`` whose layers tables mark the clipped part of the ``uds`` curves.
    """
    long = long_by_model(layerwise, attribute="layerwise")
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
    uds_results = named_results(results) if results is not None else {}
    marked = False
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
                    line={"color": palette_colour(number), "width": 3 if method == "uds" else 1.5},
                    marker={"size": size},
                    customdata=weight,
                    hovertemplate=f"{method}<br>layer %{{x}}<br>erasure %{{y:.3f}}"
                    + ("<br>weight %{customdata:.3f}" if weight is not None else "")
                    + "<extra></extra>",
                ),
                **cell,
            )
            layers = getattr(uds_results.get(model), "layers", None)
            if method == "uds" and isinstance(layers, pd.DataFrame) and not layers.empty:
                from_clipped = clipped_part_by_layer(one_site(layers, None), tau, weighted=True)
                fig.add_trace(
                    go.Scatter(
                        x=from_clipped.index,
                        y=from_clipped,
                        mode="lines",
                        name="uds: from clipped cells",
                        legendgroup="uds clipped",
                        showlegend=not marked,
                        line={"color": palette_colour(number), "dash": "dot", "width": 1.5},
                        hovertemplate="layer %{x}: %{y:.3f} of UDS's erasure from clipped cells<extra></extra>",
                    ),
                    **cell,
                )
                marked = True
    fig.update_yaxes(range=[-0.05, 1.05])
    fig.update_yaxes(title_text="erasure e<sub>l</sub>", col=1)
    fig.update_xaxes(title_text="layer", **layer_ticks(long["layer"]))
    fig.update_layout(height=320 * rows + 80)
    n_text = (
        examples_text(n_examples) if n_examples is not None else "n: every example of each model's tables"
    )
    return set_title(
        fig,
        title or "Per-layer erasure by method (1 = retain-like; marker size = layer weight)",
        [
            n_text,
            f"UDS: KE at d1 > {tau_text(tau)}; logit lens at 0.05 nats; CKA, RSA, SVCCA, PWCCA: no threshold",
            (
                "dotted: the part of UDS's erasure from clipped cells (d2 > d1, each counted as 1)"
                if marked
                else "UDS's clipped cells (d2 > d1) not marked: pass results="
            )
            if "uds" in methods
            else "",
        ],
    )

"""The report page of retain-free results: d2 alone, never read as the depth score.

Without a retain model there is no Stage 1: no d1 to divide by, no knowledge-encoding layer, no erasure ratio. What a
retain-free result holds is ``d2`` per example and layer, how far the full model's log-prob of the scored span drops
when the unlearned model's residual is patched in (nats). Unnormalised, it is not comparable with the score a retain
model gives, nor across forget sets, and this page never names it so: a table of each model's mean d2 and the share of
cells above tau, d2 per layer, and one d2 heatmap per model. Where the spans are multiple-choice letters or passage
sentences, the page says so (``display.span_notes``). [`write_report`][uds_lens.plotting.report.write_report] writes
this page when every result it finds is retain-free.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from uds_lens.display import number, span_notes
from uds_lens.plotting.style import DELTA_SCALE, model_colour
from uds_lens.plotting.tables import SavedResult

TITLE = "Retain-free report: {name}"
"""The page's title, of the results directory's name."""


@runtime_checkable
class ReportPage(Protocol):
    """What the sections write to: the report's page (headings, paragraphs, tables, figures)."""

    def heading(self, text: str, level: int = 2) -> None: ...

    def text(self, text: str) -> None: ...

    def table(self, frame: pd.DataFrame, caption: str | None = None, max_rows: int = 200) -> None: ...

    def figure(self, fig: go.Figure, caption: str | None = None) -> None: ...


def all_retain_free(results: Mapping[str, SavedResult]) -> bool:
    """Whether every result is a retain-free one (then the page is this module's)."""
    return bool(results) and all(r.result is not None and r.result.retain_free for r in results.values())


def models_table(results: Mapping[str, SavedResult], roles: Mapping[str, str]) -> pd.DataFrame:
    """One row per model: role, mean d2 (nats), the share of example x layer cells with d2 > tau, and the counts."""
    rows = []
    for name, saved in results.items():
        summary = saved.summary
        d2 = summary.get("d2_summary") or {}
        rows.append(
            {
                "model": name,
                "role": roles.get(name, ""),
                "mean d2 (nats)": number(d2.get("mean_d2")),
                "cells with d2 > tau": number(d2.get("frac_layers_d2_gt_tau"), 2),
                "examples scored": summary.get("n_scored"),
                "skipped": summary.get("n_skipped"),
            }
        )
    return pd.DataFrame(rows)


def d2_by_layer(results: Mapping[str, SavedResult]) -> go.Figure:
    """Mean d2 over the scored examples at each layer, one line per model."""
    frames = []
    for name, saved in results.items():
        layers = saved.layers
        if layers is not None and not layers.empty:
            frames.append(layers.groupby("layer", as_index=False)["d2"].mean().assign(model=name))
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["layer", "d2", "model"])
    fig = px.line(
        table,
        x="layer",
        y="d2",
        color="model",
        markers=True,
        color_discrete_map={name: model_colour(name) for name in results},
        labels={"d2": "mean d2 (nats)"},
        title="d2 per layer: the full model's drop when the unlearned model's residual is patched in",
    )
    fig.add_hline(y=0, line={"color": "grey", "dash": "dot", "width": 1})
    return fig


def d2_heatmap(name: str, saved: SavedResult) -> go.Figure:
    """d2 per layer (y) and example (x), white at 0 (RdBu, blue: the patch lowered the span's log-prob)."""
    layers = saved.layers if saved.layers is not None else pd.DataFrame(columns=["idx", "layer", "d2"])
    grid = layers.pivot(index="layer", columns="idx", values="d2")
    limit = float(grid.abs().max().max()) if grid.size else 1.0
    return px.imshow(
        grid,
        color_continuous_scale=DELTA_SCALE,
        zmin=-limit,
        zmax=limit,
        origin="lower",
        aspect="auto",
        labels={"x": "example (idx)", "y": "layer", "color": "d2 (nats)"},
        title=f"{name}: d2 per layer and example",
    )


def write_sections(
    page: ReportPage,
    root: Path,
    results: Mapping[str, SavedResult],
    roles: Mapping[str, str],
    incomplete: Mapping[str, str],
) -> None:
    """The page's sections, after its title: what d2 is here, the spans, the models, d2 per layer and per model."""
    first = next(iter(results.values()))
    settings = first.summary.get("settings") or {}
    tau = settings.get("tau")
    forms = sorted({form for saved in results.values() for form in saved.summary.get("forms", [])})
    page.text(
        f"{len(results)} model{'' if len(results) == 1 else 's'} from <code>{html.escape(str(root))}</code>, "
        f"scored in <b>retain-free mode</b> (site {html.escape(str(settings.get('site')))}, tau = "
        f"{html.escape(str(tau))} nats)."
    )
    page.text(
        "No retain model was given, so there is no Stage 1: no d1 to divide by and no knowledge-encoding layer. "
        "Each number below is <b>d2</b>, how many nats the full model's log-prob of the scored span drops when the "
        "unlearned model's residual is patched in at one layer (0: the unlearned model's activation carries what "
        "the full model's does; positive: it no longer does; negative: it makes the span more likely). It is "
        "unnormalised: not comparable with the depth score a retain model gives, nor across forget sets, and a large "
        "d2 can mean erased or merely damaged."
    )
    for note in span_notes(forms):
        page.text(html.escape(note[0].upper() + note[1:]) + ".")
    if incomplete:
        page.heading("Incomplete results (not shown)")
        page.text(
            "Left out because their files are incomplete or come from different runs: "
            + ", ".join(
                f"<code>{html.escape(name)}</code> ({html.escape(why)})" for name, why in incomplete.items()
            )
        )
    page.heading("Models")
    page.table(
        models_table(results, roles),
        caption=f"Mean d2 over every example and layer; cells with d2 > tau: the share of example x layer cells "
        f"whose drop exceeds tau = {tau} nats.",
    )
    page.figure(d2_by_layer(results), caption="Mean d2 per layer over the scored examples.")
    page.heading("Per model")
    for name, saved in results.items():
        page.heading(
            f"{name} · mean d2 {number((saved.summary.get('d2_summary') or {}).get('mean_d2'))}", level=3
        )
        page.figure(d2_heatmap(name, saved))


__all__ = [
    "TITLE",
    "ReportPage",
    "all_retain_free",
    "d2_by_layer",
    "d2_heatmap",
    "models_table",
    "write_sections",
]

"""One visual language for every figure: colours, dashes, scales, reference lines, layer ticks and bands.

**Colour** says which thing is compared (a model, a patching site, a readout). A model keeps one colour in every
figure and the report (`model_colour`: the reference models ``full`` and ``retain`` have fixed ones, every
other model gets the next `PALETTE` colour the first time it is drawn in a process, and keeps it, whatever
the order or the company it is drawn in; `set_model_colours` pins colours of your own). S1, shared by all
models audited against one full/retain pair, is grey (`S1_COLOUR`). **Dash** says which stage (`STAGE_DASH`: S1 / ``d1`` solid, S2 / ``d2`` dashed).
Thresholds and references (``tau``) are dotted grey lines, the KE layers of one example a shaded band. Heatmaps
follow the TransformerLens/ARENA convention: `DELTA_SCALE` (RdBu, white at 0) for deltas, where a positive
delta (the patch removed knowledge) is blue, and the sequential `LER_SCALE` on 0-1 for LER and UDS.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

PALETTE = px.colors.qualitative.Plotly
S1_COLOUR = "#444444"
DELTA_SCALE = "RdBu"
STAGE_DASH = {"d1": "solid", "d2": "dash"}
REFERENCE_LINE = {"color": "grey", "dash": "dot", "width": 1}
BAND_HATCH = {"shape": "/", "solidity": 0.25, "size": 7}
"""The fill of a dashed (S2) curve's band: hatched in its colour, so where it overlaps the solid curve's plain band
both stay readable (two translucent fills of one hue blend into one colour)."""
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
VALUE_UNITS = {
    "d1": "nats",
    "d2": "nats",
    "ler": "ratio, 0–1",
    "uds": "0–1",
    "component_uds": "0–1",
    "s1_score": "nats",
    "s2_score": "nats",
    "s0": "nats",
    "baseline_score": "nats",
}
"""The unit of each value a colour bar or an axis shows (log-probs and their drops in nats, ratios on 0-1)."""
TITLE_WIDTH = 60
"""Characters per title line: a title wrapped at this width fits a notebook column and the docs column (about
700 px at plotly's 17 px title font); the smaller basis lines under it wrap at half again as many."""


def value_label(value: str) -> str:
    """A value's label with its unit, for colour bars and axes: ``"Δ<sup>S1</sup> (retain → full), nats"``."""
    label = VALUE_LABELS.get(value, value.replace("_", " "))
    unit = VALUE_UNITS.get(value)
    return f"{label}<br>[{unit}]" if unit else label


def tau_text(tau: float | None) -> str:
    """``"tau = 0.05 nats"``: a KE threshold with its value and unit, as every figure's basis names it."""
    return "tau: –" if tau is None else f"tau = {tau:g} nats"


def examples_text(n_examples: int | str) -> str:
    """``"n = 24 examples"`` (``"n = 1 example"``); a string (``"24-29"``, per-model counts) is shown as given."""
    return f"n = {n_examples} example{'' if n_examples == 1 else 's'}"


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken between words only (never inside one: a title cut
    mid-word by the plot's edge is what this avoids); a word longer than ``width`` gets a line of its own."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def set_title(fig: go.Figure, title: str, basis: Iterable[str] = (), width: int = TITLE_WIDTH) -> go.Figure:
    """Give ``fig`` its title and, under it in smaller type, what it rests on (``basis``: "n = 24 examples",
    "tau = 0.05 nats", the order of the examples ...), each wrapped between words to fit a notebook or docs column.

    The top margin grows with the number of lines so the title never runs into the plot. A caller's own title
    still gets the basis: a figure always says what it rests on.
    """
    lines = [line for part in title.split("<br>") for line in wrap_words(part, width)]
    small: list[str] = []
    for part in (part for part in basis if part):  # a fact starts a new line rather than break across two
        if small and len(small[-1]) + 3 + len(part) <= int(width * 1.5):
            small[-1] += " · " + part
        else:
            small += wrap_words(part, int(width * 1.5))
    text = "<br>".join(lines + [f"<sup>{line}</sup>" for line in small])
    fig.update_layout(
        title={"text": text, "x": 0.01, "xanchor": "left"},
        # plotly spaces every line of a title by the title font's line height (about 22 px at 17 px), the
        # superscript basis lines too: fewer pixels a line let the last ones run into the plot
        margin={"t": 40 + 24 * len(lines) + 22 * len(small)},
    )
    return fig


REFERENCE_COLOURS = {"full": "#1a1a1a", "retain": "#9a9a9a"}
"""The two ends of the UDS scale, in black and grey (no palette colour is either)."""
CLIPPED_MARK = {
    "symbol": "x-thin-open",
    "size": 7,
    "color": "#d62728",
    "line": {"width": 2, "color": "#d62728"},
}
"""The marker of a clipped KE cell (``d2 > d1``, LER cut to 1) in heatmaps and per-example curves."""
_MODEL_COLOURS: dict[str, str] = {}


def palette_colour(position: int) -> str:
    """The palette colour of the ``position``-th compared thing (wrapping around): sites, readouts, methods; models
    take `model_colour`."""
    return PALETTE[position % len(PALETTE)]


def model_colour(name: str) -> str:
    """One model's colour, the same in every figure of this process and in the report written from it.

    ``full`` and ``retain`` (and ``zoo:full`` ...) have `REFERENCE_COLOURS`; any other name gets the next
    palette colour on first use (wrapping after ten models) unless `set_model_colours` pinned one.
    """
    key = str(name).removeprefix("zoo:")
    if key in REFERENCE_COLOURS:
        return REFERENCE_COLOURS[key]
    if key not in _MODEL_COLOURS:
        _MODEL_COLOURS[key] = PALETTE[len(_MODEL_COLOURS) % len(PALETTE)]
    return _MODEL_COLOURS[key]


def set_model_colours(colours: dict[str, str] | None = None, order: Iterable[str] = ()) -> dict[str, str]:
    """Pin model colours: ``colours`` as given, then the names of ``order`` palette colours in that order (so a
    notebook and a report drawn in another process agree). Returns the mapping now in force."""
    for name, colour in (colours or {}).items():
        _MODEL_COLOURS[str(name).removeprefix("zoo:")] = colour
    for name in order:
        model_colour(name)
    return dict(_MODEL_COLOURS)


def rgba(hex_colour: str, alpha: float) -> str:
    """``#rrggbb`` as a translucent ``rgba(...)`` (band fills)."""
    red, green, blue = (int(hex_colour.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({red},{green},{blue},{alpha})"


def layer_ticks(layers: Iterable[Any]) -> dict[str, Any]:
    """Integer layer ticks (plotly would otherwise label 0.5, 1.5 ... on a few-layer model)."""
    values = pd.unique(pd.Series(list(layers)).dropna())
    span = int(values.max() - values.min()) + 1 if len(values) else 1
    return {"tickmode": "linear", "tick0": 0, "dtick": max(1, -(-span // 16))}


def layer_band(frame: pd.DataFrame, column: str, kind: str | None) -> tuple[pd.Series, pd.Series]:
    """Per-layer mean of ``column`` and the half-width of the band around it.

    ``kind`` is ``"std"`` (±1 standard deviation over examples), ``"sem"`` (standard error of the mean), ``"ci95"``
    (1.96 s.e.m.) or None (no band: half-width 0).
    """
    grouped = frame.groupby("layer")[column]
    mean = grouped.mean()
    if kind is None:
        return mean, mean * 0.0
    std = grouped.std(ddof=1).fillna(0.0)
    if kind == "std":
        return mean, std
    sem = std / np.sqrt(grouped.count().clip(lower=1))
    if kind == "sem":
        return mean, sem
    if kind == "ci95":
        return mean, 1.96 * sem
    raise ValueError(f"band must be 'std', 'sem', 'ci95' or None, got {kind!r}")


def _add_band(
    fig: go.Figure,
    x: Any,
    mean: Any,
    half: Any,
    line_colour: str,
    name: str,
    hatched: bool = False,
    **cell: Any,
) -> None:
    """Shade ``mean ± half`` behind the curve ``name`` (same legend group, so toggling the curve toggles it):
    plain and translucent, or ``hatched`` (`BAND_HATCH`, edged by thin
    dashed lines) for a dashed curve's band, so two bands stay apart where they overlap."""
    x = list(x)
    upper = list(np.asarray(mean) + np.asarray(half))
    lower = list(np.asarray(mean) - np.asarray(half))
    fill: dict[str, Any] = (
        {
            "fillcolor": "rgba(0,0,0,0)",
            "fillpattern": {**BAND_HATCH, "fgcolor": rgba(line_colour, 0.55)},
            "line": {"width": 0.8, "dash": "dot", "color": rgba(line_colour, 0.6)},
        }
        if hatched
        else {"fillcolor": rgba(line_colour, 0.18), "line": {"width": 0}}
    )
    fig.add_trace(
        go.Scatter(
            x=x + x[::-1],
            y=upper + lower[::-1],
            mode="lines",
            fill="toself",
            hoverinfo="skip",
            showlegend=False,
            legendgroup=name,
            name=f"{name} band",
            **fill,
        ),
        **cell,
    )


def add_curve(
    fig: go.Figure, x: Any, y: Any, name: str, line_colour: str, dash: str, half: Any = None, **cell: Any
) -> None:
    """One per-layer curve (lines and markers) and, when ``half`` is given, its ``y ± half`` band behind it (hatched
    for a dashed curve: see ``_add_band``)."""
    if half is not None:
        _add_band(fig, x, y, half, line_colour, name, hatched=dash != "solid", **cell)
    fig.add_trace(
        go.Scatter(
            x=x,
            y=y,
            mode="lines+markers",
            name=name,
            legendgroup=name,
            line={"color": line_colour, "dash": dash},
        ),
        **cell,
    )

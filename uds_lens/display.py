"""How results show themselves: short plain reprs and the compact HTML tables notebooks render (``_repr_html_``).

Numbers are rounded to what they can carry (three decimals for scores, whole percent for shares), an undefined value
is a dash, and every aggregate is shown with what it rests on (how many examples, how many KE cells, how many of them
clipped). Standard library only: a result displays itself without importing plotly or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

DASH = "–"


def number(value: Any, digits: int = 3) -> str:
    """``value`` to ``digits`` decimals; a dash for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return f"{float(value):.{digits}f}"


def share(value: Any) -> str:
    """A share in [0, 1] as a whole percent (``"77%"``); a dash for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return f"{100 * float(value):.0f}%"


def interval(bounds: Sequence[Any]) -> str:
    """A confidence interval as ``[low, high]``; a dash when undefined."""
    low, high = bounds
    if number(low) == DASH or number(high) == DASH:
        return DASH
    return f"[{number(low)}, {number(high)}]"


def clipped_text(clipped_share: Any, median_ratio: Any, n_clipped: int, n_ke: int) -> str:
    """``"77% (23 of 30 KE cells, median d2/d1 1.76)"``: the over-disruption the clip hides."""
    if not n_ke:
        return "no KE cell"
    ratio = f", median d2/d1 {number(median_ratio, 2)}" if n_clipped else ""
    return f"{share(clipped_share)} ({n_clipped} of {n_ke} KE cells{ratio})"


def html_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()
) -> str:
    """A compact HTML table: a bold title, a header row, the rows (escaped), and small notes under it."""
    head = "".join(
        f"<th style='text-align:right;padding:2px 8px'>{escape(str(cell))}</th>" for cell in header
    )
    body = "".join(
        "<tr>"
        + "".join(f"<td style='text-align:right;padding:2px 8px'>{escape(str(cell))}</td>" for cell in row)
        + "</tr>"
        for row in rows
    )
    small = "".join(f"<div style='font-size:85%;color:#555'>{escape(note)}</div>" for note in notes)
    return (
        f"<div><b>{escape(title)}</b><table style='border-collapse:collapse'>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{small}</div>"
    )


def auditor_rows(auditor: Any) -> list[tuple[str, str]]:
    """What a ``UDSAuditor`` holds, as (label, value) pairs: its repr's and its notebook table's rows."""
    config = auditor.config
    stage1 = "computed" if auditor._stage1 is not None else "not yet (the first score() computes or loads it)"
    layers = auditor.layers
    return [
        ("full", str(auditor.full_name)),
        ("retain", str(auditor.retain_name) if auditor.retain is not None else "none (retain-free)"),
        (
            "forget set",
            f"{auditor.data_name}: {len(auditor.encoded)} examples encoded, {len(auditor.skipped)} skipped",
        ),
        ("layers", f"{len(layers)} ({layers[0]}-{layers[-1]})" if layers else "none"),
        (
            "settings",
            f"site {config.site}, scope {config.patch_scope}, tau {config.tau:g} nats, {config.engine}",
        ),
        ("device", f"{auditor.device}, {config.dtype or 'default dtype'}"),
        ("Stage 1", stage1),
    ]


__all__ = ["auditor_rows", "DASH", "clipped_text", "html_table", "interval", "number", "share"]

"""How results show themselves: short plain reprs and the compact HTML tables notebooks render (``_repr_html_``).

Numbers are rounded to what they can carry (three decimals for scores, whole percent for shares), an undefined value
is a dash, and every aggregate is shown with what it rests on (how many examples, how many KE cells, how many of them
clipped). Standard library only: a result displays itself without importing plotly or torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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


def split_text(uds_clipped: Any, clipped_share: Any) -> str:
    """``"0.762 (85% of UDS)"``: the part of UDS from clipped cells and its share of the score; a dash if undefined."""
    if number(uds_clipped) == DASH or share(clipped_share) == DASH:
        return number(uds_clipped)
    return f"{number(uds_clipped)} ({share(clipped_share)} of UDS)"


SPLIT_LEGEND = (
    "clipped_part: the part of UDS from KE cells where d2 > d1 (the unlearned model's patch hurts the full model "
    "more than retain's; LER clips them to 1), and its share of UDS.\nexcess: how far past retain's disruption the "
    "unlearned model's goes, sum over KE cells of max(0, d2 - d1) / sum of d1, mean over examples (0 = never past "
    "retain, 1 = twice retain's drop)."
)
"""What the terminal tables' ``clipped_part`` and ``excess`` columns are, printed under them."""


SPAN_NOTES = {
    "choice": "multiple choice: each item's scored span is its correct letter, as lm-evaluation-harness scores it; "
    "a letter is a weaker signal than an answer's text (one token, which a model that never saw the fact still "
    "predicts by chance a quarter of the time)",
    "completion": "passages: each one's scored span is the first sentence of its continuation",
}
"""What a result's scored spans are where they are not answer entities (its ``summary["forms"]``)."""


def span_notes(forms: Sequence[str]) -> list[str]:
    """The `SPAN_NOTES` of a result's prompt forms (``summary.get("forms", [])``), printed under its table."""
    return [SPAN_NOTES[form] for form in forms if form in SPAN_NOTES]


UDS_COLUMNS = ("uds", "ci95", "clipped_part", "excess")
"""The UDS columns of the terminal tables, as `uds_cells` fills them."""


def uds_cells(
    uds: Any, ci95: Sequence[Any], uds_clipped: Any, clipped_share: Any, excess: Any
) -> dict[str, Any]:
    """The `UDS_COLUMNS` of a terminal table's row (``uds-lens score``,
    ``demo``): UDS, its CI, the part of UDS from clipped cells with its share, and the excess disruption
    (`SPLIT_LEGEND` says what the last two are)."""
    return {
        "uds": uds,
        "ci95": interval(ci95),
        "clipped_part": split_text(uds_clipped, clipped_share),
        "excess": number(excess, 2),
    }


def table_row(name: str, summary: Mapping[str, Any]) -> dict[str, Any]:
    """A result's row of ``uds-lens score``'s table from its ``summary``:
    `uds_cells`, the counts, retain-free mode's mean d2 and Stage 2's seconds."""
    cells = uds_cells(
        summary.get("uds"),
        summary.get("ci95") or (None, None),
        summary.get("uds_clipped"),
        summary.get("uds_clipped_share"),
        summary.get("excess_disruption"),
    )
    return {
        "model": name,
        **cells,
        "scored": summary.get("n_scored"),
        "no_ke": summary.get("n_no_ke"),
        "skipped": summary.get("n_skipped"),
        "mean_d2": (summary.get("d2_summary") or {}).get("mean_d2"),
        "s2_s": (summary.get("timings") or {}).get("s2_seconds"),
    }


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
        f"<div style='max-width:100%;overflow-x:auto'><b>{escape(title)}</b><table style='border-collapse:collapse'>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{small}</div>"
    )


def html_fields(title: str, rows: Sequence[tuple[str, Any]], notes: Sequence[str] = ()) -> str:
    """A label/value HTML table, one row per field: as narrow as its longest value, so it fits a notebook column
    and the docs column however many fields it has (a one-row table of many columns does not)."""
    body = "".join(
        f"<tr><th style='text-align:left;padding:2px 8px;font-weight:normal;color:#444'>{escape(str(label))}</th>"
        f"<td style='text-align:left;padding:2px 8px'>{escape(str(value))}</td></tr>"
        for label, value in rows
    )
    small = "".join(f"<div style='font-size:85%;color:#555'>{escape(note)}</div>" for note in notes)
    return (
        f"<div style='max-width:100%'><b>{escape(title)}</b><table style='border-collapse:collapse'>"
        f"<tbody>{body}</tbody></table>{small}</div>"
    )


RESULT_NOTE = (
    "Clipped: KE cells where the unlearned model's patch hurts the full model more than retain's (LER clipped to 1, "
    "read as erased). Excess disruption: sum over KE cells of max(0, d2 - d1) / sum of d1 (0 = never past retain; "
    "1 = twice retain's drop)."
)
"""What a result's notebook view says its clipped cells and excess disruption are."""


def result_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A ``UDSResult``'s notebook view from its ``summary``, as (label, value) pairs: UDS and its CI, the split of
    UDS into its measured and clipped parts, the excess disruption (retain-free mode: the mean d2 instead), the
    counts, the clipped cells, the settings and what the scored spans are (`span_notes`)."""
    rows: list[tuple[str, str]] = []
    if summary.get("retain_free"):
        mean_d2 = (summary.get("d2_summary") or {}).get("mean_d2")
        rows.append(("mean d2 (retain-free)", f"{number(mean_d2)} nats, unnormalised"))
    else:
        mostly = summary.get("n_mostly_clipped")
        rows += [
            ("UDS [95% CI]", f"{number(summary.get('uds'))} {interval(summary.get('ci95') or (None, None))}"),
            ("from measured ratios (d2 ≤ d1)", number(summary.get("uds_unclipped"))),
            (
                "from clipped cells (d2 > d1)",
                split_text(summary.get("uds_clipped"), summary.get("uds_clipped_share"))
                + (f"; {mostly} examples rest mostly on them" if mostly else ""),
            ),
            ("excess disruption", number(summary.get("excess_disruption"), 2)),
        ]
    settings = summary.get("settings") or {}
    return rows + [
        (
            "examples",
            f"{summary['n_scored']} scored, {summary['n_no_ke']} no KE, {summary['n_skipped']} skipped",
        ),
        (
            "clipped KE cells",
            clipped_text(
                summary.get("clipped_share"),
                summary.get("clipped_median_ratio"),
                int(summary.get("n_clipped_cells") or 0),
                int(summary.get("n_ke_cells") or 0),
            ),
        ),
        (
            "settings",
            f"site {settings.get('site')}, tau {settings.get('tau')} nats, scope {settings.get('patch_scope')}",
        ),
        *(("scored span", note) for note in span_notes(summary.get("forms") or [])),
    ]


def auditor_rows(auditor: Any) -> list[tuple[str, str]]:
    """What a ``UDSAuditor`` holds, as (label, value) pairs: its repr's and its notebook table's rows."""
    config = auditor.config
    stage1 = "computed" if auditor._stage1 is not None else "not yet (the first score() computes or loads it)"
    layers = auditor.layers
    return [
        ("full", str(auditor.full_name)),
        # the name, never the model: asking an auditor for a released retain model loads it again
        ("retain", str(auditor.retain_name) if auditor.retain_name is not None else "none (retain-free)"),
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


__all__ = [
    "auditor_rows",
    "DASH",
    "clipped_text",
    "html_fields",
    "html_table",
    "interval",
    "number",
    "RESULT_NOTE",
    "result_rows",
    "share",
    "SPAN_NOTES",
    "span_notes",
    "split_text",
    "SPLIT_LEGEND",
    "table_row",
    "UDS_COLUMNS",
    "uds_cells",
]

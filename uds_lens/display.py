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


def interval(bounds: Sequence[Any] | None, digits: int = 3) -> str:
    """A confidence interval as ``[low, high]``; a dash when undefined."""
    low, high = bounds if bounds is not None else (None, None)
    if number(low) == DASH or number(high) == DASH:
        return DASH
    return f"[{number(low, digits)}, {number(high, digits)}]"


def with_interval(value: Any, bounds: Sequence[Any] | None, digits: int = 3) -> str:
    """``"0.192 [0.126, 0.265]"``: a mean and its CI; the CI left out when undefined."""
    ci = interval(bounds, digits)
    return number(value, digits) if ci == DASH or number(value) == DASH else f"{number(value, digits)} {ci}"


def clipped_text(clipped_share: Any, median_ratio: Any, n_clipped: int, n_ke: int) -> str:
    """``"77% (23 of 30 KE cells, median d2/d1 1.76)"``: the over-disruption the clip hides."""
    if not n_ke:
        return "no KE cell"
    ratio = f", median d2/d1 {number(median_ratio, 2)}" if n_clipped else ""
    return f"{share(clipped_share)} ({n_clipped} of {n_ke} KE cells{ratio})"


def split_text(uds_clipped: Any, clipped_share: Any, bounds: Sequence[Any] | None = None) -> str:
    """``"0.762 (85% of UDS)"``: the part of UDS from clipped cells and its share of the score, with its CI
    (``"0.762 [0.701, 0.820] (85% of UDS)"``) when ``bounds`` are given; a dash if undefined."""
    value = with_interval(uds_clipped, bounds)
    if number(uds_clipped) == DASH or share(clipped_share) == DASH:
        return value
    return f"{value} ({share(clipped_share)} of UDS)"


DEFINITION = (
    "UDS = measured part + clipped part. measured: KE layers where the unlearned model's patch removes at most what "
    "retain's removes (d2 <= d1), each counted at its ratio d2/d1; clipped: KE layers where it removes more (d2 > "
    "d1), each counted as 1. A 1 is erasure like retain only from the measured part; from the clipped part it is "
    "over-disruption of the forget answer, which is damage only where a control (utility) shows it."
)
"""The one definition every place a reader meets UDS first carries (``--help`` of ``score``, the console, the
report): the split, and when a 1 is damage."""

SHARES_NOTE = (
    "Two percentages: 'of UDS' is the clipped part's share of the score (each clipped cell weighted by its d1 within "
    "its example, against measured cells that add only their ratio); 'of KE cells' counts clipped cells among all KE "
    "cells, one each. They differ whenever clipped cells carry more or less of d1 than the others."
)
"""Why a result shows two clipped percentages side by side."""

SPLIT_LEGEND = (
    "measured: the part of UDS from KE cells where d2 <= d1 (the ratio d2/d1 as measured); clipped_part: the part "
    "from KE cells where d2 > d1 (the unlearned model's patch hurts the full model's answer more than retain's; "
    "LER clips them to 1: over-disruption, not erasure), and its share of UDS. [..]: 95% bootstrap CIs over "
    "examples.\nexcess: how far past retain's disruption the unlearned model's goes, sum over KE cells of "
    "max(0, d2 - d1) / sum of d1, mean over examples (0 = never past retain, 1 = twice retain's drop)."
)
"""What the terminal tables' ``measured``, ``clipped_part`` and ``excess`` columns are, printed under them."""


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


UDS_COLUMNS = ("uds", "ci95", "measured", "clipped_part", "excess")
"""The UDS columns of the terminal tables, as `uds_cells` fills them."""


def uds_cells(
    uds: Any,
    ci95: Sequence[Any],
    uds_clipped: Any,
    clipped_share: Any,
    excess: Any,
    uds_unclipped: Any = None,
    split_ci95: Mapping[str, Sequence[Any]] | None = None,
) -> dict[str, Any]:
    """The `UDS_COLUMNS` of a terminal table's row (``uds-lens score``, ``demo``): UDS, its CI, the measured part
    (``uds_unclipped``), the part of UDS from clipped cells with its share, and the excess disruption, each part
    with its CI from ``split_ci95`` (``UDSResult.split_ci95``) when given (`SPLIT_LEGEND` says what they are)."""
    cis = split_ci95 or {}
    return {
        "uds": uds,
        "ci95": interval(ci95),
        "measured": with_interval(uds_unclipped, cis.get("uds_unclipped")),
        "clipped_part": split_text(uds_clipped, clipped_share, cis.get("uds_clipped")),
        "excess": with_interval(excess, cis.get("excess_disruption"), 2),
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
        summary.get("uds_unclipped"),
        summary.get("split_ci95"),
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


def bound_text(bound: Any) -> str:
    """How far rounding could move an example's UDS, capped at UDS's whole range: ``"0.004"``, or ``"1 (the whole
    range; the band's bound, 5.31, exceeds it)"`` where the bound (a sum of band widths over ``sum_KE d1``, unbounded)
    is wider than anything a score in [0, 1] can move."""
    if number(bound) == DASH:
        return DASH
    if float(bound) > 1.0:
        return f"1, its whole range (the band's bound, {number(bound, 2)}, exceeds it)"
    return number(bound)


def precision_text(
    precision: Mapping[str, Any] | None, timings: Mapping[str, Any] | None = None
) -> str | None:
    """What a bf16/fp16 run's precision record (``meta["precision"]``) says, in words: how many examples ran Stage 2
    in fp32 and why, the decisions re-decided in fp32, what the fp32 runs cost (``timings``), how far rounding could
    still move an example's UDS (capped: `bound_text`); with the check off, the fragile cells left undecided.
    None for an fp32 run (no record)."""
    if not precision:
        return None
    dtype = str(precision.get("dtype", "reduced precision"))
    n_examples = len(precision.get("per_example") or {})
    of = f" of {n_examples}" if n_examples else ""
    fragile = int(precision.get("n_fragile_cells") or 0)
    kinds = f"{int(precision.get('n_fragile_ke') or 0)} KE, {int(precision.get('n_fragile_clip') or 0)} clip"
    bound = bound_text(precision.get("max_uds_bound"))
    if not precision.get("check"):
        band = precision.get("band") or {}
        scale = "" if band.get("measured") else f"; band from the prior scale {number(band.get('scale'), 0)}"
        return (
            f"{dtype}, precision check off: {fragile} cells lie inside {dtype}'s rounding band ({kinds} decisions"
            f"{scale}), none re-decided in fp32; rounding could move an example's UDS by up to {bound}. Score with "
            "the check on (the default) to take these decisions in fp32."
        )
    tolerance = precision.get("tolerance")
    why = (
        f" (in {dtype} rounding could move their UDS by more than {tolerance:g})"
        if tolerance is not None
        else ""
    )
    parts = [
        f"{dtype}, precision check on: Stage 2 of {int(precision.get('n_fp32_examples') or 0)}{of} examples ran "
        f"in fp32{why}; {int(precision.get('n_redecided_cells') or 0)} of {fragile} fragile cells ({kinds} "
        "decisions) re-decided in fp32"
    ]
    decisions = precision.get("decisions") or {}
    taken = [
        f"{int(counts.get('float32') or 0)} of {sum(int(v or 0) for v in counts.values())} {kind.replace('ke', 'KE')}"
        for kind, counts in decisions.items()
        if isinstance(counts, Mapping)
    ]
    if taken:
        parts.append("decisions taken in fp32: " + ", ".join(taken))
    times = timings or {}
    if times.get("s2_precision_seconds") is not None and times.get("s2_seconds") is not None:
        parts.append(
            f"the fp32 runs took {float(times['s2_precision_seconds']):.1f} s of Stage 2's "
            f"{float(times['s2_seconds']):.1f} s, plus {float(times.get('s2_precision_copy_seconds') or 0):.1f} s "
            "making fp32 copies"
        )
    parts.append(f"left in {dtype}, rounding moves an example's UDS by at most {bound}")
    skipped = precision.get("not_redecided") or {}
    if skipped:
        parts.append("not re-decided: " + ", ".join(f"{role} ({reason})" for role, reason in skipped.items()))
    rounded = [
        role for role, source in (precision.get("weights") or {}).items() if source == "upcast-rounded"
    ]
    if rounded:
        parts.append(
            f"the fp32 runs of {', '.join(rounded)} used its {dtype} weights upcast (the stored ones unknown)"
        )
    return "; ".join(parts) + "."


def precision_short(precision: Mapping[str, Any] | None) -> str | None:
    """A repr's clause of `precision_text`: ``"bfloat16: Stage 2 of 29 of 30 examples in fp32, 5 decisions
    re-decided in fp32"``; with the check off, the fragile cells and the capped bound. None in fp32."""
    if not precision:
        return None
    dtype = str(precision.get("dtype", "reduced precision"))
    n_examples = len(precision.get("per_example") or {})
    of = f" of {n_examples}" if n_examples else ""
    if not precision.get("check"):
        return (
            f"{dtype}, precision check off: {int(precision.get('n_fragile_cells') or 0)} fragile cells not "
            f"re-decided, UDS_i could move by up to {bound_text(precision.get('max_uds_bound'))}"
        )
    return (
        f"{dtype}: Stage 2 of {int(precision.get('n_fp32_examples') or 0)}{of} examples in fp32, "
        f"{int(precision.get('n_redecided_cells') or 0)} decisions re-decided in fp32"
    )


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
    "Clipped: KE cells where the unlearned model's patch hurts the full model's answer more than retain's (LER "
    "clipped to 1, read as erased: over-disruption, not erasure). Excess disruption: sum over KE cells of max(0, "
    "d2 - d1) / sum of d1 (0 = never past retain; 1 = twice retain's drop). [..]: 95% bootstrap CIs over examples. "
    + SHARES_NOTE
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
        cis = summary.get("split_ci95") or {}
        rows += [
            ("UDS [95% CI]", with_interval(summary.get("uds"), summary.get("ci95"))),
            (
                "measured part (d2 ≤ d1)",
                with_interval(summary.get("uds_unclipped"), cis.get("uds_unclipped")),
            ),
            (
                "clipped part (d2 > d1)",
                split_text(
                    summary.get("uds_clipped"), summary.get("uds_clipped_share"), cis.get("uds_clipped")
                )
                + (f"; {mostly} examples rest mostly on it" if mostly else ""),
            ),
            (
                "excess disruption",
                with_interval(summary.get("excess_disruption"), cis.get("excess_disruption"), 2),
            ),
        ]
    settings = summary.get("settings") or {}
    precision = precision_text(summary.get("precision"), summary.get("timings"))
    if precision:
        rows.append(("precision", precision))
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


def result_text(summary: Mapping[str, Any]) -> str:
    """A ``UDSResult``'s repr from its ``summary``: ``"UDS 0.884 [0.805, 0.949] = measured 0.192 [0.103, 0.284] +
    clipped 0.692 [0.548, 0.828] (78% of UDS), excess disruption 2.27 [1.07, 3.64]; 29 scored, 1 no KE, 0 skipped;
    clipped d2 > d1: 72% of 116 KE cells"``, then `precision_short` in bf16/fp16; retain-free mode's mean d2
    instead of UDS."""
    if summary.get("retain_free"):
        score = (
            f"retain-free, mean d2 {number((summary.get('d2_summary') or {}).get('mean_d2'))} (unnormalised)"
        )
    else:
        cis = summary.get("split_ci95") or {}
        score = (
            f"UDS {with_interval(summary.get('uds'), summary.get('ci95'))} = measured "
            f"{with_interval(summary.get('uds_unclipped'), cis.get('uds_unclipped'))} + clipped "
            f"{split_text(summary.get('uds_clipped'), summary.get('uds_clipped_share'), cis.get('uds_clipped'))}, "
            f"excess disruption {with_interval(summary.get('excess_disruption'), cis.get('excess_disruption'), 2)}"
        )
    precision = precision_short(summary.get("precision"))
    return (
        f"{score}; {summary.get('n_scored')} scored, {summary.get('n_no_ke')} no KE, {summary.get('n_skipped')} "
        f"skipped; clipped d2 > d1: {share(summary.get('clipped_share'))} of {summary.get('n_ke_cells')} KE cells"
        + (f"; {precision}" if precision else "")
    )


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
    "bound_text",
    "DASH",
    "DEFINITION",
    "clipped_text",
    "html_fields",
    "html_table",
    "interval",
    "number",
    "precision_short",
    "precision_text",
    "RESULT_NOTE",
    "result_rows",
    "result_text",
    "share",
    "SHARES_NOTE",
    "SPAN_NOTES",
    "span_notes",
    "split_text",
    "SPLIT_LEGEND",
    "table_row",
    "UDS_COLUMNS",
    "uds_cells",
    "with_interval",
]

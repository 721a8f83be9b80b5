"""What a report's numbers rest on, for an appendix: the checkpoints, the forget set, the settings, the software, the
machine, the time, what was skipped, and the precision the models ran in.

Every value is read from what ``UDSResult.save`` wrote (``summary.json``, and ``meta.json``'s input fingerprint: the
weights of full, retain and the unlearned model by the digest of their files, the forget set by the digest of its
records as scored), nothing is recomputed. [`provenance`][uds_lens.plotting.provenance.provenance] gives the rows
shared by every result (a value that differs between results says so and moves to the per-model table) and one row
per model; [`basis_text`][uds_lens.plotting.provenance.basis_text] is the line every caption of the report ends
with: n, tau, dtype and device.
"""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Mapping
from typing import Any

import pandas as pd

from uds_lens.display import precision_text
from uds_lens.plotting.tables import SavedResult, count_text

PER_MODEL = "differs per model (below)"
"""What a shared row says when the results disagree on it."""


def _fingerprint(result: SavedResult) -> Mapping[str, Any]:
    meta = result.result.meta if result.result is not None else {}
    fingerprint = meta.get("fingerprint")
    return fingerprint if isinstance(fingerprint, Mapping) else {}


def _checkpoint(summary: Mapping[str, Any], fingerprint: Mapping[str, Any], role: str) -> str | None:
    """``"zoo:full (weights files:xxh3_128/v2:8e75...)"``: a checkpoint as given, with the digest of its weights."""
    given, digest = summary.get(role), fingerprint.get(role)
    if given is None and digest is None:
        return None
    return f"{given if given is not None else '–'}" + (f" (weights {digest})" if digest else "")


def _settings(summary: Mapping[str, Any]) -> str:
    settings = summary.get("settings") or {}
    stage2 = summary.get("stage2") or {}
    parts = [
        f"tau {settings.get('tau')} nats",
        f"site {settings.get('site')}",
        f"scope {settings.get('patch_scope')}",
        f"engine {summary.get('engine') or settings.get('engine')}",
        f"Stage 2 on {stage2.get('cells', settings.get('stage2_cells', 'all'))} cells",
    ]
    if settings.get("published_compat"):
        parts.append("published-compat")
    if settings.get("precision_check") is not None and summary.get("precision"):
        parts.append(f"precision check {'on' if settings.get('precision_check') else 'off'}")
    return ", ".join(parts)


def _versions(summary: Mapping[str, Any]) -> str | None:
    versions = summary.get("versions")
    if not isinstance(versions, Mapping) or not versions:
        return None
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def _dtype(summary: Mapping[str, Any]) -> str | None:
    dtype = summary.get("dtype")
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _saved_at(result: SavedResult) -> str | None:
    """When the result directory was written (its ``meta.json``'s file time, UTC)."""
    path = result.path / "meta.json"
    if not path.is_file():
        return None
    stamp = _dt.datetime.fromtimestamp(path.stat().st_mtime, tz=_dt.timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M UTC")


def _skips(summary: Mapping[str, Any]) -> str:
    reasons = summary.get("skipped_reasons") or {}
    return ", ".join(f"{reason} ({count})" for reason, count in reasons.items()) if reasons else "none"


def _seconds(summary: Mapping[str, Any]) -> str | None:
    timings = summary.get("timings") or {}
    stage1, stage2 = timings.get("s1_seconds"), timings.get("s2_seconds")
    if stage1 is None and stage2 is None:
        return None
    first = "Stage 1 from the cache" if timings.get("s1_cached") else f"Stage 1 {float(stage1 or 0):.1f} s"
    return f"{first}, Stage 2 {float(stage2 or 0):.1f} s"


SHARED_ROWS = ("full model", "retain model", "forget set", "settings", "dtype, device", "software")
"""The rows of the shared block, in order."""


def provenance(results: Mapping[str, SavedResult]) -> tuple[list[tuple[str, str]], pd.DataFrame]:
    """The provenance of the results shown: ``(shared, per_model)``.

    ``shared`` is ``(label, value)`` rows (`SHARED_ROWS`): the full and retain checkpoints as given with the digests
    of their weights, the forget set as given with the digest of its records as scored, the settings, dtype and
    device, the library versions; a value the results disagree on reads `PER_MODEL`. ``per_model`` has one row per
    result: ``model, unlearned model`` (as given, with its weights' digest), ``examples`` (scored / no KE /
    skipped), ``skipped`` (each reason with its count), ``dtype, device``, ``precision`` (a bf16/fp16 run's fp32
    examples and cost, `display.precision_text`), ``time`` (Stage 1 and 2 seconds) and ``saved`` (when the
    directory was written).
    """
    scored = {name: r for name, r in results.items() if r.result is not None}
    values: dict[str, list[str | None]] = {label: [] for label in SHARED_ROWS}
    rows = []
    for name, result in scored.items():
        summary, fingerprint = result.summary, _fingerprint(result)
        data = summary.get("data")
        data_digest = fingerprint.get("data")
        dtype_device = ", ".join(str(v) for v in (_dtype(summary), summary.get("device")) if v) or None
        values["full model"].append(_checkpoint(summary, fingerprint, "full"))
        values["retain model"].append(
            _checkpoint(summary, fingerprint, "retain")
            or ("none (retain-free)" if summary.get("retain_free") else None)
        )
        n_examples = sum(int(summary.get(key) or 0) for key in ("n_scored", "n_no_ke", "n_skipped"))
        values["forget set"].append(
            None
            if data is None and data_digest is None
            else f"{data if data is not None else '–'}, {n_examples} records"
            + (f" (records digest {data_digest})" if data_digest else "")
        )
        values["settings"].append(_settings(summary))
        values["dtype, device"].append(dtype_device)
        values["software"].append(_versions(summary))
        rows.append(
            {
                "model": name,
                "unlearned model": _checkpoint(summary, fingerprint, "unlearned"),
                "examples": f"{summary.get('n_scored')} scored, {summary.get('n_no_ke')} no KE, "
                f"{summary.get('n_skipped')} skipped",
                "skipped": _skips(summary),
                "dtype, device": dtype_device,
                "precision": precision_text(summary.get("precision"), summary.get("timings"))
                or "no bf16/fp16 rounding: nothing to check",
                "time": _seconds(summary),
                "saved": _saved_at(result),
            }
        )
    shared = []
    for label in SHARED_ROWS:
        known = list(dict.fromkeys(value for value in values[label] if value is not None))
        if known:
            shared.append((label, known[0] if len(known) == 1 else PER_MODEL))
    table = pd.DataFrame(rows)
    differing = {label for label, value in shared if value == PER_MODEL}
    for label in ("full model", "retain model", "forget set", "settings", "software"):
        if label in differing:
            table[label] = values[label]
    if not table.empty and "dtype, device" not in differing:
        table = table.drop(columns=["dtype, device"])
    return shared, table


def basis_text(results: Mapping[str, SavedResult]) -> str:
    """``"n = 29 examples per model (scored), tau = 0.05 nats, float32 on cpu"``: what a figure of ``results``
    rests on, as every caption of the report states it."""
    summaries = [r.summary for r in results.values() if r.result is not None]
    if not summaries:
        return ""
    counts = count_text(int(s.get("n_scored") or 0) for s in summaries)
    taus = sorted({(s.get("settings") or {}).get("tau") for s in summaries} - {None})
    dtypes = sorted({_dtype(s) for s in summaries} - {None})
    devices = sorted({str(s.get("device")) for s in summaries if s.get("device")})
    parts = [f"n = {counts} examples per model (scored)"]
    if taus:
        parts.append("tau = " + ", ".join(f"{tau:g}" for tau in taus) + " nats")
    if dtypes:
        parts.append(", ".join(dtypes) + (f" on {', '.join(devices)}" if devices else ""))
    return ", ".join(parts)


def provenance_html(results: Mapping[str, SavedResult]) -> tuple[str, pd.DataFrame]:
    """The report's provenance block: the shared rows of [`provenance`][uds_lens.plotting.provenance.provenance]
    as an HTML table with its caption, and the per-model table."""
    shared, per_model = provenance(results)
    rows = "".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>" for label, value in shared
    )
    return (
        "<p class='caption'>What every number on this page rests on, as the results recorded it (summary.json, "
        "meta.json): the checkpoints and the forget set by the digests of their files and records.</p>"
        f"<table class='data provenance'><tbody>{rows}</tbody></table>",
        per_model,
    )


def precision_html(results: Mapping[str, SavedResult]) -> str:
    """A paragraph for the results that ran in bf16/fp16: per model, what ran in fp32, why and what it cost
    (`display.precision_text`); empty when every result ran in fp32."""
    reduced = {
        name: text
        for name, result in results.items()
        if (text := precision_text(result.summary.get("precision"), result.summary.get("timings")))
    }
    if not reduced:
        return ""
    items = "".join(
        f"<li><code>{html.escape(name)}</code>: {html.escape(text)}</li>" for name, text in reduced.items()
    )
    return (
        "<p class='precision'><b>Precision.</b> These results ran in reduced precision; what was computed in fp32, "
        f"why, and what it cost:</p><ul>{items}</ul>"
    )


__all__ = ["PER_MODEL", "SHARED_ROWS", "basis_text", "precision_html", "provenance", "provenance_html"]

"""One self-contained HTML page from saved results: the figures of `uds_lens.plotting` and the tables behind them.

``uds-lens score`` saves one directory per audited model, ``RESULTS_DIR/NAME/`` (``UDSResult.save``: ``summary.json``,
the ``examples.csv`` and ``layers.csv`` tables, and ``meta.json`` with the digest of every file); ``uds-lens diagnose`` adds
``RESULTS_DIR/NAME/{scores.json, layerwise.csv, components.csv}`` and ``RESULTS_DIR/{prompt_types.csv,
tau_sensitivity.csv}``. [`write_report`][uds_lens.plotting.report.write_report] reads whatever of these exists (results through ``UDSResult.load``, so
the page shows exactly what ``load`` gives back) and writes one HTML file with plotly.js inlined once in the page
head, so the page opens offline and can be mailed as is. Model roles (full / retain / unlearned / pos / neg ...) come
from the caller, from ``RESULTS_DIR/roles.json`` (``{name: role}``, as ``uds-lens demo`` writes it) or from each
result's summary.

The page is meant to stand as an appendix: every caption ends with what its figure rests on (n, tau, dtype and
device: `provenance.basis_text`), a provenance block names the checkpoints and the forget set by their digests,
the settings, software, machine, time and skipped records (`provenance.provenance`), a bf16/fp16 result says what
ran in fp32 and what it cost, and ``figures=("png", "pdf")`` writes every figure as a file beside the page
(`export.write_figures`), numbered as on the page, with a ``captions.txt``.
"""

from __future__ import annotations

import datetime as _dt
import functools
import html
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from uds_lens import plotting
from uds_lens.config import DEFAULT_TAU
from uds_lens.display import SHARES_NOTE, interval, number, split_text, with_interval
from uds_lens.files import write_atomic
from uds_lens.outputs import REPORT_MARKER, check_report_output
from uds_lens.plotting import retain_free
from uds_lens.plotting.export import static_renderer, write_figures
from uds_lens.plotting.models import SPLIT_CI_COLUMNS
from uds_lens.plotting.provenance import basis_text, precision_html, provenance_html
from uds_lens.plotting.tables import SavedResult, count_text
from uds_lens.result_store import DIAGNOSE_FILES, REQUIRED_FILES, ResultIntegrityError, verify_result_dir
from uds_lens.results import UDSResult

__all__ = [
    "find_incomplete",
    "load_results",
    "load_roles",
    "record_roles",
    "result_role",
    "write_report",
]

logger = logging.getLogger(__name__)

REFERENCE_ROLES = ("full", "retain")  # the two ends of the UDS scale (0 and 1 by construction)
# A sub-directory holding any of these is a result to show (or to name as incomplete): meta.json and the files
# every saved result has.
RESULT_MARKERS = ("meta.json", *REQUIRED_FILES)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        logger.warning("could not read %s (%s); skipping it", path, error)
        return None


def _read_csv(path: Path) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    try:
        return pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as error:
        logger.warning("could not read %s (%s); skipping it", path, error)
        return None


def find_incomplete(results_dir: str | Path) -> dict[str, str]:
    """``{directory name: reason}`` for every result directory under ``results_dir`` that [`load_results`][uds_lens.plotting.report.load_results]
    leaves out because its files are incomplete or do not belong together (a killed or concurrent write)."""
    return _scan(Path(results_dir))[1]


def load_results(results_dir: str | Path) -> dict[str, SavedResult]:
    """Read every complete saved result under ``results_dir`` (one sub-directory per model).

    Directories whose files ``UDSResult.load`` refuses (incomplete, or from different runs) are left out with a
    warning (see [`find_incomplete`][uds_lens.plotting.report.find_incomplete]; the report lists them), as are hidden ones (a writer's staging directories).

    Args:
        results_dir: the directory ``uds-lens score`` / ``diagnose`` wrote to.

    Returns:
        ``{name: SavedResult}`` in directory-name order; the name is the result's own, else the directory's.
    """
    return _scan(Path(results_dir))[0]


def _read_result(directory: Path) -> tuple[UDSResult | None, str | None]:
    """The result ``UDSResult.save`` wrote in ``directory`` (or None if it holds none), or why it cannot be shown."""
    if not any((directory / name).is_file() for name in RESULT_MARKERS):
        return None, None
    reason = verify_result_dir(directory)
    if reason is not None:
        return None, reason
    try:
        return UDSResult.load(directory), None
    except ResultIntegrityError as error:  # rewritten between the check and the read
        return None, str(error)


def _scan(root: Path) -> tuple[dict[str, SavedResult], dict[str, str]]:
    results: dict[str, SavedResult] = {}
    incomplete: dict[str, str] = {}
    for directory in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        result, reason = _read_result(directory)
        if reason is not None:
            logger.warning("%s is incomplete (%s); it is left out of the report", directory, reason)
            incomplete[directory.name] = reason
            continue
        if result is None and not any((directory / name).is_file() for name in DIAGNOSE_FILES):
            continue
        scores = _read_json(directory / "scores.json") if (directory / "scores.json").is_file() else None
        name = result.name if result is not None else directory.name
        results[name] = SavedResult(
            name=name,
            path=directory,
            result=result,
            scores=scores if isinstance(scores, dict) else None,
            layerwise=_read_csv(directory / "layerwise.csv"),
            components=_read_csv(directory / "components.csv"),
        )
    return results, incomplete


def load_roles(results_dir: str | Path) -> dict[str, str]:
    """Model roles from ``roles.json`` (``{name: role}``) in ``results_dir``; empty when there is none."""
    path = Path(results_dir) / "roles.json"
    content = _read_json(path) if path.is_file() else None
    if not isinstance(content, dict):
        return {}
    return {str(name): role for name, role in content.items() if isinstance(role, str)}


def result_role(result: UDSResult | None) -> str | None:
    """The role of a scored model from its own result: ``full`` or ``retain`` when its weights are those of the
    run's full or retain model (by the content fingerprints it records, else by path), ``unlearned`` otherwise;
    None for a directory without a UDS result."""
    if result is None:
        return None
    fingerprint = result.meta.get("fingerprint") or {}
    for role in REFERENCE_ROLES:
        if fingerprint.get("unlearned") is not None and fingerprint.get("unlearned") == fingerprint.get(role):
            return role
        if (
            not fingerprint
            and result.meta.get("unlearned")
            and result.meta.get("unlearned") == result.meta.get(role)
        ):
            return role
    return "unlearned"


def record_roles(results_dir: str | Path, roles: Mapping[str, str]) -> Path:
    """Write ``results_dir/roles.json`` with ``roles`` first, in their order (the order the command's table printed
    them), then the models an earlier run recorded there; the report shows models in this order."""
    path = Path(results_dir) / "roles.json"
    merged = dict(roles)
    for name, role in load_roles(results_dir).items():
        merged.setdefault(name, role)
    return write_atomic(path, json.dumps(merged, indent=2))


def _table_order(root: Path) -> list[str]:
    """The order the terminal table printed the models in: ``roles.json`` (``score``, ``demo``) then ``sweep.csv``."""
    order = list(load_roles(root))
    sweep_table = _read_csv(root / "sweep.csv") if (root / "sweep.csv").is_file() else None
    if sweep_table is not None and "name" in sweep_table:
        order += [str(name) for name in sweep_table["name"] if str(name) not in order]
    return order


def _models_table(results: Mapping[str, SavedResult], roles: Mapping[str, str]) -> pd.DataFrame:
    frame = plotting.model_frame(
        {name: r for name, r in results.items() if r.summary or r.examples is not None}
    )
    if frame.empty:
        return frame
    frame.insert(1, "role", [roles.get(name, results[name].summary.get("role")) for name in frame["model"]])
    frame["CI 95%"] = [interval(ci) for ci in zip(frame["ci_low"], frame["ci_high"], strict=True)]

    def bounds(key: str) -> list[tuple[Any, Any]]:
        return list(zip(frame[f"{key}_ci_low"], frame[f"{key}_ci_high"], strict=True))

    frame["measured part [95% CI]"] = [
        with_interval(part, ci)
        for part, ci in zip(frame["uds_unclipped"], bounds("uds_unclipped"), strict=True)
    ]
    frame["clipped part [95% CI] (share of UDS)"] = [
        split_text(part, share, ci)
        for part, share, ci in zip(
            frame["uds_clipped"], frame["uds_clipped_share"], bounds("uds_clipped"), strict=True
        )
    ]
    frame["excess disruption [95% CI]"] = [
        with_interval(value, ci, 2)
        for value, ci in zip(frame["excess_disruption"], bounds("excess_disruption"), strict=True)
    ]
    frame["examples mostly clipped"] = [
        results[name].summary.get("n_mostly_clipped") if results[name].result is not None else None
        for name in frame["model"]
    ]
    frame["clipped KE cells (share of cells)"] = [
        "–" if pd.isna(share) else f"{share:.0%}" + ("" if pd.isna(ratio) else f" (median d2/d1 {ratio:.2f})")
        for share, ratio in zip(frame["clipped_share"], frame["clipped_median_ratio"], strict=True)
    ]
    frame = frame.drop(
        columns=["clipped_share", "clipped_median_ratio", "uds_unclipped", "uds_clipped", "uds_clipped_share",
                 "excess_disruption", "tau", "dtype", *SPLIT_CI_COLUMNS]
    )  # fmt: skip
    seconds = []
    for name in frame["model"]:
        timings = results[name].summary.get("timings") or {}
        total = timings.get("total", timings.get("total_s")) if isinstance(timings, Mapping) else None
        seconds.append(float(total) if isinstance(total, int | float) else None)
    if any(s is not None for s in seconds):
        frame["time (s)"] = seconds
    frame = frame.drop(columns=["ci_low", "ci_high"]).rename(columns={"uds": "UDS"})
    return frame[
        [c for c in ["model", "role", "UDS", "CI 95%"] if c in frame.columns]
        + [c for c in frame.columns if c not in ("model", "role", "UDS", "CI 95%")]
    ]


def _scores_table(results: Mapping[str, SavedResult]) -> pd.DataFrame | None:
    rows = []
    for name, result in results.items():
        if not result.scores:
            continue
        flat: dict[str, Any] = {"model": name}
        for key, value in result.scores.items():
            if isinstance(value, Mapping) and "agg_value" in value:
                value = value["agg_value"]
            if isinstance(value, int | float) and not isinstance(value, bool):
                flat[key] = value
        rows.append(flat)
    return pd.DataFrame(rows) if rows else None


def _wide(table: pd.DataFrame, row: str, value: str, shared: tuple[str, ...]) -> pd.DataFrame:
    """One row per ``row`` value and one ``value`` column per model (plus columns shared by all models).

    ``prompt_types.csv`` and ``tau_sensitivity.csv`` are long (model x row); read as the paper prints them they are
    wide, and a page with many models stays short.
    """
    if not {"model", row, value} <= set(table.columns):
        return table
    wide = table.pivot_table(index=row, columns="model", values=value, sort=False)
    wide = wide[list(dict.fromkeys(table["model"]))]
    wide.columns = [f"{value} · {model}" for model in wide.columns]
    first = table.groupby(row, sort=False)[[c for c in shared if c in table.columns]].first()
    return first.join(wide).reset_index()


@functools.lru_cache(maxsize=1)
def _white_template() -> dict[str, Any]:
    return pio.templates["plotly_white"].to_plotly_json()


class _Page:
    """Accumulates HTML sections; plotly.js goes once into the head."""

    def __init__(self, title: str, basis: str = "") -> None:
        self.title = title
        self.basis = basis
        self.parts: list[str] = []
        self.n_figures = 0
        self.figures: list[tuple[str, go.Figure, str]] = []  # (file name, figure, caption): for static export

    def heading(self, text: str, level: int = 2) -> None:
        anchor = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
        self.parts.append(f'<h{level} id="{anchor}">{html.escape(text)}</h{level}>')

    def text(self, text: str) -> None:
        self.parts.append(f"<p>{text}</p>")

    def figure(self, fig: go.Figure, caption: str | None = None) -> None:
        """A figure with its caption, which ends with the page's basis (n, tau, dtype, device)."""
        self.n_figures += 1
        caption = " ".join(part for part in (caption, f"Basis: {self.basis}." if self.basis else "") if part)
        heading = re.sub(r"<[^>]+>", "", str(fig.layout.title.text or "figure").split("<br>")[0])
        slug = re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")[:48].rstrip("-") or "figure"
        self.figures.append((f"{self.n_figures:02d}-{slug}", fig, re.sub(r"<[^>]+>", "", caption)))
        # The white template goes into the figure's JSON rather than through update_layout, which validates and
        # deep-copies the whole template per figure (half of a report's run time).
        spec = fig.to_plotly_json()
        spec["layout"] = {**spec.get("layout", {}), "template": _white_template(), "autosize": True}
        body = pio.to_html(
            spec,
            validate=False,
            full_html=False,
            include_plotlyjs=False,
            div_id=f"figure-{self.n_figures}",
            default_width="100%",
            default_height=f"{int(fig.layout.height or 460)}px",
            config={"responsive": True, "displaylogo": False},
        )
        caption_html = f"<figcaption>{caption}</figcaption>" if caption else ""
        self.parts.append(f'<figure class="plot">{body}{caption_html}</figure>')

    def table(
        self, frame: pd.DataFrame, caption: str | None = None, max_rows: int = 200, classes: str = "data"
    ) -> None:
        shown = frame.head(max_rows)
        body = shown.to_html(
            index=False, classes=classes, na_rep="–", float_format=lambda v: f"{v:.3f}", border=0
        )
        note = f" (first {max_rows} of {len(frame)} rows)" if len(frame) > max_rows else ""
        caption_html = f"<p class='caption'>{html.escape(caption)}{note}</p>" if caption else ""
        self.parts.append(f'<div class="table">{caption_html}{body}</div>')

    def render(self) -> str:
        return (
            f"<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n{REPORT_MARKER}\n"
            f"<title>{html.escape(self.title)}</title>\n<style>{_CSS}</style>\n"
            f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head>\n<body>\n<main>\n'
            + "\n".join(self.parts)
            + "\n</main>\n</body>\n</html>\n"
        )


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0; background: #fafafa; color: #222; }
main { max-width: 1280px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { margin-bottom: 4px; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 40px; }
p.meta { color: #666; font-size: 13px; margin-top: 0; }
figure.plot { margin: 12px 0 28px; } figcaption { color: #555; font-size: 13px; }
table.data { border-collapse: collapse; font-size: 13px; margin: 8px 0 20px; }
table.data th, table.data td { padding: 4px 10px; border-bottom: 1px solid #e5e5e5; text-align: right; }
table.data th { background: #f3f3f3; } table.data td:first-child, table.data th:first-child { text-align: left; }
p.caption { font-size: 13px; color: #555; margin-bottom: 2px; }
code { background: #f3f3f3; padding: 1px 4px; border-radius: 3px; }
table.provenance th, table.provenance td { text-align: left; }
"""


def write_report(
    results_dir: str | Path,
    out_html: str | Path | None = None,
    title: str | None = None,
    roles: Mapping[str, str] | None = None,
    force: bool = False,
    figures: tuple[str, ...] | list[str] = (),
) -> Path:
    """Write one self-contained HTML report of the results saved under ``results_dir``.

    The page holds a table of models (name, role, UDS, 95% CI, the measured and clipped parts and the excess
    disruption with their CIs, counts), what a bf16/fp16 run computed in fp32, the UDS bar chart, the measured part
    against the excess disruption, the per-example distribution, the provenance block, the mean S1/S2 delta curves,
    the shared S1 heatmap (d1) and one LER heatmap per model, and, when ``diagnose`` ran, the prompt-type,
    tau-sensitivity, component-patching and logit-lens sections. Every caption ends with its basis (n, tau, dtype).
    When every result is retain-free, the page is [`retain_free`][uds_lens.plotting.retain_free]'s instead: d2
    alone, never named UDS.

    Args:
        results_dir: directory with one sub-directory per model (``summary.json, examples.csv, layers.csv``).
        out_html: output path (default ``results_dir/report.html``).
        title: page title (default: "UDS report: <directory name>").
        roles: ``{name: role}`` (from a zoo: ``{m["name"]: m["role"] for m in zoo.models}``); default the
            directory's ``roles.json`` for the models it does not name, then the role in their summary or the one
            their result implies ([`result_role`][uds_lens.plotting.report.result_role]): every model shows a role. Models are shown in this order (the terminal table's: the order
            of ``roles``, of ``roles.json``, then of ``sweep.csv``), the others by name.
        force: replace a file at ``out_html`` that is not a report (otherwise refused: a report never overwrites
            a forget set or a result's own files).
        figures: formats to export every figure in as well (``"png"``, ``"pdf"``, ``"svg"``): written to
            ``<out_html's stem>_figures/NN-title.FORMAT`` beside the page, numbered in page order, with
            ``captions.txt`` (each file's caption and basis). Rendered by kaleido, or a local Chrome/Chromium
            (`export.write_figures`); nothing is fetched.

    Returns:
        The path of the written HTML file.

    Raises:
        FileNotFoundError: ``results_dir`` does not exist or holds no saved result.
        ConfigError: ``out_html`` is a directory, or a file that is not a report and ``force`` is off.
        ConfigError: ``figures`` asked for, and nothing here can render them (the message says what to install).
    """
    root = Path(results_dir)
    out = Path(out_html) if out_html is not None else root / "report.html"
    check_report_output(out, force, "out_html (--out)" if out_html is not None else "the report")
    if figures:
        static_renderer(figures)  # nothing written before it is known that the figures can be
    if not root.is_dir():
        raise FileNotFoundError(
            f"results directory {root} does not exist; run `uds-lens score ... --out {root}` first"
        )
    results, incomplete = _scan(root)
    if not results:
        raise FileNotFoundError(
            f"no saved results under {root}: expected sub-directories with {', '.join(RESULT_MARKERS)} "
            "(written by `uds-lens score`)"
            + (
                f"; incomplete: {', '.join(f'{n} ({r})' for n, r in incomplete.items())}"
                if incomplete
                else ""
            )
        )
    order = list(roles) if roles is not None else []
    order += [name for name in _table_order(root) if name not in order]
    roles = {**load_roles(root), **(roles or {})}
    for name, result in results.items():
        if name not in roles:
            role = result.summary.get("role") or result_role(result.result)
            if role:
                roles[name] = str(role)
    # Models in the order the command's terminal table showed them; any other, by name.
    position = {name: number for number, name in enumerate(order)}
    ordered = dict(sorted(results.items(), key=lambda item: (position.get(item[0], len(order)), item[0])))
    plotting.set_model_colours(
        order=ordered
    )  # one colour per model in every figure below (kept if already drawn)
    if retain_free.all_retain_free(ordered):  # d2 alone: its own page, which never calls it UDS
        page = _Page(title or retain_free.TITLE.format(name=root.resolve().name))
        page.heading(page.title, level=1)
        retain_free.write_sections(page, root, ordered, roles, incomplete)
        return _write_page(page, out, figures)
    scored = {n: r for n, r in ordered.items() if r.examples is not None and "uds" in r.examples.columns}
    with_layers = {n: r for n, r in scored.items() if r.layers is not None and not r.layers.empty}
    page = _Page(title or f"UDS report: {root.resolve().name}", basis_text(scored))
    page.heading(page.title, level=1)
    first = next(iter(ordered.values()))
    settings = first.summary.get("settings") or {}
    meta = ", ".join(
        f"{k}={v}" for k, v in settings.items() if v is not None and not isinstance(v, dict | list)
    )
    page.parts.append(
        f"<p class='meta'>{len(ordered)} model{'' if len(ordered) == 1 else 's'} from "
        f"<code>{html.escape(str(root))}</code> · generated "
        f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
        + (f" · settings: {html.escape(meta)}" if meta else "")
        + "</p>"
    )
    page.text(
        "UDS measures how deeply forget-set knowledge is erased: each layer of the <b>full</b> model is patched with "
        "the <b>retain</b> model's residual (S1, Δ<sup>S1</sup> = d1) and with the <b>unlearned</b> model's (S2, d2). "
        f"On knowledge-encoding layers (d1 &gt; tau = {html.escape(str(settings.get('tau')))} nats) the layer erasure "
        "ratio is LER = clip(d2/d1, 0, 1); UDS<sub>i</sub> is their d1-weighted mean. 0 = the knowledge is as "
        "recoverable as in <i>full</i>, 1 = the unlearned model's layers disrupt the answer at least as much as "
        "<i>retain</i>'s. UDS = <b>measured part</b> + <b>clipped part</b>: the measured part comes from the KE "
        "layers where d2 ≤ d1 (each at its ratio), the clipped part from those where d2 &gt; d1 (each counted as 1). "
        "A 1 is erasure like retain only from the measured part; from the clipped part it is <b>over-disruption</b> "
        "of the forget answer, which UDS cannot tell from erasure, and which is damage only where a control (the "
        "model's utility) shows it. So every UDS below is shown with its two parts and the <b>excess "
        "disruption</b>: sum over KE cells of max(0, d2 − d1) / sum of d1, how far past retain the unlearned model "
        "disrupts (0 = never, 1 = twice retain's drop). Intervals are 95% bootstrap CIs over examples."
        + (f" Basis of every figure: {html.escape(page.basis)}." if page.basis else "")
    )

    if incomplete:
        page.heading("Incomplete results (not shown)")
        page.parts.append(
            "<p class='warning'>These directories were left out because their files are incomplete or come from "
            "different runs; score those models again to include them:</p><ul>"
            + "".join(
                f"<li><code>{html.escape(name)}</code>: {html.escape(reason)}</li>"
                for name, reason in incomplete.items()
            )
            + "</ul>"
        )

    with_uds = {n: r for n, r in ordered.items() if "uds" in r.summary or n in scored}
    if with_uds:
        page.heading("Models")
        page.table(
            _models_table(with_uds, roles),
            caption="UDS per model with its 95% bootstrap CI over examples, and its two parts (they add up to UDS; "
            "their CIs are each their own): the measured part, from KE cells where d2 ≤ d1 (each at its ratio), and "
            "the clipped part, from KE cells where the unlearned model's patch hurts the full model's answer more "
            "than retain's (d2 > d1, LER clipped to 1: over-disruption), with its share of UDS. Excess "
            "disruption: sum over KE cells of max(0, d2 − d1) / sum of d1, mean over examples. Examples mostly "
            f"clipped: those whose UDS_i rests more than half on clipped cells. {SHARES_NOTE} "
            + (f"Basis: {page.basis}." if page.basis else ""),
        )
        page.parts.append(precision_html(with_uds))
        table = plotting.model_frame(with_uds, roles={n: roles.get(n) or "other" for n in with_uds})
        page.figure(
            plotting.uds_bar(table),
            caption="The headline: each bar is UDS, its plain part the measured part (d2 ≤ d1) with its 95% CI "
            "(wide caps), its hatched part the clipped part (d2 > d1: the unlearned activation disrupts more than "
            "retain's, counted as erased); UDS's CI at the top (narrow caps); the percentage above a bar is the "
            "hatched part's share of its UDS.",
        )
        if table["excess_disruption"].notna().any() and table["uds_unclipped"].notna().any():
            page.figure(
                plotting.depth_vs_damage(table),
                caption="Depth vs over-disruption: each model's measured part of UDS (filled, with its 95% CI) "
                "against its excess disruption (with its CI), and a line up to its UDS (open): the line is the "
                "clipped part, which total UDS adds whatever the excess. Erasure like retain sits top left; "
                "over-disruption to the right.",
            )
    if scored:
        page.figure(
            plotting.uds_distribution(scored, kind="violin"),
            caption="Per-example UDS (right half of each violin) beside its measured part (left half); red points: "
            "examples whose UDS rests mostly on clipped cells.",
        )
    if scored:
        page.heading("Provenance")
        shared, per_model = provenance_html(scored)
        page.parts.append(shared)
        page.table(per_model, caption="Per model: the unlearned checkpoint, the examples, what was skipped and why, "
                   "the precision, the time and when the result was saved.", classes="data provenance")  # fmt: skip
    if with_layers:
        page.heading("Layers")
        # The full and retain references add nothing here (their S2 is 0 and S1); bands only while they stay legible.
        audited = {n: r for n, r in with_layers.items() if roles.get(n) not in REFERENCE_ROLES} or with_layers
        band = "std" if len(audited) <= 2 else None
        page.figure(
            plotting.stage_curves(audited, band=band),
            caption="Mean patching delta per layer over scored examples; S1 (retain as source) is shared by all "
            "models, S2 has one curve per model."
            + (" Bands: ±1 std over examples, S1's plain, S2's hatched." if band else ""),
        )
        name, reference = next(iter(with_layers.items()))
        page.figure(
            plotting.layer_heatmap(reference, value="d1", sort_by="d1",
                                   title="Δ<sup>S1</sup> per layer and example (retain → full)"),
            caption="Where the forget-set knowledge lives: blue cells lose log-prob when the retain model's residual "
            "is patched in. Shared by every model audited against the same full/retain pair. Examples in every "
            "heatmap of this page are in one order: largest mean Δ<sup>S1</sup> first.",
        )  # fmt: skip
        page.heading("Per model", level=2)
        for name, result in audited.items():
            role = roles.get(name)
            summary = result.summary
            page.heading(
                f"{name}"
                + (f" ({role})" if role else "")
                + f" · UDS {result.uds:.3f}"
                + (
                    f" · from clipped cells {split_text(summary['uds_clipped'], summary['uds_clipped_share'])}"
                    f" · excess disruption {number(summary['excess_disruption'], 2)}"
                    if summary.get("uds_clipped") is not None
                    else ""
                ),
                level=3,
            )
            page.figure(
                plotting.layer_heatmap(result, value="ler", sort_by="d1",
                                       title=f"{name}: LER on KE layers (× = clipped, d2 > d1)"),
            )  # fmt: skip
    rmu = {n: r for n, r in with_layers.items() if plotting.rmu_target_layer(n) is not None}
    if rmu:
        page.heading("RMU layer profile", level=3)
        reference_models = {n: r for n, r in with_layers.items() if roles.get(n) in ("retain", "full")}
        page.figure(
            plotting.rmu_layer_profile({**reference_models, **rmu}),
            caption="Mean LER per layer on KE cells; dashed lines mark each RMU model's target layer.",
        )
    _diagnostics_sections(page, root, ordered, with_layers)
    return _write_page(page, out, figures)


def _write_page(page: _Page, out: Path, figures: tuple[str, ...] | list[str] = ()) -> Path:
    """The page to ``out``, and its figures as files beside it in the ``figures`` formats."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, page.render().encode("utf-8"))
    logger.info("wrote %s (%d figures)", out, page.n_figures)
    if figures:  # every figure as a file beside the page, numbered as on it, and the captions in one file
        folder, white = out.with_name(f"{out.stem}_figures"), pio.templates["plotly_white"]  # the page's look
        write_figures(
            [(n, go.Figure(f).update_layout(template=white)) for n, f, _ in page.figures], folder, figures
        )
        captions = "\n\n".join(f"{name}: {caption or '(no caption)'}" for name, _, caption in page.figures)
        write_atomic(folder / "captions.txt", (captions + "\n").encode("utf-8"))
    return out


def _n_examples(results: Mapping[str, SavedResult]) -> str | None:
    """The scored examples of the results (their range when they differ), for figures whose tables lack them."""
    counts = [r.summary["n_scored"] for r in results.values() if r.result is not None]
    return count_text(counts) if counts else None


def _tau(results: Mapping[str, SavedResult]) -> float:
    """The KE threshold of the first result that records one (diagnose scores every model with one tau)."""
    for result in results.values():
        tau = (result.summary.get("settings") or {}).get("tau")
        if tau is not None:
            return float(tau)
    return DEFAULT_TAU


def _diagnostics_sections(
    page: _Page, root: Path, results: Mapping[str, SavedResult], with_layers: Mapping[str, SavedResult]
) -> None:
    """Sections from `diagnose` outputs, each only when its files exist."""
    prompt_types = _read_csv(root / "prompt_types.csv")
    tau = _read_csv(root / "tau_sensitivity.csv")
    clipped = _read_csv(root / "clipped_examples.csv")
    scores = _scores_table(results)
    components = {
        n: r.components for n, r in results.items() if r.components is not None and not r.components.empty
    }
    layerwise = {
        n: r.layerwise for n, r in results.items() if r.layerwise is not None and not r.layerwise.empty
    }
    typed = {
        n: r
        for n, r in with_layers.items()
        if r.examples is not None and r.examples["prompt_type"].notna().any()
    }
    if not (
        prompt_types is not None or tau is not None or scores is not None or components or layerwise or typed
    ):
        return
    page.heading("Diagnostics")
    if prompt_types is not None or typed:
        page.heading("Prompt types", level=3)
        # the results' own examples carry the split; prompt_types.csv only the means
        source = typed or (
            prompt_types if prompt_types is not None and "mean_uds" in prompt_types.columns else {}
        )
        if isinstance(source, pd.DataFrame) or source:
            page.figure(
                plotting.prompt_type_bar(source, tau=_tau(results)),
                caption="Mean UDS per prompt type (the paper's Table 5), its hatched part from clipped cells.",
            )
        if prompt_types is not None:
            page.table(
                _wide(prompt_types, "prompt_type", "mean_uds", ("n",)), caption="prompt_types.csv: mean UDS"
            )
    if tau is not None:
        page.heading("τ sensitivity", level=3)
        if {"tau", "uds"} <= set(tau.columns):
            page.figure(plotting.tau_curves(tau, n_examples=_n_examples(results)))
        page.table(
            _wide(tau, "tau", "uds", ("ke_mean", "n_no_ke", "spearman")),
            caption="tau_sensitivity.csv: model UDS under each τ, mean KE-set size, examples without a KE layer, "
            "and the Spearman rank correlation of the models' UDS with their UDS at the default τ",
        )
    if scores is not None:
        page.heading("Other metrics", level=3)
        page.table(
            scores, caption="scores.json of each model (every white-box score: 1 = erased like retain)"
        )
    if clipped is not None and not clipped.empty:
        page.heading("Examples whose UDS rests on clipped cells", level=3)
        page.table(
            clipped.drop(columns=[c for c in ("question",) if c in clipped.columns]),
            caption="clipped_examples.csv: the examples whose UDS_i comes more than half from clipped KE cells "
            "(d2 > d1): there the unlearned model disrupts the full model's answer more than retain does, so their "
            "score says over-disruption, not erasure like retain.",
            max_rows=60,
        )
    if layerwise:
        lens_pair = {
            n: t
            for n, t in layerwise.items()
            if {"uds", "logit_lens"} <= set(t.get("method", pd.Series()).astype(str))
        }
        if lens_pair:
            page.heading("Logit lens vs UDS", level=3)
            page.figure(
                plotting.layerwise_methods(lens_pair, methods=["uds", "logit_lens"], results=with_layers,
                                        title="Logit lens vs UDS: per-layer erasure (marker size = layer weight)"),
                caption="Observational (logit lens through the full model's frozen unembedding) vs causal (patching) "
                "erasure per layer. Where the lens reads 1 and UDS does not, the knowledge is still recoverable.",
            )  # fmt: skip
        page.heading("Every method per layer", level=3)
        try:
            page.figure(
                plotting.layerwise_methods(
                    layerwise, n_examples=_n_examples(results), tau=_tau(results), results=with_layers
                )
            )
        except ValueError as error:
            logger.warning("layerwise.csv not plotted: %s", error)
    if components:
        # S1 (retain -> full) is the same for every model audited against one full/retain pair, so one figure.
        page.heading("Component patching", level=3)
        name, table = next(iter(components.items()))
        try:
            page.figure(
                plotting.component_patching(
                    table, stage="d1", tau=_tau(results), n_examples=_n_examples(results)
                ),
                caption="Mean S1 delta (retain → full) per layer when patching each site (the paper's appendix D.1): "
                "the site with the largest delta carries the forget-set knowledge.",
            )
        except ValueError as error:
            logger.warning("components.csv of %s not plotted: %s", name, error)
            page.table(table, caption=f"{name}: components.csv")

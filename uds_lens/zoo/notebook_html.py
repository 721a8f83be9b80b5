"""Executed notebooks that show their figures anywhere: a static image beside every Plotly figure, and HTML pages
that open offline.

A Plotly figure in a notebook is data that plotly.js draws when the page runs it. Where plotly.js cannot run (a
viewer that runs no JavaScript, a page opened offline whose plotly.js comes from a CDN) the figure is a blank box.
Two things here keep it visible:

- `add_static_figures` renders every Plotly output of an executed notebook to a PNG with a local headless
  Chrome or Chromium (found on ``PATH``, or named by ``$UDS_LENS_BROWSER``; plotly.js from the installed plotly
  package, nothing fetched) and stores it twice: as the output's ``image/png``, which a viewer that renders no HTML
  shows, and inside its ``text/html``, where it stands in for the figure until plotly.js has drawn it (without
  JavaScript, or without plotly.js, the image stays).
- `offline_html` converts a notebook with nbconvert and removes every resource it would fetch from the network
  (plotly.js and MathJax from their CDNs, require.js): the page loads plotly.js from ``plotly.min.js`` beside it,
  which `write_offline_html` writes once next to the pages.

Without a browser the notebook keeps its interactive figures only, and `add_static_figures` says so once.
[`share_notebook`][uds_lens.zoo.notebook_html.share_notebook] does both for a notebook of your own, in one call.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"
PNG_MIMETYPE = "image/png"
BROWSER_ENV = "UDS_LENS_BROWSER"
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
# The size a static figure is drawn at when its layout names none (Plotly's notebook default height is 525).
STATIC_WIDTH, STATIC_HEIGHT = 900, 525
RENDER_TIMEOUT_S = 300
# The name the offline pages load plotly.js from (written once beside them).
PLOTLY_JS = "plotly.min.js"
# A <script> that fetches from the network, with or without a body, and a stylesheet <link> that does.
REMOTE_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=[\"']https?://[^\"']*[\"'][^>]*>\s*</script>", re.IGNORECASE)
REMOTE_LINK = re.compile(r"<link\b[^>]*\bhref=[\"']https?://[^\"']*[\"'][^>]*>", re.IGNORECASE)
STATIC_MARK = "uds-lens-static-figure"


def find_browser() -> str | None:
    """A headless-capable Chrome or Chromium: ``$UDS_LENS_BROWSER``, else the first of `BROWSER_NAMES` on
    ``PATH``; None when there is none."""
    named = os.environ.get(BROWSER_ENV)
    if named:
        return shutil.which(named) or (named if Path(named).is_file() else None)
    for name in BROWSER_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def plotly_js_path() -> Path:
    """The installed plotly package's own plotly.min.js (the version its figures were written for)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def headless(browser: str, profile: str) -> list[str]:
    """A browser command that runs no network service of its own (updates, sync, metrics) and keeps no state."""
    return [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
    ]


def _render_page(figures: Sequence[dict[str, Any]]) -> str:
    """A page that draws each figure with the local plotly.js, turns it into a PNG and lists the PNGs (as data
    URLs, or an error text) in ``<pre id="out">`` for the browser's ``--dump-dom``."""
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><script src="{plotly_js_path().as_uri()}"></script></head>
<body><pre id="out"></pre><script>
const figures = {json.dumps(list(figures))};
(async () => {{
  const images = [];
  for (const figure of figures) {{
    const div = document.createElement("div");
    document.body.appendChild(div);
    const layout = Object.assign({{}}, figure.layout || {{}});
    layout.width = layout.width || {STATIC_WIDTH};
    layout.height = layout.height || {STATIC_HEIGHT};
    try {{
      await Plotly.newPlot(div, figure.data || [], layout, {{staticPlot: true}});
      images.push(await Plotly.toImage(div, {{format: "png", width: layout.width, height: layout.height}}));
    }} catch (err) {{
      images.push("error: " + err);
    }}
    Plotly.purge(div);
    div.remove();
  }}
  document.getElementById("out").textContent = JSON.stringify(images);
}})();
</script></body></html>"""


def render_pngs(figures: Sequence[dict[str, Any]], browser: str) -> list[bytes | None]:
    """Each Plotly figure (a figure dict: ``data``, ``layout``) as PNG bytes, drawn by one headless browser run;
    None for a figure plotly.js could not draw."""
    if not figures:
        return []
    with tempfile.TemporaryDirectory(prefix="uds_lens_figures_") as work:
        page = Path(work) / "figures.html"
        page.write_text(_render_page(figures), encoding="utf-8")
        command = [
            *headless(browser, str(Path(work) / "profile")),
            "--virtual-time-budget=120000",
            "--dump-dom",
            page.as_uri(),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=RENDER_TIMEOUT_S, check=False)
    found = re.search(r'<pre id="out">(.*?)</pre>', done.stdout, flags=re.DOTALL)
    if done.returncode != 0 or found is None or not found.group(1):
        raise RuntimeError(
            f"{browser} drew no figures (exit {done.returncode}): {done.stderr.strip()[-300:] or 'no output'}"
        )
    images: list[bytes | None] = []
    for url in json.loads(html.unescape(found.group(1))):
        prefix = "data:image/png;base64,"
        images.append(base64.b64decode(url[len(prefix) :]) if url.startswith(prefix) else None)
    return images


def _figure_outputs(notebook: Any) -> list[dict[str, Any]]:
    return [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if PLOTLY_MIMETYPE in output.get("data", {})
    ]


def with_static_image(figure_html: str, png: bytes) -> str:
    """A figure's ``text/html`` with its PNG beside it: the image shows until plotly.js has drawn the figure, and
    stays when it cannot (no JavaScript: the live figure's empty box is hidden instead)."""
    source = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return (
        f"<noscript><style>.{STATIC_MARK}-live{{display:none}}</style></noscript>"
        f'<div class="{STATIC_MARK}-live">{figure_html}</div>'
        f'<img class="{STATIC_MARK}" src="{source}" style="max-width:100%" '
        'alt="The figure as a static image (the interactive one needs JavaScript and plotly.js)">'
        "<script>(function (script) {"
        " if (!script) return;"
        " var image = script.previousElementSibling, live = image.previousElementSibling;"
        " if (window.Plotly) { image.style.display = 'none'; } else { live.style.display = 'none'; }"
        "})(document.currentScript);</script>"
    )


def add_static_figures(notebook: Any, browser: str | None = None) -> int:
    """Give every Plotly output of ``notebook`` a static PNG (in place; outputs that have one already are left
    alone). Returns how many it added; 0 with a warning when no browser is found.

    Raises:
        RuntimeError: the browser ran but drew nothing (its error is in the message).
    """
    outputs = [output for output in _figure_outputs(notebook) if PNG_MIMETYPE not in output["data"]]
    if not outputs:
        return 0
    browser = browser or find_browser()
    if browser is None:
        logger.warning(
            "no Chrome/Chromium found (set %s or install chromium): figures are kept without static images",
            BROWSER_ENV,
        )
        return 0
    pngs = render_pngs([output["data"][PLOTLY_MIMETYPE] for output in outputs], browser)
    added = 0
    for output, png in zip(outputs, pngs):
        if png is None:
            continue
        output["data"][PNG_MIMETYPE] = base64.b64encode(png).decode("ascii")
        if "text/html" in output["data"]:
            output["data"]["text/html"] = with_static_image(output["data"]["text/html"], png)
        added += 1
    return added


def has_static_figures(notebook: Any) -> bool:
    """Whether every Plotly output of ``notebook`` carries a static image."""
    return all(PNG_MIMETYPE in output["data"] for output in _figure_outputs(notebook))


def without_network(page: str) -> str:
    """``page`` with every script and stylesheet it would fetch from the network removed."""
    return REMOTE_LINK.sub("", REMOTE_SCRIPT.sub("", page))


def offline_html(notebook: Any, plotly_js: str = PLOTLY_JS) -> str:
    """The notebook as one HTML page (nbconvert's ``lab`` template) that fetches nothing from the network:
    plotly.js is loaded from ``plotly_js`` (a path relative to the page) before any figure is drawn."""
    from nbconvert import HTMLExporter

    page, _ = HTMLExporter(template_name="lab").from_notebook_node(notebook)
    page = without_network(page)
    loader = f'<script src="{html.escape(plotly_js)}"></script>'
    head = re.search(r"<head[^>]*>", page)
    if head is None:
        return loader + page
    return page[: head.end()] + loader + page[head.end() :]


PLOTLYJS_MARK = "uds-lens-plotlyjs"
"""The id of the script that carries plotly.js in a notebook (`keep_figures_in_notebooks`), for those that take it
out again (the docs' copies: the site ships plotly.js itself)."""


def plotlyjs_script() -> str:
    """plotly.js inline, in one ``<script id="uds-lens-plotlyjs">``: what a notebook carries to draw offline."""
    from plotly.offline import get_plotlyjs

    return (
        f'<script type="text/javascript" id="{PLOTLYJS_MARK}">window.PlotlyConfig = {{MathJaxConfig: "local"}};\n'
        f"{get_plotlyjs()}</script>"
    )


def without_embedded_plotlyjs(notebook: Any) -> int:
    """Remove the plotly.js a notebook carries (`plotlyjs_script`, as `plotting.export.keep_figures_in_notebooks`
    displays it; in place),
    for a copy shown where plotly.js is loaded otherwise (the docs' pages); returns how many outputs went."""
    removed = 0
    for cell in notebook.cells:
        if cell.cell_type != "code" or not cell.get("outputs"):
            continue
        kept = [
            output
            for output in cell.outputs
            if f'id="{PLOTLYJS_MARK}"' not in str(output.get("data", {}).get("text/html", ""))
        ]
        removed += len(cell.outputs) - len(kept)
        cell.outputs = kept
    return removed


def share_notebook(
    path: str | os.PathLike, out_dir: str | os.PathLike | None = None, browser: str | None = None
) -> tuple[Path, Path]:
    """Make an executed notebook of your own shareable, offline: ``NAME.shared.ipynb`` with a static PNG beside
    every Plotly figure (drawn by a local headless Chrome or Chromium: `add_static_figures`), for viewers that run
    no JavaScript, and ``NAME.html`` (`offline_html`: nothing fetched; plotly.js from ``plotly.min.js``, written
    beside it, where the notebook does not carry it already).

    Args:
        path: the executed notebook (run it with ``plotting.keep_figures_in_notebooks()`` in its first cell, as
            ``notebook_setup`` does, so its figures are stored as HTML too).
        out_dir: where to write the two (default: beside the notebook).
        browser: the Chrome/Chromium to draw with (default: `find_browser`).

    Returns:
        ``(shared notebook, HTML page)``.

    Raises:
        RuntimeError: no browser to draw the static images with (install chromium, or set ``UDS_LENS_BROWSER``).
    """
    import nbformat

    source = Path(path)
    target = Path(out_dir) if out_dir is not None else source.parent
    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError(
            f"{source.name}: no Chrome/Chromium to draw its figures as images with; install chromium or set "
            f"{BROWSER_ENV}"
        )
    notebook = nbformat.read(source, as_version=4)
    add_static_figures(notebook, browser)
    target.mkdir(parents=True, exist_ok=True)
    shared = target / f"{source.stem}.shared.ipynb"
    shared.write_text(nbformat.writes(notebook), encoding="utf-8")
    shutil.copyfile(plotly_js_path(), target / PLOTLY_JS)
    page = target / f"{source.stem}.html"
    page.write_text(offline_html(notebook), encoding="utf-8")
    return shared, page


def write_offline_html(notebooks: Sequence[Path], out_dir: Path) -> list[Path]:
    """Each executed notebook as ``out_dir/NAME.html`` (`offline_html`), plotly.js written once beside them."""
    import nbformat

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plotly_js_path(), out_dir / PLOTLY_JS)
    pages = []
    for path in notebooks:
        target = out_dir / f"{Path(path).stem}.html"
        target.write_text(offline_html(nbformat.read(path, as_version=4)), encoding="utf-8")
        pages.append(target)
    return pages


__all__ = [
    "BROWSER_ENV",
    "PLOTLY_JS",
    "PLOTLYJS_MARK",
    "add_static_figures",
    "find_browser",
    "has_static_figures",
    "offline_html",
    "plotly_js_path",
    "plotlyjs_script",
    "render_pngs",
    "share_notebook",
    "with_static_image",
    "without_embedded_plotlyjs",
    "without_network",
    "write_offline_html",
]

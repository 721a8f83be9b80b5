"""Figures out of the notebook: PNG/SVG/PDF through kaleido, or self-contained HTML that opens offline; and figures
that stay in a notebook when it is shared ([`keep_figures_in_notebooks`][uds_lens.plotting.export.keep_figures_in_notebooks])."""

from __future__ import annotations

import json
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp")

# The renderer a notebook's figures are shown with (keep_figures_in_notebooks): Plotly's own mimetype, which Jupyter
# renders live, and beside it the figure as HTML, which a notebook read without Plotly's extension shows.
HTML_RENDERER = "uds_lens_html"
NOTEBOOK_RENDERER = f"plotly_mimetype+{HTML_RENDERER}"


def save(
    fig: go.Figure, path: str | Path, width: int | None = None, height: int | None = None, scale: float = 2.0
) -> Path:
    """Write a figure to a file, out of the notebook.

    ``.png``/``.svg``/``.pdf`` (and ``.jpg``/``.webp``) go through kaleido (``pip install 'uds_lens[figures]'``;
    kaleido 1.x also needs a Chrome it can find); without kaleido, ``.png`` and ``.pdf`` through a local headless
    Chrome/Chromium when there is one (`write_figures`). Without either, or when rendering fails, the figure is
    written as self-contained HTML next to the requested name (``fig.png`` -> ``fig.html``, plotly.js inlined, opens
    offline) with a warning saying why. ``.html`` is always written that way.

    Returns:
        The path actually written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    suffix = target.suffix.lower()
    if suffix in (".html", ".htm"):
        fig.write_html(target, include_plotlyjs=True, full_html=True)
        return target
    if suffix not in IMAGE_SUFFIXES:
        raise ValueError(f"Cannot save a figure as {target.name!r}: use one of {IMAGE_SUFFIXES} or .html.")
    try:
        import kaleido  # noqa: F401
    except ImportError:
        reason = "kaleido is not installed (pip install 'uds_lens[figures]')"
        from uds_lens.zoo.notebook_html import find_browser

        if suffix in (".png", ".pdf") and find_browser() is not None:
            try:
                write_figures([(target.stem, fig)], target.parent, [suffix[1:]], width or 1000, height)
                return target
            except RuntimeError as err:
                reason += f", and the browser could not render it ({err})"
    else:
        try:
            fig.write_image(target, width=width, height=height, scale=scale)
            return target
        except Exception as err:  # kaleido without a usable browser, or an old plotly/kaleido pair
            reason = f"kaleido could not render it ({type(err).__name__}: {err})"
    fallback = target.with_suffix(".html")
    fig.write_html(fallback, include_plotlyjs=True, full_html=True)
    warnings.warn(
        f"{target} not written: {reason}. Wrote self-contained HTML to {fallback} instead.", stacklevel=2
    )
    return fallback


STATIC_FORMATS = ("png", "pdf", "svg")
"""The formats [`write_figures`][uds_lens.plotting.export.write_figures] writes."""
PDF_RENDER_TIMEOUT_S = 120


def _figure_dict(fig: go.Figure) -> dict[str, Any]:
    return json.loads(fig.to_json())


def _browser_pdf(fig: go.Figure, target: Path, browser: str, width: int, height: int) -> None:
    """One figure printed to a one-page PDF of its own size by a headless Chrome/Chromium (vector, as drawn)."""
    from uds_lens.zoo.notebook_html import headless, plotly_js_path

    page = f"""<!DOCTYPE html><html><head><meta charset="utf-8">
<style>@page {{ size: {width}px {height}px; margin: 0 }} body {{ margin: 0 }}</style>
<script src="{plotly_js_path().as_uri()}"></script></head><body><div id="figure"></div><script>
const figure = {json.dumps(_figure_dict(fig))};
const layout = Object.assign({{}}, figure.layout || {{}}, {{width: {width}, height: {height}}});
Plotly.newPlot("figure", figure.data || [], layout, {{staticPlot: true}});
</script></body></html>"""
    with tempfile.TemporaryDirectory(prefix="uds_lens_pdf_") as work:
        source = Path(work) / "figure.html"
        source.write_text(page, encoding="utf-8")
        command = [
            *headless(browser, str(Path(work) / "profile")),
            "--virtual-time-budget=20000",
            "--no-pdf-header-footer",
            f"--print-to-pdf={target}",
            source.as_uri(),
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PDF_RENDER_TIMEOUT_S, check=False
        )
    if done.returncode != 0 or not target.is_file():
        raise RuntimeError(f"{browser} printed no PDF of {target.name}: {done.stderr.strip()[-300:]}")


def static_renderer(formats: Sequence[str]) -> str:
    """What renders ``formats`` here: ``"kaleido"`` when it is installed, else the path of a local Chrome/Chromium.

    Raises:
        ConfigError: a format not in `STATIC_FORMATS`, or nothing here to render with (the message says what to
            install): ``uds-lens report --figures`` says so in one line, before it writes anything.
    """
    from uds_lens.config import ConfigError

    unknown = [form for form in formats if form not in STATIC_FORMATS]
    if unknown:
        raise ConfigError(f"cannot export figures as {', '.join(unknown)}: use {' / '.join(STATIC_FORMATS)}")
    try:
        import kaleido  # noqa: F401
    except ImportError:
        from uds_lens.zoo.notebook_html import find_browser

        browser = find_browser()
        if browser is None:
            raise ConfigError(
                "exporting figures needs kaleido (pip install 'uds_lens[figures]') or a local Chrome/Chromium "
                "(apt-get install chromium, or set UDS_LENS_BROWSER)"
            ) from None
        if "svg" in formats:
            raise ConfigError(
                "SVG export needs kaleido (pip install 'uds_lens[figures]'); a browser renders PNG and PDF"
            ) from None
        return browser
    return "kaleido"


def write_figures(
    figures: Sequence[tuple[str, go.Figure]],
    directory: str | Path,
    formats: Sequence[str] = ("png",),
    width: int = 1000,
    height: int | None = None,
) -> list[Path]:
    """Write each ``(name, figure)`` as ``directory/name.FORMAT`` for every format of ``formats`` (`STATIC_FORMATS`).

    Rendered by kaleido when it is installed (the ``figures`` extra), else by a local headless Chrome or Chromium
    (``$UDS_LENS_BROWSER`` or on ``PATH``, as the docs' static figures are: PNG through plotly.js's own
    ``toImage``, PDF printed as vector; SVG needs kaleido). Nothing is fetched from the network either way. A
    figure keeps its own height when it has one (``height`` otherwise, default 525 px).

    Returns:
        The paths written, figure by figure, in the order of ``formats``.

    Raises:
        ConfigError: a format not in `STATIC_FORMATS`, or nothing to render with (`static_renderer`).
        RuntimeError: the browser failed to draw a figure.
    """
    renderer = static_renderer(formats)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sized = [(name, fig, int(fig.layout.height or height or 525)) for name, fig in figures]
    written: list[Path] = []
    if renderer == "kaleido":
        for name, fig, fig_height in sized:
            for form in formats:
                target = out / f"{name}.{form}"
                fig.write_image(target, width=width, height=fig_height, scale=2 if form == "png" else 1)
                written.append(target)
        return written
    from uds_lens.zoo.notebook_html import render_pngs

    browser = renderer
    pngs: list[bytes | None] = []
    if "png" in formats:
        dicts = []
        for _, fig, fig_height in sized:
            spec = _figure_dict(fig)
            spec["layout"] = {**spec.get("layout", {}), "width": width, "height": fig_height}
            dicts.append(spec)
        pngs = render_pngs(dicts, browser)
    for position, (name, fig, fig_height) in enumerate(sized):
        for form in formats:
            target = out / f"{name}.{form}"
            if form == "png":
                png = pngs[position]
                if png is None:
                    raise RuntimeError(f"{browser} could not draw {name}")
                target.write_bytes(png)
            else:
                _browser_pdf(fig, target, browser, width, fig_height)
            written.append(target)
    return written


def keep_figures_in_notebooks(offline: bool = True) -> str:
    """Store every figure a notebook displays also as HTML, so that it survives sharing the notebook, offline too.

    Plotly's default in a Jupyter kernel stores a figure only as ``application/vnd.plotly.v1+json``, which only a
    front end with Plotly's extension draws: ``jupyter nbconvert --to html`` and documentation builds show nothing.
    After this call each displayed figure carries that mimetype (Jupyter still renders it live) and a
    ``text/html`` one: the figure's ``div`` and data, drawn by plotly.js.

    Args:
        offline: where that plotly.js comes from. True (the default): from the notebook itself: this call, made in
            a notebook, displays plotly.js once (4.8 MB, in the calling cell's output), and every figure after it
            draws with it, so the saved notebook and the HTML nbconvert makes of it show their figures with no
            network. False: each figure loads plotly.js from its CDN (a few kB a figure; blank offline). A static
            image beside each figure, for viewers that run no JavaScript at all, is
            [`share_notebook`][uds_lens.zoo.notebook_html.share_notebook]'s.

    ``uds_lens.zoo.notebook.notebook_setup`` calls it; call it in the first cell of a notebook of your own.

    Returns:
        The default renderer now in force (``NOTEBOOK_RENDERER``).
    """
    import plotly.io as pio
    from plotly.io.base_renderers import HtmlRenderer

    from uds_lens.zoo.notebook_html import plotlyjs_script

    pio.renderers[HTML_RENDERER] = HtmlRenderer(connected=not offline, include_plotlyjs=False)
    pio.renderers.default = NOTEBOOK_RENDERER
    if offline:
        try:
            from IPython import get_ipython
            from IPython.display import HTML, display
        except ImportError:  # not in IPython: no notebook to put plotly.js in
            return NOTEBOOK_RENDERER
        if get_ipython() is not None:
            display(HTML(plotlyjs_script()))
    return NOTEBOOK_RENDERER

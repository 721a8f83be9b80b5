"""Figures out of the notebook: PNG/SVG/PDF through kaleido, or self-contained HTML that opens offline; and figures
that stay in a notebook when it is shared ([`keep_figures_in_notebooks`][uds_lens.plotting.export.keep_figures_in_notebooks])."""

from __future__ import annotations

import warnings
from pathlib import Path

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
    kaleido 1.x also needs a Chrome it can find). Without it, or when it fails, the figure is written as
    self-contained HTML next to the requested name (``fig.png`` -> ``fig.html``, plotly.js inlined, opens offline)
    with a warning saying why. ``.html`` is always written that way.

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


def keep_figures_in_notebooks() -> str:
    """Store every figure a notebook displays also as HTML, so that it survives sharing the notebook.

    Plotly's default in a Jupyter kernel stores a figure only as ``application/vnd.plotly.v1+json``, which only a
    front end with Plotly's extension draws: ``jupyter nbconvert --to html`` and documentation builds show nothing.
    After this call each displayed figure carries that mimetype (Jupyter still renders it live) and a
    ``text/html`` one: the figure's ``div`` and data, drawn by plotly.js from its CDN (a few kB per figure rather
    than plotly.js's 4 MB). ``uds_lens.zoo.notebook.notebook_setup`` calls it; call it in a notebook of your own.

    Returns:
        The default renderer now in force (``NOTEBOOK_RENDERER``).
    """
    import plotly.io as pio
    from plotly.io.base_renderers import HtmlRenderer

    if HTML_RENDERER not in pio.renderers:
        pio.renderers[HTML_RENDERER] = HtmlRenderer(connected=True)
    pio.renderers.default = NOTEBOOK_RENDERER
    return NOTEBOOK_RENDERER

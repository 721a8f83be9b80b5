"""Figures out of the notebook: PNG/SVG/PDF through kaleido, or self-contained HTML that opens offline."""

from __future__ import annotations

import warnings
from pathlib import Path

import plotly.graph_objects as go

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp")


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

"""Published figures: our UDS next to the published one."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from uds_lens.files import write_atomic


def add_published_comparison(table: pd.DataFrame) -> pd.DataFrame:
    """``published_uds`` (NaN where the registry has none) and ``uds_minus_published`` = ours - published."""
    frame = table.copy()
    if "published_uds" not in frame:
        frame["published_uds"] = math.nan
    frame["uds_minus_published"] = pd.to_numeric(frame["uds"], errors="coerce") - pd.to_numeric(
        frame["published_uds"], errors="coerce"
    )
    return frame


def write_published_scatter(table: pd.DataFrame, path: Path) -> Path:
    """Draw our UDS against the published one (``plotting.published_scatter``, one point per model of ``table``
    with both) into a self-contained HTML file at ``path``, replaced in one step (``files.write_atomic``);
    returns ``path``."""
    from uds_lens.plotting.meta_eval import published_scatter

    html = published_scatter(table).to_html(include_plotlyjs=True)
    return write_atomic(path, html.encode("utf-8"))  # UTF-8, as plotly's write_html writes it

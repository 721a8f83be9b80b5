"""Published figures: our UDS next to the published one."""

from __future__ import annotations

import math

import pandas as pd


def add_published_comparison(table: pd.DataFrame) -> pd.DataFrame:
    """``published_uds`` (NaN where the registry has none) and ``uds_minus_published`` = ours - published."""
    frame = table.copy()
    if "published_uds" not in frame:
        frame["published_uds"] = math.nan
    frame["uds_minus_published"] = pd.to_numeric(frame["uds"], errors="coerce") - pd.to_numeric(
        frame["published_uds"], errors="coerce"
    )
    return frame

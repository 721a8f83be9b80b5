"""Compare two output directories of ``uds-lens score`` / ``uds-lens demo`` number by number.

A refactor that should change nothing is checked by running the same command on the old and the new code into two
directories and comparing them here: the table's UDS and confidence bounds, every model's per-layer scores and deltas,
and every example's UDS. Timing columns are left out. Prints the largest absolute difference per file kind and exits
1 when a model, a row or a non-numeric value (status, KE mask, skip reason) differs, or when a difference exceeds
``--atol``.

Example:
    python experiments/compare_runs.py before_out/test after_out/test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

TIMING = ("seconds",)


def _numeric_diff(old: pd.DataFrame, new: pd.DataFrame, where: str, problems: list[str]) -> float:
    if list(old.columns) != list(new.columns):
        problems.append(f"{where}: columns differ ({list(old.columns)} vs {list(new.columns)})")
        return float("nan")
    if len(old) != len(new):
        problems.append(f"{where}: {len(old)} rows before, {len(new)} after")
        return float("nan")
    worst = 0.0
    for column in old.columns:
        if any(column.endswith(suffix) for suffix in TIMING):
            continue
        a, b = old[column], new[column]
        if pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b) and a.dtype != bool:
            x, y = a.to_numpy(dtype=float), b.to_numpy(dtype=float)
            if not np.array_equal(np.isnan(x), np.isnan(y)):
                problems.append(f"{where}: NaNs differ in {column}")
                continue
            finite = ~np.isnan(x)
            if finite.any():
                worst = max(worst, float(np.max(np.abs(x[finite] - y[finite]))))
        elif not a.astype(str).equals(b.astype(str)):
            problems.append(f"{where}: {column} differs")
    return worst


def compare(before: Path, after: Path, atol: float) -> int:
    problems: list[str] = []
    worst: dict[str, float] = {}
    for name in ("uds_table.csv",):
        if (before / name).is_file():
            worst[name] = _numeric_diff(pd.read_csv(before / name), pd.read_csv(after / name), name, problems)
    models = sorted(p.name for p in before.iterdir() if (p / "layers.csv").is_file())
    missing = [m for m in models if not (after / m / "layers.csv").is_file()]
    if missing:
        problems.append(f"models missing after: {missing}")
    for kind in ("layers.csv", "examples.csv"):
        worst[kind] = 0.0
        for model in models:
            if model in missing:
                continue
            old, new = pd.read_csv(before / model / kind), pd.read_csv(after / model / kind)
            worst[kind] = max(worst[kind], _numeric_diff(old, new, f"{model}/{kind}", problems))
    print(f"{len(models)} models compared")
    for kind, value in worst.items():
        print(f"  max |after - before| in {kind}: {value:.3g}")
        if value > atol:
            problems.append(f"{kind}: {value:.3g} > atol {atol:g}")
    for problem in problems:
        print(f"  DIFFERS: {problem}")
    return 1 if problems else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument(
        "--atol", type=float, default=0.0, help="largest difference accepted (default 0: identical)"
    )
    args = parser.parse_args()
    sys.exit(compare(args.before, args.after, args.atol))


if __name__ == "__main__":
    main()

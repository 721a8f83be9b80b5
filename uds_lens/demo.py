"""The main job on the embedded default: build (or reuse) the zoo, score every model with UDS, write a report.

``uds-lens demo`` (and ``make demo``) is ``run_demo()``: S1 (zoo ``retain`` -> ``full``) is computed once and every
zoo model, full and retain included as sanity anchors, is scored against it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from uds_lens.config import UDSConfig
from uds_lens.files import write_atomic, zoo_root
from uds_lens.outputs import check_outputs_apart, check_report_output, check_writable_dir
from uds_lens.plotting.report import write_report
from uds_lens.result_store import OutputConflictError
from uds_lens.scoring import score_models
from uds_lens.zoo.build import build_zoo
from uds_lens.zoo.layout import Zoo, load_zoo
from uds_lens.zoo.manifest import MANIFEST_FILE

logger = logging.getLogger(__name__)

DEMO_ROLES = ("full", "retain", "partial", "unlearned")


def default_zoo_dir(size: str) -> Path:
    """Where the demo builds or finds the zoo of ``size``: ``files.zoo_root`` (``$UDS_LENS_ZOO``, or
    ``<cache root>/zoo-<size>`` under ``$UDS_LENS_CACHE``)."""
    return zoo_root(size)


def _has_pools(zoo_dir: Path) -> bool:
    """Whether a built zoo lists meta-evaluation pools (the demo keeps them listed; it does not need them)."""
    return (zoo_dir / MANIFEST_FILE).is_file() and load_zoo(zoo_dir).has_pools


def preview_zoo(size: str, zoo_dir: str | os.PathLike | None) -> Path | None:
    """The test-size zoo to score first when the requested zoo has never been built (None otherwise).

    Building the default zoo takes minutes (7-8 on a 2-core CPU before anything is scored); the test-size zoo
    trains in about a minute and a half and is often cached already (the test suite builds it), so the demo
    shows a first scored table from it while the default zoo trains.
    """
    if size == "test" or os.environ.get("UDS_LENS_ZOO"):  # one zoo directory named for every size: no preview
        return None
    root = Path(zoo_dir) if zoo_dir is not None else default_zoo_dir(size)
    if (root / MANIFEST_FILE).is_file():
        return None
    return default_zoo_dir("test")


def score_zoo(
    zoo: Zoo, out: Path, config: UDSConfig | None, progress: bool
) -> tuple[pd.DataFrame, list, dict]:
    """Score the zoo's demo models (``DEMO_ROLES``) into ``out``: the summary table, their manifest entries and the
    ``UDSResult`` of each, by name."""
    entries = [m for m in zoo.models if m["role"] in DEMO_ROLES]

    def score(force: bool) -> dict:
        return score_models(
            zoo.path("full"),
            zoo.path("retain"),
            {m["name"]: zoo.path(m["name"]) for m in entries},
            zoo.forget_path,
            out_dir=out,
            config=config or UDSConfig(),
            cache_dir=out / ".s1_cache",
            progress=progress,
            force=force,
        )

    try:
        results = score(force=False)
    except OutputConflictError as conflict:
        # the demo's directory holds an earlier demo's results of a zoo that has been rebuilt since: they are this
        # command's own scratch output, replaced with a warning rather than refused
        logger.warning("the zoo changed since the last demo in %s; scoring it again (%s)", out, conflict)
        results = score(force=True)
    rows = []
    for entry in entries:
        summary = results[entry["name"]].summary
        rows.append(
            {
                "model": entry["name"],
                "role": entry["role"],
                "seen_forget_fraction": entry.get("seen_forget_fraction"),
                "method": entry.get("method"),
                "uds": summary["uds"],
                "ci_low": summary["ci95"][0],
                "ci_high": summary["ci95"][1],
                "uds_unclipped": summary["uds_unclipped"],
                "uds_clipped": summary["uds_clipped"],
                "uds_clipped_share": summary["uds_clipped_share"],
                "excess_disruption": summary["excess_disruption"],
                **{
                    f"{key}_ci_{end}": bound
                    for key, bounds in summary["split_ci95"].items()
                    for end, bound in zip(("low", "high"), bounds, strict=True)
                },
                "n_scored": summary["n_scored"],
                "n_no_ke": summary["n_no_ke"],
                "n_skipped": summary["n_skipped"],
                "s2_seconds": summary["timings"].get("s2_seconds"),
            }
        )
    return pd.DataFrame(rows), entries, results


def run_demo(
    out_dir: str | os.PathLike = "demo_out",
    zoo_dir: str | os.PathLike | None = None,
    size: str = "default",
    threads: int = 2,
    config: UDSConfig | None = None,
    progress: bool = True,
    on_preview: Callable[[pd.DataFrame, Path], None] | None = None,
) -> pd.DataFrame:
    """Build or reuse the zoo, score its models, write ``out_dir/NAME/*``, ``roles.json`` and ``report.html``.

    When the requested zoo has never been built and ``on_preview`` is given, the test-size zoo is built (or reused)
    and scored first, into ``out_dir/preview/``, and ``on_preview(table, zoo_root)`` is called with its table, so a
    first scored table appears within a few minutes; the full run follows.

    Returns the table ``model, role, seen_forget_fraction, method, uds, ci_low, ci_high, uds_unclipped, uds_clipped,
    uds_clipped_share, excess_disruption``, their CI bounds (``uds_unclipped_ci_low`` ...), ``n_scored, n_no_ke,
    n_skipped, s2_seconds`` (also written to
    ``out_dir/uds_table.csv``; ``uds_clipped`` is the part of UDS from clipped cells, ``uds_clipped_share`` its share
    of UDS, ``excess_disruption`` how far past retain the model disrupts: ``UDSResult.split``).
    """
    started = time.perf_counter()
    out = Path(out_dir)
    root = Path(zoo_dir) if zoo_dir is not None else default_zoo_dir(size)
    preview_root = preview_zoo(size, zoo_dir) if on_preview is not None else None
    # before anything is built: results never go into a zoo (the models it scores), nor a zoo into them
    check_outputs_apart({"--out": out}, {"zoo": root, "test-size zoo": preview_root})
    check_writable_dir(out)
    check_report_output(out / "report.html", option="the demo's report")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if preview_root is not None:
            # One thread, as the test suite builds it: the cache is shared rather than rebuilt (threads are part of
            # a zoo model's fingerprint), and on a busy small CPU one thread trains this zoo many times faster.
            preview = build_zoo(
                preview_root,
                size="test",
                threads=1,
                pools=_has_pools(preview_root),
                progress=progress,
                overwrite=True,
            )
            table, _, _ = score_zoo(preview, out / "preview", config, progress)
            (out / "preview").mkdir(parents=True, exist_ok=True)
            write_atomic(out / "preview" / "uds_table.csv", table.to_csv(index=False))
            logger.info("preview on the test-size zoo after %.1f s", time.perf_counter() - started)
            on_preview(table, preview_root)
        # the package's own cache is rebuilt when this version generates another world; a user's directory is not
        zoo = build_zoo(
            root,
            size=size,
            threads=threads,
            pools=_has_pools(root),
            progress=progress,
            overwrite=zoo_dir is None,
        )
        table, entries, _ = score_zoo(zoo, out, config, progress)
    finally:
        torch.set_num_threads(previous_threads)
    write_atomic(out / "roles.json", json.dumps({m["name"]: m["role"] for m in entries}, indent=2))
    write_atomic(out / "uds_table.csv", table.to_csv(index=False))
    write_report(out, out / "report.html", title=f"UDS on the embedded zoo ({size})")
    logger.info("demo finished in %.1f s", time.perf_counter() - started)
    return table


__all__ = ["DEMO_ROLES", "default_zoo_dir", "preview_zoo", "run_demo", "score_zoo"]

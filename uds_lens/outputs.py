"""Where a command writes, checked before anything is read or loaded: a path it can write, over nothing it does not
own, and inputs it needs all there.

A command that finds out at its end that it cannot write its output has wasted its compute; one that writes over a
file it did not produce (its own input, another tool's notes) has lost data. So the file outputs of ``report`` and
``annotate`` are checked first (`check_file_output`, `check_annotation_output`), and so is a zoo that
``evaluate`` and ``meta-eval`` read model by model (`check_zoo_complete`): each failure is one
[`ConfigError`][uds_lens.config.ConfigError] line naming the path and the fix. (Result directories have their own rules in
`uds_lens.result_store`.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from uds_lens.config import ConfigError

# The keys every summary annotate writes holds: a file with them may be replaced by a new summary.
ANNOTATION_SUMMARY_KEYS = ("mode", "n_records", "counts")


def check_file_output(option: str, path: str | os.PathLike, example: str = "report.html") -> None:
    """A file output that can be written: not a directory, and not under a file. ``option`` names it in the
    message, ``example`` is the file name a directory is told to take."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"{option} {path} is a directory: pass a file name (e.g. {target / example}).")
    blocking = next((parent for parent in target.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(
            f"{option} {path} lies under {blocking}, which is a file: pass a path in a directory."
        )


def _is_annotation_summary(path: Path) -> bool:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and all(key in content for key in ANNOTATION_SUMMARY_KEYS)


def check_annotation_output(out: str | os.PathLike, summary: str | os.PathLike, data: Any = None) -> None:
    """Refuse an ``annotate`` output it could not write or would write over what it does not own: ``out`` a
    directory or under a file, the ``data`` input as ``out`` or as the ``summary`` written beside it, or a
    ``summary`` path holding a file that is not an earlier annotate summary.

    Raises:
        ConfigError: naming the path and the fix.
    """
    check_file_output("--out", out, "annotated.json")
    path, summary = Path(out).expanduser(), Path(summary).expanduser()
    if isinstance(data, (str, os.PathLike)) and Path(data).expanduser().exists():
        source = Path(data).expanduser().resolve()
        for written in (path, summary):
            if written.resolve() == source:
                raise ConfigError(
                    f"annotate would write {written} over its input --data {data}: pass another --out, so the "
                    "input records are kept."
                )
    if summary.is_dir() or (summary.exists() and not _is_annotation_summary(summary)):
        raise ConfigError(
            f"annotate writes its summary to {summary}, which holds something else (not an earlier annotate "
            "summary): move it, or pass another --out."
        )


def check_zoo_complete(zoo: str | os.PathLike) -> None:
    """``zoo`` has a manifest and every model it lists is there: a missing directory is named before any model
    loads, never looked up on the hub."""
    from uds_lens.zoo.manifest import MANIFEST_FILE, model_paths

    root = Path(zoo).expanduser()
    if not (root / MANIFEST_FILE).is_file():
        raise ConfigError(
            f"--zoo {zoo} has no {MANIFEST_FILE}: build a zoo with `uds-lens zoo build --out {zoo}`."
        )
    missing = {name: root / path for name, path in model_paths(root).items() if not (root / path).is_dir()}
    if missing:
        raise ConfigError(
            f"--zoo {zoo} lists models whose directories are missing: "
            + ", ".join(f"{name} ({path})" for name, path in missing.items())
            + f"; rebuild them with `uds-lens zoo build --out {zoo}` (valid models are reused)."
        )


__all__ = ["ANNOTATION_SUMMARY_KEYS", "check_annotation_output", "check_file_output", "check_zoo_complete"]

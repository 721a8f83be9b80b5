"""Reading a zoo's ``manifest.json``: the one reader of that file, with nothing but the standard library.

`uds_lens.zoo.layout` (``load_zoo``), ``zoo:NAME`` resolution in `uds_lens.checkpoints.checkpoint` and the builder's
refusal to replace another zoo all read manifests here. It imports nothing of ours, so the loader's floor can read a
manifest without reaching the zoo's ``Zoo.model`` (which loads models) or its training code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` of a zoo directory, or None when it has none."""
    manifest_path = Path(directory) / MANIFEST_FILE
    if not manifest_path.is_file():
        return None
    return json.loads(manifest_path.read_text())


def model_paths(directory: str | os.PathLike) -> dict[str, str]:
    """``{model name: path as the manifest writes it}`` of a zoo directory (empty when it has no manifest)."""
    manifest = read_manifest(directory) or {}
    return {m["name"]: m["path"] for m in manifest.get("models", [])}


def data_file(manifest: dict[str, Any], root: str | os.PathLike, split: str) -> Path | None:
    """The QA file of ``split`` (``forget``, ``holdout`` or ``retain``) a zoo's manifest names, or None."""
    data = manifest.get("data", {})
    for key in (split, f"{split}_path", f"{split}_file"):
        if key in data:
            return Path(root) / data[key]  # an absolute entry stays absolute
    return None


__all__ = ["MANIFEST_FILE", "data_file", "model_paths", "read_manifest"]

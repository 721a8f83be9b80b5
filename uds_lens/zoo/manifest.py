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


class ManifestError(ValueError):
    """A zoo's ``manifest.json`` cannot be read (not JSON, not an object, models without a name or path): one line
    naming the file and the fix."""


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` of a zoo directory, or None when it has none.

    Raises:
        ManifestError: the file is unreadable, not JSON, or not a JSON object.
    """
    manifest_path = Path(directory) / MANIFEST_FILE
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise _broken(manifest_path, f"{type(error).__name__}: {error}") from None
    if not isinstance(manifest, dict):
        raise _broken(manifest_path, "it is not a JSON object")
    return manifest


def _broken(path: Path, why: str) -> ManifestError:
    return ManifestError(
        f"The zoo manifest {path} is unreadable ({why}): rebuild the zoo (`uds-lens zoo build --out {path.parent}`), "
        "or restore the file."
    )


def model_paths(directory: str | os.PathLike) -> dict[str, str]:
    """``{model name: path as the manifest writes it}`` of a zoo directory (empty when it has no manifest).

    Raises:
        ManifestError: the manifest is unreadable, or lists a model without a name or a path.
    """
    manifest = read_manifest(directory) or {}
    models = manifest.get("models", [])
    if not isinstance(models, list) or not all(
        isinstance(m, dict) and isinstance(m.get("name"), str) and isinstance(m.get("path"), str)
        for m in models
    ):
        raise _broken(Path(directory) / MANIFEST_FILE, "its models are not a list of {name, path} entries")
    return {m["name"]: m["path"] for m in models}


def data_file(manifest: dict[str, Any], root: str | os.PathLike, split: str) -> Path | None:
    """The QA file of ``split`` (``forget``, ``holdout`` or ``retain``) a zoo's manifest names, or None."""
    data = manifest.get("data", {})
    for key in (split, f"{split}_path", f"{split}_file"):
        if key in data:
            return Path(root) / data[key]  # an absolute entry stays absolute
    return None


__all__ = ["MANIFEST_FILE", "ManifestError", "data_file", "model_paths", "read_manifest"]

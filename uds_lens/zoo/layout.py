"""The zoo manifest: what a zoo directory holds, read in one place.

A zoo is a directory with a ``manifest.json``::

    {"models": [{"name": "npo", "path": "models/npo", "role": "unlearned", ...}, ...],
     "data": {"forget": "data/forget.json", "holdout": "data/holdout.json", "retain": "data/retain.json", ...},
     "tokenizer": "tokenizer", "relearn": {"lr": 0.002}, "checks": {...}, ...}

[`uds_lens.zoo.build_zoo`][uds_lens.zoo.build_zoo] writes it with every build detail; a hand-written one (the models of a paper-scale
meta-evaluation, say) needs only ``models`` and ``data``. Model paths are zoo-relative; a path that is absolute, or
that exists nowhere under the zoo, is kept as written (a hub id). A data entry may also be spelled ``forget_path`` or
``forget_file``. Roles: ``base``, ``full``, ``retain``, ``partial``, ``unlearned``, ``sweep`` and the
meta-evaluation's P and N pools, ``pos`` (fine-tuned *with* the forget set) and ``neg`` (never saw it).

`read_manifest` is the one reader of that file (re-exported here with ``model_paths``
and ``MANIFEST_FILE``); this module adds the `Zoo` view of it (the model loader is imported only when
`Zoo.model` is called).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uds_lens.zoo_manifest import MANIFEST_FILE, data_file, read_manifest
from uds_lens.zoo_manifest import model_paths as model_paths  # re-exported: the reader lives in manifest.py

if TYPE_CHECKING:
    import torch

    from uds_lens.tl_compat import TransformerBridge

POSITIVE_POOL = "pos"
NEGATIVE_POOL = "neg"
POOL_ROLES = (POSITIVE_POOL, NEGATIVE_POOL)


@dataclass(frozen=True)
class Zoo:
    """A zoo directory and its manifest."""

    root: Path
    manifest: dict[str, Any]

    @property
    def models(self) -> list[dict[str, Any]]:
        """Manifest entries with ``path`` resolved (a `Path`, or the hub id as written)."""
        return [{**entry, "path": self._resolve(entry["path"])} for entry in self.manifest["models"]]

    def _resolve(self, path: str) -> Path | str:
        local = self.root / path  # an absolute path stays itself
        return local if local.exists() or Path(path).is_absolute() else path

    def names(self, role: str | Sequence[str] | None = None) -> list[str]:
        """Model names in manifest (build) order, optionally only those with one role or any of several."""
        wanted = (role,) if isinstance(role, str) else role
        return [
            entry["name"]
            for entry in self.manifest["models"]
            if wanted is None or entry.get("role") in wanted
        ]

    def info(self, name: str) -> dict[str, Any]:
        """The manifest entry of one model (``path`` resolved)."""
        for entry in self.models:
            if entry["name"] == name:
                return entry
        raise KeyError(f"zoo at {self.root} has no model {name!r}; it has {self.names()}")

    def path(self, name: str) -> Path | str:
        """Directory of one model (a Hugging Face checkpoint with its tokenizer), or its hub id."""
        return self.info(name)["path"]

    def role(self, name: str) -> str:
        return str(self.info(name).get("role"))

    def model(
        self, name: str, dtype: str | torch.dtype | None = None, device: str | None = None
    ) -> TransformerBridge:
        """One zoo model loaded as a ``TransformerBridge`` (``uds_lens.load_model`` on its path)."""
        from uds_lens.checkpoints.loader import load_model

        return load_model(self.path(name), dtype=dtype, device=device)

    @property
    def has_pools(self) -> bool:
        """Whether the zoo lists meta-evaluation models (P/N pools or an unlearning sweep)."""
        return bool(self.names((*POOL_ROLES, "sweep")))

    def data_path(self, split: str) -> Path:
        """The QA file of ``split`` (``forget``, ``holdout`` or ``retain``)."""
        path = data_file(self.manifest, self.root, split)
        if path is None:
            raise ValueError(
                f"the zoo manifest in {self.root} names no {split!r} data file "
                f"(keys: {sorted(self.manifest.get('data', {}))})"
            )
        return path

    @property
    def forget_path(self) -> Path:
        return self.data_path("forget")

    @property
    def retain_path(self) -> Path:
        return self.data_path("retain")

    @property
    def holdout_path(self) -> Path:
        return self.data_path("holdout")

    @property
    def relearn(self) -> dict[str, Any]:
        """The zoo's own relearning-attack settings (``meta_eval.relearn`` keyword arguments; empty: the published)."""
        return dict(self.manifest.get("relearn", {}))

    @property
    def tokenizer_path(self) -> Path:
        """The zoo's tokenizer directory (the same files are in every model directory)."""
        return self.root / self.manifest["tokenizer"]

    @property
    def checks(self) -> dict[str, Any]:
        """The build checks (full knows the forget set, retain does not)."""
        return self.manifest["checks"]

    @property
    def build_seconds(self) -> float:
        """Wall time of the last [`build_zoo`][uds_lens.zoo.build_zoo] call on this directory (small when everything was reused)."""
        return float(self.manifest["build_seconds"])


def load_zoo(directory: str | os.PathLike) -> Zoo:
    """Open a zoo directory.

    Raises:
        FileNotFoundError: No ``manifest.json`` there (build it with ``build_zoo`` / ``uds-lens zoo build``).
    """
    root = Path(directory)
    manifest = read_manifest(root)
    if manifest is None:
        raise FileNotFoundError(
            f"{root / MANIFEST_FILE} not found: {root} is not a built zoo. Build it with "
            f"uds_lens.zoo.build_zoo({str(root)!r}) or `uds-lens zoo build --out {root}`."
        )
    return Zoo(root=root, manifest=manifest)

"""Files on the ground floor: where caches live, how a file is replaced in one step, how JSON is digested.

Every module that writes a file a reader may see half-written goes through :func:`write_atomic`; every digest of a
JSON-able value is :func:`json_digest`; every default location under the cache is :func:`cache_root` (read at call
time, so ``UDS_LENS_CACHE`` set in a notebook after import still counts).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``$UDS_LENS_CACHE``, or ``~/.cache/uds_lens``: the S1 cache, converted checkpoints and the zoos live here."""
    return Path(os.environ.get("UDS_LENS_CACHE", "~/.cache/uds_lens")).expanduser()


def zoo_root(size: str) -> Path:
    """``$UDS_LENS_ZOO`` (one directory named for every size), or ``<cache_root>/zoo-<size>``."""
    named = os.environ.get("UDS_LENS_ZOO")
    return Path(named).expanduser() if named else cache_root() / f"zoo-{size}"


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Replace ``path`` with ``data`` in one step: a reader sees the old file or the new one, never a part.

    The bytes go to a hidden sibling (same filesystem, a name unique to this writer) that is then renamed over
    ``path``; if writing fails the sibling is removed and ``path`` is left as it was.
    """
    path = Path(path)
    staging = staging_path(path)
    try:
        if isinstance(data, bytes):
            staging.write_bytes(data)
        else:
            staging.write_text(data)
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return path


def staging_path(path: str | os.PathLike) -> Path:
    """A hidden sibling of ``path`` for writers that produce the file themselves (``safetensors.save_file``); rename
    it over ``path`` with ``os.replace`` when done."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def json_digest(obj: Any, length: int | None = None) -> str:
    """SHA-256 of ``obj`` as canonical JSON (sorted keys, ``str`` for what JSON cannot hold), optionally cut to
    ``length`` hex digits. Equal values give equal digests in every process and on every machine."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    return digest if length is None else digest[:length]


__all__ = ["cache_root", "json_digest", "staging_path", "write_atomic", "zoo_root"]

"""Files on the ground floor: where caches live, how a file is replaced in one step, how contents are digested.

Every module that writes a file a reader may see half-written goes through `write_atomic` (a directory
through `replace_directory`); every digest of a JSON-able value is `json_digest`, of bytes
`bytes_digest`, of a few small files `files_digest`; every default location under the cache is
`cache_root` (read at call time, so ``UDS_LENS_CACHE`` set in a notebook after import still counts).

Two digests of file contents, each for its files. Weights are identified by ``checkpoints.digests``: XXH3-128,
because checkpoints are gigabytes and a sweep's pace is set by reading and hashing them (XXH3 hashes several GB/s
per core, SHA-256 about 0.6), computed in the read that loads them and remembered by file identity, its scheme and
version in the string. Everything
else is SHA-256 here: a saved result's files (``meta.json`` records them), the zoo's data and tokenizer files, a
notebook's source. Those are kilobytes to megabytes, so speed does not matter, and SHA-256 is the digest anyone can
check with ``sha256sum``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``$UDS_LENS_CACHE``, or ``~/.cache/uds_lens``: the S1 cache, converted checkpoints and the zoos live here."""
    return Path(os.environ.get("UDS_LENS_CACHE", "~/.cache/uds_lens")).expanduser()


def zoo_root(size: str) -> Path:
    """``$UDS_LENS_ZOO`` (one directory named for every size), or ``<cache_root>/zoo-<size>``."""
    named = os.environ.get("UDS_LENS_ZOO")
    return Path(named).expanduser() if named else cache_root() / f"zoo-{size}"


# How a built zoo's model or data file is named wherever a checkpoint or a forget set is expected: "zoo:npo",
# "zoo:forget", "zoo:test/npo".
ZOO_PREFIX = "zoo:"


def zoo_search_roots(size: str | None = None) -> list[Path]:
    """Where a ``zoo:NAME`` is looked up, in order: ``$UDS_LENS_ZOO``, then the cached ``zoo-default`` and
    ``zoo-test`` under `cache_root`; with a ``size`` (``zoo:SIZE/NAME``), ``<cache_root>/zoo-<size>`` alone."""
    if size:
        return [cache_root() / f"zoo-{size}"]
    named = [Path(p).expanduser() for p in [os.environ.get("UDS_LENS_ZOO")] if p]
    return named + [cache_root() / "zoo-default", cache_root() / "zoo-test"]


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
    except BaseException as error:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            staging.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None:
            error.filename = str(path)  # a full disk fails write() with no path: the message names this one
        raise
    return path


def staging_path(path: str | os.PathLike) -> Path:
    """A hidden sibling of ``path`` for writers that produce the file themselves (``safetensors.save_file``); rename
    it over ``path`` with ``os.replace`` when done."""
    path = Path(path)
    return path.with_name(f"{_staging_prefix(path)}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _staging_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def _aside_prefix(path: Path) -> str:
    return f".{path.name}.old-"


def staged_siblings(path: str | os.PathLike) -> list[Path]:
    """The `staging_path` siblings of ``path`` that exist (a writer's unfinished or abandoned output), by name."""
    return _siblings(Path(path), _staging_prefix(Path(path)))


def set_aside(target: str | os.PathLike) -> list[Path]:
    """The old directories `replace_directory` renamed aside for ``target`` and did not delete (a kill
    between its renames, or after them before the delete), by name."""
    return _siblings(Path(target), _aside_prefix(Path(target)))


def _siblings(path: Path, prefix: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return sorted(entry for entry in path.parent.iterdir() if entry.name.startswith(prefix))


def replace_directory(staging: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Put the finished directory ``staging`` in ``target``'s place so that a complete directory exists at every moment.

    A directory cannot be renamed over one that has files, so an existing ``target`` is renamed aside (a hidden
    sibling, ``.NAME.old-XXXXXXXXXXXX``), ``staging`` renamed to ``target``, and only then the old one deleted.
    Should the second rename fail, the old directory is renamed back: ``target`` is the old directory or the new
    one. A process killed between the two renames (two system calls) leaves no ``target`` but both complete
    directories, the old one aside and the new one at ``staging``; a writer that marks ``staging`` complete (its
    last file) can find it there and rename it in (``meta_eval.attacks.relearn`` does). ``staging`` and ``target``
    must be on one filesystem (siblings are).
    """
    staging, target = Path(staging), Path(target)
    if not os.path.lexists(target):
        os.rename(staging, target)
        return target
    aside = target.with_name(f"{_aside_prefix(target)}{uuid.uuid4().hex[:12]}")
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return target


# What to do about an operating-system error, by its errno: the second half of its one-line message.
_OS_ERROR_FIXES = {
    errno.EACCES: "check its permissions, or pass a location you can write",
    errno.EPERM: "check its permissions, or pass a location you can write",
    errno.EROFS: "the filesystem is read-only: pass a location on a writable one",
    errno.ENOSPC: "the disk is full: free space there, or pass a location on another disk",
    errno.EDQUOT: "the disk quota is used up: free space there, or pass a location on another disk",
    errno.ENAMETOOLONG: "a name in the path is longer than the filesystem holds (255 bytes): use shorter names",
    errno.ELOOP: "a symbolic link in the path leads back to itself: fix or remove the link",
    errno.ENOTDIR: "a file stands where a directory should be: move it, or pass another path",
    errno.EEXIST: "something that is not a directory stands there (a file, or a link that leads nowhere): move it, "
    "or pass another path",
    errno.EISDIR: "a directory stands where a file should be: pass a file name",
    errno.ENOENT: "it does not exist: check the path",
}


def os_error_line(error: OSError, what: str | None = None) -> str:
    """An operating system's error as one line: what failed, on which path, and what to do (by its errno).

    ``what`` names the path's role (``"--out"``, ``"the S1 cache"``); the path is the error's own ``filename``.
    An error without one (``write()`` on a full disk names no file) says only what happened; one raised with a
    message of its own is that message.
    """
    path = error.filename2 if error.filename is None else error.filename
    if (
        error.errno is None and path is None
    ):  # raised with a message of its own (``FileNotFoundError("...")``)
        return str(error)
    where = " ".join(str(part) for part in (what, path) if part is not None)
    reason = error.strerror or str(error)
    fix = _OS_ERROR_FIXES.get(error.errno or -1, "check the path and its permissions")
    return f"{where + ': ' if where else ''}{reason} ({fix})."


def json_digest(obj: Any, length: int | None = None) -> str:
    """SHA-256 of ``obj`` as canonical JSON (sorted keys, ``str`` for what JSON cannot hold), optionally cut to
    ``length`` hex digits. Equal values give equal digests in every process and on every machine."""
    return bytes_digest(json.dumps(obj, sort_keys=True, default=str).encode(), length)


def bytes_digest(content: bytes, length: int | None = None) -> str:
    """SHA-256 of ``content`` as hex, optionally cut to ``length`` hex digits (``sha256sum`` of a file of these bytes):
    what a result's ``meta.json`` records of each of its files, and what an executed notebook records of its source."""
    digest = hashlib.sha256(content).hexdigest()
    return digest if length is None else digest[:length]


def files_digest(paths: Iterable[str | os.PathLike], length: int | None = None) -> str:
    """SHA-256 over each file's name (not its directory) then its bytes, in the order given, optionally cut to
    ``length`` hex digits: one identity for a few small files (the zoo's data files, its tokenizer)."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    hexdigest = digest.hexdigest()
    return hexdigest if length is None else hexdigest[:length]


__all__ = [
    "ZOO_PREFIX",
    "bytes_digest",
    "cache_root",
    "files_digest",
    "json_digest",
    "os_error_line",
    "replace_directory",
    "set_aside",
    "staged_siblings",
    "staging_path",
    "write_atomic",
    "zoo_root",
    "zoo_search_roots",
]

"""What a refusal must look like, and the operating system's failures a test cannot cause for real.

A refusal of user input is one line on stderr, exit status 2, no traceback, and it comes before any model loads
(``helpers.cli.one_line_error``, ``forbid_model_loading``). A read-only directory cannot be made for a test running
as root, which the kernel lets write anywhere, and a full disk cannot be made at all: ``read_only`` and ``disk_full`` make
the calls that would fail there raise the ``OSError`` the system would raise.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from uds_lens.checkpoints import loader


def forbid_model_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails the test: the refusal under test must come before it. (Every loader, ``load_model``
    and ``load`` alike, builds the model through ``loader._hf_model``.)"""
    monkeypatch.setattr(loader, "_hf_model", lambda *a, **k: pytest.fail("a model was loaded"))


def _inside(path: object, root: str) -> bool:
    resolved = os.path.realpath(os.fspath(path))  # type: ignore[arg-type]
    return resolved == root or resolved.startswith(root + os.sep)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only inside the block: its mode where that binds; as root, creating a directory or
    opening a file for writing under it raises ``PermissionError`` as the system would."""
    root = os.path.realpath(directory)
    real_mkdir, real_open = os.mkdir, os.open

    def mkdir(path, *args, **kwargs):
        if _inside(path, root):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _inside(path, root):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    directory.chmod(0o555)
    try:
        with pytest.MonkeyPatch.context() as patch:
            if os.geteuid() == 0:
                patch.setattr(os, "mkdir", mkdir)
                patch.setattr(os, "open", open_)
            yield
    finally:
        directory.chmod(0o755)


def disk_full(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Writing a file's contents anywhere under ``directory`` fails as on a full disk: ``OSError(ENOSPC)`` from
    the write, which names no file."""
    root = os.path.realpath(directory)
    real_text, real_bytes = Path.write_text, Path.write_bytes

    def write_text(self, *args, **kwargs):
        if _inside(self, root):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_text(self, *args, **kwargs)

    def write_bytes(self, *args, **kwargs):
        if _inside(self, root):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_bytes(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)

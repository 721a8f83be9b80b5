"""How many times a run reads each checkpoint's bytes: every byte read from a tracked file is counted, whoever opens
it (uds_lens's one pass, its header reads, or ``transformers`` reading the files itself)."""

from __future__ import annotations

import builtins
import io
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from transformers import modeling_utils


class _Counted:
    """A binary file handle that adds what is read from it to its counter."""

    def __init__(self, handle: Any, counter: ReadCounter, key: str) -> None:
        self._handle, self._counter, self._key = handle, counter, key

    def read(self, *args: Any) -> bytes:
        data = self._handle.read(*args)
        self._counter.bytes[self._key] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        got = self._handle.readinto(buffer)
        self._counter.bytes[self._key] += got or 0
        return got

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class ReadCounter:
    """Counts the bytes read from ``files`` while it is installed (``monkeypatch`` undoes it).

    Python-level reads are counted through ``open`` (``pathlib`` and the builtin); ``transformers`` maps safetensors
    files into memory instead (``safe_open``), which is counted as a read of the whole file.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, files: Iterable[str | Path]) -> None:
        self.sizes = {str(Path(file).resolve()): Path(file).stat().st_size for file in files}
        self.bytes: Counter[str] = Counter()
        real_open, real_safe_open = io.open, modeling_utils.safe_open

        def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = real_open(file, mode, *args, **kwargs)
            key = self._key(file)
            return _Counted(handle, self, key) if key in self.sizes and "b" in mode else handle

        def counting_safe_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            key = self._key(file)
            if key in self.sizes:
                self.bytes[key] += self.sizes[key]
            return real_safe_open(file, *args, **kwargs)

        monkeypatch.setattr(io, "open", counting_open)
        monkeypatch.setattr(builtins, "open", counting_open)
        monkeypatch.setattr(modeling_utils, "safe_open", counting_safe_open)

    @staticmethod
    def _key(file: Any) -> str:
        try:
            return str(Path(file).resolve())
        except TypeError:  # a file descriptor
            return ""

    def times_read(self, file: str | Path) -> float:
        """Bytes read of ``file`` over its size: 1.0 plus its header (kilobytes) is one read."""
        key = str(Path(file).resolve())
        return self.bytes[key] / self.sizes[key]

    def reset(self) -> None:
        self.bytes.clear()

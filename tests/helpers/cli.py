"""The console entry point run in the test's own process, as a shell runs it (it always exits)."""

from __future__ import annotations

import sys
import time

import pytest

from uds_lens.cli import main


def run_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: object
) -> tuple[int, str, float]:
    """``uds-lens ARGV``: its exit code, what it wrote to stderr, and the seconds it took."""
    monkeypatch.setattr(sys, "argv", ["uds-lens", *map(str, argv)])
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err, time.perf_counter() - started


def one_line_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """``run_cli``, which must exit 2 with one line on stderr and no traceback: that line (what is left once the
    progress bars of a run that computed are taken out)."""
    code, err, _ = run_cli(monkeypatch, capsys, *argv)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("S1 ", "S2 "))]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]

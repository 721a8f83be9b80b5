"""The package entry point: importing uds_lens is silent and light; its names resolve on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.synthetic import make_result

import uds_lens
from uds_lens import cli

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("transformer_lens", "torch", "bitsandbytes", "transformers")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def test_import_writes_nothing_and_loads_no_heavy_dependency():
    probe = _run(f"import sys, uds_lens; print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr == "", f"`import uds_lens` wrote to stderr: {probe.stderr!r}"
    assert probe.stdout.strip() == "", f"`import uds_lens` imported {probe.stdout.strip()}"


@pytest.mark.parametrize("command", [[], ["score"], ["sweep"]])
def test_cli_help_imports_no_model_library(command):
    probe = _run(
        "import sys\n"
        f"sys.argv = ['uds-lens', *{command!r}, '--help']\n"
        "from uds_lens import cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        f"print('LOADED:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert probe.returncode == 0, probe.stderr
    assert ("report" if not command else "--tau") in probe.stdout  # the help text itself
    assert probe.stdout.strip().endswith("LOADED:"), probe.stdout[-200:]
    assert probe.stderr == ""


def test_public_names_resolve_lazily_and_unknown_names_fail():
    assert uds_lens.UDSConfig().tau == 0.05
    assert set(uds_lens.__all__) <= set(dir(uds_lens))
    for name in uds_lens.__all__:
        assert getattr(uds_lens, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        uds_lens.no_such_name  # noqa: B018


@pytest.mark.parametrize(("flags", "hidden"), [(["--verbose"], False), (["-v"], False), ([], True)])
def test_cli_hides_hugging_face_loading_bars_unless_verbose(monkeypatch, capsys, flags, hidden):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(sys, "argv", ["uds-lens", "score", *flags, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 0 and "--verbose" in capsys.readouterr().out
    assert (os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1") is hidden


def test_cli_report_imports_no_model_library(tmp_path):
    for name, erasure in (("full", 0.0), ("npo", 0.4)):
        make_result(name, erasure).save(tmp_path / name)
    probe = _run(
        "import sys\n"
        f"sys.argv = ['uds-lens', 'report', {str(tmp_path)!r}]\n"
        "from uds_lens import cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        f"print('LOADED:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert probe.returncode == 0, probe.stderr
    assert (tmp_path / "report.html").is_file()
    assert probe.stdout.strip().endswith("LOADED:"), probe.stdout[-300:]

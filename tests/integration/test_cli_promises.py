"""The CLI's small promises (issue 27): every accepted dtype in --help, NAME=PATH names with '=', output flushed line
by line into a pipe, and the report showing every model's role in the terminal table's order. Each test failed on
the code before the issue."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from uds_lens.checkpoints import loader
from uds_lens.cli import _unlearned_models, app
from uds_lens.plotting.report import write_report

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_accepted_dtype():
    with pytest.raises(ValueError) as error:
        loader.resolve_dtype("no-such-dtype", "cpu")
    accepted = [
        name
        for name in ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
        if name in str(error.value)
    ]
    assert len(accepted) == 6
    for command in ("score", "sweep"):
        text = " ".join(CliRunner().invoke(app, [command, "--help"], terminal_width=200).output.split())
        for name in accepted:
            assert name in text, (command, name)


def test_an_unlearned_name_may_contain_equals_signs(tiny, tmp_path):
    assert _unlearned_models([f"npo=lr=1e-5={tiny.unlearned}"]) == {"npo=lr=1e-5": str(tiny.unlearned)}
    odd = tmp_path / "lr=1e-5"
    shutil.copytree(tiny.unlearned, odd)
    assert _unlearned_models([str(odd)]) == {"lr=1e-5": str(odd)}
    assert _unlearned_models([f"mine={odd}"]) == {"mine": str(odd)}


def test_cli_output_is_line_buffered_in_a_pipe():
    code = (
        "import sys, uds_lens.cli as cli\n"
        "cli.app = lambda: print(sys.stdout.line_buffering, sys.stderr.line_buffering)\n"
        "cli.main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout.split() == ["True", "True"], proc.stderr


def test_the_report_shows_every_role_in_the_terminal_tables_order(tiny, tmp_path):
    out = tmp_path / "out"
    argv = ["score", "--full", str(tiny.full), "--retain", str(tiny.retain),
            "--unlearned", f"zeta={tiny.unlearned}", "--unlearned", f"alpha={tiny.full}",
            "--unlearned", f"mid={tiny.retain}", "--data", str(tiny.data), "--out", str(out),
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    terminal = [
        line.split()[0]
        for line in result.output.splitlines()
        if line.split()[:1] in (["zeta"], ["alpha"], ["mid"])
    ]
    assert terminal == ["zeta", "alpha", "mid"]
    page = write_report(out).read_text()
    rows = [(name, page.index(f"<td>{name}</td>")) for name in terminal]
    assert [name for name, _ in sorted(rows, key=lambda row: row[1])] == terminal
    for name, role in (("zeta", "unlearned"), ("alpha", "full"), ("mid", "retain")):
        start = page.index(f"<td>{name}</td>")
        assert page[start : page.index("</tr>", start)].count(f"<td>{role}</td>") == 1, name

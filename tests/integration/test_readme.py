"""The README as a reader meets it: short, opening with the two commands for a fresh machine, and its zoo section
runnable as written (the commands and the Python snippet are read from README.md and run on the test zoo)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ZOO_SECTION = "Try it on the zoo"
MAX_WORDS = 1200


def section(text: str, title: str) -> str:
    """The Markdown of one ``## title`` section, up to the next ``## `` heading."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert found, f"README.md has no section '## {title}'"
    return found.group(1)


def code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


def test_the_readme_is_short_and_opens_with_make_demo_and_make_test():
    text = README.read_text()
    assert len(text.split()) <= MAX_WORDS
    first_section = text.index("\n## ")
    opening = code_blocks(text[:first_section], "bash")
    assert (
        opening
        and re.search(r"^make demo\b", opening[0], re.M)
        and re.search(r"^make test\b", opening[0], re.M)
    )
    assert "SPEC" not in text and "<this repository>" not in text


@pytest.mark.slow
def test_the_readmes_zoo_section_runs_as_written(test_zoo, tmp_path):
    """Every command of the section's shell block, then its Python block, in a fresh directory with the test zoo as
    the zoo its names resolve in."""
    zoo_section = section(README.read_text(), ZOO_SECTION)
    (shell,) = code_blocks(zoo_section, "bash")
    (python,) = code_blocks(zoo_section, "python")
    commands = [line for line in shell.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert [c.split()[:2] for c in commands] == [
        ["uds-lens", "annotate"],
        ["uds-lens", "score"],
        ["uds-lens", "report"],
    ]
    env = {
        **os.environ,
        "UDS_LENS_ZOO": str(test_zoo.root),
        "UDS_LENS_CACHE": str(tmp_path / "cache"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    work = tmp_path / "reader"
    work.mkdir()
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=work, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    annotated = json.loads((work / "forget.json").read_text())
    assert len(annotated) == len(json.loads(test_zoo.forget_path.read_text()))
    assert {"prefix", "entity"} <= set(annotated[0])
    assert json.loads((work / "runs" / "npo" / "summary.json").read_text())["n_scored"] > 0
    assert (work / "runs" / "report.html").stat().st_size > 0

    done = subprocess.run(
        [sys.executable, "-c", python], cwd=work, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = re.findall(r"[-+]?\d*\.\d+|nan", done.stdout)
    assert printed and 0.0 <= float(printed[0]) <= 1.0, done.stdout
    assert (work / "stage_curves.html").stat().st_size > 0
    assert (work / "runs" / "npo-python" / "summary.json").is_file()

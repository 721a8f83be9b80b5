"""The notebooks in notebooks/: stored without outputs, and executed top to bottom on the test zoo (FAST = True)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
FAST_LINE = re.compile(r"^FAST\s*=\s*(True|False)\b", flags=re.MULTILINE)
CELL_TIMEOUT_S = 900


def _ids(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


def test_the_five_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= {
        "01_quickstart",
        "02_layer_diagnostics",
        "03_component_patching",
        "04_comparing_methods",
        "05_heads_and_hooks",
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    dirty = [
        number
        for number, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} hold outputs or execution counts; strip them before committing "
        "(e.g. `jupyter nbconvert --clear-output --inplace notebooks/*.ipynb`)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_first_cell_holds_the_parameters(path):
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "code" and FAST_LINE.search(first.source), (
        f"{path.name}: the first cell must be the parameter cell with a `FAST = True/False` line"
    )
    assert "UDS_LENS_ZOO" in first.source, (
        f"{path.name}: the first cell must read the zoo directory from UDS_LENS_ZOO"
    )


@pytest.mark.slow
@pytest.mark.xdist_group("notebooks")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, test_zoo, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    notebook.cells[0].source = FAST_LINE.sub("FAST = True", notebook.cells[0].source, count=1)
    # The kernel inherits this process's environment: point the notebook at the session's test zoo, keep the
    # S1 cache out of the user's home, and keep CPU threads modest.
    monkeypatch.setenv("UDS_LENS_ZOO", str(test_zoo.root))
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "s1_cache"))
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors

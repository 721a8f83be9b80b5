"""The notebooks in notebooks/: stored without outputs, and executed top to bottom on the test zoo (FAST = True),
their figures kept when rendered to HTML; each executed copy is kept in docs/tutorials/ for the docs build."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from helpers.docs_tools import docs_tool

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXECUTED_DIR = ROOT / "docs" / "tutorials"
PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"
_tool = docs_tool("executed_notebooks")
FAST_LINE, execute, write_copy = _tool.FAST_LINE, _tool.execute, _tool.write_copy


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


def _figures_in_html(notebook) -> tuple[int, list[str]]:
    """The notebook's Plotly figures, and the ids of the figure divs nbconvert's HTML export of it holds (what a
    notebook shared as HTML, or shown in the docs, draws)."""
    from nbconvert import HTMLExporter

    figures = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if PLOTLY_MIMETYPE in output.get("data", {})
    ]
    page, _ = HTMLExporter().from_notebook_node(notebook)
    divs = [
        re.search(r'id="([^"]+)"', div).group(1)
        for div in re.findall(r"<div[^>]*plotly-graph-div[^>]*>", page)
    ]
    drawn = [div for div in divs if re.search(rf'Plotly\.newPlot\(\s*"{re.escape(div)}"', page)]
    return len(figures), drawn


def _figure_texts(notebook) -> list[tuple[int, str]]:
    """Each Plotly figure's title and annotations, as one text (HTML tags kept), numbered in notebook order."""
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            figure = output.get("data", {}).get(PLOTLY_MIMETYPE)
            if figure is None:
                continue
            layout = figure.get("layout", {})
            title = layout.get("title", {})
            parts = [title.get("text", "") if isinstance(title, dict) else str(title)]
            parts += [annotation.get("text", "") for annotation in layout.get("annotations", [])]
            texts.append((len(texts), " | ".join(parts)))
    return texts


@pytest.mark.slow
@pytest.mark.xdist_group("notebooks")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, test_zoo, tmp_path, monkeypatch):
    # The kernel inherits this process's environment: point the notebook at the session's test zoo, keep the
    # S1 cache out of the user's home, and keep CPU threads modest.
    monkeypatch.setenv("UDS_LENS_ZOO", str(test_zoo.root))
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "s1_cache"))
    notebook = execute(path, tmp_path)
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
    # Every figure states what it rests on, in its title or its annotations: n examples and tau with its unit.
    for number, text in _figure_texts(notebook):
        assert re.search(r"\bn = \d+", text) and re.search(r"\btau = [\d.e-]+ nats", text), (
            f"{path.name}: figure {number} does not state n and tau: {text[:300]!r}"
        )
    # Every figure survives the notebook's export to HTML: its div, drawn by Plotly.newPlot (not a blank output).
    n_figures, drawn = _figures_in_html(notebook)
    if path.stem == "01_quickstart":
        assert n_figures > 0, "the quickstart shows figures: this check must see some"
    assert len(drawn) == n_figures, f"{path.name}: {n_figures} figures, {len(drawn)} drawn in the HTML export"
    # what `make docs` shows (it executes only missing or stale copies)
    write_copy(notebook, path, EXECUTED_DIR, zoo_dir=test_zoo.root, workdir=tmp_path)

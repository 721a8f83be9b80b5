"""The executed copies the docs show: current only for the version of the notebook they were executed from."""

import nbformat

from uds_lens.zoo import executed_notebooks
from uds_lens.zoo.executed_notebooks import copy_path, ensure_executed, is_current, write_copy


def _notebook(path, source: str) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(notebook, path)


def test_a_copy_is_current_until_its_notebook_changes_and_only_stale_ones_are_executed(tmp_path, monkeypatch):
    first, second = tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"
    _notebook(first, "FAST = False\nx = 1")
    _notebook(second, "FAST = False\ny = 2")
    out = tmp_path / "executed"
    assert not is_current(first, out)
    executed_cell = nbformat.read(first, as_version=4)
    executed_cell.cells[0].outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    write_copy(executed_cell, first, out)
    assert is_current(first, out) and not is_current(second, out)
    assert nbformat.read(copy_path(first, out), as_version=4).cells[0].outputs[0]["text"] == "ran\n"

    ran = []

    def fake_execute(path, workdir):
        ran.append(path.name)
        return nbformat.read(path, as_version=4)

    monkeypatch.setattr(executed_notebooks, "execute", fake_execute)
    assert ensure_executed([first, second], out) == [second] and ran == ["02_b.ipynb"]
    _notebook(first, "FAST = False\nx = 3")  # the notebook changed: its copy is stale
    assert not is_current(first, out) and is_current(second, out)
    assert ensure_executed([first, second], out) == [first]
    copy_path(second, out).write_text("{not json")  # a damaged copy is executed again, not trusted
    assert not is_current(second, out)

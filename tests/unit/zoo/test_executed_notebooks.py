"""The executed copies the docs show: current only while the notebook, the package, its libraries and the zoo they
were executed from are the same; written without the build machine's paths."""

import json

import nbformat
import pytest
from helpers.docs_tools import docs_tool

executed_notebooks = docs_tool("executed_notebooks")
copy_path, ensure_executed, inputs_path = (
    executed_notebooks.copy_path,
    executed_notebooks.ensure_executed,
    executed_notebooks.inputs_path,
)
is_current, shareable, write_copy = (
    executed_notebooks.is_current,
    executed_notebooks.shareable,
    executed_notebooks.write_copy,
)


def _notebook(path, source: str) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(notebook, path)


def _zoo(root, npo_fingerprint="aa", build_seconds=1.0):
    root.mkdir(exist_ok=True)
    manifest = {
        "size": "test",
        "data": {"forget": "data/forget.json", "fingerprint": "d1"},
        "models": [{"name": "full", "fingerprint": "ff"}, {"name": "npo", "fingerprint": npo_fingerprint}],
        "build_seconds": build_seconds,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture
def setup(tmp_path, monkeypatch):
    first, second = tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"
    _notebook(first, "FAST = False\nx = 1")
    _notebook(second, "FAST = False\ny = 2")
    zoo = _zoo(tmp_path / "zoo")
    monkeypatch.setattr(executed_notebooks, "zoo_directory", lambda name: zoo)
    monkeypatch.setattr(executed_notebooks, "ensure_zoo", lambda name: zoo)
    return first, second, zoo, tmp_path / "executed"


def test_a_copy_is_current_until_any_of_its_inputs_changes(setup, monkeypatch):
    first, second, zoo, out = setup
    assert not is_current(first, out, zoo)
    executed = nbformat.read(first, as_version=4)
    executed.cells[0].outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    write_copy(executed, first, out, zoo_dir=zoo)
    assert is_current(first, out, zoo) and not is_current(second, out, zoo)
    assert nbformat.read(copy_path(first, out), as_version=4).cells[0].outputs[0]["text"] == "ran\n"
    record = json.loads(inputs_path(first, out).read_text())
    assert record["notebook"] == "01_a.ipynb" and record["zoo"]["models"] == {"full": "ff", "npo": "aa"}
    assert set(record["libraries"]) == {"torch", "transformer-lens", "transformers", "plotly"}

    _zoo(zoo, build_seconds=9.0)  # a zoo reused by another build: same models, same outputs
    assert is_current(first, out, zoo)
    _zoo(zoo, npo_fingerprint="bb")  # a model retrained
    assert not is_current(first, out, zoo)
    _zoo(zoo)
    assert is_current(first, out, zoo)
    assert not is_current(first, out, zoo.parent / "elsewhere")  # another zoo (none built there)
    real = executed_notebooks.package_sources_digest()
    monkeypatch.setattr(executed_notebooks, "package_sources_digest", lambda: "0" * 64)  # the package changed
    assert not is_current(first, out, zoo)
    monkeypatch.setattr(executed_notebooks, "package_sources_digest", lambda: real)
    assert is_current(first, out, zoo)
    inputs_path(first, out).write_text("{not json")  # a damaged record: executed again, not trusted
    assert not is_current(first, out, zoo)


def test_only_stale_copies_are_executed(setup, monkeypatch):
    first, second, zoo, out = setup
    ran = []

    def fake_execute(path, workdir):
        ran.append(path.name)
        return nbformat.read(path, as_version=4)

    monkeypatch.setattr(executed_notebooks, "execute", fake_execute)
    assert ensure_executed([first, second], out) == [first, second]
    assert ensure_executed([first, second], out) == [] and ran == ["01_a.ipynb", "02_b.ipynb"]
    _notebook(first, "FAST = False\nx = 3")  # the notebook changed: its copy is stale
    assert ensure_executed([first, second], out) == [first]
    copy_path(second, out).unlink()
    assert ensure_executed([first, second], out) == [second]


def test_shareable_takes_the_build_machines_paths_out(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    monkeypatch.setenv("HOME", str(home))
    workdir, zoo = tmp_path / "uds_lens_nb_x1", tmp_path / "zoos" / "zoo-test"
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("print(...)")]
    notebook.cells[0].outputs = [
        nbformat.v4.new_output(
            "stream",
            text=f"report: {workdir}/runs/report.html\nforget: {zoo}/data/f.json\nother: /tmp/uds_q_1x/r.html\n",
        ),
        nbformat.v4.new_output(
            "display_data", data={"text/html": f"<a href='{home}/.cache/uds_lens/x'>x</a>"}
        ),
    ]
    shareable(notebook, workdir=workdir, zoo_dir=zoo)
    stream, html = notebook.cells[0].outputs
    assert stream["text"] == (
        "report: runs/report.html\nforget: $UDS_LENS_ZOO/data/f.json\nother: <temporary directory>/r.html\n"
    )
    assert html["data"]["text/html"] == "<a href='~/.cache/uds_lens/x'>x</a>"

"""uds_lens/plotting/export.py on synthetic UDSResults: offline HTML, kaleido images and the fallback between them."""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import plotly.graph_objects as go
import pytest

from uds_lens import plotting
from uds_lens.zoo.notebook_html import find_browser


def test_save_writes_offline_html_and_falls_back_without_kaleido(result, tmp_path, monkeypatch):
    fig = plotting.example_curves(result, 3)
    html_path = plotting.save(fig, tmp_path / "fig.html")
    text = html_path.read_text()
    assert "Plotly.newPlot" in text and len(text) > 1_000_000  # plotly.js inline ...
    assert not re.search(r"<script[^>]*src\s*=", text)  # ... and nothing fetched from a CDN
    real_import = builtins.__import__

    def no_kaleido(name, *args, **kwargs):
        if name == "kaleido":
            raise ImportError("no kaleido here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kaleido)
    monkeypatch.setattr("uds_lens.zoo.notebook_html.find_browser", lambda: None)  # nor a browser
    with pytest.warns(UserWarning, match="kaleido is not installed"):
        written = plotting.save(fig, tmp_path / "sub" / "fig.png")
    assert written == tmp_path / "sub" / "fig.html" and written.is_file()
    with pytest.raises(ValueError, match="fig.txt"):
        plotting.save(fig, tmp_path / "fig.txt")


def test_save_uses_kaleido_when_it_works(result, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kaleido", types.ModuleType("kaleido"))
    calls = []
    monkeypatch.setattr(go.Figure, "write_image", lambda self, path, **kw: calls.append((path, kw)))
    assert (
        plotting.save(plotting.example_curves(result, 3), tmp_path / "fig.svg", width=640)
        == tmp_path / "fig.svg"
    )
    assert calls and calls[0][1]["width"] == 640


# nbconvert warns that it cannot show the first figure (Plotly's mimetype alone): the point of the contrast
@pytest.mark.filterwarnings("ignore:Your element with mimetype")
def test_a_notebook_rendered_to_html_shows_its_figures(tmp_path, monkeypatch):
    """An executed notebook converted by nbconvert (what sharing it as HTML, and the docs, do) holds the figures shown
    after keep_figures_in_notebooks, data included; one shown before it (Plotly's mimetype alone) is lost there."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    root = str(Path(__file__).resolve().parents[3])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "import plotly.graph_objects as go\n"
            "go.Figure(go.Bar(name='trace_before_the_switch', x=[1], y=[2]))"
        ),
        nbformat.v4.new_code_cell("from uds_lens import plotting\nplotting.keep_figures_in_notebooks()"),
        nbformat.v4.new_code_cell(
            "go.Figure(go.Scatter(name='trace_kept_as_html', x=[1, 2], y=[0.25, 0.75]))"
        ),
    ]
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert (
        "text/html" not in notebook.cells[0].outputs[0]["data"]
    )  # Plotly's default in a kernel: lost in HTML
    kept = notebook.cells[2].outputs[0]["data"]
    assert {"application/vnd.plotly.v1+json", "text/html"} <= set(kept)  # Jupyter still renders it live
    page, _ = HTMLExporter().from_notebook_node(notebook)
    # the figure's div (nbconvert may reorder its attributes) and the call that draws it with the figure's data
    divs = [
        re.search(r'id="([^"]+)"', div).group(1)
        for div in re.findall(r"<div[^>]*plotly-graph-div[^>]*>", page)
    ]
    assert len(divs) == 1  # the second figure's; the first has none
    plot_call = re.search(rf'Plotly\.newPlot\(\s*"{divs[0]}",(.*?)</script>', page, flags=re.DOTALL)
    assert plot_call and "trace_kept_as_html" in plot_call.group(1) and "0.25" in plot_call.group(1)
    # offline: plotly.js is in the notebook once (the switch's own output), no figure fetches it from a CDN
    embedded = [
        o
        for o in notebook.cells[1].outputs
        if 'id="uds-lens-plotlyjs"' in o.get("data", {}).get("text/html", "")
    ]
    assert len(embedded) == 1 and len(embedded[0]["data"]["text/html"]) > 3_000_000
    assert "cdn.plot.ly" not in kept["text/html"]
    assert page.index('id="uds-lens-plotlyjs"') < page.index(divs[0])


@pytest.mark.slow  # a kernel and three browser runs: about 20 s
@pytest.mark.filterwarnings("ignore:Your element with mimetype")
@pytest.mark.skipif(find_browser() is None, reason="no Chrome/Chromium (apt-get install chromium)")
def test_a_users_executed_notebook_shows_its_figures_offline(tmp_path, monkeypatch):
    """A notebook of one's own, run after keep_figures_in_notebooks(), exported with nbconvert and opened in a
    headless browser that can reach no host, draws its figure; share_notebook adds a static image beside it."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    from uds_lens.zoo.notebook_html import headless, share_notebook

    root = str(Path(__file__).resolve().parents[3])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("from uds_lens import plotting\nplotting.keep_figures_in_notebooks()"),
        nbformat.v4.new_code_cell(
            "import plotly.graph_objects as go\ngo.Figure(go.Bar(x=['a', 'b'], y=[1, 2]))"
        ),
    ]
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    nbformat.write(notebook, tmp_path / "mine.ipynb")
    page = tmp_path / "mine.html"
    page.write_text(
        HTMLExporter().from_notebook_node(notebook)[0]
    )  # what `jupyter nbconvert --to html` writes
    browser = find_browser()
    offline = [
        "--proxy-server=127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--virtual-time-budget=10000",
    ]

    def dom(path: Path) -> str:
        command = [*headless(browser, str(tmp_path / "profile")), *offline, "--dump-dom", path.as_uri()]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout

    assert 'class="main-svg"' in dom(page)  # plotly.js from the notebook itself drew the figure
    shared, shared_page = share_notebook(tmp_path / "mine.ipynb", tmp_path / "out")
    figure = [o for o in nbformat.read(shared, as_version=4).cells[1].outputs if "image/png" in o["data"]]
    assert len(figure) == 1 and 'class="main-svg"' in dom(shared_page)

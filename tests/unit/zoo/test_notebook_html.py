"""Executed notebooks that show their figures anywhere: offline HTML that fetches nothing, a static PNG beside
every Plotly figure, and (where a Chrome/Chromium is installed) both checked in a headless browser with the network
off."""

from __future__ import annotations

import json
import re
import struct
import subprocess

import nbformat
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from uds_lens.zoo.notebook_html import (
    PLOTLY_JS,
    PLOTLY_MIMETYPE,
    add_static_figures,
    find_browser,
    has_static_figures,
    headless,
    offline_html,
    with_static_image,
    without_network,
    write_offline_html,
)

BROWSER = find_browser()
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chrome/Chromium (apt-get install chromium)")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _figure_notebook() -> nbformat.NotebookNode:
    """A notebook as the executed tutorials hold it: a Plotly figure stored as Plotly's mimetype and as HTML that
    loads plotly.js (and MathJax) from their CDNs."""
    figure = go.Figure(go.Scatter(x=[0, 1, 2, 3], y=[0.1, 0.7, 0.4, 0.9], name="d1"))
    figure.update_layout(title="d1 per layer")
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("figure")
    cell.outputs = [
        nbformat.v4.new_output(
            "display_data",
            data={
                PLOTLY_MIMETYPE: json.loads(figure.to_json()),
                "text/html": pio.to_html(
                    figure, include_plotlyjs="cdn", include_mathjax="cdn", full_html=False
                ),
            },
        )
    ]
    notebook.cells = [nbformat.v4.new_markdown_cell("# A figure"), cell]
    return notebook


def test_offline_html_fetches_nothing_and_loads_plotly_js_first():
    page = offline_html(_figure_notebook())
    assert re.findall(r"<script\b[^>]*\bsrc=[\"']https?://", page) == []
    assert re.findall(r"<link\b[^>]*\bhref=[\"']https?://", page) == []
    head = page[: page.index("</head>")]
    assert f'<script src="{PLOTLY_JS}"></script>' in head
    assert "Plotly.newPlot" in page  # the figure itself is still drawn by plotly.js
    # the CDN tags are gone, not the page's own scripts
    cdn = '<script src="https://cdn.plot.ly/plotly-3.0.0.min.js"></script><script>var a = 1;</script>'
    assert without_network(cdn) == "<script>var a = 1;</script>"


def test_static_image_stands_in_until_plotly_draws():
    page = with_static_image("<div id='f'></div><script>Plotly.newPlot('f', [])</script>", PNG_MAGIC + b"x")
    live, image = page.index("uds-lens-static-figure-live"), page.index("<img")
    assert live < image < page.index("window.Plotly")  # the switch runs after both, and hides one of them
    assert "<noscript><style>.uds-lens-static-figure-live{display:none}</style></noscript>" in page
    assert "data:image/png;base64,iVBORw0KGgp4" in page


def test_without_a_browser_figures_stay_interactive(monkeypatch, caplog):
    monkeypatch.setenv("UDS_LENS_BROWSER", "/nonexistent/chromium")
    notebook = _figure_notebook()
    assert find_browser() is None
    assert add_static_figures(notebook) == 0 and not has_static_figures(notebook)
    assert "no Chrome/Chromium found" in caplog.text


@needs_browser
def test_static_figures_are_pngs_of_the_figures_size():
    notebook = _figure_notebook()
    assert add_static_figures(notebook, BROWSER) == 1 and has_static_figures(notebook)
    data = notebook.cells[1].outputs[0]["data"]
    import base64

    png = base64.b64decode(data["image/png"])
    assert png.startswith(PNG_MAGIC)
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (900, 525)
    assert "data:image/png;base64," in data["text/html"]
    assert add_static_figures(notebook, BROWSER) == 0  # already there: left alone


@needs_browser
def test_offline_page_draws_its_figure_with_the_network_off(tmp_path):
    """The converted notebook in a headless browser that can reach no host: plotly.js from beside the page draws
    the figure (its SVG is in the page) and the static image steps aside."""
    notebook = _figure_notebook()
    add_static_figures(notebook, BROWSER)
    nbformat.write(notebook, tmp_path / "figure.ipynb")
    (page,) = write_offline_html([tmp_path / "figure.ipynb"], tmp_path / "html")
    assert (tmp_path / "html" / PLOTLY_JS).is_file()
    offline = ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]
    command = [*headless(BROWSER, str(tmp_path / "profile")), *offline, "--virtual-time-budget=10000"]
    dom = subprocess.run(
        [*command, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert 'class="main-svg"' in dom  # plotly.js ran and drew the figure
    (image,) = [tag for tag in re.findall(r"<img\b[^>]*>", dom) if 'class="uds-lens-static-figure"' in tag]
    assert "display: none" in image


def test_the_docs_copies_leave_out_the_plotly_js_a_notebook_carries():
    """A notebook run after keep_figures_in_notebooks() carries plotly.js once, in its own output; the docs' copies
    take it out (the site ships plotly.js) and keep every other output."""
    from uds_lens.zoo.notebook_html import plotlyjs_script, without_embedded_plotlyjs

    notebook = _figure_notebook()
    carrier = nbformat.v4.new_code_cell("plotting.keep_figures_in_notebooks()")
    carrier.outputs = [nbformat.v4.new_output("display_data", data={"text/html": plotlyjs_script()})]
    notebook.cells.insert(1, carrier)
    assert without_embedded_plotlyjs(notebook) == 1
    assert notebook.cells[1].outputs == [] and len(notebook.cells[2].outputs) == 1
    assert without_embedded_plotlyjs(notebook) == 0

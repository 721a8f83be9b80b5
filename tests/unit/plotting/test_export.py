"""uds_lens/plotting/export.py on synthetic UDSResults: offline HTML, kaleido images and the fallback between them."""

from __future__ import annotations

import builtins
import re
import sys
import types

import plotly.graph_objects as go
import pytest

from uds_lens import plotting


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

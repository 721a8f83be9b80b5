"""uds_lens/plotting/components.py on synthetic UDSResults: patching sites per layer, component grids, per-token log-probs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers.synthetic import make_result

from uds_lens import plotting


def test_component_patching_from_summary_table():
    table = pd.DataFrame(
        [
            {"site": site, "layer": layer, "mean_d1": share * layer, "mean_d2": 0.5 * share * layer}
            for site, share in [
                ("resid_post", 0.95),
                ("attn_out", 0.04),
                ("mlp_out", 0.17),
                ("resid_mid", 0.12),
            ]
            for layer in range(4)
        ]
    )
    fig = plotting.component_patching(table)
    assert len(fig.data) == 4
    assert [t.name for t in fig.data][0].startswith("attention output")  # canonical site order
    post = next(t for t in fig.data if "UDS" in t.name)
    np.testing.assert_allclose(post.y, table.query("site == 'resid_post'")["mean_d1"])
    both = plotting.component_patching(table, stage="both")
    assert sum(t.line.dash == "dash" for t in both.data) == 4


def test_component_patching_from_long_layers():
    result = make_result(sites=("attn_out", "mlp_out", "resid_mid", "resid_post"))
    fig = plotting.component_patching(result.layers)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    bands = [t for t in fig.data if t.fill == "toself"]
    assert len(lines) == 4 and len(bands) == 4


def test_component_heatmap_scales():
    grid = np.array([[0.2, -0.1, np.nan], [0.5, 0.0, -0.4]])
    deltas = plotting.component_heatmap(grid, [0, 1], "head", "d1")
    assert deltas.layout.coloraxis.cmid == 0.0
    assert deltas.layout.coloraxis.cmin == -0.5 and deltas.layout.coloraxis.cmax == 0.5
    assert deltas.layout.xaxis.title.text == "head" and deltas.layout.yaxis.title.text == "layer"
    ratios = plotting.component_heatmap(np.clip(grid, 0, 1), [0, 1], "head", "component_uds")
    assert (ratios.layout.coloraxis.cmin, ratios.layout.coloraxis.cmax) == (0.0, 1.0)


def test_token_logprobs():
    tokens = pd.DataFrame(
        {
            "position": range(6),
            "token": ["Question", ":", " Who", "\n", " Hs", "iao"],
            "logprob_full": [-3.0, -1.0, -2.0, -0.5, -0.2, -0.1],
            "logprob_patched": [-3.0, -1.0, -2.0, -0.5, -2.2, -1.1],
            "is_entity": [False, False, False, False, True, True],
        }
    )
    fig = plotting.token_logprobs(tokens)
    assert [t.type for t in fig.data] == ["bar", "bar", "heatmap"]
    assert list(fig.data[0].x)[2] == "2:␣Who" and list(fig.data[0].x)[3] == "3:\\n"
    np.testing.assert_allclose(fig.data[2].z[0], [0, 0, 0, 0, 2.0, 1.0])
    assert fig.data[2].zmid == 0.0
    (rect,) = [s for s in fig.layout.shapes if s.type == "rect"]
    assert (rect.x0, rect.x1) == (3.5, 5.5)
    with pytest.raises(ValueError, match="is_entity"):
        plotting.token_logprobs(tokens.drop(columns=["is_entity"]))

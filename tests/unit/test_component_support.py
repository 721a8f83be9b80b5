"""What a component result rests on (SPEC 2): KE cells and examples per aggregate, the heads' own threshold, the
clipped share, and figures and reprs that show them."""

from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest
import torch

from uds_lens.component_result import HEAD_TAU, MIN_SUPPORT, ComponentResult
from uds_lens.components import patch_heads
from uds_lens.config import DEFAULT_TAU


def _heads(d1: np.ndarray, d2: np.ndarray, tau: float = HEAD_TAU) -> ComponentResult:
    """A head result whose deltas are ``d1``, ``d2`` exactly (baseline 0, scores the negated deltas)."""
    n_examples, n_layers, n_heads = d1.shape
    zeros = torch.zeros(n_examples, n_layers, n_heads)
    return ComponentResult(
        name="npo",
        hook="attn.hook_z",
        axis="head",
        idx=list(range(10, 10 + n_examples)),
        layers=list(range(n_layers)),
        s0=torch.zeros(n_examples),
        baseline=zeros,
        s1=torch.from_numpy(-d1).float(),
        s2=torch.from_numpy(-d2).float(),
        valid=torch.ones(n_examples, n_heads, dtype=torch.bool),
        tau=tau,
        engine="fast",
    )


# 4 examples x 2 layers x 2 heads. Head (0, 0) is KE (d1 = 0.02 > 0.01) in examples 10-12, head (1, 1) in example 10
# only (0.3, which also passes the residual stream's 0.05), the others never. Example 13 has no KE cell at all.
D1 = np.zeros((4, 2, 2))
D1[:3, 0, 0] = 0.02
D1[0, 1, 1] = 0.3
D1[3] = 0.001  # example 13: every cell below both thresholds
D2 = D1.copy()
D2[1, 0, 0] = 0.04  # clipped: d2 = 2 d1 on a KE cell
D2[2, 0, 0] = 0.0


def test_support_counts_ke_cells_per_component_and_examples_overall():
    heads = _heads(D1, D2)
    assert heads.n_ke_cells.tolist() == [[3, 0], [0, 1]]
    assert heads.n_examples == 3
    defined = ~np.isnan(heads.example_uds.numpy())
    assert defined.sum() == heads.n_examples  # uds averages exactly the examples counted


def test_heads_have_their_own_threshold_and_with_tau_rethresholds():
    assert HEAD_TAU < DEFAULT_TAU
    assert inspect.signature(patch_heads).parameters["tau"].default == HEAD_TAU
    heads = _heads(D1, D2)
    strict = heads.with_tau(DEFAULT_TAU)
    assert strict.tau == DEFAULT_TAU and heads.tau == HEAD_TAU
    assert strict.n_ke_cells.tolist() == [[0, 0], [0, 1]] and strict.n_examples == 1
    assert torch.equal(strict.d1, heads.d1)  # the scores are untouched


def test_the_table_hides_pooled_values_with_too_little_support():
    table = _heads(D1, D2).table().set_index(["layer", "head"])
    assert MIN_SUPPORT == 3
    assert table.loc[(0, 0), "n_ke_cells"] == 3 and not math.isnan(table.loc[(0, 0), "component_uds"])
    assert table.loc[(1, 1), "n_ke_cells"] == 1 and math.isnan(table.loc[(1, 1), "component_uds"])
    assert table.loc[(0, 0), "n_clipped"] == 1


def test_the_table_gives_mean_d1_over_the_cells_component_uds_pools():
    """Head (0, 0) is KE in examples 10-12 (d1 0.02 each), not in 13 (0.001): the mean d1 beside its component UDS
    is over those three cells (0.02), the all-example mean beside it says so in its name (0.01525)."""
    table = _heads(D1, D2).table().set_index(["layer", "head"])
    assert table.loc[(0, 0), "mean_d1_ke"] == np.float32(0.02).item()
    assert table.loc[(0, 0), "mean_d2_ke"] == pytest.approx((0.02 + 0.04 + 0.0) / 3)
    assert table.loc[(0, 0), "mean_d1"] == pytest.approx((3 * 0.02 + 0.001) / 4)
    assert math.isnan(table.loc[(0, 1), "mean_d1_ke"])  # never KE: no cell to average
    html = _heads(D1, D2)._repr_html_()
    assert "over the same KE cells" in html and ">0.020<" in html


def test_clipped_share_counts_ke_cells_with_d2_above_d1():
    clipped = _heads(D1, D2).clipped
    assert clipped["n_ke_cells"] == 4 and clipped["n_clipped_cells"] == 1
    # 0.04 and 0.02 in float32 differ by a power of two, so their ratio is exactly 2
    assert clipped["clipped_share"] == 0.25 and clipped["clipped_median_ratio"] == 2.0


def test_the_figure_marks_thin_cells_and_puts_the_support_in_hover_and_title():
    heads = _heads(D1, D2)
    fig = heads.figure("component_uds")
    trace = fig.data[0]
    z = np.asarray(trace.z, dtype=float)
    assert not math.isnan(z[0, 0]) and math.isnan(z[1, 1])  # one KE cell: no colour, a label
    assert trace.text[1][1].startswith("n=1") and "n=3" in trace.text[0][0]
    assert "KE cells" in trace.hovertemplate and np.asarray(trace.customdata).tolist() == [[3, 0], [0, 1]]
    title = fig.layout.title.text
    assert "npo" in title and "4 KE cells from 3 of 4 examples" in title and "n = 4 examples" in title
    # the heads' threshold beside the layers' (the auditor's), both with their unit
    assert "KE: d1 > tau = 0.01 nats per head (layers: tau = 0.05 nats)" in title


def test_the_repr_names_the_threshold_and_the_support():
    text = repr(_heads(D1, D2))
    assert (
        "KE: d1 > tau = 0.01 nats per head (layers: tau = 0.05 nats): 4 of 16 cells, from 3 examples" in text
    )
    assert "component UDS" in text and "clipped d2 > d1: 25%" in text
    assert not re.search(r"\d\.\d{5,}", text)
    html = _heads(D1, D2)._repr_html_()
    assert html.count("<tr>") == 2  # header + the one cell with enough support

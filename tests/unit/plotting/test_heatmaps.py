"""uds_lens/plotting/heatmaps.py on synthetic UDSResults: values, colour scales, KE marks, sorting, hover, sites."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from helpers.synthetic import make_result

from uds_lens import plotting


def _ke_cells(fig: go.Figure) -> set[tuple[str, int]]:
    """The KE cells the figure marks: the marked cells, or, when the marks say "not KE", every other cell."""
    markers = next(t for t in fig.data if "KE" in (t.name or "") and "no value" not in t.name)
    marked = {(str(x), int(y)) for x, y in zip(markers.x, markers.y, strict=True)}
    if not markers.name.startswith("not KE"):
        return marked
    heatmap = fig.data[0]
    every = {(str(x), int(y)) for x in heatmap.x for y in heatmap.y}
    return every - marked


@pytest.mark.parametrize("value", ["d1", "d2"])
def test_delta_heatmap_is_rdbu_centred_at_zero(result, value):
    fig = plotting.layer_heatmap(result, value=value)
    heatmap = fig.data[0]
    assert isinstance(fig, go.Figure) and heatmap.type == "heatmap"
    assert fig.layout.coloraxis.cmid == 0.0
    colours = [c for _, c in fig.layout.coloraxis.colorscale]
    assert colours[0] != colours[-1] and len(colours) >= 9  # a diverging RdBu scale, not a single colour
    assert fig.layout.xaxis.title.text == "example (idx)" and fig.layout.yaxis.title.text == "layer"
    assert fig.layout.coloraxis.cmin == -fig.layout.coloraxis.cmax  # symmetric: white is exactly 0


def test_d1_and_d2_heatmaps_share_one_scale(result):
    ranges = {
        value: plotting.layer_heatmap(result, value=value).layout.coloraxis.cmax for value in ("d1", "d2")
    }
    assert ranges["d1"] == ranges["d2"] == pytest.approx(result.layers[["d1", "d2"]].abs().max().max())


def test_heatmap_values_are_layer_by_example(result):
    fig = plotting.layer_heatmap(result, value="d1", sort_by="idx")
    z = np.asarray(fig.data[0].z, dtype=float)
    scored_idxs = sorted(result.layers["idx"].unique())
    n_layers = result.layers["layer"].nunique()
    assert z.shape == (n_layers, len(scored_idxs))
    assert list(fig.data[0].x) == [str(i) for i in scored_idxs]
    expected = result.layers.query("idx == 3 and layer == 4")["d1"].item()
    assert z[4, scored_idxs.index(3)] == pytest.approx(expected)


def test_ler_heatmap_is_sequential_zero_one_and_blank_off_ke(result):
    fig = plotting.layer_heatmap(result, value="ler", sort_by="idx")
    assert fig.layout.coloraxis.cmin == 0.0 and fig.layout.coloraxis.cmax == 1.0
    z = np.asarray(fig.data[0].z, dtype=float)
    ke = result.layers.pivot(index="layer", columns="idx", values="ke").to_numpy(dtype=bool)
    assert np.isnan(z[~ke]).all() and np.isfinite(z[ke]).all()
    # blanks mark non-KE cells: no KE marker trace by default, and the legend names the grey cells
    assert not [t for t in fig.data if (t.name or "").startswith(("KE", "not KE"))]
    assert [t.name for t in fig.data if "no value" in (t.name or "")] == ["grey: no value (not KE)"]


def test_ke_cells_are_marked_where_ke_is_true(result):
    fig = plotting.layer_heatmap(result, value="d2")
    expected = {(str(r.idx), int(r.layer)) for r in result.layers.itertuples() if r.ke}
    assert fig.data[1].type == "scatter" and fig.data[1].mode == "markers"
    assert _ke_cells(fig) == expected


def test_clipped_ke_cells_are_crossed_on_d2_and_ler(result):
    # over-disrupt the even layers: d2 = 2 d1 there (LER clips those KE cells to 1)
    even = result.layers["layer"] % 2 == 0
    layers = result.layers.assign(d2=result.layers["d2"].where(~even, 2 * result.layers["d1"]))
    result = replace(result, layers=layers)
    expected = {(str(r.idx), int(r.layer)) for r in layers.itertuples() if r.ke and r.d2 > r.d1}
    assert expected and all(layer % 2 == 0 for _, layer in expected)
    for value in ("d2", "ler"):
        fig = plotting.layer_heatmap(result, value=value)
        crosses = next(t for t in fig.data if (t.name or "").startswith("clipped"))
        assert {(str(x), int(y)) for x, y in zip(crosses.x, crosses.y, strict=True)} == expected
    assert not [
        t for t in plotting.layer_heatmap(result, value="d1").data if (t.name or "").startswith("clip")
    ]


def test_one_order_serves_every_heatmap_and_d1_order_is_model_free(result):
    order = plotting.layer_heatmap(result, value="d1", sort_by="d1").data[0].x
    mean_d1 = result.layers.groupby("idx")["d1"].mean()
    assert [int(x) for x in order] == sorted(mean_d1.index, key=lambda i: (-mean_d1[i], i))
    given = [int(x) for x in order][::-1]
    for value in ("d1", "d2", "ler"):
        assert [int(x) for x in plotting.layer_heatmap(result, value=value, order=given).data[0].x] == given


def test_the_title_names_the_model(result):
    assert plotting.layer_heatmap(result, value="d2").layout.title.text.startswith(f"{result.name}: ")


def test_ke_marks_fall_back_to_tau_without_ke_column(result):
    layers = result.layers.drop(columns=["ke"])
    fig = plotting.layer_heatmap(layers, value="d1", tau=0.5, mark_ke=True)
    expected = {(str(r.idx), int(r.layer)) for r in layers.itertuples() if r.d1 > 0.5}
    assert _ke_cells(fig) == expected


def test_sort_by_uds_puts_undefined_last(result):
    fig = plotting.layer_heatmap(result, value="d1", sort_by="uds")
    order = [int(x) for x in fig.data[0].x]
    uds = result.examples.set_index("idx")["uds"]
    defined = [i for i in order if not np.isnan(uds[i])]
    assert defined == sorted(defined, key=lambda i: uds[i])
    assert order[-1] == 1  # example 1 has no KE layer


def test_sort_by_prompt_type_groups_examples(result):
    fig = plotting.layer_heatmap(result, value="d1", sort_by="prompt_type")
    types = result.examples.set_index("idx")["prompt_type"]
    order_types = [types[int(x)] for x in fig.data[0].x]
    assert order_types == sorted(order_types)
    group_labels = {a.text for a in fig.layout.annotations}
    assert set(order_types) <= group_labels


def test_sorting_needs_examples_table(result):
    with pytest.raises(ValueError, match="examples table"):
        plotting.layer_heatmap(result.layers, value="d1", sort_by="uds")


def test_hover_shows_question_entity_and_values(result):
    data = pd.DataFrame(
        {
            "idx": range(12),
            "question": [f"Who wrote book {i}?" for i in range(12)],
            "entity": [f"E{i}" for i in range(12)],
        }
    )
    fig = plotting.layer_heatmap(result, value="d1", data=data, sort_by="idx")
    custom = np.asarray(fig.data[0].customdata, dtype=object)
    column = list(fig.data[0].x).index("3")
    assert custom[2, column][0] == "3"
    assert custom[2, column][3] == "Who wrote book 3?" and custom[2, column][4] == "E3"
    d1 = result.layers.query("idx == 3 and layer == 2")["d1"].item()
    assert custom[2, column][5] == f"{d1:.3f}"
    template = fig.data[0].hovertemplate
    assert "entity" in template and "d1" in template and "LER" in template


def test_heatmap_picks_one_site():
    result = make_result(sites=("attn_out", "resid_post"))
    z_post = np.asarray(plotting.layer_heatmap(result, value="d1", sort_by="idx").data[0].z, dtype=float)
    z_attn = np.asarray(
        plotting.layer_heatmap(result, value="d1", site="attn_out", sort_by="idx").data[0].z, dtype=float
    )
    assert z_post.shape == z_attn.shape
    assert np.nanmax(z_attn) < np.nanmax(z_post)
    with pytest.raises(ValueError, match="site"):
        plotting.layer_heatmap(result, site="mlp_out")


@pytest.mark.parametrize(
    "sort_by, order", [("d1", "by mean d1 over layers, largest first"), ("uds", "by UDS_i, lowest first")]
)
def test_the_heatmap_states_n_tau_its_order_and_its_unit(result, sort_by, order):
    fig = plotting.layer_heatmap(result, value="d1", sort_by=sort_by, title="my own title")
    title = fig.layout.title.text
    n_examples = result.layers["idx"].nunique()
    assert title.startswith("my own title") and f"n = {n_examples} examples" in title
    assert "tau = 0.05 nats" in title and order in title
    assert "nats" in fig.layout.coloraxis.colorbar.title.text
    assert "0–1" in plotting.layer_heatmap(result, value="ler").layout.coloraxis.colorbar.title.text

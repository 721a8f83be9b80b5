"""uds_lens/plots.py on synthetic result tables: traces, axes, colour scales, KE marks, sorting."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from helpers.synthetic import FakeResult, make_lens_layers, make_result

from uds_lens import plots


@pytest.fixture(scope="module")
def result() -> FakeResult:
    return make_result("npo", erasure=0.4, n_examples=12, n_layers=6)


@pytest.fixture(scope="module")
def results() -> dict[str, FakeResult]:
    return {
        name: make_result(name, erasure) for name, erasure in [("full", 0.0), ("npo", 0.4), ("retain", 1.0)]
    }


def _ke_cells(fig: go.Figure) -> set[tuple[str, int]]:
    markers = fig.data[1]
    return {(str(x), int(y)) for x, y in zip(markers.x, markers.y, strict=True)}


# ---------------------------------------------------------------------------------------------------------------------
# Heatmaps


@pytest.mark.parametrize("value", ["d1", "d2"])
def test_delta_heatmap_is_rdbu_centred_at_zero(result, value):
    fig = plots.layer_heatmap(result, value=value)
    heatmap = fig.data[0]
    assert isinstance(fig, go.Figure) and heatmap.type == "heatmap"
    assert fig.layout.coloraxis.cmid == 0.0
    colours = [c for _, c in fig.layout.coloraxis.colorscale]
    assert colours[0] != colours[-1] and len(colours) >= 9  # a diverging RdBu scale, not a single colour
    assert fig.layout.xaxis.title.text == "example (idx)" and fig.layout.yaxis.title.text == "layer"
    assert fig.layout.coloraxis.cmin == -fig.layout.coloraxis.cmax  # symmetric: white is exactly 0


def test_d1_and_d2_heatmaps_share_one_scale(result):
    ranges = {value: plots.layer_heatmap(result, value=value).layout.coloraxis.cmax for value in ("d1", "d2")}
    assert ranges["d1"] == ranges["d2"] == pytest.approx(result.layers[["d1", "d2"]].abs().max().max())


def test_heatmap_values_are_layer_by_example(result):
    fig = plots.layer_heatmap(result, value="d1", sort_by="idx")
    z = np.asarray(fig.data[0].z, dtype=float)
    scored_idxs = sorted(result.layers["idx"].unique())
    n_layers = result.layers["layer"].nunique()
    assert z.shape == (n_layers, len(scored_idxs))
    assert list(fig.data[0].x) == [str(i) for i in scored_idxs]
    expected = result.layers.query("idx == 3 and layer == 4")["d1"].item()
    assert z[4, scored_idxs.index(3)] == pytest.approx(expected)


def test_ler_heatmap_is_sequential_zero_one_and_blank_off_ke(result):
    fig = plots.layer_heatmap(result, value="ler", sort_by="idx")
    assert fig.layout.coloraxis.cmin == 0.0 and fig.layout.coloraxis.cmax == 1.0
    z = np.asarray(fig.data[0].z, dtype=float)
    ke = result.layers.pivot(index="layer", columns="idx", values="ke").to_numpy(dtype=bool)
    assert np.isnan(z[~ke]).all() and np.isfinite(z[ke]).all()
    assert len(fig.data) == 1  # blanks mark non-KE cells; no marker trace by default


def test_ke_cells_are_marked_where_ke_is_true(result):
    fig = plots.layer_heatmap(result, value="d2")
    expected = {(str(r.idx), int(r.layer)) for r in result.layers.itertuples() if r.ke}
    assert fig.data[1].type == "scatter" and fig.data[1].mode == "markers"
    assert _ke_cells(fig) == expected


def test_ke_marks_fall_back_to_tau_without_ke_column(result):
    layers = result.layers.drop(columns=["ke"])
    fig = plots.layer_heatmap(layers, value="d1", tau=0.5, mark_ke=True)
    expected = {(str(r.idx), int(r.layer)) for r in layers.itertuples() if r.d1 > 0.5}
    assert _ke_cells(fig) == expected


def test_sort_by_uds_puts_undefined_last(result):
    fig = plots.layer_heatmap(result, value="d1", sort_by="uds")
    order = [int(x) for x in fig.data[0].x]
    uds = result.examples.set_index("idx")["uds"]
    defined = [i for i in order if not np.isnan(uds[i])]
    assert defined == sorted(defined, key=lambda i: uds[i])
    assert order[-1] == 1  # example 1 has no KE layer


def test_sort_by_prompt_type_groups_examples(result):
    fig = plots.layer_heatmap(result, value="d1", sort_by="prompt_type")
    types = result.examples.set_index("idx")["prompt_type"]
    order_types = [types[int(x)] for x in fig.data[0].x]
    assert order_types == sorted(order_types)
    group_labels = {a.text for a in fig.layout.annotations}
    assert set(order_types) <= group_labels


def test_sorting_needs_examples_table(result):
    with pytest.raises(ValueError, match="examples table"):
        plots.layer_heatmap(result.layers, value="d1", sort_by="uds")


def test_hover_shows_question_entity_and_values(result):
    data = pd.DataFrame(
        {
            "idx": range(12),
            "question": [f"Who wrote book {i}?" for i in range(12)],
            "entity": [f"E{i}" for i in range(12)],
        }
    )
    fig = plots.layer_heatmap(result, value="d1", data=data, sort_by="idx")
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
    z_post = np.asarray(plots.layer_heatmap(result, value="d1", sort_by="idx").data[0].z, dtype=float)
    z_attn = np.asarray(
        plots.layer_heatmap(result, value="d1", site="attn_out", sort_by="idx").data[0].z, dtype=float
    )
    assert z_post.shape == z_attn.shape
    assert np.nanmax(z_attn) < np.nanmax(z_post)
    with pytest.raises(ValueError, match="site"):
        plots.layer_heatmap(result, site="mlp_out")


# ---------------------------------------------------------------------------------------------------------------------
# Curves, distributions, bars


def test_stage_curves_one_model(result):
    fig = plots.stage_curves(result)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["S1 (retain → full)", "S2 (unlearned → full)"]
    scored = result.examples.query("status == 'scored'")["idx"]
    expected = result.layers[result.layers["idx"].isin(scored)].groupby("layer")["d1"].mean()
    np.testing.assert_allclose(np.asarray(lines[0].y, dtype=float), expected.to_numpy())
    assert sum(1 for t in fig.data if t.fill == "toself") == 2


def test_stage_curves_overlay_shares_s1(results):
    fig = plots.stage_curves(results, band=None)
    names = [t.name for t in fig.data]
    assert names.count("S1 (retain → full)") == 1
    assert {"S2 · full", "S2 · npo", "S2 · retain"} <= set(names)
    assert not any(t.fill == "toself" for t in fig.data)


def test_stage_curves_scores(result):
    fig = plots.stage_curves(result, quantity="score")
    assert fig.layout.yaxis.title.text == "mean entity log-prob"
    assert any(shape.type == "line" for shape in fig.layout.shapes)  # the clean full score


@pytest.mark.parametrize("kind, trace_type", [("violin", "violin"), ("histogram", "histogram")])
def test_uds_distribution(results, kind, trace_type):
    fig = plots.uds_distribution(results, kind=kind)
    assert [t.type for t in fig.data] == [trace_type] * 3
    assert [t.name for t in fig.data] == list(results)
    values = fig.data[1].y if kind == "violin" else fig.data[1].x
    assert len(values) == results["npo"].examples["uds"].notna().sum()


def test_uds_bar_has_ci_error_bars(results):
    fig = plots.uds_bar(results)
    bar = fig.data[0]
    assert bar.type == "bar" and list(bar.x) == list(results)
    summary = results["npo"].summary
    assert bar.y[1] == pytest.approx(summary["uds"])
    assert bar.error_y.array[1] == pytest.approx(summary["ci95"][1] - summary["uds"])
    assert bar.error_y.arrayminus[1] == pytest.approx(summary["uds"] - summary["ci95"][0])


def test_uds_bar_by_role_and_bootstrap_when_ci_missing(results):
    stripped = {
        name: FakeResult(r.examples, r.layers, {k: v for k, v in r.summary.items() if k != "ci95"})
        for name, r in results.items()
    }
    fig = plots.uds_bar(stripped, roles={"full": "full", "npo": "unlearned", "retain": "retain"})
    assert [t.name for t in fig.data] == ["full", "unlearned", "retain"]
    npo = fig.data[1]
    low, high = npo.customdata[0]
    assert low < npo.y[0] < high


def test_model_frame_counts(results):
    frame = plots.model_frame(results)
    row = frame.set_index("model").loc["npo"]
    assert (row.n_scored, row.n_no_ke, row.n_skipped) == (10, 1, 1)


def test_prompt_type_bar(results):
    fig = plots.prompt_type_bar(results)
    assert [t.name for t in fig.data] == list(results)
    examples = results["npo"].examples.dropna(subset=["uds"])
    expected = examples.groupby("prompt_type", sort=False)["uds"].mean()
    got = dict(zip(fig.data[1].x, fig.data[1].y, strict=True))
    assert got == pytest.approx(expected.to_dict())


# ---------------------------------------------------------------------------------------------------------------------
# Components, lenses, RMU


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
    fig = plots.component_patching(table)
    assert len(fig.data) == 4
    assert [t.name for t in fig.data][0].startswith("attention output")  # canonical site order
    post = next(t for t in fig.data if "UDS" in t.name)
    np.testing.assert_allclose(post.y, table.query("site == 'resid_post'")["mean_d1"])
    both = plots.component_patching(table, stage="both")
    assert sum(t.line.dash == "dash" for t in both.data) == 4


def test_component_patching_from_long_layers():
    result = make_result(sites=("attn_out", "mlp_out", "resid_mid", "resid_post"))
    fig = plots.component_patching(result.layers)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    bands = [t for t in fig.data if t.fill == "toself"]
    assert len(lines) == 4 and len(bands) == 4


def test_lens_vs_uds_example(result):
    lens = make_lens_layers(result)
    fig = plots.lens_vs_uds_example(result, lens, idx=0)
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 2
    assert bars[0].name.startswith("UDS (patching): score")
    uds_0 = result.examples.set_index("idx").loc[0, "uds"]
    assert f"{uds_0:.3f}" in bars[0].name
    ke = result.layers.query("idx == 0 and site == 'resid_post'").sort_values("layer")["ke"].to_numpy()
    assert np.isnan(np.asarray(bars[0].y, dtype=float)[~ke]).all()
    with pytest.raises(ValueError, match="example 999"):
        plots.lens_vs_uds_example(result, lens, idx=999)


def test_lens_vs_uds_models(results):
    lens = {name: make_lens_layers(r) for name, r in results.items()}
    fig = plots.lens_vs_uds_models(results, lens)
    assert len(fig.data) == 2 * len(results)
    assert [a.text for a in fig.layout.annotations][: len(results)] == list(results)


def test_rmu_layer_profile_marks_targets():
    results = {
        "rmu_l1": make_result(erasure=0.3),
        "rmu_l4": make_result(erasure=0.6),
        "retain": make_result(erasure=1),
    }
    fig = plots.rmu_layer_profile(results)
    assert [t.name for t in fig.data] == list(results)
    assert sorted(shape.x0 for shape in fig.layout.shapes) == [1, 4]
    fig = plots.rmu_layer_profile(results, target_layers={"retain": 2})
    assert [shape.x0 for shape in fig.layout.shapes] == [2]


def test_layerwise_methods_panels_and_filter():
    layerwise = {
        model: pd.DataFrame(
            [{"method": m, "layer": layer, "erasure": 0.1 * layer, "weight": float(layer)}
             for m in ("uds", "logit_lens", "cka") for layer in range(4)]
        )
        for model in ("npo", "rmu_l1")
    }  # fmt: skip
    fig = plots.layerwise_methods(layerwise)
    assert len(fig.data) == 6 and [a.text for a in fig.layout.annotations] == ["npo", "rmu_l1"]
    assert sum(t.showlegend for t in fig.data) == 3
    sizes = np.asarray(fig.data[0].marker.size, dtype=float)
    assert sizes[0] < sizes[-1]  # marker size follows the layer weight
    pair = plots.layerwise_methods(layerwise, methods=["uds", "logit_lens"])
    assert {t.name for t in pair.data} == {"uds", "logit_lens"}
    with pytest.raises(ValueError, match="none of the requested"):
        plots.layerwise_methods(layerwise, methods=["fisher"])


def test_tau_curves():
    table = pd.DataFrame(
        {"model": ["a", "a", "b", "b"], "tau": [0.01, 0.05] * 2, "uds": [0.2, 0.3, 0.6, 0.7]}
    )
    fig = plots.tau_curves(table)
    assert [t.name for t in fig.data] == ["a", "b"]
    assert fig.layout.shapes[0].x0 == 0.05


def test_prompt_type_bar_from_summary_table():
    table = pd.DataFrame(
        {
            "model": ["m"] * 3,
            "prompt_type": ["yes_no", "name", "overall"],
            "n_scored": [3, 4, 7],
            "mean_uds": [0.6, 0.1, 0.3],
        }
    )
    fig = plots.prompt_type_bar(table)
    assert list(fig.data[0].x) == ["yes_no", "name", "overall"] and list(fig.data[0].text) == [
        "n=3",
        "n=4",
        "n=7",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Meta-evaluation and tokens


def test_pool_histograms_auc_and_panels():
    rng = np.random.default_rng(0)
    metrics = pd.DataFrame(
        {
            "model": [f"m{i}" for i in range(20)],
            "pool": ["P"] * 10 + ["N"] * 10,
            "uds": np.r_[rng.uniform(0, 0.3, 10), rng.uniform(0.6, 1, 10)],  # high = erased: P low
            "truth_ratio": np.r_[rng.uniform(0.6, 1, 10), rng.uniform(0, 0.3, 10)],  # high = knows: P high
        }
    )
    fig = plots.pool_histograms(metrics)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["uds (AUC 1.000)", "truth_ratio (AUC 1.000)"]
    assert len(fig.data) == 4 and {t.name for t in fig.data} == {"P pool", "N pool"}
    long = metrics.melt(id_vars=["model", "pool"], var_name="metric", value_name="value")
    assert [a.text for a in plots.pool_histograms(long).layout.annotations] == titles


@pytest.mark.parametrize("attack", ["quantization", "relearning"])
def test_robustness_scatter_has_identity_line(attack):
    table = pd.DataFrame(
        {
            "model": ["retain", "a", "b"] * 2,
            "metric": ["uds"] * 3 + ["rouge"] * 3,
            "before": [0.9, 0.2, 0.4, 0.1, 0.5, 0.6],
            "after": [0.8, 0.3, 0.4, 0.3, 0.3, 0.6],
        }
    )
    fig = plots.robustness_scatter(table, attack=attack)
    identity = [t for t in fig.data if t.name == "y = x"]
    assert len(identity) == 2 and list(identity[0].x) == list(identity[0].y)
    shifted = [t for t in fig.data if t.name == "y = x + Δ_ret"]
    assert len(shifted) == (2 if attack == "relearning" else 0)
    if shifted:
        assert shifted[0].y[0] - shifted[0].x[0] == pytest.approx(-0.1)
    stars = [t for t in fig.data if t.name == "retain"]
    assert stars and stars[0].marker.symbol == "star"


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
    fig = plots.token_logprobs(tokens)
    assert [t.type for t in fig.data] == ["bar", "bar", "heatmap"]
    assert list(fig.data[0].x)[2] == "2:␣Who" and list(fig.data[0].x)[3] == "3:\\n"
    np.testing.assert_allclose(fig.data[2].z[0], [0, 0, 0, 0, 2.0, 1.0])
    assert fig.data[2].zmid == 0.0
    (rect,) = [s for s in fig.layout.shapes if s.type == "rect"]
    assert (rect.x0, rect.x1) == (3.5, 5.5)
    with pytest.raises(ValueError, match="is_entity"):
        plots.token_logprobs(tokens.drop(columns=["is_entity"]))


# ---------------------------------------------------------------------------------------------------------------------
# One convention, one example, components, files


def test_one_dash_convention_across_figures(result, results):
    """S1/d1 solid and S2/d2 dashed wherever both stages are drawn."""
    stages = plots.stage_curves(results, band=None)
    dash = {t.name: t.line.dash for t in stages.data}
    assert dash["S1 (retain → full)"] == "solid" and dash["S2 · npo"] == "dash"
    example = plots.example_curves(result, 3)
    assert [t.line.dash for t in example.data if t.mode == "lines+markers"] == ["solid", "dash"]
    lens = plots.lens_vs_uds_example(result, make_lens_layers(result), idx=3)
    assert {t.line.dash for t in lens.data if t.name.endswith("ΔS1")} == {"solid"}
    assert {t.line.dash for t in lens.data if t.name.endswith("ΔS2")} == {"dash"}
    assert plots.DELTA_SCALE == "RdBu"  # TransformerLens/ARENA's diverging scale


def test_example_curves_band_title_and_tau(result):
    idx = 3
    fig = plots.example_curves(result, idx)
    uds = result.examples.set_index("idx").loc[idx, "uds"]
    assert f"UDS = {uds:.3f}" in fig.layout.title.text and "Entity 3" in fig.layout.title.text
    ke_layers = set(result.layers.query("idx == @idx and ke")["layer"])
    bands = {int(round((s.x0 + s.x1) / 2)) for s in fig.layout.shapes if s.type == "rect"}
    assert bands == ke_layers and 0 < len(ke_layers) < 6
    assert any(s.type == "line" and s.y0 == pytest.approx(0.05) for s in fig.layout.shapes)
    no_ke = plots.example_curves(result, 1)  # example 1 has no KE layer
    assert "undefined" in no_ke.layout.title.text
    with pytest.raises(ValueError, match="example 11"):
        plots.example_curves(result, 11)  # skipped: no layer rows


def test_component_heatmap_scales():
    grid = np.array([[0.2, -0.1, np.nan], [0.5, 0.0, -0.4]])
    deltas = plots.component_heatmap(grid, [0, 1], "head", "d1")
    assert deltas.layout.coloraxis.cmid == 0.0
    assert deltas.layout.coloraxis.cmin == -0.5 and deltas.layout.coloraxis.cmax == 0.5
    assert deltas.layout.xaxis.title.text == "head" and deltas.layout.yaxis.title.text == "layer"
    ratios = plots.component_heatmap(np.clip(grid, 0, 1), [0, 1], "head", "component_uds")
    assert (ratios.layout.coloraxis.cmin, ratios.layout.coloraxis.cmax) == (0.0, 1.0)


def test_save_writes_offline_html_and_falls_back_without_kaleido(result, tmp_path, monkeypatch):
    import builtins

    fig = plots.example_curves(result, 3)
    html_path = plots.save(fig, tmp_path / "fig.html")
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
        written = plots.save(fig, tmp_path / "sub" / "fig.png")
    assert written == tmp_path / "sub" / "fig.html" and written.is_file()
    with pytest.raises(ValueError, match="fig.txt"):
        plots.save(fig, tmp_path / "fig.txt")


def test_save_uses_kaleido_when_it_works(result, tmp_path, monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "kaleido", types.ModuleType("kaleido"))
    calls = []
    monkeypatch.setattr(go.Figure, "write_image", lambda self, path, **kw: calls.append((path, kw)))
    assert (
        plots.save(plots.example_curves(result, 3), tmp_path / "fig.svg", width=640) == tmp_path / "fig.svg"
    )
    assert calls and calls[0][1]["width"] == 640

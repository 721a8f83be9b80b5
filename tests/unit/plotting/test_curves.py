"""uds_lens/plotting/curves.py on synthetic UDSResults: stage, example, tau and lens curves; one dash convention."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers.synthetic import make_lens_layers

from uds_lens import plotting


def test_stage_curves_one_model(result):
    fig = plotting.stage_curves(result)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["S1 (retain → full)", f"S2 ({result.name} → full)"]
    assert fig.layout.title.text.startswith(f"{result.name}: ")  # the model is named
    assert (
        plotting.stage_curves(result.layers).data[-1].name == "S2 (unlearned → full)"
    )  # a bare table has no name
    scored = result.examples.query("status == 'scored'")["idx"]
    expected = result.layers[result.layers["idx"].isin(scored)].groupby("layer")["d1"].mean()
    np.testing.assert_allclose(np.asarray(lines[0].y, dtype=float), expected.to_numpy())
    assert sum(1 for t in fig.data if t.fill == "toself") == 2


def test_stage_curves_overlay_shares_s1(results):
    fig = plotting.stage_curves(results, band=None)
    names = [t.name for t in fig.data]
    assert names.count("S1 (retain → full)") == 1
    assert {"S2 · full", "S2 · npo", "S2 · retain"} <= set(names)
    assert not any(t.fill == "toself" for t in fig.data)


def test_stage_curves_scores(result):
    fig = plotting.stage_curves(result, quantity="score")
    assert fig.layout.yaxis.title.text == "mean entity log-prob (nats)"
    assert any(shape.type == "line" for shape in fig.layout.shapes)  # the clean full score


def test_lens_vs_uds_example(result):
    lens = make_lens_layers(result)
    fig = plotting.lens_vs_uds_example(result, lens, idx=0)
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 2
    assert bars[0].name.startswith("UDS (patching): score")
    uds_0 = result.examples.set_index("idx").loc[0, "uds"]
    assert f"{uds_0:.3f}" in bars[0].name
    ke = result.layers.query("idx == 0 and site == 'resid_post'").sort_values("layer")["ke"].to_numpy()
    assert np.isnan(np.asarray(bars[0].y, dtype=float)[~ke]).all()
    with pytest.raises(ValueError, match="example 999"):
        plotting.lens_vs_uds_example(result, lens, idx=999)


def test_lens_vs_uds_models(results):
    lens = {name: make_lens_layers(r) for name, r in results.items()}
    fig = plotting.lens_vs_uds_models(results, lens)
    assert len(fig.data) == 3 * len(results)  # UDS, the part of it from clipped cells, the lens
    assert [a.text for a in fig.layout.annotations][: len(results)] == list(results)


def test_layerwise_methods_panels_and_filter():
    layerwise = {
        model: pd.DataFrame(
            [{"method": m, "layer": layer, "erasure": 0.1 * layer, "weight": float(layer)}
             for m in ("uds", "logit_lens", "cka") for layer in range(4)]
        )
        for model in ("npo", "rmu_l1")
    }  # fmt: skip
    fig = plotting.layerwise_methods(layerwise)
    assert len(fig.data) == 6 and [a.text for a in fig.layout.annotations] == ["npo", "rmu_l1"]
    assert sum(t.showlegend for t in fig.data) == 3
    sizes = np.asarray(fig.data[0].marker.size, dtype=float)
    assert sizes[0] < sizes[-1]  # marker size follows the layer weight
    pair = plotting.layerwise_methods(layerwise, methods=["uds", "logit_lens"])
    assert {t.name for t in pair.data} == {"uds", "logit_lens"}
    with pytest.raises(ValueError, match="none of the requested"):
        plotting.layerwise_methods(layerwise, methods=["fisher"])


def test_tau_curves():
    table = pd.DataFrame(
        {"model": ["a", "a", "b", "b"], "tau": [0.01, 0.05] * 2, "uds": [0.2, 0.3, 0.6, 0.7]}
    )
    fig = plotting.tau_curves(table)
    assert [t.name for t in fig.data] == ["a", "b"]
    assert fig.layout.shapes[0].x0 == 0.05


def test_one_dash_convention_across_figures(result, results):
    """S1/d1 solid and S2/d2 dashed wherever both stages are drawn."""
    stages = plotting.stage_curves(results, band=None)
    dash = {t.name: t.line.dash for t in stages.data}
    assert dash["S1 (retain → full)"] == "solid" and dash["S2 · npo"] == "dash"
    example = plotting.example_curves(result, 3)
    assert [t.line.dash for t in example.data if t.mode == "lines+markers"] == ["solid", "dash"]
    lens = plotting.lens_vs_uds_example(result, make_lens_layers(result), idx=3)
    assert {t.line.dash for t in lens.data if t.name.endswith("ΔS1")} == {"solid"}
    assert {t.line.dash for t in lens.data if t.name.endswith("ΔS2")} == {"dash"}
    assert plotting.DELTA_SCALE == "RdBu"  # TransformerLens/ARENA's diverging scale


def test_example_curves_band_title_and_tau(result):
    idx = 3
    fig = plotting.example_curves(result, idx)
    uds = result.examples.set_index("idx").loc[idx, "uds"]
    assert f"UDS = {uds:.3f}" in fig.layout.title.text and "Entity 3" in fig.layout.title.text
    ke_layers = set(result.layers.query("idx == @idx and ke")["layer"])
    bands = {int(round((s.x0 + s.x1) / 2)) for s in fig.layout.shapes if s.type == "rect"}
    assert bands == ke_layers and 0 < len(ke_layers) < 6
    assert any(s.type == "line" and s.y0 == pytest.approx(0.05) for s in fig.layout.shapes)
    no_ke = plotting.example_curves(result, 1)  # example 1 has no KE layer
    assert "undefined" in no_ke.layout.title.text
    with pytest.raises(ValueError, match="example 11"):
        plotting.example_curves(result, 11)  # skipped: no layer rows


def test_stage_curves_state_their_basis_and_keep_both_bands_readable(result):
    """n and tau in the title, tau drawn; S1's band plain, S2's hatched, so where they overlap both stay visible
    (two translucent fills of one hue blended into one colour)."""
    fig = plotting.stage_curves(result)
    scored = int((result.examples["status"] == "scored").sum())
    assert f"n = {scored} examples" in fig.layout.title.text and "tau = 0.05 nats" in fig.layout.title.text
    bands = [t for t in fig.data if t.fill == "toself"]
    assert not bands[0].fillpattern.shape and bands[1].fillpattern.shape == "/"
    assert any(a.text.startswith("tau = 0.05 nats") for a in fig.layout.annotations)


def test_example_title_fits_a_column_and_names_its_basis(result):
    """Every title line fits the docs column (wrapped between words, never cut inside one), and the figure says it
    rests on one example at tau = 0.05 nats."""
    import re

    from uds_lens.plotting.style import TITLE_WIDTH

    fig = plotting.example_curves(result, 3)
    title = fig.layout.title.text
    assert "n = 1 example" in title and "tau = 0.05 nats" in title
    for line in title.split("<br>"):
        text = re.sub(r"<[^>]+>", "", line)
        limit = TITLE_WIDTH if not line.startswith("<sup>") else int(1.5 * TITLE_WIDTH)
        assert len(text) <= limit, line
    question = result.examples.set_index("idx").loc[3, "question"]
    assert question in re.sub(r"<[^>]+>", "", title.replace("<br>", " "))


def test_wrap_words_breaks_between_words_only():
    from uds_lens.plotting.style import wrap_words

    text = "npo: example 12: UDS = 1.000 from 4 of 4 KE layers clipped (the unlearned patch hurts more)"
    lines = wrap_words(text, 30)
    assert " ".join(lines) == text and all(len(line) <= 30 for line in lines)
    assert wrap_words("a-very-long-single-token", 5) == ["a-very-long-single-token"]

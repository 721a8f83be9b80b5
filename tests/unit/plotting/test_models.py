"""uds_lens/plotting/models.py on synthetic UDSResults: the model table, UDS bars and CIs, distributions, prompt types, RMU profile."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pandas as pd
import pytest
from helpers.synthetic import make_result

from uds_lens import plotting


def test_uds_distribution_draws_each_model_beside_its_measured_part(results):
    """A violin per model: UDS_i on the right half, its measured part on the left; the examples resting mostly on
    clipped cells are the selected (red) points. The histogram overlays the two."""
    models = {**results, "damaged": make_result("damaged", erasure=2.0)}
    fig = plotting.uds_distribution(models)
    assert [t.type for t in fig.data] == ["violin"] * 2 * len(models)
    halves = {t.name: t for t in fig.data}
    for name, result in models.items():
        examples = result.examples.dropna(subset=["uds"])
        measured, total = halves[f"{name}: measured part"], halves[name]
        assert (measured.side, total.side) == ("negative", "positive")
        assert list(total.y) == pytest.approx(list(examples["uds"]))
        assert list(measured.y) == pytest.approx(list(examples["uds_unclipped"]))
        mostly = list((examples["uds_clipped"] > examples["uds_unclipped"]).to_numpy().nonzero()[0])
        assert list(total.selectedpoints) == mostly
    assert len(halves["damaged"].selectedpoints) == len(models["damaged"].examples.dropna(subset=["uds"]))
    assert "rests mostly on clipped cells" in fig.layout.title.text
    histogram = plotting.uds_distribution(results, kind="histogram")
    assert [t.name for t in histogram.data] == [
        n for name in results for n in (name, f"{name}: measured part")
    ]
    with pytest.raises(ValueError, match="kind"):
        plotting.uds_distribution(results, kind="box")


def _ci_trace(fig):
    return next(trace for trace in fig.data if trace.type == "scatter")


def test_uds_bar_has_ci_error_bars(results):
    fig = plotting.uds_bar(results)
    ci = _ci_trace(fig)
    assert list(ci.x) == list(results)
    summary = results["npo"].summary
    assert ci.y[1] == pytest.approx(summary["uds"])
    assert ci.error_y.array[1] == pytest.approx(summary["ci95"][1] - summary["uds"])
    assert ci.error_y.arrayminus[1] == pytest.approx(summary["uds"] - summary["ci95"][0])


def test_uds_bar_by_role(results):
    fig = plotting.uds_bar(results, roles={"full": "full", "npo": "unlearned", "retain": "retain"})
    bars = fig.data[0]
    assert list(bars.x) == list(results)
    uds, low, high, *_, role = bars.customdata[1]
    assert (low, high) == pytest.approx(results["npo"].ci95) and low < uds < high and role == "unlearned"
    assert list(bars.marker.color) == [plotting.model_colour(name) for name in results]


def test_uds_bar_splits_each_bar_into_its_measured_and_clipped_parts(results):
    """The bar of a model whose patches disrupt twice as much as retain's is all hatched (its UDS rests on clipped
    cells), a model that erases part of the fact (d2 = 0.4 d1) plain: the two parts stack to UDS, and each bar is
    labelled with its clipped share."""
    models = {**results, "damaged": make_result("damaged", erasure=2.0)}
    fig = plotting.uds_bar(models)
    measured, clipped = fig.data[0], fig.data[1]
    assert measured.type == clipped.type == "bar" and fig.layout.barmode == "stack"
    assert clipped.marker.pattern.shape == "/" and not measured.marker.pattern.shape
    for position, name in enumerate(models):
        split = models[name].split
        assert measured.y[position] + clipped.y[position] == pytest.approx(models[name].uds, abs=1e-12)
        assert clipped.y[position] == pytest.approx(split["uds_clipped"], abs=1e-12)
    assert clipped.y[3] > 0.9 and clipped.y[1] < 0.01  # damaged vs npo
    shares = {a.x: a.text for a in fig.layout.annotations}
    assert (
        shares["damaged"] == f"{models['damaged'].split['uds_clipped_share']:.0%}" and shares["npo"] == "0%"
    )


def _points(fig, name):
    return next(trace for trace in fig.data if trace.name and trace.name.startswith(name))


def test_depth_vs_damage_plots_the_measured_part_with_its_intervals(results):
    """y is the measured part of UDS (not UDS, which climbs with clipped cells), with its bootstrap CI; x the excess
    disruption with its CI; an open marker at UDS with UDS's CI, and a line from one to the other per model."""
    models = {**results, "damaged": make_result("damaged", erasure=2.0)}
    fig = plotting.depth_vs_damage(models)
    measured, total = _points(fig, "measured part"), _points(fig, "UDS")
    place = {name: (x, y) for name, x, y in zip(measured.text, measured.x, measured.y, strict=True)}
    assert place["full"] == pytest.approx((0.0, 0.0), abs=0.02) and place["npo"][0] < 0.01
    for position, name in enumerate(measured.text):
        split, cis = models[name].split, models[name].split_ci95
        assert measured.y[position] == pytest.approx(split["uds_unclipped"], abs=1e-12)
        assert measured.x[position] == pytest.approx(split["excess_disruption"], abs=1e-12)
        low, high = cis["uds_unclipped"]
        assert measured.error_y.array[position] == pytest.approx(high - split["uds_unclipped"], abs=1e-12)
        assert measured.error_y.arrayminus[position] == pytest.approx(split["uds_unclipped"] - low, abs=1e-12)
        low, high = cis["excess_disruption"]
        assert measured.error_x.array[position] == pytest.approx(high - split["excess_disruption"], abs=1e-12)
        assert total.y[position] == pytest.approx(models[name].uds, abs=1e-12)
        assert total.error_y.array[position] == pytest.approx(
            models[name].ci95[1] - models[name].uds, abs=1e-12
        )
    # the damaging model's UDS is about 1, all of it clipped: its measured part sits at the bottom, far right
    x, y = place["damaged"]
    assert models["damaged"].uds > 0.9 and y < 0.1 and x > 0.5
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(lines) == len(models) and list(lines[3].y) == pytest.approx([y, models["damaged"].uds])
    assert "measured part" in fig.layout.yaxis.title.text and "95%" in fig.layout.title.text
    with pytest.raises(ValueError, match="excess_disruption"):
        plotting.depth_vs_damage(pd.DataFrame({"model": ["a"], "uds": [0.5]}))


def test_a_figure_of_uds_carries_the_split_and_its_intervals(results):
    """Every model-level figure of UDS shows the two parts apart and the bootstrap intervals: the bar chart's measured
    part has its own CI, besides UDS's; its hover gives the clipped part's and the excess's."""
    models = {**results, "damaged": make_result("damaged", erasure=2.0)}
    fig = plotting.uds_bar(models)
    measured = fig.data[0]
    for position, name in enumerate(models):
        split, (low, high) = models[name].split, models[name].split_ci95["uds_unclipped"]
        assert measured.error_y.array[position] == pytest.approx(high - split["uds_unclipped"], abs=1e-12)
        assert measured.error_y.arrayminus[position] == pytest.approx(split["uds_unclipped"] - low, abs=1e-12)
        custom = measured.customdata[position]
        assert list(custom[7:13]) == pytest.approx(
            [bound for key in ("uds_unclipped", "uds_clipped", "excess_disruption")
             for bound in models[name].split_ci95[key]]
        )  # fmt: skip
    assert "clipped part" in measured.hovertemplate and "excess disruption" in measured.hovertemplate
    frame = plotting.model_frame(models).set_index("model")
    assert frame.loc["npo", "uds_clipped_ci_high"] == pytest.approx(
        models["npo"].split_ci95["uds_clipped"][1]
    )
    assert frame.loc["npo", "dtype"] is None  # a synthetic result records no format


def test_every_model_figure_states_n_and_tau(results):
    """A figure says what it rests on: the number of examples and tau with its value and unit."""
    figures = {
        "uds_bar": plotting.uds_bar(results),
        "depth_vs_damage": plotting.depth_vs_damage(results),
        "uds_distribution": plotting.uds_distribution(results),
        "prompt_type_bar": plotting.prompt_type_bar(results),
        "rmu_layer_profile": plotting.rmu_layer_profile(results),
    }
    for name, fig in figures.items():
        title = fig.layout.title.text
        # 10 scored examples; the layer profile counts the 11 with layer rows (one has no KE layer)
        assert re.search(r"n = 1[01] examples", title) and "tau = 0.05 nats" in title, (name, title)


def test_one_colour_per_model_whatever_the_figure_or_order(results):
    """A model's colour in the bar chart, the curves, the distributions and the RMU profile is one colour, and
    drawing the models in another order or company does not change it."""
    names = list(results)
    reordered = {name: results[name] for name in reversed(names)}
    colours: dict[str, set[str]] = {name: set() for name in names}
    bars = plotting.uds_bar(reordered).data[0]
    for name, colour in zip(bars.x, bars.marker.color, strict=True):
        colours[name].add(colour)
    for trace in plotting.uds_distribution(results).data + plotting.uds_distribution(reordered).data:
        if trace.name in colours:  # the other half is the measured part's, paler
            colours[trace.name].add(trace.line.color)
    for trace in plotting.prompt_type_bar({"npo": results["npo"]}).data:
        if trace.name in colours:  # the hatched clipped part is a pale fill with this colour's hatching
            colours[trace.name].add(trace.marker.color)
    for trace in plotting.rmu_layer_profile(reordered).data:
        colours[trace.name.removesuffix(": from clipped cells")].add(trace.line.color)
    for trace in plotting.stage_curves(results, band=None).data:
        if trace.name.startswith("S2 · "):
            colours[trace.name.removeprefix("S2 · ")].add(trace.line.color)
    assert all(len(found) == 1 for found in colours.values()), colours
    assert len({found.pop() for found in colours.values()}) == len(names)  # and no two models share one
    assert (
        plotting.model_colour("full") == plotting.model_colour("zoo:full") != plotting.model_colour("retain")
    )


def test_model_frame_carries_the_clipped_share(results):
    frame = plotting.model_frame(results).set_index("model")
    for name, result in results.items():
        assert frame.loc[name, "clipped_share"] == pytest.approx(result.clipped["clipped_share"], nan_ok=True)
    bare = {
        name: SimpleNamespace(examples=r.examples, layers=r.layers, settings=r.settings)
        for name, r in results.items()
    }
    counted = plotting.model_frame(bare).set_index("model")
    assert counted["clipped_share"].to_numpy() == pytest.approx(
        frame["clipped_share"].to_numpy(), nan_ok=True
    )


def test_model_frame_without_summary_uses_the_package_bootstrap(results):
    """A table of examples alone gets the UDS and CI that UDSResult reports for the same examples."""
    bare = {name: SimpleNamespace(examples=r.examples) for name, r in results.items()}
    frame = plotting.model_frame(bare).set_index("model")
    for name, result in results.items():
        assert frame.loc[name, "uds"] == pytest.approx(result.uds)
        assert (frame.loc[name, "ci_low"], frame.loc[name, "ci_high"]) == pytest.approx(result.ci95)
    assert (frame.loc["npo", ["n_scored", "n_no_ke", "n_skipped"]] == [10, 1, 1]).all()


def test_model_frame_counts(results):
    frame = plotting.model_frame(results)
    row = frame.set_index("model").loc["npo"]
    assert (row.n_scored, row.n_no_ke, row.n_skipped) == (10, 1, 1)


def test_prompt_type_bar_splits_each_mean_into_its_measured_and_clipped_parts(results):
    fig = plotting.prompt_type_bar(results)
    assert [t.name for t in fig.data if t.showlegend is not False] == list(results)
    examples = results["npo"].examples.dropna(subset=["uds"])
    means = examples.groupby("prompt_type", sort=False)[["uds", "uds_clipped"]].mean()
    measured, clipped = fig.data[2], fig.data[3]  # npo's two parts, in one offset group
    assert measured.name == "npo" and clipped.name == "npo: clipped part" and measured.offsetgroup == "npo"
    got = {x: m + c for x, m, c in zip(measured.x, measured.y, clipped.y, strict=True)}
    assert got == pytest.approx(means["uds"].to_dict())
    assert list(clipped.base) == pytest.approx(list(measured.y)) and clipped.marker.pattern.shape == "/"
    assert "hatched: the part from clipped cells" in fig.layout.title.text


def test_prompt_type_bar_from_summary_table():
    table = pd.DataFrame(
        {
            "model": ["m"] * 3,
            "prompt_type": ["yes_no", "name", "overall"],
            "n_scored": [3, 4, 7],
            "mean_uds": [0.6, 0.1, 0.3],
        }
    )
    fig = plotting.prompt_type_bar(table)
    assert list(fig.data[0].x) == ["yes_no", "name", "overall"] and list(fig.data[0].text) == [
        "n=3",
        "n=4",
        "n=7",
    ]


def test_rmu_layer_profile_draws_the_part_from_clipped_cells():
    """The dotted line of a layer is the share of its KE cells that are clipped, the part of its mean LER they give
    (each adds exactly 1): all of it for a model that disrupts twice as much as retain, none for a partial eraser."""
    results = {"rmu_l1": make_result(erasure=2.0), "npo": make_result(erasure=0.3)}
    fig = plotting.rmu_layer_profile(results)
    traces = {t.name: t for t in fig.data}
    mean, part = traces["rmu_l1"], traces["rmu_l1: from clipped cells"]
    assert list(part.x) == list(mean.x) and part.line.dash == "dot"
    layers = results["rmu_l1"].layers
    ke = layers[layers["ke"]]
    expected = (ke["d2"] > ke["d1"]).groupby(ke["layer"]).mean()
    assert list(part.y) == pytest.approx(list(expected.reindex(mean.x)))
    assert max(traces["npo: from clipped cells"].y) < 0.2 < min(part.y)
    assert "dotted: the part from clipped cells" in fig.layout.title.text


def test_rmu_layer_profile_marks_targets():
    results = {
        "rmu_l1": make_result(erasure=0.3),
        "rmu_l4": make_result(erasure=0.6),
        "retain": make_result(erasure=1),
    }
    fig = plotting.rmu_layer_profile(results)
    assert [t.name for t in fig.data] == [
        n for name in results for n in (name, f"{name}: from clipped cells")
    ]
    assert sorted(shape.x0 for shape in fig.layout.shapes) == [1, 4]
    fig = plotting.rmu_layer_profile(results, target_layers={"retain": 2})
    assert [shape.x0 for shape in fig.layout.shapes] == [2]

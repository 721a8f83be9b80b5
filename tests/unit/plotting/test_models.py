"""uds_lens/plotting/models.py on synthetic UDSResults: the model table, UDS bars and CIs, distributions, prompt types, RMU profile."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pandas as pd
import pytest
from helpers.synthetic import make_result

from uds_lens import plotting


@pytest.mark.parametrize("kind, trace_type", [("violin", "violin"), ("histogram", "histogram")])
def test_uds_distribution(results, kind, trace_type):
    fig = plotting.uds_distribution(results, kind=kind)
    assert [t.type for t in fig.data] == [trace_type] * 3
    assert [t.name for t in fig.data] == list(results)
    values = fig.data[1].y if kind == "violin" else fig.data[1].x
    assert len(values) == results["npo"].examples["uds"].notna().sum()


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


def test_depth_vs_damage_sets_a_damaging_model_apart_from_retain(results):
    models = {**results, "damaged": make_result("damaged", erasure=2.0)}
    fig = plotting.depth_vs_damage(models)
    points = fig.data[0]
    place = {name: (x, y) for name, x, y in zip(points.text, points.x, points.y, strict=True)}
    assert place["full"] == pytest.approx((0.0, 0.0), abs=0.02) and place["npo"][0] < 0.01
    # the synthetic retain is retain plus noise: UDS about 1 with a little excess, far from the damaged model's
    x, y = place["damaged"]
    assert y > 0.9 and x == pytest.approx(models["damaged"].split["excess_disruption"]) and x > 0.5
    assert place["retain"][1] > 0.9 and place["retain"][0] < 0.1
    with pytest.raises(ValueError, match="excess_disruption"):
        plotting.depth_vs_damage(pd.DataFrame({"model": ["a"], "uds": [0.5]}))


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
        colours[trace.name].add(trace.line.color)
    for trace in plotting.prompt_type_bar({"npo": results["npo"]}).data:
        colours[trace.name].add(trace.marker.color)
    for trace in plotting.rmu_layer_profile(reordered).data:
        colours[trace.name].add(trace.line.color)
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


def test_prompt_type_bar(results):
    fig = plotting.prompt_type_bar(results)
    assert [t.name for t in fig.data] == list(results)
    examples = results["npo"].examples.dropna(subset=["uds"])
    expected = examples.groupby("prompt_type", sort=False)["uds"].mean()
    got = dict(zip(fig.data[1].x, fig.data[1].y, strict=True))
    assert got == pytest.approx(expected.to_dict())


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


def test_rmu_layer_profile_marks_targets():
    results = {
        "rmu_l1": make_result(erasure=0.3),
        "rmu_l4": make_result(erasure=0.6),
        "retain": make_result(erasure=1),
    }
    fig = plotting.rmu_layer_profile(results)
    assert [t.name for t in fig.data] == list(results)
    assert sorted(shape.x0 for shape in fig.layout.shapes) == [1, 4]
    fig = plotting.rmu_layer_profile(results, target_layers={"retain": 2})
    assert [shape.x0 for shape in fig.layout.shapes] == [2]

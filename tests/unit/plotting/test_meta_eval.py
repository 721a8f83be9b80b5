"""uds_lens/plotting/meta_eval.py on the tables uds_lens.meta_eval writes: pool histograms, robustness scatter."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from uds_lens import plotting
from uds_lens.meta_eval.formulas import faithfulness_auc, robustness_table


@pytest.fixture(scope="module")
def metrics() -> pd.DataFrame:
    """``metrics.csv`` as run_meta_eval writes it: index = model, its zoo role, one column per metric."""
    rng = np.random.default_rng(0)
    names = (
        [f"pos{i}" for i in range(10)] + [f"neg{i}" for i in range(10)] + ["unl0", "unl1", "full", "retain"]
    )
    frame = pd.DataFrame(index=pd.Index(names, name="model"))
    frame["role"] = ["pos"] * 10 + ["neg"] * 10 + ["unlearned", "unlearned", "full", "retain"]
    # Overlapping pools, so the AUCs are neither 0.5 nor 1; uds is high = erased (P should be low), prob high = knows.
    frame["uds"] = np.r_[rng.uniform(0, 0.6, 10), rng.uniform(0.3, 1, 10), 0.9, 0.5, 0.0, 1.0]
    frame["prob"] = np.r_[rng.uniform(0.3, 1, 10), rng.uniform(0, 0.6, 10), 0.1, 0.3, 0.95, 0.1]
    frame["model_utility"] = 0.5
    return frame


def test_pool_histograms_show_the_meta_evaluation_auc(metrics):
    fig = plotting.pool_histograms(metrics.reset_index())
    pools = {"pos": metrics.index[metrics["role"] == "pos"], "neg": metrics.index[metrics["role"] == "neg"]}
    expected = {
        metric: faithfulness_auc(
            metrics.loc[pools["pos"], metric].to_numpy(), metrics.loc[pools["neg"], metric].to_numpy(), knows
        )
        for metric, knows in (("uds", False), ("prob", True), ("model_utility", True))
    }
    assert 0.6 < expected["uds"] < 1.0 and 0.6 < expected["prob"] < 1.0
    titles = {a.text.split(" ")[0]: a.text for a in fig.layout.annotations}
    for metric in ("uds", "prob"):
        assert titles[metric] == f"{metric} (AUC {expected[metric]:.3f})"
    # Only the two pools are drawn: unlearned, full and retain are not in the P or N pool.
    assert {t.name for t in fig.data} == {"pos pool", "neg pool"}
    assert sum(len(t.x) for t in fig.data if t.legendgroup == "pos") == 10 * len(titles)
    long = metrics.reset_index().melt(id_vars=["model", "role"], var_name="metric", value_name="value")
    assert [a.text for a in plotting.pool_histograms(long).layout.annotations] == [
        a.text for a in fig.layout.annotations
    ]
    with pytest.raises(ValueError, match="'P' and 'N' pools"):
        plotting.pool_histograms(metrics, positive="P", negative="N")


def test_robustness_scatter_reads_the_meta_evaluation_table(metrics):
    """``robustness.csv`` holds both attacks (``quantisation``, ``relearning``); each figure draws its own rows."""
    unlearned = ["unl0", "unl1"]
    quant = metrics.loc[unlearned, ["uds", "prob"]] * 0.9
    relearn = metrics.loc[[*unlearned, "retain"], ["uds", "prob"]] - 0.1
    pools = {"pos": [f"pos{i}" for i in range(10)], "neg": [f"neg{i}" for i in range(10)]}
    table = robustness_table(metrics, pools, quant, relearn, apply_faithfulness_filter=False)
    assert set(table["attack"]) == {"quantisation", "relearning"}
    for attack in ("quantisation", "relearning"):
        fig = plotting.robustness_scatter(table, attack=attack)
        first_panel = table["metric"].iloc[0]
        rows = table[(table["attack"] == attack) & (table["metric"] == first_panel)]
        (points,) = [t for t in fig.data if t.name == "models" and t.xaxis == "x"]
        assert list(points.text) == list(rows["model"])
        np.testing.assert_allclose(points.x, rows["before"])
        np.testing.assert_allclose(points.y, rows["after"])
    assert "quantisation" in plotting.robustness_scatter(table).layout.title.text
    with pytest.raises(ValueError, match="attack must be"):
        plotting.robustness_scatter(table, attack="quantization")
    with pytest.raises(ValueError, match="no 'relearning' rows"):
        plotting.robustness_scatter(table[table["attack"] == "quantisation"], attack="relearning")


@pytest.mark.parametrize("attack", ["quantisation", "relearning"])
def test_robustness_scatter_has_identity_line_and_retain_shift(attack):
    table = pd.DataFrame(
        {
            "model": ["retain", "a", "b"] * 2,
            "metric": ["uds"] * 3 + ["rouge"] * 3,
            "before": [0.9, 0.2, 0.4, 0.1, 0.5, 0.6],
            "after": [0.8, 0.3, 0.4, 0.3, 0.3, 0.6],
        }
    )
    fig = plotting.robustness_scatter(table, attack=attack)
    identity = [t for t in fig.data if t.name == "y = x"]
    assert len(identity) == 2 and list(identity[0].x) == list(identity[0].y)
    shifted = [t for t in fig.data if t.name == "y = x + Δ_ret"]
    assert len(shifted) == (2 if attack == "relearning" else 0)
    if shifted:
        assert shifted[0].y[0] - shifted[0].x[0] == pytest.approx(-0.1)
    stars = [t for t in fig.data if t.name == "retain"]
    assert stars and stars[0].marker.symbol == "star"

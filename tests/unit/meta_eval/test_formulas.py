"""uds_lens/meta_eval/formulas.py: symmetric Q/R, faithfulness direction, filters, the robustness and meta tables."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from uds_lens.meta_eval.formulas import (
    META_EVAL_COLUMNS,
    QUANTISATION,
    RELEARNING,
    ROBUSTNESS_COLUMNS,
    faithfulness_auc,
    faithfulness_threshold,
    meta_evaluate,
    quantisation_q,
    relearning_r,
    robustness_table,
    utility_filter,
)
from uds_lens.meta_eval.paper import METRIC_KEYS
from uds_lens.metrics.memorization import harmonic_mean


@pytest.mark.parametrize("value", [0.0, 0.3, 1.0, -0.2])
def test_q_is_one_without_change(value) -> None:
    assert quantisation_q(value, value) == pytest.approx(1.0)


def test_q_is_symmetric_and_penalises_both_directions() -> None:
    assert quantisation_q(0.4, 0.6) == pytest.approx(quantisation_q(0.6, 0.4))
    assert quantisation_q(0.4, 0.6) == pytest.approx(1 - 0.2 / 1.0)
    assert quantisation_q(0.5, 0.0) == pytest.approx(0.0, abs=1e-8)
    assert np.allclose(quantisation_q([0.2, 0.5], [0.2, 0.25]), [1.0, 1 - 0.25 / 0.75])


def test_r_symmetric_in_models_and_orientation() -> None:
    r = relearning_r(0.2, 0.7, 0.3, 0.4)  # Δ_unl 0.5, Δ_ret 0.1
    assert r == pytest.approx(1 - 0.4 / 0.6)
    assert relearning_r(0.3, 0.4, 0.2, 0.7) == pytest.approx(r)  # swap unlearned and retain
    assert relearning_r(1 - 0.2, 1 - 0.7, 1 - 0.3, 1 - 0.4) == pytest.approx(r)  # 1 - x orientation
    assert relearning_r(0.2, 0.5, 0.6, 0.9) == pytest.approx(1.0)  # same shift as retain
    assert relearning_r(0.2, 0.2, 0.6, 0.6) == pytest.approx(1.0)  # nothing moves
    assert relearning_r(0.2, 0.6, 0.5, 0.1) == pytest.approx(0.0, abs=1e-8)  # opposite shifts


def test_harmonic_mean_with_zeros() -> None:
    assert harmonic_mean([0.0, 0.9]) < 1e-10
    assert harmonic_mean([0.8, 0.8]) == pytest.approx(0.8)


def test_faithfulness_inverts_erasure_metrics() -> None:
    p_uds, n_uds = [0.1, 0.2, 0.3], [0.7, 0.8, 0.9]  # P pool knows: low UDS
    assert faithfulness_auc(p_uds, n_uds, higher_means_knowledge=False) == pytest.approx(1.0)
    assert faithfulness_auc(p_uds, n_uds, higher_means_knowledge=True) == pytest.approx(0.0)
    assert faithfulness_auc([0.9, 0.8], [0.1, 0.2], higher_means_knowledge=True) == pytest.approx(1.0)
    assert math.isnan(faithfulness_auc([0.9], [0.1, 0.2], True))
    threshold = faithfulness_threshold(p_uds, n_uds, higher_means_knowledge=False)
    assert 1 - 0.7 < threshold <= 1 - 0.3  # between the pools in knowledge units


def _synthetic_frames():
    rng = np.random.default_rng(0)
    names = [f"pos{i}" for i in range(4)] + [f"neg{i}" for i in range(4)] + [f"unl{i}" for i in range(3)]
    roles = ["pos"] * 4 + ["neg"] * 4 + ["unlearned"] * 3
    frame = pd.DataFrame(index=[*names, "full", "retain"])
    frame["role"] = [*roles, "full", "retain"]
    # "uds": perfectly separating (P low), stable under attacks; "prob": separating, unstable.
    frame["uds"] = [0.1, 0.15, 0.2, 0.25, 0.8, 0.85, 0.9, 0.95, 0.9, 0.92, 0.6, 0.0, 1.0]
    frame["prob"] = [0.9, 0.8, 0.85, 0.7, 0.2, 0.1, 0.15, 0.3, 0.1, 0.12, 0.2, 0.95, 0.1]
    frame["model_utility"] = [0.5] * 11 + [0.5, 0.45]
    frame.loc["unl2", "model_utility"] = 0.1  # fails the utility filter
    quant = frame.loc[["unl0", "unl1", "unl2"], ["uds", "prob"]].copy()
    quant["prob"] = quant["prob"] * 0.5 + rng.uniform(0, 0.01, 3)
    relearn = frame.loc[["unl0", "unl1", "unl2", "retain"], ["uds", "prob"]].copy()
    relearn["prob"] = relearn["prob"] + np.array([0.6, 0.6, 0.6, 0.05])
    pools = {"pos": names[:4], "neg": names[4:8]}
    return frame, pools, quant, relearn


def test_meta_evaluate_table_shape_and_values() -> None:
    frame, pools, quant, relearn = _synthetic_frames()
    table = meta_evaluate(frame, pools, robustness_table(frame, pools, quant, relearn))
    assert list(table.columns) == META_EVAL_COLUMNS
    assert list(table["metric"]) == list(METRIC_KEYS)
    row = table.set_index("metric")
    assert row.at["uds", "faithfulness"] == pytest.approx(1.0)
    assert row.at["uds", "q"] == pytest.approx(1.0) and row.at["uds", "r"] == pytest.approx(1.0)
    assert row.at["uds", "overall"] == pytest.approx(1.0)
    assert row.at["uds", "n_models_q"] == 2  # unl2 is dropped by the utility filter
    assert row.at["prob", "q"] < 0.8 and row.at["prob", "r"] < 0.3
    assert row.at["prob", "robustness"] == pytest.approx(
        harmonic_mean([row.at["prob", "q"], row.at["prob", "r"]])
    )
    assert np.isnan(row.at["cka", "faithfulness"]) and row.at["cka", "n_models_q"] == 0


def test_robustness_table_names_the_attacks_as_the_contract_says() -> None:
    frame, pools, quant, relearn = _synthetic_frames()
    details = robustness_table(frame, pools, quant, relearn)
    assert list(details.columns) == ROBUSTNESS_COLUMNS
    assert set(details["attack"]) == {QUANTISATION, RELEARNING} == {"quantisation", "relearning"}
    # the P/N pools are read under the zoo's role names
    assert set(pools) == {"pos", "neg"}


def test_filters_drop_low_utility_and_not_unlearned_models() -> None:
    frame, pools, quant, relearn = _synthetic_frames()
    assert not utility_filter(frame)["unl2"] and utility_filter(frame)["unl0"]
    frame.loc["unl0", "uds"] = 0.05  # looks like a P model for UDS: not "unlearned" by the UDS threshold
    details = robustness_table(frame, pools, quant, relearn)
    uds = details[(details["metric"] == "uds") & details["passed"]]
    assert set(uds["model"]) == {"unl1"}

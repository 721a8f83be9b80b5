"""The score formula (``uds.py``): UDS by hand, the long-table adapter, the deltas and the bootstrap CI.

The auditor that runs the models (invariants, the S1 cache, result reuse) is tested in ``test_auditor.py``.
"""

import numpy as np
import pandas as pd
import pytest

from uds_lens.uds import (
    bootstrap_ci,
    deltas,
    example_uds,
    excess_disruption,
    layer_erasure_ratio,
    model_uds,
    mostly_clipped,
    rescore,
    uds_parts,
)

# The split's two parts are UDS's own numerator terms summed in two groups instead of one (float64): they add up to
# UDS to a few ulps of a number <= 1; the bound, far above that and far below any real difference.
SPLIT_TOLERANCE = 1e-12


def test_formula_by_hand():
    d1 = np.array([[0.5, 0.04, 1.0, 0.2], [0.01, 0.02, 0.0, -0.3]])
    d2 = np.array([[0.25, 9.0, 2.0, -0.1], [0.5, 0.5, 0.5, 0.5]])
    uds = example_uds(d1, d2, tau=0.05)
    # KE = {0, 2, 3}: (0.5*0.5 + 1.0*1 + 0.2*0) / (0.5 + 1.0 + 0.2)
    assert uds[0] == pytest.approx((0.25 + 1.0) / 1.7)
    assert np.isnan(uds[1])
    assert layer_erasure_ratio(np.array([[0.0]]), np.array([[1.0]]))[0, 0] == 0.0
    # strict >: a layer exactly at tau is not KE
    assert np.isnan(example_uds(np.array([[0.05]]), np.array([[0.05]]), tau=0.05))[0]


def test_rescore_matches_example_uds_on_a_long_table():
    """The DataFrame adapter is the same formula: per-example UDS from a long table (rows shuffled, a second site)
    equals example_uds on the matrices, and ler is NaN outside KE layers."""
    rng = np.random.default_rng(0)
    d1 = rng.normal(0.1, 0.2, size=(5, 6))
    d2 = rng.normal(0.05, 0.2, size=(5, 6))
    d1[3] = -1.0  # no KE layer: NaN
    long = pd.DataFrame(
        {
            "idx": np.repeat(np.arange(5) * 10, 6),
            "layer": np.tile(np.arange(6), 5),
            "d1": d1.ravel(),
            "d2": d2.ravel(),
        }
    )
    both = pd.concat([long.assign(site="resid_post"), long.assign(site="mlp_out", d2=0.0)]).sample(
        frac=1.0, random_state=1
    )
    layers, per_example = rescore(both, tau=0.05, by=("site", "idx"))
    got = per_example[per_example["site"] == "resid_post"].set_index("idx")["uds"].sort_index().to_numpy()
    np.testing.assert_allclose(got, example_uds(d1, d2, tau=0.05), rtol=1e-12, equal_nan=True)
    assert (per_example.loc[per_example["site"] == "mlp_out", "uds"].dropna() == 0.0).all()
    assert (
        layers.loc[~layers["ke"], "ler"].isna().all() and layers.loc[layers["ke"], "ler"].between(0, 1).all()
    )
    assert per_example.set_index(["site", "idx"]).loc[("resid_post", 30), "n_ke"] == 0


def test_split_and_excess_by_hand():
    # example 0: KE = {0, 1, 2} (layer 3 is under tau although d2 > d1 there: not clipped, not counted)
    #   layer 0: d1 2.0, d2 1.0 -> LER 0.5, measured;  layer 1: d1 1.0, d2 3.0 -> clipped (LER 1), excess 2.0
    #   layer 2: d1 0.5, d2 0.5 -> LER 1 exactly, measured (d2 <= d1: erased like retain, not clipped)
    # example 1: one KE layer, clipped: its UDS of 1 rests wholly on damage; example 2: no KE layer
    d1 = np.array([[2.0, 1.0, 0.5, 0.04], [0.01, 0.3, 0.0, 0.0], [0.01, 0.02, 0.03, 0.04]])
    d2 = np.array([[1.0, 3.0, 0.5, 9.00], [0.50, 1.2, 0.0, 0.0], [1.00, 1.00, 1.00, 1.00]])
    unclipped, clipped = uds_parts(d1, d2, tau=0.05)
    np.testing.assert_allclose(unclipped[:2], [(2.0 * 0.5 + 0.5) / 3.5, 0.0], rtol=1e-15)
    np.testing.assert_allclose(clipped[:2], [1.0 / 3.5, 1.0], rtol=1e-15)
    np.testing.assert_allclose(excess_disruption(d1, d2, 0.05)[:2], [2.0 / 3.5, 0.9 / 0.3], rtol=1e-15)
    assert np.isnan(unclipped[2]) and np.isnan(clipped[2]) and np.isnan(excess_disruption(d1, d2, 0.05)[2])
    assert mostly_clipped(unclipped, clipped).tolist() == [False, True, False]
    np.testing.assert_allclose(unclipped + clipped, example_uds(d1, d2, 0.05), atol=SPLIT_TOLERANCE)


def test_erasure_like_retain_is_unclipped_and_damage_is_clipped():
    """Two models with UDS 1 on every example: one equal to retain (d2 == d1: erasure, nothing clipped, no excess)
    and one whose patches cost three times retain's (d2 = 3 d1: all of it clipped, excess 2). UDS cannot tell them
    apart; the split and the excess do."""
    d1 = np.random.default_rng(2).uniform(0.1, 2.0, size=(6, 5))
    erased = uds_parts(d1, d1.copy())
    damaged = uds_parts(d1, 3 * d1)
    assert (example_uds(d1, d1.copy()) == 1.0).all() and (example_uds(d1, 3 * d1) == 1.0).all()
    assert (erased[0] == 1.0).all() and (erased[1] == 0.0).all()
    assert (damaged[0] == 0.0).all() and (damaged[1] == 1.0).all()
    np.testing.assert_allclose(excess_disruption(d1, d1.copy()), 0.0, atol=0)
    np.testing.assert_allclose(excess_disruption(d1, 3 * d1), 2.0, rtol=1e-14)
    # an unlearned model equal to full: no part, no excess
    assert (uds_parts(d1, np.zeros_like(d1))[0] == 0.0).all() and (
        excess_disruption(d1, np.zeros_like(d1)) == 0
    ).all()


def test_the_parts_add_up_to_uds_per_example_and_per_model():
    rng = np.random.default_rng(3)
    d1 = rng.normal(0.4, 0.6, size=(200, 12))
    d2 = d1 * rng.uniform(-0.5, 3.0, size=d1.shape) + rng.normal(0, 0.2, size=d1.shape)
    d1[:5] = -1.0  # examples without a KE layer: every figure undefined, none of them in the model means
    per_example = example_uds(d1, d2, tau=0.05)
    unclipped, clipped = uds_parts(d1, d2, tau=0.05)
    assert 0 < np.nanmean(clipped) < np.nanmean(per_example)  # some clipped cells and some measured ones
    np.testing.assert_allclose(unclipped + clipped, per_example, atol=SPLIT_TOLERANCE, equal_nan=True)
    assert model_uds(unclipped) + model_uds(clipped) == pytest.approx(
        model_uds(per_example), abs=SPLIT_TOLERANCE
    )
    # the long-table adapter gives the same numbers
    long = pd.DataFrame(
        {
            "idx": np.repeat(np.arange(200), 12),
            "layer": np.tile(np.arange(12), 200),
            "d1": d1.ravel(),
            "d2": d2.ravel(),
        }
    )
    table = rescore(long.sample(frac=1.0, random_state=4), tau=0.05)[1].set_index("idx").sort_index()
    np.testing.assert_allclose(table["uds_unclipped"], unclipped, rtol=1e-12, equal_nan=True)
    np.testing.assert_allclose(table["uds_clipped"], clipped, rtol=1e-12, equal_nan=True)
    np.testing.assert_allclose(
        table["excess_disruption"], excess_disruption(d1, d2), rtol=1e-12, equal_nan=True
    )
    np.testing.assert_allclose(
        table["uds_unclipped"] + table["uds_clipped"], table["uds"], atol=SPLIT_TOLERANCE, equal_nan=True
    )


def test_excess_is_the_d1_weighted_mean_of_the_relative_excess():
    """The issue's definition, d1-weighted mean over KE cells of max(0, d2 - d1) / d1, computed cell by cell."""
    rng = np.random.default_rng(5)
    d1 = rng.uniform(-0.2, 2.0, size=(30, 8))
    d2 = rng.uniform(-0.5, 5.0, size=(30, 8))
    ke = d1 > 0.05
    for row in range(30):
        weights = d1[row][ke[row]]
        relative = np.maximum(0.0, d2[row][ke[row]] - weights) / weights
        expected = np.average(relative, weights=weights) if weights.size else np.nan
        np.testing.assert_allclose(
            excess_disruption(d1[row : row + 1], d2[row : row + 1])[0], expected, rtol=1e-12
        )


def test_bootstrap_ci_does_not_depend_on_example_order():
    values = np.random.default_rng(1).uniform(0, 1, 25)
    assert bootstrap_ci(values) == bootstrap_ci(values[::-1]) == bootstrap_ci(np.roll(values, 7))


def test_deltas_subtract_in_the_scores_own_dtype():
    """float32 stage scores give float32 deltas equal to torch's subtraction bit for bit (the saved tables' numbers);
    float64 when either is float64."""
    rng = np.random.default_rng(2)
    baseline = rng.normal(-2, 1, size=(4, 5)).astype(np.float32)
    patched = rng.normal(-3, 1, size=(4, 5)).astype(np.float32)
    d = deltas(baseline, patched)
    assert d.dtype == np.float32 and np.array_equal(d, baseline - patched)
    assert not np.array_equal(d.astype(np.float64), baseline.astype(np.float64) - patched.astype(np.float64))
    mixed = deltas(np.array([1.0, 2.0]), np.array([0.5, 3.0], dtype=np.float32))
    assert mixed.dtype == np.float64 and mixed.tolist() == [0.5, -1.0]


@pytest.mark.parametrize(
    "d2, expected",
    [
        ((1.0, 1.0), (2 / 3, 2 / 3, 0.0, 0.0)),  # A: erases the second layer like retain
        ((1.0, 3.0), (2 / 3, 1 / 3, 1 / 3, 2 / 3)),  # B: the same UDS, half of it from a clipped layer
        ((6.0, 3.0), (1.0, 0.0, 1.0, 2.0)),  # C: UDS 1 from damage alone
    ],
)
def test_the_concept_pages_worked_example(d2, expected):
    """docs/concepts/uds.md, "Erasure or damage": d1 = (2.0, 1.0, 0.01), tau 0.05 nats (the third layer not KE)."""
    d1 = np.array([[2.0, 1.0, 0.01]])
    d2 = np.array([[*d2, 5.0]])
    unclipped, clipped = uds_parts(d1, d2)
    got = (example_uds(d1, d2)[0], unclipped[0], clipped[0], excess_disruption(d1, d2)[0])
    assert got == pytest.approx(expected, abs=1e-15)

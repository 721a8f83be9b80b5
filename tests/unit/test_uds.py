"""The score formula (``uds.py``): UDS by hand, the long-table adapter, the deltas and the bootstrap CI.

The auditor that runs the models (invariants, the S1 cache, result reuse) is tested in ``test_auditor.py``.
"""

import numpy as np
import pandas as pd
import pytest

from uds_lens.uds import bootstrap_ci, deltas, example_uds, layer_erasure_ratio, rescore


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

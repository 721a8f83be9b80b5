"""The trained test zoo shows the properties UDS should have (SPEC §6, the zoo issue): ranges, not exact values."""

import re

import pytest

from uds_lens.auditor import UDSAuditor


@pytest.fixture(scope="module")
def zoo_results(test_zoo, tmp_path_factory):
    auditor = UDSAuditor(
        test_zoo.path("full"),
        test_zoo.path("retain"),
        test_zoo.forget_path,
        cache_dir=tmp_path_factory.mktemp("s1"),
        progress=False,
    )
    names = [m["name"] for m in test_zoo.models if m["role"] in ("full", "retain", "partial", "unlearned")]
    return {name: auditor.score(test_zoo.path(name), name=name) for name in names}


@pytest.mark.slow
def test_anchor_models(zoo_results):
    assert zoo_results["full"].uds <= 0.03
    assert zoo_results["retain"].uds == pytest.approx(1.0)
    assert zoo_results["full"].summary["n_scored"] >= 0.8 * len(zoo_results["full"].examples)


@pytest.mark.slow
def test_partial_models_track_the_unseen_fraction(zoo_results):
    r90, r50 = zoo_results["retain90"].uds, zoo_results["retain50"].uds
    assert r90 < r50 < zoo_results["retain"].uds
    assert abs(r90 - 0.1) <= 0.2 and abs(r50 - 0.5) <= 0.2


@pytest.mark.slow
def test_idknll_is_shallower_than_npo(zoo_results):
    assert zoo_results["idknll"].uds < zoo_results["npo"].uds


@pytest.mark.slow
def test_rmu_disruption_starts_at_its_target_layer(zoo_results):
    rmu = [name for name in zoo_results if re.fullmatch(r"rmu_l\d+", name)]
    assert rmu
    for name in rmu:
        target = int(name.split("_l")[1])
        layers = zoo_results[name].layers
        erased = layers[layers["d2"] > zoo_results[name].settings["tau"]]
        first = erased.groupby("idx")["layer"].min()
        assert len(first) > 0, name
        assert (first >= target).all(), (
            f"{name}: disruption before layer {target}: {first.value_counts().to_dict()}"
        )
        # and nothing leaks backward: layers below the target are untouched
        assert (layers.loc[layers["layer"] < target, "d2"].abs() <= 1e-4).all()

"""Diagnostics on the test zoo (issue 5): endpoint calibration of every method, RMU onset, method agreement."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from uds_lens.analysis.case_studies import first_erased_layer, method_agreement, rank_concordance
from uds_lens.analysis.diagnose import METHODS, diagnose

pytestmark = pytest.mark.slow

# Retain-normalised by construction: at unlearned == retain they are 1 (up to the 1e-8 epsilons).
ENDPOINT_METHODS = ("uds", "logit_lens", "tuned_lens", "cka", "rsa", "svcca", "pwcca", "fisher_masked_0.0001",
                    "fisher_masked_0.001", "fisher_masked_0.01", "linear_probe")  # fmt: skip


@pytest.fixture(scope="module")
def zoo_diagnosis(request, tmp_path_factory):
    try:
        zoo = request.getfixturevalue("test_zoo")
    except pytest.FixtureLookupError:
        pytest.skip("the test_zoo fixture (tests/conftest.py) is not available")
    names = ["full", "retain", *zoo.names("partial"), *zoo.names("unlearned")]
    out = tmp_path_factory.mktemp("diagnose_zoo")
    scores = diagnose(
        zoo.path("full"), zoo.path("retain"), {name: zoo.path(name) for name in names}, zoo.forget_path, out,
        methods=METHODS, sites=("resid_post",), calibration=zoo.retain_path, tuned_lens_steps=100, cache_dir=False,
    ).scores  # fmt: skip
    return zoo, scores, out


def test_endpoints(zoo_diagnosis):
    _, scores, out = zoo_diagnosis
    for method in ENDPOINT_METHODS:
        assert scores.at["full", method] <= 0.02, method
        assert scores.at["retain", method] >= 0.98, method
    assert json.loads((out / "full" / "scores.json").read_text()).keys() >= set(ENDPOINT_METHODS)
    assert (out / "prompt_types.csv").is_file() and (out / "tau_sensitivity.csv").is_file()


def test_rmu_profile_starts_at_its_target_layers(zoo_diagnosis, tmp_path):
    from uds_lens.auditor import UDSAuditor
    from uds_lens.config import UDSConfig

    zoo, _, _ = zoo_diagnosis
    auditor = UDSAuditor(
        zoo.path("full"), zoo.path("retain"), zoo.forget_path, config=UDSConfig(), cache_dir=tmp_path
    )
    for name in zoo.names("unlearned"):
        if not name.startswith("rmu_l"):
            continue
        target = int(name.removeprefix("rmu_l"))
        layers = auditor.score(zoo.path(name), name=name).layers
        untouched = layers[layers["layer"] < max(0, target - 2)]  # RMU trains blocks target-2 .. target
        if len(untouched):
            assert untouched["d2"].abs().max() < 1e-4, name
        onset = first_erased_layer(layers)["onset"].dropna()
        assert len(onset) > 0, name
        assert onset.median() >= max(0, target - 2) and onset.median() <= target, (name, onset.median())


def test_method_agreement_is_reported(zoo_diagnosis):
    zoo, scores, _ = zoo_diagnosis
    unlearned = scores.loc[[n for n in scores.index if n not in ("full", "retain")]]
    agreement = method_agreement(unlearned)
    concordance = rank_concordance(unlearned)
    assert agreement.loc["uds", "uds"] == pytest.approx(1.0)
    # The issue asks to report, not to assert, which way LL vs CKA comes out.
    print(
        pd.DataFrame({"spearman_vs_uds": agreement["uds"], "pairwise_concordance": concordance}).to_string()
    )

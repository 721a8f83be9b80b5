"""uds_lens/analysis.py: case-study tables over UDS results (tau re-application, prompt types, RMU onset, CIs)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers.synthetic import make_lens_layers, make_result

from uds_lens.analysis.case_studies import (
    component_shares,
    component_summary,
    entity_length_correlation,
    first_erased_layer,
    ke_size_distribution,
    layer_profile,
    lens_vs_uds,
    method_agreement,
    onset_summary,
    prompt_type_uds,
    rank_concordance,
    rescore_uds,
    tau_sensitivity,
    uds_by_entity_length,
)
from uds_lens.auditor import UDSAuditor
from uds_lens.config import UDSConfig
from uds_lens.uds import bootstrap_ci


def test_rescore_at_default_tau_matches_the_results_own_uds():
    result = make_result(erasure=0.4)
    rescored = rescore_uds(result.layers, 0.05, site="resid_post").set_index("idx")
    scored = result.examples.set_index("idx").loc[rescored.index]
    np.testing.assert_allclose(rescored["uds"].to_numpy(), scored["uds"].to_numpy(), equal_nan=True)
    assert (rescored["status"] == scored["status"]).all()


def test_one_site_policy_is_shared_by_analyses_and_figures():
    """results.one_site is the one policy: a named site must exist, a multi-site table is read at resid_post (the
    default site), and one without resid_post needs site= (never an arbitrary pick)."""
    stacked = make_result(sites=("resid_post", "mlp_out")).layers
    at_default = rescore_uds(stacked).set_index("idx")
    at_post = rescore_uds(stacked[stacked["site"] == "resid_post"]).set_index("idx")
    pd.testing.assert_frame_equal(at_default, at_post)
    at_mlp = rescore_uds(stacked, site="mlp_out").set_index("idx")
    assert not np.allclose(at_mlp["uds"].fillna(-1), at_post["uds"].fillna(-1))  # the site chosen matters
    with pytest.raises(ValueError, match="several sites"):
        rescore_uds(make_result(sites=("attn_out", "mlp_out")).layers)
    with pytest.raises(ValueError, match="'attn_out' is not in the layers table"):
        first_erased_layer(stacked, site="attn_out")  # was an empty table


def test_tau_reapplied_equals_recomputation_with_the_core(trio):
    results = {}
    for tau in (0.05, 0.2, 0.0):
        auditor = UDSAuditor(trio.models["full"], trio.models["retain"], trio.records, config=UDSConfig(tau=tau),
                             tokenizer=trio.tokenizer, cache_dir=False, progress=False)  # fmt: skip
        results[tau] = auditor.score(trio.models["other"], name="other")
    for tau in (0.2, 0.0):
        rescored = rescore_uds(results[0.05].layers, tau).set_index("idx")
        recomputed = results[tau].examples.set_index("idx").loc[rescored.index]
        np.testing.assert_allclose(
            rescored["uds"], recomputed["uds"].astype(float), atol=1e-6, equal_nan=True
        )
        assert (rescored["n_ke"].to_numpy() == recomputed["n_ke"].to_numpy()).all()
    table = tau_sensitivity({"other": results[0.05].layers}, taus=(0.0, 0.2))
    at_02 = table[table["tau"] == 0.2].iloc[0]
    assert at_02["uds"] == pytest.approx(results[0.2].uds, abs=1e-6)


def test_tau_sensitivity_across_models():
    layers = {f"m{i}": make_result(erasure=e).layers for i, e in enumerate((0.1, 0.4, 0.7, 0.95))}
    table = tau_sensitivity(layers, site="resid_post")
    assert set(table["tau"]) == {0.0, 0.01, 0.02, 0.03, 0.05, 0.1}
    default = table[table["tau"] == 0.05]
    assert (default["abs_delta"] == 0).all() and (default["spearman"] == 1.0).all()
    assert table.groupby("tau")["ke_mean"].nunique().max() == 1  # S1 shared: one KE distribution per tau
    sizes = ke_size_distribution(layers["m0"], site="resid_post")
    assert sizes["ke_mean"].is_monotonic_decreasing
    assert sizes.loc[sizes["tau"] == 0.05, "n_no_ke"].item() == 1


def test_prompt_type_table():
    result = make_result(erasure=0.5)
    table = prompt_type_uds({"m": result.examples})
    overall = table[table["prompt_type"] == "overall"].iloc[0]
    assert overall["n"] == len(result.examples)
    assert overall["mean_uds"] == pytest.approx(result.examples["uds"].mean())
    per_type = table[table["prompt_type"] != "overall"]
    assert per_type["n"].sum() == len(result.examples)


def test_bootstrap_ci_contains_the_mean():
    values = np.random.default_rng(0).uniform(size=200)
    low, high = bootstrap_ci(values)
    assert low < values.mean() < high
    assert high - low < 0.2
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([np.nan])))
    lens_scores = np.random.default_rng(1).uniform(size=50)
    low, high = bootstrap_ci(lens_scores, seed=3)
    assert low <= lens_scores.mean() <= high


def test_entity_length_tables():
    examples = pd.DataFrame(
        {"idx": range(6), "n_entity_tokens": [1, 2, 3, 4, 5, 6], "uds": [0.9, 0.8, 0.6, 0.5, 0.2, 0.1],
         "status": ["scored"] * 6}
    )  # fmt: skip
    corr = entity_length_correlation({"m": examples}).iloc[0]
    assert corr["spearman"] == pytest.approx(-1.0)
    assert len(uds_by_entity_length(examples)) == 6


def test_first_erased_layer_and_profile():
    layers = pd.DataFrame(
        {"idx": [0] * 4 + [1] * 4, "layer": [0, 1, 2, 3] * 2, "site": "resid_post",
         "d1": [0.0, 0.2, 0.5, 1.0] * 2, "d2": [0.0, 0.01, 0.4, 1.5, 0.0, 0.0, 0.0, 0.01]}
    )  # fmt: skip
    onset = first_erased_layer(layers).set_index("idx")["onset"]
    assert onset[0] == 2 and math.isnan(onset[1])
    profile = layer_profile(layers).set_index("layer")
    assert profile.loc[2, "n_onset"] == 1 and profile["n_onset"].sum() == 1
    assert profile.loc[3, "mean_ler_ke"] == pytest.approx(0.5 * (1.0 + 0.01))
    summary = onset_summary({"rmu": layers}).iloc[0]
    assert summary["median_onset"] == 2 and summary["frac_with_onset"] == 0.5


def test_method_agreement_and_concordance():
    scores = pd.DataFrame(
        {"uds": [0.1, 0.5, 0.9, 0.3], "logit_lens": [0.2, 0.6, 0.8, 0.1], "cka": [0.9, 0.1, 0.5, 0.4]},
        index=["a", "b", "c", "d"],
    )
    agreement = method_agreement(scores)
    assert np.allclose(np.diag(agreement), 1.0)
    concordance = rank_concordance(scores)
    assert concordance["uds"] == 1.0
    assert concordance["logit_lens"] > concordance["cka"]


def test_component_summary_and_lens_table():
    result = make_result(sites=("resid_post", "attn_out", "mlp_out"))
    summary = component_summary(result.layers)
    assert list(summary.columns) == ["site", "layer", "mean_d1", "mean_d2"]
    assert set(summary["site"]) == {"resid_post", "attn_out", "mlp_out"}
    shares = component_shares(result.layers).set_index("site")
    assert shares.loc["resid_post", "share_of_reference"] == 1.0
    assert shares.loc["attn_out", "share_of_reference"] < 1.0
    single = make_result()
    table = lens_vs_uds(single.layers, make_lens_layers(single), idx=0)
    assert {"uds_d1", "uds_ler", "lens_d1", "lens_ler", "uds_ke"} <= set(table.columns)
    with pytest.raises(ValueError, match="missing"):
        lens_vs_uds(single.layers, make_lens_layers(single), idx=999)

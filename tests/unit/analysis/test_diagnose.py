"""uds_lens/diagnose.py: the files `uds-lens diagnose` writes and the endpoint properties of every score."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from uds_lens.analysis.diagnose import METHODS, diagnose

RETAIN_NORMALISED = ("uds", "logit_lens", "tuned_lens", "cka", "rsa", "svcca", "pwcca", "fisher_masked_0.0001",
                     "fisher_masked_0.001", "fisher_masked_0.01", "linear_probe")  # fmt: skip


def _check_endpoints(scores: pd.DataFrame) -> None:
    for method in scores.columns:
        assert scores.at["full", method] <= 0.02, method
        assert scores.at["retain", method] >= 0.98, method


def test_diagnose_writes_the_files(trio, tmp_path):
    unlearned = {"full": trio.models["full"], "retain": trio.paths["retain"], "other": trio.models["other"]}
    result = diagnose(trio.models["full"], trio.models["retain"], unlearned, trio.records,
                      methods=("uds", "logit_lens", "cka"), sites=("resid_post", "mlp_out"), cache_dir=False)  # fmt: skip
    assert not any(tmp_path.iterdir())  # nothing is written without out_dir
    scores = result.scores
    assert list(scores.index) == list(unlearned)
    assert set(scores.columns) == {"uds", "logit_lens", "cka"}
    _check_endpoints(scores)
    assert list(result.uds_results) == list(unlearned)
    assert result.uds_results["other"].uds == pytest.approx(scores.at["other", "uds"])
    assert result.save(tmp_path) == tmp_path
    for name in unlearned:
        written = json.loads((tmp_path / name / "scores.json").read_text())
        assert written == pytest.approx(scores.loc[name].to_dict())
        layerwise = pd.read_csv(tmp_path / name / "layerwise.csv")
        assert list(layerwise.columns) == ["method", "layer", "erasure", "weight"]
        assert set(layerwise["method"]) == {"uds", "logit_lens", "cka"}
        assert layerwise["erasure"].between(0, 1).all()
        pd.testing.assert_frame_equal(layerwise, result.layerwise[name], check_dtype=False)
        components = pd.read_csv(tmp_path / name / "components.csv")
        assert list(components.columns) == ["site", "layer", "mean_d1", "mean_d2"]
        assert set(components["site"]) == {"resid_post", "mlp_out"}
    prompt_types = pd.read_csv(tmp_path / "prompt_types.csv")
    assert set(prompt_types["model"]) == set(unlearned)
    assert {"genre", "origin", "overall"} <= set(prompt_types["prompt_type"])
    tau_table = pd.read_csv(tmp_path / "tau_sensitivity.csv")
    assert set(tau_table["model"]) == set(unlearned)
    assert (tau_table.loc[tau_table["tau"] == 0.05, "spearman"] == 1.0).all()
    # the examples whose UDS rests mostly on clipped cells, every model's, as each result lists them
    clipped = pd.read_csv(tmp_path / "clipped_examples.csv")
    for name, uds_result in result.uds_results.items():
        listed = clipped.loc[clipped["model"] == name, "idx"].tolist()
        assert listed == uds_result.mostly_clipped_examples()["idx"].tolist()
        assert (clipped["uds_clipped"] > clipped["uds_unclipped"]).all()
    assert "retain" not in set(
        clipped["model"]
    )  # retain as its own unlearned model: d2 == d1, nothing clipped
    assert [line.split(":")[0] for line in result.clipped_lines()] == list(unlearned)


def test_diagnose_rejects_unknown_methods(trio, tmp_path):
    with pytest.raises(ValueError, match=r"methods \(--methods\) must be one of"):  # a ConfigError, one line
        diagnose(trio.paths["full"], trio.paths["retain"], {}, trio.records, tmp_path, methods=("nope",))


@pytest.mark.slow
def test_diagnose_every_method_and_site(trio, tmp_path):
    unlearned = {"full": trio.paths["full"], "retain": trio.paths["retain"], "other": trio.paths["other"]}
    scores = diagnose(trio.paths["full"], trio.paths["retain"], unlearned, trio.records, tmp_path, methods=METHODS,
                      sites=("attn_out", "mlp_out", "resid_mid", "resid_post"), calibration=trio.examples,
                      tuned_lens_steps=10, cache_dir=False).scores  # fmt: skip
    assert set(scores.columns) == set(RETAIN_NORMALISED)
    _check_endpoints(scores)
    assert scores.loc["other"].between(0, 1).all()
    components = pd.read_csv(tmp_path / "other" / "components.csv")
    assert set(components["site"]) == {"attn_out", "mlp_out", "resid_mid", "resid_post"}

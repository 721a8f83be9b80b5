"""`uds-lens evaluate` / `meta-eval` on the test zoo: every metric, the paper's 20 rows, resumable."""

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from uds_lens.cli import app
from uds_lens.meta_eval.paper import METRICS
from uds_lens.zoo.layout import load_zoo

COLUMNS = ["metric", "faithfulness", "q", "r", "robustness", "overall", "n_models_q", "n_models_r"]


@pytest.mark.slow
def test_meta_eval_writes_all_rows(test_zoo, tmp_path):
    out = tmp_path / "meta"
    result = CliRunner().invoke(
        app, ["meta-eval", "--zoo", str(test_zoo.root), "--out", str(out), "--max-new-tokens", "24"]
    )
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "meta_eval.csv")
    assert list(table.columns) == COLUMNS
    assert len(table) == 20 == len(METRICS)
    assert set(table["metric"]) == {spec.name for spec in METRICS}
    uds = table.set_index("metric").loc["uds"]
    assert 0.5 < uds["faithfulness"] <= 1.0
    assert table["faithfulness"].notna().all()  # every metric is measured on both pools
    metrics = pd.read_csv(out / "metrics.csv", index_col=0)
    assert {"uds", "logit_lens", "cka", "fisher_masked"} <= set(metrics.columns)
    assert metrics["uds"].notna().all()
    # the chat-formatted output metrics read the zoo models in the format they were trained on
    assert metrics.at["full", "rouge"] > 0.9 and metrics.at["full", "prob"] > 0.8
    assert metrics.at["retain", "prob"] < 0.3 and metrics.at["full", "model_utility"] > 0.3
    # the pools carry the signal: models that saw the forget facts keep more of them by UDS
    pools = metrics.groupby("role")["uds"].mean()
    assert pools["pos"] + 0.2 < pools["neg"]
    assert (out / "meta_eval_vs_paper.csv").is_file()
    # resumable: a second run reuses every finished model and gives the same table
    again = CliRunner().invoke(
        app, ["meta-eval", "--zoo", str(test_zoo.root), "--out", str(out), "--max-new-tokens", "24"]
    )
    assert again.exit_code == 0, again.output
    pd.testing.assert_frame_equal(pd.read_csv(out / "meta_eval.csv"), table)


@pytest.mark.slow
def test_evaluate_scores_every_model_of_a_zoo(tmp_path):
    from helpers.tiny import make_tiny_zoo

    zoo = make_tiny_zoo(tmp_path / "zoo", n_pool=1, steps=20)
    out = tmp_path / "eval"
    result = CliRunner().invoke(
        app, ["evaluate", "--zoo", str(zoo), "--out", str(out), "--max-new-tokens", "4", "--batch-size", "8"]
    )
    assert result.exit_code == 0, result.output
    metrics = pd.read_csv(out / "metrics.csv", index_col="model")
    assert sorted(metrics.index) == sorted(load_zoo(zoo).names())
    assert {spec.name for spec in METRICS} | {"model_utility", "privacy", "privacy_uds"} <= set(
        metrics.columns
    )
    assert metrics.at["full", "uds"] == pytest.approx(0.0, abs=1e-6)
    assert metrics.at["retain", "uds"] == pytest.approx(1.0, abs=1e-6)
    assert metrics.at["retain", "s_mia_loss"] == pytest.approx(1.0)
    saved = json.loads((out / "models" / "full" / "metrics.json").read_text())
    assert set(saved["json"]["prob"]) == {"agg_value", "value_by_index"}  # the open-unlearning shape


def test_meta_eval_refuses_an_unregistered_metric_before_loading_anything(tmp_path):
    result = CliRunner().invoke(
        app,
        ["meta-eval", "--zoo", str(tmp_path / "no-zoo"), "--out", str(tmp_path / "out"), "--metric", "rogue"],
    )
    assert result.exit_code == 2 and "rogue" in result.output and "rouge" in result.output
    assert not (tmp_path / "out").exists()

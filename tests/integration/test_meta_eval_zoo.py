"""`uds-lens evaluate` / `meta-eval` on the test zoo: every metric, the paper's 20 rows, resumable."""

import pandas as pd
import pytest
from typer.testing import CliRunner

from uds_lens.cli import app
from uds_lens.meta_eval import METRICS

COLUMNS = ["metric", "faithfulness", "q", "r", "robustness", "overall", "n_models_q", "n_models_r"]


@pytest.mark.slow
def test_meta_eval_writes_all_rows(test_zoo, tmp_path):
    out = tmp_path / "meta"
    result = CliRunner().invoke(app, ["meta-eval", "--zoo", str(test_zoo.root), "--out", str(out),
                                      "--max-new-tokens", "24"])
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "meta_eval.csv")
    assert list(table.columns) == COLUMNS
    assert len(table) == 20 == len(METRICS)
    assert set(table["metric"]) == {spec.key for spec in METRICS}
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
    again = CliRunner().invoke(app, ["meta-eval", "--zoo", str(test_zoo.root), "--out", str(out),
                                     "--max-new-tokens", "24"])
    assert again.exit_code == 0, again.output
    pd.testing.assert_frame_equal(pd.read_csv(out / "meta_eval.csv"), table)

"""uds_lens/meta_eval/runner.py: the meta-evaluation of a tiny zoo, cached per model and resumable."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from helpers.tiny import make_tiny_zoo
from safetensors.torch import load_file, save_file

from uds_lens.meta_eval.formulas import META_EVAL_COLUMNS
from uds_lens.meta_eval.paper import METRIC_KEYS
from uds_lens.meta_eval.runner import run_meta_eval
from uds_lens.zoo.layout import load_zoo


@pytest.mark.slow
def test_run_meta_eval_on_a_tiny_zoo_writes_all_twenty_rows_and_resumes(tmp_path) -> None:
    zoo = make_tiny_zoo(tmp_path / "zoo")
    calls: list[str] = []

    def counting(key: str, value: float):
        def fn(model_or_path) -> float:
            calls.append(key)
            return value

        return fn

    def uds_fn(model_or_path) -> float:
        calls.append("uds")
        name = Path(str(model_or_path)).name if isinstance(model_or_path, (str, Path)) else "quantised"
        return 0.9 if name.startswith(("neg", "unlearned", "retain")) else 0.1

    white_box = {
        "logit_lens": counting("logit_lens", 0.5),
        "cka": counting("cka", 0.4),
        "fisher_masked": counting("fisher_masked", 0.3),
    }
    out = tmp_path / "out"
    kwargs = dict(
        uds_fn=uds_fn,
        white_box_fns=white_box,
        batch_size=8,
        max_new_tokens=4,
        progress=False,
        relearn_kwargs={"lr": 1e-3, "batch_size": 4, "grad_accum": 1, "device": "cpu"},
    )
    table = run_meta_eval(zoo, out, **kwargs)
    assert list(pd.read_csv(out / "meta_eval.csv")["metric"]) == list(METRIC_KEYS)
    assert list(table.columns) == META_EVAL_COLUMNS
    metrics = pd.read_csv(out / "metrics.csv", index_col="model")
    assert set(metrics.index) == set(
        load_zoo(zoo).names(["full", "retain", "unlearned", "sweep", "pos", "neg"])
    )
    assert set(METRIC_KEYS) <= set(metrics.columns)
    assert metrics.at["retain", "s_mia_loss"] == pytest.approx(1.0)
    # utility (the whole retain set) only where the utility filter reads it
    has_utility = metrics["model_utility"].notna()
    assert has_utility[metrics["role"].isin(["full", "retain", "unlearned", "sweep"])].all()
    assert not has_utility[metrics["role"].isin(["pos", "neg"])].any()
    assert table.set_index("metric").at["uds", "faithfulness"] == pytest.approx(1.0)
    assert (table["n_models_r"] <= 2).all() and (out / "metrics_quant.csv").is_file()
    assert (out / "models" / "retain" / "relearn" / "model" / "config.json").is_file()
    # the sweep model is attacked like the unlearned one
    assert set(pd.read_csv(out / "metrics_quant.csv", index_col="model").index) == {
        "unlearned0",
        "unlearned1",
    }
    assert (out / "models" / "unlearned1" / "relearn" / "model" / "config.json").is_file()
    n_calls = len(calls)
    again = run_meta_eval(zoo, out, **kwargs)
    assert len(calls) == n_calls  # everything came from the per-model caches
    pd.testing.assert_frame_equal(again, table)
    # rows are registry names: a subset gives the same numbers for those rows
    subset = run_meta_eval(zoo, out, metrics=["uds", "prob"], **kwargs)
    expected = table.set_index("metric").loc[["uds", "prob"]].reset_index()
    pd.testing.assert_frame_equal(subset, expected)
    assert len(calls) == n_calls
    # a smaller robustness pool (a CPU's): only the named models are attacked and scored, from the same caches
    run_meta_eval(zoo, out, robustness_models=["unlearned1"], **kwargs)
    assert len(calls) == n_calls
    assert set(pd.read_csv(out / "robustness.csv")["model"]) == {"unlearned1"}
    assert "unlearned0" not in pd.read_csv(out / "metrics.csv", index_col="model").index
    assert set(pd.read_csv(out / "metrics_quant.csv", index_col="model").index) == {"unlearned1"}
    with pytest.raises(ValueError, match="'pos0'.*choose among"):
        run_meta_eval(zoo, out, robustness_models=["pos0"], **kwargs)
    run_meta_eval(zoo, out, **kwargs)  # the whole pool again, for what follows
    # the caches are keyed by the checkpoints' contents: rewriting a pool model's weights unchanged (a copy, a
    # touch) rescores nothing; a retrained one (other weights at the same path) is scored again, nothing else is
    weights = load_zoo(zoo).path(load_zoo(zoo).names("pos")[0]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    run_meta_eval(zoo, out, **kwargs)
    assert len(calls) == n_calls
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    run_meta_eval(zoo, out, **kwargs)
    assert sorted(calls[n_calls:]) == sorted(["uds", "logit_lens", "cka", "fisher_masked"])


@pytest.mark.slow
def test_a_registered_metric_joins_the_evaluation(tmp_path) -> None:
    from uds_lens.meta_eval.runner import evaluate_zoo
    from uds_lens.metrics import registry

    zoo = make_tiny_zoo(tmp_path / "zoo", n_pool=1, steps=10)
    scored: list[str] = []

    @registry.metric(
        "weight_files", label="Weight files", kind=registry.WHITE_BOX, direction=registry.KNOWLEDGE
    )
    def weight_files(model_or_path) -> float:
        scored.append(Path(model_or_path).name)
        return float(len(list(Path(model_or_path).glob("*.safetensors"))))

    try:
        table = evaluate_zoo(
            zoo, tmp_path / "eval", roles=["full"], max_new_tokens=2, batch_size=8, progress=False
        )
    finally:
        registry.unregister("weight_files")
    assert table["weight_files"].eq(1.0).all() and sorted(scored) == sorted(table.index)

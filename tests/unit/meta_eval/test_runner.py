"""uds_lens/meta_eval.py: symmetric Q/R, faithfulness direction, filters, the 20-row table, NF4 and relearning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers.tiny import make_records, make_tiny_llama, make_tiny_tokenizer

from uds_lens.meta_eval import (
    META_EVAL_COLUMNS,
    METRIC_KEYS,
    METRICS,
    compare_with_paper,
    faithfulness_auc,
    faithfulness_threshold,
    harmonic_mean,
    meta_evaluate,
    quantisation_q,
    relearning_r,
    robustness_table,
    utility_filter,
)


def test_catalogue_has_the_papers_twenty_rows() -> None:
    assert len(METRICS) == 20 and len(set(METRIC_KEYS)) == 20
    erasure_type = {m.key for m in METRICS if not m.higher_means_knowledge}
    assert erasure_type == {
        "s_mia_loss",
        "s_mia_zlib",
        "s_mia_min_k",
        "s_mia_min_kpp",
        "uds",
        "logit_lens",
        "cka",
        "fisher_masked",
    }


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
    table = meta_evaluate(frame, pools, quant, relearn)
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


def test_comparison_with_the_paper_lines_up_each_metric() -> None:
    frame, pools, quant, relearn = _synthetic_frames()
    table = meta_evaluate(frame, pools, quant, relearn)
    comparison = compare_with_paper(table)
    assert list(comparison.index) == list(METRIC_KEYS)
    assert comparison.at["uds", "paper_faithfulness"] == 0.971 and comparison.at["cka", "paper_r"] == 0.013
    assert comparison.at["uds", "faithfulness"] == table.set_index("metric").at["uds", "faithfulness"]
    assert comparison.at["uds", "paper_rank"] == 1 and comparison.at["para_rouge", "paper_rank"] == 19
    assert comparison.at["uds", "rank"] == 1  # the only metric here with an overall score besides prob
    # each paper row is internally consistent: overall = HM(faithfulness, robustness), robustness = HM(q, r)
    for metric, row in comparison.iterrows():
        assert harmonic_mean([row.paper_q, row.paper_r]) == pytest.approx(row.paper_robustness, abs=2e-3), (
            metric
        )
        assert harmonic_mean([row.paper_faithfulness, row.paper_robustness]) == pytest.approx(
            row.paper_overall, abs=2e-3
        ), metric


def test_filters_drop_low_utility_and_not_unlearned_models() -> None:
    frame, pools, quant, relearn = _synthetic_frames()
    assert not utility_filter(frame)["unl2"] and utility_filter(frame)["unl0"]
    frame.loc["unl0", "uds"] = 0.05  # looks like a P model for UDS: not "unlearned" by the UDS threshold
    details = robustness_table(frame, pools, quant, relearn)
    uds = details[(details["metric"] == "uds") & details["passed"]]
    assert set(uds["model"]) == {"unl1"}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attacks")
    tokenizer = make_tiny_tokenizer()
    return tokenizer, make_tiny_llama(tmp / "model", tokenizer=tokenizer)


def test_nf4_model_is_close_to_but_not_the_original(tiny_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    from uds_lens.meta_eval import quantise_nf4

    tokenizer, path = tiny_checkpoint
    quantised = quantise_nf4(path, device="cpu")
    assert any("4bit" in type(m).__name__ for m in quantised.modules())
    original = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([tokenizer("What genre does Amara Okafor write?")["input_ids"]])
    with torch.no_grad():
        h_q = quantised(ids, output_hidden_states=True).hidden_states[-1].float()
        h_o = original(ids, output_hidden_states=True).hidden_states[-1].float()
    relative = float((h_q - h_o).norm() / h_o.norm())
    assert 0 < relative < 0.3


def test_relearn_raises_forget_likelihood_deterministically_and_resumes(tiny_checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from uds_lens.meta_eval import relearn
    from uds_lens.metrics.memorization import score_answers

    tokenizer, path = tiny_checkpoint
    forget = make_records(16, seed=21)
    pairs = [(r["question"], r["answer"]) for r in forget]
    kwargs = dict(lr=3e-3, batch_size=4, grad_accum=1, seed=1, progress=False, device="cpu")
    out = relearn(path, forget, tokenizer, tmp_path / "relearned", **kwargs)
    before = score_answers(AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer, pairs, batch_size=16)
    after = score_answers(AutoModelForCausalLM.from_pretrained(out).eval(), tokenizer, pairs, batch_size=16)
    assert np.mean([a.avg_loss for a in after]) < np.mean([b.avg_loss for b in before]) - 0.2
    again = relearn(path, forget, tokenizer, tmp_path / "again", **kwargs)
    w1 = AutoModelForCausalLM.from_pretrained(out).state_dict()
    w2 = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert relearn(path, forget, tokenizer, out, **kwargs) == out  # reused, not retrained
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((out / "relearn.json").read_text())["lr"] == 3e-3


@pytest.mark.slow
def test_run_meta_eval_on_a_tiny_zoo_writes_all_twenty_rows_and_resumes(tmp_path) -> None:
    from helpers.tiny import make_tiny_zoo

    from uds_lens.meta_eval import read_zoo, run_meta_eval

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
        read_zoo(zoo).names(["full", "retain", "unlearned", "sweep", "pos", "neg"])
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
    # a retrained pool model (new weight files at the same path) is scored again; nothing else is
    weights = Path(read_zoo(zoo).path(read_zoo(zoo).names(["pos"])[0])) / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    run_meta_eval(zoo, out, **kwargs)
    assert sorted(calls[n_calls:]) == sorted(["uds", "logit_lens", "cka", "fisher_masked"])

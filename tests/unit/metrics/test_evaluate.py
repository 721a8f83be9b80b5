"""uds_lens/metrics/evaluate.py: every output metric of one model, the Open-Unlearning JSON, and the DataFrames."""

from __future__ import annotations

import math

import pytest
from helpers.tiny import make_records, make_tiny_llama, make_tiny_tokenizer, train_on_records

from uds_lens.metrics import OUTPUT_METRICS, S_MIA_METRICS, evaluate_model, report_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate")
    tokenizer = make_tiny_tokenizer()
    base = make_tiny_llama(tmp / "base", tokenizer=tokenizer)
    forget = make_records(6, seed=41)
    holdout = make_records(6, seed=42, offset=100)
    retain = make_records(4, seed=43, offset=200)
    trained = train_on_records(base, forget, tmp / "trained", steps=80)
    return tokenizer, base, trained, forget, holdout, retain


def test_report_has_every_metric_and_the_open_unlearning_shape(setup) -> None:
    tokenizer, base, _, forget, holdout, retain = setup
    report = report_model(
        base,
        tokenizer,
        forget,
        holdout,
        retain,
        batch_size=4,
        max_new_tokens=6,
        progress=False,
        retain_aucs={a: 0.5 for a in ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_kpp")},
    )
    for name in (*OUTPUT_METRICS, *S_MIA_METRICS, "mem", "privacy", "model_utility", "retain_q_prob"):
        assert name in report.values and not math.isnan(report.values[name]), name
    entry = report.json["prob"]
    assert set(entry) == {"agg_value", "value_by_index"}
    assert set(entry["value_by_index"]) == {str(r["idx"]) for r in forget}
    assert entry["agg_value"] == pytest.approx(sum(v["score"] for v in entry["value_by_index"].values()) / 6)
    assert set(report.json["mia_loss"]["holdout"]["value_by_index"]) == {str(r["idx"]) for r in holdout}
    assert len(report.examples) == 6 and {"generation", "rouge", "truth_ratio"} <= set(
        report.examples.columns
    )
    assert len(report.mia_examples) == 12


def test_a_model_that_memorised_the_forget_set_scores_as_knowing_it(setup) -> None:
    tokenizer, base, trained, forget, holdout, _ = setup
    knows = evaluate_model(
        trained, tokenizer, forget, holdout, None, batch_size=6, max_new_tokens=24, progress=False
    )
    random = evaluate_model(
        base, tokenizer, forget, holdout, None, batch_size=6, max_new_tokens=4, progress=False
    )
    for name in ("prob", "em", "es", "rouge", "mia_loss"):
        assert knows[name] > random[name] + 0.2, name
    assert knows["rouge"] > 0.8 and knows["em"] > 0.8
    assert knows["mem"] < random["mem"]

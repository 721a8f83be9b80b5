"""uds_lens/metrics/evaluate.py: every output metric of one model, the Open-Unlearning JSON, and the DataFrames."""

from __future__ import annotations

import math

import pytest

from uds_lens.metrics.evaluate import OUTPUT_METRICS, S_MIA_METRICS, evaluate_model, report_model


def test_report_has_every_metric_and_the_open_unlearning_shape(memorised) -> None:
    m = memorised
    tokenizer, base, forget, holdout, retain = m.tokenizer, m.base, m.forget, m.holdout, m.retain
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
    assert entry["agg_value"] == pytest.approx(
        sum(v["score"] for v in entry["value_by_index"].values()) / len(forget)
    )
    assert set(report.json["mia_loss"]["holdout"]["value_by_index"]) == {str(r["idx"]) for r in holdout}
    assert len(report.examples) == len(forget) and {"generation", "rouge", "truth_ratio"} <= set(
        report.examples.columns
    )
    assert len(report.mia_examples) == len(forget) + len(holdout)


def test_a_model_that_memorised_the_forget_set_scores_as_knowing_it(memorised) -> None:
    m = memorised
    tokenizer, base, trained, forget, holdout = m.tokenizer, m.base, m.trained, m.forget, m.holdout
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

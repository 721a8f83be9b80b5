"""uds_lens/meta_eval/paper.py: the paper's Table 3, its rows as registry specs, and the side-by-side comparison."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from uds_lens.meta_eval.formulas import META_EVAL_COLUMNS
from uds_lens.meta_eval.paper import METRIC_KEYS, METRICS, PAPER_TABLE3, compare_with_paper
from uds_lens.metrics import registry
from uds_lens.metrics.memorization import harmonic_mean


def test_catalogue_has_the_papers_twenty_rows_with_the_registrys_directions() -> None:
    assert len(METRICS) == 20 and len(set(METRIC_KEYS)) == 20 and list(METRIC_KEYS) == list(PAPER_TABLE3)
    assert all(spec is registry.spec(spec.name) for spec in METRICS)
    erasure_type = {m.name for m in METRICS if not m.higher_means_knowledge}
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


def test_comparison_with_the_paper_lines_up_each_metric() -> None:
    overall = np.linspace(0.9, 0.1, len(METRIC_KEYS))
    table = pd.DataFrame(
        {
            "metric": list(
                reversed(METRIC_KEYS)
            ),  # the comparison follows the paper's order, not the input's
            "faithfulness": overall,
            "q": overall,
            "r": overall,
            "robustness": overall,
            "overall": overall,
            "n_models_q": 3,
            "n_models_r": 2,
        },
        columns=META_EVAL_COLUMNS,
    )
    comparison = compare_with_paper(table)
    assert set(comparison.index) == set(METRIC_KEYS)
    assert comparison.at["uds", "paper_faithfulness"] == 0.971 and comparison.at["cka", "paper_r"] == 0.013
    assert comparison.at["uds", "faithfulness"] == pytest.approx(0.9)
    assert comparison.at["uds", "paper_rank"] == 1 and comparison.at["para_rouge", "paper_rank"] == 19
    assert comparison.at["uds", "rank"] == 1 and comparison.at["es", "rank"] == 20
    # each paper row is internally consistent: overall = HM(faithfulness, robustness), robustness = HM(q, r)
    for metric, row in comparison.iterrows():
        assert harmonic_mean([row.paper_q, row.paper_r]) == pytest.approx(row.paper_robustness, abs=2e-3), (
            metric
        )
        assert harmonic_mean([row.paper_faithfulness, row.paper_robustness]) == pytest.approx(
            row.paper_overall, abs=2e-3
        ), metric

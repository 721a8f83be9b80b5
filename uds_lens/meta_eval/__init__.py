"""The paper's meta-evaluation: is a metric faithful (separates models that saw the forget set from models that did
not) and robust (unmoved by NF4 quantisation and by relearning)?

``formulas`` holds the arithmetic (AUC, symmetric Q/R, the filters, the tables), ``paper`` the paper's Table 3,
``attacks`` NF4 quantisation and relearning, ``runner`` the run on a zoo; ``scorers`` turns UDS and the white-box
baselines into ``fn(model) -> float`` for it. Which metrics exist, and which way each points, is the metric registry's
(`uds_lens.metrics.registry`).
"""

from uds_lens.data import read_records
from uds_lens.meta_eval.attacks import QuantisationError, nf4_config, quantise_nf4, relearn
from uds_lens.meta_eval.formulas import (
    EPS,
    META_EVAL_COLUMNS,
    QUANTISATION,
    RELEARNING,
    faithfulness_auc,
    faithfulness_filter,
    faithfulness_threshold,
    meta_evaluate,
    orient,
    quantisation_q,
    relearning_r,
    robustness_table,
    utility_filter,
)
from uds_lens.meta_eval.paper import METRIC_KEYS, METRICS, PAPER_TABLE3, compare_with_paper
from uds_lens.meta_eval.runner import evaluate_zoo, run_meta_eval
from uds_lens.metrics.memorization import harmonic_mean
from uds_lens.metrics.registry import MetricSpec
from uds_lens.zoo.layout import load_zoo as read_zoo

__all__ = [
    "EPS",
    "META_EVAL_COLUMNS",
    "METRICS",
    "METRIC_KEYS",
    "PAPER_TABLE3",
    "QUANTISATION",
    "RELEARNING",
    "MetricSpec",
    "QuantisationError",
    "compare_with_paper",
    "evaluate_zoo",
    "faithfulness_auc",
    "faithfulness_filter",
    "faithfulness_threshold",
    "harmonic_mean",
    "meta_evaluate",
    "nf4_config",
    "orient",
    "quantisation_q",
    "quantise_nf4",
    "read_records",
    "read_zoo",
    "relearn",
    "relearning_r",
    "robustness_table",
    "run_meta_eval",
    "utility_filter",
]

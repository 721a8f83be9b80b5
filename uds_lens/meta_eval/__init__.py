"""The paper's meta-evaluation: is a metric faithful (separates models that saw the forget set from models that did
not) and robust (unmoved by NF4 quantisation and by relearning)?

``runner`` holds the formulas, the attacks and the runners for now; ``scorers`` turns UDS and the white-box
baselines into ``fn(model) -> float`` for it.
"""

from uds_lens.meta_eval.runner import (
    EPS,
    META_EVAL_COLUMNS,
    METRICS,
    PAPER_TABLE3,
    MetricSpec,
    QuantisationError,
    compare_with_paper,
    evaluate_zoo,
    faithfulness_auc,
    faithfulness_filter,
    faithfulness_threshold,
    meta_evaluate,
    nf4_config,
    orient,
    quantisation_q,
    quantise_nf4,
    read_records,
    read_zoo,
    relearn,
    relearning_r,
    robustness_table,
    run_meta_eval,
    utility_filter,
)

__all__ = [
    "EPS",
    "META_EVAL_COLUMNS",
    "METRICS",
    "PAPER_TABLE3",
    "MetricSpec",
    "QuantisationError",
    "compare_with_paper",
    "evaluate_zoo",
    "faithfulness_auc",
    "faithfulness_filter",
    "faithfulness_threshold",
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

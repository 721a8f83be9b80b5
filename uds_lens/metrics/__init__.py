"""Open-Unlearning output-level metrics (memorization, generation, MIA, utility) on Hugging Face causal LMs.

``evaluate_model`` returns every metric of one model as ``{name: value}``; ``report_model`` adds the per-example
results in Open-Unlearning's JSON shape and as DataFrames. The modules hold one concept each: ``registry`` (every
metric's name, kind and direction, the ``@metric`` decorator), ``chat`` (prompt formatting), ``memorization``,
``generation``, ``privacy`` (MIA), ``utility``.
"""

from uds_lens.metrics.evaluate import (
    GENERATION_METRICS,
    MEMORIZATION_METRICS,
    OUTPUT_METRICS,
    S_MIA_METRICS,
    MetricsReport,
    add_privacy,
    evaluate_model,
    report_model,
)
from uds_lens.metrics.memorization import harmonic_mean
from uds_lens.metrics.privacy import normalised_mia, paper_privacy, privacy_score
from uds_lens.metrics.registry import MetricResult, MetricSpec, metric

__all__ = [
    "GENERATION_METRICS",
    "MEMORIZATION_METRICS",
    "OUTPUT_METRICS",
    "S_MIA_METRICS",
    "MetricResult",
    "MetricSpec",
    "MetricsReport",
    "add_privacy",
    "evaluate_model",
    "harmonic_mean",
    "metric",
    "normalised_mia",
    "paper_privacy",
    "privacy_score",
    "report_model",
]

"""Open-Unlearning output-level metrics (memorization, generation, MIA, utility) on Hugging Face causal LMs.

``evaluate_model`` returns every metric of one model as ``{name: value}``; ``report_model`` adds the per-example
results in Open-Unlearning's JSON shape and as DataFrames. The modules hold one concept each: ``registry`` (every
metric's name, kind and direction, the ``@metric`` decorator), ``chat`` (prompt formatting), ``memorization``,
``generation``, ``privacy`` (MIA), ``utility``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from uds_lens.lazy import lazy_exports

# public name -> the module that defines it. Resolved on first use (PEP 562, as ``uds_lens/__init__`` does): the
# registry is plain Python, and the figures and reports that read it must not import torch through the metrics.
_EXPORTS = {
    "GENERATION_METRICS": "evaluate",
    "MEMORIZATION_METRICS": "evaluate",
    "OUTPUT_METRICS": "evaluate",
    "S_MIA_METRICS": "evaluate",
    "MetricsReport": "evaluate",
    "add_privacy": "evaluate",
    "evaluate_model": "evaluate",
    "report_model": "evaluate",
    "harmonic_mean": "memorization",
    "normalised_mia": "privacy",
    "paper_privacy": "privacy",
    "privacy_score": "privacy",
    "MetricResult": "registry",
    "MetricSpec": "registry",
    "metric": "registry",
}

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

if TYPE_CHECKING:
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


__getattr__, __dir__ = lazy_exports(__name__, {name: f".{module}" for name, module in _EXPORTS.items()})

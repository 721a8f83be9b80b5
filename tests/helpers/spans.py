"""Span choices from hand-set word scores: how annotation tests give ``choose_span`` a contrast without a model."""

from __future__ import annotations

import numpy as np

from uds_lens.annotation import AnnotateConfig, SpanChoice, choose_span, content_scores
from uds_lens.phrases import answer_units


def hot_choice(
    question: str, answer: str, hot: dict[str, float], config: AnnotateConfig | None = None
) -> SpanChoice:
    """The span ``choose_span`` takes when every word of ``answer`` named in ``hot`` carries that contrast and the rest
    none (after ``content_scores``, as ``annotate`` passes them)."""
    units = answer_units(answer)
    scores = np.array([float(hot.get(unit.text, 0.0)) for unit in units])
    return choose_span(
        answer, units, content_scores(question, units, scores), config or AnnotateConfig(), question
    )

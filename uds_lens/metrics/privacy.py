"""Membership-inference (MIA) metrics: does the model still tell forget-set answers from unseen (holdout) ones?

Each attack gives every answer a score where **higher means "more non-member-like"**:

- **LOSS** = mean cross-entropy over the answer tokens;
- **ZLib** = LOSS / ``len(zlib.compress(answer text))``;
- **Min-K** (k = 0.4) = ``-mean`` of the lowest ``max(1, floor(0.4 n))`` token log-probs;
- **Min-K++** (k = 0.4) = ``-mean`` of the lowest 40% of the z-scores ``(log p(y_t) - mu_t) / sigma_t``.

The attack's AUC is ``roc_auc_score(labels, scores)`` with forget = label 0 and holdout = label 1, so AUC ~ 1 means
the forget set still looks *seen* (knowledge present) and ~0.5 means it looks like the holdout.

The retain-referenced variants rescale the AUC against the retain model's (MUSE PrivLeak style)
``s = clip(1 - |AUC - AUC_ret| / AUC_ret, 0, 1)`` (higher = closer to retain = more erased); **Privacy** = HM of the
four ``s``, and the paper's proposal is ``Privacy = HM(MIA_agg, UDS)``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

import torch
from jaxtyping import Float
from sklearn.metrics import roc_auc_score
from torch import Tensor

from uds_lens.metrics.memorization import AnswerScores, harmonic_mean
from uds_lens.metrics.registry import OUTPUT, names

MIN_K_FRACTION = 0.4
ATTACKS = names(OUTPUT, group="Privacy")


def min_k_score(values: Float[Tensor, " token"], k: float = MIN_K_FRACTION) -> float:
    """``-mean`` of the lowest ``max(1, floor(k n))`` values (Min-K on log-probs, Min-K++ on z-scores)."""
    if values.numel() == 0:
        return float("nan")
    count = max(1, int(values.numel() * k))
    return -float(torch.sort(values.float()).values[:count].mean())


def zlib_score(avg_loss: float, text: str) -> float:
    return avg_loss / len(zlib.compress(text.encode("utf-8")))


def attack_scores(scores: Sequence[AnswerScores], k: float = MIN_K_FRACTION) -> dict[str, list[float]]:
    """Per-answer scores of the four attacks (higher = more non-member-like)."""
    return {
        "mia_loss": [s.avg_loss for s in scores],
        "mia_zlib": [zlib_score(s.avg_loss, s.target_text) for s in scores],
        "mia_min_k": [min_k_score(s.logprobs, k) for s in scores],
        "mia_min_kpp": [min_k_score(s.z_scores, k) for s in scores],
    }


def mia_auc(forget_scores: Sequence[float], holdout_scores: Sequence[float]) -> float:
    """AUC of forget (label 0) vs holdout (label 1); ~1 = the forget set is recognised as seen."""
    pairs = [(0, s) for s in forget_scores] + [(1, s) for s in holdout_scores]
    pairs = [(y, s) for y, s in pairs if not math.isnan(s)]
    labels = [y for y, _ in pairs]
    if len(set(labels)) < 2:
        return float("nan")
    return float(roc_auc_score(labels, [s for _, s in pairs]))


def normalised_mia(auc: float, auc_retain: float) -> float:
    """``s = clip(1 - |AUC - AUC_ret| / AUC_ret, 0, 1)``; 1 = indistinguishable from the retain model."""
    if auc_retain <= 0 or math.isnan(auc) or math.isnan(auc_retain):
        return float("nan")
    return min(max(1.0 - abs(auc - auc_retain) / auc_retain, 0.0), 1.0)


def normalised_mia_all(aucs: Mapping[str, float], retain_aucs: Mapping[str, float]) -> dict[str, float]:
    """``s_mia_<attack>`` for the four attacks, from a model's and the retain model's AUCs."""
    return {f"s_{a}": normalised_mia(aucs[a], retain_aucs[a]) for a in ATTACKS}


def privacy_score(s_values: Sequence[float]) -> float:
    """Privacy (MIA_agg) = harmonic mean of the four ``s_MIA`` values."""
    return harmonic_mean(list(s_values))


def paper_privacy(mia_agg: float, uds: float) -> float:
    """The paper's proposed privacy axis ``HM(MIA_agg, UDS)`` (both: higher = more erased)."""
    return harmonic_mean([mia_agg, uds])

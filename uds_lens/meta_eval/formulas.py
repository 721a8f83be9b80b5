"""The meta-evaluation's formulas: is a metric faithful, and is it robust?

Following Dorna et al. (2025) as extended by the UDS paper (§4, App. E), every metric ``m`` is first oriented so that
higher = more knowledge (``k = m`` for knowledge metrics, ``k = 1 - m`` for erasure metrics: the ``direction`` of
its `registry` spec), then scored on:

- **Faithfulness** = AUC-ROC of ``k`` separating the P pool (models trained *with* the forget set, label 1) from the
  N pool (never saw it, label 0). Pools are passed as ``{"pos": [...], "neg": [...]}``, the zoo's role names.
- **Quantisation** (NF4 4-bit, bf16 compute) per unlearned model, symmetric:
  ``Q = 1 - clip(|k_after - k_before| / (|k_before| + |k_after| + eps), 0, 1)``.
- **Relearning** (one epoch of fine-tuning on the forget set) of each unlearned model and of retain, with
  ``Δ = k_after - k_before``: ``R = 1 - clip(|Δ_unl - Δ_ret| / (|Δ_unl| + |Δ_ret| + eps), 0, 1)``.
- Only unlearned models with utility ``>= 0.8 x`` the full model's, and classified as *unlearned* by the metric's own
  faithfulness threshold (``k`` below the P/N cut that maximises Youden's J = TPR - FPR), enter Q and R.
- ``robustness = HM(mean Q, mean R)``, ``overall = HM(faithfulness, robustness)``.

(Open-Unlearning's asymmetric ``min(m_after/m_before, 1)`` / ``min(Δ_ret/Δ_unl, 1)`` are not used: the paper reports
the symmetric ones.) `robustness_table` applies the filters and gives every (metric, model, attack) its Q or R;
`meta_evaluate` turns that into the one-row-per-metric table. Everything here is arithmetic on tables of metric
values; the attacks that produce them are in `attacks`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score, roc_curve

from uds_lens.meta_eval.paper import METRICS
from uds_lens.metrics.memorization import harmonic_mean
from uds_lens.metrics.registry import MetricSpec
from uds_lens.zoo.layout import NEGATIVE_POOL, POSITIVE_POOL

logger = logging.getLogger(__name__)

EPS = 1e-10
UTILITY_THRESHOLD = 0.8
UTILITY_COLUMN = "model_utility"
# The models whose robustness is measured: the unlearned models, and a zoo's extra hyperparameter sweep of them.
ROBUSTNESS_ROLES = ("unlearned", "sweep")
# The attacks, as the ``attack`` column of the robustness table spells them.
QUANTISATION = "quantisation"
RELEARNING = "relearning"
# Model-level metric values of a pool: a list or a 1-D array.
Scores = Sequence[float] | np.ndarray
ROBUSTNESS_COLUMNS = ["metric", "model", "attack", "before", "after", "score", "passed"]
META_EVAL_COLUMNS = ["metric", "faithfulness", "q", "r", "robustness", "overall", "n_models_q", "n_models_r"]


def orient(values: Any, higher_means_knowledge: bool) -> np.ndarray:
    """Metric values as knowledge scores (higher = more knowledge): raw, or ``1 - x`` for erasure-type metrics."""
    array = np.asarray(values, dtype=float)
    return array if higher_means_knowledge else np.asarray(1.0 - array)


def faithfulness_auc(p_scores: Scores, n_scores: Scores, higher_means_knowledge: bool) -> float:
    """AUC-ROC of the P pool (label 1) against the N pool (label 0) on oriented scores; NaN with < 2 per pool."""
    p = orient(p_scores, higher_means_knowledge)
    n = orient(n_scores, higher_means_knowledge)
    p, n = p[~np.isnan(p)], n[~np.isnan(n)]
    if len(p) < 2 or len(n) < 2:
        return float("nan")
    return float(roc_auc_score(np.r_[np.ones(len(p)), np.zeros(len(n))], np.r_[p, n]))


def faithfulness_threshold(p_scores: Scores, n_scores: Scores, higher_means_knowledge: bool) -> float:
    """The oriented-score cut that best separates P from N (max Youden's J); models below it count as unlearned."""
    p = orient(p_scores, higher_means_knowledge)
    n = orient(n_scores, higher_means_knowledge)
    p, n = p[~np.isnan(p)], n[~np.isnan(n)]
    if len(p) == 0 or len(n) == 0:
        return float("nan")
    fpr, tpr, thresholds = roc_curve(np.r_[np.ones(len(p)), np.zeros(len(n))], np.r_[p, n])
    return float(thresholds[int(np.argmax(tpr - fpr))])


def quantisation_q(before: Any, after: Any, eps: float = EPS) -> Any:
    """Symmetric quantisation stability ``1 - clip(|after - before| / (|before| + |after| + eps), 0, 1)``."""
    before, after = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    q = 1.0 - np.clip(np.abs(after - before) / (np.abs(before) + np.abs(after) + eps), 0.0, 1.0)
    return float(q) if q.ndim == 0 else q


def relearning_r(unl_before: Any, unl_after: Any, ret_before: Any, ret_after: Any, eps: float = EPS) -> Any:
    """Symmetric relearning stability ``1 - clip(|Δ_unl - Δ_ret| / (|Δ_unl| + |Δ_ret| + eps), 0, 1)``."""
    d_unl = np.asarray(unl_after, dtype=float) - np.asarray(unl_before, dtype=float)
    d_ret = np.asarray(ret_after, dtype=float) - np.asarray(ret_before, dtype=float)
    r = 1.0 - np.clip(np.abs(d_unl - d_ret) / (np.abs(d_unl) + np.abs(d_ret) + eps), 0.0, 1.0)
    return float(r) if r.ndim == 0 else r


def utility_filter(
    metrics_df: pd.DataFrame,
    full: str = "full",
    column: str = UTILITY_COLUMN,
    threshold: float = UTILITY_THRESHOLD,
) -> pd.Series:
    """Boolean per model: utility relative to the full model ``>= threshold`` (all True if utility is unknown)."""
    reference = (
        metrics_df.at[full, column] if column in metrics_df.columns and full in metrics_df.index else np.nan
    )
    if not np.isfinite(reference) or reference <= 1e-6:
        logger.warning(
            "the full model %r has no usable %r (%s): the utility filter is skipped", full, column, reference
        )
        return pd.Series(True, index=metrics_df.index)
    relative = metrics_df[column] / reference
    return relative >= threshold


def faithfulness_filter(values: pd.Series, threshold: float, higher_means_knowledge: bool) -> pd.Series:
    """Boolean per model: classified as unlearned (oriented score below the faithfulness threshold)."""
    if not np.isfinite(threshold):
        return pd.Series(True, index=values.index)
    return pd.Series(orient(values, higher_means_knowledge) < threshold, index=values.index)


def pool_scores(column: pd.Series, pools: Mapping[str, Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
    """A metric's values on the P and the N pool (NaN for a pool model the table lacks)."""
    return (
        column.reindex(pools.get(POSITIVE_POOL, [])).to_numpy(),
        column.reindex(pools.get(NEGATIVE_POOL, [])).to_numpy(),
    )


def robustness_table(
    metrics_df: pd.DataFrame,
    pools: Mapping[str, Sequence[str]],
    quant_df: pd.DataFrame | None,
    relearn_df: pd.DataFrame | None,
    *,
    unlearned: Sequence[str] | None = None,
    retain: str = "retain",
    full: str = "full",
    utility_threshold: float = UTILITY_THRESHOLD,
    apply_faithfulness_filter: bool = True,
    metrics: Sequence[MetricSpec] = METRICS,
) -> pd.DataFrame:
    """Per (metric, model, attack): oriented values before/after, the Q or R score, and whether it passed the filters.

    Args:
        metrics_df: one row per model (index = name), one column per metric, plus ``role`` and ``model_utility``.
        pools: ``{"pos": [...], "neg": [...]}`` model names of the P and N pools.
        quant_df / relearn_df: metric values after the attack (index = model name; relearn must hold ``retain``).
        unlearned: the models whose robustness is measured (default: roles ``unlearned`` and ``sweep``).
        retain: the retain model's name (the relearning reference).
        full: the full model's name (the utility reference).
        utility_threshold: minimum utility relative to full.
        apply_faithfulness_filter: keep only models the metric's own threshold classifies as unlearned.
        metrics: the metrics to score (default: the paper's Table 3).

    Returns:
        DataFrame with columns ``ROBUSTNESS_COLUMNS``; ``attack`` is ``"quantisation"`` or ``"relearning"``.
    """
    if unlearned is None:
        unlearned = (
            list(metrics_df.index[metrics_df["role"].isin(ROBUSTNESS_ROLES)]) if "role" in metrics_df else []
        )
    useful = utility_filter(metrics_df, full=full, threshold=utility_threshold)
    rows = []
    for spec in metrics:
        if spec.name not in metrics_df.columns:
            continue
        column = metrics_df[spec.name]
        knowledge = spec.higher_means_knowledge
        threshold = faithfulness_threshold(*pool_scores(column, pools), knowledge)
        unlearned_like = faithfulness_filter(column, threshold, knowledge)
        for name in unlearned:
            if name not in metrics_df.index:
                continue
            passed = bool(useful.get(name, True)) and (
                not apply_faithfulness_filter or bool(unlearned_like[name])
            )
            before = float(orient(column[name], knowledge))
            row = {"metric": spec.name, "model": name, "before": before, "passed": passed}
            if quant_df is not None and spec.name in quant_df.columns and name in quant_df.index:
                after = float(orient(quant_df.at[name, spec.name], knowledge))
                rows.append(
                    {**row, "attack": QUANTISATION, "after": after, "score": quantisation_q(before, after)}
                )
            if (
                relearn_df is not None
                and spec.name in relearn_df.columns
                and name in relearn_df.index
                and retain in relearn_df.index
                and retain in metrics_df.index
            ):
                after = float(orient(relearn_df.at[name, spec.name], knowledge))
                ret_before = float(orient(column[retain], knowledge))
                ret_after = float(orient(relearn_df.at[retain, spec.name], knowledge))
                score = relearning_r(before, after, ret_before, ret_after)
                rows.append({**row, "attack": RELEARNING, "after": after, "score": score})
    return pd.DataFrame(rows, columns=ROBUSTNESS_COLUMNS)


def meta_evaluate(
    metrics_df: pd.DataFrame,
    pools: Mapping[str, Sequence[str]],
    robustness: pd.DataFrame,
    metrics: Sequence[MetricSpec] = METRICS,
) -> pd.DataFrame:
    """The meta-evaluation table: one row per metric (missing metrics give NaN rows).

    Args:
        metrics_df: one row per model (index = name), one column per metric.
        pools: ``{"pos": [...], "neg": [...]}`` model names of the P and N pools.
        robustness: the per-model Q and R of `robustness_table`.
        metrics: the rows (default: the paper's Table 3).

    Returns:
        DataFrame with columns ``metric, faithfulness, q, r, robustness, overall, n_models_q, n_models_r``.
    """
    kept = robustness[robustness["passed"] & robustness["score"].notna()]
    rows = []
    for spec in metrics:
        if spec.name in metrics_df.columns:
            faith = faithfulness_auc(*pool_scores(metrics_df[spec.name], pools), spec.higher_means_knowledge)
        else:
            faith = float("nan")
        q_scores = kept[(kept["metric"] == spec.name) & (kept["attack"] == QUANTISATION)]["score"]
        r_scores = kept[(kept["metric"] == spec.name) & (kept["attack"] == RELEARNING)]["score"]
        q = float(q_scores.mean()) if len(q_scores) else float("nan")
        r = float(r_scores.mean()) if len(r_scores) else float("nan")
        robust = harmonic_mean([q, r], eps=0.0) if np.isfinite(q) and np.isfinite(r) else float("nan")
        overall = (
            harmonic_mean([faith, robust], eps=0.0)
            if np.isfinite(faith) and np.isfinite(robust)
            else float("nan")
        )
        rows.append(
            {
                "metric": spec.name,
                "faithfulness": faith,
                "q": q,
                "r": r,
                "robustness": robust,
                "overall": overall,
                "n_models_q": int(len(q_scores)),
                "n_models_r": int(len(r_scores)),
            }
        )
    return pd.DataFrame(rows, columns=META_EVAL_COLUMNS)

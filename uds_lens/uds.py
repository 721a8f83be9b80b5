"""The Unlearning Depth Score (UDS): how much of the forgotten knowledge is still causally recoverable.

For every example ``i`` and layer ``l`` (one patch per layer, see ``uds_lens.patching.engines``):

* ``baseline[l]``: the full model's mean entity-token log-prob, unpatched (S0; the fast engine recomputes it per
  layer, equal to S0 up to float noise, so that a source identical to full gives deltas of exactly 0);
* ``d1[l] = baseline[l] - s_S1[l]``: the drop when the **retain** model's activations are patched in (Stage 1: where
  the knowledge lives in the full model);
* ``d2[l] = baseline[l] - s_S2[l]``: the drop when the **unlearned** model's activations are patched in (Stage 2:
  how much of it the unlearned model has erased);
* ``ke_mask[l] = d1[l] > tau``: the knowledge-encoding (KE) layers (strict ``>``, ``tau = 0.05`` nats);
* ``ler[l] = clip(d2[l] / d1[l], 0, 1)``: the layer erasure ratio;
* ``UDS_i = sum_KE d1 * ler / sum_KE d1``, undefined (NaN) when no layer is KE; model UDS = mean of defined ``UDS_i``;
* ``clipped_mask = ke & (d2 > d1)``: KE cells whose ratio the clip cut to 1 (over-disruption: the unlearned model's
  activation breaks the full model more than retain's does). Reported, never changes UDS.

0 means the unlearned model still carries the knowledge exactly like the full model; 1 means it disrupts the full
model's answer at least as much as a model that never saw the fact. A cell reaches ``ler = 1`` in two ways: the
unlearned model's activation disrupts exactly as much as retain's (erasure), or more (``d2 > d1``, clipped: the
activation disrupts beyond removing the fact: over-disruption, which is damage only where a control such as the
model's utility shows it). Two figures say which, beside UDS (they never change it):

* **the split** ``UDS_i = uds_unclipped_i + uds_clipped_i`` ([`uds_parts`][uds_lens.uds.uds_parts]), both over
  the same denominator: ``uds_unclipped_i = sum_{KE, d2 <= d1} d1 * ler / sum_KE d1`` (the cells whose ratio is the
  measured one) and ``uds_clipped_i = sum_{KE, d2 > d1} d1 / sum_KE d1`` (the clipped cells, ``ler = 1`` each). The
  model's parts are the means over the same scored examples, so they add up to the model UDS too;
* **excess disruption** ``excess_i = sum_KE max(0, d2 - d1) / sum_KE d1``
  ([`excess_disruption`][uds_lens.uds.excess_disruption]): the d1-weighted mean over KE cells of
  ``max(0, d2 - d1) / d1``, how far past retain's disruption the unlearned model's goes, in nats per nat of
  knowledge (0: never past retain; 1: on average twice retain's drop). Model value: the mean over scored examples.

Without a retain model (retain-free mode) only ``d2`` exists; its summaries are unnormalised.

This module is the math only, and the only place it is written: NumPy in float64 on ``[example, layer]`` arrays
(tiny next to the forward passes that produce them), so tables, reports and plots use it without importing torch.
``rescore`` is its adapter for the long ``layers`` DataFrames (one row per example x layer) that results,
analyses, components and plots pass around. Running the models is ``auditor.py``'s job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from jaxtyping import Bool, Float

from uds_lens.config import DEFAULT_TAU


def deltas(
    baseline: Float[np.ndarray, "*shape"], patched: Float[np.ndarray, "*shape"]
) -> Float[np.ndarray, "*shape"]:
    """``d = baseline - patched``: positive when the patch destroyed entity log-prob (``d1`` with S1, ``d2`` with S2).

    Computed in the scores' own floating dtype (float32 stage scores give float32 deltas, as saved in ``layers``),
    float64 for anything else; the summaries below then read them in float64.
    """
    baseline, patched = np.asarray(baseline), np.asarray(patched)
    return np.subtract(baseline, patched, dtype=np.result_type(baseline, patched, np.float32))


def ke_mask(d1: Float[np.ndarray, "*shape"], tau: float = DEFAULT_TAU) -> Bool[np.ndarray, "*shape"]:
    """Knowledge-encoding layers: ``d1 > tau`` (strict; a NaN ``d1`` is never KE)."""
    return np.asarray(d1, dtype=float) > tau


def layer_erasure_ratio(
    d1: Float[np.ndarray, "*shape"], d2: Float[np.ndarray, "*shape"]
) -> Float[np.ndarray, "*shape"]:
    """``clip(d2 / d1, 0, 1)``; 0 where ``d1 == 0`` (such layers are never KE for ``tau >= 0``)."""
    d1 = np.asarray(d1, dtype=float)
    d2 = np.asarray(d2, dtype=float)
    return np.clip(np.divide(d2, d1, out=np.zeros_like(d2), where=d1 != 0), 0.0, 1.0)


def clipped_mask(
    d1: Float[np.ndarray, "*shape"], d2: Float[np.ndarray, "*shape"], tau: float = DEFAULT_TAU
) -> Bool[np.ndarray, "*shape"]:
    """KE cells where ``d2 > d1``: their ``d2 / d1`` is above 1 and LER clips it to 1 (over-disruption).

    A NaN ``d2`` (a cell a KE-only Stage 2 did not run) is never clipped.
    """
    d1 = np.asarray(d1, dtype=float)
    return ke_mask(d1, tau) & (np.asarray(d2, dtype=float) > d1)


def clipped_summary(
    d1: Float[np.ndarray, "*shape"], d2: Float[np.ndarray, "*shape"], tau: float = DEFAULT_TAU
) -> dict[str, float]:
    """Over-disruption over all cells given: ``clipped_share`` (clipped KE cells / KE cells, NaN with no KE cell),
    ``clipped_median_ratio`` (median ``d2 / d1`` over the clipped cells, NaN with none) and the two counts."""
    d1, d2 = np.asarray(d1, dtype=float), np.asarray(d2, dtype=float)
    n_ke = int(ke_mask(d1, tau).sum())
    clipped = clipped_mask(d1, d2, tau)
    n_clipped = int(clipped.sum())
    return {
        "clipped_share": n_clipped / n_ke if n_ke else float("nan"),
        "clipped_median_ratio": float(np.median(d2[clipped] / d1[clipped])) if n_clipped else float("nan"),
        "n_ke_cells": n_ke,
        "n_clipped_cells": n_clipped,
    }


def _ke_weighted(
    d1: Float[np.ndarray, "*shape"], d2: Float[np.ndarray, "*shape"], tau: float
) -> tuple[Bool[np.ndarray, "*shape"], Float[np.ndarray, "*shape"], Float[np.ndarray, "*shape"]]:
    """The per-layer terms of UDS: KE mask, weight ``d1`` on KE layers (0 elsewhere), and ``weight * ler``."""
    ke = ke_mask(d1, tau)
    weight = np.where(ke, d1, 0.0)
    return ke, weight, np.where(ke, weight * layer_erasure_ratio(d1, d2), 0.0)


def _split_terms(
    d1: Float[np.ndarray, "*shape"], d2: Float[np.ndarray, "*shape"], tau: float
) -> dict[str, np.ndarray]:
    """Every per-cell term of UDS and of the figures beside it, from one KE mask and one clip.

    ``ke``, ``weight`` (``d1`` on KE cells), ``weighted`` (``weight * ler``: UDS's numerator terms), ``unclipped``
    (``weighted`` on the KE cells with ``d2 <= d1``), ``clipped`` (``weight`` on the KE cells with ``d2 > d1``, where
    ``ler`` is exactly 1) and ``excess`` (``max(0, d2 - d1)`` on KE cells; nonzero only on the clipped ones). A NaN
    ``d2`` on a KE cell is never clipped: it makes ``weighted``, ``unclipped`` and ``excess`` NaN there, as UDS is.
    """
    d1, d2 = np.asarray(d1, dtype=float), np.asarray(d2, dtype=float)
    ke, weight, weighted = _ke_weighted(d1, d2, tau)
    over = clipped_mask(d1, d2, tau)
    return {
        "ke": ke,
        "weight": weight,
        "weighted": weighted,
        "unclipped": np.where(over, 0.0, weighted),
        "clipped": np.where(over, weight, 0.0),
        "excess": np.where(ke, np.maximum(d2 - d1, 0.0), 0.0),
    }


def _weighted_mean(n_ke: np.ndarray, weight_sum: np.ndarray, weighted_sum: np.ndarray) -> np.ndarray:
    """``sum weight * ler / sum weight`` per example; NaN where no layer is KE."""
    safe = np.where(n_ke > 0, weight_sum, 1.0)
    return np.where(n_ke > 0, weighted_sum / np.where(safe == 0, 1.0, safe), np.nan)


def example_uds(
    d1: Float[np.ndarray, "example layer"], d2: Float[np.ndarray, "example layer"], tau: float = DEFAULT_TAU
) -> Float[np.ndarray, " example"]:
    """Per-example UDS: the d1-weighted mean of the layer erasure ratio over KE layers; NaN with no KE layer.

    Accepts anything ``np.asarray`` takes (a CPU torch tensor too) and returns float64.
    """
    ke, weight, weighted = _ke_weighted(d1, d2, tau)
    return _weighted_mean(ke.sum(-1), weight.sum(-1), weighted.sum(-1))


def uds_parts(
    d1: Float[np.ndarray, "example layer"], d2: Float[np.ndarray, "example layer"], tau: float = DEFAULT_TAU
) -> tuple[Float[np.ndarray, " example"], Float[np.ndarray, " example"]]:
    """Per-example UDS split by where it comes from: ``(unclipped, clipped)``, NaN with no KE layer.

    ``unclipped = sum_{KE, d2 <= d1} d1 * ler / sum_KE d1``: the part whose ratio is measured (the unlearned model
    disrupts at most as much as retain); ``clipped = sum_{KE, d2 > d1} d1 / sum_KE d1``: the part from clipped cells,
    each counted as fully erased although the unlearned activation disrupts more than retain's (over-disruption:
    erasure, or not, plus more). Over one denominator, so ``unclipped + clipped`` is [`example_uds`][uds_lens.uds.example_uds]
    (to float64 rounding: the same terms summed in two groups).

    Examples:
        >>> d1 = np.array([[2.0, 1.0, 0.01]])  # layer 2 is under tau: not KE
        >>> d2 = np.array([[1.0, 3.0, 5.00]])  # layer 1 is clipped: d2 = 3 d1
        >>> uds_parts(d1, d2)  # ((2 * 0.5) / 3, 1 / 3); UDS = 2 / 3
        (array([0.33333333]), array([0.33333333]))
    """
    terms = _split_terms(d1, d2, tau)
    n_ke, weight_sum = terms["ke"].sum(-1), terms["weight"].sum(-1)
    return (
        _weighted_mean(n_ke, weight_sum, terms["unclipped"].sum(-1)),
        _weighted_mean(n_ke, weight_sum, terms["clipped"].sum(-1)),
    )


def excess_disruption(
    d1: Float[np.ndarray, "example layer"], d2: Float[np.ndarray, "example layer"], tau: float = DEFAULT_TAU
) -> Float[np.ndarray, " example"]:
    """How far past retain's disruption the unlearned model's goes: ``sum_KE max(0, d2 - d1) / sum_KE d1``.

    The d1-weighted mean over KE layers of ``max(0, d2 - d1) / d1``, in nats of extra drop per nat of the retain
    model's drop: 0 when no KE layer's ``d2`` exceeds its ``d1`` (UDS then rests on measured ratios only), 1 when the
    unlearned activations cost the full model twice what retain's cost, summed over KE layers. Unbounded above, NaN
    with no KE layer. Only clipped cells contribute, so it measures what the clip hides.

    Examples:
        >>> excess_disruption(np.array([[2.0, 1.0, 0.01]]), np.array([[1.0, 3.0, 5.00]]))  # (3 - 1) / (2 + 1)
        array([0.66666667])
    """
    terms = _split_terms(d1, d2, tau)
    return _weighted_mean(terms["ke"].sum(-1), terms["weight"].sum(-1), terms["excess"].sum(-1))


def mostly_clipped(
    unclipped: Float[np.ndarray, " example"], clipped: Float[np.ndarray, " example"]
) -> Bool[np.ndarray, " example"]:
    """The examples whose ``UDS_i`` rests mostly on clipped cells: ``clipped > unclipped`` (the two parts of
    [`uds_parts`][uds_lens.uds.uds_parts]), more than half of the score; False where UDS is undefined."""
    return np.asarray(clipped, dtype=float) > np.asarray(unclipped, dtype=float)


def model_uds(per_example: Float[np.ndarray, " example"]) -> float:
    """Plain mean over examples with a defined UDS (NaN if none is defined)."""
    values = np.asarray(per_example, dtype=float)
    defined = values[~np.isnan(values)]
    return float(defined.mean()) if defined.size else float("nan")


def bootstrap_ci(
    values: Sequence[float] | np.ndarray, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean over the defined (non-NaN) values.

    The values are sorted first, so the interval depends on the set of per-example scores and the seed, not on the
    order the examples were listed in.
    """
    array = np.asarray(values, dtype=float)
    array = np.sort(array[~np.isnan(array)])
    if array.size == 0:
        return (float("nan"), float("nan"))
    if array.size == 1:
        return (float(array[0]), float(array[0]))
    rng = np.random.default_rng(seed)
    means = array[rng.integers(0, array.size, size=(n_boot, array.size))].mean(axis=1)
    alpha = (1 - level) / 2
    return (float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha)))


SPLIT_COLUMNS = ("uds_unclipped", "uds_clipped", "excess_disruption")
"""The per-example figures beside UDS that [`split_ci`][uds_lens.uds.split_ci] gives intervals for."""


def split_ci(
    per_example: pd.DataFrame, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """Bootstrap CIs of the model means of UDS's two parts and of the excess disruption.

    ``per_example`` holds the columns of `SPLIT_COLUMNS` (an examples table, or ``rescore``'s per-example one);
    each column gets [`bootstrap_ci`][uds_lens.uds.bootstrap_ci] over its defined values, with the same
    resamples, level and seed as the model UDS's CI. The intervals are marginal: the parts' bounds do not add up
    to UDS's.
    """
    return {
        column: bootstrap_ci(
            pd.to_numeric(per_example[column], errors="coerce").to_numpy(dtype=float), n_boot, level, seed
        )
        for column in SPLIT_COLUMNS
    }


def rescore(
    layers: pd.DataFrame, tau: float = DEFAULT_TAU, by: Sequence[str] = ("idx",)
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """UDS on a long ``layers`` table (columns ``d1``, ``d2`` and the ``by`` keys, one row per example x layer).

    Returns ``(layers, per_example)``: the table with ``ke`` and ``ler`` (re)computed for ``tau`` (``ler`` is NaN
    outside KE layers, where ``d2 / d1`` is a ratio of noise, not of knowledge), and one row per ``by`` group (first
    appearance order) with ``n_ke``, ``n_clipped`` (KE layers with ``d2 > d1``,
    [`clipped_mask`][uds_lens.uds.clipped_mask]), ``uds``, its two parts ``uds_unclipped`` and ``uds_clipped``
    ([`uds_parts`][uds_lens.uds.uds_parts]) and ``excess_disruption``
    ([`excess_disruption`][uds_lens.uds.excess_disruption]). Pass ``by=("site", "idx")`` for a table holding
    several sites, or another example key for lens tables. Retain-free tables (``d1`` all NaN) get no KE layer and
    a NaN ``uds``.
    """
    keys = list(by)
    d1 = layers["d1"].to_numpy(dtype=float)
    d2 = layers["d2"].to_numpy(dtype=float)
    terms = _split_terms(d1, d2, tau)
    ke = terms["ke"]
    scored = layers.assign(ke=ke, ler=np.where(ke, layer_erasure_ratio(d1, d2), np.nan))
    sums = (
        scored[keys]
        .assign(
            n_ke=ke.astype(int),
            n_clipped=clipped_mask(d1, d2, tau).astype(int),
            **{name: terms[name] for name in ("weight", "weighted", "unclipped", "clipped", "excess")},
        )
        .groupby(keys, sort=False)
        .sum()
    )
    n_ke, weight = sums["n_ke"].to_numpy(dtype=int), sums["weight"].to_numpy(dtype=float)

    def mean(term: str) -> np.ndarray:
        return _weighted_mean(n_ke, weight, sums[term].to_numpy(dtype=float))

    per_example = pd.DataFrame(
        {
            "n_ke": n_ke,
            "n_clipped": sums["n_clipped"].to_numpy(dtype=int),
            "uds": mean("weighted"),
            "uds_unclipped": mean("unclipped"),
            "uds_clipped": mean("clipped"),
            "excess_disruption": mean("excess"),
        },
        index=sums.index,
    ).reset_index()
    return scored, per_example

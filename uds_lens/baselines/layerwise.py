"""Layerwise erasure: the one shape every white-box diagnostic reports in.

Each method (logit lens, tuned lens, CKA, RSA, SVCCA/PWCCA, Fisher, linear probe) turns the three models
(full, retain, unlearned) into a per-layer erasure ``e_l`` in [0, 1] (0 = the unlearned model looks like the full
model at layer ``l``, 1 = it looks like the retain model) and a per-layer weight ``w_l >= 0`` that says how much
forget-set signal the layer carries (how different full and retain are there). The model score is the weighted mean

    score = sum_l w_l * e_l / sum_l w_l        over layers with w_l > 1e-8 (NaN if there are none).

Two normalisations feed it:

* similarity-based methods (CKA, RSA, SVCCA, PWCCA), from a similarity ``S`` in [0, 1] to the retain model:
  ``e_l = clip((S(unl, ret) - S(full, ret)) / (1 - S(full, ret) + 1e-8), 0, 1)``, ``w_l = max(1 - S(full, ret), 0)``
  (the published CKA baseline);
* delta-based, UDS-shaped methods (UDS itself, logit and tuned lens), per example ``i`` and layer ``l`` with
  ``d1 = k_full - k_ret``, ``d2 = k_full - k_unl``, a KE mask and a LER: pooled over examples per layer
  (`pooled_layerwise`), ``e_l = sum_i KE d1 LER / sum_i KE d1`` and ``w_l = sum_i KE d1 / n``.

The per-example aggregation of UDS is ``uds.example_uds``, written once there. The lenses use the published lens
variant of it, which differs in two places and is `lens_erasure` here: ``LER = clip(d2 / (d1 +
1e-8), 0, 1)`` (``eps`` in the ratio) and an example is scored only when its KE weight ``sum_KE d1`` exceeds 1e-8
(UDS: when it has any KE layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from uds_lens.config import DEFAULT_TAU

MIN_WEIGHT = 1e-8
"""Layers whose weight is at most this carry no signal and are left out of the weighted mean."""

SIMILARITY_EPS = 1e-8
"""Added to the denominator of the similarity normalisation, as in the published baselines."""


@dataclass(frozen=True)
class LayerwiseErasure:
    """Per-layer erasure and weight of one method for one unlearned model.

    Attributes:
        method: Method key as written to ``scores.json`` (``"cka"``, ``"fisher_masked_0.001"``, ...).
        erasure: ``e_l`` in [0, 1] per layer; 1 = retain-like.
        weight: ``w_l >= 0`` per layer.
    """

    method: str
    erasure: Float[Tensor, " layer"]
    weight: Float[Tensor, " layer"]

    @property
    def score(self) -> float:
        """Weighted mean of the erasure over layers with signal (NaN when no layer has any)."""
        return weighted_layer_score(self.erasure, self.weight)

    def to_frame(self) -> pd.DataFrame:
        """Long table ``method, layer, erasure, weight`` (the rows of ``layerwise.csv``)."""
        return pd.DataFrame(
            {
                "method": self.method,
                "layer": range(self.erasure.shape[0]),
                "erasure": self.erasure.double().cpu().numpy(),
                "weight": self.weight.double().cpu().numpy(),
            }
        )


def weighted_layer_score(
    erasure: Float[Tensor, " layer"], weight: Float[Tensor, " layer"], min_weight: float = MIN_WEIGHT
) -> float:
    """``sum w * e / sum w`` over layers with ``w > min_weight``; NaN if no layer qualifies."""
    keep = weight > min_weight
    if not bool(keep.any()):
        return math.nan
    w = weight[keep].double()
    return float((w * erasure[keep].double()).sum() / w.sum())


def similarity_erasure(
    sim_unlearned_retain: Float[Tensor, " layer"], sim_full_retain: Float[Tensor, " layer"]
) -> tuple[Float[Tensor, " layer"], Float[Tensor, " layer"]]:
    """Retain-normalised erasure of a similarity to the retain model.

    Args:
        sim_unlearned_retain: ``S(unl, ret)`` per layer, 1 = identical.
        sim_full_retain: ``S(full, ret)`` per layer.

    Returns:
        ``(erasure, weight)``: ``clip((S_ur - S_fr) / (1 - S_fr + 1e-8), 0, 1)`` and ``max(1 - S_fr, 0)``.
    """
    erasure = ((sim_unlearned_retain - sim_full_retain) / (1.0 - sim_full_retain + SIMILARITY_EPS)).clamp(
        0.0, 1.0
    )
    weight = (1.0 - sim_full_retain).clamp(min=0.0)
    return erasure, weight


def pooled_layerwise(
    method: str,
    d1: Float[Tensor, "example layer"],
    ke: Bool[Tensor, "example layer"],
    ler: Float[Tensor, "example layer"],
) -> LayerwiseErasure:
    """Pool a UDS-shaped table over examples, per layer: ``e_l = sum_i KE d1 LER / sum_i KE d1`` (1 where no example
    is KE), ``w_l = sum_i KE d1 / n``.

    The weighted mean of this view is the d1-pooled score, not the mean of per-example scores a model score is;
    it is what the layerwise plots and ``layerwise.csv`` show. ``ler`` is read on KE entries only.
    """
    ke_d1 = torch.where(ke, d1, torch.zeros_like(d1)).double()
    total = ke_d1.sum(dim=0)
    on_ke = torch.where(ke, ler.double(), torch.zeros_like(ke_d1))
    erasure = torch.where(total > 0, (ke_d1 * on_ke).sum(dim=0) / total.clamp(min=1e-30), 1.0)
    weight = total / max(d1.shape[0], 1)
    return LayerwiseErasure(method, erasure.float(), weight.float())


LENS_EPS = 1e-8
"""Added to ``d1`` in the lens LER, and the KE weight an example needs to be scored (the published lens)."""


@dataclass(frozen=True)
class LensErasure:
    """The lens variant of UDS's aggregation, per example and layer (see the module docstring).

    Attributes:
        d1: ``k_full - k_ret`` per example and layer.
        d2: ``k_full - k_unl`` per example and layer.
        ke: KE layers, ``d1 > tau``.
        ler: ``clip(d2 / (d1 + 1e-8), 0, 1)`` (meaningful on KE layers only).
        per_example: ``sum_KE d1 * LER / sum_KE d1``, NaN when ``sum_KE d1 <= 1e-8``.
    """

    d1: Float[Tensor, "example layer"]
    d2: Float[Tensor, "example layer"]
    ke: Bool[Tensor, "example layer"]
    ler: Float[Tensor, "example layer"]
    per_example: Float[Tensor, " example"]

    @property
    def score(self) -> float:
        """Plain mean of the defined per-example scores (NaN if none is defined)."""
        defined = self.per_example[~self.per_example.isnan()]
        return float(defined.double().mean()) if defined.numel() else math.nan

    def layerwise(self, method: str) -> LayerwiseErasure:
        """Per-layer erasure pooled over examples (`pooled_layerwise`)."""
        return pooled_layerwise(method, self.d1, self.ke, self.ler)


def lens_erasure(
    d1: Float[Tensor, "example layer"], d2: Float[Tensor, "example layer"], tau: float = DEFAULT_TAU
) -> LensErasure:
    """The published lens aggregation of per-layer deltas: UDS's form with ``eps`` in the ratio.

    Args:
        d1: Retain deltas ``k_full - k_ret``.
        d2: Unlearned deltas ``k_full - k_unl``.
        tau: KE threshold (strict ``d1 > tau``).
    """
    ke = d1 > tau
    ler = (d2 / (d1 + LENS_EPS)).nan_to_num(nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
    ke_d1 = torch.where(ke, d1, torch.zeros_like(d1)).double()
    denominator = ke_d1.sum(dim=1)
    numerator = (ke_d1 * ler.double()).sum(dim=1)
    per_example = torch.where(denominator > LENS_EPS, numerator / denominator.clamp(min=1e-30), math.nan)
    return LensErasure(d1=d1, d2=d2, ke=ke, ler=ler, per_example=per_example.to(d1.dtype))

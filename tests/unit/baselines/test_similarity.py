"""uds_lens/similarity.py and uds_lens/layerwise.py: CKA/RSA/SVCCA/PWCCA properties and retain normalisation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from uds_lens.baselines.hidden import HiddenStates
from uds_lens.baselines.layerwise import LayerwiseErasure, similarity_erasure, weighted_layer_score
from uds_lens.baselines.similarity import (
    _rank,
    linear_cka,
    pwcca,
    rsa,
    similarity_score,
    svcca,
)


@pytest.fixture()
def x() -> torch.Tensor:
    return torch.randn(60, 12, generator=torch.Generator().manual_seed(0))


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed)))
    return q


def test_cka_identity_orthogonal_and_isotropic_scale_invariance(x):
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    y = torch.tanh(x @ torch.randn(12, 9, generator=torch.Generator().manual_seed(1)))
    base = linear_cka(x, y)
    assert 0.0 < base < 1.0
    assert linear_cka(x @ _orthogonal(12, 2) * 3.7, y) == pytest.approx(base, abs=1e-6)
    assert linear_cka(x, y * 0.01 + 5.0) == pytest.approx(base, abs=1e-6)  # centring removes the offset
    anisotropic = x * torch.linspace(0.1, 10, 12)
    assert abs(linear_cka(anisotropic, y) - base) > 1e-3


def test_cka_equals_hsic_form(x):
    y = x[:, :5] ** 2
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    k, l_ = x.double() @ x.double().T, y.double() @ y.double().T

    def hsic(a, b):
        return torch.trace(a @ h @ b @ h)

    expected = hsic(k, l_) / torch.sqrt(hsic(k, k) * hsic(l_, l_))
    assert linear_cka(x, y) == pytest.approx(float(expected), abs=1e-10)


def test_cka_degenerate_is_zero():
    assert linear_cka(torch.ones(5, 3), torch.randn(5, 3)) == 0.0


def test_rank_matches_scipy_with_ties():
    values = torch.tensor([3.0, 1.0, 3.0, 2.0, 1.0, 5.0], dtype=torch.float64)
    np.testing.assert_allclose(_rank(values).numpy() + 1, stats.rankdata(values.numpy()))


def test_rsa_svcca_pwcca_identity_and_invariances(x):
    assert rsa(x, x) == pytest.approx(1.0)
    assert rsa(x, 4.0 * x @ _orthogonal(12, 3)) == pytest.approx(1.0)
    assert svcca(x, x) == pytest.approx(1.0, abs=1e-8)
    assert pwcca(x, x) == pytest.approx(1.0, abs=1e-8)
    rotated = x @ _orthogonal(12, 4) * 2.0
    assert svcca(x, rotated) == pytest.approx(1.0, abs=1e-8)
    noise = torch.randn(60, 12, generator=torch.Generator().manual_seed(5))
    for similarity in (rsa, svcca, pwcca):
        assert similarity(x, noise) < 0.9


def test_similarity_erasure_formula():
    erasure, weight = similarity_erasure(
        torch.tensor([0.9, 0.5, 0.2, 1.0]), torch.tensor([0.5, 0.5, 0.5, 1.0])
    )
    torch.testing.assert_close(erasure, torch.tensor([0.4 / (0.5 + 1e-8), 0.0, 0.0, 0.0]))
    torch.testing.assert_close(weight, torch.tensor([0.5, 0.5, 0.5, 0.0]))
    assert weighted_layer_score(erasure, weight) == pytest.approx(0.8 / 3, rel=1e-6)
    assert math.isnan(weighted_layer_score(erasure, torch.zeros(4)))


def test_layerwise_frame():
    frame = LayerwiseErasure("cka", torch.tensor([0.0, 1.0]), torch.tensor([1.0, 3.0])).to_frame()
    assert list(frame.columns) == ["method", "layer", "erasure", "weight"]
    assert frame["layer"].tolist() == [0, 1]


@pytest.mark.parametrize("method", ["cka", "rsa", "svcca", "pwcca"])
def test_similarity_scores_on_models(trio_hidden, method):
    hidden = trio_hidden
    as_full = similarity_score(hidden["full"], hidden["retain"], hidden["full"], method)
    as_retain = similarity_score(hidden["full"], hidden["retain"], hidden["retain"], method)
    as_other = similarity_score(hidden["full"], hidden["retain"], hidden["other"], method)
    assert as_full.score <= 0.02
    assert as_retain.score >= 0.98
    assert 0.0 <= as_other.score <= 1.0
    assert (as_full.weight >= 0).all()


def test_synthetic_interpolation_is_monotone():
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(1, 80, 16, generator=generator)
    retain = torch.randn(1, 80, 16, generator=generator)
    index = torch.arange(80)

    def states(resid):
        return HiddenStates(resid, index, index, torch.zeros(80, dtype=torch.long))

    scores = [
        similarity_score(states(full), states(retain), states((1 - t) * full + t * retain), "cka").score
        for t in (0.0, 0.3, 0.7, 1.0)
    ]
    assert scores[0] == pytest.approx(0.0, abs=1e-9) and scores[-1] == pytest.approx(1.0, abs=1e-6)
    assert all(a <= b + 1e-9 for a, b in zip(scores[:-1], scores[1:], strict=True))

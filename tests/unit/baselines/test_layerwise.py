"""uds_lens/baselines/layerwise.py: the weighted layer score, the per-layer pooling of UDS-shaped tables, and the
lens variant of the UDS aggregation (the same as ``uds.example_uds`` except for its two epsilons)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from uds_lens import uds
from uds_lens.baselines.layerwise import (
    LENS_EPS,
    LayerwiseErasure,
    lens_erasure,
    pooled_layerwise,
    weighted_layer_score,
)

D1 = torch.tensor(
    [[0.5, 0.02, 2.0, 1.0], [0.01, 0.03, 0.0, 0.04], [1.0, 0.04, 0.3, 0.06]], dtype=torch.float64
)
D2 = torch.tensor([[0.25, 0.5, 3.0, -0.2], [0.3, 0.0, 0.1, 0.02], [0.5, 0.1, 0.0, 0.06]], dtype=torch.float64)


def test_weighted_layer_score_skips_layers_without_signal():
    erasure = torch.tensor([0.2, 1.0, 0.6])
    assert weighted_layer_score(erasure, torch.tensor([1.0, 0.0, 3.0])) == pytest.approx((0.2 + 1.8) / 4)
    assert math.isnan(weighted_layer_score(erasure, torch.tensor([0.0, 1e-9, 0.0])))
    result = LayerwiseErasure("m", erasure, torch.tensor([1.0, 0.0, 3.0]))
    assert result.score == pytest.approx(0.5)
    frame = result.to_frame()
    assert list(frame.columns) == ["method", "layer", "erasure", "weight"]
    assert frame["layer"].tolist() == [0, 1, 2] and (frame["method"] == "m").all()


def test_lens_erasure_is_the_uds_aggregation_up_to_its_epsilons():
    lens = lens_erasure(D1, D2, tau=0.05)
    expected = uds.example_uds(D1.numpy(), D2.numpy(), tau=0.05)
    np.testing.assert_allclose(lens.per_example.numpy(), expected, rtol=1e-6, equal_nan=True)
    assert math.isnan(lens.per_example[1]) and lens.ke.sum(dim=1).tolist() == [3, 0, 3]
    assert lens.score == pytest.approx(float(np.nanmean(expected)), rel=1e-6)
    # where they differ: the ratio has eps in its denominator, and a KE weight of at most eps is not scored
    tiny_d1 = torch.tensor([[LENS_EPS / 2]], dtype=torch.float64)
    assert math.isnan(lens_erasure(tiny_d1, tiny_d1, tau=0.0).per_example[0])
    assert uds.example_uds(tiny_d1.numpy(), tiny_d1.numpy(), tau=0.0)[0] == 1.0
    assert lens_erasure(tiny_d1 * 4, tiny_d1 * 4, tau=0.0).ler[0, 0] == pytest.approx(2 / 3)


def test_pooled_layerwise_pools_examples_per_layer():
    ke = torch.tensor(uds.ke_mask(D1.numpy(), 0.05))
    ler = torch.tensor(uds.layer_erasure_ratio(D1.numpy(), D2.numpy()))
    pooled = pooled_layerwise("uds", D1, ke, ler)
    for layer in range(D1.shape[1]):
        on = ke[:, layer]
        if on.any():
            d1 = D1[on, layer]
            expected = float((d1 * ler[on, layer]).sum() / d1.sum())
            assert pooled.erasure[layer].item() == pytest.approx(expected, rel=1e-6)
        else:
            assert pooled.erasure[layer].item() == 1.0
        assert pooled.weight[layer].item() == pytest.approx(float(D1[on, layer].sum() / 3), rel=1e-6)
    assert pooled.weight[1].item() == 0.0  # no KE example at layer 1: no signal, left out of the score
    # a LER that is NaN off KE (UDSResult.layers' convention) pools the same
    off_ke_nan = torch.where(ke, ler, torch.nan)
    torch.testing.assert_close(pooled_layerwise("uds", D1, ke, off_ke_nan).erasure, pooled.erasure)
    lens = lens_erasure(D1, D2, tau=0.05).layerwise("logit_lens")
    assert lens.method == "logit_lens"
    torch.testing.assert_close(lens.erasure, pooled.erasure, atol=1e-6, rtol=0)

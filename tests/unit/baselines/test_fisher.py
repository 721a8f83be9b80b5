"""uds_lens/fisher.py: diagonal Fisher per block and the masked-Fisher erasure (PUBLISHED_IMPL §3)."""

from __future__ import annotations

import pytest
import torch

from uds_lens.baselines.fisher import (
    FisherDiagonal,
    diagonal_fisher,
    fisher_anchor,
    fisher_method_key,
    masked_fisher,
    masked_fisher_scores,
)


@pytest.fixture(scope="module")
def fishers(trio) -> dict[str, FisherDiagonal]:
    return {name: diagonal_fisher(trio.models[name], trio.encoded[:3]) for name in ("full", "retain")}


def test_method_keys():
    assert [fisher_method_key(p) for p in (1e-4, 1e-3, 1e-2)] == [
        "fisher_masked_0.0001",
        "fisher_masked_0.001",
        "fisher_masked_0.01",
    ]


def test_diagonal_fisher_is_mean_squared_gradient_of_block_parameters(trio, fishers):
    model = trio.models["full"]
    fisher = fishers["full"]
    assert len(fisher.per_layer) == 3
    assert fisher.per_layer[1].numel() == sum(p.numel() for p in model.blocks[1].parameters())
    assert not any(p.requires_grad for p in model.parameters())  # restored after the backward passes
    expected = torch.zeros_like(fisher.per_layer[1])
    params = list(model.blocks[1].parameters())
    for example in trio.encoded[:3]:
        for p in params:
            p.requires_grad_(True)
        logits = model(torch.tensor([example.input_ids]), return_type="logits")[0]
        logprobs = torch.log_softmax(logits[list(example.read_positions)], dim=-1)
        loss = -logprobs.gather(1, torch.tensor(example.labels)[:, None]).mean()
        grads = torch.autograd.grad(loss, params)
        expected += torch.cat([g.flatten() ** 2 for g in grads])
        for p in params:
            p.requires_grad_(False)
    torch.testing.assert_close(fisher.per_layer[1], expected / 3, rtol=1e-4, atol=1e-10)


def test_masked_fisher_hand_computed():
    full = FisherDiagonal([torch.tensor([1.0, 0.0, 5.0, 2.0])], 1)
    retain = FisherDiagonal([torch.tensor([4.0, 3.0, 5.0, 1.0])], 1)
    unlearned = FisherDiagonal([torch.tensor([2.0, 3.0, 0.0, 0.0])], 1)
    anchor = fisher_anchor(full, retain, 0.5)  # a = [3, 3, 0, 0] -> mask {0, 1}
    assert sorted(anchor.masks[0].tolist()) == [0, 1]
    assert anchor.retain_mean.item() == pytest.approx(3.5)
    assert anchor.excess_full.item() == pytest.approx(3.0)
    result = masked_fisher(anchor, unlearned)
    # excess_unl = 3.5 - 2.5 = 1 -> erasure = 1 - 1/3
    assert result.erasure.item() == pytest.approx(2.0 / 3.0, rel=1e-6)
    assert result.weight.item() == pytest.approx(3.0)
    tiny = fisher_anchor(full, retain, 1e-9)
    assert tiny.masks[0].numel() == 1


def test_layer_without_signal_gets_erasure_one_and_no_weight():
    same = FisherDiagonal([torch.tensor([1.0, 2.0])], 1)
    result = masked_fisher(fisher_anchor(same, same, 0.5), FisherDiagonal([torch.tensor([9.0, 9.0])], 1))
    assert result.erasure.item() == 1.0 and result.weight.item() == 0.0


def test_masked_fisher_endpoints_on_models(fishers):
    as_full = masked_fisher_scores(fishers["full"], fishers["retain"], fishers["full"])
    as_retain = masked_fisher_scores(fishers["full"], fishers["retain"], fishers["retain"])
    mixed = FisherDiagonal(
        [(f + r) / 2 for f, r in zip(fishers["full"].per_layer, fishers["retain"].per_layer, strict=True)], 3
    )
    as_other = masked_fisher_scores(fishers["full"], fishers["retain"], mixed)
    assert set(as_full) == {"fisher_masked_0.0001", "fisher_masked_0.001", "fisher_masked_0.01"}
    for key in as_full:
        assert as_full[key].score <= 0.02
        assert as_retain[key].score >= 0.98
        assert 0.3 <= as_other[key].score <= 0.7  # halfway between full and retain

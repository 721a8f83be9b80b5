"""Model-level scorers for the meta-evaluation: anchored at full (0) and retain (1), cached, NF4 sources accepted."""

import math

import pytest

from uds_lens.meta_eval.attacks import quantise_nf4
from uds_lens.meta_eval.scorers import WHITE_BOX, ModelScorers


@pytest.fixture(scope="module")
def scorers(tiny):
    return ModelScorers(tiny.full, tiny.retain, tiny.data, cache_dir=False)


def test_full_scores_zero_and_retain_one(scorers, tiny):
    fns = scorers.white_box_fns()
    assert set(fns) == set(WHITE_BOX)
    assert scorers.uds(tiny.full) == pytest.approx(0.0, abs=1e-6)
    assert scorers.uds(tiny.retain) == pytest.approx(1.0, abs=1e-6)
    for name in ("logit_lens", "fisher_masked"):
        assert fns[name](tiny.full) == pytest.approx(0.0, abs=1e-4), name
        assert fns[name](tiny.retain) == pytest.approx(1.0, abs=1e-4), name
    unlearned = {name: fn(tiny.unlearned) for name, fn in fns.items()}
    assert all(math.isfinite(v) for k, v in unlearned.items() if k != "cka"), unlearned
    assert 0.0 < scorers.uds(tiny.unlearned) < 1.0


def test_each_model_is_scored_once(scorers, tiny, monkeypatch):
    fns = scorers.white_box_fns()
    first = fns["logit_lens"](tiny.unlearned)
    monkeypatch.setattr(scorers._reference, "observational", lambda model: pytest.fail("scored twice"))
    assert fns["logit_lens"](str(tiny.unlearned)) == first
    assert math.isfinite(fns["fisher_masked"](tiny.unlearned)) or math.isnan(
        fns["fisher_masked"](tiny.unlearned)
    )


def test_a_quantised_source_is_scored_on_its_dequantised_weights(scorers, tiny):
    quantised = quantise_nf4(tiny.full, device="cpu")
    # run the quantised model first (as the meta-evaluation's output metrics and UDS do), then the white-box scores:
    # the forward passes must not leave weights that dequantise to something else
    uds = scorers.uds(quantised)
    assert (
        0.0 < uds < 0.5
    )  # NF4 rounding moves full a little towards nothing in particular, far from retain's 1
    lens = scorers.white_box_fns()["logit_lens"]
    assert lens(tiny.full) == pytest.approx(0.0, abs=1e-4)
    assert 1e-6 < lens(quantised) < 0.5
    assert lens(quantised) != pytest.approx(lens(tiny.retain), abs=0.3)


def test_nf4_weights_are_the_rounded_originals_after_a_forward_pass(tiny):
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    quantised = quantise_nf4(tiny.full, device="cpu")
    ids = torch.tensor([[0, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        quantised(ids)
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    original = AutoModelForCausalLM.from_pretrained(tiny.full).state_dict()
    dequantised = copy.deepcopy(quantised).dequantize().state_dict()
    for name, weight in original.items():
        if name.endswith("proj.weight"):
            rounded = dequantize_4bit(*quantize_4bit(weight, blocksize=64, quant_type="nf4")).float()
            got = dequantised[name].float()
            assert float((rounded - weight).norm() / weight.norm()) > 0.01, name  # NF4 does round
            assert float((got - rounded).norm() / weight.norm()) < 0.02, (
                name
            )  # to exactly that, not a repacked layout


def test_the_split_columns_come_from_the_one_scoring_of_uds(scorers, tiny, monkeypatch):
    """metrics.csv carries uds_clipped and excess_disruption beside uds, read from the same UDSResult: the parts
    add up to the UDS the table shows, and the model is not scored again for them."""
    from uds_lens.meta_eval.scorers import SPLIT_COLUMNS

    fns = scorers.split_fns()
    assert set(fns) == set(SPLIT_COLUMNS) == {"uds_clipped", "excess_disruption"}
    uds = scorers.uds(tiny.unlearned)
    monkeypatch.setattr(scorers.auditor, "score", lambda model: pytest.fail("scored twice"))
    result = scorers._result(tiny.unlearned)
    assert fns["uds_clipped"](tiny.unlearned) == result.split["uds_clipped"]
    assert result.split["uds_unclipped"] + fns["uds_clipped"](tiny.unlearned) == pytest.approx(uds, abs=1e-12)
    assert fns["excess_disruption"](tiny.unlearned) >= 0.0

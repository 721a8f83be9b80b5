"""Model-level scorers for the meta-evaluation: anchored at full (0) and retain (1), cached, NF4 sources accepted."""

import math

import pytest
from tiny_models import make_llama

from uds_lens.meta_eval import QuantisationError, quantise_nf4
from uds_lens.scorers import WHITE_BOX, ModelScorers


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
    assert math.isfinite(fns["fisher_masked"](tiny.unlearned)) or math.isnan(fns["fisher_masked"](tiny.unlearned))


@pytest.fixture(scope="module")
def wide(tiny, tmp_path_factory):
    """A full/retain pair whose widths bitsandbytes' CPU NF4 kernel accepts (multiples of 64)."""
    root = tmp_path_factory.mktemp("wide")
    full = make_llama(root / "full", tiny.tokenizer, seed=0, d_model=64, d_mlp=128)
    retain = make_llama(root / "retain", tiny.tokenizer, seed=1, base=full, noise=0.3)
    return full, retain


def test_a_quantised_source_is_scored_on_its_dequantised_weights(wide, tiny):
    full, retain = wide
    scorers = ModelScorers(full, retain, tiny.data, cache_dir=False)
    quantised = quantise_nf4(full, device="cpu")
    uds = scorers.uds(quantised)
    # NF4 rounding moves the source a little away from full: a small UDS, not 0 and far from retain's 1
    assert 0.0 < uds < 0.5
    lens = scorers.white_box_fns()["logit_lens"]
    assert lens(full) == pytest.approx(0.0, abs=1e-4)
    assert math.isfinite(lens(quantised)) and lens(quantised) > 1e-6


def test_nf4_refuses_cpu_widths_its_kernel_cannot_run(tiny):
    with pytest.raises(QuantisationError, match="multiples of 64"):
        quantise_nf4(tiny.full, device="cpu")

"""Head-level UDS on the trained test zoo, with zoo models addressed by name."""

from __future__ import annotations

import time

import pytest
import torch

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import load_tokenizer
from uds_lens.config import UDSConfig
from uds_lens.tl_compat import TransformerBridge
from uds_lens.zoo.layout import load_zoo


@pytest.fixture(scope="module")
def zoo_auditor(test_zoo, monkeypatch_module):
    monkeypatch_module.setenv("UDS_LENS_ZOO", str(test_zoo.root))
    # The whole forget set (30 examples): one head carries less than a whole layer, and on 6 examples no head's d1
    # cleared tau on every zoo build (the largest was 0.045 on one), so the head-level test had nothing to check.
    return UDSAuditor(
        "zoo:full", "zoo:retain", test_zoo.forget_path, UDSConfig(), cache_dir=False, progress=False
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_zoo_names_load_and_are_kept(zoo_auditor, test_zoo):
    npo = zoo_auditor.load_source("zoo:npo")
    assert isinstance(npo, TransformerBridge) and npo.uds_source == str(test_zoo.path("npo"))
    assert zoo_auditor.load_source("zoo:npo") is npo  # loaded once, kept
    result = zoo_auditor.score("zoo:npo")
    assert result.name == "npo" and zoo_auditor.last_source is npo
    assert load_tokenizer("zoo:npo").vocab_size == zoo_auditor.tokenizer.vocab_size
    model = load_zoo(test_zoo.root).model("retain")
    assert isinstance(model, TransformerBridge) and model.cfg.n_layers == zoo_auditor.full.cfg.n_layers


def test_unknown_zoo_name_fails_at_once_naming_the_models(zoo_auditor):
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="npo"):
        zoo_auditor.load_source("zoo:no_such_model")
    assert time.perf_counter() - started < 5
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="pass 'zoo:npo'"):
        zoo_auditor.load_source("npo")  # a bare zoo name is not retried on the hub
    assert time.perf_counter() - started < 5


def test_head_level_uds_separates_retain_from_full(zoo_auditor):
    """On trained models the head patch carries knowledge: retain's heads remove it (d1 > 0 somewhere), a full
    source removes nothing (d2 == 0 at every head), a retain source removes all of it (UDS 1 on every KE cell)."""
    as_full = zoo_auditor.patch_heads("zoo:full")
    assert as_full.s1.shape[1:] == (zoo_auditor.full.cfg.n_layers, zoo_auditor.full.cfg.n_heads)
    assert as_full.ke.any()
    assert as_full.d2.abs().max() < 1e-5
    assert as_full.uds == pytest.approx(0.0, abs=1e-6)
    as_retain = zoo_auditor.patch_heads("zoo:retain")
    defined = as_retain.component_uds[~torch.isnan(as_retain.component_uds)]
    assert defined.numel() and torch.allclose(defined, torch.ones_like(defined))
    npo = zoo_auditor.patch_heads("zoo:npo")
    frame = npo.frame()
    assert len(frame) == npo.s1.numel() and frame["ler"].isna().eq(~frame["ke"]).all()

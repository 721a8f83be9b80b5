"""Every supported decoder family on tiny random checkpoints (issue 25): Llama-3 (rope scaling), Mistral, Qwen2 (q/k/v
biases), Qwen3 (q/k norm), Gemma 2 and 3 (norm offsets, post-norms, soft-capping, sliding windows, scaled
embeddings), Phi-3 (fused projections) and OLMo 2 (post-norms, q/k norm).

For each: the bridge equals Hugging Face (hidden states, final norm, logits) and every site equals the tensor a plain
torch hook reads on Hugging Face's own modules, exactly where the bridge runs Hugging Face's operations on the same
tensors and within the reordering tolerance where it does not (Phi-3, see ``REORDERED_BRIDGES``); the naive engine is
the oracle; the fast engine equals it within 1e-5
(or, for a family it does not compute, the auditor runs the naive engine and says so); full -> full is exactly 0 below
the last layer, retain -> retain is 1, in both modes; one head's patch changes nothing when source = full.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.families import build_family, family_configs
from helpers.hf_oracle import hf_site
from helpers.numerics import assert_close_reordered, reordered_tolerance

from uds_lens import UDSConfig, load_tokenizer
from uds_lens.components import patch_heads
from uds_lens.config import EngineSpec
from uds_lens.data import encode, load_examples
from uds_lens.models import load_hf_model, load_model
from uds_lens.patching import (
    FAST_MODEL_TYPES,
    fast_engine_refusal,
    pad_batch,
    patched_scores,
    source_activations,
)
from uds_lens.sources import SITES, as_source, verify_parity

FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"]
TOKENS = torch.tensor([[0, 5, 17, 33, 2, 90, 41, 7, 8], [0, 6, 6, 19, 77, 3, 12, 250, 9]])
# Families whose bridge does not run Hugging Face's own operations on Hugging Face's tensors. Phi-3's bridge
# (TransformerLens's JointGateUpMLPBridge and JointQKV attention) splits the fused ``gate_up_proj``/``qkv_proj`` into
# separate projections and applies the activation to the contiguous ``gate`` tensor, where Hugging Face applies it to
# a strided chunk of the fused output: the same arithmetic on another layout, whose last bits depend on the
# processor's vector width (exact on AVX2 at d_mlp 48, 1e-6 apart on AVX-512). Every other family's bridge runs the
# same operations on the same layouts (its attention is an op-for-op copy of Hugging Face's eager attention), which
# the row lengths of helpers/families.py, chosen to leave a vector remainder on every processor, hold it to.
REORDERED_BRIDGES = {"phi3"}


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """``{family: {"full": dir, "retain": dir}}``, built once for the module (about two seconds a family)."""
    tokenizer = load_tokenizer(tiny.tokenizer)
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, config in family_configs(len(tokenizer)).items():
        full = build_family(config, root / family / "full", tokenizer, seed=0)
        retain = build_family(config, root / family / "retain", tokenizer, seed=1, base=full, noise=0.5)
        out[family] = {"full": full, "retain": retain}
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints) -> dict[str, dict[str, object]]:
    return {
        family: {role: load_model(path, device="cpu") for role, path in paths.items()}
        for family, paths in checkpoints.items()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_is_hugging_face_at_every_site(family, checkpoints, loaded):
    bridge = loaded[family]["full"]
    plain = load_hf_model(checkpoints[family]["full"], device="cpu", attn_implementation="eager")
    parity = verify_parity(bridge, plain, TOKENS)
    if family in REORDERED_BRIDGES:
        with torch.no_grad():
            reference = plain(input_ids=TOKENS, output_hidden_states=True, use_cache=False)
        magnitude = max(float(h.abs().max()) for h in (*reference.hidden_states, reference.logits))
        assert max(parity.values()) <= reordered_tolerance(magnitude), parity
        compare = assert_close_reordered
    else:
        # exact by construction: the bridge runs Hugging Face's own modules (or their op-for-op copy) on its tensors
        assert parity == {"resid_post": 0.0, "final_norm": 0.0, "logits": 0.0}

        def compare(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
            torch.testing.assert_close(actual, expected, atol=0, rtol=0, msg=msg)

    source = as_source(bridge)
    for site in SITES:
        acts = source.activations(TOKENS, site, range(source.n_layers))
        for layer in range(source.n_layers):
            compare(acts[layer], hf_site(plain, TOKENS, site, layer), msg=f"{site} {layer}")
    # not vacuous: the retain checkpoint differs
    assert verify_parity(loaded[family]["retain"], plain, TOKENS)["logits"] > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_engine_equals_naive_or_is_refused(family, tiny, loaded):
    full, retain = loaded[family]["full"], loaded[family]["retain"]
    model_type = full.original_model.config.model_type
    refusal = fast_engine_refusal(full)
    if model_type not in FAST_MODEL_TYPES:
        assert refusal is not None and model_type in refusal
        return
    assert refusal is None
    tokenizer = load_tokenizer(tiny.tokenizer)
    for compat in (False, True):
        encoded, _ = encode(load_examples(tiny.data), tokenizer, published_compat=compat)
        batch = pad_batch(encoded, tokenizer.pad_token_id, "span")
        layers = list(range(full.cfg.n_layers))
        for site in SITES:
            acts = source_activations(retain, batch.tokens, EngineSpec(site, layers, published_compat=compat))
            naive = patched_scores(full, batch, acts, EngineSpec(site, layers, "naive"))
            fast = patched_scores(full, batch, acts, EngineSpec(site, layers, "fast"))
            assert (naive - fast).abs().max() <= 1e-5, (site, compat)
            assert (naive - naive.mean()).abs().max() > 1e-3  # not vacuous: layers and examples differ


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compat", [False, True])
def test_full_is_zero_and_retain_is_one(family, compat, loaded, tiny_auditor, caplog):
    models = loaded[family]
    with caplog.at_level(logging.WARNING, logger="uds_lens.auditor"):
        auditor = tiny_auditor(models, UDSConfig(published_compat=compat))
    fast = models["full"].original_model.config.model_type in FAST_MODEL_TYPES
    assert auditor.config.engine == ("fast" if fast else "naive")
    assert fast or "naive engine" in caplog.text  # the one-line notice of the fallback
    as_retain = auditor.score(models["retain"])
    scored = as_retain.examples.dropna(subset=["uds"])
    assert len(scored) >= 2 and np.allclose(scored["uds"], 1.0)
    as_full = auditor.score(models["full"])
    last = models["full"].cfg.n_layers - 1
    assert (as_full.layers.loc[as_full.layers["layer"] < last, "d2"] == 0.0).all()
    if not compat:
        assert (as_full.layers["d2"] == 0.0).all()


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "olmo2"])
def test_one_head_patched_from_full_changes_nothing(family, loaded, tiny_auditor):
    """Head-level patching (``hook_z``) on a fast family and two naive ones: source = full moves no score."""
    models = loaded[family]
    auditor = tiny_auditor(models)
    heads = patch_heads(auditor, models["full"], hook="z", idxs=[0, 2])
    assert heads.s2.shape[-1] == models["full"].cfg.n_heads
    # reordered: the fast engine's head patch against its baseline run (the naive engine's would be exact)
    assert_close_reordered(heads.s2, heads.baseline)
    assert (heads.d1.nan_to_num().abs() > 1e-4).any()  # retain's heads do move the score

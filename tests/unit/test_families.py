"""Every supported decoder family on tiny random checkpoints (issues 25, 34): Llama-3 (rope scaling), Mistral with and
without a sliding window, Qwen2 (q/k/v biases; one windowed layer), Qwen3 (q/k norm), Gemma 2 and 3 (norm offsets,
post-norms, soft-capping, sliding windows, scaled embeddings), Phi-3 (fused projections) and OLMo 2 (post-norms, q/k
norm), and the family table they are described by.

For each: the bridge equals Hugging Face (hidden states, final norm, logits) and every site equals the tensor a plain
torch hook reads on Hugging Face's own modules, exactly where the bridge runs Hugging Face's operations on the same
tensors and within the reordering tolerance where it does not (Phi-3, see ``REORDERED_BRIDGES``); the naive engine is
the oracle; the fast engine runs every family and equals it within 1e-5 at every site in both modes (a reordered
computation: another kernel); full -> full is exactly 0 below the last layer, retain -> retain is 1, in both modes;
head patching on the fast engine equals the naive engine's, and one head's patch changes nothing when source = full.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.families import WINDOW, build_family, family_configs
from helpers.hf_oracle import hf_site
from helpers.numerics import assert_close_reordered, reordered_tolerance

from uds_lens.checkpoints.loader import load_hf_model, load_model, load_tokenizer
from uds_lens.components import patch_heads
from uds_lens.config import SITES, EngineSpec, UDSConfig
from uds_lens.data import encode, load_examples
from uds_lens.families import family_of
from uds_lens.patching.batch import pad_batch
from uds_lens.patching.engines import engine_for, source_activations
from uds_lens.patching.kernels import FAST_MODEL_TYPES, fast_engine_refusal
from uds_lens.sources import as_source, verify_parity

FAMILIES = [
    "llama3",
    "mistral",
    "mistral_window",
    "qwen2",
    "qwen2_window",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
]
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
def test_fast_engine_equals_naive(family, tiny, loaded):
    full, retain = loaded[family]["full"], loaded[family]["retain"]
    assert full.original_model.config.model_type in FAST_MODEL_TYPES
    assert fast_engine_refusal(full) is None
    tokenizer = load_tokenizer(tiny.tokenizer)
    for compat in (False, True):
        encoded, _ = encode(load_examples(tiny.data), tokenizer, published_compat=compat)
        batch = pad_batch(encoded, tokenizer.pad_token_id, "span")
        layers = list(range(full.cfg.n_layers))
        for site in SITES:
            acts = source_activations(retain, batch.tokens, EngineSpec(site, layers, published_compat=compat))
            naive = engine_for(EngineSpec(site, layers, "naive")).patched_scores(full, batch, acts)
            fast = engine_for(EngineSpec(site, layers, "fast")).patched_scores(full, batch, acts)
            # reordered (another kernel), held to the 1e-5 in fp32
            assert (naive - fast).abs().max() <= 1e-5, (site, compat)
            assert (naive - naive.mean()).abs().max() > 1e-3  # not vacuous: layers and examples differ


def test_windows_are_reached_and_change_the_scores(tiny, loaded):
    """The windowed checkpoints are the unwindowed one's weights with a window every prompt is longer than: the
    window masks keys in every example and moves the scores, so the fast engine's agreement above is about it."""
    tokenizer = load_tokenizer(tiny.tokenizer)
    encoded, _ = encode(load_examples(tiny.data), tokenizer)
    assert min(ex.window("span").start for ex in encoded) > WINDOW
    batch = pad_batch(encoded, tokenizer.pad_token_id, "span")
    spec = EngineSpec("resid_post", [0, 1], "fast")
    plain = engine_for(spec).clean_run(loaded["mistral"]["full"], batch).scores
    windowed = engine_for(spec).clean_run(loaded["mistral_window"]["full"], batch).scores
    assert (plain - windowed).abs().min() > 0 and (plain - windowed).abs().max() > 1e-3
    windows = {
        name: family_of(loaded[name]["full"].original_model.config).windows(
            loaded[name]["full"].original_model.config
        )
        for name in ("mistral", "mistral_window", "qwen2_window", "gemma2", "gemma3", "phi3")
    }
    assert windows == {
        "mistral": [None, None],
        "mistral_window": [WINDOW, WINDOW],
        "qwen2_window": [None, WINDOW],
        "gemma2": [WINDOW, None],
        "gemma3": [WINDOW, WINDOW],
        "phi3": [None, None],
    }


def test_phi3_long_rope_decides_from_the_whole_input(tiny, tmp_path):
    """Hugging Face's Phi-3 takes its long rope factors when the input is longer than
    ``original_max_position_embeddings``. Set here between the cut length (through the last read position, what the
    fast engine's kernel sees) and the whole prompt + reference (what the model's own forward sees), the fast
    engine on the cut batch still equals the naive engine on the whole one: the kernel decides from the whole
    input (``PatchBatch.input_length``)."""
    from transformers import Phi3Config

    tokenizer = load_tokenizer(tiny.tokenizer)
    encoded, _ = encode(load_examples(tiny.data), tokenizer)
    cut = max(ex.read_positions.stop for ex in encoded)
    whole = pad_batch(encoded, tokenizer.pad_token_id, "span", cut=False)
    assert whole.input_length > cut
    config = family_configs(len(tokenizer))["phi3"].to_dict()
    rotary = config["hidden_size"] // config["num_attention_heads"] // 2
    config["rope_scaling"] = {
        "rope_type": "longrope",
        "short_factor": [1.0] * rotary,
        "long_factor": [4.0] * rotary,
    }
    config["original_max_position_embeddings"] = cut
    phi3 = Phi3Config(**{key: value for key, value in config.items() if key != "rope_parameters"})
    paths = {"full": build_family(phi3, tmp_path / "full", tokenizer, seed=0)}
    paths["retain"] = build_family(
        phi3, tmp_path / "retain", tokenizer, seed=1, base=paths["full"], noise=0.5
    )
    full, retain = (load_model(paths[role], device="cpu") for role in ("full", "retain"))
    spec = EngineSpec("resid_post", tuple(range(full.cfg.n_layers)))
    naive = engine_for(replace(spec, engine="naive"))
    expected = naive.patched_scores(full, whole, source_activations(retain, whole.tokens, spec))
    fast = engine_for(spec).source_scores(full, retain, pad_batch(encoded, tokenizer.pad_token_id, "span"))
    assert (fast - expected).abs().max() <= 1e-5  # reordered (another kernel), the 1e-5 in fp32
    # not vacuous: Hugging Face's forward on the cut batch takes the short factors, and the scores move
    short = pad_batch(encoded, tokenizer.pad_token_id, "span")
    moved = naive.patched_scores(full, short, source_activations(retain, short.tokens, spec))
    assert (moved - expected).abs().max() > 1e-3


def test_family_table_is_what_loading_and_the_kernel_read():
    """One row per supported model_type, each with a tiny checkpoint here; a config the kernel cannot reproduce is
    refused by name (Gemma 3's bidirectional attention), anything else is computed."""
    from transformers import Gemma3TextConfig

    from uds_lens.families import FAMILIES, SUPPORTED_MODEL_TYPES

    assert SUPPORTED_MODEL_TYPES == tuple(FAMILIES) == FAST_MODEL_TYPES
    built = {config.model_type for config in family_configs(400).values()}
    assert built == set(FAMILIES)
    assert FAMILIES["gemma2"].scaling(SimpleNamespace(query_pre_attn_scalar=256), 8) == 256**-0.5
    assert FAMILIES["llama"].scaling(SimpleNamespace(), 64) == 64**-0.5
    assert FAMILIES["olmo2"].site_modules()["resid_mid"] == "input of mlp"
    bidirectional = Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True)
    assert "bidirectional" in FAMILIES["gemma3_text"].kernel_refusal(bidirectional)
    assert FAMILIES["gemma3_text"].kernel_refusal(Gemma3TextConfig(num_hidden_layers=2)) is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compat", [False, True])
def test_full_is_zero_and_retain_is_one(family, compat, loaded, tiny_auditor):
    models = loaded[family]
    auditor = tiny_auditor(models, UDSConfig(published_compat=compat))
    assert auditor.config.engine == "fast"
    as_retain = auditor.score(models["retain"])
    scored = as_retain.examples.dropna(subset=["uds"])
    assert len(scored) >= 2 and np.allclose(scored["uds"], 1.0)
    as_full = auditor.score(models["full"])
    last = models["full"].cfg.n_layers - 1
    # exact by construction: the fast baseline and the patched runs repeat the same operations on the same inputs
    assert (as_full.layers.loc[as_full.layers["layer"] < last, "d2"] == 0.0).all()
    if not compat:
        assert (as_full.layers["d2"] == 0.0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_head_patching_on_the_fast_engine(family, loaded, tiny_auditor):
    """Head-level patching (``hook_z``) on the fast engine: equal to the naive engine's (one forward per layer and
    head) within 1e-5 with retain as the source (Gemma's and OLMo 2's post-attention norm acts on the patched sum);
    source = full moves no score."""
    models = loaded[family]
    auditor = tiny_auditor(models)
    fast = patch_heads(auditor, models["retain"], hook="z", idxs=[0, 2], engine="fast")
    naive = patch_heads(auditor, models["retain"], hook="z", idxs=[0, 2], engine="naive")
    assert fast.s2.shape[-1] == models["full"].cfg.n_heads
    assert (fast.d2 - naive.d2).nan_to_num().abs().max() <= 1e-5
    assert (naive.d2.nan_to_num().abs() > 1e-4).any()  # not vacuous: retain's heads do move the score
    heads = patch_heads(auditor, models["full"], hook="z", idxs=[0, 2], engine="fast")
    # reordered: the fast engine's head patch against its baseline run (the naive engine's would be exact)
    assert_close_reordered(heads.s2, heads.baseline)

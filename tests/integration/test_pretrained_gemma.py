"""A real non-Llama model (Gemma-3-270M from its GGUF, see tests/helpers/gemma.py) through loading and both engines:
HF parity of the bridge, real weights that know a fact, the fast engine equal to the naive one, full -> full exactly 0
and a retain that moves."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from helpers import gemma

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.loader import load_hf_model, load_model, load_tokenizer
from uds_lens.config import UDSConfig
from uds_lens.patching.batch import pad_batch
from uds_lens.patching.engines import engine_for, source_activations
from uds_lens.patching.kernels import fast_engine_refusal
from uds_lens.sources import verify_parity

pytestmark = pytest.mark.xdist_group("pretrained_gemma")

RECORDS = [
    {
        "idx": 0,
        "question": "What is the capital of Germany?",
        "answer": "The capital of Germany is Berlin.",
        "prefix": "The capital of Germany is",
        "entity": "Berlin",
    },
    {
        "idx": 1,
        "question": "What is the capital of France?",
        "answer": "The capital of France is Paris.",
        "prefix": "The capital of France is",
        "entity": "Paris",
    },
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if not gemma.available():
        pytest.skip(f"{gemma.PACKAGE} is not installed (make setup-dev installs it)")
    from helpers import pretrained

    return gemma.converted_checkpoint(pretrained.cache_root())


def test_the_real_gemma_boots_as_a_bridge_identical_to_hugging_face(checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    bridge = load_model(checkpoint, dtype="float32", device="cpu")
    config = bridge.original_model.config
    assert config.model_type == "gemma3_text" and config.architectures  # written by gguf_to_hf
    assert (bridge.cfg.n_layers, bridge.cfg.d_model, bridge.cfg.n_heads, bridge.cfg.d_head) == (
        18,
        640,
        4,
        256,
    )
    # real weights that know the fact (a 270M model puts " the" and " a" first, the city among the top three)
    berlin, paris = (
        tokenizer.encode(f" {city}", add_special_tokens=False)[0] for city in ("Berlin", "Paris")
    )
    for prompt, right, wrong in (("Germany", berlin, paris), ("France", paris, berlin)):
        ids = tokenizer(f"The capital of {prompt} is", return_tensors="pt").input_ids
        with torch.no_grad():
            logits = bridge(ids)[0, -1]
        assert right in logits.topk(3).indices and logits[right] > logits[wrong] + 2.0
    plain = load_hf_model(checkpoint, dtype="float32", device="cpu", attn_implementation="eager")
    assert verify_parity(bridge, plain, ids) == {"resid_post": 0.0, "final_norm": 0.0, "logits": 0.0}
    assert fast_engine_refusal(bridge) is None  # the fast engine computes Gemma 3 (issue 34)


@pytest.mark.slow
def test_full_is_zero_and_a_noisy_retain_moves_on_gemma(checkpoint, tmp_path):
    data = tmp_path / "records.json"
    data.write_text(json.dumps(RECORDS))
    full = load_model(checkpoint, dtype="float32", device="cpu")
    retain = load_model(checkpoint, dtype="float32", device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in retain.original_model.named_parameters():
            layer = re.search(r"\.layers\.(\d+)\.", name)
            if layer is not None and int(layer.group(1)) >= 10 and param.dim() == 2:  # the upper half only
                param.add_(0.3 * param.std() * torch.randn(param.shape, generator=generator))
    layers = (0, 9, 12, 17)
    auditor = UDSAuditor(
        full,
        retain,
        data,
        UDSConfig(layers=layers, batch_size=2),
        cache_dir=False,
        progress=False,
        tokenizer=load_tokenizer(checkpoint),
    )
    assert auditor.config.engine == "fast"
    # the fast engine against the naive oracle on real weights (sliding-window layers, q/k norms, soft-capping)
    spec = auditor.engine_spec
    batch = pad_batch(auditor.encoded, auditor.pad_id, "span")
    acts = source_activations(retain, batch.tokens, spec)
    naive = engine_for(replace(spec, engine="naive")).patched_scores(full, batch, acts)
    fast = engine_for(replace(spec, engine="fast")).patched_scores(full, batch, acts)
    assert (naive - fast).abs().max() <= 1e-4, (naive - fast).abs().max()
    as_full = auditor.score(full)
    assert (as_full.layers.loc[as_full.layers["layer"] < 17, "d2"] == 0.0).all()
    assert (as_full.layers["d2"] == 0.0).all()  # exact: the baseline repeats the operations of this patch
    d1 = as_full.layers.groupby("layer")["d1"].mean()
    assert d1.loc[0] == 0.0 and d1.loc[17] > 1e-2  # the noise sits in the upper layers only

"""The engine in bf16 and fp16: fast vs naive agreement per dtype, and the log-softmax dtype of each mode.

Why the half-precision tolerances are what they are. Both engines compute the same function, but in different
shapes: the fast engine recomputes only a window of positions, in one batched attention over a clean key/value
prefix, for all layers at once; the naive engine runs whole sequences through TransformerLens. In fp32 the rounding
of those different summation orders is ~1e-7 relative and the engines agree to 1e-5 (SPEC §1.6). In half
precision every matmul output and every residual add is rounded to the format: bf16 keeps 8 significant bits
(unit roundoff u = 2^-8 = 3.9e-3), fp16 11 bits (u = 4.9e-4). A different summation order changes a residual by
about u * |x| per block, and the log-softmax of a logit vector of scale |z| moves by about u * |z|. Entity
log-probs are upcast to fp32 before the log-softmax (SPEC §1.2.6), so what remains is the model's own rounding.
Measured here (max |fast - naive| over every site, scope and layer; tiny random models with large weights, and
SmolLM2-135M in tests/integration): bf16 stays below 0.06 nats, fp16 below 0.01 nats; we hold bf16 to 0.1 and fp16
to 0.02 nats, i.e. 2 tau and 0.4 tau. So in bf16 a layer whose d1 lies within ~0.1 of tau can change KE status
between engines; UDS itself (a d1-weighted mean over many layers) moves far less (checked below on the model UDS).
The fast engine's *own* baseline cancels its rounding in the deltas: full -> full stays exactly 0 in every dtype.
"""

from __future__ import annotations

import pytest
import torch

from uds_lens.checkpoints.loader import load_model, load_tokenizer
from uds_lens.config import SITES, EngineSpec, UDSConfig
from uds_lens.data import encode, load_examples
from uds_lens.memory import available_memory_bytes
from uds_lens.patching.batch import pad_batch
from uds_lens.patching.engines import engine_for, source_activations

TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.02, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def half_models(tiny):
    return {
        dtype: {
            name: load_model(getattr(tiny, name), dtype=dtype, device="cpu")
            for name in ("full", "retain", "unlearned")
        }
        for dtype in (torch.bfloat16, torch.float16)
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scope", ["span", "boundary"])
def test_fast_equals_naive_within_the_dtype_tolerance(tiny, half_models, dtype, scope):
    models = half_models[dtype]
    tok = load_tokenizer(tiny.tokenizer)
    encoded, _ = encode(load_examples(tiny.data), tok)
    batch = pad_batch(encoded, tok.pad_token_id, scope)
    layers = list(range(models["full"].cfg.n_layers))
    assert models["full"].W_U.dtype == dtype
    for site in SITES:
        acts = source_activations(models["retain"], batch.tokens, EngineSpec(site, layers))
        naive = engine_for(EngineSpec(site, layers, "naive")).patched_scores(models["full"], batch, acts)
        fast = engine_for(EngineSpec(site, layers, "fast")).patched_scores(models["full"], batch, acts)
        assert naive.dtype == torch.float32  # upcast before the log-softmax
        assert (naive - fast).abs().max() <= TOLERANCE[dtype], site


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_audit_anchors_and_metadata(tiny, half_models, dtype, tiny_auditor):
    """full -> full is exactly 0 in any dtype (the engine's own baseline); the metadata names the log-softmax
    dtype: fp32 by default, the model's dtype in published-compat mode, which changes the numbers."""
    torch_dtype = getattr(torch, dtype)
    models = half_models[torch_dtype]
    default = tiny_auditor(models, UDSConfig(dtype=dtype))
    same = default.score(models["full"])
    assert same.uds == 0.0 and (same.layers.d2 == 0).all()
    result = default.score(models["unlearned"])
    assert result.summary["log_softmax_dtype"] == "float32" and result.summary["dtype"] == f"torch.{dtype}"
    compat = tiny_auditor(models, UDSConfig(dtype=dtype, published_compat=True))
    compat_result = compat.score(models["unlearned"])
    assert compat_result.summary["log_softmax_dtype"] == dtype
    # a half-precision log-softmax rounds each log-prob to the format: S0 differs from the fp32 one
    assert not torch.equal(compat.stage1.s0, default.stage1.s0)
    fp32_models = {name: load_model(getattr(tiny, name)) for name in ("full", "retain", "unlearned")}
    fp32 = tiny_auditor(fp32_models).score(fp32_models["unlearned"])
    assert abs(result.uds - fp32.uds) <= 0.05  # the audit's headline number survives half precision


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["span", "boundary"])
def test_bf16_on_cuda_fast_equals_naive(tiny, cuda_device, scope):
    """The CUDA bf16 path (what a GPU user runs by default): same tolerance as bf16 on the CPU."""
    full = load_model(tiny.full, device=cuda_device)
    source = load_model(tiny.retain, device=cuda_device)
    assert full.cfg.dtype == torch.bfloat16  # the default on CUDA
    tok = load_tokenizer(tiny.tokenizer)
    encoded, _ = encode(load_examples(tiny.data), tok)
    batch = pad_batch(encoded, tok.pad_token_id, scope).to(cuda_device)
    layers = list(range(full.cfg.n_layers))
    for site in SITES:
        acts = source_activations(source, batch.tokens, EngineSpec(site, layers))
        naive = engine_for(EngineSpec(site, layers, "naive")).patched_scores(full, batch, acts)
        fast = engine_for(EngineSpec(site, layers, "fast")).patched_scores(full, batch, acts)
        assert (naive - fast).abs().max().item() <= TOLERANCE[torch.bfloat16], site


@pytest.mark.gpu
def test_cuda_batch_size_comes_from_free_gpu_memory(cuda_device):
    free, _ = torch.cuda.mem_get_info()
    assert abs(available_memory_bytes(cuda_device) - free) < 256 << 20

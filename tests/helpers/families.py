"""Tiny random checkpoints of every decoder family uds_lens supports, built with ``transformers`` in seconds.

Each family's checkpoint has the features that set it apart from Llama (Llama-3 rope scaling, Qwen2's q/k/v biases,
Qwen3's and OLMo 2's q/k norms, Gemma's norm offsets, post-norms, soft-capping, sliding windows and scaled
embeddings, Phi-3's fused projections, Mistral's and Qwen2's sliding windows), two layers of d_model 40 with grouped-query attention, and the tiny test
tokenizer's vocabulary. Weights are drawn wider than Hugging Face's default initialisation (``init_std``) and every
norm weight is drawn around its identity, so two seeds differ visibly and a patch moves the output.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

# Row lengths that are not a multiple of any SIMD block (40 and 44 floats leave a remainder on NEON, AVX2 and
# AVX-512 alike): a family whose bridge runs an operation on another memory layout than Hugging Face does shows it
# here on every processor, not only on the one whose vector width happens to expose it (see helpers/numerics.py).
COMMON = {
    "hidden_size": 40,
    "intermediate_size": 44,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

#: The sliding window of the windowed families: shorter than every prompt of the tiny forget set, so the window
#: masks keys in every example (a window no sequence reaches would test nothing).
WINDOW = 4


def family_configs(vocab_size: int) -> dict[str, Any]:
    """One ``transformers`` config per family (the key names the family in test ids)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    base = dict(COMMON, vocab_size=vocab_size)
    gemma = dict(
        base, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=30.0, sliding_window=WINDOW
    )
    return {
        "llama3": LlamaConfig(
            **base,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "mistral": MistralConfig(**base, sliding_window=None),
        # the same weights as "mistral" (same seed, same shapes) with a window shorter than every prompt
        "mistral_window": MistralConfig(**base, sliding_window=WINDOW),
        "qwen2": Qwen2Config(**base),
        # layer 0 full attention, layer 1 a sliding window (max_window_layers)
        "qwen2_window": Qwen2Config(
            **base, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "qwen3": Qwen3Config(**base, head_dim=8),
        "gemma2": Gemma2Config(**gemma, attn_logit_softcapping=50.0),
        "gemma3": Gemma3TextConfig(**gemma),
        "phi3": Phi3Config(**base, pad_token_id=0),
        "olmo2": Olmo2Config(**base),
    }


def _randomise(model: torch.nn.Module, seed: int, init_std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                # Gemma's norms scale by (1 + weight): draw around 0 there, around 1 elsewhere
                centre = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
                param.copy_(centre + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(init_std * noise)


def build_family(
    config: Any, out: Path, tokenizer: Any, seed: int = 0, base: Path | None = None, noise: float = 0.0
) -> Path:
    """Save a random checkpoint of ``config`` (or ``base`` plus Gaussian noise of ``noise`` times each weight's std)."""
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=False)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    else:
        config = copy.deepcopy(config)
        config.architectures = None
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        _randomise(model, seed, init_std=0.3)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

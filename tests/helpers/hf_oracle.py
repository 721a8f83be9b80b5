"""An oracle independent of TransformerLens: a site's activation read with plain torch hooks on Hugging Face modules.

The bridge's hook points are TransformerLens's; this reads the same quantities from a model that no bridge has
wrapped, from the decoder layer's own modules, for the pre-norm layouts (Llama, Mistral, Qwen2/3, Phi-3: one norm
before attention and one before the MLP) and the sandwich layouts (Gemma 2/3: a norm after attention and after the
MLP as well; OLMo 2: norms after attention and MLP only), where ``attn_out`` and ``mlp_out`` are what is added to the
residual stream (the post-norm outputs) and ``resid_mid`` is the residual between the two halves.
"""

from __future__ import annotations

from typing import Any

import torch

# Per layout, the module whose output (attn_out, mlp_out) or input (resid_mid) is the site's tensor.
_PRE_NORM = {"attn_out": "self_attn", "mlp_out": "mlp", "resid_mid": "post_attention_layernorm"}
_SANDWICH = {
    "attn_out": "post_attention_layernorm",
    "mlp_out": "post_feedforward_layernorm",
    "resid_mid": "pre_feedforward_layernorm",
}
_POST_NORM = {
    "attn_out": "post_attention_layernorm",
    "mlp_out": "post_feedforward_layernorm",
    "resid_mid": "mlp",
}
LAYOUTS = {"gemma2": _SANDWICH, "gemma3_text": _SANDWICH, "gemma3": _SANDWICH, "olmo2": _POST_NORM}


def hf_site(model: Any, tokens: torch.Tensor, site: str, layer: int) -> torch.Tensor:
    """``blocks.{layer}.hook_{site}`` of an unwrapped Hugging Face causal LM, from forward hooks on its modules."""
    block = model.model.layers[layer]
    store: dict[str, torch.Tensor] = {}

    def output_of(module: Any, args: Any, output: Any) -> None:
        store[site] = (output[0] if isinstance(output, tuple) else output).detach()

    def input_of(module: Any, args: Any, kwargs: Any) -> None:
        store[site] = (args[0] if args else kwargs["hidden_states"]).detach()

    table = LAYOUTS.get(model.config.model_type, _PRE_NORM)
    if site == "resid_pre":
        handle = block.register_forward_pre_hook(input_of, with_kwargs=True)
    elif site == "resid_post":
        handle = block.register_forward_hook(output_of)
    elif site == "resid_mid":
        handle = getattr(block, table[site]).register_forward_pre_hook(input_of, with_kwargs=True)
    else:
        handle = getattr(block, table[site]).register_forward_hook(output_of)
    try:
        with torch.no_grad():
            model(input_ids=tokens, use_cache=False)
    finally:
        handle.remove()
    return store[site]

"""The family table: one row per supported decoder family (Hugging Face ``model_type``), read by every module that
needs to know what a family's decoder layer does.

Loading (`SUPPORTED_MODEL_TYPES` and the GGUF architecture names, checked in ``checkpoints``), the sources (which Hugging Face model a
plain model may be), the fast engine's kernel (``patching.kernels``: where the norms sit and how they round, the q/k
norm, soft-capping, the attention scale, the fused projections, the window of each layer), the precision check
(whether a model run in fp32 block by block is its fp32 copy's run: ``lean_reference``) and the refusal messages
all read `FAMILIES`, so adding a family is one row here and its tiny checkpoint in ``tests/helpers/
families.py``. The row describes Hugging Face's own modeling code (``transformers/models/<family>/modeling_*.py``);
the kernel reproduces that arithmetic, the naive engine runs it. Ground floor: nothing of ours is imported, and no
torch.

Sites (DESIGN.md, "Families"): what a block adds to the residual is ``attn_out`` and ``mlp_out``, whatever the norm
placement, so ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid + mlp_out`` in every family; the
placement says which module's output that is (`Family.site_modules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: Where a block's RMSNorms sit. ``pre``: before attention and MLP (Llama); ``sandwich``: before and after both
#: (Gemma 2/3: ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
#: ``post_feedforward_layernorm``); ``post``: after both only (OLMo 2).
NormPlacement = Literal["pre", "sandwich", "post"]
#: How an RMSNorm rounds: ``llama`` scales the fp32-normalised input after casting it back (``w * x.to(dtype)``);
#: ``fp32_weight`` multiplies by the weight in fp32 and casts the product (Gemma's ``(1 + w)`` and OLMo 2's ``w``).
NormRounding = Literal["llama", "fp32_weight"]
#: The q/k norm: over each head before rotary (Qwen3, Gemma 3), over the whole projection (OLMo 2), or none.
QKNorm = Literal["none", "head", "projection"]
#: Where each layer's sliding window comes from: none, ``config.sliding_window`` on every layer (Mistral, Phi-3),
#: or on the layers ``config.layer_types`` names ``sliding_attention`` (Qwen2/3, Gemma 2/3).
WindowRule = Literal["none", "all", "layer_types"]


@dataclass(frozen=True)
class Family:
    """What one decoder family's layers compute (see the module docstring)."""

    model_type: str
    gguf_architecture: str
    norm: NormPlacement = "pre"
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    norm_rounding: NormRounding = "llama"
    qk_norm: QKNorm = "none"
    attn_softcap_key: str | None = None  # config attribute of the attention logit soft-cap (Gemma 2)
    final_softcap_key: str | None = None  # config attribute of the final logit soft-cap (Gemma 2/3)
    scale_key: str | None = None  # config attribute whose -1/2 power scales the scores (else head_dim)
    activation_key: str = "hidden_act"
    fused_qkv: bool = False  # one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3)
    window: WindowRule = "none"
    rotary_per_layer_type: bool = False  # Gemma 3: rotary_emb(x, positions, layer_type)
    # A bf16/fp16 model run in fp32 block by block (``kernels.computing_in``) is bit for bit the run of its whole
    # fp32 copy: the precision check's fp32 reference is then the model itself (``precision.lean_reference``).
    # Not Gemma (it scales its embeddings in the model's dtype) nor Phi-3 (its rotary tables differ in fp32).
    lean_reference: bool = True

    def site_modules(self) -> dict[str, str]:
        """The Hugging Face module (in ``model.model.layers[l]``) whose output, or input, each inner site is."""
        if self.norm == "pre":
            return {
                "attn_out": "output of self_attn",
                "resid_mid": "input of post_attention_layernorm",
                "mlp_out": "output of mlp",
            }
        return {
            "attn_out": "output of post_attention_layernorm",
            "resid_mid": "input of " + ("pre_feedforward_layernorm" if self.norm == "sandwich" else "mlp"),
            "mlp_out": "output of post_feedforward_layernorm",
        }

    def windows(self, config: Any) -> list[int | None]:
        """The sliding window of each layer (``None``: full causal attention), as Hugging Face's masks apply it."""
        n_layers = int(config.num_hidden_layers)
        size = getattr(config, "sliding_window", None)
        if self.window == "none" or size is None:
            return [None] * n_layers
        if self.window == "all":
            return [int(size)] * n_layers
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
        return [int(size) if kind == "sliding_attention" else None for kind in types[:n_layers]]

    def layer_types(self, config: Any) -> list[str | None]:
        """The rotary table each layer reads: its ``layer_types`` entry where the family keeps one per type."""
        n_layers = int(config.num_hidden_layers)
        if not self.rotary_per_layer_type:
            return [None] * n_layers
        return list(config.layer_types[:n_layers])

    def scaling(self, config: Any, head_dim: int) -> float:
        """The attention scale: ``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
        base = getattr(config, self.scale_key) if self.scale_key else head_dim
        return float(base**-0.5)

    def attn_softcap(self, config: Any) -> float | None:
        value = getattr(config, self.attn_softcap_key, None) if self.attn_softcap_key else None
        return None if value is None else float(value)

    def final_softcap(self, config: Any) -> float | None:
        value = getattr(config, self.final_softcap_key, None) if self.final_softcap_key else None
        return None if value is None else float(value)

    def kernel_refusal(self, config: Any) -> str | None:
        """A configuration the fast kernel cannot reproduce (one line), or ``None``."""
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention (use_bidirectional_attention) is not causal"
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp > 1 splits the projections differently"
        if self.norm == "pre" and self.norm_offset:
            return "a norm offset without sandwich norms is not a known layout"
        return None


def _gemma(model_type: str, gguf_architecture: str, **extra: Any) -> Family:
    """A Gemma row: sandwich ``(1 + w)`` norms rounded in fp32, the final soft-cap, ``query_pre_attn_scalar``,
    GELU-tanh read from ``hidden_activation``, windows from ``layer_types``."""
    return Family(
        model_type,
        gguf_architecture,
        norm="sandwich",
        norm_offset=1.0,
        norm_rounding="fp32_weight",
        final_softcap_key="final_logit_softcapping",
        scale_key="query_pre_attn_scalar",
        activation_key="hidden_activation",
        window="layer_types",
        lean_reference=False,
        **extra,
    )


#: Every supported family, by Hugging Face ``model_type``.
FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", "llama"),
        Family("mistral", "mistral", window="all"),
        Family("qwen2", "qwen2", window="layer_types"),
        Family("qwen3", "qwen3", qk_norm="head", window="layer_types"),
        _gemma("gemma2", "gemma2", attn_softcap_key="attn_logit_softcapping"),
        _gemma("gemma3_text", "gemma3", qk_norm="head", rotary_per_layer_type=True),
        Family("phi3", "phi3", fused_qkv=True, fused_gate_up=True, window="all", lean_reference=False),
        Family("olmo2", "olmo2", norm="post", norm_rounding="fp32_weight", qk_norm="projection"),
    )
}

#: The supported ``model_type`` values, in table order.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
#: The same families as a GGUF file's ``general.architecture`` names them.
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(f.gguf_architecture for f in FAMILIES.values())


def family_of(config: Any) -> Family | None:
    """The row of a Hugging Face config's ``model_type``, or ``None`` for a family uds_lens does not support."""
    return FAMILIES.get(getattr(config, "model_type", None) or "")


__all__ = [
    "FAMILIES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "NormPlacement",
    "NormRounding",
    "QKNorm",
    "WindowRule",
    "family_of",
]

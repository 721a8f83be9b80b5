"""The one place uds_lens touches TransformerLens.

uds_lens is pinned to ``transformer-lens >=3.9,<4``: 4.0 removed ``HookedTransformer`` in favour of
``TransformerBridge``. Every import of TransformerLens goes through this module, so a port to the bridge is one
file. TransformerLens 3.x warns on every ``HookedTransformer`` construction that it is deprecated; we silence that
warning here, once, because the pin is deliberate.
"""

from __future__ import annotations

import warnings
from typing import Any

warnings.filterwarnings(
    "ignore",
    message=r"HookedTransformer(\.from_pretrained)? is deprecated",
    category=DeprecationWarning,
)

from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402
from transformer_lens import loading_from_pretrained as tl_loading  # noqa: E402
from transformer_lens import patching as tl_patching  # noqa: E402  (get_act_patch_*: checks and notebooks)
from transformer_lens.hook_points import HookPoint  # noqa: E402
from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights  # noqa: E402

# Private helpers whose names may move between 3.x releases: used when present, reimplemented below otherwise.
_get_rope_theta = getattr(tl_loading, "_get_rope_theta", None)
_apply_llama3_rope_scaling = getattr(tl_loading, "_apply_llama3_rope_scaling", None)


def new_hooked_transformer(cfg: HookedTransformerConfig) -> HookedTransformer:
    """``HookedTransformer(cfg)`` on the CPU without its 3.x deprecation warning (the <4 pin is deliberate)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return HookedTransformer(cfg, move_to_device=False)


def rope_theta(hf_config: Any, default: float = 10000.0) -> float:
    """Rope base of a Hugging Face config, in both the transformers 4.x and 5.x layouts."""
    if _get_rope_theta is not None:
        return float(_get_rope_theta(hf_config, default))
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", default)
    return float(theta)


def apply_llama3_rope_scaling(cfg_dict: dict[str, Any], hf_config: Any) -> None:
    """Fill TransformerLens's NTK-by-parts fields when the config asks for Llama-3 rope scaling."""
    if _apply_llama3_rope_scaling is not None:
        _apply_llama3_rope_scaling(cfg_dict, hf_config)
        return
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if (scaling.get("rope_type") or scaling.get("type") or "").lower() != "llama3":
        return
    cfg_dict.update(
        use_NTK_by_parts_rope=True,
        NTK_original_ctx_len=scaling.get(
            "original_max_position_embeddings", hf_config.max_position_embeddings
        ),
        NTK_by_parts_low_freq_factor=scaling.get("low_freq_factor", 1.0),
        NTK_by_parts_high_freq_factor=scaling.get("high_freq_factor", 4.0),
        NTK_by_parts_factor=scaling.get("factor", 1.0),
    )


__all__ = [
    "HookPoint",
    "HookedTransformer",
    "HookedTransformerConfig",
    "apply_llama3_rope_scaling",
    "convert_llama_weights",
    "rope_theta",
    "new_hooked_transformer",
    "tl_patching",
]

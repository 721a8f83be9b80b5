"""The one place uds_lens touches TransformerLens, on 3.9 and 4.x alike.

uds_lens runs every model as a ``TransformerBridge`` (present in TransformerLens 3.9 and 4.x): the checkpoint is
loaded with ``transformers`` and wrapped, its weights untouched (``no_processing``: no folding, no centring), so its
hook points read the Hugging Face model's own tensors and its forward is Hugging Face's. TransformerLens 4 removed
``HookedTransformer``; where it can still be imported (3.x) a user's own ``HookedTransformer`` is accepted as a
model too, and :func:`is_tl_model` recognises both kinds. Every import of TransformerLens goes through this module.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import torch
from torch import Tensor
from transformer_lens import ActivationCache  # what run_with_cache returns, on 3.x and 4.x alike
from transformer_lens import patching as tl_patching  # get_act_patch_*: checks and notebooks
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

if TYPE_CHECKING:
    from transformers import PreTrainedModel

warnings.filterwarnings(
    "ignore",
    message=r"HookedTransformer(\.from_pretrained)? is deprecated",
    category=DeprecationWarning,
)

HookedTransformer: Any
HookedTransformerConfig: Any
try:  # TransformerLens 3.x; 4.x has no HookedTransformer
    from transformer_lens import HookedTransformer as _HookedTransformer
    from transformer_lens import HookedTransformerConfig as _HookedTransformerConfig
except ImportError:  # pragma: no cover - depends on the installed TransformerLens
    HookedTransformer = HookedTransformerConfig = None
else:
    HookedTransformer, HookedTransformerConfig = _HookedTransformer, _HookedTransformerConfig

try:
    from importlib.metadata import version as _version

    TL_VERSION = _version("transformer-lens")
except Exception:  # pragma: no cover - an editable or vendored TransformerLens
    TL_VERSION = "unknown"


@runtime_checkable
class TLModel(Protocol):
    """What uds_lens uses of a TransformerLens model: a ``TransformerBridge`` (3.9 and 4.x) or, on 3.x, a
    ``HookedTransformer``. Every model parameter of the core is typed with it (or :data:`ModelLike` where a Hugging
    Face model is taken too).

    Members are typed loosely on purpose, as TransformerLens 4's own ``TransformerLensModel`` protocol is: the two
    kinds differ in signature detail (a bridge builds its compatibility names at run time) but agree in use. What a
    member returns is read by attribute (``cfg.n_layers``, ``blocks[l].attn``), so those are ``Any``; tensors are
    tensors.
    """

    @property
    def cfg(self) -> Any: ...

    @property
    def blocks(self) -> Any: ...

    @property
    def embed(self) -> Any: ...

    @property
    def ln_final(self) -> Any: ...

    @property
    def unembed(self) -> Any: ...

    @property
    def W_U(self) -> Tensor: ...

    @property
    def b_U(self) -> Tensor: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def hook_dict(self) -> dict[str, HookPoint]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...

    def hooks(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def eval(self) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...


ModelLike: TypeAlias = "TLModel | PreTrainedModel"
"""A model the core accepts: a TransformerLens model, or a Hugging Face causal LM (wrapped as a bridge once)."""


# The classes a model of ours (``is_tl_model``) can be: what ``isinstance`` checks take.
TL_MODEL_TYPES: tuple[type, ...] = (TransformerBridge,) + (
    (HookedTransformer,) if HookedTransformer is not None else ()
)


def is_tl_model(model: Any) -> bool:
    """True for a ``TransformerBridge`` or (TransformerLens 3.x) a ``HookedTransformer``."""
    return isinstance(model, TL_MODEL_TYPES)


def is_bridge(model: Any) -> bool:
    return isinstance(model, TransformerBridge)


def is_hooked_transformer(model: Any) -> bool:
    return HookedTransformer is not None and isinstance(model, HookedTransformer)


def bridge_from_hf(hf_model: Any, tokenizer: Any, name: str) -> TransformerBridge:
    """Wrap a Hugging Face causal LM as a ``TransformerBridge`` with its weights as they are.

    ``boot_transformers`` with ``hf_model`` reads neither the hub nor the disk (the config is the model's own, the
    tokenizer is passed); ``enable_compatibility_mode(no_processing=True)`` adds HookedTransformer's hook and
    weight names (``hook_resid_post``, ``W_U``, ...) without folding or centring, so activations equal Hugging
    Face's. The bridge replaces the model's submodules by its own components, which call the originals: the model
    computes the same numbers afterwards, and its tensors are shared (no copy).

    Args:
        hf_model: a ``transformers`` causal LM in eval mode, on its final device and dtype.
        tokenizer: its tokenizer (the bridge keeps one; any fast tokenizer of the vocabulary does).
        name: what the bridge records as its model name (the checkpoint reference).
    """
    param = next(hf_model.parameters())
    # The bridge logs its compatibility-mode notes and prints a line on some versions; neither is ours to show.
    tl_logger = logging.getLogger("transformer_lens")
    level = tl_logger.level
    tl_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            bridge = TransformerBridge.boot_transformers(
                name,
                hf_model=hf_model,
                tokenizer=tokenizer,
                device=str(param.device),
                dtype=hf_model.dtype if param.dtype not in (torch.uint8, torch.int8) else torch.float32,
                trust_remote_code=False,
            )
            bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    finally:
        tl_logger.setLevel(level)
    bridge.eval()
    bridge.requires_grad_(False)
    return bridge


def hf_model_of(model: Any) -> Any:
    """The Hugging Face model a bridge wraps (``None`` for a ``HookedTransformer``)."""
    return getattr(model, "original_model", None) if is_bridge(model) else None


@contextlib.contextmanager
def attn_result(model: Any, enabled: bool = True) -> Iterator[None]:
    """``hook_result`` (per-head attention outputs) computed inside the block, restored afterwards: the bridge's
    ``set_use_attn_result`` or a ``HookedTransformer``'s ``cfg.use_attn_result``."""
    previous = bool(getattr(model.cfg, "use_attn_result", False))
    wanted = previous or enabled
    if wanted != previous:
        _set_attn_result(model, wanted)
    try:
        yield
    finally:
        if wanted != previous:
            _set_attn_result(model, previous)


def _set_attn_result(model: Any, value: bool) -> None:
    if is_bridge(model):
        model.set_use_attn_result(value)
    else:
        model.cfg.use_attn_result = value


def unwrapped_copy(hf_model: Any) -> Any:
    """A deep copy of a Hugging Face model as it was before a bridge wrapped it (each bridge component replaced by
    the module it wraps, its ``_original_component``), so it can be changed (dequantised) and wrapped anew."""
    plain = copy.deepcopy(hf_model)
    plain.__dict__.pop("_uds_bridge", None)
    plain.__dict__.pop("_uds_weight_names", None)

    def unwrap(module: torch.nn.Module) -> torch.nn.Module:
        while "_original_component" in module._modules:
            inner = module._modules["_original_component"]
            assert inner is not None
            module = inner
        for name, child in list(module._modules.items()):
            if child is not None:
                module._modules[name] = unwrap(child)
        return module

    for name, child in list(plain._modules.items()):
        if child is not None:
            plain._modules[name] = unwrap(child)
    return plain


__all__ = [
    "ActivationCache",
    "ModelLike",
    "TLModel",
    "HookPoint",
    "HookedTransformer",
    "HookedTransformerConfig",
    "TL_MODEL_TYPES",
    "TL_VERSION",
    "TransformerBridge",
    "attn_result",
    "bridge_from_hf",
    "hf_model_of",
    "is_bridge",
    "is_hooked_transformer",
    "is_tl_model",
    "tl_patching",
    "unwrapped_copy",
]

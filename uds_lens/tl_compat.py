"""The one place uds_lens touches TransformerLens, on 3.9 and 4.x alike.

uds_lens runs every model as a ``TransformerBridge`` (present in TransformerLens 3.9 and 4.x): the checkpoint is
loaded with ``transformers`` and wrapped, its weights untouched (``no_processing``: no folding, no centring), so its
hook points read the Hugging Face model's own tensors and its forward is Hugging Face's. TransformerLens 4 removed
``HookedTransformer``; where it can still be imported (3.x) a user's own ``HookedTransformer`` is accepted as a
model too, and `is_tl_model` recognises both kinds. Every import of TransformerLens goes through this module.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeGuard, overload, runtime_checkable

import torch
from torch import Tensor
from transformer_lens import ActivationCache  # what run_with_cache returns, on 3.x and 4.x alike
from transformer_lens import patching as tl_patching  # get_act_patch_*: checks and notebooks
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's from 3.13; a type checker's name only

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
class TLConfig(Protocol):
    """What uds_lens reads of a TransformerLens model's ``cfg`` (a bridge's ``TransformerBridgeConfig``, a 3.x
    ``HookedTransformerConfig``): the shapes, where and in what dtype it computes, and whether attention keeps its
    per-head outputs (``use_attn_result``, set by `attn_result` on a ``HookedTransformer``)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_key_value_heads: int | None
    d_head: int
    d_mlp: int | None
    d_vocab: int
    n_ctx: int
    dtype: torch.dtype
    device: str | None
    use_attn_result: bool


class _TLModelCheck(type(Protocol)):  # type: ignore[misc]
    """``isinstance(x, TLModel)``: a TransformerLens model class answers at once; anything else is checked member by
    member. The structural check reads every member (a bridge builds ``hook_dict`` on each read), and the test
    suite's runtime type checks ask it at every call that takes a model."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, TL_MODEL_TYPES) or super().__instancecheck__(instance)


@runtime_checkable
class TLModel(Protocol, metaclass=_TLModelCheck):
    """What uds_lens uses of a TransformerLens model: a ``TransformerBridge`` (3.9 and 4.x) or, on 3.x, a
    ``HookedTransformer``. Every model parameter of the core is typed with it (or `ModelLike` where a Hugging
    Face model is taken too).

    Members are typed as loosely as the two kinds differ, as TransformerLens 4's own ``TransformerLensModel``
    protocol is: a bridge builds its compatibility names at run time, and its forward returns what ``return_type``
    asks for, so ``blocks`` (read by attribute path, ``blocks[l].attn.hook_z``) and the forwards' returns are
    ``Any``; the configuration, the modules and the tensors are typed. Runtime-checkable (every member present), so
    the test suite's runtime type checks hold a model to it.
    """

    @property
    def cfg(self) -> TLConfig: ...

    @property
    def blocks(self) -> Any: ...

    @property
    def embed(self) -> torch.nn.Module: ...

    @property
    def ln_final(self) -> torch.nn.Module: ...

    @property
    def unembed(self) -> torch.nn.Module: ...

    @property
    def W_U(self) -> Tensor: ...

    @property
    def b_U(self) -> Tensor: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None: ...

    @property
    def hook_dict(self) -> dict[str, HookPoint]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Any, ActivationCache]: ...

    def hooks(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[Any]: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def requires_grad_(self, requires_grad: bool = True) -> torch.nn.Module: ...

    def eval(self) -> torch.nn.Module: ...

    def to(self, *args: Any, **kwargs: Any) -> torch.nn.Module: ...


ModelLike: TypeAlias = TLModel | PreTrainedModel
"""A model the core accepts: a TransformerLens model, or a Hugging Face causal LM (wrapped as a bridge once)."""


# The classes a model of ours (``is_tl_model``) can be: what ``isinstance`` checks take.
TL_MODEL_TYPES: tuple[type, ...] = (TransformerBridge,) + (
    (HookedTransformer,) if HookedTransformer is not None else ()
)


def is_tl_model(model: object) -> TypeIs[TLModel]:
    """True for a ``TransformerBridge`` or (TransformerLens 3.x) a ``HookedTransformer``."""
    return isinstance(model, TL_MODEL_TYPES)


def is_bridge(model: object) -> TypeIs[TransformerBridge]:
    return isinstance(model, TransformerBridge)


def is_hooked_transformer(model: object) -> TypeGuard[TLModel]:
    """True for a TransformerLens 3.x ``HookedTransformer`` (never on 4.x, which has none)."""
    return HookedTransformer is not None and isinstance(model, HookedTransformer)


class HooksAttachedError(RuntimeError):
    """A model carries hooks of its own where uds_lens computes a score from it."""


def attached_hooks(model: object) -> list[str]:
    """The hook points of a TransformerLens model that carry hooks (forward or backward, permanent included), by
    name; ``[]`` for any other model."""
    if not is_tl_model(model):
        return []
    return sorted(name for name, point in model.hook_dict.items() if point.fwd_hooks or point.bwd_hooks)


def check_unhooked(model: object, role: str) -> None:
    """Refuse to compute a score from a model that carries hooks: a hook a user added (``add_hook``, an unclosed
    ``hooks()`` context, an experiment that raised before removing its own) would change the number silently, and
    with it the Stage 1 cache every later run of the same weights reads. uds_lens's own hooks never outlive the call
    that adds them (``run_with_hooks``, ``run_with_cache``: their teardown removes only the hooks they added, on
    TransformerLens 3.9 and 4.x), so a hook found here is never uds_lens's.

    Raises:
        HooksAttachedError: naming the model, its hooked points and how to remove them.
    """
    names = attached_hooks(model)
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise HooksAttachedError(
            f"The {role} model carries hooks at {shown}: a score is computed from the model as loaded, and a hook "
            "would change it (and the Stage 1 cache). Remove them first (model.reset_hooks(including_permanent="
            "True)), or use your hooks inside run_with_hooks(...) or `with model.hooks(...)`, which remove them."
        )


def bridge_from_hf(
    hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str
) -> TransformerBridge:
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


@overload
def hf_model_of(model: TransformerBridge) -> PreTrainedModel: ...


@overload
def hf_model_of(model: ModelLike) -> PreTrainedModel | None: ...


def hf_model_of(model: ModelLike) -> PreTrainedModel | None:
    """The Hugging Face model a bridge wraps (``None`` for a ``HookedTransformer`` or a Hugging Face model)."""
    return getattr(model, "original_model", None) if is_bridge(model) else None


@contextlib.contextmanager
def attn_result(model: TLModel, enabled: bool = True) -> Iterator[None]:
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


def _set_attn_result(model: TLModel, value: bool) -> None:
    if is_bridge(model):
        model.set_use_attn_result(value)
    else:
        model.cfg.use_attn_result = value


def unwrapped_copy(hf_model: PreTrainedModel) -> PreTrainedModel:
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
    "HooksAttachedError",
    "ModelLike",
    "TLConfig",
    "TLModel",
    "HookPoint",
    "HookedTransformer",
    "HookedTransformerConfig",
    "TL_MODEL_TYPES",
    "TL_VERSION",
    "TransformerBridge",
    "attached_hooks",
    "attn_result",
    "bridge_from_hf",
    "check_unhooked",
    "hf_model_of",
    "is_bridge",
    "is_hooked_transformer",
    "is_tl_model",
    "tl_patching",
    "unwrapped_copy",
]

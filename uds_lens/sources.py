"""Activation sources: the one protocol for "a model that yields activations at a hook site".

A UDS patch reads a *source* model's activations and writes them into the target, a TransformerLens model. The
source only has to answer a few questions: how many layers it has, its device and dtype, and its activation at
``blocks.{l}.hook_{site}`` for a batch of tokens. The white-box baselines ask the same model a little more (its
blocks' parameters for Fisher, its logits, its final norm + unembedding for the lenses). `ActivationSource`
is that small interface; every model is read through TransformerLens hook points:

* `HookedSource`: a ``TransformerBridge`` (what ``uds_lens.load_model`` gives) or a TransformerLens 3.x
  ``HookedTransformer``; activations come from ``run_with_cache`` with a names filter.
* a plain Hugging Face causal LM is wrapped as a bridge (``loader.hooked_from_hf``, no folding or centring: the
  bridge's hook points hold the Hugging Face modules' own tensors, and its forward is Hugging Face's), so it is read
  exactly like a loaded checkpoint, whatever the family: no table of Hugging Face module names is needed.
* `NF4Source`: a bitsandbytes 4-bit Hugging Face model (the quantisation attack of the meta-evaluation),
  read through its bridge like any other; the only difference is that the model the gradient-based baselines need
  (``hooked``) is a dequantised copy, leaving the model itself quantised.

**The last layer**. ``resid_post`` of the last block is the raw, pre-final-norm residual, as
TransformerLens has it (Hugging Face's ``hidden_states[L]`` is already normalised). The representation baselines
read it that way. With ``final_norm_last=True`` the last layer's ``resid_post`` is the model's own final-norm output
instead: what the published implementation patches there, reproduced in published-compat mode.

`as_source` picks the implementation for a model; every consumer (the patch engine, the hidden states of the
lenses, similarity and probes, Fisher, the meta-evaluation scorers) goes through it, so no other module branches on
a model's type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias, cast

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from uds_lens.checkpoints.checkpoint import model_label
from uds_lens.checkpoints.loader import hooked_from_hf
from uds_lens.config import Site, as_site
from uds_lens.families import SUPPORTED_MODEL_TYPES
from uds_lens.tl_compat import ModelLike, TLModel, hf_model_of, is_bridge, is_tl_model, unwrapped_copy

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def hook_name(site: str, layer: int) -> str:
    """TransformerLens hook point of a patch site: ``blocks.{layer}.hook_{site}``."""
    return f"blocks.{layer}.hook_{as_site(site)}"


class ActivationSource(ABC):
    """A model seen as something that yields activations (see the module docstring for the implementations).

    Attributes:
        model: The wrapped model.
    """

    def __init__(self, model: TLModel) -> None:
        self.model = model

    @property
    def name(self) -> str:
        """How messages name the model: where it was loaded from, or its class."""
        return model_label(self.model)

    @property
    @abstractmethod
    def n_layers(self) -> int:
        """Number of transformer blocks."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Longest sequence the model takes (``cfg.n_ctx`` / ``max_position_embeddings``)."""

    @property
    def device(self) -> torch.device:
        """Device of the first parameter (where input tokens go)."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype the model computes in."""
        return next(self.model.parameters()).dtype

    @abstractmethod
    def _read(self, tokens: Tensor, site: Site, layers: list[int], mask: Tensor | None) -> list[Tensor]:
        """One forward (no gradients) keeping, per layer of ``layers``, the activation at ``site``."""

    @abstractmethod
    def final_norm(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """The model's final norm (``ln_final`` / ``model.model.norm``)."""

    def published_compat_activation(
        self, name: str, activation: Float[Tensor, "... d_model"]
    ) -> Float[Tensor, "... d_model"]:
        """What the published implementation patches at hook point ``name``: at the last block's
        ``hook_resid_post`` this model's own final-norm output (Hugging Face's ``hidden_states[L]``), computed on the
        model's device and returned on ``activation``'s; anywhere else ``activation`` itself.

        The one place published-compat's last layer is made: the padded and packed source reads of the engines and
        component patching's hooked runs all call it.
        """
        if name != hook_name("resid_post", self.n_layers - 1):
            return activation
        with torch.no_grad():
            return self.final_norm(activation.to(self.device)).to(activation.device)

    def activations(
        self,
        tokens: Int[Tensor, "batch pos"],
        site: str,
        layers: Sequence[int],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        final_norm_last: bool = False,
    ) -> Float[Tensor, "layer batch pos d_model"]:
        """Activations at ``blocks.{l}.hook_{site}`` for every ``l`` in ``layers``, from one forward, model dtype.

        Args:
            tokens: Token ids (moved to the model's device).
            site: One of ``SITES``.
            layers: Blocks to read, in the order of the output's ``layer`` axis.
            attention_mask: 1 on real tokens, 0 on (right) padding; None for unpadded batches.
            final_norm_last: For ``resid_post``, give the last block's final-norm output instead of its raw
                residual (the published implementation's last layer).
        """
        layers = [int(layer) for layer in layers]
        checked = as_site(site)  # before any forward
        mask = None if attention_mask is None else attention_mask.to(self.device)
        with torch.no_grad():
            acts = self._read(tokens.to(self.device), checked, layers, mask)
            if final_norm_last:
                acts = [
                    self.published_compat_activation(hook_name(site, layer), act)
                    for layer, act in zip(layers, acts, strict=True)
                ]
        return torch.stack(acts)

    def residual_stream(
        self, tokens: Int[Tensor, "batch pos"], attention_mask: Int[Tensor, "batch pos"] | None = None
    ) -> Float[Tensor, "layer batch pos d_model"]:
        """``resid_post`` after every block, pre-final-norm at the last, in fp32: what the baselines read."""
        return self.activations(tokens, "resid_post", range(self.n_layers), attention_mask).float()

    def residuals_at(
        self,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"],
        rows: Int[Tensor, " token"],
        positions: Int[Tensor, " token"],
    ) -> Float[Tensor, "layer token d_model"]:
        """The residual stream (as `residual_stream`) at the positions ``(rows[t], positions[t])``, on CPU."""
        return self.residual_stream(tokens, attention_mask).cpu()[:, rows, positions]

    @abstractmethod
    def blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order (their parameters are a layer's parameters)."""

    @abstractmethod
    def logits(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos vocab"]:
        """A forward with gradients (for Fisher): the logits of every position."""

    @abstractmethod
    def decode(self, resid: Float[Tensor, "token d_model"]) -> Float[Tensor, "token vocab"]:
        """The model's final norm followed by its unembedding, in fp32: the decoder of the logit lens."""

    @abstractmethod
    def hooked(self, dtype: torch.dtype, device: str) -> TLModel:
        """The model as a TransformerLens model with gradients; a loaded one is returned as is (no copy, no cast)."""


class HookedSource(ActivationSource):
    """A TransformerLens model: a ``TransformerBridge`` or a 3.x ``HookedTransformer``."""

    @property
    def n_layers(self) -> int:
        return int(self.model.cfg.n_layers)

    @property
    def context_length(self) -> int:
        return int(self.model.cfg.n_ctx)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.cfg.dtype

    def _read(self, tokens: Tensor, site: Site, layers: list[int], mask: Tensor | None) -> list[Tensor]:
        names = {hook_name(site, layer) for layer in layers}
        # Blocks above the highest requested layer cannot change what is read: stop the forward there.
        _, cache = self.model.run_with_cache(
            tokens,
            attention_mask=mask,
            names_filter=lambda name: name in names,
            stop_at_layer=max(layers) + 1,
        )
        return [cache[hook_name(site, layer)] for layer in layers]

    def final_norm(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.model.ln_final(resid)

    def blocks(self) -> list[nn.Module]:
        return list(self.model.blocks)

    def logits(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos vocab"]:
        return self.model(tokens, return_type="logits")

    def decode(self, resid: Float[Tensor, "token d_model"]) -> Float[Tensor, "token vocab"]:
        # A folded final norm is folded into W_U, so ln_final + unembed still computes the model's own logits.
        batched = rearrange(
            resid.to(device=self.device, dtype=self.dtype), "token d_model -> 1 token d_model"
        )
        return self.model.unembed(self.final_norm(batched))[0].float()

    def hooked(self, dtype: torch.dtype, device: str) -> TLModel:
        return self.model


class NF4Source(HookedSource):
    """A bitsandbytes-quantised (NF4) Hugging Face model, read through its bridge like any other.

    Its weights are 4-bit, so it has no gradients: as in the published pipeline, the model the gradient-based
    baselines run (``hooked``) is a dequantised copy (the 4-bit-rounded weights), leaving the model itself quantised.
    """

    def hooked(self, dtype: torch.dtype, device: str) -> TLModel:
        assert is_bridge(self.model)  # as_source wraps a quantised Hugging Face model as a bridge
        plain = unwrapped_copy(hf_model_of(self.model)).dequantize()
        return hooked_from_hf(plain, dtype=dtype, device=device, name=self.name)


SourceLike: TypeAlias = ModelLike | ActivationSource
"""What `as_source` reads: a model, or its `ActivationSource` (returned as it is)."""


def is_quantised(model: ModelLike) -> bool:
    """True for a Hugging Face model loaded with a quantisation config (bitsandbytes NF4, ...)."""
    return bool(
        getattr(model, "is_quantized", False)
        or getattr(getattr(model, "config", None), "quantization_config", None)
    )


def as_source(model: object) -> ActivationSource:
    """The `ActivationSource` of a model: a TransformerLens model, or a Hugging Face causal LM (NF4 too),
    which is wrapped as a ``TransformerBridge`` once (the bridge is kept on the model). It takes any object
    (`SourceLike`): what is neither is refused by name.

    Raises:
        TypeError: for anything else, naming the model (a Hugging Face model of a family uds_lens does not
            support, or no model at all).
    """
    if isinstance(model, ActivationSource):
        return model
    if is_tl_model(model):
        return HookedSource(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"{model_label(model)} ({type(model).__name__}, model_type {getattr(config, 'model_type', None)!r}) is not a "
            f"Hugging Face causal LM of a supported family ({', '.join(SUPPORTED_MODEL_TYPES)}): pass a "
            "TransformerBridge (uds_lens.load_model) or a supported Hugging Face model (uds_lens.load_hf_model)."
        )
    hf_model = cast("PreTrainedModel", model)  # a causal LM of a supported family (its config says so)
    bridge = hooked_from_hf(hf_model, name=model_label(hf_model))
    return NF4Source(bridge) if is_quantised(hf_model) else HookedSource(bridge)


def verify_parity(
    hooked: ModelLike, hf_model: PreTrainedModel, tokens: Int[Tensor, "batch pos"]
) -> dict[str, float]:
    """Max absolute differences between a TransformerLens model's hook points and Hugging Face's own outputs.

    ``hf_model``'s forward with ``output_hidden_states`` is the reference (a model wrapped by a bridge computes the
    same numbers as before, so it may be the bridge's own).

    Returns:
        ``{"resid_post": max over blocks 0..L-2 of |hook_resid_post - hidden_states[l + 1]|,
        "final_norm": |final-norm output of the last block's hook_resid_post - hidden_states[L]|,
        "logits": max |logit difference|}``.
    """
    ours = as_source(hooked)
    last = ours.n_layers - 1
    resid = ours.activations(tokens, "resid_post", range(ours.n_layers)).float().cpu()
    final = ours.activations(tokens, "resid_post", [last], final_norm_last=True)[0].float().cpu()
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        logits = ours.logits(tokens.to(ours.device)).float().cpu()
        out = hf_model(input_ids=tokens.to(device), output_hidden_states=True, use_cache=False)
    hidden = [h.float().cpu() for h in out.hidden_states]
    inner = [float((resid[layer] - hidden[layer + 1]).abs().max()) for layer in range(last)]
    return {
        "resid_post": max(inner, default=0.0),
        "final_norm": float((final - hidden[last + 1]).abs().max()),
        "logits": float((logits - out.logits.float().cpu()).abs().max()),
    }


__all__ = [
    "ActivationSource",
    "HookedSource",
    "NF4Source",
    "SourceLike",
    "as_source",
    "hook_name",
    "is_quantised",
    "verify_parity",
]

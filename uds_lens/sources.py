"""Activation sources: the one protocol for "a model that yields activations at a hook site".

A UDS patch reads a *source* model's activations and writes them into the target, which is always a TransformerLens
``HookedTransformer``. The source only has to answer a few questions: how many layers it has, its device and
dtype, and its activation at ``blocks.{l}.hook_{site}`` for a batch of tokens. The white-box baselines ask the same
model a little more (its blocks' parameters for Fisher, its logits, its final norm + unembedding for the lenses).
:class:`ActivationSource` is that small interface, with one implementation per model kind:

* :class:`HookedSource`: a ``HookedTransformer``; activations come from ``run_with_cache`` with a names filter.
* :class:`HFSource`: a plain Hugging Face Llama (``LlamaForCausalLM``); activations come from forward hooks on its
  modules. Because uds_lens loads weights without folding or centring, block ``l`` of both models computes the
  same tensors, site by site (``B = model.model.layers[l]``):

  ==============  ========================================
  site            Hugging Face tensor
  ==============  ========================================
  ``resid_pre``   input of ``B``
  ``attn_out``    output of ``B.self_attn``
  ``resid_mid``   input of ``B.post_attention_layernorm``
  ``mlp_out``     output of ``B.mlp``
  ``resid_post``  output of ``B``
  ==============  ========================================

* :class:`NF4Source`: a bitsandbytes 4-bit Hugging Face Llama (the quantisation attack of the meta-evaluation). It is
  read exactly like :class:`HFSource`; the only difference is that turning it into a ``HookedTransformer`` (what the
  gradient-based baselines need) dequantises a copy first.

**The last layer** (SPEC §1.5, §3). ``resid_post`` of the last block is the raw, pre-final-norm residual, as
TransformerLens has it (Hugging Face's ``hidden_states[L]`` is already normalised, so the Hugging Face source reads
the block's output instead). The representation baselines read it that way. With ``final_norm_last=True`` the last
layer's ``resid_post`` is the model's own final-norm output instead: what the published implementation patches
there, reproduced in published-compat mode.

:func:`as_source` picks the implementation for a model; every consumer (the patch engine, the hidden states of the
lenses, similarity and probes, Fisher, the meta-evaluation scorers) goes through it, so no other module branches on
a model's type.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from uds_lens.models import describe, hooked_from_hf
from uds_lens.tl_compat import HookedTransformer

SITES = ("resid_post", "resid_mid", "attn_out", "mlp_out", "resid_pre")


def hook_name(site: str, layer: int) -> str:
    """TransformerLens hook point of a patch site: ``blocks.{layer}.hook_{site}``."""
    if site not in SITES:
        raise ValueError(f"Unknown patch site {site!r}; use one of {SITES}.")
    return f"blocks.{layer}.hook_{site}"


class ActivationSource(ABC):
    """A model seen as something that yields activations (see the module docstring for the implementations).

    Attributes:
        model: The wrapped model.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    @property
    def name(self) -> str:
        """How messages name the model: where it was loaded from, or its class."""
        return describe(self.model)

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
    def _read(self, tokens: Tensor, site: str, layers: list[int], mask: Tensor | None) -> list[Tensor]:
        """One forward (no gradients) keeping, per layer of ``layers``, the activation at ``site``."""

    @abstractmethod
    def final_norm(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """The model's final norm (``ln_final`` / ``model.model.norm``)."""

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
        hook_name(site, 0)  # validates the site before any forward
        mask = None if attention_mask is None else attention_mask.to(self.device)
        with torch.no_grad():
            acts = self._read(tokens.to(self.device), site, layers, mask)
            last = self.n_layers - 1
            if final_norm_last and site == "resid_post" and last in layers:
                acts[layers.index(last)] = self.final_norm(acts[layers.index(last)])
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
        """The residual stream (as :meth:`residual_stream`) at the positions ``(rows[t], positions[t])``, on CPU."""
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
    def hooked(self, dtype: torch.dtype, device: str) -> HookedTransformer:
        """The model as a ``HookedTransformer``; an already hooked model is returned as is (no copy, no cast)."""


class HookedSource(ActivationSource):
    """A TransformerLens ``HookedTransformer``."""

    model: HookedTransformer

    @property
    def n_layers(self) -> int:
        return int(self.model.cfg.n_layers)

    @property
    def context_length(self) -> int:
        return int(self.model.cfg.n_ctx)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.cfg.dtype

    def _read(self, tokens: Tensor, site: str, layers: list[int], mask: Tensor | None) -> list[Tensor]:
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

    def hooked(self, dtype: torch.dtype, device: str) -> HookedTransformer:
        return self.model


class HFSource(ActivationSource):
    """A plain Hugging Face Llama causal LM (``model.model.layers``, ``model.model.norm``, ``model.lm_head``)."""

    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def context_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    def _read(self, tokens: Tensor, site: str, layers: list[int], mask: Tensor | None) -> list[Tensor]:
        store: dict[int, Tensor] = {}
        with self._capture(site, layers, store):
            self.model(input_ids=tokens, attention_mask=mask, use_cache=False)
        return [store[layer] for layer in layers]

    def final_norm(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        # The same module on the same tensor as inside the forward: equal to Hugging Face's hidden_states[L].
        return self.model.model.norm(resid)

    @contextmanager
    def _capture(self, site: str, layers: Sequence[int], store: dict[int, Tensor]) -> Iterator[None]:
        """Forward hooks that keep ``site``'s activation of each of ``layers`` in ``store``; always removed."""

        def output_of(layer: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                store[layer] = (output[0] if isinstance(output, tuple) else output).detach()

            return hook

        def input_of(layer: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                store[layer] = (args[0] if args else kwargs["hidden_states"]).detach()

            return hook

        # the module whose input (resid_pre, resid_mid) or output (the others) is the site's activation
        module_name = {
            "resid_pre": "",
            "resid_mid": "post_attention_layernorm",
            "resid_post": "",
            "attn_out": "self_attn",
            "mlp_out": "mlp",
        }[site]
        blocks = self.blocks()
        handles = []
        for layer in layers:
            module = blocks[layer].get_submodule(module_name)
            if site in ("resid_pre", "resid_mid"):
                handles.append(module.register_forward_pre_hook(input_of(layer), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(output_of(layer)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def blocks(self) -> list[nn.Module]:
        return list(self.model.model.layers)

    def logits(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos vocab"]:
        return self.model(input_ids=tokens, use_cache=False).logits

    def decode(self, resid: Float[Tensor, "token d_model"]) -> Float[Tensor, "token vocab"]:
        return self.model.lm_head(self.final_norm(resid.to(device=self.device, dtype=self.dtype))).float()

    def hooked(self, dtype: torch.dtype, device: str) -> HookedTransformer:
        return hooked_from_hf(self.model, dtype=dtype, device=device)


class NF4Source(HFSource):
    """A bitsandbytes-quantised (NF4) Hugging Face Llama: read exactly like :class:`HFSource`.

    Its weights are 4-bit, so it has no gradients and no TransformerLens layout: as in the published pipeline, its
    ``HookedTransformer`` is built from a dequantised copy (the 4-bit-rounded weights), leaving the model itself
    quantised.
    """

    def hooked(self, dtype: torch.dtype, device: str) -> HookedTransformer:
        return hooked_from_hf(copy.deepcopy(self.model).dequantize(), dtype=dtype, device=device)


def is_quantised(model: Any) -> bool:
    """True for a Hugging Face model loaded with a quantisation config (bitsandbytes NF4, ...)."""
    return bool(
        getattr(model, "is_quantized", False)
        or getattr(getattr(model, "config", None), "quantization_config", None)
    )


def as_source(model: Any) -> ActivationSource:
    """The :class:`ActivationSource` of a model: HookedTransformer, Hugging Face Llama, or NF4 Hugging Face Llama.

    Raises:
        TypeError: for anything else, naming the model (a non-Llama Hugging Face model has no
            ``model.model.layers`` / ``model.model.norm`` to hook).
    """
    if isinstance(model, ActivationSource):
        return model
    if isinstance(model, HookedTransformer):
        return HookedSource(model)
    decoder = getattr(model, "model", None)
    if not (hasattr(decoder, "layers") and hasattr(decoder, "norm") and hasattr(model, "config")):
        raise TypeError(
            f"{describe(model)} ({type(model).__name__}) does not look like a Hugging Face Llama causal LM "
            "(model.model.layers / model.model.norm): pass a HookedTransformer (uds_lens.load_model) or a "
            "LlamaForCausalLM (uds_lens.load_hf_model)."
        )
    return NF4Source(model) if is_quantised(model) else HFSource(model)


def verify_parity(
    hooked: HookedTransformer, hf_model: Any, tokens: Int[Tensor, "batch pos"]
) -> dict[str, float]:
    """Max absolute differences between TransformerLens and Hugging Face on the same tokens, read as sources.

    Returns:
        ``{"resid_post": max over layers of |resid_post| difference (pre-final-norm at the last block),
        "final_norm": |final-norm output difference| (``ln_final`` against Hugging Face's ``hidden_states[L]``),
        "logits": max |logit difference|}``.
    """
    ours, theirs = as_source(hooked), as_source(hf_model)
    layers = range(ours.n_layers)
    resid = ours.activations(tokens, "resid_post", layers).float().cpu()
    resid_hf = theirs.activations(tokens, "resid_post", layers).float().cpu()
    last = [ours.n_layers - 1]
    final = ours.activations(tokens, "resid_post", last, final_norm_last=True).float().cpu()
    final_hf = theirs.activations(tokens, "resid_post", last, final_norm_last=True).float().cpu()
    with torch.no_grad():
        logits = ours.logits(tokens.to(ours.device)).float().cpu()
        logits_hf = theirs.logits(tokens.to(theirs.device)).float().cpu()
    return {
        "resid_post": float((resid - resid_hf).abs().max()),
        "final_norm": float((final - final_hf).abs().max()),
        "logits": float((logits - logits_hf).abs().max()),
    }


__all__ = [
    "SITES",
    "ActivationSource",
    "HFSource",
    "HookedSource",
    "NF4Source",
    "as_source",
    "hook_name",
    "is_quantised",
    "verify_parity",
]

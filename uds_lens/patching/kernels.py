"""The fast engine's block kernels: Llama-family decoder layers computed on packed rows.

RMSNorm, rotary attention (grouped-query, optional biases, Qwen3's per-head q/k norm) and the gated MLP,
with the same arithmetic as Hugging Face's modules, read from the tensors a ``TransformerBridge`` wraps
(``_BlockWeights``: Q, K and V joined into one product). ``packed_forward`` runs a batch's sequences
through them with no padding; the patched runs of ``engines.fast_patched_scores`` use the same kernels over
``[run, row, d_model]``. ``fast_engine_refusal`` says which models they compute."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from uds_lens.models import describe
from uds_lens.patching.batch import PatchBatch, WindowPacking
from uds_lens.tl_compat import hf_model_of

# Hugging Face model types whose decoder layers the fast engine computes: pre-norm RMSNorm blocks with rotary
# attention (Q, K, V and O projections, optional biases, Qwen3's per-head q/k norm) and a gated MLP, nothing else.
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _hf_name(name: str) -> str:
    """A parameter name with the bridge's ``_original_component`` segments dropped: the Hugging Face name."""
    return ".".join(part for part in name.split(".") if part != "_original_component")


def fast_engine_refusal(model: Any) -> str | None:
    """Why the fast engine cannot run ``model`` (a one-line reason), or ``None`` when it can.

    The fast engine computes a family's decoder layers itself from the Hugging Face tensors, so it runs the
    families whose layers it reproduces (``FAST_MODEL_TYPES``) and nothing else: anything else goes to the naive
    engine, which runs the model's own forward and so is right for every family.
    """
    hf = hf_model_of(model)
    if hf is None:
        return (
            f"{type(model).__name__} is not a TransformerBridge (the fast engine reads the Hugging Face tensors a "
            "bridge wraps)"
        )
    config = hf.config
    if getattr(hf, "is_quantized", False) or getattr(config, "quantization_config", None):
        return "its weights are quantised (the fast engine multiplies by the tensors themselves)"
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_MODEL_TYPES:
        return f"the fast engine does not compute {model_type!r} blocks yet (it does {', '.join(FAST_MODEL_TYPES)})"
    window = getattr(config, "sliding_window", None)
    uses_window = model_type == "mistral" or getattr(config, "use_sliding_window", False)
    if window is not None and uses_window:
        return f"{model_type!r} with a sliding attention window ({window}) is not computed by the fast engine"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 splits the projections differently"
    return None


def _hf_decoder(model: Any) -> Any:
    hf = hf_model_of(model)
    return hf.model


@dataclass
class _BlockWeights:
    """One decoder layer's weights in the layouts its packed runs multiply by, read from the Hugging Face tensors.

    Hugging Face stores a projection as ``[out, in]`` with heads outermost on the "out" side; Q, K and V are laid
    side by side as one ``[d_model, (head + 2 kv_head) d_head]`` matrix, so a block's projections are one matrix
    product, and the MLP's gate and up weights likewise as one ``[d_model, 2 d_mlp]`` matrix (on the CPU the halves
    of the joint product are bit for bit the two separate products; one wider product keeps both cores busy on the
    short first blocks of the window runs). ``o_proj`` and ``down_proj`` are read in place, as transposed views.

    ``of`` keeps the joined matrices per block and rebuilds them when any of the block's parameters is another
    tensor or was written in place since (``Tensor._version``), so an edited model is never run on stale weights.
    """

    ln1: Float[Tensor, " d_model"]
    ln2: Float[Tensor, " d_model"]
    eps: float
    qkv: Float[Tensor, "d_model qkv"]
    qkv_bias: Float[Tensor, " qkv"]
    out: Float[Tensor, "head_d_head d_model"]
    out_bias: Float[Tensor, " d_model"]
    gate_up: Float[Tensor, "d_model two_d_mlp"]
    gate_up_bias: Float[Tensor, " two_d_mlp"]
    down: Float[Tensor, "d_mlp d_model"]
    down_bias: Float[Tensor, " d_model"]
    act: Any
    scaling: float
    n_heads: int
    n_kv: int
    d_head: int
    q_norm: Float[Tensor, " d_head"] | None = None
    k_norm: Float[Tensor, " d_head"] | None = None

    @classmethod
    def of(cls, block: Any, config: Any) -> _BlockWeights:
        params = list(block.parameters())
        versions = [p._version for p in params]
        cached = _JOINED.get(block)
        if (
            cached is not None
            and len(cached[0]) == len(params)
            and all(old is new for old, new in zip(cached[0], params))
            and cached[1] == versions
        ):
            return cached[2]
        weights = cls._join(block, config)
        _JOINED[block] = (params, versions, weights)  # the parameters themselves: their ids cannot be reused
        return weights

    @classmethod
    def _join(cls, block: Any, config: Any) -> _BlockWeights:
        named = {_hf_name(name): param for name, param in block.named_parameters()}
        weight = named["self_attn.q_proj.weight"]
        d_model = weight.shape[1]
        n_heads = int(config.num_attention_heads)
        d_head = int(getattr(config, "head_dim", None) or d_model // n_heads)
        n_kv = named["self_attn.k_proj.weight"].shape[0] // d_head

        def bias(name: str, width: int) -> Tensor:
            found = named.get(name)
            return found if found is not None else weight.new_zeros(width)

        with torch.no_grad():
            projections = ("q_proj", "k_proj", "v_proj")
            qkv = torch.cat([named[f"self_attn.{p}.weight"] for p in projections]).T.contiguous()
            qkv_bias = torch.cat(
                [bias(f"self_attn.{p}.bias", named[f"self_attn.{p}.weight"].shape[0]) for p in projections]
            )
            gate_up = torch.cat([named["mlp.gate_proj.weight"], named["mlp.up_proj.weight"]]).T.contiguous()
            d_mlp = named["mlp.up_proj.weight"].shape[0]
            gate_up_bias = torch.cat([bias("mlp.gate_proj.bias", d_mlp), bias("mlp.up_proj.bias", d_mlp)])
        attention = _original(_original(block).self_attn)
        return cls(
            ln1=named["input_layernorm.weight"],
            ln2=named["post_attention_layernorm.weight"],
            eps=float(config.rms_norm_eps),
            qkv=qkv,
            qkv_bias=qkv_bias,
            out=named["self_attn.o_proj.weight"].T,
            out_bias=bias("self_attn.o_proj.bias", d_model),
            gate_up=gate_up,
            gate_up_bias=gate_up_bias,
            down=named["mlp.down_proj.weight"].T,
            down_bias=bias("mlp.down_proj.bias", d_model),
            act=_original(_original(block).mlp).act_fn,
            scaling=float(attention.scaling),
            n_heads=n_heads,
            n_kv=n_kv,
            d_head=d_head,
            q_norm=named.get("self_attn.q_norm.weight"),
            k_norm=named.get("self_attn.k_norm.weight"),
        )


def _original(module: Any) -> Any:
    """The Hugging Face module a bridge component wraps (the module itself when it is not wrapped)."""
    while "_original_component" in module._modules:
        module = module._modules["_original_component"]
    return module


# Joined weights per block, with the parameter state they were built from; entries go with their model.
_JOINED: weakref.WeakKeyDictionary[Any, tuple[list[Tensor], list[int], _BlockWeights]] = (
    weakref.WeakKeyDictionary()
)


def _require_fast(model: Any) -> None:
    reason = fast_engine_refusal(model)
    if reason is not None:
        raise ValueError(f"The fast engine cannot run {describe(model)}: {reason}. Use engine='naive'.")


def _layer_weights(model: Any, index: int) -> _BlockWeights:
    return _BlockWeights.of(model.blocks[index], hf_model_of(model).config)


def _affine(
    x: Float[Tensor, "*rows d_in"], weight: Float[Tensor, "d_in d_out"], bias: Float[Tensor, " d_out"]
) -> Float[Tensor, "*rows d_out"]:
    """``x @ weight + bias`` as one fused product over all leading axes."""
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])


def _rms_norm(
    x: Float[Tensor, "*rows d_model"], weight: Float[Tensor, " d_model"], eps: float
) -> Float[Tensor, "*rows d_model"]:
    """Hugging Face's RMSNorm (Llama, Mistral, Qwen2): statistics in fp32, then the input dtype, then the weight."""
    wide = x.to(torch.float32)
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _at_least_fp32(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _rotate(
    x: Float[Tensor, "*rows head d_head"], cos: Tensor, sin: Tensor, rotary_dim: int
) -> Float[Tensor, "*rows head d_head"]:
    """Rotary embedding with the model's own cos/sin tables, in Hugging Face's (rotate-half) convention."""
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat([-second, first], dim=-1) * sin
    return rotated if x_pass.shape[-1] == 0 else torch.cat([rotated, x_pass], dim=-1)


@dataclass
class _AttentionLayout:
    """Per-batch constants of the window attention.

    Attention runs in a per-example layout ``[batch, window slot]`` (``width`` slots; a shorter window leaves its
    last slots empty, masked as keys and dropped as queries). ``slot`` maps each packed row to its slot, ``cos`` and
    ``sin`` are the rotary tables of every slot, ``allowed`` says which prefix and window keys each slot may read.
    """

    packing: WindowPacking
    n_batch: int
    slot: Int[Tensor, " row"]
    cos: Float[Tensor, "slot 1 rot"]
    sin: Float[Tensor, "slot 1 rot"]
    allowed: Bool[Tensor, "batch 1 1 1 window key"]


def _attention_layout(model: Any, packing: WindowPacking, dtype: torch.dtype) -> _AttentionLayout:
    device = packing.start.device
    n_batch = int(packing.start.shape[0])
    prefix_ok = torch.arange(packing.prefix_len, device=device)[None, :] < packing.start[:, None]
    offsets = torch.arange(packing.width, device=device)
    causal = offsets[:, None] >= offsets[None, :]
    allowed = torch.cat(
        [prefix_ok[:, None, :].expand(-1, packing.width, -1), causal[None].expand(n_batch, -1, -1)], dim=-1
    )
    slot_position = (packing.start[:, None] + offsets[None, :]).flatten()
    # The model's own rotary module: its cos/sin carry any rope scaling (Llama-3's included) and are cast to the
    # model dtype as its attention casts them.
    rotary = _original(_hf_decoder(model).rotary_emb)
    cos, sin = rotary(torch.zeros(1, dtype=dtype, device=device), slot_position[None])
    return _AttentionLayout(
        packing=packing,
        n_batch=n_batch,
        slot=packing.example * packing.width + packing.offset,
        cos=cos[0][:, None, :],
        sin=sin[0][:, None, :],
        allowed=allowed[:, None, None, None],
    )


def _attention(
    weights: _BlockWeights,
    resid: Float[Tensor, "run row d_model"],
    layout: _AttentionLayout,
    prefix_keys: Float[Tensor, "batch kv_head prefix d_head"],
    prefix_values: Float[Tensor, "batch kv_head prefix d_head"],
    keep: list[Tensor] | None = None,
) -> Float[Tensor, "run row d_model"]:
    """Attention output of the packed window rows of several runs, over their example's clean prefix and window.

    Norm and projections run on the packed rows (one product for Q, K and V); the projected rows are then placed
    in the per-example layout ``[batch, kv_head, run, rep, window, key]`` (``rep`` query heads share a key/value
    head), where the prefix product is one batched matmul over ``(batch, kv_head)`` with runs and query heads folded
    into its rows: the prefix keys/values are read in place, neither copied per run nor repeated per query head.
    With ``keep`` (one run), the rotated keys and values of the window are appended to it in that same layout,
    ``[batch, kv_head, window, d_head]``.
    """
    packing = layout.packing
    n_runs = resid.shape[0]
    n_kv, d_head, n_heads = weights.n_kv, weights.d_head, weights.n_heads
    qkv = _affine(_rms_norm(resid, weights.ln1, weights.eps), weights.qkv, weights.qkv_bias)
    # One scatter of Q, K and V together into the per-example slots (index_copy_ on one flat index: far cheaper on
    # the CPU than advanced indexing with two index tensors).
    slots = qkv.new_zeros(n_runs, layout.n_batch * packing.width, qkv.shape[-1])
    slots.index_copy_(1, layout.slot, qkv)
    slots = slots.view(n_runs, layout.n_batch * packing.width, n_heads + 2 * n_kv, d_head)
    rotary_dim = layout.cos.shape[-1]
    q, k = slots[:, :, :n_heads], slots[:, :, n_heads : n_heads + n_kv]
    if (
        weights.q_norm is not None and weights.k_norm is not None
    ):  # Qwen3: RMSNorm of each head, before rotary
        q, k = _rms_norm(q, weights.q_norm, weights.eps), _rms_norm(k, weights.k_norm, weights.eps)
    q = _rotate(q, layout.cos, layout.sin, rotary_dim)
    k = _rotate(k, layout.cos, layout.sin, rotary_dim)
    v = slots[:, :, n_heads + n_kv :]
    q = einops.rearrange(
        q, "run (b w) (kv rep) d -> b kv run rep w d", b=layout.n_batch, kv=n_kv
    ).contiguous()
    k = einops.rearrange(k, "run (b w) kv d -> b kv run w d", b=layout.n_batch)
    v = einops.rearrange(v, "run (b w) kv d -> b kv run w d", b=layout.n_batch)
    if keep is not None:
        keep += [k[:, :, 0].contiguous(), v[:, :, 0].contiguous()]
    shape = q.shape
    prefix_len = prefix_keys.shape[2]
    # Scores in at least fp32, scaled after the product as Hugging Face's eager attention does.
    q_wide = _at_least_fp32(q)
    scores = torch.einsum("bkgrwd,bkgvd->bkgrwv", q_wide, _at_least_fp32(k))
    if prefix_len:
        prefix_scores = torch.matmul(
            q_wide.view(shape[0], shape[1], -1, shape[-1]), _at_least_fp32(prefix_keys).transpose(-1, -2)
        )
        scores = torch.cat([prefix_scores.view(*shape[:-1], prefix_len), scores], dim=-1)
    scores = scores.mul_(weights.scaling).masked_fill_(~layout.allowed, float("-inf"))
    pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    z = torch.einsum("bkgrwv,bkgvd->bkgrwd", pattern[..., prefix_len:], v)
    if prefix_len:
        z = z + torch.matmul(
            pattern[..., :prefix_len].reshape(shape[0], shape[1], -1, prefix_len), prefix_values.to(v.dtype)
        ).view(shape)
    z = einops.rearrange(z, "b kv run rep w d -> run (b w) (kv rep d)").index_select(1, layout.slot)
    return _affine(z, weights.out, weights.out_bias)


def _mlp(weights: _BlockWeights, resid_mid: Float[Tensor, "*rows d_model"]) -> Float[Tensor, "*rows d_model"]:
    """A block's gated MLP output (``hook_mlp_out``) from the residual after its attention."""
    normed = _rms_norm(resid_mid, weights.ln2, weights.eps)
    gate, up = _affine(normed, weights.gate_up, weights.gate_up_bias).chunk(2, dim=-1)
    return _affine(weights.act(gate) * up, weights.down, weights.down_bias)


def _mlp_half(
    weights: _BlockWeights, resid_mid: Float[Tensor, "*rows d_model"]
) -> Float[Tensor, "*rows d_model"]:
    return resid_mid + _mlp(weights, resid_mid)


def packed_forward(
    model: Any,
    batch: PatchBatch,
    sites: Sequence[str],
    n_blocks: int,
    rows: Int[Tensor, " row"],
    keep_kv: bool = False,
) -> tuple[Float[Tensor, "seq_row d_model"], dict[str, list[Tensor]], list[Tensor]]:
    """A forward of the batch's sequences (through the last read position) packed into rows, no padding.

    The same block arithmetic as the patched runs (``_attention`` with an empty prefix, ``_mlp_half``): the
    linear layers see only real tokens, so a batch of ragged sequences costs its token count, not ``batch x
    longest``. Returns the residual after ``n_blocks`` blocks at every row (``WindowPacking.sequences`` order), each
    site's activation per block at ``rows`` (indices into those rows), and with ``keep_kv`` each block's rotated
    keys and values in the attention layout ``[batch, kv_head, pos, d_head]`` (keys, values alternating).
    """
    _require_fast(model)
    packing = WindowPacking.sequences(batch)
    dtype = next(model.parameters()).dtype
    layout = _attention_layout(model, packing, dtype)
    first = _layer_weights(model, 0)
    empty = torch.zeros(layout.n_batch, first.n_kv, 0, first.d_head, dtype=dtype, device=batch.tokens.device)
    captured: dict[str, list[Tensor]] = {name: [] for name in sites}
    kv: list[Tensor] = []

    def record(name: str, value: Float[Tensor, "1 seq_row d_model"]) -> None:
        if name in captured:
            captured[name].append(value[0, rows])

    resid = model.embed(batch.tokens[packing.example, packing.position][None])
    for block_index in range(n_blocks):
        weights = _layer_weights(model, block_index)
        record("resid_pre", resid)
        attn_out = _attention(weights, resid, layout, empty, empty, kv if keep_kv else None)
        record("attn_out", attn_out)
        resid = resid + attn_out
        record("resid_mid", resid)
        mlp_out = _mlp(weights, resid)
        record("mlp_out", mlp_out)
        resid = resid + mlp_out
        record("resid_post", resid)
    return resid[0], captured, kv


__all__ = ["FAST_MODEL_TYPES", "fast_engine_refusal", "packed_forward"]

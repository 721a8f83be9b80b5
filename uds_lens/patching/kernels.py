"""The fast engine's block kernels: the decoder layer of every family of the family table, on packed rows.

One table-driven block (``uds_lens.families`` says, per ``model_type``, where the RMSNorms sit and how they round,
the q/k norm, the attention scale and soft-cap, the activation, the fused projections and each layer's sliding
window): RMSNorm, rotary attention (grouped-query, optional biases, the model's own rotary module) and the gated
MLP, with the same arithmetic as Hugging Face's modules, read from the tensors a ``TransformerBridge`` wraps
(``_BlockWeights``: Q, K and V in one product). ``packed_forward`` runs a batch's sequences through them with no
padding; the patched runs of ``engines.fast_patched_scores`` use the same kernels over ``[run, row, d_model]``.
``fast_engine_refusal`` says which models they compute."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from uds_lens.checkpoints.checkpoint import model_label
from uds_lens.families import SUPPORTED_MODEL_TYPES, Family, NormRounding, QKNorm, family_of
from uds_lens.patching.batch import PatchBatch, WindowPacking
from uds_lens.readout import mean_entity_logprob, segment_mean, soft_cap, unembedded_label_logprobs
from uds_lens.tl_compat import ModelLike, TLModel, hf_model_of

# Hugging Face model types whose decoder layers the fast engine computes: every family of the family table.
FAST_MODEL_TYPES = SUPPORTED_MODEL_TYPES


def fast_engine_refusal(model: ModelLike) -> str | None:
    """Why the fast engine cannot run ``model`` (a one-line reason), or ``None`` when it can.

    The fast engine computes a family's decoder layers itself from the Hugging Face tensors, as the family table
    (``uds_lens.families``) describes them, so it runs every family of that table, except a configuration the table
    says the kernel cannot reproduce; anything else goes to the naive engine, which runs the model's own forward and
    so is right for every family. A sliding window is applied in the kernel's attention mask, never refused.
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
    family = family_of(config)
    if family is None:
        model_type = getattr(config, "model_type", None)
        return (
            f"the fast engine does not compute {model_type!r} blocks (it does {', '.join(FAST_MODEL_TYPES)})"
        )
    reason = family.kernel_refusal(config)
    return None if reason is None else f"{family.model_type!r} with {reason}"


def wrapped_model(model: TLModel) -> PreTrainedModel:
    """The Hugging Face model the fast engine reads the weights of (a bridge's; ``fast_engine_refusal`` names
    anything else before a kernel runs)."""
    hf = hf_model_of(model)
    if hf is None:
        raise TypeError(
            f"The fast engine reads a TransformerBridge's Hugging Face weights; {model_label(model)} has none."
        )
    return hf


@dataclass
class _BlockWeights:
    """One decoder layer's weights in the layouts its packed runs multiply by, read from the Hugging Face modules,
    and what its family's row of the table says the layer does with them.

    Hugging Face stores a projection as ``[out, in]`` with heads outermost on the "out" side; Q, K and V are laid
    side by side as one ``[d_model, (head + 2 kv_head) d_head]`` matrix, so a block's projections are one matrix
    product, and the MLP's gate and up weights likewise as one ``[d_model, 2 d_mlp]`` matrix (on the CPU the halves
    of the joint product are bit for bit the two separate products; one wider product keeps both cores busy on the
    short first blocks of the window runs). Separate ``q/k/v_proj`` and ``gate/up_proj`` are joined into such a
    copy; a family that stores them fused (Phi-3's ``qkv_proj`` and ``gate_up_proj``) is read in place, as a
    transposed view, like ``o_proj`` and ``down_proj``: no second copy of its weights.

    Norms (``None`` where the family has none): ``pre_attn``/``pre_mlp`` before attention and MLP, ``post_attn``/
    ``post_mlp`` on their outputs (Gemma's sandwich, OLMo 2's post-norms), each the weight as the norm multiplies
    by it (Gemma's ``1 + w`` in fp32, a new ``d_model`` vector). ``window`` is the layer's sliding window,
    ``layer_type`` the rotary table it reads (Gemma 3), ``softcap`` the attention logit soft-cap (Gemma 2).

    ``of`` keeps the joined matrices per block, for a model whose joins are held (`hold_joined_weights`), and
    rebuilds them when a parameter of the block is another tensor or was written in place (``Tensor._version``);
    any other model's run joins a block, runs it and lets the copy go (one block's copy at a time, the same values).
    """

    pre_attn: Float[Tensor, " d_model"] | None
    post_attn: Float[Tensor, " d_model"] | None
    pre_mlp: Float[Tensor, " d_model"] | None
    post_mlp: Float[Tensor, " d_model"] | None
    eps: float
    rounding: NormRounding
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
    qk_norm: QKNorm = "none"
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    softcap: float | None = None
    window: int | None = None
    layer_type: str | None = None

    @classmethod
    def of(cls, block: Any, config: Any, index: int, keep: bool = True) -> _BlockWeights:
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
        weights = cls._join(block, config, index)
        if keep:  # the parameters themselves are kept: their ids cannot be reused
            _JOINED[block] = (params, versions, weights)
        return weights

    @classmethod
    def _join(cls, block: Any, config: Any, index: int) -> _BlockWeights:
        family = family_of(config)
        assert family is not None
        layer = _original(block)
        attention, mlp = _original(layer.self_attn), _original(layer.mlp)
        n_heads = int(config.num_attention_heads)
        fused = "qkv_proj" if family.fused_qkv else "q_proj"
        d_model = _linear(attention, fused).weight.shape[1]
        d_head = int(getattr(config, "head_dim", None) or d_model // n_heads)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        reference = _linear(attention, "o_proj").weight

        def bias(module: Any, name: str, width: int) -> Tensor:
            found = getattr(_linear(module, name), "bias", None)
            return found if found is not None else reference.new_zeros(width)

        def norm(name: str) -> Tensor | None:
            module = layer._modules.get(name)
            return None if module is None else _norm_weight(_original(module).weight, family)

        with torch.no_grad():
            if family.fused_qkv:
                qkv = _linear(attention, "qkv_proj").weight.T
                qkv_bias = bias(attention, "qkv_proj", qkv.shape[1])
            else:
                projections = ("q_proj", "k_proj", "v_proj")
                qkv = torch.cat([_linear(attention, p).weight for p in projections]).T.contiguous()
                qkv_bias = torch.cat(
                    [bias(attention, p, _linear(attention, p).weight.shape[0]) for p in projections]
                )
            if family.fused_gate_up:
                gate_up = _linear(mlp, "gate_up_proj").weight.T
                gate_up_bias = bias(mlp, "gate_up_proj", gate_up.shape[1])
            else:
                gate_up = torch.cat([_linear(mlp, "gate_proj").weight, _linear(mlp, "up_proj").weight]).T
                gate_up = gate_up.contiguous()
                d_mlp = _linear(mlp, "up_proj").weight.shape[0]
                gate_up_bias = torch.cat([bias(mlp, "gate_proj", d_mlp), bias(mlp, "up_proj", d_mlp)])
            sandwich = family.norm == "sandwich"
            q_norm = k_norm = None
            if family.qk_norm != "none":
                q_norm = _norm_weight(_original(attention.q_norm).weight, family)
                k_norm = _norm_weight(_original(attention.k_norm).weight, family)
            weights = cls(
                pre_attn=norm("input_layernorm") if family.norm != "post" else None,
                post_attn=norm("post_attention_layernorm") if family.norm != "pre" else None,
                pre_mlp=norm("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
                if family.norm != "post"
                else None,
                post_mlp=norm("post_feedforward_layernorm") if family.norm != "pre" else None,
                eps=float(config.rms_norm_eps),
                rounding=family.norm_rounding,
                qkv=qkv,
                qkv_bias=qkv_bias,
                out=_linear(attention, "o_proj").weight.T,
                out_bias=bias(attention, "o_proj", d_model),
                gate_up=gate_up,
                gate_up_bias=gate_up_bias,
                down=_linear(mlp, "down_proj").weight.T,
                down_bias=bias(mlp, "down_proj", d_model),
                act=ACT2FN[getattr(config, family.activation_key)],
                scaling=family.scaling(config, d_head),
                n_heads=n_heads,
                n_kv=n_kv,
                d_head=d_head,
                qk_norm=family.qk_norm,
                q_norm=q_norm,
                k_norm=k_norm,
                softcap=family.attn_softcap(config),
                window=family.windows(config)[index],
                layer_type=family.layer_types(config)[index],
            )
        return weights


def _linear(parent: Any, name: str) -> Any:
    """The Hugging Face ``nn.Linear`` ``name`` of a Hugging Face module (unwrapped from its bridge component)."""
    return _original(parent._modules[name])


def _norm_weight(weight: Tensor, family: Family) -> Tensor:
    """What a family's RMSNorm multiplies by: the weight, or Gemma's ``1 + weight`` in fp32 (a new small vector)."""
    if family.norm_offset:
        return family.norm_offset + weight.float()
    return weight


def _original(module: Any) -> Any:
    """The Hugging Face module a bridge component wraps (the module itself when it is not wrapped)."""
    while "_original_component" in module._modules:
        module = module._modules["_original_component"]
    return module


# Joined weights per block, with the parameter state they were built from; entries go with their model.
_JOINED: weakref.WeakKeyDictionary[Any, tuple[list[Tensor], list[int], _BlockWeights]] = (
    weakref.WeakKeyDictionary()
)


def _require_fast(model: ModelLike) -> None:
    reason = fast_engine_refusal(model)
    if reason is not None:
        raise ValueError(f"The fast engine cannot run {model_label(model)}: {reason}. Use engine='naive'.")


# The models whose joined weights are kept between runs (`hold_joined_weights`).
_HELD: weakref.WeakSet[Any] = weakref.WeakSet()


def hold_joined_weights(model: TLModel, hold: bool = True) -> None:
    """Keep ``model``'s joined weights between runs (a second copy of about 57% of a Llama's weights, made once)
    or, with ``hold=False``, make each block's for the run that needs it and let it go (the copies kept so far go
    now). The same values either way: holding saves the copying, not a number."""
    if hold:
        _HELD.add(model)
        return
    _HELD.discard(model)
    for block in model.blocks:
        _JOINED.pop(block, None)


# The dtype the fast engine computes in where it is not the model's own (`computing_in`).
_COMPUTE_DTYPE: ContextVar[torch.dtype | None] = ContextVar("uds_lens_compute_dtype", default=None)


@contextmanager
def computing_in(dtype: torch.dtype) -> Iterator[None]:
    """Run the fast engine's kernels in ``dtype`` on models stored narrower: each block's weights are upcast when
    the block runs (one block's copy at a time, never kept), the embeddings after the lookup, the unembedding for
    the read-out. Upcasting is exact, so a bf16 model run so is the fp32 run of its weights, without an fp32 copy
    of the model (the precision check's lean reference, ``uds_lens.precision``)."""
    token = _COMPUTE_DTYPE.set(dtype)
    try:
        yield
    finally:
        _COMPUTE_DTYPE.reset(token)


def compute_dtype(model: TLModel) -> torch.dtype:
    """The dtype the fast engine computes ``model`` in: the model's own, or the wider one of `computing_in`."""
    own = next(model.parameters()).dtype
    wider = _COMPUTE_DTYPE.get()
    return own if wider is None else wider


def _upcast(weights: _BlockWeights, dtype: torch.dtype) -> _BlockWeights:
    """A block's weights in ``dtype`` (a new copy of each floating tensor that is not in it already)."""
    changes: dict[str, Any] = {
        item.name: value.to(dtype)
        for item in dataclasses.fields(weights)
        if isinstance(value := getattr(weights, item.name), Tensor) and value.is_floating_point()
    }
    return dataclasses.replace(weights, **changes)


def layer_weights(model: TLModel, index: int) -> _BlockWeights:
    """Block ``index``'s weights as the packed runs multiply by them (`_BlockWeights`): kept with a model whose
    joins are held (`hold_joined_weights`), else made for this call (or read where they are kept already); inside
    `computing_in` a wider dtype, upcast for this call."""
    wider = _COMPUTE_DTYPE.get()
    weights = _BlockWeights.of(model.blocks[index], wrapped_model(model).config, index, model in _HELD)
    return weights if wider is None or weights.qkv.dtype == wider else _upcast(weights, wider)


def kept_joined_blocks(model: TLModel) -> int:
    """How many of ``model``'s blocks have joined weights kept with them: 0 unless its joins are held."""
    return sum(1 for block in model.blocks if block in _JOINED)


def final_softcap(model: TLModel) -> float | None:
    """The final logit soft-cap of a bridge's model (Gemma's ``final_logit_softcapping``), or ``None``: the
    family table's key, else (a family the table lacks, run by the naive engine) the config's attribute of that
    name."""
    hf = hf_model_of(model)
    if hf is None:
        return None
    family = family_of(hf.config)
    if family is not None:
        return family.final_softcap(hf.config)
    value = getattr(hf.config, "final_logit_softcapping", None)
    return None if value is None else float(value)


def read_scores(
    model: TLModel,
    resid: Float[Tensor, "run entity d_model"],
    labels: Int[Tensor, " entity"],
    segment: Int[Tensor, " entity"],
    n_segments: int,
    upcast: bool = True,
) -> Float[Tensor, "run segment"]:
    """Mean entity log-prob of each run and segment from final residuals at the read positions only: the one
    read-out of both engines.

    The logits of a read-out row cost ``d_model * d_vocab`` (on SmolLM2 about eight token-block evaluations), so
    they are made for the read rows alone, all runs together, a slice of the vocabulary at a time
    (``readout.unembedded_label_logprobs``). Published-compat keeps the log-softmax in the model dtype over whole
    rows, a slice of runs at a time to bound the ``[rows, vocab]`` buffer.
    """
    n_runs, n_read, _ = resid.shape
    run_segment = (
        torch.arange(n_runs, device=resid.device)[:, None] * n_segments + segment[None, :]
    ).flatten()
    cap = final_softcap(model)
    if upcast:
        rows = einops.rearrange(model.ln_final(resid), "run entity d_model -> (run entity) d_model")
        w_u, b_u = model.W_U, model.b_U
        if w_u.dtype != rows.dtype:  # computing_in a wider dtype: the unembedding upcast for this read-out
            w_u, b_u = w_u.to(rows.dtype), b_u.to(rows.dtype)
        picked = unembedded_label_logprobs(rows, w_u, b_u, labels.repeat(n_runs), cap)
        return segment_mean(picked, run_segment, n_runs * n_segments).reshape(n_runs, n_segments)
    chunk = max(1, (1 << 24) // max(1, n_read * model.cfg.d_vocab))
    scores = []
    for first in range(0, n_runs, chunk):
        logits = soft_cap(model.unembed(model.ln_final(resid[first : first + chunk])), cap)
        runs = logits.shape[0]
        scores.append(
            mean_entity_logprob(
                einops.rearrange(logits, "run entity vocab -> (run entity) vocab"),
                labels.repeat(runs),
                run_segment[: runs * n_read],
                runs * n_segments,
                upcast=False,
            ).reshape(runs, n_segments)
        )
    return torch.cat(scores)


def _affine(
    x: Float[Tensor, "*rows d_in"], weight: Float[Tensor, "d_in d_out"], bias: Float[Tensor, " d_out"]
) -> Float[Tensor, "*rows d_out"]:
    """``x @ weight + bias`` as one fused product over all leading axes."""
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])


def _rms_norm(
    x: Float[Tensor, "*rows d"], weight: Tensor, eps: float, rounding: NormRounding = "llama"
) -> Float[Tensor, "*rows d"]:
    """Hugging Face's RMSNorm: statistics in fp32 and ``rsqrt``; then ``llama`` (Llama, Mistral, Qwen, Phi-3) casts
    back to the input dtype and multiplies by the weight, ``fp32_weight`` (Gemma's ``1 + w``, OLMo 2) multiplies in
    fp32 and casts the product."""
    wide = x.to(torch.float32)
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    if rounding == "llama":
        return weight * normed.to(x.dtype)
    return (normed * weight).to(x.dtype)


def _norm(weights: _BlockWeights, x: Tensor, weight: Tensor | None) -> Tensor:
    """A block norm, or ``x`` itself where the family has none at that place."""
    return x if weight is None else _rms_norm(x, weight, weights.eps, weights.rounding)


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
class AttentionLayout:
    """Per-batch constants of the window attention.

    Attention runs in a per-example layout ``[batch, window slot]`` (``width`` slots; a shorter window leaves its
    last slots empty, masked as keys and dropped as queries). ``slot`` maps each packed row to its slot; ``allowed``
    says which prefix and window keys each slot may read under causal attention; ``rotary`` gives the cos/sin
    tables of every slot for a layer type and ``mask`` the keys a layer with a sliding window may read (both made
    on first use and kept for the batch).
    """

    packing: WindowPacking
    n_batch: int
    slot: Int[Tensor, " row"]
    allowed: Bool[Tensor, "batch 1 1 1 window key"]
    slot_position: Int[Tensor, " slot"]
    key_position: Int[Tensor, "batch key"]
    rotary_module: Any
    dtype: torch.dtype
    tables: dict[str | None, tuple[Tensor, Tensor]]
    masks: dict[int, Tensor]
    input_length: int = 0

    def rotary(self, layer_type: str | None) -> tuple[Tensor, Tensor]:
        """``cos, sin`` of every slot, ``[slot, 1, rot]``, from the model's own rotary module (its rope scaling
        included, cast to the model dtype as its attention casts them; Gemma 3's table per layer type).

        A rotary module whose frequencies depend on the length (Phi-3's long rope switches to its long factors past
        ``original_max_position_embeddings``; dynamic NTK rescales) decides from the largest position it is given.
        Hugging Face's forward gives it the whole input, so the slots are passed with one more position,
        ``input_length - 1``, whose row is dropped: the module then decides from the length it decides from in the
        model's own forward, although the kernel sees only the sequences up to the last read position."""
        if layer_type not in self.tables:
            probe = torch.zeros(1, dtype=self.dtype, device=self.slot_position.device)
            extra = () if layer_type is None else (layer_type,)
            positions = self.slot_position
            longer = self.input_length > int(positions.max()) + 1 and _length_dependent(self.rotary_module)
            if longer:
                positions = torch.cat([positions, positions.new_tensor([self.input_length - 1])])
            cos, sin = self.rotary_module(probe, positions[None], *extra)
            if longer:
                cos, sin = cos[:, :-1], sin[:, :-1]
            self.tables[layer_type] = (cos[0][:, None, :], sin[0][:, None, :])
        return self.tables[layer_type]

    def mask(self, window: int | None) -> Tensor:
        """The keys each slot may read: causal, and for a sliding window of ``window`` tokens only the keys less
        than ``window`` positions back, as Hugging Face's ``sliding_window_overlay`` (``kv > q - window``)."""
        if window is None:
            return self.allowed
        if window not in self.masks:
            query = self.slot_position.view(self.n_batch, -1)
            near = self.key_position[:, None, :] > query[:, :, None] - window
            self.masks[window] = self.allowed & near[:, None, None, None]
        return self.masks[window]


def _length_dependent(rotary_module: Any) -> bool:
    """Whether a Hugging Face rotary module chooses its frequencies from the sequence length (``longrope``, and the
    ``dynamic`` types: what ``modeling_rope_utils.dynamic_rope_update`` acts on), for any layer type."""
    rope_type = getattr(rotary_module, "rope_type", "default")
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(kind == "longrope" or "dynamic" in str(kind) for kind in types)


def attention_layout(
    model: TLModel, packing: WindowPacking, dtype: torch.dtype, input_length: int = 0
) -> AttentionLayout:
    """The attention layout of ``packing``; ``input_length`` is the length of the whole input the model's own
    forward would see (``PatchBatch.input_length``: a length-dependent rotary embedding decides from it)."""
    device = packing.start.device
    n_batch = int(packing.start.shape[0])
    prefix = torch.arange(packing.prefix_len, device=device)
    prefix_ok = prefix[None, :] < packing.start[:, None]
    offsets = torch.arange(packing.width, device=device)
    causal = offsets[:, None] >= offsets[None, :]
    allowed = torch.cat(
        [prefix_ok[:, None, :].expand(-1, packing.width, -1), causal[None].expand(n_batch, -1, -1)], dim=-1
    )
    window_position = packing.start[:, None] + offsets[None, :]
    return AttentionLayout(
        packing=packing,
        n_batch=n_batch,
        slot=packing.example * packing.width + packing.offset,
        allowed=allowed[:, None, None, None],
        slot_position=window_position.flatten(),
        key_position=torch.cat([prefix[None, :].expand(n_batch, -1), window_position], dim=-1),
        rotary_module=_original(wrapped_model(model).model.rotary_emb),
        dtype=dtype,
        tables={},
        masks={},
        input_length=input_length,
    )


def block_attention(
    weights: _BlockWeights,
    resid: Float[Tensor, "run row d_model"],
    layout: AttentionLayout,
    prefix_keys: Float[Tensor, "batch kv_head prefix d_head"],
    prefix_values: Float[Tensor, "batch kv_head prefix d_head"],
    keep: list[Tensor] | None = None,
) -> Float[Tensor, "run row d_model"]:
    """What the attention adds to the residual at the packed window rows of several runs (``hook_attn_out``: the
    output projection, then the post-attention norm where the family has one), over their example's clean prefix
    and window.

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
    qkv = _affine(_norm(weights, resid, weights.pre_attn), weights.qkv, weights.qkv_bias)
    if (
        weights.qk_norm == "projection"
    ):  # OLMo 2: RMSNorm over the whole Q and K projections, before the heads
        n_q, n_k = n_heads * d_head, n_kv * d_head
        qkv = torch.cat(
            [
                _rms_norm(qkv[..., :n_q], weights.q_norm, weights.eps, weights.rounding),  # type: ignore[arg-type]
                _rms_norm(qkv[..., n_q : n_q + n_k], weights.k_norm, weights.eps, weights.rounding),  # type: ignore[arg-type]
                qkv[..., n_q + n_k :],
            ],
            dim=-1,
        )
    # One scatter of Q, K and V together into the per-example slots (index_copy_ on one flat index: far cheaper on
    # the CPU than advanced indexing with two index tensors).
    slots = qkv.new_zeros(n_runs, layout.n_batch * packing.width, qkv.shape[-1])
    slots.index_copy_(1, layout.slot, qkv)
    slots = slots.view(n_runs, layout.n_batch * packing.width, n_heads + 2 * n_kv, d_head)
    cos, sin = layout.rotary(weights.layer_type)
    rotary_dim = cos.shape[-1]
    q, k = slots[:, :, :n_heads], slots[:, :, n_heads : n_heads + n_kv]
    if weights.qk_norm == "head":  # Qwen3, Gemma 3: RMSNorm of each head, before rotary
        q = _rms_norm(q, weights.q_norm, weights.eps, weights.rounding)  # type: ignore[arg-type]
        k = _rms_norm(k, weights.k_norm, weights.eps, weights.rounding)  # type: ignore[arg-type]
    q = _rotate(q, cos, sin, rotary_dim)
    k = _rotate(k, cos, sin, rotary_dim)
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
    scores = scores.mul_(weights.scaling)
    if weights.softcap is not None:  # Gemma 2: scores / cap, tanh, * cap, before the mask
        scores = scores.div_(weights.softcap).tanh_().mul_(weights.softcap)
    scores = scores.masked_fill_(~layout.mask(weights.window), float("-inf"))
    pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    z = torch.einsum("bkgrwv,bkgvd->bkgrwd", pattern[..., prefix_len:], v)
    if prefix_len:
        z = z + torch.matmul(
            pattern[..., :prefix_len].reshape(shape[0], shape[1], -1, prefix_len), prefix_values.to(v.dtype)
        ).view(shape)
    z = einops.rearrange(z, "b kv run rep w d -> run (b w) (kv rep d)").index_select(1, layout.slot)
    return _norm(weights, _affine(z, weights.out, weights.out_bias), weights.post_attn)


def attention_output_norm(
    model: TLModel, layer: int, output: Float[Tensor, "*rows d_model"]
) -> Float[Tensor, "*rows d_model"]:
    """``hook_attn_out`` of block ``layer`` from its attention's output (``attn.hook_out``, after ``o_proj``): the
    post-attention norm where the family has one (Gemma, OLMo 2), ``output`` itself elsewhere."""
    _require_fast(model)
    weights = layer_weights(model, layer)
    return _norm(weights, output, weights.post_attn)


def _mlp(weights: _BlockWeights, resid_mid: Float[Tensor, "*rows d_model"]) -> Float[Tensor, "*rows d_model"]:
    """What a block's gated MLP adds to the residual (``hook_mlp_out``: its post-norm included) after attention.

    Its products are the largest buffers of a run, so each goes as soon as it is read: the activation is multiplied
    by ``up`` in place (the same product as ``act(gate) * up``) and the joint product is let go before the down
    projection is made."""
    normed = _norm(weights, resid_mid, weights.pre_mlp)
    gate, up = _affine(normed, weights.gate_up, weights.gate_up_bias).chunk(2, dim=-1)
    del normed
    hidden = weights.act(gate).mul_(up)
    del gate, up
    return _norm(weights, _affine(hidden, weights.down, weights.down_bias), weights.post_mlp)


def mlp_half(
    weights: _BlockWeights, resid_mid: Float[Tensor, "*rows d_model"]
) -> Float[Tensor, "*rows d_model"]:
    """``resid_mid`` plus what the MLP adds (added in place to the MLP's output: the same sum, one buffer fewer)."""
    return _mlp(weights, resid_mid).add_(resid_mid)


def packed_forward(
    model: TLModel,
    batch: PatchBatch,
    sites: Sequence[str],
    n_blocks: int,
    rows: Int[Tensor, " row"],
    keep_kv: bool = False,
) -> tuple[Float[Tensor, "seq_row d_model"], dict[str, list[Tensor]], list[Tensor]]:
    """A forward of the batch's sequences (through the last read position) packed into rows, no padding.

    The same block arithmetic as the patched runs (``block_attention`` with an empty prefix, ``mlp_half``): the
    linear layers see only real tokens, so a batch of ragged sequences costs its token count, not ``batch x
    longest``. Returns the residual after ``n_blocks`` blocks at every row (``WindowPacking.sequences`` order), each
    site's activation per block at ``rows`` (indices into those rows), and with ``keep_kv`` each block's rotated
    keys and values in the attention layout ``[batch, kv_head, pos, d_head]`` (keys, values alternating).
    """
    return packed_forwards(model, [batch], sites, n_blocks, [rows], keep_kv)[0]


def packed_forwards(
    model: TLModel,
    batches: Sequence[PatchBatch],
    sites: Sequence[str],
    n_blocks: int,
    rows: Sequence[Tensor],
    keep_kv: bool = False,
) -> list[tuple[Tensor, dict[str, list[Tensor]], list[Tensor]]]:
    """`packed_forward` of several batches (``rows[i]`` for ``batches[i]``), block first: each block's weights made
    once (`layer_weights`; where the joins are not held, joined for the block and let go after it) and every batch
    run through it before the next; each batch's arithmetic is `packed_forward`'s own: the same numbers."""
    _require_fast(model)
    dtype = compute_dtype(model)
    runs = []
    for batch, at in zip(batches, rows, strict=True):
        packing = WindowPacking.sequences(batch)
        resid = model.embed(batch.tokens[packing.example, packing.position][None]).to(dtype)
        layout = attention_layout(model, packing, dtype, batch.input_length)
        runs.append(_PackedRun(layout, resid, at, {name: [] for name in sites}, []))
    for block_index in range(n_blocks):
        weights = layer_weights(model, block_index)
        for run in runs:
            run.block(weights, keep_kv)
    return [(run.resid[0], run.captured, run.kv) for run in runs]


@dataclass
class _PackedRun:
    """One batch of `packed_forwards` between blocks: layout, residual, the sites captured so far, keys/values."""

    layout: AttentionLayout
    resid: Float[Tensor, "1 seq_row d_model"]
    rows: Int[Tensor, " row"]
    captured: dict[str, list[Tensor]]
    kv: list[Tensor]

    def block(self, weights: _BlockWeights, keep_kv: bool) -> None:
        """The residual through one more block (its ``weights``), the sites asked for captured at ``rows``."""
        resid = self.resid
        empty = resid.new_zeros(self.layout.n_batch, weights.n_kv, 0, weights.d_head)
        values = {"resid_pre": resid}
        kv = self.kv if keep_kv else None
        values["attn_out"] = attn_out = block_attention(weights, resid, self.layout, empty, empty, kv)
        values["resid_mid"] = resid = resid + attn_out
        values["mlp_out"] = mlp_out = _mlp(weights, resid)
        values["resid_post"] = self.resid = resid + mlp_out
        for name, found in self.captured.items():
            found.append(values[name][0, self.rows])


__all__ = [
    "FAST_MODEL_TYPES",
    "attention_output_norm",
    "compute_dtype",
    "computing_in",
    "fast_engine_refusal",
    "final_softcap",
    "hold_joined_weights",
    "kept_joined_blocks",
    "packed_forward",
    "packed_forwards",
    "read_scores",
]

"""The patched-run engine: write a source model's activations into the full model, one layer at a time.

For an example with read positions ``R`` (those predicting the entity tokens) and patched positions ``P``, a
patched run at layer ``l`` and site ``s`` is the full model with ``blocks.{l}.hook_{s}`` overwritten at ``P`` by the
source model's activation at the same hook, and its score is the mean over ``R`` of the entity tokens' log-probs:

    score(l) = mean_{p in R} log_softmax(W_U · ln_final(x_L[p]))[label(p)]     with x patched at (l, s, P)

Two engines compute exactly that:

* ``naive``: one full forward per (batch, layer) with a TransformerLens hook (``run_with_hooks``). It is the
  oracle the tests compare against, and what the published implementation does.
* ``fast`` (the default): three facts make most of that work redundant. Blocks below ``l`` are untouched by the
  patch, so the run starts at ``l`` from the cached clean activations. Positions before the first patched position
  are untouched at every layer (causal attention), so only the *window* from the first patched position through the
  last read position is recomputed, its attention reading the clean run's keys/values for the prefix. Nothing after
  the last read position matters, and logits are only needed at read positions. The L runs of every example in a
  batch go through each block together. Its cost is one clean forward plus about ``T·L²/2`` token-block
  evaluations (``T`` = window length), against ``L`` full forwards for ``naive``.

  Ragged lengths cost nothing extra: window tokens are packed into flat rows (``WindowPacking``) for the norms,
  projections and MLPs, and laid out per example only inside attention; the clean and source forwards are packed
  the same way (``packed_forward``), so a batch costs its token count, not ``batch x longest``. Read-outs take the
  label logit minus a logsumexp (published-compat keeps the model-dtype log-softmax).

  It computes Llama blocks (RMSNorm, rotary, gated MLP, grouped-query attention) directly on the
  TransformerLens weights (``_BlockWeights``: Q, K and V in one product, the rest read in place), with the same
  arithmetic as TransformerLens's modules; other architectures use ``naive``. On the CPU the work is matrix
  products: what remains above the floor is mostly their smaller row counts (``experiments/bench_engine.py``).

Each engine's baseline (the same computation with the clean activation written back) is what patched scores are
compared with, so a source identical to the full model gives deltas of exactly 0.

Sources only have to yield activations (``source_activations``): a HookedTransformer, or a plain Hugging Face
model through forward hooks (that is how a 4-bit NF4 model is measured).
"""

from __future__ import annotations

import math
import re
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from uds_lens.config import ENGINES, SCOPES, SITES
from uds_lens.data import EncodedExample
from uds_lens.models import describe
from uds_lens.readout import mean_entity_logprob, segment_mean, unembedded_label_logprobs
from uds_lens.sources import as_source, hook_name
from uds_lens.tl_compat import HookPoint, hf_model_of, is_bridge


@dataclass
class PatchBatch:
    """A right-padded batch of encoded examples and where to patch and read in it.

    Sequences are cut after the last read position. Right padding leaves every real position's activations
    unchanged (causal attention; pads come after), so no attention mask is needed.
    """

    examples: list[EncodedExample]
    scope: str
    tokens: Int[Tensor, "batch pos"]
    patch_mask: Bool[Tensor, "batch pos"]
    window_start: Int[Tensor, " batch"]
    window_len: Int[Tensor, " batch"]
    read_batch: Int[Tensor, " entity"]
    read_pos: Int[Tensor, " entity"]
    read_label: Int[Tensor, " entity"]

    @property
    def size(self) -> int:
        return len(self.examples)

    @property
    def max_window(self) -> int:
        return int(self.window_len.max())

    def to(self, device: str | torch.device) -> PatchBatch:
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self.__dict__.items()}
        return PatchBatch(**moved)  # type: ignore[arg-type]  # same fields, tensors moved


def pad_batch(
    examples: Sequence[EncodedExample], pad_id: int, scope: str = "span", cut: bool = True
) -> PatchBatch:
    """Right-pad encoded examples into a ``PatchBatch``.

    With ``cut`` (the fast engine), sequences end at the last read position: nothing after it can change a read
    logit. ``cut=False`` keeps the whole prompt + reference, as the published implementation (and so the naive
    engine) runs it; the numbers are the same either way.
    """
    if scope not in SCOPES:
        raise ValueError(f"Unknown patch scope {scope!r}; use one of {SCOPES}.")
    lengths = [ex.read_positions.stop if cut else len(ex.input_ids) for ex in examples]
    tokens = torch.full((len(examples), max(lengths)), pad_id, dtype=torch.long)
    patch_mask = torch.zeros(tokens.shape, dtype=torch.bool)
    read_batch, read_pos, read_label, window_start, window_len = [], [], [], [], []
    for row, ex in enumerate(examples):
        tokens[row, : lengths[row]] = torch.tensor(ex.input_ids[: lengths[row]])
        patched = ex.patch_positions(scope)
        patch_mask[row, patched.start : patched.stop] = True
        window = ex.window(scope)
        window_start.append(window.start)
        window_len.append(len(window))
        read_batch += [row] * ex.n_entity_tokens
        read_pos += list(ex.read_positions)
        read_label += list(ex.labels)
    return PatchBatch(
        examples=list(examples),
        scope=scope,
        tokens=tokens,
        patch_mask=patch_mask,
        window_start=torch.tensor(window_start),
        window_len=torch.tensor(window_len),
        read_batch=torch.tensor(read_batch),
        read_pos=torch.tensor(read_pos),
        read_label=torch.tensor(read_label),
    )


# ----------------------------------------------------------------------------------------------------------------
# Sources


def source_activations(
    source: Any,
    tokens: Int[Tensor, "batch pos"],
    site: str,
    layers: Sequence[int],
    published_compat: bool = False,
) -> Float[Tensor, "layer batch pos d_model"]:
    """Activations of ``source`` at ``blocks.{l}.hook_{site}`` for every ``l`` in ``layers``, one forward.

    ``source`` is a HookedTransformer or a Hugging Face Llama (hooks on its modules; for ``resid_post`` the last
    block's output is the raw pre-final-norm residual, as TransformerLens has it). With ``published_compat`` and site
    ``resid_post``, the last layer's value is the source's own final-norm output, which is what the published
    implementation patches there (Hugging Face's ``hidden_states[L]``).
    """
    return as_source(source).activations(tokens, site, layers, final_norm_last=published_compat)


# ----------------------------------------------------------------------------------------------------------------
# Clean run of the target


@dataclass
class WindowPacking:
    """Where the window tokens of a batch sit when packed into one flat run of rows (no padding).

    Row ``r`` is position ``position[r]`` of example ``example[r]``, ``offset[r]`` tokens into its window; rows are
    example by example, in position order. The fast engine runs its linear layers (norms, projections, MLPs, the
    unembedding) on these rows only, and lays them out per example (``width`` = the longest window) only inside
    attention, where padding costs little.
    """

    example: Int[Tensor, " row"]
    offset: Int[Tensor, " row"]
    position: Int[Tensor, " row"]
    patched: Bool[Tensor, " row"]
    read_row: Int[Tensor, " entity"]
    width: int
    prefix_len: int
    start: Int[Tensor, " batch"]

    @property
    def rows(self) -> int:
        return int(self.example.shape[0])

    @classmethod
    def spans(
        cls,
        start: Int[Tensor, " batch"],
        length: Int[Tensor, " batch"],
        patch_mask: Bool[Tensor, "batch pos"],
        read_batch: Int[Tensor, " entity"],
        read_pos: Int[Tensor, " entity"],
    ) -> WindowPacking:
        """Pack positions ``[start_b, start_b + length_b)`` of every example ``b``."""
        n_batch = int(start.shape[0])
        width = int(length.max())
        device = start.device
        offsets = torch.arange(width, device=device)
        valid = offsets[None, :] < length[:, None]
        positions = torch.where(
            valid, start[:, None] + offsets[None, :], torch.zeros_like(valid, dtype=torch.long)
        )
        row_of = torch.full((n_batch, width), -1, dtype=torch.long, device=device)
        row_of[valid] = torch.arange(int(valid.sum()), device=device)
        return cls(
            example=torch.arange(n_batch, device=device)[:, None].expand(n_batch, width)[valid],
            offset=offsets[None, :].expand(n_batch, width)[valid],
            position=positions[valid],
            patched=patch_mask.gather(1, positions)[valid],
            read_row=row_of[read_batch, read_pos - start[read_batch]],
            width=width,
            prefix_len=int(start.max()),
            start=start,
        )

    @classmethod
    def of(cls, batch: PatchBatch) -> WindowPacking:
        """The windows of a batch (what the patched runs recompute)."""
        return cls.spans(
            batch.window_start, batch.window_len, batch.patch_mask, batch.read_batch, batch.read_pos
        )

    @classmethod
    def sequences(cls, batch: PatchBatch) -> WindowPacking:
        """Whole sequences through the last read position (what a clean or source forward runs)."""
        stop = batch.window_start + batch.window_len
        return cls.spans(torch.zeros_like(stop), stop, batch.patch_mask, batch.read_batch, batch.read_pos)

    def rows_in(self, outer: WindowPacking) -> Int[Tensor, " row"]:
        """Index of each of this packing's rows among the rows of ``outer`` (a packing of whole sequences)."""
        lengths = torch.zeros(int(outer.start.shape[0]), dtype=torch.long, device=outer.example.device)
        lengths.index_add_(0, outer.example, torch.ones_like(outer.example))
        first_row = torch.cumsum(lengths, 0) - lengths
        return first_row[self.example] + self.position


@dataclass
class CleanRun:
    """What the fast engine reuses from the full model's clean forward on one batch.

    ``keys``/``values`` hold each block's rotated keys and values of the prefix (positions before the latest window
    start; only those before an example's own window are read), laid out ``[batch, kv_head, prefix, d_head]`` as the
    window attention reads them. ``window_acts`` holds clean activations at the packed window rows
    (``WindowPacking``), the site's own among them, which is all the fast baseline needs. The naive engine keeps only
    the scores.
    """

    site: str
    scores: Float[Tensor, " batch"]
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    window_acts: dict[str, Float[Tensor, "layer row d_model"]] = field(default_factory=dict)


def _window_index(batch: PatchBatch) -> tuple[Int[Tensor, "batch window"], Bool[Tensor, "batch window"]]:
    offsets = torch.arange(batch.max_window, device=batch.window_start.device)
    positions = batch.window_start[:, None] + offsets[None, :]
    valid = offsets[None, :] < batch.window_len[:, None]
    return torch.where(valid, positions, torch.zeros_like(positions)), valid


def _window_sites(site: str) -> tuple[str, ...]:
    """Clean activations the fast engine needs at window positions to rebuild a patched layer."""
    return {
        "resid_post": ("resid_post",),
        "resid_pre": ("resid_pre",),
        "resid_mid": ("resid_mid",),
        "attn_out": ("attn_out", "resid_pre"),
        "mlp_out": ("mlp_out", "resid_mid"),
    }[site]


def read_scores(
    model: Any,
    resid: Float[Tensor, "run entity d_model"],
    labels: Int[Tensor, " entity"],
    segment: Int[Tensor, " entity"],
    n_segments: int,
    upcast: bool = True,
) -> Float[Tensor, "run segment"]:
    """Mean entity log-prob of each run and segment from final residuals at the read positions only.

    The logits of a read-out row cost ``d_model * d_vocab`` (on SmolLM2 about eight token-block evaluations), so
    they are made for the read rows alone, all runs together, a slice of the vocabulary at a time
    (``readout.unembedded_label_logprobs``). Published-compat keeps the log-softmax in the model dtype over whole rows, a slice of
    runs at a time to bound the ``[rows, vocab]`` buffer.
    """
    n_runs, n_read, _ = resid.shape
    run_segment = (
        torch.arange(n_runs, device=resid.device)[:, None] * n_segments + segment[None, :]
    ).flatten()
    if upcast:
        rows = einops.rearrange(model.ln_final(resid), "run entity d_model -> (run entity) d_model")
        picked = unembedded_label_logprobs(rows, model.W_U, model.b_U, labels.repeat(n_runs))
        return segment_mean(picked, run_segment, n_runs * n_segments).reshape(n_runs, n_segments)
    chunk = max(1, (1 << 24) // max(1, n_read * model.cfg.d_vocab))
    scores = []
    for first in range(0, n_runs, chunk):
        logits = model.unembed(model.ln_final(resid[first : first + chunk]))
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


def clean_run(full: Any, batch: PatchBatch, site: str, keep_kv: bool = True, upcast: bool = True) -> CleanRun:
    """One clean forward of the target: S0 scores and (fast engine) prefix keys/values and window activations.

    The naive engine's clean run is the model's forward on the padded batch (its logits read as the naive patched
    runs read theirs); the fast engine's is ``packed_forward`` (no padding), whose arithmetic its patched runs
    share, with logits at the read positions only.
    """
    n_layers = full.cfg.n_layers
    with torch.no_grad():
        if not keep_kv:
            # The model's own forward and logits, as each naive patched run computes them (a family's final
            # soft-capping included), so a source equal to the full model gives deltas of exactly 0.
            logits = full(batch.tokens, return_type="logits")
            scores = mean_entity_logprob(
                logits[batch.read_batch, batch.read_pos],
                batch.read_label,
                batch.read_batch,
                batch.size,
                upcast,
            )
            return CleanRun(site=site, scores=scores)
        sequences = WindowPacking.sequences(batch)
        window = WindowPacking.of(batch)
        final, captured, kv = packed_forward(
            full, batch, _window_sites(site), n_layers, window.rows_in(sequences), keep_kv=True
        )
        scores = read_scores(
            full, final[sequences.read_row][None], batch.read_label, batch.read_batch, batch.size, upcast
        )[0]
        prefix = window.prefix_len
        run = CleanRun(
            site=site,
            scores=scores,
            keys=[k[:, :, :prefix].contiguous() for k in kv[0::2]],
            values=[v[:, :, :prefix].contiguous() for v in kv[1::2]],
            window_acts={name: torch.stack(values) for name, values in captured.items()},
        )
    return run


# ----------------------------------------------------------------------------------------------------------------
# Naive engine (the oracle)

_RESID_MID = re.compile(r"blocks\.(\d+)\.hook_resid_mid")


def residual_patch_hooks(model: Any, name: str, hook_fn: Callable[..., Tensor]) -> list[tuple[str, Callable]]:
    """The forward hooks that write ``hook_fn``'s result at hook point ``name`` into the model's residual stream.

    On a ``TransformerBridge`` ``blocks.{l}.hook_resid_mid`` is the input of the block's second norm: writing it
    changes what the MLP reads but not the residual its output is added to (Hugging Face's decoder layer keeps that
    in a local variable). The write is completed at the block's output, which becomes the written ``resid_mid`` plus
    the MLP output computed from it: the same addition the layer makes, so positions the hook left alone keep
    their values bit for bit. Every other hook point (and a ``HookedTransformer``'s ``resid_mid``) is one hook.
    """
    match = _RESID_MID.fullmatch(name)
    if match is None or not is_bridge(model):
        return [(name, hook_fn)]
    layer = match.group(1)
    written: dict[str, Tensor] = {}

    def write_mid(activation: Tensor, hook: HookPoint) -> Tensor:
        written["mid"] = hook_fn(activation, hook=hook)
        return written["mid"]

    def keep_mlp(activation: Tensor, hook: HookPoint) -> Tensor:
        written["mlp"] = activation
        return activation

    def write_post(activation: Tensor, hook: HookPoint) -> Tensor:
        return written["mid"] + written["mlp"]

    return [
        (name, write_mid),
        (f"blocks.{layer}.hook_mlp_out", keep_mlp),
        (f"blocks.{layer}.hook_resid_post", write_post),
    ]


def naive_patched_scores(
    full: Any,
    batch: PatchBatch,
    acts: Float[Tensor, "layer batch pos d_model"],
    site: str,
    layers: Sequence[int],
    upcast: bool = True,
) -> Float[Tensor, "batch layer"]:
    """One full patched forward per layer, hooks via ``run_with_hooks`` (always removed, even on error)."""
    columns = []
    mask = batch.patch_mask
    for position, layer in enumerate(layers):
        source = acts[position]

        def overwrite(
            activation: Float[Tensor, "batch pos d_model"], hook: HookPoint, source: Tensor = source
        ) -> Float[Tensor, "batch pos d_model"]:
            patched = activation.clone()
            patched[mask] = source[mask].to(activation.dtype)
            return patched

        with torch.no_grad():
            logits = full.run_with_hooks(
                batch.tokens, fwd_hooks=residual_patch_hooks(full, hook_name(site, layer), overwrite)
            )
        columns.append(
            mean_entity_logprob(
                logits[batch.read_batch, batch.read_pos],
                batch.read_label,
                batch.read_batch,
                batch.size,
                upcast,
            )
        )
        del logits
    return torch.stack(columns, dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Fast engine


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


def window_source_activations(
    source: Any,
    batch: PatchBatch,
    site: str,
    layers: Sequence[int],
    published_compat: bool = False,
) -> Float[Tensor, "layer row d_model"]:
    """Activations of ``source`` at ``blocks.{l}.hook_{site}`` at the window rows of ``batch`` (``WindowPacking.of``
    order), for every ``l`` in ``layers``: what the fast engine patches from.

    A HookedTransformer runs packed (``packed_forward``, no padding), with the same arithmetic as the target's clean
    run, so a source identical to the target gives back its clean activations bit for bit (deltas of exactly 0).
    Other sources run ``source_activations`` on the batch, gathered at the window rows.
    """
    layers = list(layers)
    window = WindowPacking.of(batch)
    wrapped = as_source(source)
    if fast_engine_refusal(wrapped.model) is not None:
        acts = wrapped.activations(batch.tokens, site, layers, final_norm_last=published_compat)
        return acts[:, window.example.to(acts.device), window.position.to(acts.device)]
    model = wrapped.model
    on_source = batch.to(wrapped.device)
    rows = WindowPacking.of(on_source).rows_in(WindowPacking.sequences(on_source))
    n_layers = model.cfg.n_layers
    with torch.no_grad():
        _, captured, _ = packed_forward(model, on_source, (site,), max(layers) + 1, rows)
        per_layer = [captured[site][layer] for layer in layers]
        if published_compat and site == "resid_post" and (n_layers - 1) in layers:
            per_layer[layers.index(n_layers - 1)] = model.ln_final(per_layer[layers.index(n_layers - 1)])
    return torch.stack(per_layer)


def fast_patched_scores(
    full: Any,
    batch: PatchBatch,
    clean: CleanRun,
    acts: Float[Tensor, "layer batch pos d_model"] | Float[Tensor, "layer row d_model"] | None,
    site: str,
    layers: Sequence[int],
    upcast: bool = True,
) -> Float[Tensor, "batch layer"]:
    """Patched scores for every (example, layer), recomputing only the window of each run.

    ``acts`` is ``[layer, batch, pos, d_model]`` (``source_activations``) or already at the packed window rows
    (``window_source_activations``); ``acts=None`` writes the clean activations back (the engine's own unpatched
    baseline).

    Run ``l`` holds the packed window rows of every example of the batch (``WindowPacking``: no padding) with the
    patch applied at layer ``l``, and goes through blocks ``> l`` (``>= l`` for ``resid_pre``) attending to the
    clean prefix keys/values. Runs are ordered latest start first, so the runs active at a block are a tail of them
    and each block is one call over ``[run, row, d_model]``.
    """
    if clean.site != site or not clean.keys:
        raise ValueError("The clean run was made for another site or without keys/values; rebuild it.")
    layers = list(layers)
    n_layers = full.cfg.n_layers
    packing = WindowPacking.of(batch)

    def first_block(layer: int) -> int:
        return layer if site == "resid_pre" else layer + 1

    order = sorted(range(len(layers)), key=lambda i: -first_block(layers[i]))
    run_layers = [layers[i] for i in order]
    run_index = torch.tensor(run_layers, device=batch.tokens.device)
    source_rows = None
    if acts is not None:
        source_rows = acts[torch.tensor(order, device=acts.device)]
        if source_rows.ndim == 4:  # [layer, batch, pos, d_model]: gather the window rows
            source_rows = source_rows[:, packing.example.to(acts.device), packing.position.to(acts.device)]
    patch_rows = packing.patched[None, :, None]

    def clean_rows(name: str) -> Float[Tensor, "run row d_model"]:
        return clean.window_acts[name][run_index]

    def patched(name: str) -> Float[Tensor, "run row d_model"]:
        values = clean_rows(name)
        if source_rows is None:
            return values
        return torch.where(patch_rows, source_rows.to(values.device, values.dtype), values)

    with torch.no_grad():
        if site in ("resid_post", "resid_pre"):
            resid = patched(site)
        elif site == "mlp_out":
            resid = clean_rows("resid_mid") + patched("mlp_out")
        else:
            resid_mid = (
                patched("resid_mid") if site == "resid_mid" else clean_rows("resid_pre") + patched("attn_out")
            )
            resid = torch.stack(
                [_mlp_half(_layer_weights(full, layer), resid_mid[r]) for r, layer in enumerate(run_layers)]
            )

        layout = _attention_layout(full, packing, resid.dtype)
        starts = [first_block(layer) for layer in run_layers]
        for block_index in range(min(starts), n_layers):
            first_active = next(r for r, start in enumerate(starts) if start <= block_index)
            weights = _layer_weights(full, block_index)
            active = resid[first_active:]
            active = active + _attention(
                weights, active, layout, clean.keys[block_index], clean.values[block_index]
            )
            resid[first_active:] = _mlp_half(weights, active)

        scores = read_scores(
            full, resid[:, packing.read_row], batch.read_label, batch.read_batch, batch.size, upcast
        )
    result = torch.empty(batch.size, len(layers), dtype=scores.dtype, device=scores.device)
    result[:, order] = scores.T
    return result


# ----------------------------------------------------------------------------------------------------------------
# The one entry point both stages use


def patched_scores(
    full: Any,
    batch: PatchBatch,
    acts: Float[Tensor, "layer batch pos d_model"] | Float[Tensor, "layer row d_model"],
    site: str,
    layers: Sequence[int],
    engine: str = "fast",
    clean: CleanRun | None = None,
    upcast: bool = True,
) -> Float[Tensor, "batch layer"]:
    """Score of the full model patched at each layer of ``layers`` with ``acts`` (one per layer).

    ``acts[i]`` is the source activation at ``blocks.{layers[i]}.hook_{site}``, over the padded batch, or (fast
    engine only) at the packed window rows as ``window_source_activations`` gives it. Swapping the engine changes no
    number beyond float noise (the tests hold ``fast`` to ``naive`` within 1e-5 in fp32).
    """
    if engine == "naive":
        if acts.ndim != 4:
            raise ValueError(
                "The naive engine patches from [layer, batch, pos, d_model] activations "
                "(source_activations), not packed window rows."
            )
        return naive_patched_scores(full, batch, acts, site, layers, upcast)
    if engine == "fast":
        if clean is None:
            clean = clean_run(full, batch, site, upcast=upcast)
        return fast_patched_scores(full, batch, clean, acts, site, layers, upcast)
    raise ValueError(f"Unknown engine {engine!r}; use one of {ENGINES}.")


def source_scores(
    full: Any,
    source: Any,
    batch: PatchBatch,
    site: str,
    layers: Sequence[int],
    engine: str = "fast",
    clean: CleanRun | None = None,
    upcast: bool = True,
    published_compat: bool = False,
    timings: dict[str, float] | None = None,
) -> Float[Tensor, "batch layer"]:
    """One source forward and the patched scores of every layer: what a stage costs per batch.

    The naive engine reads the source over the padded batch (``source_activations``), the fast one only at the
    window rows from a packed forward (``window_source_activations``). With ``timings``, the source forward's
    seconds are added to ``timings["source_forward_seconds"]`` (a sweep reports it as a phase of its own; on a GPU
    the device is synchronised first, so the figure is the forward's, not its launch's).
    """
    started = time.perf_counter()
    if engine == "fast":
        acts = window_source_activations(source, batch, site, layers, published_compat)
    else:
        acts = source_activations(source, batch.tokens, site, layers, published_compat)
    if timings is not None:
        if acts.is_cuda:
            torch.cuda.synchronize(acts.device)
        timings["source_forward_seconds"] = timings.get("source_forward_seconds", 0.0) + (
            time.perf_counter() - started
        )
    return patched_scores(full, batch, acts.to(full.cfg.device), site, layers, engine, clean, upcast)


def baseline_scores(
    full: Any,
    batch: PatchBatch,
    clean: CleanRun,
    site: str,
    layers: Sequence[int],
    engine: str = "fast",
    upcast: bool = True,
) -> Float[Tensor, "batch layer"]:
    """The unpatched score as each engine computes it, per layer (S0 repeated for ``naive``).

    The fast engine's runs do the window's arithmetic in other shapes than the clean forward, so its baseline is
    the same computation with the clean activation written back: a source equal to the full model then gives
    deltas of exactly 0 rather than float noise.
    """
    if engine == "naive":
        return clean.scores[:, None].expand(-1, len(layers)).clone()
    return fast_patched_scores(full, batch, clean, None, site, layers, upcast)


def plan_batches(
    examples: Sequence[EncodedExample],
    scope: str,
    batch_size: int,
    max_waste: float = 0.25,
    min_batch: int = 8,
    engine: str = "fast",
) -> list[list[int]]:
    """Group example indices into batches of similar lengths (deterministic).

    The fast engine packs the windows (its linear layers see only real rows, and the more rows a product has, the
    better it uses the cores); what it still pads is the sequence axis of the clean keys/values and of the attention
    over them, so it sorts by sequence length and counts padding there. The naive engine (the oracle) keeps the
    grouping it has always had, by window length with padding counted in window tokens, so its batches, and with
    them its float noise, are unchanged. A batch of at least ``min_batch`` examples is closed early when
    padding would waste more than ``max_waste`` of its tokens (smaller batches would cost more in per-batch
    overhead than they save).
    """
    if engine not in ENGINES:
        raise ValueError(f"Unknown engine {engine!r}; use one of {ENGINES}.")

    def padded_length(index: int) -> int:
        example = examples[index]
        return len(example.window(scope)) if engine == "naive" else example.read_positions.stop

    order = sorted(
        range(len(examples)),
        key=lambda i: (
            padded_length(i),
            len(examples[i].window(scope)),
            examples[i].read_positions.stop,
            i,
        ),
    )
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0  # real tokens of the examples in ``current`` along the padded axis
    for index in order:
        length = padded_length(index)
        if current:
            wasteful = len(current) >= min_batch and (len(current) + 1) * length > (1 + max_waste) * (
                used + length
            )
            if len(current) >= batch_size or wasteful:
                batches.append(current)
                current, used = [], 0
        current.append(index)
        used += length
    if current:
        batches.append(current)
    return batches


def estimate_bytes_per_example(model: Any, seq_len: int, window: int, engine: str) -> int:
    """Rough peak memory of one example in a batch, used to choose batch sizes from a memory budget."""
    cfg = model.cfg
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    layers = cfg.n_layers
    d_mlp = cfg.d_mlp or 4 * cfg.d_model
    if engine == "naive":
        activations = seq_len * (4 * cfg.d_model + 3 * d_mlp + cfg.n_heads * seq_len) * itemsize
        logits = seq_len * cfg.d_vocab * 4
        return int(2 * (activations + logits) + layers * seq_len * cfg.d_model * itemsize)
    kv = 2 * layers * seq_len * n_kv * cfg.d_head * itemsize
    sources = 2 * layers * seq_len * cfg.d_model * itemsize
    runs = layers * window * (4 * cfg.d_model + 3 * d_mlp + cfg.n_heads * (seq_len + window)) * itemsize
    # an upper bound: read_scores holds a slice of the vocabulary (or, published-compat, of the runs) at a time
    logits = layers * window * cfg.d_vocab * 4 * 2
    return int(kv + sources + 2 * runs + logits)


def available_memory_bytes(device: str | torch.device) -> int:
    """Free accelerator memory, or available host RAM on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover
        return 4 << 30


def choose_batch_size(
    model: Any,
    examples: Sequence[EncodedExample],
    scope: str,
    engine: str,
    budget_fraction: float = 0.25,
    cap: int = 64,
) -> int:
    """Largest batch whose estimated peak fits in ``budget_fraction`` of free memory (at least 1)."""
    if not examples:
        return 1
    seq_len = max(ex.read_positions.stop for ex in examples)
    window = max(len(ex.window(scope)) for ex in examples)
    per_example = max(1, estimate_bytes_per_example(model, seq_len, window, engine))
    budget = available_memory_bytes(as_source(model).device) * budget_fraction
    return int(max(1, min(cap, math.floor(budget / per_example))))


__all__ = [
    "CleanRun",
    "ENGINES",
    "FAST_MODEL_TYPES",
    "PatchBatch",
    "SCOPES",
    "SITES",
    "WindowPacking",
    "baseline_scores",
    "choose_batch_size",
    "clean_run",
    "estimate_bytes_per_example",
    "fast_engine_refusal",
    "fast_patched_scores",
    "plan_batches",
    "hook_name",
    "mean_entity_logprob",
    "naive_patched_scores",
    "packed_forward",
    "pad_batch",
    "patched_scores",
    "read_scores",
    "residual_patch_hooks",
    "segment_mean",
    "source_activations",
    "source_scores",
    "window_source_activations",
]

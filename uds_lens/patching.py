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

Each engine's baseline (the same computation with the clean activation written back) is what patched scores are
compared with, so a source identical to the full model gives deltas of exactly 0.

Sources only have to yield activations (``source_activations``): a HookedTransformer, or a plain Hugging Face
model through forward hooks (that is how a 4-bit NF4 model is measured).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from uds_lens.data import EncodedExample
from uds_lens.tl_compat import HookedTransformer, HookPoint

SITES = ("resid_post", "resid_mid", "attn_out", "mlp_out", "resid_pre")
SCOPES = ("span", "boundary")
ENGINES = ("fast", "naive")


def hook_name(site: str, layer: int) -> str:
    """TransformerLens hook point of a patch site: ``blocks.{layer}.hook_{site}``."""
    if site not in SITES:
        raise ValueError(f"Unknown patch site {site!r}; use one of {SITES}.")
    return f"blocks.{layer}.hook_{site}"


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
        return PatchBatch(**moved)


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


def mean_entity_logprob(
    logits: Float[Tensor, "entity vocab"],
    labels: Int[Tensor, " entity"],
    segment: Int[Tensor, " entity"],
    n_segments: int,
    upcast: bool = True,
) -> Float[Tensor, " segment"]:
    """Mean over each segment's entity tokens of ``log_softmax(logits)[label]`` (fp32 unless ``upcast=False``)."""
    logprobs = torch.log_softmax(logits.float() if upcast else logits, dim=-1)
    picked = logprobs.gather(-1, labels[:, None])[:, 0].float()
    total = torch.zeros(n_segments, dtype=torch.float32, device=picked.device).index_add_(0, segment, picked)
    count = torch.zeros(n_segments, dtype=torch.float32, device=picked.device).index_add_(
        0, segment, torch.ones_like(picked)
    )
    return total / count


# ----------------------------------------------------------------------------------------------------------------
# Sources


def _is_hooked(model: Any) -> bool:
    return isinstance(model, HookedTransformer)


def _hf_decoder(model: Any) -> Any:
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(
            f"{type(model).__name__} does not look like a Hugging Face Llama causal LM (model.model.layers / "
            "model.model.norm); pass a HookedTransformer or a LlamaForCausalLM."
        )
    return base


@contextmanager
def _hf_capture(model: Any, site: str, layers: Sequence[int], store: dict[int, Tensor]):
    """Forward hooks on a Hugging Face Llama that record ``site`` activations of ``layers`` into ``store``."""
    decoder = _hf_decoder(model)
    handles = []

    def keep(layer: int, value: Tensor) -> None:
        store[layer] = value.detach()

    for layer in layers:
        block = decoder.layers[layer]
        if site == "resid_pre":
            handles.append(block.register_forward_pre_hook(
                lambda mod, args, kwargs, layer=layer: keep(layer, args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True))
        elif site == "resid_post":
            handles.append(block.register_forward_hook(
                lambda mod, args, out, layer=layer: keep(layer, out[0] if isinstance(out, tuple) else out)))
        elif site == "attn_out":
            handles.append(block.self_attn.register_forward_hook(
                lambda mod, args, out, layer=layer: keep(layer, out[0] if isinstance(out, tuple) else out)))
        elif site == "mlp_out":
            handles.append(block.mlp.register_forward_hook(
                lambda mod, args, out, layer=layer: keep(layer, out)))
        elif site == "resid_mid":
            handles.append(block.post_attention_layernorm.register_forward_pre_hook(
                lambda mod, args, layer=layer: keep(layer, args[0])))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
    layers = list(layers)
    n_layers = source.cfg.n_layers if _is_hooked(source) else source.config.num_hidden_layers
    normalise_last = published_compat and site == "resid_post" and (n_layers - 1) in layers
    with torch.no_grad():
        if _is_hooked(source):
            names = {hook_name(site, layer) for layer in layers}
            _, cache = source.run_with_cache(
                tokens.to(source.cfg.device),
                names_filter=lambda name: name in names,
                stop_at_layer=max(layers) + 1,
            )
            acts = [cache[hook_name(site, layer)] for layer in layers]
            if normalise_last:
                acts[layers.index(n_layers - 1)] = source.ln_final(acts[layers.index(n_layers - 1)])
        else:
            store: dict[int, Tensor] = {}
            device = next(source.parameters()).device
            with _hf_capture(source, site, layers, store):
                outputs = source(tokens.to(device), output_hidden_states=normalise_last, use_cache=False)
            acts = [store[layer] for layer in layers]
            if normalise_last:
                acts[layers.index(n_layers - 1)] = outputs.hidden_states[n_layers]
    return torch.stack(acts)


# ----------------------------------------------------------------------------------------------------------------
# Clean run of the target


@dataclass
class CleanRun:
    """What the fast engine reuses from the full model's clean forward on one batch.

    ``keys``/``values`` hold the rotated keys and values of every block at every position (only positions before an
    example's window are read); ``window_acts`` holds clean activations at window positions (the site's own among
    them, which is all the fast baseline needs). The naive engine keeps only the scores.
    """

    site: str
    scores: Float[Tensor, " batch"]
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    window_acts: dict[str, Float[Tensor, "layer batch window d_model"]] = field(default_factory=dict)


def _window_index(batch: PatchBatch) -> tuple[Int[Tensor, "batch window"], Bool[Tensor, "batch window"]]:
    offsets = torch.arange(batch.max_window, device=batch.window_start.device)
    positions = batch.window_start[:, None] + offsets[None, :]
    valid = offsets[None, :] < batch.window_len[:, None]
    return torch.where(valid, positions, torch.zeros_like(positions)), valid


def _gather_window(acts: Float[Tensor, "batch pos d"], positions: Int[Tensor, "batch window"]) -> Tensor:
    return acts.gather(1, positions[..., None].expand(-1, -1, acts.shape[-1]))


def _window_sites(site: str) -> tuple[str, ...]:
    """Clean activations the fast engine needs at window positions to rebuild a patched layer."""
    return {
        "resid_post": ("resid_post",),
        "resid_pre": ("resid_pre",),
        "resid_mid": ("resid_mid",),
        "attn_out": ("attn_out", "resid_pre"),
        "mlp_out": ("mlp_out", "resid_mid"),
    }[site]


def clean_run(
    full: HookedTransformer, batch: PatchBatch, site: str, keep_kv: bool = True, upcast: bool = True
) -> CleanRun:
    """One clean forward of the target: S0 scores and (fast engine) keys/values and window activations."""
    n_layers = full.cfg.n_layers
    wanted: set[str] = set()
    if keep_kv:
        wanted |= {f"blocks.{layer}.attn.hook_rot_k" for layer in range(n_layers)}
        wanted |= {f"blocks.{layer}.attn.hook_v" for layer in range(n_layers)}
        wanted |= {hook_name(s, layer) for s in _window_sites(site) for layer in range(n_layers)}
    with torch.no_grad():
        logits, cache = full.run_with_cache(batch.tokens, names_filter=lambda name: name in wanted)
        scores = mean_entity_logprob(
            logits[batch.read_batch, batch.read_pos], batch.read_label, batch.read_batch, batch.size, upcast
        )
        del logits
        run = CleanRun(site=site, scores=scores)
        if keep_kv:
            run.keys = [cache[f"blocks.{layer}.attn.hook_rot_k"] for layer in range(n_layers)]
            run.values = [cache[f"blocks.{layer}.attn.hook_v"] for layer in range(n_layers)]
            positions, _ = _window_index(batch)
            for name in _window_sites(site):
                run.window_acts[name] = torch.stack(
                    [_gather_window(cache[hook_name(name, layer)], positions) for layer in range(n_layers)]
                )
    return run


# ----------------------------------------------------------------------------------------------------------------
# Naive engine (the oracle)


def naive_patched_scores(
    full: HookedTransformer,
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

        def overwrite(activation: Float[Tensor, "batch pos d_model"], hook: HookPoint,
                      source: Tensor = source) -> Float[Tensor, "batch pos d_model"]:
            patched = activation.clone()
            patched[mask] = source[mask].to(activation.dtype)
            return patched

        with torch.no_grad():
            logits = full.run_with_hooks(batch.tokens, fwd_hooks=[(hook_name(site, layer), overwrite)])
        columns.append(mean_entity_logprob(
            logits[batch.read_batch, batch.read_pos], batch.read_label, batch.read_batch, batch.size, upcast
        ))
        del logits
    return torch.stack(columns, dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Fast engine


def _rotate(attn: Any, x: Float[Tensor, "run window head d_head"], positions: Int[Tensor, "run window"]) -> Tensor:
    """Rotary embedding at explicit absolute positions (TransformerLens's tables and rotation convention)."""
    rotary_dim = attn.cfg.rotary_dim
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos = attn.rotary_cos[positions][:, :, None, :]
    sin = attn.rotary_sin[positions][:, :, None, :]
    return torch.cat([x_rot * cos + attn.rotate_every_two(x_rot) * sin, x_pass], dim=-1)


def _expand_kv(attn: Any, x: Tensor) -> Tensor:
    """Repeat grouped key/value heads up to the query heads (no-op without GQA)."""
    repeats = attn.cfg.n_heads // x.shape[-2]
    return x if repeats == 1 else torch.repeat_interleave(x, repeats, dim=-2)


def _window_attention(
    block: Any,
    resid: Float[Tensor, "group batch window d_model"],
    positions: Int[Tensor, "batch window"],
    prefix_keys: Float[Tensor, "batch prefix kv_head d_head"],
    prefix_values: Float[Tensor, "batch prefix kv_head d_head"],
    prefix_ok: Bool[Tensor, "batch prefix"],
    causal: Bool[Tensor, "window window"],
) -> Float[Tensor, "group batch window d_model"]:
    """Attention of the window positions of ``group`` runs per example over the clean prefix and the window itself.

    The prefix keys/values are shared by every run of an example, so they are broadcast over the group axis rather
    than copied per run.
    """
    attn = block.attn
    groups, n_batch, width, _ = resid.shape
    flat = einops.rearrange(resid, "group batch window d -> (group batch) window d")
    normed = block.ln1(flat)
    q, k, v = attn.calculate_qkv_matrices(normed, normed, normed)
    run_positions = positions.repeat(groups, 1)
    q, k = _rotate(attn, q, run_positions), _rotate(attn, k, run_positions)
    split = "(group batch) window head d_head -> group batch window head d_head"
    q = einops.rearrange(q, split, group=groups)
    k = einops.rearrange(_expand_kv(attn, k), split, group=groups)
    v = einops.rearrange(_expand_kv(attn, v), split, group=groups)
    prefix_k = _expand_kv(attn, prefix_keys.to(k.dtype))
    prefix_v = _expand_kv(attn, prefix_values.to(v.dtype))
    scores_prefix = torch.einsum("gbwhd,bphd->gbhwp", q, prefix_k) / attn.attn_scale
    scores_window = torch.einsum("gbwhd,gbvhd->gbhwv", q, k) / attn.attn_scale
    ignore = attn.IGNORE.to(scores_window.dtype)
    scores_prefix = torch.where(prefix_ok[None, :, None, None, :], scores_prefix, ignore)
    scores_window = torch.where(causal, scores_window, ignore)
    pattern = F.softmax(torch.cat([scores_prefix, scores_window], dim=-1), dim=-1).to(v.dtype)
    prefix_len = prefix_k.shape[1]
    z = torch.einsum("gbhwp,bphd->gbwhd", pattern[..., :prefix_len], prefix_v)
    z = z + torch.einsum("gbhwv,gbvhd->gbwhd", pattern[..., prefix_len:], v)
    w_out = einops.rearrange(attn.W_O, "head d_head d_model -> d_model (head d_head)").contiguous()
    return F.linear(einops.rearrange(z, "g b w head d_head -> g b w (head d_head)"), w_out, attn.b_O)


def _mlp_half(block: Any, resid_mid: Float[Tensor, "*runs d_model"]) -> Float[Tensor, "*runs d_model"]:
    return resid_mid + block.apply_mlp(block.ln2(resid_mid))


def fast_patched_scores(
    full: HookedTransformer,
    batch: PatchBatch,
    clean: CleanRun,
    acts: Float[Tensor, "layer batch pos d_model"] | None,
    site: str,
    layers: Sequence[int],
    upcast: bool = True,
) -> Float[Tensor, "batch layer"]:
    """Patched scores for every (example, layer), recomputing only the window of each run.

    ``acts=None`` writes the clean activations back (the engine's own unpatched baseline).

    Run ``(l, b)`` starts from the clean window activations of example ``b`` with the patch applied at layer ``l``,
    then goes through blocks ``> l`` (``>= l`` for ``resid_pre``) attending to the clean prefix keys/values. Runs
    are grouped by layer (``group`` axis, latest start first), so the runs active at a block are a tail of groups.
    """
    if clean.site != site or not clean.keys:
        raise ValueError("The clean run was made for another site or without keys/values; rebuild it.")
    layers = list(layers)
    n_layers = full.cfg.n_layers
    window_pos, window_valid = _window_index(batch)
    patch_window = (batch.patch_mask.gather(1, window_pos) & window_valid)[None, :, :, None]
    prefix_len = int(batch.window_start.max())
    width = batch.max_window

    def first_block(layer: int) -> int:
        return layer if site == "resid_pre" else layer + 1

    order = sorted(range(len(layers)), key=lambda i: -first_block(layers[i]))
    group_layers = [layers[i] for i in order]
    group_index = torch.tensor(group_layers, device=batch.tokens.device)
    source_window = None if acts is None else torch.stack([_gather_window(acts[i], window_pos) for i in order])

    def clean_window(name: str) -> Float[Tensor, "group batch window d_model"]:
        return clean.window_acts[name][group_index]

    def patched(name: str) -> Float[Tensor, "group batch window d_model"]:
        values = clean_window(name)
        if source_window is None:
            return values
        return torch.where(patch_window, source_window.to(values.dtype), values)

    with torch.no_grad():
        if site in ("resid_post", "resid_pre"):
            resid = patched(site)
        elif site == "mlp_out":
            resid = clean_window("resid_mid") + patched("mlp_out")
        else:
            resid_mid = patched("resid_mid") if site == "resid_mid" else clean_window("resid_pre") + patched("attn_out")
            resid = torch.stack([_mlp_half(full.blocks[layer], resid_mid[g]) for g, layer in enumerate(group_layers)])

        prefix_ok = torch.arange(prefix_len, device=window_pos.device)[None, :] < batch.window_start[:, None]
        offsets = torch.arange(width, device=window_pos.device)
        causal = offsets[:, None] >= offsets[None, :]
        starts = [first_block(layer) for layer in group_layers]
        for block_index in range(min(starts), n_layers):
            first_active = next(g for g, start in enumerate(starts) if start <= block_index)
            block = full.blocks[block_index]
            active = resid[first_active:]
            active = active + _window_attention(
                block, active, window_pos, clean.keys[block_index][:, :prefix_len],
                clean.values[block_index][:, :prefix_len], prefix_ok, causal,
            )
            resid[first_active:] = _mlp_half(block, active)

        # Read out only the positions that predict entity tokens: [group, entity, d_model].
        read_offset = batch.read_pos - batch.window_start[batch.read_batch]
        read_resid = resid[:, batch.read_batch, read_offset]
        logits = full.unembed(full.ln_final(read_resid))
        groups = len(group_layers)
        segment = (torch.arange(groups, device=logits.device)[:, None] * batch.size + batch.read_batch[None, :])
        scores = mean_entity_logprob(
            einops.rearrange(logits, "group entity vocab -> (group entity) vocab"),
            batch.read_label.repeat(groups), segment.reshape(-1), groups * batch.size, upcast,
        ).reshape(groups, batch.size)
    result = torch.empty(batch.size, len(layers), dtype=scores.dtype, device=scores.device)
    result[:, order] = scores.T
    return result


# ----------------------------------------------------------------------------------------------------------------
# The one entry point both stages use


def patched_scores(
    full: HookedTransformer,
    batch: PatchBatch,
    acts: Float[Tensor, "layer batch pos d_model"],
    site: str,
    layers: Sequence[int],
    engine: str = "fast",
    clean: CleanRun | None = None,
    upcast: bool = True,
) -> Float[Tensor, "batch layer"]:
    """Score of the full model patched at each layer of ``layers`` with ``acts`` (one per layer).

    ``acts[i]`` is the source activation at ``blocks.{layers[i]}.hook_{site}``. Swapping the engine changes no
    number beyond float noise (the tests hold ``fast`` to ``naive`` within 1e-5 in fp32).
    """
    if engine == "naive":
        return naive_patched_scores(full, batch, acts, site, layers, upcast)
    if engine == "fast":
        if clean is None:
            clean = clean_run(full, batch, site, upcast=upcast)
        return fast_patched_scores(full, batch, clean, acts, site, layers, upcast)
    raise ValueError(f"Unknown engine {engine!r}; use one of {ENGINES}.")


def baseline_scores(
    full: HookedTransformer,
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
    examples: Sequence[EncodedExample], scope: str, batch_size: int, max_waste: float = 0.25, min_batch: int = 8
) -> list[list[int]]:
    """Group example indices into batches of similar window and sequence lengths (deterministic).

    The fast engine's cost is the padded window size times the number of runs, so examples are sorted by window
    length and a batch of at least ``min_batch`` examples is closed early when padding would waste more than
    ``max_waste`` of its window tokens (smaller batches would cost more in per-batch overhead than they save).
    """
    order = sorted(range(len(examples)),
                   key=lambda i: (len(examples[i].window(scope)), examples[i].read_positions.stop, i))
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0  # window tokens of the examples in ``current``
    for index in order:
        window = len(examples[index].window(scope))
        if current:
            wasteful = len(current) >= min_batch and (len(current) + 1) * window > (1 + max_waste) * (used + window)
            if len(current) >= batch_size or wasteful:
                batches.append(current)
                current, used = [], 0
        current.append(index)
        used += window
    if current:
        batches.append(current)
    return batches


def estimate_bytes_per_example(model: HookedTransformer, seq_len: int, window: int, engine: str) -> int:
    """Rough peak memory of one example in a batch, used to choose batch sizes from a memory budget."""
    cfg = model.cfg
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    layers = cfg.n_layers
    if engine == "naive":
        activations = seq_len * (4 * cfg.d_model + 3 * cfg.d_mlp + cfg.n_heads * seq_len) * itemsize
        logits = seq_len * cfg.d_vocab * 4
        return int(2 * (activations + logits) + layers * seq_len * cfg.d_model * itemsize)
    kv = 2 * layers * seq_len * n_kv * cfg.d_head * itemsize
    sources = 2 * layers * seq_len * cfg.d_model * itemsize
    runs = layers * window * (4 * cfg.d_model + 3 * cfg.d_mlp + cfg.n_heads * (seq_len + window)) * itemsize
    runs += layers * layers * window * cfg.n_heads * cfg.d_head * itemsize  # gathered prefix K/V per run
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
    model: HookedTransformer,
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
    budget = available_memory_bytes(model.cfg.device) * budget_fraction
    return int(max(1, min(cap, math.floor(budget / per_example))))


__all__ = [
    "CleanRun", "ENGINES", "PatchBatch", "SCOPES", "SITES", "baseline_scores", "choose_batch_size", "clean_run",
    "estimate_bytes_per_example", "fast_patched_scores", "plan_batches", "hook_name", "mean_entity_logprob", "naive_patched_scores",
    "pad_batch", "patched_scores", "source_activations",
]

"""The two patching engines and the entry points both stages call (see the package docstring for the method).

``source_scores`` runs a source once and scores every patched layer; ``baseline_scores`` is each engine's
unpatched score; ``patched_scores`` dispatches to ``naive_patched_scores`` (one hooked forward per layer, the
oracle) or ``fast_patched_scores`` (windows only, from the ``clean_run``'s keys and values)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor

from uds_lens.config import ENGINES, EngineSpec
from uds_lens.patching.batch import CleanRun, PatchBatch, WindowPacking, window_sites
from uds_lens.patching.kernels import (
    attention_layout,
    block_attention,
    fast_engine_refusal,
    final_softcap,
    layer_weights,
    mlp_half,
    packed_forward,
)
from uds_lens.readout import mean_entity_logprob, segment_mean, soft_cap, unembedded_label_logprobs
from uds_lens.sources import as_source, hook_name
from uds_lens.tl_compat import HookPoint, is_bridge

# ----------------------------------------------------------------------------------------------------------------
# Sources


def source_activations(
    source: Any, tokens: Int[Tensor, "batch pos"], spec: EngineSpec
) -> Float[Tensor, "layer batch pos d_model"]:
    """Activations of ``source`` at ``blocks.{l}.hook_{spec.site}`` for every ``l`` in ``spec.layers``, one forward.

    ``source`` is a HookedTransformer or a Hugging Face Llama (hooks on its modules; for ``resid_post`` the last
    block's output is the raw pre-final-norm residual, as TransformerLens has it). With ``spec.published_compat``
    and site ``resid_post``, the last layer's value is the source's own final-norm output, which is what the
    published implementation patches there (Hugging Face's ``hidden_states[L]``).
    """
    return as_source(source).activations(
        tokens, spec.site, spec.layers, final_norm_last=spec.published_compat
    )


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
        picked = unembedded_label_logprobs(rows, model.W_U, model.b_U, labels.repeat(n_runs), cap)
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


def clean_run(full: Any, batch: PatchBatch, spec: EngineSpec) -> CleanRun:
    """One clean forward of the target: S0 scores and (fast engine) prefix keys/values and window activations.

    The naive engine's clean run is the model's forward on the padded batch (its logits read as the naive patched
    runs read theirs); the fast engine's is ``packed_forward`` (no padding), whose arithmetic its patched runs
    share, with logits at the read positions only. Only ``spec.site``, ``spec.engine`` and ``spec.upcast`` matter
    here: one clean run serves every layer.
    """
    n_layers = full.cfg.n_layers
    site, upcast = spec.site, spec.upcast
    with torch.no_grad():
        if spec.engine == "naive":
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
            full, batch, window_sites(site), n_layers, window.rows_in(sequences), keep_kv=True
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
    full: Any, batch: PatchBatch, acts: Float[Tensor, "layer batch pos d_model"], spec: EngineSpec
) -> Float[Tensor, "batch layer"]:
    """One full patched forward per layer, hooks via ``run_with_hooks`` (always removed, even on error)."""
    columns = []
    mask = batch.patch_mask
    for position, layer in enumerate(spec.layers):
        source = acts[position]

        def overwrite(
            activation: Float[Tensor, "batch pos d_model"], hook: HookPoint, source: Tensor = source
        ) -> Float[Tensor, "batch pos d_model"]:
            patched = activation.clone()
            patched[mask] = source[mask].to(activation.dtype)
            return patched

        with torch.no_grad():
            logits = full.run_with_hooks(
                batch.tokens, fwd_hooks=residual_patch_hooks(full, hook_name(spec.site, layer), overwrite)
            )
        columns.append(
            mean_entity_logprob(
                logits[batch.read_batch, batch.read_pos],
                batch.read_label,
                batch.read_batch,
                batch.size,
                spec.upcast,
            )
        )
        del logits
    return torch.stack(columns, dim=1)


def window_source_activations(
    source: Any, batch: PatchBatch, spec: EngineSpec
) -> Float[Tensor, "layer row d_model"]:
    """Activations of ``source`` at ``blocks.{l}.hook_{spec.site}`` at the window rows of ``batch``
    (``WindowPacking.of`` order), for every ``l`` in ``spec.layers``: what the fast engine patches from.

    A HookedTransformer runs packed (``packed_forward``, no padding), with the same arithmetic as the target's clean
    run, so a source identical to the target gives back its clean activations bit for bit (deltas of exactly 0).
    Other sources run ``source_activations`` on the batch, gathered at the window rows.
    """
    site, layers = spec.site, list(spec.layers)
    window = WindowPacking.of(batch)
    wrapped = as_source(source)
    if fast_engine_refusal(wrapped.model) is not None:
        acts = wrapped.activations(batch.tokens, site, layers, final_norm_last=spec.published_compat)
        return acts[:, window.example.to(acts.device), window.position.to(acts.device)]
    model = wrapped.model
    on_source = batch.to(wrapped.device)
    rows = WindowPacking.of(on_source).rows_in(WindowPacking.sequences(on_source))
    with torch.no_grad():
        _, captured, _ = packed_forward(model, on_source, (site,), max(layers) + 1, rows)
        per_layer = [captured[site][layer] for layer in layers]
        if spec.published_compat:
            per_layer = [
                wrapped.published_compat_activation(hook_name(site, layer), acts)
                for layer, acts in zip(layers, per_layer, strict=True)
            ]
    return torch.stack(per_layer)


def fast_patched_scores(
    full: Any,
    batch: PatchBatch,
    clean: CleanRun,
    acts: Float[Tensor, "layer batch pos d_model"] | Float[Tensor, "layer row d_model"] | None,
    spec: EngineSpec,
) -> Float[Tensor, "batch layer"]:
    """Patched scores for every (example, layer of ``spec.layers``), recomputing only the window of each run.

    ``acts`` is ``[layer, batch, pos, d_model]`` (``source_activations``) or already at the packed window rows
    (``window_source_activations``); ``acts=None`` writes the clean activations back (the engine's own unpatched
    baseline).

    Run ``l`` holds the packed window rows of every example of the batch (``WindowPacking``: no padding) with the
    patch applied at layer ``l``, and goes through blocks ``> l`` (``>= l`` for ``resid_pre``) attending to the
    clean prefix keys/values. Runs are ordered latest start first, so the runs active at a block are a tail of them
    and each block is one call over ``[run, row, d_model]``.
    """
    site, layers = spec.site, list(spec.layers)
    if clean.site != site or not clean.keys:
        raise ValueError("The clean run was made for another site or without keys/values; rebuild it.")
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
                [mlp_half(layer_weights(full, layer), resid_mid[r]) for r, layer in enumerate(run_layers)]
            )

        layout = attention_layout(full, packing, resid.dtype)
        starts = [first_block(layer) for layer in run_layers]
        for block_index in range(min(starts), n_layers):
            first_active = next(r for r, start in enumerate(starts) if start <= block_index)
            weights = layer_weights(full, block_index)
            active = resid[first_active:]
            active = active + block_attention(
                weights, active, layout, clean.keys[block_index], clean.values[block_index]
            )
            resid[first_active:] = mlp_half(weights, active)

        scores = read_scores(
            full, resid[:, packing.read_row], batch.read_label, batch.read_batch, batch.size, spec.upcast
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
    spec: EngineSpec,
    clean: CleanRun | None = None,
) -> Float[Tensor, "batch layer"]:
    """Score of the full model patched at each layer of ``spec.layers`` with ``acts`` (one per layer).

    ``acts[i]`` is the source activation at ``blocks.{spec.layers[i]}.hook_{spec.site}``, over the padded batch,
    or (fast engine only) at the packed window rows as ``window_source_activations`` gives it. Swapping the engine
    changes no number beyond float noise (the tests hold ``fast`` to ``naive`` within 1e-5 in fp32).
    """
    if spec.engine == "naive":
        if acts.ndim != 4:
            raise ValueError(
                "The naive engine patches from [layer, batch, pos, d_model] activations "
                "(source_activations), not packed window rows."
            )
        return naive_patched_scores(full, batch, acts, spec)
    if spec.engine == "fast":
        if clean is None:
            clean = clean_run(full, batch, spec)
        return fast_patched_scores(full, batch, clean, acts, spec)
    raise ValueError(f"Unknown engine {spec.engine!r}; use one of {ENGINES}.")


def source_scores(
    full: Any,
    source: Any,
    batch: PatchBatch,
    spec: EngineSpec,
    clean: CleanRun | None = None,
    timings: dict[str, float] | None = None,
) -> Float[Tensor, "batch layer"]:
    """One source forward and the patched scores of every layer: what a stage costs per batch.

    The naive engine reads the source over the padded batch (``source_activations``), the fast one only at the
    window rows from a packed forward (``window_source_activations``). With ``timings``, the source forward's
    seconds are added to ``timings["source_forward_seconds"]`` (a sweep reports it as a phase of its own; on a GPU
    the device is synchronised first, so the figure is the forward's, not its launch's).
    """
    acts = timed_source_activations(source, batch, spec, timings)
    return patched_scores(full, batch, acts.to(full.cfg.device), spec, clean)


def timed_source_activations(
    source: Any, batch: PatchBatch, spec: EngineSpec, timings: dict[str, float] | None = None
) -> Tensor:
    """The source's activations as ``spec.engine`` reads them: the packed window rows (fast) or the padded batch
    (naive). With ``timings``, the forward's seconds are added to ``timings["source_forward_seconds"]`` (on a GPU
    after a synchronisation, so the figure is the forward's, not its launch's)."""
    started = time.perf_counter()
    if spec.engine == "fast":
        acts = window_source_activations(source, batch, spec)
    else:
        acts = source_activations(source, batch.tokens, spec)
    if timings is not None:
        if acts.is_cuda:
            torch.cuda.synchronize(acts.device)
        timings["source_forward_seconds"] = timings.get("source_forward_seconds", 0.0) + (
            time.perf_counter() - started
        )
    return acts


def baseline_scores(
    full: Any,
    batch: PatchBatch,
    clean: CleanRun,
    spec: EngineSpec,
) -> Float[Tensor, "batch layer"]:
    """The unpatched score as each engine computes it, per layer (S0 repeated for ``naive``).

    The fast engine's runs do the window's arithmetic in other shapes than the clean forward, so its baseline is
    the same computation with the clean activation written back: a source equal to the full model then gives
    deltas of exactly 0 rather than float noise.
    """
    if spec.engine == "naive":
        return clean.scores[:, None].expand(-1, len(spec.layers)).clone()
    return fast_patched_scores(full, batch, clean, None, spec)


__all__ = [
    "baseline_scores",
    "clean_run",
    "fast_patched_scores",
    "naive_patched_scores",
    "patched_scores",
    "read_scores",
    "residual_patch_hooks",
    "source_activations",
    "source_scores",
    "timed_source_activations",
    "window_source_activations",
]

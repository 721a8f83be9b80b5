"""The patched-run engine: write a source model's activations into the full model, one layer at a time.

For an example with read positions ``R`` (those predicting the entity tokens) and patched positions ``P``, a
patched run at layer ``l`` and site ``s`` is the full model with ``blocks.{l}.hook_{s}`` overwritten at ``P`` by the
source model's activation at the same hook, and its score is the mean over ``R`` of the entity tokens' log-probs:

    score(l) = mean_{p in R} log_softmax(W_U · ln_final(x_L[p]))[label(p)]     with x patched at (l, s, P)

Two engines compute exactly that, one class each on a shared base (``engines.PatchEngine``), chosen once from an
``EngineSpec`` and the model they patch by ``engines.engine_for(spec, full)``; every stage calls the chosen object's ``clean_run``,
``baseline_scores``, ``source_scores`` / ``patched_scores`` and ``cell_scores``, and planning asks its class how it
pads and sizes a batch:

* ``NaiveEngine``: one forward per (batch, layer) with TransformerLens hooks (``run_with_hooks``), as the published
  implementation does, stopped at the last block: the final residual is read at the read positions only, with the
  fast engine's read-out. It is the oracle the tests compare against, and the fallback for what ``fast`` refuses.
* ``FastEngine`` (the default): three facts make most of that work redundant. Blocks below ``l`` are untouched by the
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

  It computes the decoder layer of every family of ``uds_lens.families`` (RMSNorms wherever the family puts them,
  rotary grouped-query attention with q/k norms, soft-capping and sliding windows, the gated MLP) directly on the
  Hugging Face tensors a bridge wraps (``_BlockWeights``: Q, K and V in one product, the rest read in place), with the
  same arithmetic as Hugging Face's modules; what it refuses (``fast_engine_refusal``) uses ``naive``. On the CPU the work is matrix
  products: what remains above the floor is mostly their smaller row counts (``experiments/bench_engine.py``).

Each engine's baseline (the same computation with the clean activation written back) is what patched scores are
compared with, so a source identical to the full model gives deltas of exactly 0.

Sources only have to yield activations (``source_activations``): a ``TransformerBridge``, or a plain Hugging Face
model through forward hooks (that is how a 4-bit NF4 model is measured).

Every engine call takes one ``config.EngineSpec`` (site, layers, engine, published_compat) instead of loose
arguments. The package, one concept per module:

* ``batch``: ``PatchBatch`` (where to patch and read), ``WindowPacking`` (window tokens packed into flat rows),
  ``CleanRun`` (what the fast engine keeps from the clean forward);
* ``kernels``: the fast engine's table-driven block kernels and ``packed_forward``; ``fast_engine_refusal``;
* ``engines``: ``PatchEngine``, ``NaiveEngine``, ``FastEngine``, ``engine_for``; the source reads; ``axis_engine``
  and each engine's ``axis_scores`` (component patching);
* ``axes``: the component axes (head, entity token, patched position), one row of ``AXIS_PATCHES`` each: width,
  runs, mask, setter, read and labels, the small pieces the engines' ``axis_scores`` combine;
* ``resumed``: the fast engine's patched runs, resumed from the clean run at the patched layer: one kernel
  (``resumed_scores``) over two run layouts, one run per layer (``LayerRuns``) or per chosen cell (``CellRuns``:
  KE-only Stage 2, ragged runs packed into one row axis);
* ``planning``: which examples share a batch, the run's memory plan (``MemoryPlan``: the free memory measured once,
  ``SHARES`` the one table of what it hands out; ``CleanRuns``, the budgeted clean-run cache), and ``run_batches``,
  the one runner that halves a batch that runs out of memory (the auditor and component patching use it);
* ``cells``: what a Stage 2 on chosen cells runs and records, and ``stage2_work``, the floor's window work priced on
  the cells run.

The read-out (label log-probs and their per-example mean) is ``uds_lens.readout``'s, applied to final residuals by
``kernels.read_scores``.
"""

from __future__ import annotations

from uds_lens.config import ENGINES, SCOPES, SITES, EngineSpec
from uds_lens.patching.axes import AXIS_PATCHES, AxisPatch
from uds_lens.patching.batch import CleanRun, PatchBatch, WindowPacking, pad_batch
from uds_lens.patching.engines import (
    FastEngine,
    NaiveEngine,
    PatchEngine,
    axis_engine,
    engine_class,
    engine_for,
    residual_patch_hooks,
    source_activations,
    window_source_activations,
)
from uds_lens.patching.kernels import FAST_MODEL_TYPES, fast_engine_refusal, packed_forward, read_scores
from uds_lens.patching.planning import SHARES, MemoryPlan, choose_batch_size, plan_batches, run_batches
from uds_lens.readout import mean_entity_logprob, segment_mean
from uds_lens.sources import hook_name

__all__ = [
    "AXIS_PATCHES",
    "AxisPatch",
    "CleanRun",
    "ENGINES",
    "FAST_MODEL_TYPES",
    "FastEngine",
    "MemoryPlan",
    "NaiveEngine",
    "PatchBatch",
    "PatchEngine",
    "SCOPES",
    "SHARES",
    "SITES",
    "EngineSpec",
    "WindowPacking",
    "axis_engine",
    "choose_batch_size",
    "engine_class",
    "engine_for",
    "fast_engine_refusal",
    "hook_name",
    "mean_entity_logprob",
    "packed_forward",
    "pad_batch",
    "plan_batches",
    "read_scores",
    "residual_patch_hooks",
    "run_batches",
    "segment_mean",
    "source_activations",
    "window_source_activations",
]

"""The two patching engines, one class each on a shared base, and the source reads (see the package docstring for
the method).

``engine_for(spec)`` chooses the engine once, from ``spec.engine``; every stage then calls the chosen object:
``clean_run`` (S0 and what the engine reuses), ``baseline_scores`` (its unpatched score per layer),
``source_scores`` / ``patched_scores`` (one source forward, then a patched run per layer), ``cell_scores`` (Stage 2
on chosen cells only). Planning asks the engine's class how it lays out and sizes a batch (``cut``,
``padded_length``, ``bytes_per_example``, ``joins_weights``) and whether it runs a model at all (``refusal``).
Component patching asks ``axis_engine`` for the engine of one row of ``patching.axes`` and calls its
``axis_scores`` (heads, entity tokens or patched positions along a last axis).

* `NaiveEngine` (the oracle and the fallback): one hooked forward of the full model per (batch, layer),
  stopped at the last block's output; the final residual is read at the read positions only (``read_scores``, the
  fast engine's read-out), so no run makes logits for positions nobody reads.
* `FastEngine` (the default): only each example's window is recomputed, from the clean run's keys and
  values (``fast_patched_scores``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from uds_lens.checkpoints.checkpoint import model_label
from uds_lens.config import ENGINES, Engine, EngineSpec, Scope
from uds_lens.data import EncodedExample
from uds_lens.patching.axes import (
    HEAD_HOOKS,
    AxisPatch,
    AxisScores,
    cached_activations,
    head_attn_out_patches,
    hooked_token_logprobs,
)
from uds_lens.patching.batch import CleanRun, PatchBatch, WindowPacking, window_sites
from uds_lens.patching.kernels import fast_engine_refusal, packed_forward, packed_forwards, read_scores
from uds_lens.patching.resumed import CellRuns, LayerRuns, resumed_scores
from uds_lens.readout import segment_mean
from uds_lens.sources import as_source, hook_name
from uds_lens.tl_compat import HookPoint, ModelLike, TLModel, attn_result, is_bridge

logger = logging.getLogger(__name__)

Hooks = list[tuple[str, Callable[..., Tensor]]]

# ----------------------------------------------------------------------------------------------------------------
# The shared base


class PatchEngine(ABC):
    """One patching engine bound to one ``EngineSpec`` (site, layers, published-compat): see the module docstring.

    Class attributes say how planning treats the engine's batches: ``cut`` (sequences end at the last read
    position, ``pad_batch``'s ``cut``) and ``joins_weights`` (the engine keeps joined copies of a model's matrices,
    ``planning.joined_copy_bytes``).
    """

    name: ClassVar[Engine]
    cut: ClassVar[bool]
    joins_weights: ClassVar[bool]

    def __init__(self, spec: EngineSpec) -> None:
        if spec.engine != self.name:
            raise ValueError(f"{type(self).__name__} runs engine {self.name!r}, not {spec.engine!r}.")
        self.spec = spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def with_layers(self, layers: Sequence[int]) -> PatchEngine:
        """The same engine over other layers (``cell_scores`` runs only the layers that have a cell)."""
        return type(self)(dataclasses.replace(self.spec, layers=tuple(layers)))

    # -- what planning asks of the engine ---------------------------------------------------------------------

    @staticmethod
    @abstractmethod
    def refusal(model: TLModel) -> str | None:
        """Why this engine cannot run ``model`` (one line), or ``None``."""

    @staticmethod
    @abstractmethod
    def padded_length(example: EncodedExample, scope: Scope) -> int:
        """The length along the axis this engine pads a batch on (what ``plan_batches`` groups by)."""

    @staticmethod
    @abstractmethod
    def bytes_per_example(model: TLModel, seq_len: int, window: int) -> int:
        """Rough peak memory of one example in a batch (``choose_batch_size`` divides a budget by it)."""

    # -- the runs -------------------------------------------------------------------------------------------------

    @abstractmethod
    def clean_run(self, full: TLModel, batch: PatchBatch) -> CleanRun:
        """One clean forward of the target: S0 and what this engine's patched runs reuse. Only ``spec.site`` and
        ``spec.upcast`` matter here: one clean run serves every layer."""

    @abstractmethod
    def source_activations(self, source: ModelLike, batch: PatchBatch) -> Tensor:
        """The source's activations at ``spec.site`` of every layer of ``spec.layers``, as ``patched_scores``
        reads them."""

    @abstractmethod
    def patched_scores(
        self, full: TLModel, batch: PatchBatch, acts: Tensor, clean: CleanRun | None = None
    ) -> Float[Tensor, "batch layer"]:
        """Score of the full model patched at each layer of ``spec.layers`` with ``acts`` (one per layer).

        Swapping the engine changes no number beyond float noise (the tests hold ``fast`` to ``naive`` within 1e-5
        in fp32)."""

    @abstractmethod
    def baseline_scores(
        self, full: TLModel, batch: PatchBatch, clean: CleanRun
    ) -> Float[Tensor, "batch layer"]:
        """The unpatched score as this engine computes it, per layer: what patched scores are compared with, so a
        source identical to the full model gives deltas of exactly 0."""

    @abstractmethod
    def scores_of_cells(
        self,
        full: TLModel,
        batch: PatchBatch,
        clean: CleanRun | None,
        acts: Tensor,
        source_rows: list[int],
        cells: Bool[Tensor, "batch layer"],
    ) -> Float[Tensor, " cell"]:
        """Scores of ``cells`` (``[batch, layer of spec.layers]``) in ``cells.nonzero()`` order, from the source
        activations of the examples ``source_rows`` (this engine's ``source_activations`` of that sub-batch)."""

    @abstractmethod
    def axis_scores(
        self, full: TLModel, source: TLModel, batch: PatchBatch, patch: AxisPatch, point: str, width: int
    ) -> AxisScores:
        """Scores along a component axis (``patch``, a row of ``patching.axes``, ``width`` components) at every
        layer of ``spec.layers``, ``source``'s activation at ``blocks.{l}.{point}`` written as the row says."""

    # -- shared ---------------------------------------------------------------------------------------------------

    def source_activations_of(self, source: ModelLike, batches: Sequence[PatchBatch]) -> list[Tensor]:
        """`source_activations` of each of ``batches`` (the fast engine reads them block first,
        ``window_source_activations_of``)."""
        return [self.source_activations(source, batch) for batch in batches]

    def timed_source_activations(
        self, source: ModelLike, batches: Sequence[PatchBatch], timings: dict[str, float] | None = None
    ) -> list[Tensor]:
        """`source_activations_of`; with ``timings``, the forward's seconds are added to
        ``timings["source_forward_seconds"]`` (on a GPU after a synchronisation, so the figure is the forward's,
        not its launch's)."""
        started = time.perf_counter()
        acts = self.source_activations_of(source, batches)
        if timings is not None:
            if acts and acts[0].is_cuda:
                torch.cuda.synchronize(acts[0].device)
            timings["source_forward_seconds"] = timings.get("source_forward_seconds", 0.0) + (
                time.perf_counter() - started
            )
        return acts

    def source_scores(
        self,
        full: TLModel,
        source: ModelLike,
        batch: PatchBatch,
        clean: CleanRun | None = None,
        timings: dict[str, float] | None = None,
    ) -> Float[Tensor, "batch layer"]:
        """One source forward and the patched scores of every layer: what a stage costs per batch (``timings`` as
        for `timed_source_activations`)."""
        (acts,) = self.timed_source_activations(source, [batch], timings)
        return self.patched_scores(full, batch, acts.to(full.cfg.device), clean)

    def cell_scores(
        self,
        full: TLModel,
        source: ModelLike,
        batch: PatchBatch,
        cells: Bool[Tensor, "batch layer"],
        clean: CleanRun | None = None,
        timings: dict[str, float] | None = None,
    ) -> Float[Tensor, "batch layer"]:
        """`source_scores` on the ``cells`` only (``[batch, layer of spec.layers]``), NaN elsewhere.

        The source runs on the examples that have a cell, through the last layer that has one; a batch without any
        cell runs nothing (``patching.cells`` describes the fast engine's packing of the cells)."""
        cells = cells.to(torch.bool).cpu()
        result = torch.full(cells.shape, float("nan"))
        rows = cells.any(1).nonzero()[:, 0].tolist()
        if not rows:
            return result
        used = cells.any(0).nonzero()[:, 0].tolist()
        narrowed = self.with_layers([self.spec.layers[j] for j in used])
        cells_used = cells[:, used]
        sources = batch if len(rows) == batch.size else batch.select(rows)
        (acts,) = narrowed.timed_source_activations(source, [sources], timings)
        acts = acts.to(full.cfg.device)
        scores = narrowed.scores_of_cells(full, batch, clean, acts, rows, cells_used)
        full_index = torch.tensor(used)[cells_used.nonzero()[:, 1]]
        result[cells_used.nonzero()[:, 0], full_index] = scores.float().cpu()
        return result


def engine_class(name: str) -> type[PatchEngine]:
    """The engine class named ``name`` (``fast`` or ``naive``)."""
    classes: dict[str, type[PatchEngine]] = {"fast": FastEngine, "naive": NaiveEngine}
    if name not in classes:
        raise ValueError(f"Unknown engine {name!r}; use one of {ENGINES}.")
    return classes[name]


def engine_for(spec: EngineSpec, full: TLModel | None = None, label: str = "the full model") -> PatchEngine:
    """The engine ``spec.engine`` names, bound to ``spec``: the one place the choice is made.

    Given the model it will patch (``full``), the naive engine where the engine named refuses that model (a family
    the fast engine does not compute, quantised weights): the model's own forward, never a guess, after a one-line
    warning that names what runs naive (``label``) and why."""
    chosen = engine_class(spec.engine)
    refusal = None if full is None else chosen.refusal(full)
    if refusal is None:
        return chosen(spec)
    logger.warning("%s: %s; it runs on the naive engine.", label, refusal)
    return NaiveEngine(dataclasses.replace(spec, engine="naive"))


def axis_engine(spec: EngineSpec, patch: AxisPatch, full: TLModel, strict: bool = False) -> PatchEngine:
    """The engine that runs component patch ``patch`` on ``full``: `engine_for`, naive where the row is naive-only
    (``patch.naive_only``) or the engine refuses the model.

    Raises:
        ValueError: ``strict`` (the engine was asked for by name) and the row is naive-only.
    """
    if spec.engine != "naive" and patch.naive_only is not None:
        if strict:
            raise ValueError(patch.naive_only)
        return engine_for(dataclasses.replace(spec, engine="naive"))
    return engine_for(spec, full, f"{patch.axis} patching of {model_label(full)}")


# ----------------------------------------------------------------------------------------------------------------
# Sources


def source_activations(
    source: ModelLike, tokens: Int[Tensor, "batch pos"], spec: EngineSpec
) -> Float[Tensor, "layer batch pos d_model"]:
    """Activations of ``source`` at ``blocks.{l}.hook_{spec.site}`` for every ``l`` in ``spec.layers``, one forward
    over the padded batch (what the naive engine patches from; the fast engine accepts it too).

    ``source`` is a TransformerLens model or a Hugging Face model (hooks on its modules; for ``resid_post`` the last
    block's output is the raw pre-final-norm residual, as TransformerLens has it). With ``spec.published_compat``
    and site ``resid_post``, the last layer's value is the source's own final-norm output, which is what the
    published implementation patches there (Hugging Face's ``hidden_states[L]``).
    """
    return as_source(source).activations(
        tokens, spec.site, spec.layers, final_norm_last=spec.published_compat
    )


# ----------------------------------------------------------------------------------------------------------------
# Naive engine (the oracle)

_RESID_MID = re.compile(r"blocks\.(\d+)\.hook_resid_mid")


def residual_patch_hooks(model: TLModel, name: str, hook_fn: Callable[..., Tensor]) -> Hooks:
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


class _FinalResidual(Exception):
    """Raised by the last block's hook to end a naive run there, carrying the residual at the read positions."""

    def __init__(self, resid: Tensor) -> None:
        super().__init__("final residual captured")
        self.resid = resid


def final_residual_at_reads(
    full: TLModel, batch: PatchBatch, hooks: Hooks
) -> Float[Tensor, "entity d_model"]:
    """The full model's forward on the padded batch with ``hooks``, stopped at the last block's output: the
    pre-final-norm residual at the read positions (``batch.read_batch``, ``batch.read_pos``).

    The forward ends there (the hook raises, and ``run_with_hooks`` removes every hook on the way out), so no
    logits are made for the positions nobody reads; the final norm and the unembedding are ``read_scores``'s, on
    the read rows alone. The capture is the last hook of its hook point, so it sees what the patch hooks wrote."""
    last = f"blocks.{full.cfg.n_layers - 1}.hook_resid_post"
    rows, positions = batch.read_batch, batch.read_pos

    def stop(activation: Tensor, hook: HookPoint) -> Tensor:
        raise _FinalResidual(activation[rows, positions])

    try:
        full.run_with_hooks(batch.tokens, fwd_hooks=[*hooks, (last, stop)])
    except _FinalResidual as done:
        return done.resid
    raise RuntimeError(f"The forward never reached {last}: the model's blocks do not end there.")


class NaiveEngine(PatchEngine):
    """One hooked forward of the full model per (batch, layer) on the padded batch: the oracle the tests compare
    against and the fallback for what the fast engine refuses (quantised weights, a family it does not compute).

    Each run, the clean one included, stops at the last block and reads the final residual at the read positions
    (`final_residual_at_reads`, then ``read_scores``), so a source equal to the full model gives deltas of
    exactly 0 and the read-out is the fast engine's. Its baseline is S0 repeated per layer."""

    name: ClassVar[Engine] = "naive"
    cut: ClassVar[bool] = False  # the whole prompt + reference, as the published implementation runs it
    joins_weights: ClassVar[bool] = False

    @staticmethod
    def refusal(model: TLModel) -> str | None:
        return None  # the model's own forward: right for every family

    @staticmethod
    def padded_length(example: EncodedExample, scope: Scope) -> int:
        return len(
            example.window(scope)
        )  # the grouping the oracle has always had, so its float noise is unchanged

    @staticmethod
    def bytes_per_example(model: TLModel, seq_len: int, window: int) -> int:
        cfg = model.cfg
        itemsize = torch.empty((), dtype=cfg.dtype).element_size()
        d_mlp = cfg.d_mlp or 4 * cfg.d_model
        activations = seq_len * (4 * cfg.d_model + 3 * d_mlp + cfg.n_heads * seq_len) * itemsize
        logits = window * cfg.d_vocab * 4  # read rows only (read_scores)
        return int(2 * (activations + logits) + cfg.n_layers * seq_len * cfg.d_model * itemsize)

    def read(self, full: TLModel, batch: PatchBatch, hooks: Hooks) -> Float[Tensor, " batch"]:
        """The score of one run: the forward with ``hooks``, read at the read positions."""
        with torch.no_grad():
            resid = final_residual_at_reads(full, batch, hooks)
            return read_scores(
                full, resid[None], batch.read_label, batch.read_batch, batch.size, self.spec.upcast
            )[0]

    def clean_run(self, full: TLModel, batch: PatchBatch) -> CleanRun:
        return CleanRun(site=self.spec.site, scores=self.read(full, batch, []))

    def source_activations(self, source: ModelLike, batch: PatchBatch) -> Tensor:
        return source_activations(source, batch.tokens, self.spec)

    def patched_scores(
        self, full: TLModel, batch: PatchBatch, acts: Tensor, clean: CleanRun | None = None
    ) -> Float[Tensor, "batch layer"]:
        """One patched forward per layer (``run_with_hooks``: its hooks are removed even on error), from
        ``[layer, batch, pos, d_model]`` activations (``source_activations``)."""
        if acts.ndim != 4:
            raise ValueError(
                "The naive engine patches from [layer, batch, pos, d_model] activations "
                "(source_activations), not packed window rows."
            )
        columns = []
        mask = batch.patch_mask
        for position, layer in enumerate(self.spec.layers):
            source = acts[position]

            def overwrite(
                activation: Float[Tensor, "batch pos d_model"], hook: HookPoint, source: Tensor = source
            ) -> Float[Tensor, "batch pos d_model"]:
                patched = activation.clone()
                patched[mask] = source[mask].to(activation.dtype)
                return patched

            hooks = residual_patch_hooks(full, hook_name(self.spec.site, layer), overwrite)
            columns.append(self.read(full, batch, hooks))
        return torch.stack(columns, dim=1)

    def baseline_scores(
        self, full: TLModel, batch: PatchBatch, clean: CleanRun
    ) -> Float[Tensor, "batch layer"]:
        return clean.scores[:, None].expand(-1, len(self.spec.layers)).clone()

    def scores_of_cells(
        self,
        full: TLModel,
        batch: PatchBatch,
        clean: CleanRun | None,
        acts: Tensor,
        source_rows: list[int],
        cells: Bool[Tensor, "batch layer"],
    ) -> Float[Tensor, " cell"]:
        """Per layer, one hooked forward of the examples that have a cell there."""
        out = torch.empty(int(cells.sum()), dtype=torch.float32)
        cell_index = torch.full(cells.shape, -1, dtype=torch.long)
        cell_index[cells] = torch.arange(int(cells.sum()))
        source_of = {row: position for position, row in enumerate(source_rows)}
        for position, layer in enumerate(self.spec.layers):
            members = cells[:, position].nonzero()[:, 0].tolist()
            if not members:
                continue
            layer_acts = acts[position][[source_of[row] for row in members]][None]
            scores = self.with_layers([layer]).patched_scores(full, batch.select(members), layer_acts)
            out[cell_index[members, position]] = scores[:, 0].float().cpu()
        return out

    def axis_scores(
        self, full: TLModel, source: TLModel, batch: PatchBatch, patch: AxisPatch, point: str, width: int
    ) -> AxisScores:
        """One ``run_with_hooks`` per (layer, run of ``patch.runs``), the whole logits read at the read positions:
        ``patch.setter`` writes the source's activation where ``patch.mask`` says, ``patch.read`` turns the run's
        per-token log-probs into columns; rows a run does not patch stay NaN."""
        layers, upcast = self.spec.layers, self.spec.upcast
        names = [f"blocks.{layer}.{point}" for layer in layers]
        use_result = point == HEAD_HOOKS["result"]
        with attn_result(full, use_result):
            cache = cached_activations(
                source, batch.tokens, set(names), use_result, self.spec.published_compat
            )
            clean = hooked_token_logprobs(full, batch, [], upcast)
            scores = torch.full((batch.size, len(layers), width), math.nan, device=batch.tokens.device)
            for position, name in enumerate(names):
                for component, mask in patch.patched_runs(batch, width):
                    hook = partial(patch.setter, source=cache[name], mask=mask, component=component)
                    logprobs = hooked_token_logprobs(
                        full, batch, residual_patch_hooks(full, name, hook), upcast
                    )
                    patch.write(scores[:, position], logprobs, batch, width, component, mask)
        baseline = patch.read(clean, batch, width)[:, None].expand(-1, len(layers), -1)
        return AxisScores(segment_mean(clean, batch.read_batch, batch.size), baseline, scores)


# ----------------------------------------------------------------------------------------------------------------
# Fast engine (the default)


def window_source_activations(
    source: ModelLike, batch: PatchBatch, spec: EngineSpec
) -> Float[Tensor, "layer row d_model"]:
    """Activations of ``source`` at ``blocks.{l}.hook_{spec.site}`` at the window rows of ``batch``
    (``WindowPacking.of`` order), for every ``l`` in ``spec.layers``: what the fast engine patches from
    (`window_source_activations_of` one batch)."""
    return window_source_activations_of(source, [batch], spec)[0]


def window_source_activations_of(
    source: ModelLike, batches: Sequence[PatchBatch], spec: EngineSpec
) -> list[Tensor]:
    """`window_source_activations` of each of ``batches`` (``[layer, row, d_model]`` each), read block first.

    A TransformerLens model (a bridge) runs packed (``packed_forwards``, no padding), with the same arithmetic as
    the target's clean run, so a source identical to the target gives back its clean activations bit for bit
    (deltas of exactly 0); its blocks run one at a time over every batch, each block's joined weights made once
    for all of them (``kernels.packed_forwards``). Other sources run ``source_activations`` on each batch,
    gathered at the window rows.
    """
    site, layers = spec.site, list(spec.layers)
    wrapped = as_source(source)
    if fast_engine_refusal(wrapped.model) is not None:
        out = []
        for batch in batches:
            window = WindowPacking.of(batch)
            acts = wrapped.activations(batch.tokens, site, layers, final_norm_last=spec.published_compat)
            out.append(acts[:, window.example.to(acts.device), window.position.to(acts.device)])
        return out
    on_source = [batch.to(wrapped.device) for batch in batches]
    rows = [WindowPacking.of(b).rows_in(WindowPacking.sequences(b)) for b in on_source]
    with torch.no_grad():
        runs = packed_forwards(wrapped.model, on_source, (site,), max(layers) + 1, rows)
        out = []
        for _, captured, _ in runs:
            per_layer = [captured[site][layer] for layer in layers]
            if spec.published_compat:
                per_layer = [
                    wrapped.published_compat_activation(hook_name(site, layer), acts)
                    for layer, acts in zip(layers, per_layer, strict=True)
                ]
            out.append(torch.stack(per_layer))
    return out


def fast_patched_scores(
    full: TLModel,
    batch: PatchBatch,
    clean: CleanRun,
    acts: Float[Tensor, "layer batch pos d_model"] | Float[Tensor, "layer row d_model"] | None,
    spec: EngineSpec,
) -> Float[Tensor, "batch layer"]:
    """Patched scores for every (example, layer of ``spec.layers``), recomputing only the window of each run: the
    resumed runs of ``patching.resumed``, one per layer over every example's window (``LayerRuns``).

    ``acts`` is ``[layer, batch, pos, d_model]`` (``source_activations``) or already at the packed window rows
    (``window_source_activations``); ``acts=None`` writes the clean activations back (the engine's own unpatched
    baseline).
    """
    if acts is not None and acts.ndim == 4:  # [layer, batch, pos, d_model]: gather the window rows
        packing = WindowPacking.of(batch)
        acts = acts[:, packing.example.to(acts.device), packing.position.to(acts.device)]
    return resumed_scores(LayerRuns.of(full, batch, spec), batch, clean, acts, spec)


class FastEngine(PatchEngine):
    """Only the window of each run is recomputed, from the clean run's prefix keys and values, all the runs of a
    batch through each block together (the package docstring has the method): the default."""

    name: ClassVar[Engine] = "fast"
    cut: ClassVar[bool] = True  # nothing after the last read position can change a read logit
    joins_weights: ClassVar[bool] = True

    @staticmethod
    def refusal(model: TLModel) -> str | None:
        return fast_engine_refusal(model)

    @staticmethod
    def padded_length(example: EncodedExample, scope: Scope) -> int:
        return example.read_positions.stop  # windows are packed; the keys/values' sequence axis is padded

    @staticmethod
    def bytes_per_example(model: TLModel, seq_len: int, window: int) -> int:
        cfg = model.cfg
        itemsize = torch.empty((), dtype=cfg.dtype).element_size()
        n_kv = cfg.n_key_value_heads or cfg.n_heads
        layers = cfg.n_layers
        d_mlp = cfg.d_mlp or 4 * cfg.d_model
        kv = 2 * layers * seq_len * n_kv * cfg.d_head * itemsize
        sources = 2 * layers * seq_len * cfg.d_model * itemsize
        runs = layers * window * (4 * cfg.d_model + 3 * d_mlp + cfg.n_heads * (seq_len + window)) * itemsize
        # no logits: read_scores holds a slice of the vocabulary (or, published-compat, of the runs) at a time, a few
        # MiB whatever the batch, which the runs' bound (twice over) covers
        return int(kv + sources + 2 * runs)

    def clean_run(self, full: TLModel, batch: PatchBatch) -> CleanRun:
        """``packed_forward`` (no padding), whose arithmetic the patched runs share, with logits at the read
        positions only, keeping each block's prefix keys/values and the window activations."""
        site = self.spec.site
        with torch.no_grad():
            sequences = WindowPacking.sequences(batch)
            window = WindowPacking.of(batch)
            final, captured, kv = packed_forward(
                full, batch, window_sites(site), full.cfg.n_layers, window.rows_in(sequences), keep_kv=True
            )
            scores = read_scores(
                full,
                final[sequences.read_row][None],
                batch.read_label,
                batch.read_batch,
                batch.size,
                self.spec.upcast,
            )[0]
            prefix = window.prefix_len
            return CleanRun(
                site=site,
                scores=scores,
                keys=[k[:, :, :prefix].contiguous() for k in kv[0::2]],
                values=[v[:, :, :prefix].contiguous() for v in kv[1::2]],
                window_acts={name: torch.stack(values) for name, values in captured.items()},
            )

    def source_activations(self, source: ModelLike, batch: PatchBatch) -> Tensor:
        return window_source_activations(source, batch, self.spec)

    def source_activations_of(self, source: ModelLike, batches: Sequence[PatchBatch]) -> list[Tensor]:
        return window_source_activations_of(source, batches, self.spec)

    def patched_scores(
        self, full: TLModel, batch: PatchBatch, acts: Tensor, clean: CleanRun | None = None
    ) -> Float[Tensor, "batch layer"]:
        """From ``[layer, batch, pos, d_model]`` activations (``source_activations``) or the packed window rows
        (``window_source_activations``); the clean run is made when not given."""
        return fast_patched_scores(full, batch, clean or self.clean_run(full, batch), acts, self.spec)

    def baseline_scores(
        self, full: TLModel, batch: PatchBatch, clean: CleanRun
    ) -> Float[Tensor, "batch layer"]:
        """The runs' arithmetic is in other shapes than the clean forward's, so the baseline is the same
        computation with the clean activation written back (deltas of exactly 0 for a source equal to full)."""
        return fast_patched_scores(full, batch, clean, None, self.spec)

    def scores_of_cells(
        self,
        full: TLModel,
        batch: PatchBatch,
        clean: CleanRun | None,
        acts: Tensor,
        source_rows: list[int],
        cells: Bool[Tensor, "batch layer"],
    ) -> Float[Tensor, " cell"]:
        clean = clean or self.clean_run(full, batch)
        runs = CellRuns.of(full, batch, cells.to(batch.tokens.device), source_rows, self.spec)
        return resumed_scores(runs, batch, clean, acts, self.spec)

    def axis_scores(
        self, full: TLModel, source: TLModel, batch: PatchBatch, patch: AxisPatch, point: str, width: int
    ) -> AxisScores:
        """Head patching at the patched positions: one run per head at site ``attn_out`` over every layer, from
        ``axes.head_attn_out_patches``; the baseline is this engine's own unpatched recomputation."""
        if patch.naive_only is not None:
            raise ValueError(patch.naive_only)
        engine = FastEngine(dataclasses.replace(self.spec, site="attn_out"))
        clean = engine.clean_run(full, batch)
        baseline = engine.baseline_scores(full, batch, clean)
        heads = head_attn_out_patches(full, source, batch, point, self.spec.layers)
        scores = torch.stack([engine.patched_scores(full, batch, acts, clean) for acts in heads], dim=-1)
        return AxisScores(clean.scores, baseline[:, :, None].expand(-1, -1, width), scores)


__all__ = [
    "FastEngine",
    "NaiveEngine",
    "PatchEngine",
    "axis_engine",
    "engine_class",
    "engine_for",
    "fast_patched_scores",
    "final_residual_at_reads",
    "residual_patch_hooks",
    "source_activations",
    "window_source_activations",
    "window_source_activations_of",
]

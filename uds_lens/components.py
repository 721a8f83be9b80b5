"""Head- and position-level patching: UDS at the granularity TransformerLens users work at.

UDS (``auditor.py`` running ``patching.engines``) patches one hook site per layer (a residual or block output). Here
the same patch is resolved further, with the same stages and the same definitions (``d1 = baseline - s1``,
``d2 = baseline - s2`` with the unpatched score as baseline, KE cells ``d1 > tau``, ``LER = clip(d2 / d1, 0, 1)`` on
KE cells and NaN elsewhere, ``UDS = sum_KE d1 * LER / sum_KE d1``; :class:`ComponentResult` computes them through
``uds.py``), reading only what :class:`PatchContext` names of the auditor:

* **per head** (:func:`patch_heads`): the source's ``blocks.{l}.attn.hook_z`` (or ``hook_result``) of one head
  ``h`` is written into the full model at the patched positions; scores ``[example, layer, head]``. Head-level UDS
  answers *which heads carry the forgotten fact, and did unlearning remove it there*;
* **per entity token** (:func:`patch_tokens`): the usual span patch at one site, but the log-prob of every entity
  token is kept instead of their mean, ``[example, layer, token]``, so one sees which token of "Nikolai Abilov"
  is still recoverable. The mean over an example's tokens is exactly the span score;
* **per patched position** (:func:`patch_positions`): each patched position is patched alone, the span mean read
  as usual, ``[example, layer, position]`` (TransformerLens's ``get_act_patch_resid_pre`` layout, restricted to
  the positions UDS patches).

Engines. A head's output enters the residual stream only through the attention output,
``attn_out = sum_h z_h W_O[h] + b_O`` (``result_h = z_h W_O[h]`` is TransformerLens's ``hook_result``), so
patching head ``h`` is exactly patching ``attn_out`` with ``clean attn_out + (z_src,h - z_full,h) W_O[h]`` (for
``hook_z``; ``hook_result`` uses the source's own ``W_O``; where the family normalises the attention's output before
adding it, Gemma's and OLMo 2's post-attention norm, the patched ``attn_out`` is that norm of the patched sum
``attn.hook_out + change``). That lets the fast engine (``patching.engines`` on ``patching.kernels``) run it:
one call per head over all layers. Everything else (other hook names, all positions, per-token reads) uses
``run_with_hooks``, one forward per (layer, component): the naive engine, which is also the tests' oracle. The
naive engine's baseline is the clean score S0; the fast engine's is its own unpatched recomputation, as in UDS.

Sources are run as TransformerLens models (bridges) here (a head is a TransformerLens notion): ``auditor.load_source``
loads a path or zoo name as one, and a Hugging Face source is converted (``sources.ActivationSource.hooked``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.component_result import HEAD_TAU, ComponentResult
from uds_lens.config import SITES, Engine, EngineSpec, Scope, UDSConfig
from uds_lens.data import EncodedExample
from uds_lens.families import family_of
from uds_lens.patching.batch import PatchBatch, pad_batch
from uds_lens.patching.engines import FastEngine, engine_class, residual_patch_hooks
from uds_lens.patching.kernels import attention_output_norm, wrapped_model
from uds_lens.patching.planning import consecutive_batches, run_batches
from uds_lens.readout import label_logprobs, mean_entity_logprob, segment_mean
from uds_lens.sources import as_source, hook_name
from uds_lens.tl_compat import HookPoint, ModelLike, TLModel, attn_result

logger = logging.getLogger(__name__)

HEAD_HOOKS = {"z": "attn.hook_z", "result": "attn.hook_result"}
"""Per-head hook points (TransformerLens names inside ``blocks.{l}``): ``[batch, pos, head, d]``."""

Axis: TypeAlias = Literal["head", "token", "position"]
"""What a component result indexes after ``[example, layer]``: one attention head, one entity token, one patched
position."""
Positions: TypeAlias = Literal["patched", "all"]
"""Where head patching writes: the example's patched positions (the UDS window) or every position."""
EngineChoice: TypeAlias = Literal["auto", "fast", "naive"]
"""The engine asked of head patching: ``auto`` runs the fast one where it applies."""

AXES: tuple[Axis, ...] = ("head", "token", "position")


@runtime_checkable
class PatchContext(Protocol):
    """What component patching reads from the auditor it runs for, and nothing more.

    ``UDSAuditor`` satisfies it structurally (``patch_heads(auditor, "zoo:npo")`` and ``auditor.patch_heads(...)`` are
    the same call); so does any object with these members, e.g. a test double. Component patching never calls back
    into the auditor's own scoring, and writes only to ``component_cache``.
    """

    @property
    def full(self) -> TLModel:
        """The full model, a TransformerLens model: the patch target."""

    @property
    def retain(self) -> TLModel | None:
        """The retain model (S1's source), or None in retain-free mode (component patching then refuses)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The full model's tokenizer: decodes the labels of entity tokens and patched positions."""

    @property
    def pad_id(self) -> int:
        """The token id that pads batches."""

    @property
    def config(self) -> UDSConfig:
        """The settings read here: ``site``, ``tau``, ``patch_scope``, ``batch_size``, ``published_compat``."""

    @property
    def layers(self) -> Sequence[int]:
        """The layers patched by default."""

    @property
    def progress(self) -> bool:
        """Whether tqdm bars are shown by default."""

    @property
    def component_cache(self) -> MutableMapping[tuple, Any]:
        """Where S1's component scores are kept for the next unlearned model (keyed by the run's settings)."""

    def select(self, idxs: Sequence[int] | None = None) -> list[EncodedExample]:
        """The encoded examples with these dataset ``idx`` (default all scored ones), in that order."""
        ...

    def load_source(self, model: object, role: str = "unlearned") -> ModelLike:
        """A source model (path, zoo name or loaded model), loaded once and kept."""
        ...


# ----------------------------------------------------------------------------------------------------------------
# Inputs of one example, and a metric for hand-written hooks


@dataclass(frozen=True)
class ExampleInputs:
    """Everything a hand-written hook experiment needs for one forget-set example, as tensors.

    Attributes:
        idx: the example's dataset ``idx``.
        question / entity / prompt / reference: the strings (``prompt + reference`` is what the tokens encode).
        tokens: ``[1, pos]`` prompt + reference token ids (BOS included), ready for ``run_with_hooks``.
        str_tokens: the tokens as strings, one per position.
        read_positions: ``[entity]`` positions whose logits predict the entity tokens.
        labels: ``[entity]`` the entity token ids (``tokens[0, read_positions + 1]``).
        patch_positions: ``[patched]`` positions UDS patches under the auditor's scope.
    """

    idx: int
    question: str
    entity: str
    prompt: str
    reference: str
    tokens: Int[Tensor, "1 pos"]
    str_tokens: list[str]
    read_positions: Int[Tensor, " entity"]
    labels: Int[Tensor, " entity"]
    patch_positions: Int[Tensor, " patched"]


def entity_metric(
    read_batch: Int[Tensor, " entity"],
    read_pos: Int[Tensor, " entity"],
    labels: Int[Tensor, " entity"],
    n_examples: int,
    per_example: bool = False,
    upcast: bool = True,
) -> Callable[[Tensor], Tensor]:
    """A patching metric: logits ``[batch, pos, vocab]`` -> mean entity log-prob (a 0-d tensor, or ``[batch]``).

    The value is UDS's score of a run (the per-example mean of the entity tokens' log-probs), averaged over the
    examples of the batch unless ``per_example``. It returns a tensor, not a float, so it works as the
    ``patching_metric`` of ``transformer_lens.patching.get_act_patch_*`` and inside ``run_with_hooks`` code.
    """

    def metric(logits: Float[Tensor, "batch pos vocab"]) -> Tensor:
        device = logits.device
        rows = read_batch.to(device)
        picked = logits[rows, read_pos.to(device)]
        scores = mean_entity_logprob(picked, labels.to(device), rows, n_examples, upcast)
        return scores if per_example else scores.mean()

    return metric


# ----------------------------------------------------------------------------------------------------------------
# Runs


def _source_cache(
    source: TLModel,
    tokens: Tensor,
    names: set[str],
    use_attn_result: bool = False,
    device: str | torch.device | None = None,
) -> dict[str, Tensor]:
    """Activations of ``source`` at ``names`` (one forward, no gradients), on ``device`` (the target's)."""
    with attn_result(source, use_attn_result), torch.no_grad():
        _, cache = source.run_with_cache(
            tokens.to(source.cfg.device), names_filter=lambda name: name in names
        )
    return {name: cache[name].to(device or tokens.device) for name in names}


def _token_logprobs(logits: Tensor, batch: PatchBatch, upcast: bool) -> Float[Tensor, " entity"]:
    return label_logprobs(logits[batch.read_batch, batch.read_pos], batch.read_label, upcast)


def _per_example_mean(values: Float[Tensor, " entity"], batch: PatchBatch) -> Float[Tensor, " batch"]:
    return segment_mean(values, batch.read_batch, batch.size)


def _token_grid(
    values: Float[Tensor, " entity"], batch: PatchBatch, width: int
) -> Float[Tensor, "batch token"]:
    """Scatter per-token values into ``[batch, token]`` (NaN past an example's last entity token)."""
    first = torch.full((batch.size,), 1 << 30, device=values.device).scatter_reduce(
        0, batch.read_batch, batch.read_pos, reduce="amin"
    )
    offset = batch.read_pos - first[batch.read_batch]
    grid = torch.full((batch.size, width), math.nan, device=values.device)
    grid[batch.read_batch, offset] = values
    return grid


def _run(full: TLModel, tokens: Tensor, hooks: list[tuple[str, Callable]]) -> Tensor:
    expanded = [pair for name, fn in hooks for pair in residual_patch_hooks(full, name, fn)]
    with torch.no_grad():
        return full.run_with_hooks(tokens, fwd_hooks=expanded)


def _overwrite(source: Tensor, mask: Bool[Tensor, "batch pos"], head: int | None) -> Callable:
    """A TransformerLens hook writing ``source`` at ``mask`` positions (one head's slice when ``head`` is given)."""

    def hook(activation: Tensor, hook: HookPoint) -> Tensor:
        patched = activation.clone()
        if head is None:
            patched[mask] = source[mask].to(activation.dtype)
        else:
            patched[:, :, head][mask] = source[:, :, head][mask].to(activation.dtype)
        return patched

    return hook


def _all_positions(batch: PatchBatch) -> Bool[Tensor, "batch pos"]:
    return torch.ones_like(batch.patch_mask)


def _resolve_hook(hook: str) -> str:
    """``"z"`` / ``"result"`` -> ``attn.hook_z`` / ``attn.hook_result``; a site name -> ``hook_{site}``."""
    if hook in HEAD_HOOKS:
        return HEAD_HOOKS[hook]
    if hook in SITES:
        return f"hook_{hook}"
    return hook.split(".", 2)[-1] if hook.startswith("blocks.") else hook


def _check_hook(full: TLModel, point: str, layers: Sequence[int]) -> None:
    missing = [
        f"blocks.{layer}.{point}" for layer in layers if f"blocks.{layer}.{point}" not in full.hook_dict
    ]
    if missing:
        known = sorted({name.split(".", 2)[-1] for name in full.hook_dict if name.startswith("blocks.0.")})
        raise ValueError(
            f"The full model has no hook point {missing[0]!r}; hook names inside a block are {known} "
            f"(or a UDS site: {SITES})."
        )


@dataclass
class _StageScores:
    s0: Tensor
    baseline: Tensor
    scores: Tensor
    valid: Tensor
    labels: list[list[str]]


class _Runner:
    """Batches of an auditor's encoded examples (in the order asked for) and the per-batch runs of one patching
    experiment, run by ``planning.run_batches``: a batch that runs out of memory is halved and retried, as the
    auditor's are, and the halves are kept for the next stage."""

    def __init__(self, auditor: PatchContext, idxs: Sequence[int] | None, batch_size: int | None) -> None:
        self.auditor = auditor
        self.full: TLModel = auditor.full
        self.encoded: list[EncodedExample] = auditor.select(idxs)
        size = batch_size or auditor.config.batch_size or 8
        self.batches = consecutive_batches(len(self.encoded), size)
        self.spec = auditor.config.engine_spec(tuple(auditor.layers))
        self.upcast = self.spec.upcast
        self.scope = auditor.config.patch_scope
        self.device = self.full.cfg.device or "cpu"  # where the full model computes (a model sets it)

    def batch(self, members: list[int], cut: bool = True) -> PatchBatch:
        chunk = [self.encoded[i] for i in members]
        return pad_batch(chunk, self.auditor.pad_id, self.scope, cut=cut).to(self.device)

    def run(self, work: Callable[[PatchBatch], None], desc: str, progress: bool) -> None:
        """``work(batch)`` for every batch, in order (``work`` keeps its results only once a batch is done)."""
        run_batches(self.batches, lambda _, members: work(self.batch(members)), self.device, desc, progress)


def _heads_fast(
    runner: _Runner, source: TLModel, hook: str, layers: list[int], progress: bool, stage: str
) -> _StageScores:
    full = runner.full
    n_heads = full.cfg.n_heads
    spec = EngineSpec(site="attn_out", layers=tuple(layers), published_compat=runner.spec.published_compat)
    engine = FastEngine(spec)
    # The head outputs add up to the attention's output (``attn.hook_out``); where the family normalises that
    # before adding it to the residual (Gemma, OLMo 2), the patched ``attn_out`` is the norm of the patched sum.
    family = family_of(wrapped_model(full).config)
    post_norm = family is not None and family.norm != "pre"

    def out_name(layer: int) -> str:
        return f"blocks.{layer}.attn.hook_out" if post_norm else hook_name("attn_out", layer)

    s0_parts, base_parts, score_parts = [], [], []

    def one_batch(batch: PatchBatch) -> None:
        clean = engine.clean_run(full, batch)
        z_names = {f"blocks.{layer}.attn.hook_z" for layer in layers}
        full_cache = _source_cache(full, batch.tokens, z_names | {out_name(layer) for layer in layers})
        source_cache = _source_cache(source, batch.tokens, z_names)
        base = engine.baseline_scores(full, batch, clean)
        per_head = []
        for head in range(n_heads):
            acts = []
            for layer in layers:
                z_full = full_cache[f"blocks.{layer}.attn.hook_z"][:, :, head]
                z_source = source_cache[f"blocks.{layer}.attn.hook_z"][:, :, head].to(z_full.dtype)
                w_full = full.blocks[layer].attn.W_O[head]
                w_source = (
                    w_full if hook == HEAD_HOOKS["z"] else source.blocks[layer].attn.W_O[head].to(w_full)
                )
                change = einops.einsum(
                    z_source, w_source, "batch pos d_head, d_head d_model -> batch pos d_model"
                ) - einops.einsum(z_full, w_full, "batch pos d_head, d_head d_model -> batch pos d_model")
                patched = full_cache[out_name(layer)] + change
                acts.append(attention_output_norm(full, layer, patched) if post_norm else patched)
            per_head.append(engine.patched_scores(full, batch, torch.stack(acts), clean))
        s0_parts.append(clean.scores.float().cpu())
        base_parts.append(base.float().cpu()[:, :, None].expand(-1, -1, n_heads))
        score_parts.append(torch.stack(per_head, dim=-1).float().cpu())

    runner.run(one_batch, f"{stage}: heads (fast)", progress)
    valid = torch.ones(len(runner.encoded), n_heads, dtype=torch.bool)
    return _StageScores(
        torch.cat(s0_parts),
        torch.cat(base_parts),
        torch.cat(score_parts),
        valid,
        [[str(h) for h in range(n_heads)] for _ in runner.encoded],
    )


def _components_naive(
    runner: _Runner,
    source: TLModel,
    hook: str,
    layers: list[int],
    axis: str,
    positions: str,
    progress: bool,
    stage: str,
) -> _StageScores:
    """One ``run_with_hooks`` per (batch, layer, component); see the module docstring for the three axes."""
    full = runner.full
    n_heads = full.cfg.n_heads
    if axis == "head":
        width = n_heads
    elif axis == "token":
        width = max(e.n_entity_tokens for e in runner.encoded)
    else:
        width = max(len(e.patch_positions(runner.scope)) for e in runner.encoded)
    names = {f"blocks.{layer}.{hook}" for layer in layers}
    use_result = hook == HEAD_HOOKS["result"]
    s0_parts, base_parts, score_parts, valid_parts = [], [], [], []

    def one_batch(batch: PatchBatch) -> None:
        cache = _source_cache(source, batch.tokens, names, use_result)
        if runner.spec.published_compat:
            # as UDS in compat mode (SPEC 1.5): the source's final-norm output is what the last layer receives
            compat = as_source(source)
            cache = {name: compat.published_compat_activation(name, acts) for name, acts in cache.items()}
        mask = _all_positions(batch) if positions == "all" else batch.patch_mask
        clean_tokens = _token_logprobs(_run(full, batch.tokens, []), batch, runner.upcast)
        s0 = _per_example_mean(clean_tokens, batch)
        scores = torch.full((batch.size, len(layers), width), math.nan, device=runner.device)
        for position, layer in enumerate(layers):
            name = f"blocks.{layer}.{hook}"
            if axis == "head":
                for head in range(width):
                    logits = _run(full, batch.tokens, [(name, _overwrite(cache[name], mask, head))])
                    scores[:, position, head] = _per_example_mean(
                        _token_logprobs(logits, batch, runner.upcast), batch
                    )
            elif axis == "token":
                logits = _run(full, batch.tokens, [(name, _overwrite(cache[name], mask, None))])
                scores[:, position] = _token_grid(_token_logprobs(logits, batch, runner.upcast), batch, width)
            else:
                for offset in range(width):
                    single = _nth_patched(batch, runner.scope, offset)
                    if not single.any():
                        continue
                    logits = _run(full, batch.tokens, [(name, _overwrite(cache[name], single, None))])
                    rows = single.any(-1)
                    means = _per_example_mean(_token_logprobs(logits, batch, runner.upcast), batch)
                    scores[rows, position, offset] = means[rows]
        if axis == "token":
            base = _token_grid(clean_tokens, batch, width)[:, None, :].expand(-1, len(layers), -1)
        else:
            base = s0[:, None, None].expand(-1, len(layers), width)
        s0_parts.append(s0.float().cpu())
        base_parts.append(base.float().cpu())
        score_parts.append(scores.float().cpu())
        valid_parts.append(~torch.isnan(scores.float().cpu()).all(1))

    with attn_result(full, use_result):
        runner.run(one_batch, f"{stage}: {axis}s (naive)", progress)
    return _StageScores(
        torch.cat(s0_parts),
        torch.cat(base_parts),
        torch.cat(score_parts),
        torch.cat(valid_parts),
        _labels(runner, axis, width),
    )


def _nth_patched(batch: PatchBatch, scope: Scope, offset: int) -> Bool[Tensor, "batch pos"]:
    """Mask of each example's ``offset``-th patched position (empty for examples with fewer)."""
    mask = torch.zeros_like(batch.patch_mask)
    for row, example in enumerate(batch.examples):
        patched = example.patch_positions(scope)
        if offset < len(patched):
            mask[row, patched[offset]] = True
    return mask


def _labels(runner: _Runner, axis: str, width: int) -> list[list[str]]:
    if axis == "head":
        return [[str(h) for h in range(width)] for _ in runner.encoded]
    tokenizer = runner.auditor.tokenizer
    out = []
    for example in runner.encoded:
        if axis == "token":
            ids = list(example.labels)
        else:
            ids = [example.input_ids[p] for p in example.patch_positions(runner.scope)]
        names = [str(tokenizer.decode([token])) for token in ids]
        out.append(names + [""] * (width - len(names)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# The public calls


def _hooked_source(auditor: PatchContext, source: ModelLike) -> TLModel:
    """The source as a TransformerLens model: heads and ``hook_z`` are TransformerLens names, so a Hugging Face source
    is converted (an NF4 one from a dequantised copy) into the full model's dtype and device."""
    full = auditor.full.cfg
    return as_source(source).hooked(dtype=full.dtype, device=str(full.device))


def _stage_scores(
    auditor: PatchContext,
    source: ModelLike,
    role: str,
    key: tuple,
    compute: Callable[[TLModel, str], _StageScores],
    stage: str,
) -> _StageScores:
    """S1 is shared by every unlearned model of one auditor: kept on the auditor under ``key``. ``stage`` labels
    the progress bar (``S1 (retain)``, ``S2 (npo)``)."""
    store = auditor.component_cache if role == "retain" else None
    if store is not None and key in store:
        return store[key]
    scores = compute(_hooked_source(auditor, source), stage)
    if store is not None:
        store[key] = scores
    return scores


def _result(
    auditor: PatchContext,
    unlearned: object,
    name: str | None,
    hook: str,
    axis: Axis,
    layers: Sequence[int],
    idxs: Sequence[int] | None,
    compute: Callable[[TLModel, str], _StageScores],
    engine: Engine,
    key: tuple,
    tau: float,
) -> ComponentResult:
    if auditor.retain is None:
        raise ValueError("Component-level UDS needs a retain model (d1); this auditor was built without one.")
    source = auditor.load_source(unlearned)
    name = name or Checkpoint.resolve(unlearned).name
    stage1 = _stage_scores(auditor, auditor.retain, "retain", key, compute, "S1 (retain)")
    stage2 = _stage_scores(auditor, source, "unlearned", key, compute, f"S2 ({name})")
    return ComponentResult(
        name=name,
        hook=hook,
        axis=axis,
        idx=[e.idx for e in auditor.select(idxs)],
        layers=list(layers),
        s0=stage1.s0,
        baseline=stage1.baseline,
        s1=stage1.scores,
        s2=stage2.scores,
        valid=stage1.valid & stage2.valid,
        labels=stage1.labels,
        tau=tau,
        engine=engine,
    )


def patch_heads(
    auditor: PatchContext,
    unlearned: object,
    hook: str = "z",
    layers: Sequence[int] | None = None,
    idxs: Sequence[int] | None = None,
    positions: Positions = "patched",
    engine: EngineChoice = "auto",
    name: str | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
    tau: float = HEAD_TAU,
) -> ComponentResult:
    """Head-level UDS: patch one attention head at a time, for retain (S1) and the unlearned model (S2).

    Example:
        >>> heads = patch_heads(auditor, "zoo:npo")           # or auditor.patch_heads("zoo:npo")
        >>> heads.d1.shape                                     # [example, layer, head]
        >>> heads.component_uds                                # [layer, head]: did unlearning remove it there?
        >>> heads.frame().head()                               # long: idx, layer, head, ..., d1, d2, ke, ler

    Args:
        auditor: a ``UDSAuditor`` (full, retain, forget set and settings), or anything that is a
            :class:`PatchContext`.
        unlearned: the S2 source (path, zoo name, or a loaded model).
        hook: ``"z"`` (``attn.hook_z``: the head's value-weighted mix, through full's ``W_O``) or ``"result"``
            (``attn.hook_result``: the head's output through the source's own ``W_O``).
        layers: layers to patch (default the auditor's).
        idxs: dataset ``idx`` of the examples (default all scored examples).
        positions: ``"patched"`` (the auditor's patch scope, as UDS) or ``"all"`` (every position, as
            TransformerLens's ``get_act_patch_attn_head_out_all_pos``; naive engine).
        engine: ``"fast"`` (exact for both hooks at the patched positions), ``"naive"`` (one forward per layer and
            head) or ``"auto"`` (fast where it applies).
        name: result name (default from the model).
        batch_size: examples per batch (default the auditor's, else 8).
        progress: tqdm bars (default the auditor's setting).
        tau: the heads' KE threshold in nats (default :data:`~uds_lens.component_result.HEAD_TAU`, 0.01: a head's
            delta is a small part of its layer's, so the residual stream's 0.05 would leave almost no cell).

    Returns:
        A :class:`ComponentResult` with ``axis="head"``: tensors ``[example, layer, head]``.
    """
    if hook not in HEAD_HOOKS:
        raise ValueError(f"hook must be one of {sorted(HEAD_HOOKS)} (per-head hook points), got {hook!r}.")
    if positions not in ("patched", "all"):
        raise ValueError(f"positions must be 'patched' or 'all', got {positions!r}.")
    if engine not in ("auto", "fast", "naive"):
        raise ValueError(f"engine must be 'auto', 'fast' or 'naive', got {engine!r}.")
    if engine == "fast" and positions == "all":
        raise ValueError(
            "The fast engine recomputes only the patched window; positions='all' needs engine='naive'."
        )
    chosen: Engine = "naive" if engine == "naive" or positions == "all" else "fast"
    refusal = engine_class(chosen).refusal(auditor.full)
    if refusal is not None:
        logger.warning("patch_heads runs the naive engine: %s.", refusal)
        chosen = "naive"
    layers = list(layers) if layers is not None else list(auditor.layers)
    progress = auditor.progress if progress is None else progress
    runner = _Runner(auditor, idxs, batch_size)
    point = HEAD_HOOKS[hook]

    def fast(source: TLModel, stage: str) -> _StageScores:
        return _heads_fast(runner, source, point, layers, progress, stage)

    def naive(source: TLModel, stage: str) -> _StageScores:
        return _components_naive(runner, source, point, layers, "head", positions, progress, stage)

    compute = {"fast": fast, "naive": naive}[chosen]

    key = ("head", point, tuple(layers), tuple(e.idx for e in runner.encoded), positions, chosen)
    return _result(auditor, unlearned, name, point, "head", layers, idxs, compute, chosen, key, tau)


def _patch_each(
    auditor: PatchContext,
    unlearned: object,
    axis: Axis,
    site: str | None,
    layers: Sequence[int] | None,
    idxs: Sequence[int] | None,
    name: str | None,
    batch_size: int | None,
    progress: bool | None,
) -> ComponentResult:
    """The naive hooked runs behind :func:`patch_tokens` (``axis="token"``) and :func:`patch_positions`."""
    site = site or auditor.config.site
    layers = list(layers) if layers is not None else list(auditor.layers)
    progress = auditor.progress if progress is None else progress
    runner = _Runner(auditor, idxs, batch_size)
    point = _resolve_hook(site)
    _check_hook(auditor.full, point, layers)

    def compute(source: TLModel, stage: str) -> _StageScores:
        return _components_naive(runner, source, point, layers, axis, "patched", progress, stage)

    key = (axis, point, tuple(layers), tuple(e.idx for e in runner.encoded))
    tau = (
        auditor.config.tau
    )  # a token's (a position's) delta is on the span's scale: the residual stream's tau
    return _result(auditor, unlearned, name, point, axis, layers, idxs, compute, "naive", key, tau)


def patch_tokens(
    auditor: PatchContext,
    unlearned: object,
    site: str | None = None,
    layers: Sequence[int] | None = None,
    idxs: Sequence[int] | None = None,
    name: str | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
) -> ComponentResult:
    """Position-resolved UDS: the span patch of UDS, with every entity token's log-prob kept.

    ``result.d1[i, l, t]`` is how much of entity token ``t``'s log-prob the retain patch at layer ``l`` removes;
    averaged over an example's tokens it is that example's span ``d1`` (the naive engine's, whose baseline is S0).
    The other arguments are :func:`patch_heads`'s.

    Args:
        site: a UDS site (``resid_post`` ...) or any hook name inside ``blocks.{l}`` (default the auditor's site).

    Returns:
        A :class:`ComponentResult` with ``axis="token"``: tensors ``[example, layer, token]``; ``labels`` hold the
        token strings.
    """
    return _patch_each(auditor, unlearned, "token", site, layers, idxs, name, batch_size, progress)


def patch_positions(
    auditor: PatchContext,
    unlearned: object,
    site: str | None = None,
    layers: Sequence[int] | None = None,
    idxs: Sequence[int] | None = None,
    name: str | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
) -> ComponentResult:
    """Position-level patching: each patched position patched alone, the span's mean entity log-prob read.

    The other arguments are :func:`patch_heads`'s.

    Args:
        site: a UDS site or any hook name inside ``blocks.{l}`` (default the auditor's site).

    Returns:
        A :class:`ComponentResult` with ``axis="position"``: ``[example, layer, position]``, position ``p`` being
        the example's ``p``-th patched position (``labels`` hold the token at it).
    """
    return _patch_each(auditor, unlearned, "position", site, layers, idxs, name, batch_size, progress)


__all__ = [
    "AXES",
    "ExampleInputs",
    "HEAD_HOOKS",
    "PatchContext",
    "entity_metric",
    "patch_heads",
    "patch_positions",
    "patch_tokens",
]

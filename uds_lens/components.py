"""Head- and position-level patching: UDS at the granularity TransformerLens users work at.

UDS (``auditor.py`` running ``patching.engines``) patches one hook site per layer (a residual or block output). Here
the same patch is resolved further, with the same stages and the same definitions (``d1 = baseline - s1``,
``d2 = baseline - s2`` with the unpatched score as baseline, KE cells ``d1 > tau``, ``LER = clip(d2 / d1, 0, 1)`` on
KE cells and NaN elsewhere, ``UDS = sum_KE d1 * LER / sum_KE d1``; [`ComponentResult`][uds_lens.component_result.ComponentResult] computes them through
``uds.py``), reading only what [`PatchContext`][uds_lens.components.PatchContext] names of the auditor:

* **per head** ([`patch_heads`][uds_lens.components.patch_heads]): the source's ``blocks.{l}.attn.hook_z`` (or ``hook_result``) of one head
  ``h`` is written into the full model at the patched positions; scores ``[example, layer, head]``. Head-level UDS
  answers *which heads carry the forgotten fact, and did unlearning remove it there*;
* **per entity token** ([`patch_tokens`][uds_lens.components.patch_tokens]): the usual span patch at one site, but the log-prob of every entity
  token is kept instead of their mean, ``[example, layer, token]``, so one sees which token of "Nikolai Abilov"
  is still recoverable. The mean over an example's tokens is exactly the span score;
* **per patched position** ([`patch_positions`][uds_lens.components.patch_positions]): each patched position is patched alone, the span mean read
  as usual, ``[example, layer, position]`` (TransformerLens's ``get_act_patch_resid_pre`` layout, restricted to
  the positions UDS patches).

Each axis is one row of ``patching.axes.AXIS_PATCHES`` (its width, the runs of one layer, where a run writes, the
setter, the read, the labels), and an engine runs it: ``patching.engines.axis_engine`` chooses the engine of a row
(the fast one for head patching at the patched positions, where the model allows; the naive one, one
``run_with_hooks`` per (layer, component), for the rest) and its ``axis_scores`` computes one batch. This module
batches the examples, keeps S1 for the next unlearned model and builds the result. The naive engine's baseline is
the clean score S0; the fast engine's is its own unpatched recomputation, as in UDS.

Sources are run as TransformerLens models (bridges) here (a head is a TransformerLens notion): ``auditor.load_source``
loads a path or zoo name as one, and a Hugging Face source is converted (``sources.ActivationSource.hooked``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.component_result import HEAD_TAU, ComponentResult
from uds_lens.config import SITES, Engine, UDSConfig
from uds_lens.data import EncodedExample
from uds_lens.patching.axes import AXIS_PATCHES, HEAD_HOOKS, Axis, AxisPatch, AxisScores, Positions
from uds_lens.patching.batch import PatchBatch, pad_batch
from uds_lens.patching.engines import axis_engine
from uds_lens.patching.planning import consecutive_batches, run_batches
from uds_lens.readout import mean_entity_logprob
from uds_lens.sources import as_source
from uds_lens.tl_compat import ModelLike, TLModel, check_unhooked

EngineChoice: TypeAlias = Literal["auto", "fast", "naive"]
"""The engine asked of head patching: ``auto`` runs the fast one where it applies."""


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
        question: the record's question.
        entity: the span UDS scores.
        prompt: the prompt string.
        reference: the answer string after the prompt (``prompt + reference`` is what the tokens encode).
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
    """One component-patching experiment: an auditor's encoded examples (in the order asked for), the axis row it
    patches along, at hook point ``point`` of ``layers``, and the engine that runs it. Batches are run by
    ``planning.run_batches``: a batch that runs out of memory is halved and retried, as the auditor's are, and the
    halves are kept for the next stage."""

    def __init__(
        self,
        auditor: PatchContext,
        idxs: Sequence[int] | None,
        batch_size: int | None,
        patch: AxisPatch,
        point: str,
        layers: Sequence[int] | None,
        engine: Engine,
        strict: bool = False,
    ) -> None:
        self.auditor = auditor
        self.full: TLModel = auditor.full
        self.encoded: list[EncodedExample] = auditor.select(idxs)
        size = batch_size or auditor.config.batch_size or 8
        self.batches = consecutive_batches(len(self.encoded), size)
        self.scope = auditor.config.patch_scope
        self.device = self.full.cfg.device or "cpu"  # where the full model computes (a model sets it)
        self.patch = patch
        self.point = point
        self.layers = list(layers) if layers is not None else list(auditor.layers)
        spec = dataclasses.replace(auditor.config.engine_spec(tuple(self.layers)), engine=engine)
        self.engine = axis_engine(spec, patch, self.full, strict)
        self.width = patch.width(self.full, self.encoded, self.scope)

    @property
    def key(self) -> tuple:
        """What S1's scores depend on beyond the auditor (the key of its ``component_cache``)."""
        idxs = tuple(e.idx for e in self.encoded)
        return (self.patch.axis, self.point, tuple(self.layers), idxs, self.patch.positions, self.engine.name)

    def batch(self, members: list[int]) -> PatchBatch:
        chunk = [self.encoded[i] for i in members]
        return pad_batch(chunk, self.auditor.pad_id, self.scope).to(self.device)

    def stage(self, source: TLModel, stage: str, progress: bool) -> _StageScores:
        """One stage's scores: ``engine.axis_scores`` on every batch, in order (a batch's scores are kept only once
        it is done). ``stage`` labels the progress bar (``S1 (retain)``, ``S2 (npo)``)."""
        parts: list[AxisScores] = []

        def one_batch(_: int, members: list[int]) -> None:
            batch = self.batch(members)
            parts.append(
                self.engine.axis_scores(self.full, source, batch, self.patch, self.point, self.width).cpu()
            )

        desc = f"{stage}: {self.patch.axis}s ({self.engine.name})"
        run_batches(self.batches, one_batch, self.device, desc, progress)
        scores = torch.cat([part.scores for part in parts])
        tokenizer = self.auditor.tokenizer
        return _StageScores(
            torch.cat([part.s0 for part in parts]),
            torch.cat([part.baseline for part in parts]),
            scores,
            ~torch.isnan(scores).all(1),
            [self.patch.labels(example, tokenizer, self.scope, self.width) for example in self.encoded],
        )


# ----------------------------------------------------------------------------------------------------------------
# The public calls


def _hooked_source(auditor: PatchContext, source: ModelLike, role: str) -> TLModel:
    """The source as a TransformerLens model: heads and ``hook_z`` are TransformerLens names, so a Hugging Face source
    is converted (an NF4 one from a dequantised copy) into the full model's dtype and device. Refused when it or the
    full model carries hooks of its own: such a hook would change every score."""
    full = auditor.full.cfg
    hooked = as_source(source).hooked(dtype=full.dtype, device=str(full.device))
    check_unhooked(auditor.full, "full")
    check_unhooked(hooked, role)
    return hooked


def _stage1(auditor: PatchContext, retain: TLModel, runner: _Runner, progress: bool) -> _StageScores:
    """S1 of ``runner``'s experiment, shared by every unlearned model of one auditor: kept on the auditor under the
    runner's key."""
    store = auditor.component_cache
    if runner.key not in store:
        store[runner.key] = runner.stage(_hooked_source(auditor, retain, "retain"), "S1 (retain)", progress)
    return store[runner.key]


def _result(
    auditor: PatchContext,
    runner: _Runner,
    unlearned: object,
    name: str | None,
    progress: bool | None,
    tau: float,
) -> ComponentResult:
    retain = auditor.retain
    if retain is None:
        raise ValueError("Component-level UDS needs a retain model (d1); this auditor was built without one.")
    source = auditor.load_source(unlearned)
    name = name or Checkpoint.resolve(unlearned).name
    progress = auditor.progress if progress is None else progress
    stage1 = _stage1(auditor, retain, runner, progress)
    stage2 = runner.stage(_hooked_source(auditor, source, "unlearned"), f"S2 ({name})", progress)
    return ComponentResult(
        name=name,
        hook=runner.point,
        axis=runner.patch.axis,
        idx=[e.idx for e in runner.encoded],
        layers=runner.layers,
        s0=stage1.s0,
        baseline=stage1.baseline,
        s1=stage1.scores,
        s2=stage2.scores,
        valid=stage1.valid & stage2.valid,
        labels=stage1.labels,
        tau=tau,
        engine=runner.engine.name,
        layer_tau=auditor.config.tau,
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

    Examples:
        >>> heads = patch_heads(auditor, "zoo:npo")           # or auditor.patch_heads("zoo:npo")
        >>> heads.d1.shape                                     # [example, layer, head]
        >>> heads.component_uds                                # [layer, head]: did unlearning remove it there?
        >>> heads.frame().head()                               # long: idx, layer, head, ..., d1, d2, ke, ler

    Args:
        auditor: a ``UDSAuditor`` (full, retain, forget set and settings), or anything that is a
            [`PatchContext`][uds_lens.components.PatchContext].
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
        tau: the heads' KE threshold in nats (default [`HEAD_TAU`][uds_lens.component_result.HEAD_TAU], 0.01: a head's
            delta is a small part of its layer's, so the residual stream's 0.05 would leave almost no cell).

    Returns:
        A [`ComponentResult`][uds_lens.component_result.ComponentResult] with ``axis="head"``: tensors ``[example, layer, head]``.
    """
    if hook not in HEAD_HOOKS:
        raise ValueError(f"hook must be one of {sorted(HEAD_HOOKS)} (per-head hook points), got {hook!r}.")
    if positions not in ("patched", "all"):
        raise ValueError(f"positions must be 'patched' or 'all', got {positions!r}.")
    if engine not in ("auto", "fast", "naive"):
        raise ValueError(f"engine must be 'auto', 'fast' or 'naive', got {engine!r}.")
    patch = AXIS_PATCHES["head"]
    if positions == "all":
        patch = patch.at_every_position()
    # "auto" is the fast engine where the row and the model allow it; "fast" asked by name refuses a naive-only row
    runner = _Runner(
        auditor,
        idxs,
        batch_size,
        patch,
        HEAD_HOOKS[hook],
        layers,
        engine="naive" if engine == "naive" else "fast",
        strict=engine == "fast",
    )
    return _result(auditor, runner, unlearned, name, progress, tau)


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
    """The runs behind [`patch_tokens`][uds_lens.components.patch_tokens] (``axis="token"``) and [`patch_positions`][uds_lens.components.patch_positions]."""
    point = _resolve_hook(site or auditor.config.site)
    runner = _Runner(auditor, idxs, batch_size, AXIS_PATCHES[axis], point, layers, auditor.config.engine)
    _check_hook(auditor.full, point, runner.layers)
    # a token's (a position's) delta is on the span's scale: the residual stream's tau
    return _result(auditor, runner, unlearned, name, progress, auditor.config.tau)


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
    The other arguments are [`patch_heads`][uds_lens.components.patch_heads]'s.

    Args:
        site: a UDS site (``resid_post`` ...) or any hook name inside ``blocks.{l}`` (default the auditor's site).

    Returns:
        A [`ComponentResult`][uds_lens.component_result.ComponentResult] with ``axis="token"``: tensors ``[example, layer, token]``; ``labels`` hold the
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

    The other arguments are [`patch_heads`][uds_lens.components.patch_heads]'s.

    Args:
        site: a UDS site or any hook name inside ``blocks.{l}`` (default the auditor's site).

    Returns:
        A [`ComponentResult`][uds_lens.component_result.ComponentResult] with ``axis="position"``: ``[example, layer, position]``, position ``p`` being
        the example's ``p``-th patched position (``labels`` hold the token at it).
    """
    return _patch_each(auditor, unlearned, "position", site, layers, idxs, name, batch_size, progress)


__all__ = [
    "ExampleInputs",
    "PatchContext",
    "entity_metric",
    "patch_heads",
    "patch_positions",
    "patch_tokens",
]

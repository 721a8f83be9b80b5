"""The auditor: the UDS pipeline over real models, Stage 1 computed once.

``UDSAuditor(full, retain, data)`` loads the full (patch target) and retain models, encodes the forget set once, and
computes Stage 1 (retain -> full) once: S0, the per-layer baseline and S1 depend only on (full, retain, data,
settings), so they are cached on disk keyed by a fingerprint of all of those (``stage_cache.S1Cache``) and reused by
every unlearned model after that. ``auditor.score(unlearned)`` runs Stage 2 and returns a
[`UDSResult`][uds_lens.results.UDSResult]. An out-of-memory batch is halved and retried, a non-finite score is an error
(``failures``).

Around it: ``config`` (the settings), ``fingerprints`` (what a result depends on), ``scoring.score_models`` (many models,
reusing a saved result only when its full fingerprint matches). The score itself is ``uds.py``'s math; the patched
runs are ``patching``'s engines.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from uds_lens import display, memory
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ModelMismatchError
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import ModelArg, build_model, default_device
from uds_lens.component_result import ComponentResult
from uds_lens.components import ExampleInputs
from uds_lens.config import ConfigError, EngineSpec, UDSConfig
from uds_lens.data import DataArg, EncodedExample, check_ids_in_vocabulary, encode, fit_context
from uds_lens.failures import require_finite
from uds_lens.files import json_digest
from uds_lens.fingerprints import (
    inputs_fingerprint,
    layout_digest,
    library_versions,
    stage1_inputs_key,
    tokenizer_digest,
    with_unlearned,
)
from uds_lens.inputs import NOT_GIVEN, NotGiven, RunInputs
from uds_lens.memory import release_dropped, retry_out_of_memory
from uds_lens.patching.batch import PatchBatch, pad_batch
from uds_lens.patching.cells import stage2_record
from uds_lens.patching.engines import PatchEngine, engine_for
from uds_lens.patching.kernels import hold_joined_weights
from uds_lens.patching.planning import MemoryPlan, run_batches
from uds_lens.precision import PrecisionCheck
from uds_lens.results import UDSResult
from uds_lens.sources import as_source
from uds_lens.stage_cache import S1Cache, StageOne, stage_digest
from uds_lens.stages import StageRuns
from uds_lens.tl_compat import ActivationCache, ModelLike, TLModel, check_unhooked
from uds_lens.uds import ke_mask
from uds_lens.workbench import Workbench

logger = logging.getLogger(__name__)


class UDSAuditor:
    """Score any number of unlearned models against one (full, retain, forget set) with S1 computed once.

    Examples:
        >>> auditor = UDSAuditor("ckpt/full", "ckpt/retain", "forget.json")
        >>> result = auditor.score("ckpt/npo")
        >>> result.uds, result.examples.head(), result.layers.head()

    The arguments are made into the run's `inputs.RunInputs` first (every checkpoint made a `Checkpoint`, the forget
    set read, full and retain compared); a `RunInputs` made already may be passed as ``full`` instead
    (`UDSAuditor.from_inputs` takes one without resolving anything).

    Args:
        full: the patch target and baseline: a local checkpoint dir, ``.gguf``, hub id, ``zoo:NAME``, `Checkpoint`,
            or a loaded model; or the run's `RunInputs`.
        retain: the Stage-1 source (same forms), or None for retain-free mode.
        data: forget-set path / hub id / records / Examples.
        config: ``UDSConfig``.
        tokenizer: defaults to the full model's tokenizer (from its directory).
        cache_dir: S1 cache directory (default ``~/.cache/uds_lens``, or ``$UDS_LENS_CACHE``); ``False`` disables it.
        progress: tqdm progress bars over example batches.
        limit: score only the first ``limit`` examples.
        retain_name: how results name the retain model (default: its path); a sweep worker that adopts another
            worker's Stage 1 names the retain model it never loaded.
        data_name: how results name the forget set (default: its path, or ``<records>`` for data given as
            records); a sweep worker names the data file its examples were read from.

    Attributes:
        inputs: the run's `RunInputs` (the checkpoints, the examples, the settings).
        full / retain: the loaded TransformerLens models (``retain`` is None in retain-free mode).
        tokenizer / pad_id: the full model's fast tokenizer and the id that pads batches.
        config / device / layers / progress: the settings, the device, the patched layers, tqdm on or off.
        examples / encoded / skipped: the forget set (``Example``), the scorable examples' token layouts
            (``EncodedExample``: ``input_ids``, ``read_positions``, ``labels``, ``patch_positions(scope)``) and the
            ``Skip``s with their reasons.
        stage1: S0, each engine's per-layer baseline and S1 (``StageOne``), computed once and cached on disk.
        sources / last_source: models kept by [`load_source`][uds_lens.auditor.UDSAuditor.load_source] (by `Checkpoint`) and the model the last
            [`score`][uds_lens.auditor.UDSAuditor.score] loaded.
        component_cache: head/token/position-level S1 scores, kept for the next unlearned model.
        engine: the patching engine every stage runs (`patching.engines.engine_for`, chosen once).
        plan: what the run may hold beyond its models (`patching.planning.MemoryPlan`, from one measurement).
        runs: what each stage computes per batch (`stages.StageRuns`; in bf16/fp16 the precision check's,
            `precision.PrecisionCheck`).
        clean_cache_bytes: what the clean runs kept for the next stage may hold (set it to bound them; 0 keeps none);
            with the precision check on, half the clean-run share (its fp32 clean runs keep the other half).
        holds_joined: whether the fast engine keeps full's joined Q/K/V and gate/up copies between runs (the
            plan's: when memory allows; else a block's at a time, the same numbers).
        workbench: hooks of your own on this auditor's examples (`workbench.Workbench`).

    What it holds when: full for its whole life; the retain model through Stage 1 only and each unlearned model
    through its own Stage 2 only, when the auditor loaded them itself (a model passed as an object is the caller's
    and stays); full's joined weight copies where the plan grants them; a source's activations read ahead, block
    first, for the next batches of its stage.

    For hooks of your own (its `workbench.Workbench`): [`example`][uds_lens.workbench.Workbench.example] (one
    example's tensors), [`tokens`][uds_lens.workbench.Workbench.tokens],
    [`metric`][uds_lens.workbench.Workbench.metric] (a tensor-valued patching metric),
    [`run_with_cache`][uds_lens.workbench.Workbench.run_with_cache] (the clean run's activations); for finer
    patching: [`patch_heads`][uds_lens.workbench.Workbench.patch_heads],
    [`patch_tokens`][uds_lens.workbench.Workbench.patch_tokens],
    [`patch_positions`][uds_lens.workbench.Workbench.patch_positions] (``uds_lens.components``).
    """

    def __init__(
        self,
        full: ModelArg | RunInputs,
        retain: ModelArg | None | NotGiven = NOT_GIVEN,
        data: DataArg | NotGiven = NOT_GIVEN,
        config: UDSConfig | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        cache_dir: str | os.PathLike | bool | None = None,
        progress: bool = True,
        limit: int | None = None,
        retain_name: str | None = None,
        data_name: str | None = None,
    ) -> None:
        inputs = RunInputs.resolve(
            full,
            retain,
            data,
            config=config,
            tokenizer=tokenizer,
            cache_dir=cache_dir,
            limit=limit,
            data_name=data_name,
        )
        self._set_up(inputs, progress, retain_name)

    @classmethod
    def from_inputs(
        cls, inputs: RunInputs, progress: bool = True, retain_name: str | None = None
    ) -> UDSAuditor:
        """The auditor of a run's inputs made already (`RunInputs.resolve`: `scoring.score_models` and a sweep's
        workers build theirs so): nothing is resolved, read or compared again."""
        auditor = cls.__new__(cls)
        auditor._set_up(inputs, progress, retain_name)
        return auditor

    def _set_up(self, inputs: RunInputs, progress: bool, retain_name: str | None) -> None:
        """Load full and retain, encode the forget set, choose the engine and the batches (see the class)."""
        self.inputs = inputs
        self.config = inputs.config.with_stage2_cells("all")
        self.progress = progress
        self._base_fingerprint: dict[str, Any] | None = None
        self.device = self.config.device or default_device()
        self.sources: dict[Checkpoint, ModelLike] = {}
        # measured once before the models it loads: full's fit check reads it, retain's what full leaves of it
        loads = any(c is not None and c.model is None for c in (inputs.full, inputs.retain))
        free = memory.available_memory_bytes(self.device) if loads else None
        self.full = self._load_target(inputs.full, "full", free)
        self.full_name = inputs.full.label
        tokenizer = inputs.encoding_tokenizer
        self.tokenizer = tokenizer
        if tokenizer.vocab_size > self.full.cfg.d_vocab:
            raise ModelMismatchError(
                f"The tokenizer has {tokenizer.vocab_size} tokens but the full model's vocabulary is "
                f"{self.full.cfg.d_vocab}: they do not belong together. Load the tokenizer from the full model's directory."
            )
        # one family, one tokenizer, one shape: compared once, where the inputs were made (inputs.RunInputs)
        if free is not None and inputs.full.model is None:
            free = max(0, free - sum(t.numel() * t.element_size() for t in self.full.parameters()))
        self._retain = self._load_target(inputs.retain, "retain", free) if inputs.retain is not None else None
        self._retain_dropped = False
        # what Stage 1 is computed from: the digests of the bytes full's and retain's loads read (or their tensors')
        self.identities = {"full": inputs.full.loaded_fingerprint(self.full)}
        if inputs.retain is not None:
            self.identities["retain"] = inputs.retain.loaded_fingerprint(self._retain)
            self._retain_weights = inputs.retain.weights_digest(self._retain)
        if retain_name is None and inputs.retain is not None:
            retain_name = inputs.retain.label
        self.retain_name = retain_name
        self.examples = inputs.examples
        self.data_name = inputs.data_name
        self.encoded, self.skipped = encode(self.examples, tokenizer, self.config.published_compat)
        # an id past the embedding (tokens added to the tokenizer) would fail deep in the first forward
        check_ids_in_vocabulary(
            max((max(e.input_ids) for e in self.encoded), default=-1), self.full.cfg.d_vocab, "full"
        )
        # An example longer than a model's context would crash the whole run: cut it after its last read position,
        # or skip it with a counted reason.
        n_ctx = min(
            as_source(model).context_length for model in (self.full, self._retain) if model is not None
        )
        self.encoded, too_long = fit_context(self.encoded, n_ctx)
        self.skipped = self.skipped + too_long
        n_layers = self.full.cfg.n_layers
        self.layers = list(self.config.layers) if self.config.layers is not None else list(range(n_layers))
        bad = [layer for layer in self.layers if not 0 <= layer < n_layers]
        if bad:
            raise ConfigError(
                f"Layers {bad} do not exist: the full model has {n_layers} layers (0..{n_layers - 1})."
            )
        # chosen once: the engine named, or the naive one (the model's own forward) where it refuses the full model
        self.engine: PatchEngine = engine_for(self.engine_spec, self.full, self.full_name or "full")
        self.config = dataclasses.replace(self.config, engine=self.engine.name)
        # what the run may hold beyond its models (its room), from one measurement of the memory free now
        self.plan = MemoryPlan.measure(
            self.target_device, self.full, self.engine, self.encoded, self.config.patch_scope
        )
        hold_joined_weights(self.full, self.plan.holds_target_joins)
        self.cache = (
            None
            if inputs.cache_dir is False
            else S1Cache(inputs.cache_dir if inputs.cache_dir is not True else None)
        )
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # similar lengths together (less padding), as many as the plan's batch share fits; deterministic
        self._batches = self.plan.batches(
            self.full, self.encoded, self.config.patch_scope, self.engine.name, self.config.batch_size
        )
        # what each stage computes per batch: in bf16/fp16 checked where rounding could decide, in fp32 plain
        runs = StageRuns(
            self.engine,
            self.full,
            self.plan,
            self._batch,
            self._require_finite,
            self.full_name,
            lambda: self._batches,
        )
        self.runs = PrecisionCheck.for_run(runs, self.config)
        self._stage1: StageOne | None = None
        self.last_source: ModelLike | None = None
        self.component_cache: dict[tuple, Any] = {}
        self.workbench = Workbench(self)

    @property
    def retain(self) -> TLModel | None:
        """The retain model (Stage 1's source); None in retain-free mode and once dropped (`drop_retain`).

        It is held while Stage 1 is computed. Once Stage 1 is computed, read from the cache or adopted
        (`use_stage1`), a retain model this auditor loaded itself (from a path, hub id, ``zoo:`` name or
        `Checkpoint`) is released, so Stage 2 holds full and one unlearned model only; asking for it again here
        (component patching does) loads it again and holds it. A model given as an object is the caller's: the
        auditor cannot free it and keeps it.
        """
        checkpoint = self.inputs.retain
        if self._retain is None and not self._retain_dropped and checkpoint is not None:
            try:  # held to the bytes Stage 1 was computed from
                model = self._load_target(checkpoint, "retain")
                same = checkpoint.weights_digest(model) == self._retain_weights
                why = "" if same else "its files now hold other weights"
            except ModelLoadError as error:
                why = str(error)
            if why:
                raise ModelLoadError(
                    f"The retain model {checkpoint.label} no longer is what Stage 1 was computed from ({why}): restore "
                    "the files Stage 1 read, or compute Stage 1 again (a new UDSAuditor)."
                )
            self._retain = model
        return self._retain

    def drop_retain(self) -> None:
        """Let go of the retain model for good once Stage 1 is computed (computing it first if it is not yet).

        Stage 1 is all the retain model is needed for; results keep naming it (``retain_name``) and fingerprinting
        it (from the source it was given). Unlike the release after Stage 1 (`retain`), a dropped retain model is
        not loaded again: component patching (``patch_heads`` ...) then raises.
        """
        _ = self.stage1
        self._retain_dropped = True
        if self._retain is not None:
            dropped, self._retain = weakref.ref(self._retain), None
            release_dropped(dropped, self.device)

    def _release_retain(self) -> None:
        """Stage 1 is done: release a retain model this auditor loaded itself (never a model given as an object)."""
        checkpoint = self.inputs.retain
        callers = checkpoint is None or checkpoint.model is not None or checkpoint in self.sources
        if self._retain is None or callers:
            return  # none, or the caller's (given as an object, or kept by load_source)
        dropped, self._retain = weakref.ref(self._retain), None
        release_dropped(dropped, self.device)

    def load(self, model: object, role: str = "unlearned") -> ModelLike:
        """A model as this auditor runs it: a checkpoint loaded in its dtype and device, a loaded model as is; either
        compared with full first unless it is one of the inputs' (`RunInputs.admit`); anything else is refused by
        `Checkpoint.resolve`'s ``TypeError``, which names the forms a model may take."""
        return self._load(self.inputs.admit(model, role), role)

    def load_source(self, model: object, role: str = "unlearned") -> ModelLike:
        """Load a source model once and keep it: later ``score``/``patch_*`` calls with the same checkpoint reuse it.

        Args:
            model: a checkpoint directory, hub id, zoo name (``"zoo:npo"``), `Checkpoint`, or an already loaded
                model (returned as is).
            role: how error messages name it.

        Returns:
            The loaded model (also in ``auditor.sources[checkpoint]``).
        """
        checkpoint = self.inputs.admit(model, role)
        if checkpoint.model is None and checkpoint not in self.sources:
            self.sources[checkpoint] = self._load(checkpoint, role)
        return self._load(checkpoint, role)

    def _load_target(self, checkpoint: Checkpoint, role: str, free_bytes: int | None = None) -> TLModel:
        """The full or retain model as the engines patch into it and read it: a TransformerLens model (a Hugging
        Face model given in memory is wrapped as a bridge once, ``sources.as_source``)."""
        return as_source(self._load(checkpoint, role, free_bytes)).model

    def _load(self, checkpoint: Checkpoint, role: str, free_bytes: int | None = None) -> ModelLike:
        """The model of a checkpoint: kept (``sources``), in memory, or loaded (one read of its bytes; its fit
        checked against ``free_bytes``, the run's figure, where given, else the memory free now)."""
        if checkpoint in self.sources:
            return self.sources[checkpoint]
        return retry_out_of_memory(
            lambda: build_model(
                checkpoint, dtype=self.config.dtype, device=self.device, free_bytes=free_bytes
            ),
            self.device,
            f"loading the {role} model {checkpoint.label}",
        )

    @property
    def engine_spec(self) -> EngineSpec:
        """What the patching engines need of these settings, over the layers this auditor patches."""
        return self.config.engine_spec(tuple(self.layers))

    @property
    def upcast(self) -> bool:
        """Whether log-softmax runs in float32 (the engine spec's rule: everywhere but published-compat)."""
        return self.engine_spec.upcast

    @property
    def log_softmax_dtype(self) -> str:
        """The dtype entity log-probs are computed in: fp32 by default, the model's own dtype in
        published-compat mode (as the published code does); recorded in every result's metadata."""
        return "float32" if self.upcast else str(self.full.cfg.dtype).replace("torch.", "")

    @property
    def holds_joined(self) -> bool:
        """Whether full's joined Q/K/V and gate/up copies are held between runs (`plan`'s)."""
        return self.plan.holds_target_joins

    @property
    def clean_cache_bytes(self) -> int:
        """What the clean runs kept for the next stage may hold (``runs.clean``'s budget; settable)."""
        return self.runs.clean.budget

    @clean_cache_bytes.setter
    def clean_cache_bytes(self, budget: int) -> None:
        self.runs.clean.budget = budget

    def select(self, idxs: Sequence[int] | None = None) -> list[EncodedExample]:
        """The encoded examples with these dataset ``idx`` values, in that order (default all scored ones)."""
        if idxs is None:
            return list(self.encoded)
        by_idx = {e.idx: e for e in self.encoded}
        skipped = {s.idx: s.reason for s in self.skipped}
        out = []
        for idx in idxs:
            if idx in by_idx:
                out.append(by_idx[idx])
            elif idx in skipped:
                raise KeyError(
                    f"Example idx {idx} was skipped ({skipped[idx]}): it has no token layout to patch."
                )
            else:
                raise KeyError(
                    f"No example with idx {idx} in {self.data_name}; scored idx are "
                    f"{[e.idx for e in self.encoded][:20]}..."
                )
        return out

    # -- hooks of your own: the workbench's (`workbench.Workbench`) ----------------------------------------------

    def example(self, idx: int) -> ExampleInputs:
        """One example as tensors: [`Workbench.example`][uds_lens.workbench.Workbench.example]."""
        return self.workbench.example(idx)

    def tokens(self, idxs: int | Sequence[int]) -> Tensor:
        """Right-padded tokens: [`Workbench.tokens`][uds_lens.workbench.Workbench.tokens]."""
        return self.workbench.tokens(idxs)

    def metric(self, idxs: int | Sequence[int], per_example: bool = False) -> Callable[[Tensor], Tensor]:
        """A patching metric: [`Workbench.metric`][uds_lens.workbench.Workbench.metric]."""
        return self.workbench.metric(idxs, per_example)

    def run_with_cache(
        self,
        idxs: int | Sequence[int],
        model: ModelArg | None = None,
        names_filter: Callable[[str], bool] | Sequence[str] | str | None = None,
    ) -> tuple[Tensor, ActivationCache]:
        """A clean run's activations: [`Workbench.run_with_cache`][uds_lens.workbench.Workbench.run_with_cache]."""
        return self.workbench.run_with_cache(idxs, model, names_filter)

    def patch_heads(self, unlearned: object, **kwargs: Any) -> ComponentResult:
        """Head-level UDS: [`Workbench.patch_heads`][uds_lens.workbench.Workbench.patch_heads]."""
        return self.workbench.patch_heads(unlearned, **kwargs)

    def patch_tokens(self, unlearned: object, **kwargs: Any) -> ComponentResult:
        """Per-entity-token UDS: [`Workbench.patch_tokens`][uds_lens.workbench.Workbench.patch_tokens]."""
        return self.workbench.patch_tokens(unlearned, **kwargs)

    def patch_positions(self, unlearned: object, **kwargs: Any) -> ComponentResult:
        """One position at a time: [`Workbench.patch_positions`][uds_lens.workbench.Workbench.patch_positions]."""
        return self.workbench.patch_positions(unlearned, **kwargs)

    # -- batching ----------------------------------------------------------------------------------------------

    def _batch(self, members: list[int]) -> PatchBatch:
        return pad_batch(
            [self.encoded[i] for i in members],
            self.pad_id,
            self.config.patch_scope,
            cut=self.engine.cut,
        ).to(self.target_device)

    @property
    def target_device(self) -> str:
        """Where the full model computes (the auditor's device unless the model was given on another one)."""
        return self.full.cfg.device or self.device

    # -- Stage 1 -----------------------------------------------------------------------------------------------

    def fingerprint(self, unlearned: Checkpoint | None, identity: str | None = None) -> dict[str, Any]:
        """``result_fingerprint`` of this auditor's inputs and ``unlearned`` (None for the inputs' keys alone), plus
        ``s1``: the `stage_digest` of the Stage 1 every result of this auditor is computed from (so this computes
        Stage 1, or reads it from the cache, when it is not there yet).

        Full and retain are identified by the bytes their loads read; ``unlearned`` by ``identity`` when it is given
        (`score` passes the `Checkpoint.loaded_fingerprint` of the model it scored), else by its files as they are
        now (a reuse decision made before loading it, `Checkpoint.fingerprint`)."""
        if self._base_fingerprint is None or "s1" not in self._base_fingerprint:
            self._base_fingerprint = {
                **inputs_fingerprint(self.inputs, self.full, self.config, self.identities),
                "s1": stage_digest(self.stage1),
            }
        # a sweep worker that adopts Stage 1 never loads retain: whether there is a d1 is Stage 1's to say
        base, retain_free = self._base_fingerprint, self.stage1.s1 is None
        return with_unlearned(base, unlearned, self.config, retain_free=retain_free, identity=identity)

    def fingerprint_payload(self) -> dict[str, Any]:
        """What the S1 cache is keyed by: full's and retain's weights (the digest of the checkpoint bytes their
        loading read, or of the tensors of a model given in memory or fetched from the hub), the tokenizer, the
        token layout, the layers, the settings and the dtype."""
        settings = self.config.to_dict()
        # Stage 1 never reads the tolerance, nor (but in bf16/fp16) whether the precision check is on
        for volatile in ("tau", "batch_size", "device", "stage2_cells", "precision_tolerance"):
            settings.pop(volatile)
        for unread in self.runs.ignored_settings:
            settings.pop(unread)
        retain = self.inputs.retain
        # a local retain is identified by the bytes its load read; a hub or in-memory one by its tensors (a hub model
        # released after Stage 1 is loaded again to hash them; a dropped one is not)
        retain_model = None if retain is None or retain.local else self.retain
        return {
            "full": self.inputs.full.weights_digest(self.full),
            "retain": None
            if retain is None or (retain_model is None and not retain.local)
            else self._retain_weights
            if retain.local
            else retain.weights_digest(retain_model),
            "tokenizer": tokenizer_digest(self.tokenizer),
            "layout": layout_digest(self.encoded),
            "layers": self.layers,
            "settings": settings,
            "dtype": str(self.full.cfg.dtype),
        }

    @property
    def stage1(self) -> StageOne:
        """S0, each engine's per-layer baseline and S1 (retain patched in), from the cache when possible; the
        retain model is released then (`retain`)."""
        if self._stage1 is None:
            self._stage1 = self._compute_stage1()
            self._release_retain()
        return self._stage1

    def _compute_stage1(self) -> StageOne:
        payload = key = None
        if self.cache is not None:
            payload = self.fingerprint_payload()
            key = json_digest(payload)
            cached = self.cache.load(key, payload)
            if cached is not None and cached.idx == [e.idx for e in self.encoded]:
                logger.info("S1 cache hit: %s", self.cache.path(key))
                # The batch size is not part of the key (it follows free memory), so the plan S1 ran in is adopted:
                # S2 batches exactly as S1 did, and a source identical to full still gives deltas of exactly 0.
                self.use_stage1(cached, cached.batches)
                self._index_stage1(payload)
                return cached
        check_unhooked(self.full, "full")
        if self.retain is not None:
            check_unhooked(self.retain, "retain")
        started = time.perf_counter()
        run = self.runs.stage_one(self.retain, self.retain_name, (len(self.encoded), len(self.layers)))
        try:
            # out of memory, a batch is halved and retried (halves kept); its clean runs go, fewer are kept after
            device, split = self.target_device, self.runs.forget_clean_runs
            desc = "S1 (retain -> full)" if self.retain is not None else "S0 (full; retain-free)"
            run_batches(self._batches, run.batch, device, desc, self.progress, split)
        finally:
            run.close()
        stage = run.finish([e.idx for e in self.encoded], self.batches, time.perf_counter() - started)
        if self.cache is not None and key is not None and payload is not None:
            if self.cache.save(key, payload, stage) is not None:
                self._index_stage1(payload)
        return stage

    def _index_stage1(self, payload: dict[str, Any]) -> None:
        """Index the cache entry of ``payload`` by this auditor's inputs (`fingerprints.stage1_inputs_key`, with the
        identities of the bytes its loads read), beside the inputs' keys its results record: a rerun then finds its
        Stage 1 and decides reuse without loading a model (`scoring.score_models`)."""
        inputs_key = stage1_inputs_key(self.inputs, self.identities)
        if self.cache is not None and inputs_key is not None:
            fingerprint = inputs_fingerprint(self.inputs, self.full, self.config, self.identities)
            self.cache.save_index(inputs_key, payload, fingerprint)

    @property
    def batches(self) -> list[list[int]]:
        """The example batches (indices into ``encoded``) every stage runs in; a sweep ships them to its workers so
        that each worker pads and batches exactly like the auditor that computed Stage 1."""
        return [list(members) for members in self._batches]

    def use_stage1(
        self,
        stage: StageOne,
        batches: Sequence[Sequence[int]],
        inputs_fingerprint: dict[str, Any] | None = None,
    ) -> None:
        """Adopt a Stage 1 computed by another auditor on the same (full, retain, data, settings) instead of
        computing it here: a sweep computes S1 once and ships it, with its batches, to every worker.

        Args:
            stage: the other auditor's ``stage1``.
            batches: the other auditor's ``batches`` (so padding and batching, hence every number, are the same).
            inputs_fingerprint: the other auditor's ``fingerprint(None)``; the results of this auditor then record
                the retain model Stage 1 came from, although this auditor never loaded it.

        Raises:
            ValueError: the stage or the batches do not cover this auditor's encoded examples.
        """
        if stage.idx != [e.idx for e in self.encoded]:
            raise ValueError(
                "The Stage 1 handed over was computed on other examples than this auditor's encoded "
                "forget set; compute it with the same data, tokenizer and settings."
            )
        if sorted(i for members in batches for i in members) != list(range(len(self.encoded))):
            raise ValueError("The batches handed over do not cover every encoded example exactly once.")
        self._batches = [list(members) for members in batches]
        self.runs.forget_clean_runs(short_of_memory=False)
        self._stage1 = stage
        if self._base_fingerprint is not None:
            self._base_fingerprint.pop("s1", None)  # the digest of the Stage 1 just replaced
        if inputs_fingerprint is not None:
            self._base_fingerprint = {
                key: value for key, value in inputs_fingerprint.items() if key != "unlearned"
            }
        self._release_retain()  # Stage 1 is here: what the retain model was held for

    def _require_finite(
        self,
        values: Tensor,
        members: Sequence[int],
        model: ModelLike,
        role: str,
        label: str | None,
        what: str,
    ) -> None:
        """`require_finite` on a batch of this auditor's examples (``members``), checked per batch: fail early."""
        require_finite(values, [self.encoded[m] for m in members], self.layers, model, role, label, what)

    def d1(self) -> Float[Tensor, "example layer"] | None:
        """``d1 = baseline - s1`` of Stage 1, ``[example, layer]`` (fp32 where the precision check re-decided it);
        None in retain-free mode."""
        return self.stage1.decided_d1()

    # -- Stage 2 -----------------------------------------------------------------------------------------------

    def stage2_cells(self) -> Tensor | None:
        """The ``[example, layer]`` cells Stage 2 runs: the KE cells (``d1 > tau``, from Stage 1) with
        ``stage2_cells="ke"``, None (every cell) with ``"all"`` or in retain-free mode."""
        d1 = self.d1()
        if self.config.stage2_cells != "ke" or d1 is None:
            return None
        return torch.from_numpy(ke_mask(d1.numpy(), self.config.tau))

    def stage2_plan(self, cells: Tensor | None = None) -> dict[str, Any]:
        """What Stage 2 runs on ``cells`` (None: every cell), as results record it in ``meta["stage2"]``
        (``patching.cells.stage2_record``: the cells, the tau they were chosen with, the share of the work)."""
        window = [len(e.window(self.config.patch_scope)) for e in self.encoded]
        return stage2_record(
            window, self.layers, self.full.cfg.n_layers, self.config.site, cells, self.config.tau
        )

    def score(self, unlearned: ModelArg, name: str | None = None) -> UDSResult:
        """Score one unlearned model (a checkpoint, a `Checkpoint`, a TransformerBridge, a HookedTransformer, or a
        Hugging Face model as a source); one not among the inputs' is compared with full first."""
        checkpoint = self.inputs.admit(unlearned)
        source_label = checkpoint.label
        # the previous model goes before this one loads: never two unlearned models on the device at once
        self.last_source = None
        # its fit checked against the plan's figure (measured with full and retain held; every model has full's shape)
        source = self._load(checkpoint, "unlearned", self.plan.free)
        identity = checkpoint.loaded_fingerprint(source)  # the bytes this load read, not the files now
        # a model given as an object, or kept by load_source, stays the caller's after scoring; one loaded here is
        # released once its Stage 2 is done (auditor.load_source keeps a model for hooks of one's own)
        given = checkpoint.model is not None or checkpoint in self.sources
        if given:
            self.last_source = source
        check_unhooked(self.full, "full")
        check_unhooked(source, "unlearned")
        stage = self.stage1
        cells = self.stage2_cells()
        started = time.perf_counter()
        run = self.runs.stage_two(source, source_label, stage, cells)
        try:  # halved and retried as in Stage 1
            desc = f"S2 ({checkpoint.name} -> full)"
            device, split = self.target_device, self.runs.forget_clean_runs
            run_batches(self._batches, run.batch, device, desc, self.progress, split)
        finally:
            run.close()
        # what the stage spent making models (a bf16 run's fp32 copies) is a load, as the model's own: not Stage 2
        s2_seconds = time.perf_counter() - started - run.load_seconds()
        s2, stage_meta, stage_timings = run.scores(), run.meta(), run.timings()
        del run  # it holds the source
        if not given:
            dropped = weakref.ref(source)
            del source
            release_dropped(dropped, self.device)
        timings = {
            "s1_seconds": stage.seconds,
            "s2_seconds": s2_seconds,
            **stage_timings,  # the unlearned model's own forward; in bf16/fp16 the check's fp32 runs and copies
            "s1_cached": stage.cached,
            "n_examples": len(self.examples),
            "s2_seconds_per_example": s2_seconds / max(1, len(self.encoded)),
        }
        return UDSResult.from_stages(
            name=name or checkpoint.name,
            encoded=self.encoded,
            skipped=self.skipped,
            layers=self.layers,
            s0=stage.s0,
            baseline=stage.baseline,
            s1=stage.decided_s1(),
            s2=s2,
            # retain-free mode has no d1, hence no KE cell: every cell ran, whatever was asked
            config=self.config if cells is not None else dataclasses.replace(self.config, stage2_cells="all"),
            meta={
                "full": self.full_name,
                "retain": self.retain_name,
                "unlearned": source_label,
                "data": self.data_name,
                "versions": library_versions(),
                "device": str(self.full.cfg.device),
                "dtype": str(self.full.cfg.dtype),
                "log_softmax_dtype": self.log_softmax_dtype,
                "engine": self.config.engine,
                "timings": timings,
                "stage2": self.stage2_plan(cells),
                **stage_meta,
                "fingerprint": self.fingerprint(checkpoint, identity),
            },
            records=self.examples,
        )

    def __repr__(self) -> str:
        return (
            "UDSAuditor("
            + "; ".join(f"{label}: {value}" for label, value in display.auditor_rows(self))
            + ")"
        )

    def _repr_html_(self) -> str:
        """The notebook view: one row per thing the auditor holds."""
        return display.html_table("UDSAuditor", ["", ""], [list(row) for row in display.auditor_rows(self)])


__all__ = ["UDSAuditor"]

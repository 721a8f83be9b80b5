"""The auditor: the UDS pipeline over real models, with its settings, the S1 cache and result reuse.

``UDSAuditor(full, retain, data)`` loads the full (patch target) and retain models, encodes the forget set once, and
computes Stage 1 (retain -> full) once: S1 depends only on (full, retain, data, settings), so it is cached on disk
keyed by a fingerprint of all of those (:class:`S1Cache`) and reused by every unlearned model after that.
``auditor.score(unlearned)`` runs Stage 2 and returns a :class:`~uds_lens.results.UDSResult`; :func:`score_models`
does that for many models and reuses a saved result only when its full fingerprint (every model's weights, the data,
the settings) matches. The score itself is ``uds.py``'s math; the patched runs are ``patching.py``'s engines.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.constants import HF_HUB_CACHE
from jaxtyping import Float
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from uds_lens import checkpoint, models
from uds_lens.component_result import ComponentResult
from uds_lens.components import ExampleInputs, entity_metric, patch_heads, patch_positions, patch_tokens
from uds_lens.config import ConfigError, EngineSpec, UDSConfig
from uds_lens.data import EncodedExample, Example, build_prompt, encode, fit_context, load_examples
from uds_lens.files import cache_root, json_digest
from uds_lens.patching import (
    CleanRun,
    PatchBatch,
    baseline_scores,
    choose_batch_size,
    clean_run,
    fast_engine_refusal,
    pad_batch,
    plan_batches,
    source_scores,
)
from uds_lens.results import UDSResult, check_result_name, check_saved, conflict_error, load_reusable
from uds_lens.sources import as_source

logger = logging.getLogger(__name__)

# 4: the batch plan is stored with S1 and adopted on a hit (S2 then runs in exactly the batches S1 ran in).
# 5: model fingerprints hash the Hugging Face tensors under their Hugging Face names (TransformerBridge backend).
# 6: the header holds the SHA-256 of the tensors and the batch plan (``stage_digest``), checked on every read.
CACHE_FORMAT = 6


# ----------------------------------------------------------------------------------------------------------------
# Stage results and the S1 cache


@dataclass
class StageOne:
    """Everything that depends only on (full, retain, data, settings), per scored example, in encoded order."""

    idx: list[int]
    s_full: Float[Tensor, " example"]
    baseline: Float[Tensor, "example layer"]
    s1: Float[Tensor, "example layer"] | None
    batches: list[list[int]]  # the batch plan it was computed in (indices into the encoded examples)
    seconds: float = 0.0
    cached: bool = False


def stage_digest(stage: StageOne) -> str:
    """SHA-256 of the numbers a Stage 1 hands to every result: ``s_full``, ``baseline``, ``s1`` (as float32 bytes,
    with their shapes), the example indices and the batch plan.

    Stored in the S1 cache's header and checked on every read, so a cache whose scores were changed after it was
    written (the header alone still parses and fits) is rebuilt instead of trusted; and recorded in every result's
    fingerprint (``"s1"``), so a result computed from a corrupt cache is never reused once the cache is repaired.
    """
    digest = hashlib.sha256()
    for name, tensor in (("s_full", stage.s_full), ("baseline", stage.baseline), ("s1", stage.s1)):
        digest.update(name.encode() + b"\0")
        if tensor is None:
            digest.update(b"none")
            continue
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(json.dumps(list(values.shape)).encode())
        digest.update(values.numpy().tobytes())
    digest.update(json.dumps({"idx": [int(i) for i in stage.idx], "batches": stage.batches}).encode())
    return digest.hexdigest()[:32]


def tokenizer_digest(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def layout_digest(encoded: Sequence[EncodedExample]) -> str:
    return json_digest(
        [[e.idx, list(e.input_ids), e.prompt_len, e.entity_start, e.entity_end] for e in encoded]
    )


class S1Cache:
    """S1 on disk: one safetensors file per fingerprint; stale entries are never read, corrupt ones are rebuilt.

    The tensors (``s_full``, ``baseline``, ``s1``) are stored with safetensors and everything else (format, the full
    fingerprint payload, example indices) as JSON in the file's header, so reading a cache file can never run code,
    whoever wrote it (the default directory is shared by every audit of the user). A file that does not parse, whose
    payload differs, whose shapes do not fit, that holds a non-finite value, or whose tensors and batch plan do not
    match the digest in its header (:func:`stage_digest`: values changed after the file was written) is deleted with
    a warning and S1 is recomputed. Caches of older versions (``s1_*.pt`` pickles) are never opened.
    """

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else cache_root()

    def path(self, key: str) -> Path:
        return self.directory / f"s1_{key[:32]}.safetensors"

    def load(self, key: str, payload: dict[str, Any]) -> StageOne | None:

        path = self.path(key)
        legacy = path.with_suffix(".pt")
        if legacy.is_file():
            warnings.warn(
                f"S1 cache {legacy} is in the old pickle format, which could run code when read: it is not "
                "read but deleted, and S1 is recomputed.",
                stacklevel=2,
            )
            legacy.unlink(missing_ok=True)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                header = json.loads((handle.metadata() or {})["uds_lens"])
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            if header.get("format") != CACHE_FORMAT or header.get("payload") != json.loads(
                json.dumps(payload, default=str)
            ):
                raise ValueError("fingerprint payload does not match")
            idx = [int(i) for i in header["idx"]]
            s_full, baseline, s1 = tensors["s_full"], tensors["baseline"], tensors.get("s1")
            n_layers = len(payload["layers"])
            if (
                s_full.shape != (len(idx),)
                or baseline.shape != (len(idx), n_layers)
                or (s1 is not None and s1.shape != baseline.shape)
            ):
                raise ValueError("tensor shapes do not fit the examples and layers")
            if not all(bool(torch.isfinite(t).all()) for t in (s_full, baseline, s1) if t is not None):
                raise ValueError("it holds non-finite scores")
            batches = [[int(i) for i in members] for members in header["batches"]]
            if sorted(i for members in batches for i in members) != list(range(len(idx))):
                raise ValueError("its batch plan does not cover every example exactly once")
            stage = StageOne(idx=idx, s_full=s_full, baseline=baseline, s1=s1, batches=batches, cached=True)
            if header.get("digest") != stage_digest(stage):
                raise ValueError(
                    "its scores or batch plan do not match the digest in its header (the file was changed after "
                    "it was written); results computed from it are not reused"
                )
            return stage
        except Exception as err:  # any unreadable or inconsistent file is rebuilt
            warnings.warn(
                f"S1 cache {path} is unreadable or inconsistent ({err}); recomputing S1.", stacklevel=2
            )
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, payload: dict[str, Any], stage: StageOne) -> Path:

        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tensors = {"s_full": stage.s_full, "baseline": stage.baseline}
        if stage.s1 is not None:
            tensors["s1"] = stage.s1
        header = {
            "format": CACHE_FORMAT,
            "payload": payload,
            "idx": [int(i) for i in stage.idx],
            "batches": stage.batches,
            "digest": stage_digest(stage),
        }
        save_file(
            {name: t.detach().float().cpu().contiguous() for name, t in tensors.items()},
            str(tmp),
            metadata={"uds_lens": json.dumps(header, default=str)},
        )
        os.replace(tmp, path)
        return path


# ----------------------------------------------------------------------------------------------------------------
# The auditor


def _versions() -> dict[str, str]:

    out = {}
    for package in ("uds_lens", "torch", "transformer-lens", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "unknown"
    return out


# ----------------------------------------------------------------------------------------------------------------
# Fingerprints: what a result depends on


# 2: in-memory models are hashed by their Hugging Face tensors (TransformerBridge backend); numbers move at float noise.
# 3: ``s1``, the digest of the Stage 1 values a result was computed from, is part of it.
RESULT_FINGERPRINT_FORMAT = 3


def _hub_revision(model_id: str) -> str | None:
    """The commit a hub id resolves to in the local Hugging Face cache (offline; None when not cached)."""
    ref = Path(HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}" / "refs" / "main"
    return ref.read_text().strip() if ref.is_file() else None


def source_fingerprint(source: Any) -> str | None:
    """Identity of a model's weights, never of its path.

    A local checkpoint directory (or ``.gguf`` file) is identified by the contents of its weight, config and
    tokenizer files (``checkpoint.file_digest``: scheme and version in the string, so a change of digest re-keys
    saved results instead of misreading them), an in-memory model by a digest of its tensors (``models.model_fingerprint``), a hub id by itself
    and the cached commit it resolves to. None stands for "no model" (retain-free mode).
    """
    if source is None:
        return None
    if isinstance(source, (str, os.PathLike)):
        try:  # "zoo:NAME" is identified by its directory's files, like any other path
            source = models.resolve_zoo_name(source)
        except models.ModelLoadError:
            pass  # a zoo name that names no model: identified by itself, and loading it fails with the reason
        path = Path(source).expanduser()
        if path.exists():
            return "files:" + checkpoint.file_digest(path)
        return f"hub:{source}@{_hub_revision(str(source)) or 'unresolved'}"
    return "tensors:" + models.model_fingerprint(source)


def examples_fingerprint(examples: Sequence[Example]) -> str:
    """Digest of a forget set as scored (after ``limit``): every field of every record, in order."""
    return json_digest([example.to_record() for example in examples])[:32]


def settings_fingerprint(config: UDSConfig, full: Any = None) -> dict[str, Any]:
    """The settings a result depends on: the config without tau (re-applied to saved deltas), batch size (results
    are invariant to it) and device; plus the dtype the full model runs in."""
    settings = config.to_dict()
    for volatile in ("tau", "batch_size", "device"):
        settings.pop(volatile)
    if full is not None and not isinstance(full, (str, os.PathLike)):
        settings["dtype"] = str(as_source(full).dtype)
    else:
        settings["dtype"] = str(models.resolve_dtype(config.dtype, config.device or models.default_device()))
    return settings


def result_fingerprint(
    full: Any,
    retain: Any,
    unlearned: Any,
    data: Any,
    config: UDSConfig | None = None,
    limit: int | None = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Everything a saved UDS result depends on, as a JSON-ready dict; two runs with equal fingerprints give the
    same tables, so a saved result may be reused only when its fingerprint equals the new one
    (``results.load_reusable``).

    Keys: ``format``, ``full``, ``retain``, ``unlearned`` (:func:`source_fingerprint`: file contents or tensor
    digests, so a checkpoint retrained in place changes it), ``data`` (the records after ``limit``),
    ``tokenizer`` (``"from full"`` unless one is passed explicitly), ``settings`` (:func:`settings_fingerprint`).
    Loads no model; reads the data and hashes the checkpoint files (memoised by size and modification time).
    ``UDSAuditor.fingerprint(unlearned)`` gives the same dict for an auditor's inputs plus ``s1``, the digest of
    the Stage 1 values (which needs the models): a saved result is reused only when that matches too.
    """
    config = config or UDSConfig()
    return {
        "format": RESULT_FINGERPRINT_FORMAT,
        "full": source_fingerprint(full),
        "retain": source_fingerprint(retain),
        "unlearned": source_fingerprint(unlearned),
        "data": examples_fingerprint(load_examples(data, limit=limit)),
        "tokenizer": "from full" if tokenizer is None else tokenizer_digest(tokenizer),
        "settings": settings_fingerprint(config, full),
    }


class UDSAuditor:
    """Score any number of unlearned models against one (full, retain, forget set) with S1 computed once.

    Example:
        >>> auditor = UDSAuditor("ckpt/full", "ckpt/retain", "forget.json")
        >>> result = auditor.score("ckpt/npo")
        >>> result.uds, result.examples.head(), result.layers.head()

    Args:
        full: the patch target and baseline: a local checkpoint dir, hub id, or a loaded HookedTransformer.
        retain: the Stage-1 source (same forms), or None for retain-free mode.
        data: forget-set path / hub id / records / Examples.
        config: ``UDSConfig``.
        tokenizer: defaults to the full model's tokenizer (from its directory).
        cache_dir: S1 cache directory (default ``~/.cache/uds_lens``, or ``$UDS_LENS_CACHE``); ``False`` disables it.
        progress: tqdm progress bars over example batches.
        limit: score only the first ``limit`` examples.
        retain_name / data_name: how results name the retain model and the forget set (default: their paths, or
            ``<records>`` for data given as records); a sweep worker that adopts another worker's Stage 1 names
            the retain model it never loaded, and the data file its examples were read from.

    Attributes:
        full / retain: the loaded HookedTransformers (``retain`` is None in retain-free mode).
        tokenizer / pad_id: the full model's fast tokenizer and the id that pads batches.
        config / device / layers / progress: the settings, the device, the patched layers, tqdm on or off.
        examples / encoded / skipped: the forget set (``Example``), the scorable examples' token layouts
            (``EncodedExample``: ``input_ids``, ``read_positions``, ``labels``, ``patch_positions(scope)``) and the
            ``Skip``s with their reasons.
        stage1: S0, each engine's per-layer baseline and S1 (``StageOne``), computed once and cached on disk.
        sources / last_source: models kept by :meth:`load_source` (by path) and the model the last
            :meth:`score` loaded.
        component_cache: head/token/position-level S1 scores, kept for the next unlearned model.

    For hooks of your own: :meth:`example` (one example's tensors), :meth:`tokens`, :meth:`metric` (a
    tensor-valued patching metric), :meth:`run_with_cache` (the clean run's activations); for finer patching:
    :meth:`patch_heads`, :meth:`patch_tokens`, :meth:`patch_positions` (``uds_lens.components``).
    """

    def __init__(
        self,
        full: Any,
        retain: Any,
        data: Any,
        config: UDSConfig | None = None,
        tokenizer: Any = None,
        cache_dir: str | os.PathLike | bool | None = None,
        progress: bool = True,
        limit: int | None = None,
        retain_name: str | None = None,
        data_name: str | None = None,
    ) -> None:
        self.config = config or UDSConfig()
        self.progress = progress
        self._inputs = {"full": full, "retain": retain, "tokenizer_given": tokenizer is not None}
        self._base_fingerprint: dict[str, Any] | None = None
        self.device = self.config.device or models.default_device()
        self.full = self._load(full, "full")
        self.full_name = models.describe(full)
        refusal = fast_engine_refusal(self.full) if self.config.engine == "fast" else None
        if refusal is not None:
            # a family the fast engine does not compute: the naive engine (the model's own forward), never a guess
            logger.warning("%s: %s; scoring with the naive engine.", self.full_name, refusal)
            self.config = dataclasses.replace(self.config, engine="naive")
        if tokenizer is None:
            source = full if isinstance(full, (str, os.PathLike)) else getattr(self.full, "uds_source", None)
            if source is None:
                raise ValueError("Pass tokenizer=... when the full model is given as an in-memory model.")
            tokenizer = models.load_tokenizer(source)
        self.tokenizer = tokenizer
        if tokenizer.vocab_size > self.full.cfg.d_vocab:
            raise models.ModelMismatchError(
                f"The tokenizer has {tokenizer.vocab_size} tokens but the full model's vocabulary is "
                f"{self.full.cfg.d_vocab}: they do not belong together. Load the tokenizer from the full model's directory."
            )
        self.retain = self._load(retain, "retain") if retain is not None else None
        if retain_name is None and retain is not None:
            retain_name = models.describe(retain)
        self.retain_name = retain_name
        if self.retain is not None:
            models.check_compatible(self.full, self.retain, "full", "retain")
        self.examples: list[Example] = load_examples(data, limit=limit)
        if data_name is None:
            data_name = str(data) if isinstance(data, (str, os.PathLike)) else "<records>"
        self.data_name = data_name
        self.encoded, self.skipped = encode(self.examples, tokenizer, self.config.published_compat)
        # An example longer than a model's context would crash the whole run: cut it after its last read position,
        # or skip it with a counted reason.
        n_ctx = min(
            as_source(model).context_length for model in (self.full, self.retain) if model is not None
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
        self.cache = None if cache_dir is False else S1Cache(cache_dir if cache_dir is not True else None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._batches = self._make_batches()
        self._clean: dict[int, CleanRun] = {}
        self._stage1: StageOne | None = None
        self.sources: dict[str, Any] = {}
        self.component_cache: dict[tuple, Any] = {}

    def drop_retain(self) -> None:
        """Release the retain model once Stage 1 is computed (computing it first if it is not yet).

        Stage 1 is all the retain model is needed for; results keep naming it (``retain_name``) and fingerprinting
        it (from the source it was given), so a sweep worker frees its memory before it scores the unlearned models. Component
        patching (``patch_heads`` ...) needs the retain model and raises once it is dropped.
        """
        _ = self.stage1
        self.retain = None

    # -- loading -----------------------------------------------------------------------------------------------

    def load(self, model: Any, role: str = "unlearned") -> Any:
        """A model as this auditor runs it: a path or hub id is loaded in the auditor's dtype and device; a
        HookedTransformer or Hugging Face model is returned as is."""
        return self._load(model, role)

    def load_source(self, model: Any, role: str = "unlearned") -> Any:
        """Load a source model once and keep it: later ``score``/``patch_*`` calls with the same path reuse it.

        Args:
            model: a checkpoint directory, hub id, zoo name (``"zoo:npo"``), or an already loaded model (returned
                as is).
            role: how error messages name it.

        Returns:
            The HookedTransformer (also in ``auditor.sources[path]``).
        """
        if not isinstance(model, (str, os.PathLike)):
            return self._load(model, role)
        key = str(model)
        if key not in self.sources:
            self.sources[key] = self._load(model, role)
        return self.sources[key]

    def _load(self, model: Any, role: str) -> Any:
        if isinstance(model, (str, os.PathLike)) and str(model) in getattr(self, "sources", {}):
            return self.sources[str(model)]
        return models.load(model, dtype=self.config.dtype, device=self.device, role=role)

    @property
    def engine_spec(self) -> EngineSpec:
        """What the patching engines need of these settings, over the layers this auditor patches."""
        return self.config.engine_spec(tuple(self.layers))

    @property
    def upcast(self) -> bool:
        return not self.config.published_compat

    @property
    def log_softmax_dtype(self) -> str:
        """The dtype entity log-probs are computed in: fp32 by default (SPEC §1.2.6), the model's own dtype in
        published-compat mode (as the published code does); recorded in every result's metadata."""
        return "float32" if self.upcast else str(self.full.cfg.dtype).replace("torch.", "")

    # -- batching ----------------------------------------------------------------------------------------------

    def _make_batches(self) -> list[list[int]]:
        """Example indices per batch, similar lengths together (less padding); deterministic."""
        if not self.encoded:
            return []
        size = self.config.batch_size or choose_batch_size(
            self.full, self.encoded, self.config.patch_scope, self.config.engine
        )
        return plan_batches(self.encoded, self.config.patch_scope, size, engine=self.config.engine)

    def _each_batch(self, desc: str, work: Callable[[int, list[int]], None]) -> None:
        """``work(number, members)`` for every example batch; an out-of-memory error halves that batch and retries.

        The halves replace the batch in the plan, so later stages and models start from the size that fitted. The
        clean runs are keyed by batch number, which the split shifts, so they are dropped and recomputed. On a CPU
        with overcommit the kernel may kill the process instead of raising: there the memory-budgeted batch size
        (``choose_batch_size``) is the protection.
        """
        number = 0
        with tqdm(total=len(self.encoded), desc=desc, unit="example", disable=not self.progress) as bar:
            while number < len(self._batches):
                members = self._batches[number]
                try:
                    work(number, members)
                except Exception as err:
                    if not is_out_of_memory(err) or len(members) == 1:
                        raise
                    error_name = type(err).__name__
                else:
                    bar.update(len(members))
                    number += 1
                    continue
                # Outside the except block: the failed attempt's frames (and their tensors) are released by now.
                half = len(members) // 2
                logger.warning(
                    "Out of memory on a batch of %d examples (%s); retrying as %d + %d.",
                    len(members),
                    error_name,
                    half,
                    len(members) - half,
                )
                self._batches[number : number + 1] = [members[:half], members[half:]]
                self._clean.clear()
                release_memory(self.full.cfg.device)

    def _batch(self, members: list[int]) -> PatchBatch:
        return pad_batch(
            [self.encoded[i] for i in members],
            self.pad_id,
            self.config.patch_scope,
            cut=self.config.engine == "fast",
        ).to(self.full.cfg.device)

    def _clean_run(self, number: int, batch: PatchBatch) -> CleanRun:
        if number not in self._clean:
            self._clean[number] = clean_run(self.full, batch, self.engine_spec)
        return self._clean[number]

    def _source_scores(
        self, source: Any, batch: PatchBatch, number: int, timings: dict[str, float] | None = None
    ) -> Tensor:
        return source_scores(
            self.full, source, batch, self.engine_spec, self._clean_run(number, batch), timings
        )

    # -- Stage 1 -----------------------------------------------------------------------------------------------

    def fingerprint(self, unlearned: Any) -> dict[str, Any]:
        """``result_fingerprint`` of this auditor's inputs and ``unlearned`` (full, retain and data hashed once),
        plus ``s1``: the :func:`stage_digest` of the Stage 1 every result of this auditor is computed from (so this
        computes Stage 1, or reads it from the cache, when it is not there yet)."""
        if self._base_fingerprint is None or "s1" not in self._base_fingerprint:
            self._base_fingerprint = {
                "format": RESULT_FINGERPRINT_FORMAT,
                "full": source_fingerprint(self._inputs["full"]),
                "retain": source_fingerprint(self._inputs["retain"]),
                "data": examples_fingerprint(self.examples),
                "tokenizer": tokenizer_digest(self.tokenizer)
                if self._inputs["tokenizer_given"]
                else "from full",
                "settings": settings_fingerprint(self.config, self.full),
                "s1": stage_digest(self.stage1),
            }
        return {**self._base_fingerprint, "unlearned": source_fingerprint(unlearned)}

    def fingerprint_payload(self) -> dict[str, Any]:
        settings = self.config.to_dict()
        for volatile in ("tau", "batch_size", "device"):
            settings.pop(volatile)
        return {
            "full": models.model_fingerprint(self.full),
            "retain": models.model_fingerprint(self.retain) if self.retain is not None else None,
            "tokenizer": tokenizer_digest(self.tokenizer),
            "layout": layout_digest(self.encoded),
            "layers": self.layers,
            "settings": settings,
            "dtype": str(self.full.cfg.dtype),
        }

    @property
    def stage1(self) -> StageOne:
        """S0, each engine's per-layer baseline and S1 (retain patched in), from the cache when possible."""
        if self._stage1 is None:
            self._stage1 = self._compute_stage1()
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
                return cached
        started = time.perf_counter()
        n, n_layers = len(self.encoded), len(self.layers)
        s_full = torch.full((n,), float("nan"))
        baseline = torch.full((n, n_layers), float("nan"))
        s1 = torch.full((n, n_layers), float("nan")) if self.retain is not None else None

        def stage_one_batch(number: int, members: list[int]) -> None:
            batch = self._batch(members)
            clean = self._clean_run(number, batch)
            s_full[members] = clean.scores.float().cpu()
            self._require_finite(
                s_full[members], members, self.full, "full", self.full_name, "clean score (S0)"
            )
            baseline[members] = baseline_scores(self.full, batch, clean, self.engine_spec).float().cpu()
            self._require_finite(
                baseline[members], members, self.full, "full", self.full_name, "baseline score"
            )
            if s1 is not None:
                s1[members] = self._source_scores(self.retain, batch, number).float().cpu()
                self._require_finite(
                    s1[members], members, self.retain, "retain", self.retain_name, "patched score (S1)"
                )

        self._each_batch("S1 (retain -> full)", stage_one_batch)
        stage = StageOne(
            idx=[e.idx for e in self.encoded],
            s_full=s_full,
            baseline=baseline,
            s1=s1,
            batches=self.batches,
            seconds=time.perf_counter() - started,
        )
        if self.cache is not None and key is not None and payload is not None:
            self.cache.save(key, payload, stage)
        return stage

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
        self._clean = {}
        self._stage1 = stage
        if self._base_fingerprint is not None:
            self._base_fingerprint.pop("s1", None)  # the digest of the Stage 1 just replaced
        if inputs_fingerprint is not None:
            self._base_fingerprint = {
                key: value for key, value in inputs_fingerprint.items() if key != "unlearned"
            }

    def _require_finite(
        self, values: Tensor, members: Sequence[int], model: Any, role: str, label: str | None, what: str
    ) -> None:
        """Raise :func:`nonfinite_error` when a batch's scores hold NaN/inf (checked per batch: fail early)."""
        bad = ~torch.isfinite(values)
        if not bad.any():
            return
        rows = bad.reshape(len(members), -1).any(-1)
        first_row = int(torch.nonzero(rows)[0, 0])
        idx = [self.encoded[members[row]].idx for row in torch.nonzero(rows)[:, 0].tolist()]
        columns = torch.nonzero(bad.reshape(len(members), -1).any(0))[:, 0].tolist()
        score_layer = self.layers[columns[0]] if values.dim() == 2 else None
        raise nonfinite_error(model, role, label, what, idx, self.encoded[members[first_row]], score_layer)

    def d1(self) -> Float[Tensor, "example layer"] | None:
        stage = self.stage1
        return None if stage.s1 is None else stage.baseline - stage.s1

    # -- Stage 2 -----------------------------------------------------------------------------------------------

    def score(self, unlearned: Any, name: str | None = None) -> Any:
        """Score one unlearned model (path, hub id, HookedTransformer, or Hugging Face model as a source)."""
        source_label = models.describe(unlearned)
        source = self._load(unlearned, "unlearned")
        self.last_source = (
            source  # kept for hooks of one's own after scoring (auditor.load_source keeps many)
        )
        models.check_compatible(self.full, source, "full", source_label)
        stage = self.stage1
        started = time.perf_counter()
        s2 = torch.full((len(self.encoded), len(self.layers)), float("nan"))
        clock: dict[str, float] = {}

        def stage_two_batch(number: int, members: list[int]) -> None:
            s2[members] = self._source_scores(source, self._batch(members), number, clock).float().cpu()
            self._require_finite(
                s2[members], members, source, "unlearned", source_label, "patched score (S2)"
            )

        self._each_batch(f"S2 ({models.model_name(unlearned)} -> full)", stage_two_batch)
        s2_seconds = time.perf_counter() - started
        timings = {
            "s1_seconds": stage.seconds,
            "s2_seconds": s2_seconds,
            # the part of S2 spent in the unlearned model's own forward (the rest is the patched runs)
            "s2_source_forward_seconds": clock.get("source_forward_seconds", 0.0),
            "s1_cached": stage.cached,
            "n_examples": len(self.examples),
            "s2_seconds_per_example": s2_seconds / max(1, len(self.encoded)),
        }
        return UDSResult.from_stages(
            name=name or models.model_name(unlearned),
            encoded=self.encoded,
            skipped=self.skipped,
            layers=self.layers,
            s_full=stage.s_full,
            baseline=stage.baseline,
            s1=stage.s1,
            s2=s2,
            config=self.config,
            meta={
                "full": self.full_name,
                "retain": self.retain_name,
                "unlearned": source_label,
                "data": self.data_name,
                "versions": _versions(),
                "device": str(self.full.cfg.device),
                "dtype": str(self.full.cfg.dtype),
                "log_softmax_dtype": self.log_softmax_dtype,
                "engine": self.config.engine,
                "timings": timings,
                "fingerprint": self.fingerprint(unlearned),
            },
            records=self.examples,
        )

    # -- hooks of your own ------------------------------------------------------------------------------------

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

    def example(self, idx: int) -> Any:
        """One example as tensors for a hand-written hook experiment (``components.ExampleInputs``).

        ``tokens`` is ``[1, pos]`` (prompt + reference, BOS included: pass it to ``run_with_hooks`` as is, never
        through ``to_tokens``), ``read_positions``/``labels`` are where the entity tokens are predicted and which
        they are, ``patch_positions`` what UDS patches under this auditor's scope.
        """

        encoded = self.select([idx])[0]
        record = next(e for e in self.examples if e.idx == idx)
        prompt, reference = build_prompt(record, self.config.published_compat) or ("", "")
        device = self.full.cfg.device
        return ExampleInputs(
            idx=idx,
            question=record.question,
            entity=record.entity,
            prompt=prompt,
            reference=reference,
            tokens=torch.tensor([encoded.input_ids], device=device),
            str_tokens=[self.tokenizer.decode([token]) for token in encoded.input_ids],
            read_positions=torch.tensor(list(encoded.read_positions), device=device),
            labels=torch.tensor(encoded.labels, device=device),
            patch_positions=torch.tensor(
                list(encoded.patch_positions(self.config.patch_scope)), device=device
            ),
        )

    def tokens(self, idxs: int | Sequence[int]) -> Tensor:
        """``[batch, pos]`` right-padded tokens of these examples (the layout :meth:`metric` reads)."""
        chosen = self.select([idxs] if isinstance(idxs, int) else idxs)
        return pad_batch(chosen, self.pad_id, self.config.patch_scope, cut=False).tokens.to(
            self.full.cfg.device
        )

    def metric(self, idxs: int | Sequence[int], per_example: bool = False) -> Callable[[Tensor], Tensor]:
        """A tensor-valued patching metric for logits of :meth:`tokens` ``(idxs)``: the mean entity log-prob.

        Works with ``run_with_hooks`` and as the ``patching_metric`` of ``transformer_lens.patching``'s
        ``get_act_patch_*`` (they call ``.item()`` on it, so it must return a tensor, never a float).

        Example:
            >>> ex, metric = auditor.example(3), auditor.metric(3)
            >>> metric(auditor.full(ex.tokens))        # == the clean score S0 of example 3
        """

        chosen = self.select([idxs] if isinstance(idxs, int) else idxs)
        batch = pad_batch(chosen, self.pad_id, self.config.patch_scope, cut=False)
        return entity_metric(
            batch.read_batch, batch.read_pos, batch.read_label, batch.size, per_example, upcast=self.upcast
        )

    def run_with_cache(self, idxs: int | Sequence[int], model: Any = None, names_filter: Any = None) -> Any:
        """``(logits, ActivationCache)`` of the clean run of ``model`` (default ``full``) on these examples."""
        target = self.full if model is None else self.load_source(model)
        with torch.no_grad():
            return target.run_with_cache(self.tokens(idxs).to(target.cfg.device), names_filter=names_filter)

    def patch_heads(self, unlearned: Any, **kwargs: Any) -> ComponentResult:
        """Head-level UDS ``[example, layer, head]``: see :func:`uds_lens.components.patch_heads`."""

        return patch_heads(self, unlearned, **kwargs)

    def patch_tokens(self, unlearned: Any, **kwargs: Any) -> ComponentResult:
        """Per-entity-token UDS ``[example, layer, token]``: see :func:`uds_lens.components.patch_tokens`."""

        return patch_tokens(self, unlearned, **kwargs)

    def patch_positions(self, unlearned: Any, **kwargs: Any) -> ComponentResult:
        """One patched position at a time ``[example, layer, position]``: :func:`uds_lens.components.patch_positions`."""

        return patch_positions(self, unlearned, **kwargs)


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation failure: CUDA's ``OutOfMemoryError``, or the CPU allocator's "can't allocate memory"."""
    if isinstance(err, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        "out of memory" in text.lower() or "can't allocate memory" in text
    )


def release_memory(device: str | torch.device) -> None:
    """Give freed blocks back before a retry (the CUDA caching allocator keeps them otherwise)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class NonFiniteScoreError(FloatingPointError):
    """A model produced NaN/inf scores: the message names the model, the examples, the first layer and the fix."""


def _first_nonfinite_layer(model: Any, example: EncodedExample) -> int | None:
    """The first block whose output (``resid_post``) is non-finite on ``example``, or None when all are finite."""
    source = as_source(model)
    n_layers = source.n_layers
    acts = source.activations(torch.tensor([list(example.input_ids)]), "resid_post", range(n_layers))
    bad = [layer for layer in range(n_layers) if not bool(torch.isfinite(acts[layer]).all())]
    return bad[0] if bad else None


def _first_nonfinite_parameter(model: Any) -> str | None:
    # parameters only (buffers such as an attention mask's -inf are on purpose), by their Hugging Face names
    for name, tensor in models.named_weights(model):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def nonfinite_error(
    model: Any,
    role: str,
    label: str | None,
    what: str,
    idx: Sequence[int],
    example: EncodedExample,
    score_layer: int | None,
) -> NonFiniteScoreError:
    """The error for non-finite scores of one stage: which model, which examples, the first layer where the
    activations (or, failing that, the scores) stop being finite, and advice that fits the cause: broken weights,
    an overflow in a 16-bit dtype, or activations that blow up in float32 with finite weights."""
    layer = _first_nonfinite_layer(model, example)
    where = (
        f"first at layer {layer} (blocks.{layer}.hook_resid_post)"
        if layer is not None
        else f"first in the scores of layer {score_layer}"
        if score_layer is not None
        else ""
    )
    parameter = _first_nonfinite_parameter(model)
    dtype = as_source(model).dtype
    if parameter is not None:
        advice = (
            f"its weights are already non-finite ({parameter}): the checkpoint is broken (a diverged training "
            "run or a bad conversion); re-export or retrain it"
        )
    elif dtype in (torch.float16, torch.bfloat16):
        advice = (
            f"its weights are finite, so the activations overflow in {str(dtype).replace('torch.', '')}: run "
            "in float32 (--dtype float32, or UDSConfig(dtype='float32'))"
        )
    else:
        advice = (
            f"its weights are finite and it already runs in {str(dtype).replace('torch.', '')}, so its "
            "activations blow up on these inputs: check how the checkpoint was trained (a diverged run gives "
            "such weights)"
        )
    return NonFiniteScoreError(
        f"The {role} model ({label or type(model).__name__}) gives a non-finite {what} for example idx "
        f"{list(idx)[:10]}{', ' + where if where else ''}: {advice}. Nothing was cached or saved."
    )


def result_names(unlearned: Sequence[Any]) -> dict[str, Any]:
    """Unique result names for a list of models: each directory's basename, or, where two share one, as many parent
    directories as tell them apart joined with ``__`` (``/runs/a/npo`` and ``/runs/b/npo`` give ``a__npo`` and
    ``b__npo``). Models that no path tells apart (the same model twice) raise ``ValueError``."""
    basenames = [models.model_name(model) for model in unlearned]
    names = list(basenames)
    for position, model in enumerate(unlearned):
        if basenames.count(basenames[position]) == 1 or not isinstance(model, (str, os.PathLike)):
            continue
        parts = Path(model).expanduser().resolve().parts
        clashing = [
            Path(other).expanduser().resolve().parts
            for other, name in zip(unlearned, basenames)
            if name == basenames[position] and isinstance(other, (str, os.PathLike))
        ]
        for depth in range(2, len(parts) + 1):
            if sum(other[-depth:] == parts[-depth:] for other in clashing) == 1:
                names[position] = "__".join(parts[-depth:])
                break
    if len(set(names)) != len(names):
        raise ValueError(
            f"Two unlearned models share a result name ({names}): pass each model once, or a dict "
            "{name: model} (CLI: --unlearned NAME=PATH)."
        )
    return dict(zip(names, unlearned))


def refuse_other_runs(
    out_dir: Path,
    named_models: Sequence[tuple[str, Any]],
    full: Any,
    retain: Any,
    data: Any,
    config: UDSConfig,
    limit: int | None = None,
    tolerate: tuple[str, ...] = (),
) -> None:
    """Refuse, before any model is loaded, to write over ``out_dir/NAME`` directories that hold results of other
    inputs (another full, retain, data set, setting or checkpoint under that name): they are another run's, and only
    ``force`` replaces them. Reads the checkpoint files (digests memoised) and the saved fingerprints, nothing else;
    the Stage 1 digest is not compared here (it needs the models).

    Args:
        named_models: ``(result name, unlearned model)`` pairs.
        tolerate: input keys whose difference is left to a later check (the sweep's driver cannot know the
            workers' dtype, so it tolerates ``"settings"``).

    Raises:
        results.OutputConflictError: naming every such directory and what differs.
    """
    conflicts = {}
    for name, model in named_models:
        saved = out_dir / name
        if saved.exists():
            inputs = result_fingerprint(full, retain, model, data, config, limit)
            check = check_saved(saved, inputs, ignore=("s1",))
            if set(check.conflicts) - set(tolerate):
                conflicts[str(saved)] = check.reason
    if conflicts:
        raise conflict_error(conflicts)


def score_models(
    full: Any,
    retain: Any,
    unlearned: Sequence[Any] | dict[str, Any],
    data: Any,
    out_dir: str | os.PathLike | None = None,
    config: UDSConfig | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
    limit: int | None = None,
    progress: bool = True,
    force: bool = False,
) -> dict[str, Any]:
    """Score several unlearned models against one (full, retain, data), saving each under ``out_dir/NAME/``.

    A saved ``out_dir/NAME/`` is reused instead of recomputed only when it is intact and was computed from identical
    inputs: the same full, retain and unlearned weights (file contents, not paths), the same data (after ``limit``),
    the same settings (tau aside: it is re-applied to the saved deltas) and the same Stage 1 values (their digest;
    a result computed from a corrupt S1 cache is recomputed once the cache is repaired). Then the log says
    ``reusing NAME: identical inputs`` and the result's ``meta["reused"]`` is set. A saved result of *other* inputs
    (another run's) is refused before any model is loaded, naming what differs, unless ``force``; one that is
    incomplete, fails its digests or used other Stage 1 values is recomputed with a warning saying why (also in
    ``meta["recomputed"]``). Each result is written atomically under a lock (``results.atomic_result_dir``).

    Args:
        unlearned: models (result names from their paths, see :func:`result_names`) or ``{name: model}``; a name is
            one path component.
        force: recompute every model even when a saved result could be reused, and replace results of other runs.

    Raises:
        ValueError: a result name is not a single path component, or ``out_dir`` is a file (both before any compute).
        results.OutputConflictError: ``out_dir/NAME`` holds another run's result and ``force`` is off.
    """

    config = config or UDSConfig()
    items = (
        list(unlearned.items())
        if isinstance(unlearned, dict)
        else list(result_names(list(unlearned)).items())
    )
    for name, _ in items:
        check_result_name(name)
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(
            f"The output directory {out_dir} is a file: pass a directory (it is created if missing)."
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of examples, got {limit!r}.")
    results: dict[str, Any] = {}
    auditor: UDSAuditor | None = None
    if out_dir is not None and not force:
        # Before any model is loaded: a directory holding another run's result (other weights, data or settings)
        # is never silently replaced.
        refuse_other_runs(Path(out_dir), items, full, retain, data, config, limit)
    for name, model in items:
        target = Path(out_dir) / name if out_dir is not None else None
        reason = "forced (--force)" if force else ""
        if target is not None and not force and target.exists():
            # The saved result's Stage 1 digest is compared too, which needs this run's Stage 1 (from the cache).
            if auditor is None:
                auditor = UDSAuditor(
                    full, retain, data, config=config, cache_dir=cache_dir, progress=progress, limit=limit
                )
            previous, reason = load_reusable(target, auditor.fingerprint(model))
            if previous is not None:
                results[name] = previous.with_tau(config.tau)
                results[name].meta["reused"] = reason
                logger.info("reusing %s: %s", name, reason)
                continue
            logger.warning("recomputing %s: %s", name, reason)
        if auditor is None:
            auditor = UDSAuditor(
                full, retain, data, config=config, cache_dir=cache_dir, progress=progress, limit=limit
            )
        results[name] = auditor.score(model, name=name)
        if target is not None and target.exists():
            results[name].meta["recomputed"] = reason
        if target is not None:
            results[name].save(target)
    return results

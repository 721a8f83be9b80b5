"""The Unlearning Depth Score (UDS): how much of the forgotten knowledge is still causally recoverable.

For every example ``i`` and layer ``l`` (one patch per layer, see ``patching.py``):

* ``s_full``: the full model's mean entity-token log-prob (S0);
* ``d1[l] = s_full - s_S1[l]``: the drop when the **retain** model's activations are patched in (Stage 1: where the
  knowledge lives in the full model);
* ``d2[l] = s_full - s_S2[l]``: the drop when the **unlearned** model's activations are patched in (Stage 2: how much
  of it the unlearned model has erased);
* ``ke_mask[l] = d1[l] > tau``: the knowledge-encoding (KE) layers (strict ``>``, ``tau = 0.05`` nats);
* ``ler[l] = clip(d2[l] / d1[l], 0, 1)``: the layer erasure ratio;
* ``UDS_i = sum_KE d1 * ler / sum_KE d1``, undefined (NaN) when no layer is KE; model UDS = mean of defined ``UDS_i``.

0 means the unlearned model still carries the knowledge exactly like the full model; 1 means it is as absent as in
a model that never saw it. S1 depends only on (full, retain, data, settings): ``UDSAuditor`` computes it once,
caches it on disk keyed by a fingerprint of all of those, and then scores any number of unlearned models.
Without a retain model (retain-free mode) only ``d2`` exists; its summaries are unnormalised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from uds_lens import models
from uds_lens.data import EncodedExample, Example, Skip, encode, load_examples
from uds_lens.patching import (
    ENGINES,
    SCOPES,
    SITES,
    CleanRun,
    PatchBatch,
    baseline_scores,
    choose_batch_size,
    clean_run,
    pad_batch,
    plan_batches,
    source_scores,
)
from uds_lens.tl_compat import HookedTransformer

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2
DEFAULT_CACHE_DIR = Path(os.environ.get("UDS_LENS_CACHE", "~/.cache/uds_lens")).expanduser()


# ----------------------------------------------------------------------------------------------------------------
# The score


def deltas(s_full: Float[Tensor, "example layer"], patched: Float[Tensor, "example layer"]) -> Float[Tensor, "example layer"]:
    """``s_full - s_patched``: positive when the patch destroyed entity log-prob."""
    return s_full - patched


def ke_mask(d1: Float[Tensor, "*shape"], tau: float) -> Bool[Tensor, "*shape"]:
    """Knowledge-encoding layers: ``d1 > tau`` (strict)."""
    return d1 > tau


def layer_erasure_ratio(d1: Float[Tensor, "*shape"], d2: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``clip(d2 / d1, 0, 1)``; 0 where ``d1 == 0`` (such layers are never KE for ``tau >= 0``)."""
    safe = torch.where(d1 == 0, torch.ones_like(d1), d1)
    return torch.where(d1 == 0, torch.zeros_like(d1), (d2 / safe).clamp(0.0, 1.0))


def example_uds(
    d1: Float[Tensor, "example layer"], d2: Float[Tensor, "example layer"], tau: float = 0.05
) -> Float[Tensor, " example"]:
    """Per-example UDS: the d1-weighted mean of the layer erasure ratio over KE layers; NaN with no KE layer."""
    ke = ke_mask(d1, tau)
    weights = torch.where(ke, d1, torch.zeros_like(d1))
    numerator = (weights * layer_erasure_ratio(d1, d2)).sum(-1)
    denominator = weights.sum(-1)
    return torch.where(ke.any(-1), numerator / torch.where(ke.any(-1), denominator, torch.ones_like(denominator)),
                       torch.full_like(denominator, float("nan")))


def model_uds(per_example: Float[Tensor, " example"]) -> float:
    """Plain mean over examples with a defined UDS (NaN if none is defined)."""
    defined = per_example[~torch.isnan(per_example)]
    return float(defined.mean()) if defined.numel() else float("nan")


def bootstrap_ci(values: Sequence[float] | np.ndarray, n_boot: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean over the defined (non-NaN) values."""
    array = np.asarray(values, dtype=float)
    array = array[~np.isnan(array)]
    if array.size == 0:
        return (float("nan"), float("nan"))
    if array.size == 1:
        return (float(array[0]), float(array[0]))
    rng = np.random.default_rng(seed)
    means = array[rng.integers(0, array.size, size=(n_boot, array.size))].mean(axis=1)
    alpha = (1 - level) / 2
    return (float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha)))


# ----------------------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class UDSConfig:
    """Settings of a UDS audit (defaults from the paper).

    Attributes:
        tau: KE threshold on ``d1`` in nats (strict ``>``). Applied after the S1 cache: changing it recomputes nothing.
        patch_scope: ``span`` (patch the positions that predict the entity tokens) or ``boundary`` (only the last
            prompt token).
        site: hook site patched in every block: ``resid_post`` (default), ``resid_mid``, ``attn_out``,
            ``mlp_out`` or ``resid_pre``.
        layers: layers to patch (None = all).
        published_compat: reproduce the published implementation (trailing space kept in the prompt, the source's
            final-norm output patched at the last layer, log-softmax in the model dtype).
        batch_size: examples per batch; None chooses from a memory budget.
        dtype / device: for models this auditor loads itself (default fp32 on CPU, bf16 on CUDA).
        engine: ``fast`` (default) or ``naive`` (the oracle: one full forward per layer).
    """

    tau: float = 0.05
    patch_scope: str = "span"
    site: str = "resid_post"
    layers: tuple[int, ...] | None = None
    published_compat: bool = False
    batch_size: int | None = None
    dtype: str | None = None
    device: str | None = None
    engine: str = "fast"

    def __post_init__(self) -> None:
        if self.patch_scope not in SCOPES:
            raise ValueError(f"patch_scope must be one of {SCOPES}, got {self.patch_scope!r}.")
        if self.site not in SITES:
            raise ValueError(f"site must be one of {SITES}, got {self.site!r}.")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}.")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError("batch_size must be a positive integer (or None to choose from memory).")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(layer) for layer in self.layers))
        if not math.isfinite(self.tau):
            raise ValueError("tau must be a finite number of nats.")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layers"] = list(self.layers) if self.layers is not None else None
        return out


# ----------------------------------------------------------------------------------------------------------------
# Stage results and the S1 cache


@dataclass
class StageOne:
    """Everything that depends only on (full, retain, data, settings), per scored example, in encoded order."""

    idx: list[int]
    s_full: Float[Tensor, " example"]
    baseline: Float[Tensor, "example layer"]
    s1: Float[Tensor, "example layer"] | None
    seconds: float = 0.0
    cached: bool = False


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def layout_digest(encoded: Sequence[EncodedExample]) -> str:
    return _digest([[e.idx, list(e.input_ids), e.prompt_len, e.entity_start, e.entity_end] for e in encoded])


class S1Cache:
    """S1 on disk: one file per fingerprint; stale entries are never read, corrupt ones are rebuilt with a warning."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else DEFAULT_CACHE_DIR

    def path(self, key: str) -> Path:
        return self.directory / f"s1_{key[:32]}.pt"

    def load(self, key: str, payload: dict[str, Any]) -> StageOne | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            stored = torch.load(path, map_location="cpu", weights_only=False)
            if stored.get("format") != CACHE_FORMAT or stored.get("payload") != payload:
                raise ValueError("fingerprint payload does not match")
            return StageOne(idx=list(stored["idx"]), s_full=stored["s_full"], baseline=stored["baseline"],
                            s1=stored["s1"], cached=True)
        except Exception as err:  # any unreadable or inconsistent file is rebuilt
            warnings.warn(f"S1 cache {path} is unreadable or inconsistent ({err}); recomputing S1.", stacklevel=2)
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, payload: dict[str, Any], stage: StageOne) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"format": CACHE_FORMAT, "payload": payload, "idx": stage.idx, "s_full": stage.s_full.cpu(),
                    "baseline": stage.baseline.cpu(), "s1": None if stage.s1 is None else stage.s1.cpu()}, tmp)
        os.replace(tmp, path)
        return path


# ----------------------------------------------------------------------------------------------------------------
# The auditor


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("uds_lens", "torch", "transformer-lens", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "unknown"
    return out


def model_name(source: Any) -> str:
    """Result name of a model: a directory's basename, or a hub id with ``/`` replaced by ``__``."""
    described = models.describe(source)
    path = Path(described).expanduser()
    if path.is_dir():
        return path.resolve().name
    return described.replace("/", "__")


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
    ) -> None:
        self.config = config or UDSConfig()
        self.progress = progress
        self.device = self.config.device or models.default_device()
        self.full = self._load(full, "full")
        self.full_name = models.describe(full)
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
        self.retain_name = models.describe(retain) if retain is not None else None
        if self.retain is not None:
            models.check_compatible(self.full, self.retain, "full", "retain")
        self.examples: list[Example] = load_examples(data, limit=limit)
        self.data_name = str(data) if isinstance(data, (str, os.PathLike)) else "<records>"
        self.encoded, self.skipped = encode(self.examples, tokenizer, self.config.published_compat)
        n_layers = self.full.cfg.n_layers
        self.layers = list(self.config.layers) if self.config.layers is not None else list(range(n_layers))
        bad = [layer for layer in self.layers if not 0 <= layer < n_layers]
        if bad:
            raise ValueError(f"Layers {bad} do not exist: the full model has {n_layers} layers (0..{n_layers - 1}).")
        self.cache = None if cache_dir is False else S1Cache(cache_dir if cache_dir is not True else None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._batches = self._make_batches()
        self._clean: dict[int, CleanRun] = {}
        self._stage1: StageOne | None = None

    # -- loading -----------------------------------------------------------------------------------------------

    def load(self, model: Any, role: str = "unlearned") -> Any:
        """A model as this auditor runs it: a path or hub id is loaded in the auditor's dtype and device; a
        HookedTransformer or Hugging Face model is returned as is."""
        return self._load(model, role)

    def _load(self, model: Any, role: str) -> Any:
        if isinstance(model, (str, os.PathLike)):
            return models.load_model(model, dtype=self.config.dtype, device=self.device)
        if isinstance(model, HookedTransformer) or hasattr(model, "config"):
            return model
        raise TypeError(f"{role} must be a checkpoint path, hub id, HookedTransformer or Hugging Face model.")

    @property
    def upcast(self) -> bool:
        return not self.config.published_compat

    # -- batching ----------------------------------------------------------------------------------------------

    def _make_batches(self) -> list[list[int]]:
        """Example indices per batch, similar lengths together (less padding); deterministic."""
        if not self.encoded:
            return []
        size = self.config.batch_size or choose_batch_size(
            self.full, self.encoded, self.config.patch_scope, self.config.engine)
        return plan_batches(self.encoded, self.config.patch_scope, size)

    def _batch(self, members: list[int]) -> PatchBatch:
        return pad_batch([self.encoded[i] for i in members], self.pad_id, self.config.patch_scope,
                         cut=self.config.engine == "fast").to(self.full.cfg.device)

    def _clean_run(self, number: int, batch: PatchBatch) -> CleanRun:
        if number not in self._clean:
            self._clean[number] = clean_run(self.full, batch, self.config.site,
                                            keep_kv=self.config.engine == "fast", upcast=self.upcast)
        return self._clean[number]

    def _source_scores(self, source: Any, batch: PatchBatch, number: int) -> Tensor:
        return source_scores(self.full, source, batch, self.config.site, self.layers, self.config.engine,
                             self._clean_run(number, batch), self.upcast, self.config.published_compat)

    # -- Stage 1 -----------------------------------------------------------------------------------------------

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
            key = _digest(payload)
            cached = self.cache.load(key, payload)
            if cached is not None and cached.idx == [e.idx for e in self.encoded]:
                logger.info("S1 cache hit: %s", self.cache.path(key))
                return cached
        started = time.perf_counter()
        n, n_layers = len(self.encoded), len(self.layers)
        s_full = torch.full((n,), float("nan"))
        baseline = torch.full((n, n_layers), float("nan"))
        s1 = torch.full((n, n_layers), float("nan")) if self.retain is not None else None
        for number, members in enumerate(tqdm(self._batches, desc="S1 (retain -> full)", unit="batch",
                                              disable=not self.progress)):
            batch = self._batch(members)
            clean = self._clean_run(number, batch)
            s_full[members] = clean.scores.float().cpu()
            baseline[members] = baseline_scores(self.full, batch, clean, self.config.site, self.layers,
                                                self.config.engine, self.upcast).float().cpu()
            if s1 is not None:
                s1[members] = self._source_scores(self.retain, batch, number).float().cpu()
        stage = StageOne(idx=[e.idx for e in self.encoded], s_full=s_full, baseline=baseline, s1=s1,
                         seconds=time.perf_counter() - started)
        _check_finite(stage.s_full, self.encoded, "the full model's clean score")
        if self.cache is not None and key is not None and payload is not None:
            self.cache.save(key, payload, stage)
        return stage

    def d1(self) -> Float[Tensor, "example layer"] | None:
        stage = self.stage1
        return None if stage.s1 is None else deltas(stage.baseline, stage.s1)

    # -- Stage 2 -----------------------------------------------------------------------------------------------

    def score(self, unlearned: Any, name: str | None = None) -> Any:
        """Score one unlearned model (path, hub id, HookedTransformer, or Hugging Face model as a source)."""
        from uds_lens.results import UDSResult

        source_label = models.describe(unlearned)
        source = self._load(unlearned, "unlearned")
        models.check_compatible(self.full, source, "full", source_label)
        stage = self.stage1
        started = time.perf_counter()
        s2 = torch.full((len(self.encoded), len(self.layers)), float("nan"))
        for number, members in enumerate(tqdm(self._batches, desc=f"S2 ({model_name(unlearned)} -> full)",
                                              unit="batch", disable=not self.progress)):
            batch = self._batch(members)
            s2[members] = self._source_scores(source, batch, number).float().cpu()
        _check_finite(s2, self.encoded, f"the patched scores of {source_label}")
        s2_seconds = time.perf_counter() - started
        timings = {"s1_seconds": stage.seconds, "s2_seconds": s2_seconds, "s1_cached": stage.cached,
                   "n_examples": len(self.examples),
                   "s2_seconds_per_example": s2_seconds / max(1, len(self.encoded))}
        return UDSResult.from_stages(
            name=name or model_name(unlearned),
            encoded=self.encoded,
            skipped=self.skipped,
            layers=self.layers,
            s_full=stage.s_full,
            baseline=stage.baseline,
            s1=stage.s1,
            s2=s2,
            config=self.config,
            meta={
                "full": self.full_name, "retain": self.retain_name, "unlearned": source_label, "data": self.data_name,
                "versions": _versions(), "device": str(self.full.cfg.device), "dtype": str(self.full.cfg.dtype),
                "engine": self.config.engine, "timings": timings,
                "prompt_types": {e.idx: e.prompt_type for e in self.examples},
            },
        )

    def score_many(self, unlearned: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        """Score several models; S1 and the clean runs are shared. Returns ``{name: UDSResult}``."""
        items = unlearned.items() if isinstance(unlearned, dict) else ((model_name(u), u) for u in unlearned)
        return {name: self.score(model, name=name) for name, model in items}


def _check_finite(values: Tensor, encoded: Sequence[EncodedExample], what: str) -> None:
    bad = ~torch.isfinite(values)
    if bad.any():
        rows = bad.reshape(len(encoded), -1).any(-1)
        idx = [encoded[i].idx for i in torch.nonzero(rows)[:, 0].tolist()][:10]
        raise FloatingPointError(
            f"NaN/inf in {what} for example idx {idx}: the model produced non-finite log-probs. Check the "
            "checkpoint's weights, or run in float32 (--dtype float32)."
        )


__all__ = [
    "DEFAULT_CACHE_DIR", "S1Cache", "StageOne", "UDSAuditor", "UDSConfig", "bootstrap_ci", "deltas", "example_uds",
    "ke_mask", "layer_erasure_ratio", "model_name", "model_uds", "score_models", "Skip",
]


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
) -> dict[str, Any]:
    """Score several unlearned models against one (full, retain, data), saving each under ``out_dir/NAME/``.

    A model whose ``out_dir/NAME/summary.json`` already exists with the same settings is loaded, not recomputed,
    so an interrupted sweep resumes where it stopped.
    """
    from uds_lens.results import UDSResult

    config = config or UDSConfig()
    items = list(unlearned.items()) if isinstance(unlearned, dict) else [(model_name(u), u) for u in unlearned]
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"Two unlearned models share a result name ({names}); pass a dict of unique names.")
    results: dict[str, Any] = {}
    auditor: UDSAuditor | None = None
    for name, model in items:
        target = Path(out_dir) / name if out_dir is not None else None
        if target is not None and (target / "meta.json").is_file():
            previous = UDSResult.load(target)
            if {k: v for k, v in previous.settings.items() if k != "tau"} == {
                    k: v for k, v in config.to_dict().items() if k != "tau"} and previous.meta.get("unlearned") == \
                    models.describe(model):
                results[name] = previous.with_tau(config.tau)
                logger.info("%s: reusing the saved result in %s", name, target)
                continue
        if auditor is None:
            auditor = UDSAuditor(full, retain, data, config=config, cache_dir=cache_dir, progress=progress,
                                 limit=limit)
        results[name] = auditor.score(model, name=name)
        if target is not None:
            results[name].save(target)
    return results

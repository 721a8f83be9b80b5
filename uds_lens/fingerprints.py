"""Fingerprints: what a saved result and the S1 cache depend on, as JSON-ready digests.

A model is identified by its weights (file contents or tensor digests), never by its path; a forget set by its records
after ``limit``; the settings by the config without the values results do not depend on. Two runs with equal
fingerprints give the same tables, so a saved result is reused only when its fingerprint equals the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeAlias

from huggingface_hub.constants import HF_HUB_CACHE
from transformers import PreTrainedTokenizerBase

from uds_lens import checkpoint, models
from uds_lens.checkpoint import model_fingerprint
from uds_lens.config import UDSConfig
from uds_lens.data import EncodedExample, Example, load_examples
from uds_lens.files import json_digest
from uds_lens.resolve import CheckpointRef, ModelLoadError, resolve_zoo_name
from uds_lens.sources import as_source
from uds_lens.tl_compat import ModelLike

ModelArg: TypeAlias = CheckpointRef | ModelLike
"""A model as the auditor takes it: a checkpoint directory, ``.gguf`` file, hub id or ``zoo:NAME``, or a model in
memory (a TransformerBridge, a HookedTransformer or a Hugging Face causal LM)."""
DataArg: TypeAlias = str | os.PathLike | Sequence[dict[str, Any]] | Sequence[Example] | None
"""A forget set as ``data.load_examples`` takes it: a JSON/JSONL path, a hub dataset id, records or ``Example``s."""


def library_versions() -> dict[str, str]:

    out = {}
    for package in ("uds_lens", "torch", "transformer-lens", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "unknown"
    return out


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def layout_digest(encoded: Sequence[EncodedExample]) -> str:
    return json_digest(
        [[e.idx, list(e.input_ids), e.prompt_len, e.entity_start, e.entity_end] for e in encoded]
    )


# 2: in-memory models are hashed by their Hugging Face tensors (TransformerBridge backend); numbers move at float noise.
# 3: ``s1``, the digest of the Stage 1 values a result was computed from, is part of it.
RESULT_FINGERPRINT_FORMAT = 3


def _hub_revision(model_id: str) -> str | None:
    """The commit a hub id resolves to in the local Hugging Face cache (offline; None when not cached)."""
    ref = Path(HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}" / "refs" / "main"
    return ref.read_text().strip() if ref.is_file() else None


def source_fingerprint(source: ModelArg | None) -> str | None:
    """Identity of a model's weights, never of its path.

    A local checkpoint directory (or ``.gguf`` file) is identified by the contents of its weight, config and
    tokenizer files (``checkpoint.file_digest``: scheme and version in the string, so a change of digest re-keys
    saved results instead of misreading them), an in-memory model by a digest of its tensors (``model_fingerprint``), a hub id by itself
    and the cached commit it resolves to. None stands for "no model" (retain-free mode).
    """
    if source is None:
        return None
    if isinstance(source, (str, os.PathLike)):
        try:  # "zoo:NAME" is identified by its directory's files, like any other path
            source = resolve_zoo_name(source)
        except ModelLoadError:
            pass  # a zoo name that names no model: identified by itself, and loading it fails with the reason
        path = Path(source).expanduser()
        if path.exists():
            return "files:" + checkpoint.file_digest(path)
        return f"hub:{source}@{_hub_revision(str(source)) or 'unresolved'}"
    return "tensors:" + model_fingerprint(source)


def examples_fingerprint(examples: Sequence[Example]) -> str:
    """Digest of a forget set as scored (after ``limit``): every field of every record, in order."""
    return json_digest([example.to_record() for example in examples])[:32]


def settings_fingerprint(config: UDSConfig, full: ModelArg | None = None) -> dict[str, Any]:
    """The settings a result depends on: the config without tau (re-applied to saved deltas), batch size (results
    are invariant to it), device and the Stage 2 cells (:func:`stage2_fingerprint` keys those), and the precision
    check's settings where it does nothing (fp32); plus the dtype the full model runs in."""
    settings = config.to_dict()
    for volatile in ("tau", "batch_size", "device", "stage2_cells"):
        settings.pop(volatile)
    if full is not None and not isinstance(full, (str, os.PathLike)):
        settings["dtype"] = str(as_source(full).dtype)
    else:
        settings["dtype"] = str(models.resolve_dtype(config.dtype, config.device or models.default_device()))
    if settings["dtype"] not in ("torch.bfloat16", "torch.float16"):  # the precision check acts on these only
        settings.pop("precision_check")
        settings.pop("precision_tolerance")
    return settings


def stage2_fingerprint(config: UDSConfig, retain_free: bool = False) -> dict[str, Any] | None:
    """Which cells Stage 2 ran, when not all of them: ``{"cells": "ke", "tau": tau}`` (the KE cells depend on tau),
    None for every cell (``stage2_cells`` ``all`` or None, and always in retain-free mode, which has no KE cells).

    A result fingerprint holds it under ``stage2`` only when it is not None, so every-cell results keep the
    fingerprints they were saved with. It is not an input (``result_store.INPUT_KEYS``): a saved result of other
    cells is recomputed, never refused as another run's.
    """
    if config.stage2_cells != "ke" or retain_free:
        return None
    return {"cells": "ke", "tau": config.tau}


def inputs_fingerprint(
    full: ModelArg,
    retain: ModelArg | None,
    examples: Sequence[Example],
    config: UDSConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    loaded_full: ModelArg | None = None,
) -> dict[str, Any]:
    """The keys of a result fingerprint that every model scored against the same inputs shares: ``format``,
    ``full``, ``retain`` (:func:`source_fingerprint` of the arguments as given), ``data`` (the records as scored),
    ``tokenizer`` (``"from full"`` unless one is passed explicitly) and ``settings`` (:func:`settings_fingerprint`,
    its dtype read from ``loaded_full``, the model ``full`` loaded as, when there is one). The one place that lays
    the dict out: :func:`result_fingerprint` and ``UDSAuditor.fingerprint`` complete it with :func:`with_unlearned`.
    """
    return {
        "format": RESULT_FINGERPRINT_FORMAT,
        "full": source_fingerprint(full),
        "retain": source_fingerprint(retain),
        "data": examples_fingerprint(examples),
        "tokenizer": "from full" if tokenizer is None else tokenizer_digest(tokenizer),
        "settings": settings_fingerprint(config, full if loaded_full is None else loaded_full),
    }


def with_unlearned(
    inputs: dict[str, Any], unlearned: ModelArg | None, config: UDSConfig, retain_free: bool
) -> dict[str, Any]:
    """``inputs`` (:func:`inputs_fingerprint`, and ``s1`` where an auditor adds it) completed for one scored model:
    ``unlearned`` (:func:`source_fingerprint`) and, for a KE-only Stage 2, ``stage2`` (:func:`stage2_fingerprint`)."""
    fingerprint = {**inputs, "unlearned": source_fingerprint(unlearned)}
    stage2 = stage2_fingerprint(config, retain_free=retain_free)
    if stage2 is not None:
        fingerprint["stage2"] = stage2
    return fingerprint


def result_fingerprint(
    full: ModelArg,
    retain: ModelArg | None,
    unlearned: ModelArg | None,
    data: DataArg,
    config: UDSConfig | None = None,
    limit: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> dict[str, Any]:
    """Everything a saved UDS result depends on, as a JSON-ready dict; two runs with equal fingerprints give the
    same tables, so a saved result may be reused only when its fingerprint equals the new one
    (``results.load_reusable``).

    Keys: ``format``, ``full``, ``retain``, ``unlearned`` (:func:`source_fingerprint`: file contents or tensor
    digests, so a checkpoint retrained in place changes it), ``data`` (the records after ``limit``),
    ``tokenizer`` (``"from full"`` unless one is passed explicitly), ``settings`` (:func:`settings_fingerprint`),
    and ``stage2`` for a KE-only Stage 2 (:func:`stage2_fingerprint`).
    Loads no model; reads the data and hashes the checkpoint files (memoised by size and modification time).
    ``UDSAuditor.fingerprint(unlearned)`` gives the same dict for an auditor's inputs plus ``s1``, the digest of
    the Stage 1 values (which needs the models): a saved result is reused only when that matches too.
    """
    config = config or UDSConfig()
    inputs = inputs_fingerprint(full, retain, load_examples(data, limit=limit), config, tokenizer)
    return with_unlearned(inputs, unlearned, config, retain_free=retain is None)

"""Fingerprints: what a saved result and the S1 cache depend on, as JSON-ready digests.

A model is identified by its weights (file contents or tensor digests), never by its path; a forget set by its records
after ``limit``; the settings by the config without the values results do not depend on. Two runs with equal
fingerprints give the same tables, so a saved result is reused only when its fingerprint equals the new one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from transformers import PreTrainedTokenizerBase

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.loader import default_device, resolve_dtype
from uds_lens.config import UDSConfig
from uds_lens.data import EncodedExample
from uds_lens.files import json_digest
from uds_lens.inputs import RunInputs
from uds_lens.tl_compat import ModelLike, is_tl_model


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
# 4: a checkpoint is identified by the bytes its load read (a digest remembered by a stamp without ctime could name
#    other bytes), a model in memory by XXH3-128 of its tensors (was SHA-256): a result of format 3 is recomputed.
RESULT_FINGERPRINT_FORMAT = 4


def settings_fingerprint(config: UDSConfig, model: ModelLike | None = None) -> dict[str, Any]:
    """The settings a result depends on: the config without tau (re-applied to saved deltas), batch size (results
    are invariant to it), device and the Stage 2 cells (`stage2_fingerprint` keys those), and the precision
    check's settings where it does nothing (fp32); plus the dtype the full model runs in."""
    settings = config.to_dict()
    for volatile in ("tau", "batch_size", "device", "stage2_cells"):
        settings.pop(volatile)
    if model is not None:  # the dtype it computes in: a TransformerLens model's config, else its weights'
        settings["dtype"] = str(model.cfg.dtype if is_tl_model(model) else next(model.parameters()).dtype)
    else:
        settings["dtype"] = str(resolve_dtype(config.dtype, config.device or default_device()))
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
    inputs: RunInputs,
    loaded_full: ModelLike | None = None,
    config: UDSConfig | None = None,
    identities: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The keys of a result fingerprint that every model scored against the same inputs shares: ``format``,
    ``full``, ``retain`` (each checkpoint's identity: ``identities[role]`` where given, the
    `Checkpoint.loaded_fingerprint` of the model an auditor loaded, else `Checkpoint.fingerprint`, its files as they
    are now), ``data`` (the records as scored), ``tokenizer`` (``"from full"`` unless one is passed explicitly) and
    ``settings`` (`settings_fingerprint` of ``config``, default the inputs', its dtype read from ``loaded_full``, the
    model ``full`` loaded as, when there is one). The one place that lays the dict out: `result_fingerprint` and
    ``UDSAuditor.fingerprint`` complete it with `with_unlearned`.
    """
    known = identities or {}
    return {
        "format": RESULT_FINGERPRINT_FORMAT,
        "full": known.get("full") or inputs.full.fingerprint,
        "retain": None if inputs.retain is None else known.get("retain") or inputs.retain.fingerprint,
        "data": inputs.data_digest,
        "tokenizer": "from full" if inputs.tokenizer is None else tokenizer_digest(inputs.tokenizer),
        "settings": settings_fingerprint(config or inputs.config, loaded_full or inputs.full.model),
    }


def stage1_inputs_key(
    inputs: RunInputs, identities: Mapping[str, str] | None = None, known_only: bool = False
) -> str | None:
    """The key under which the S1 cache indexes the Stage 1 of ``inputs`` (`stage_cache.S1Cache.find`), from the
    resolved inputs alone, before any model is loaded: full's and retain's identities (``identities[role]``, the
    bytes an auditor's loads read, where given; else `Checkpoint.fingerprint`, their files as they are now), the
    examples (`RunInputs.data_digest`), the tokenizer, the settings but those no
    result depends on, and the device and dtype the models load in. Everything an auditor's S1 payload and results'
    fingerprints hold is decided by these, so equal keys select the same cache entry.

    None where a checkpoint is not a file on this machine (a hub id names no bytes before its load; a model in memory
    is loaded already): then only an auditor's models key its Stage 1. With ``known_only``, None too where a
    checkpoint's stamp proves no remembered digest (`Checkpoint.known_digest`): its files are not hashed apart from
    the load that will read them."""
    known = dict(identities or {})
    checkpoints = {"full": inputs.full, "retain": inputs.retain}
    if any(c is not None and (not c.local or c.model is not None) for c in checkpoints.values()):
        return None
    for role, checkpoint in checkpoints.items():
        if known_only and checkpoint is not None and role not in known:
            digest = checkpoint.known_digest()
            if digest is None:
                return None
            known[role] = "files:" + digest
    config = inputs.config
    settings = config.to_dict()
    for volatile in ("tau", "batch_size", "stage2_cells"):
        settings.pop(volatile)
    device = config.device or default_device()
    return json_digest(
        {
            "format": RESULT_FINGERPRINT_FORMAT,
            **{
                role: None if c is None else known.get(role) or c.fingerprint
                for role, c in checkpoints.items()
            },
            "data": inputs.data_digest,
            "tokenizer": "from full" if inputs.tokenizer is None else tokenizer_digest(inputs.tokenizer),
            "settings": settings,
            "device": str(device),
            "dtype": str(resolve_dtype(config.dtype, device)),
        }
    )


def with_unlearned(
    inputs: dict[str, Any],
    unlearned: Checkpoint | None,
    config: UDSConfig,
    retain_free: bool,
    identity: str | None = None,
) -> dict[str, Any]:
    """``inputs`` (`inputs_fingerprint`, and ``s1`` where an auditor adds it) completed for one scored model:
    ``unlearned`` (``identity``, the `Checkpoint.loaded_fingerprint` of the model scored, where given; else its
    `Checkpoint.fingerprint`) and, for a KE-only Stage 2, ``stage2`` (`stage2_fingerprint`)."""
    if identity is None and unlearned is not None:
        identity = unlearned.fingerprint
    fingerprint = {**inputs, "unlearned": identity}
    stage2 = stage2_fingerprint(config, retain_free=retain_free)
    if stage2 is not None:
        fingerprint["stage2"] = stage2
    return fingerprint


def result_fingerprint(
    inputs: RunInputs, unlearned: Checkpoint | None, config: UDSConfig | None = None
) -> dict[str, Any]:
    """Everything a saved UDS result depends on, as a JSON-ready dict; two runs with equal fingerprints give the
    same tables, so a saved result may be reused only when its fingerprint equals the new one
    (``results.load_reusable``).

    Keys: ``format``, ``full``, ``retain``, ``unlearned`` (`Checkpoint.fingerprint`: file contents or tensor
    digests, so a checkpoint retrained in place changes it), ``data`` (the records after ``limit``),
    ``tokenizer`` (``"from full"`` unless one is passed explicitly), ``settings`` (`settings_fingerprint`),
    and ``stage2`` for a KE-only Stage 2 (`stage2_fingerprint`, of ``config``: default the inputs').
    Loads no model and reads no data (the inputs hold the examples); a checkpoint's digest is remembered by file
    identity, or read once. ``UDSAuditor.fingerprint(unlearned)`` gives the same dict for an auditor's inputs plus
    ``s1``, the digest of the Stage 1 values (which needs the models): a saved result is reused only when that
    matches too.
    """
    config = config or inputs.config
    return with_unlearned(inputs_fingerprint(inputs), unlearned, config, retain_free=inputs.retain is None)

"""Whether full, retain and the unlearned models can be patched into each other: one family, one tokenizer, one shape.

UDS writes activations of one model into another and reads the result through the full model's tokenizer: the token
ids the forget set is encoded into must mean the same token to every model, and every hook site must hold the same
quantity. So before any compute the models must agree on

- their family (``model_type``): a Gemma-2 block's ``attn_out`` is its post-attention norm's output, a Llama
  block's is ``o_proj``'s (docs/DESIGN.md, "Families"); patching one into the other gives a number but no meaning;
- their tokenizer: the same vocabulary (every token string with the same id, not only the same size), the same
  merges, and the same special tokens (beginning, end, unknown). Metadata a tokenizer is saved with (its maximum
  length, a chat template, the padding side) is not compared: it does not change what an id means;
- their shapes (``models.ArchitectureSignature``: layers, widths, heads, vocabulary size).

A mismatch is a [`ModelMismatchError`][uds_lens.models.ModelMismatchError] naming the two models and what differs.
`check_checkpoints` runs on checkpoint references before anything is loaded (configs and tokenizers only,
plus the weight files' headers against the config, ``weights.check_config_size``); `check_loaded` runs on
loaded models (what ``UDSAuditor`` holds), so in-memory models are checked too.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from uds_lens import models
from uds_lens.checkpoint import stored_shapes
from uds_lens.resolve import CheckpointRef, CheckpointSource, ModelLoadError, describe, resolve_source
from uds_lens.tl_compat import ModelLike, hf_model_of, is_hooked_transformer, is_tl_model
from uds_lens.weights import check_config_size

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# The special tokens whose text must agree: they are written into prompts (beginning) or end answers.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token")
# Differing tokens (or tensors) named in a message before "and N more".
TOKENS_SHOWN = 3
# The unembedding, which a checkpoint of tied embeddings may or may not store.
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ModelIdentity:
    """What two models must share to be patched into each other, and how messages name the model.

    Attributes:
        label: the model as messages name it (``"retain (/ckpt/retain)"``).
        model_type: the Hugging Face family, or None when unknown (a TransformerLens 3.x ``HookedTransformer``).
        signature: the shapes.
        tokenizer: its fast tokenizer, or None when the checkpoint ships none (then only the vocabulary size of
            ``signature`` is compared).
        tokenizer_files: the digest of the files it was read from (`tokenizer_files_digest`), when it was
            read from a checkpoint: equal digests are one tokenizer, compared no further.
        tensors: ``{name: shape}`` its ``.safetensors`` files hold (headers only), when known: fine-tunes of one
            model hold the same tensors, so one that lacks a tensor full's files hold is refused before any
            compute (its loader would refuse it too, but only once Stage 1 had run).
    """

    label: str
    model_type: str | None
    signature: models.ArchitectureSignature
    tokenizer: PreTrainedTokenizerBase | None = None
    tokenizer_files: str | None = None
    tensors: dict[str, tuple[int, ...]] | None = None


# Files a tokenizer is read from; two checkpoints whose files are byte-identical have one tokenizer (no comparison).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# Tokenizers already read, by the digest of their files: a sweep reads each distinct tokenizer once.
_TOKENIZERS: dict[str, PreTrainedTokenizerBase] = {}


def tokenizer_files_digest(directory: str | os.PathLike) -> str | None:
    """XXH3-128 of a checkpoint directory's tokenizer files (names and bytes), or None when it has none."""
    root = Path(directory)
    present = [root / name for name in TOKENIZER_FILES if (root / name).is_file()]
    if not present:
        return None
    hasher = xxhash.xxh3_128()
    for file in present:
        hasher.update(file.name.encode() + b"\0")
        hasher.update(file.read_bytes())
    return hasher.hexdigest()


def _local_source(path_or_id: object) -> CheckpointSource | None:
    """The resolved source of a checkpoint reference on this machine; None for anything else (a hub id is checked
    once loaded: a check fetches nothing), or for what names no checkpoint (its loader says so, where it loads)."""
    if not isinstance(path_or_id, (str, os.PathLike)):
        return None
    try:
        source = resolve_source(path_or_id)
    except ModelLoadError:
        return None
    return source if source.local else None


def checkpoint_tokenizer(path_or_id: CheckpointRef | None) -> PreTrainedTokenizerBase | None:
    """A local checkpoint directory's own tokenizer, or None: a checkpoint without tokenizer files, a ``.gguf``
    (its tokenizer is rebuilt from the file: seconds) or a hub id (not fetched for a check). Read once per
    distinct set of tokenizer files."""
    return _tokenizer_and_digest(_local_source(path_or_id))[0]


def _tokenizer_and_digest(
    source: CheckpointSource | None,
) -> tuple[PreTrainedTokenizerBase | None, str | None]:
    if source is None or source.kind != "directory":
        return None, None
    digest = tokenizer_files_digest(source.location)
    if digest is None:
        return None, None
    if digest not in _TOKENIZERS:
        try:
            _TOKENIZERS[digest] = models.read_tokenizer(source)
        except (ModelLoadError, OSError, ValueError, TypeError):
            return None, None
    return _TOKENIZERS[digest], digest


def identity_of_checkpoint(source: CheckpointSource, role: str) -> ModelIdentity:
    """A checkpoint's identity from its config and tokenizer files, without building the model; its config's size
    is checked against its weight files first (``weights.check_config_size``), so a config describing another model
    is refused here."""
    label = f"{role} ({source})"
    config = models.read_config(source)
    models.check_supported(config, str(source))
    shapes: dict[str, tuple[int, ...]] = {}
    if source.kind == "directory":
        with models.loader_errors(source, "weights"):
            shapes = stored_shapes(source.location)
        if shapes:
            check_config_size(source.location, config, shapes.values(), models.default_dtype("cpu"), None)
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop(TIED_HEAD, None)  # saved by some writers and not by others: the same model either way
    return ModelIdentity(
        label,
        getattr(config, "model_type", None),
        models.ArchitectureSignature.of_config(config),
        *_tokenizer_and_digest(source),
        tensors=shapes or None,
    )


def identity_of_model(
    model: ModelLike, role: str, tokenizer: PreTrainedTokenizerBase | None = None
) -> ModelIdentity:
    """A loaded model's identity; ``tokenizer`` defaults to its checkpoint's own (``model.uds_source``)."""
    name = describe(model)
    digest = None
    if tokenizer is None:
        tokenizer, digest = _tokenizer_and_digest(_local_source(getattr(model, "uds_source", None)))
    model_type = None
    if not is_hooked_transformer(model):
        hf = hf_model_of(model) if is_tl_model(model) else model
        model_type = getattr(getattr(hf, "config", None), "model_type", None)
    return ModelIdentity(
        f"{role} ({name})", model_type, models.ArchitectureSignature.of(model), tokenizer, digest
    )


def _merges(tokenizer: PreTrainedTokenizerBase) -> list[str] | None:
    """A BPE tokenizer's merges as ``"a b"`` strings (tokenizers writes them as strings or as pairs), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    merges = json.loads(backend.to_str()).get("model", {}).get("merges")
    if merges is None:
        return None
    return [" ".join(pair) if isinstance(pair, list) else str(pair) for pair in merges]


def tokenizer_differences(first: PreTrainedTokenizerBase, second: PreTrainedTokenizerBase) -> list[str]:
    """What makes two tokenizers encode text into ids that mean different tokens, in words (empty: none)."""
    differences = []
    vocab_a, vocab_b = first.get_vocab(), second.get_vocab()
    if vocab_a != vocab_b:
        moved = sorted(
            (token for token in set(vocab_a) | set(vocab_b) if vocab_a.get(token) != vocab_b.get(token)),
            key=lambda token: min(vocab_a.get(token, 1 << 62), vocab_b.get(token, 1 << 62)),
        )
        examples = ", ".join(
            f"{token!r}: {vocab_a.get(token, 'absent')} vs {vocab_b.get(token, 'absent')}"
            for token in moved[:TOKENS_SHOWN]
        )
        differences.append(
            f"the vocabularies differ ({len(vocab_a)} and {len(vocab_b)} tokens; {len(moved)} tokens have another "
            f"id or none, e.g. {examples})"
        )
    elif _merges(first) != _merges(second):
        differences.append("the tokenizers' merges differ (the same vocabulary splits text otherwise)")
    for special in SPECIAL_TOKENS:
        a, b = getattr(first, special, None), getattr(second, special, None)
        if a != b:
            differences.append(f"{special} differs ({a!r} vs {b!r})")
    return differences


def _tensor_differences(first: dict[str, tuple[int, ...]], second: dict[str, tuple[int, ...]]) -> str:
    def named(names: list[str]) -> str:
        return ", ".join(names[:TOKENS_SHOWN]) + (
            f" and {len(names) - TOKENS_SHOWN} more" if len(names) > TOKENS_SHOWN else ""
        )

    parts = []
    lacking = sorted(set(first) - set(second))
    extra = sorted(set(second) - set(first))
    reshaped = sorted(name for name in set(first) & set(second) if first[name] != second[name])
    if lacking:
        parts.append(
            f"its weight files lack {named(lacking)}, which full's hold (they would be initialised at random)"
        )
    if extra:
        parts.append(
            f"full's weight files lack {named(extra)}, which its hold (one of the two is incomplete)"
        )
    if reshaped:
        parts.append(f"{named(reshaped)} have other shapes")
    return "; ".join(parts)


def differences(first: ModelIdentity, second: ModelIdentity) -> list[str]:
    """What differs between two models, in words (empty: they can be patched into each other)."""
    found = []
    if first.model_type and second.model_type and first.model_type != second.model_type:
        found.append(f"model_type {first.model_type!r} vs {second.model_type!r}")
    a, b = first.signature, second.signature
    found += [
        f"{key} {getattr(a, key)} vs {getattr(b, key)}"
        for key in a.__dataclass_fields__
        if getattr(a, key) != getattr(b, key)
    ]
    if first.tensors is not None and second.tensors is not None and first.tensors != second.tensors:
        found.append(_tensor_differences(first.tensors, second.tensors))
    same_files = first.tokenizer_files is not None and first.tokenizer_files == second.tokenizer_files
    if first.tokenizer is not None and second.tokenizer is not None and not same_files:
        found += tokenizer_differences(first.tokenizer, second.tokenizer)
    return found


def check_identities(reference: ModelIdentity, others: Iterable[ModelIdentity]) -> None:
    """Refuse models that differ from ``reference`` (the full model), naming each and what differs.

    Raises:
        models.ModelMismatchError: one line for all of them.
    """
    refusals = []
    for other in others:
        found = differences(reference, other)
        if found:
            refusals.append(f"{other.label} differs from {reference.label}: {'; '.join(found)}")
        elif other.tokenizer is None or reference.tokenizer is None:
            logger.info(
                "%s: no tokenizer to compare with %s; vocabulary size and shapes agree",
                other.label,
                reference.label,
            )
    if refusals:
        raise models.ModelMismatchError(
            " | ".join(refusals)
            + ". UDS patches between checkpoints fine-tuned from one base model with one "
            "tokenizer: pass models of the same family and tokenizer."
        )


def check_checkpoints(
    full: object,
    retain: object,
    unlearned: Sequence[tuple[str, object]] = (),
    skip_unreadable: bool = False,
) -> None:
    """Before anything is loaded: full, retain and every unlearned model given as a checkpoint reference are one
    family with one tokenizer and one shape. Models already in memory are left to `check_loaded`, and nothing
    is compared when full itself is in memory.

    Args:
        unlearned: ``(name, model)`` pairs.
        skip_unreadable: leave an unlearned checkpoint whose config or weight headers cannot be read to its loader
            (a sweep reports it as a failed row and goes on) instead of raising here.

    Raises:
        models.ModelMismatchError: naming every model that differs from full, and what differs.
        ModelLoadError: a checkpoint whose config cannot be read, or does not match its weight files.
    """
    full_source = _local_source(full)
    if full_source is None:
        return
    reference = identity_of_checkpoint(full_source, "full")
    retain_source = _local_source(retain)
    others = [identity_of_checkpoint(retain_source, "retain")] if retain_source is not None else []
    for name, model in unlearned:
        source = _local_source(model)
        if source is None:
            continue
        try:
            others.append(identity_of_checkpoint(source, f"unlearned {name}"))
        except ModelLoadError as error:
            if not skip_unreadable:
                raise
            logger.info("unlearned %s is left to its loader: %s", name, error)
    check_identities(reference, others)


def check_loaded(reference: ModelIdentity, model: ModelLike, role: str) -> None:
    """A loaded model against full's identity (``UDSAuditor`` checks retain and each unlearned model with it)."""
    check_identities(reference, [identity_of_model(model, role)])


__all__ = [
    "SPECIAL_TOKENS",
    "ModelIdentity",
    "check_checkpoints",
    "check_identities",
    "check_loaded",
    "checkpoint_tokenizer",
    "differences",
    "identity_of_checkpoint",
    "identity_of_model",
    "tokenizer_differences",
    "tokenizer_files_digest",
]

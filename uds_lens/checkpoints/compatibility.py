"""Whether full, retain and the unlearned models can be patched into each other: one family, one tokenizer, one shape.

UDS writes activations of one model into another and reads the result through the full model's tokenizer: the token
ids the forget set is encoded into must mean the same token to every model, and every hook site must hold the same
quantity. So before any compute the models must agree on

- their family (``model_type``): a Gemma-2 block's ``attn_out`` is its post-attention norm's output, a Llama
  block's is ``o_proj``'s (docs/DESIGN.md, "Families"); patching one into the other gives a number but no meaning;
- their tokenizer: the same vocabulary (every token string with the same id, not only the same size), the same
  merges, and the same special tokens (beginning, end, unknown). Metadata a tokenizer is saved with (its maximum
  length, a chat template, the padding side) is not compared: it does not change what an id means;
- their shapes (`ArchitectureSignature`: layers, widths, heads, vocabulary size), and, where the weight files'
  headers say, the tensors they hold.

Each model's `ModelIdentity` is made from its `Checkpoint` (`identity_of`), from what the checkpoint read once (its
config, its tokenizer, its tensor headers; a model in memory from its own config and the checkpoint it was loaded
from), and the identities are compared once, where a run's inputs are made (`inputs.RunInputs`), before anything is
loaded: `check_compatible`. A mismatch is a `ModelMismatchError` naming the two models and what differs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.coverage import check_config_size
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.tl_compat import ModelLike, hf_model_of, is_hooked_transformer, is_tl_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# The special tokens whose text must agree: they are written into prompts (beginning) or end answers.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token")
# Differing tokens (or tensors) named in a message before "and N more".
TOKENS_SHOWN = 3
# The unembedding, which a checkpoint of tied embeddings may or may not store.
TIED_HEAD = "lm_head.weight"


class ModelMismatchError(ValueError):
    """Two checkpoints cannot be patched into each other (different family, architecture or vocabulary)."""


@dataclass(frozen=True)
class ArchitectureSignature:
    """What two models must share to be patched into each other."""

    n_layers: int
    d_model: int
    n_heads: int
    n_key_value_heads: int | None
    d_head: int
    d_mlp: int | None  # None only for attention-only models, which TransformerLens allows
    d_vocab: int

    @classmethod
    def of(cls, model: ModelLike) -> ArchitectureSignature:
        """The signature of a model in memory (a bridge's or a Hugging Face model's config, a HookedTransformer's
        ``cfg``)."""
        if is_hooked_transformer(model):
            c = model.cfg
            return cls(c.n_layers, c.d_model, c.n_heads, c.n_key_value_heads, c.d_head, c.d_mlp, c.d_vocab)
        hf = hf_model_of(model) if is_tl_model(model) else model
        if hf is None:
            raise TypeError(f"{type(model).__name__} wraps no Hugging Face model: its shapes are unknown.")
        return cls.of_config(hf.config)

    @classmethod
    def of_config(cls, c: PretrainedConfig) -> ArchitectureSignature:
        """The signature a Hugging Face config describes (no weights needed)."""
        n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            n_kv if n_kv != c.num_attention_heads else None,
            head_dim,
            c.intermediate_size,
            c.vocab_size,
        )


@dataclass(frozen=True)
class ModelIdentity:
    """What two models must share to be patched into each other, and how messages name the model.

    Attributes:
        label: the model as messages name it (``"retain (/ckpt/retain)"``).
        model_type: the Hugging Face family, or None when unknown (a TransformerLens 3.x ``HookedTransformer``).
        signature: the shapes.
        tokenizer: its fast tokenizer, or None when the checkpoint ships none (then only the vocabulary size of
            ``signature`` is compared).
        tokenizer_files: the digest of the files it was read from (`Checkpoint.tokenizer_files`): equal digests are
            one tokenizer, compared no further.
        tensors: ``{name: shape}`` its ``.safetensors`` files hold (headers only), when known: fine-tunes of one
            model hold the same tensors, so one that lacks a tensor full's files hold is refused before any
            compute (its loader would refuse it too, but only once Stage 1 had run).
    """

    label: str
    model_type: str | None
    signature: ArchitectureSignature
    tokenizer: PreTrainedTokenizerBase | None = None
    tokenizer_files: str | None = None
    tensors: dict[str, tuple[int, ...]] | None = None


def own_tokenizer(checkpoint: Checkpoint) -> PreTrainedTokenizerBase | None:
    """The tokenizer a checkpoint ships, to compare: a directory's (when it has tokenizer files and they read), a
    model in memory's checkpoint's; None for a ``.gguf`` (rebuilt from the file: seconds) or a hub id."""
    if checkpoint.model is not None:
        return own_tokenizer(checkpoint.origin) if checkpoint.origin is not None else None
    if checkpoint.kind != "directory" or checkpoint.tokenizer_files is None:
        return None
    try:
        return checkpoint.tokenizer
    except (ModelLoadError, OSError, ValueError, TypeError):
        return None


def identity_of(
    checkpoint: Checkpoint, role: str, tokenizer: PreTrainedTokenizerBase | None = None
) -> ModelIdentity:
    """A model's identity from what its checkpoint read (config, tokenizer, tensor headers), without building the
    model; a directory's config is checked against its weight files first (`coverage.check_config_size`), so a
    config describing another model is refused here. ``tokenizer`` (one passed explicitly) replaces its own.

    Raises:
        ModelLoadError: a config that cannot be read, is of an unsupported family, or does not match the weights.
    """
    label = f"{role} ({checkpoint.label})"
    if checkpoint.model is not None:
        model_type = getattr(checkpoint.model_config, "model_type", None)
        files = checkpoint.tokenizer_files if tokenizer is None else None
        signature = ArchitectureSignature.of(checkpoint.model)
        return ModelIdentity(label, model_type, signature, tokenizer or own_tokenizer(checkpoint), files)
    config = checkpoint.config
    shapes = dict(checkpoint.tensor_shapes or {})
    if shapes:  # the dtype only sizes a memory check, which this one leaves out
        check_config_size(checkpoint.location, config, shapes.values(), torch.float32, None)
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop(TIED_HEAD, None)  # saved by some writers and not by others: the same model either way
    return ModelIdentity(
        label,
        getattr(config, "model_type", None),
        ArchitectureSignature.of_config(config),
        tokenizer or own_tokenizer(checkpoint),
        checkpoint.tokenizer_files if tokenizer is None else None,
        tensors=shapes or None,
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
        ModelMismatchError: one line for all of them.
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
        raise ModelMismatchError(
            " | ".join(refusals)
            + ". UDS patches between checkpoints fine-tuned from one base model with one "
            "tokenizer: pass models of the same family and tokenizer."
        )


def check_compatible(
    reference: ModelIdentity, others: Sequence[tuple[str, Checkpoint]], skip_unreadable: bool = False
) -> dict[str, str]:
    """Every model of ``others`` (``(role, checkpoint)``) against full's identity, before anything is loaded.

    Args:
        reference: full's identity (`identity_of`).
        skip_unreadable: leave a model whose config or weight headers cannot be read out of the comparison (a
            sweep reports it as a failed row and goes on) instead of raising.

    Returns:
        ``{role: why it could not be read}`` of the models left out (empty unless ``skip_unreadable``).

    Raises:
        ModelMismatchError: naming every model that differs from full, and what differs.
        ModelLoadError: a checkpoint whose config cannot be read, or does not match its weight files.
    """
    identities, unreadable = [], {}
    for role, checkpoint in others:
        try:
            identities.append(identity_of(checkpoint, role))
        except ModelLoadError as error:
            if not skip_unreadable:
                raise
            unreadable[role] = str(error)
            logger.info("%s is left to its loader: %s", role, error)
    check_identities(reference, identities)
    return unreadable


__all__ = [
    "SPECIAL_TOKENS",
    "ArchitectureSignature",
    "ModelIdentity",
    "ModelMismatchError",
    "check_compatible",
    "check_identities",
    "differences",
    "identity_of",
    "own_tokenizer",
    "tokenizer_differences",
]

"""Identity of a checkpoint: its files' digest (computed in the one pass that reads them, or remembered by file
identity), and the digest of a model's tensors in memory.

A result may be reused only when the checkpoint it was computed from is byte for byte the one asked for, so a checkpoint
on disk is identified by the contents of the files its loading reads (the weight files the folder's rules choose, and
the config and tokenizer files: `folder.CheckpointFiles.identifying`). At GPU speed a sweep's pace is set by reading
checkpoints, so the digest is xxHash's XXH3-128 (GB/s per core; SHA-256 is ~0.6 GB/s here) and it is computed while
the bytes are read for loading (`folder.stage`), never in a second pass over them.

A digest, once computed, is remembered by the identity of the files it covers (`file_stamp`: each file's name, size,
modification time, inode and device), in memory and on disk under the cache root (`digests/`): a later run, a sweep's
reuse decision or a fingerprint of an unchanged checkpoint asks the cache instead of reading its bytes, and a file
rewritten in place (another size, time or inode) is read again. The disk cache is optional: when it cannot be written
the digest is still computed and used, with a warning.

Every digest names its scheme and version (`xxh3_128/v2:...`). A result or cache saved under another scheme (the
older `files:<sha-256>` identities) therefore never equals a new one: it is recomputed, never misread. Change
`DIGEST_VERSION` whenever what is hashed or how changes.

A model in memory is identified by its tensors' bytes (`model_fingerprint` over `named_weights`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import Tensor, nn

from uds_lens.files import cache_root, write_atomic
from uds_lens.tl_compat import ModelLike, hf_model_of, is_hooked_transformer, is_tl_model

logger = logging.getLogger(__name__)

# What is hashed, and how: bump on any change, so old identities never match new ones.
DIGEST_VERSION = 2
DIGEST_SCHEME = f"xxh3_128/v{DIGEST_VERSION}"
# Read size: large enough that per-call overhead vanishes, small enough that hashing stays cache-warm.
CHUNK_BYTES = 1 << 23
# Where remembered digests are kept, under the cache root.
DIGEST_DIR = "digests"

FileStamp = tuple[Any, ...]
"""What identifies the files of one checkpoint without reading them: the folder and, per file, its name in the
identity, size, modification time (ns), inode and device."""

_DIGESTS: dict[FileStamp, str] = {}
_DIGESTS_LOCK = threading.Lock()
_UNWRITABLE_WARNED: set[str] = set()


class CheckpointReadError(RuntimeError):
    """A checkpoint file could not be read whole (truncated, changed while read, not a safetensors file)."""


def file_stamp(root: Path, files: Sequence[tuple[str, Path]]) -> FileStamp:
    """The identity of ``files`` (``(name in the identity, path)`` pairs) of the checkpoint at ``root``."""
    entries = []
    for name, path in files:
        stat = path.stat()
        entries.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev))
    return (str(root.resolve()), tuple(entries))


def _disk_path(stamp: FileStamp) -> tuple[Path, str]:
    text = json.dumps([DIGEST_SCHEME, stamp])
    return cache_root() / DIGEST_DIR / f"{xxhash.xxh3_128(text.encode()).hexdigest()}.json", text


def known_digest(stamp: FileStamp) -> str | None:
    """The digest remembered for files of this identity (in memory, else on disk), or None: nothing is read but
    the small cache file."""
    with _DIGESTS_LOCK:
        known = _DIGESTS.get(stamp)
    if known is not None:
        return known
    path, text = _disk_path(stamp)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("stamp") != text or not isinstance(saved.get("digest"), str):
        return None
    with _DIGESTS_LOCK:
        _DIGESTS[stamp] = saved["digest"]
    return str(saved["digest"])


def remember_digest(stamp: FileStamp, digest: str) -> str:
    """Keep ``digest`` for files of this identity, in memory and (when the cache can be written) on disk."""
    with _DIGESTS_LOCK:
        _DIGESTS[stamp] = digest
    path, text = _disk_path(stamp)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"stamp": text, "digest": digest}))
    except OSError as error:
        folder = str(path.parent)
        if folder not in _UNWRITABLE_WARNED:
            _UNWRITABLE_WARNED.add(folder)
            logger.warning(
                "Checkpoint digests are not remembered in %s (%s): each run reads them again.", folder, error
            )
    return digest


def forget_digests() -> None:
    """Drop the digests remembered in memory (those on disk stay): the next look-up of a checkpoint reads its cache
    file under the cache root, or its bytes."""
    with _DIGESTS_LOCK:
        _DIGESTS.clear()


def file_header(hasher: Any, name: str, size: int) -> None:
    """Name and size before the contents: two files' bytes can never be shifted from one to the other."""
    hasher.update(name.encode() + b"\0" + struct.pack("<Q", size))


def hash_stream(hasher: Any, file: Path) -> None:
    """Feed a file's bytes to ``hasher``, chunk by chunk."""
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            hasher.update(chunk)


def read_into(handle: Any, buffer: Tensor, hasher: Any | None, file: Path) -> None:
    """Fill ``buffer`` from ``handle`` in chunks, hashing each chunk as it lands (the bytes are touched once);
    ``hasher`` None reads without hashing (the digest is known).

    Raises:
        CheckpointReadError: the file ended early or grew while it was read.
    """
    view = buffer.numpy().data  # uint8: one byte per element
    done, size = 0, len(view)
    while done < size:
        got = handle.readinto(view[done : min(size, done + CHUNK_BYTES)])
        if not got:
            raise CheckpointReadError(
                f"{file} ended after {done} of {size} bytes (truncated, or rewritten while it was read): "
                "re-save or re-download it."
            )
        if hasher is not None:
            hasher.update(view[done : done + got])
        done += got
    if handle.read(1):
        raise CheckpointReadError(f"{file} grew while it was read: let the writer finish, then rerun.")


def new_hasher() -> Any:
    """The hasher of every checkpoint digest."""
    return xxhash.xxh3_128()


def finish(hasher: Any) -> str:
    """``xxh3_128/v2:HEX`` of what ``hasher`` was fed."""
    return f"{DIGEST_SCHEME}:{hasher.hexdigest()}"


def files_digest(root: Path, files: Sequence[tuple[str, Path]]) -> str:
    """The digest of a checkpoint's identifying files (names, sizes, contents), remembered by their identity: the
    bytes are read only when no digest is known for them. For a checkpoint about to be loaded,
    `folder.stage` computes the same digest from the read that loads it instead."""
    stamp = file_stamp(root, files)
    known = known_digest(stamp)
    if known is not None:
        return known
    hasher = new_hasher()
    for (name, path), entry in zip(files, stamp[1], strict=True):
        file_header(hasher, name, entry[1])
        hash_stream(hasher, path)
    return remember_digest(stamp, finish(hasher))


# ----------------------------------------------------------------------------------------------------------------
# Identity of a model in memory: its tensors' bytes


def named_weights(model: ModelLike | nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors a fingerprint hashes, by name: a Hugging Face model's parameters under their Hugging Face names
    (a bridge's are its Hugging Face model's: the bridge wraps each module in one holding it as
    ``_original_component``, a segment dropped here, and parameters the bridge added are left out), a
    ``HookedTransformer``'s state dict, or any other module's parameters."""
    if is_hooked_transformer(model):
        return [(name, value) for name, value in model.state_dict().items() if torch.is_tensor(value)]
    hf = _weights_owner(model)
    own = hf.__dict__.get("_uds_weight_names")
    named = [(name.replace("._original_component", ""), param) for name, param in hf.named_parameters()]
    return [(name, param) for name, param in named if own is None or name in own]


# model_fingerprint's digests, per model object (dropped with it), each with the identity of the weights it hashed.
_FINGERPRINTS: weakref.WeakKeyDictionary[ModelLike | nn.Module, tuple[tuple[Any, ...], str]] = (
    weakref.WeakKeyDictionary()
)
_FINGERPRINTS_LOCK = threading.Lock()


def _weights_identity(weights: list[tuple[str, Tensor]]) -> tuple[Any, ...] | None:
    """Which tensors, where, at which version: a parameter replaced, moved, cast or changed in place (autograd's
    version counter, which in-place operations and optimiser steps advance) gives another identity. None for
    tensors made under ``torch.inference_mode``, which keep no version (never memoised)."""
    try:
        return tuple(
            (name, t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype, str(t.device))
            for name, t in weights
        )
    except RuntimeError:
        return None


def model_fingerprint(model: ModelLike | nn.Module) -> str:
    """A digest of every weight's bytes (not the path): any change to any weight changes it.

    A bridge and the Hugging Face model it wraps have the same fingerprint (their tensors are the same), on every
    TransformerLens version. Each tensor is hashed in its logical (row-major) order, in slices of at most 16M
    elements, so neither a transposed view nor a GPU tensor is ever copied whole.

    Memoised per model object and the identity of its weights (`_weights_identity`): hashing copies every
    weight to the host (a minute at 8B on a GPU), and a worker asks several times. A change made behind autograd's
    back (through ``tensor.data``) is not seen; `forget_fingerprint` drops the memo.
    """
    weights = named_weights(model)
    identity = _weights_identity(weights)
    owner = _fingerprint_owner(model) if identity is not None else None
    with _FINGERPRINTS_LOCK:
        known = _FINGERPRINTS.get(owner) if owner is not None else None
    if known is not None and known[0] == identity:
        return known[1]
    fingerprint = _hash_weights(weights)
    if owner is not None and identity is not None:
        with _FINGERPRINTS_LOCK:
            _FINGERPRINTS[owner] = (identity, fingerprint)
    return fingerprint


def _weights_owner(model: ModelLike | nn.Module) -> ModelLike | nn.Module:
    """The model whose weights `named_weights` reads: a bridge's Hugging Face model, any other model itself."""
    hf = hf_model_of(model) if is_tl_model(model) else None
    return model if hf is None else hf


def _fingerprint_owner(model: ModelLike | nn.Module) -> ModelLike | nn.Module | None:
    """The object whose weights `named_weights` reads (a bridge's Hugging Face model), if it can be weakly
    referenced."""
    owner = model if is_hooked_transformer(model) else _weights_owner(model)
    try:
        weakref.ref(owner)
    except TypeError:
        return None
    return owner


def forget_fingerprint(model: ModelLike | nn.Module) -> None:
    """Drop the memoised fingerprint of ``model`` (after changing its weights through ``tensor.data``)."""
    owner = _fingerprint_owner(model)
    if owner is not None:
        with _FINGERPRINTS_LOCK:
            _FINGERPRINTS.pop(owner, None)


def _hash_weights(weights: Iterable[tuple[str, Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(weights, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.numel() == 0:
            continue
        flat = (
            tensor.detach().reshape(tensor.shape[0], -1)
            if tensor.dim() > 1
            else tensor.detach().reshape(1, -1)
        )
        rows = max(1, (1 << 24) // flat.shape[1])
        for chunk in flat.split(rows, dim=0):
            digest.update(chunk.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:24]


__all__ = [
    "CHUNK_BYTES",
    "DIGEST_DIR",
    "DIGEST_SCHEME",
    "DIGEST_VERSION",
    "CheckpointReadError",
    "FileStamp",
    "file_header",
    "file_stamp",
    "files_digest",
    "finish",
    "forget_digests",
    "forget_fingerprint",
    "hash_stream",
    "known_digest",
    "model_fingerprint",
    "named_weights",
    "new_hasher",
    "read_into",
    "remember_digest",
]

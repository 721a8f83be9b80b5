"""Checkpoint identity from one pass over its bytes, and staging: the same pass keeps the weights in memory.

Two identities, each computed in one place: a checkpoint on disk by its files' contents (`file_digest`;
`checkpoint_stamp` is the same for any checkpoint argument, a hub id standing for itself), and a model in memory
by its tensors' bytes (`model_fingerprint` over `named_weights`).

A result may be reused only when the checkpoint it was computed from is byte for byte the one asked for, so a
checkpoint directory is identified by the contents of the files that can change its numbers (weights, config,
tokenizer): `file_digest`. At GPU speed a sweep's pace is set by reading and hashing checkpoints, so the digest
is xxHash's XXH3-128 (GB/s per core; SHA-256 is ~0.6 GB/s here) and it is computed while the bytes are read for
loading: `stage` reads each ``.safetensors`` file once into one buffer (pinned memory when the model goes to a
GPU), hashes it on the way, and hands its tensors to the loader as views of that buffer (`Staged.tensors`,
plain ``(name, tensor)`` pairs that any loader can take as a state dict). Other files (config, tokenizer, ``.bin`` or
``.gguf`` weights) are hashed in the same pass; the loader reads those itself.

Every digest names its scheme and version (``xxh3_128/v2:...``). A result or cache saved under another scheme (the
older ``files:<sha-256>`` identities) therefore never equals a new one: it is recomputed, never misread. Change
`DIGEST_VERSION` whenever what is hashed or how changes.

Digests are memoised per (resolved path, file names, sizes, modification times), so a sweep hashes full and retain
once, the fingerprint of a staged model costs nothing, and a checkpoint rewritten in place is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import Tensor, nn

from uds_lens.tl_compat import ModelLike, hf_model_of, is_hooked_transformer, is_tl_model

# What is hashed, and how: bump on any change, so old identities never match new ones.
DIGEST_VERSION = 2
DIGEST_SCHEME = f"xxh3_128/v{DIGEST_VERSION}"
# Files of a checkpoint directory that can change its numbers: weights, config, tokenizer, chat template.
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".jinja", ".model", ".txt")
# Read size: large enough that per-call overhead vanishes, small enough that hashing stays cache-warm.
CHUNK_BYTES = 1 << 23

_DIGESTS: dict[tuple[Any, ...], str] = {}
_DIGESTS_LOCK = threading.Lock()

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointReadError(RuntimeError):
    """A checkpoint file could not be read whole (truncated, changed while read, not a safetensors file)."""


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files that identify a checkpoint: the file itself, or a directory's weight/config/tokenizer files."""
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES)


def _stamp(root: Path, files: list[Path]) -> tuple[Any, ...]:
    return (str(root.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


def _file_header(hasher: Any, file: Path, size: int) -> None:
    """Name and size before the contents: two files' bytes can never be shifted from one to the other."""
    hasher.update(file.name.encode() + b"\0" + struct.pack("<Q", size))


def _hash_stream(hasher: Any, file: Path) -> None:
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            hasher.update(chunk)


def _remember(stamp: tuple[Any, ...], digest: str) -> str:
    with _DIGESTS_LOCK:
        _DIGESTS[stamp] = digest
    return digest


def cached_digest(path: str | os.PathLike) -> str | None:
    """The memoised digest of a checkpoint whose files are unchanged since it was hashed, else None (no read)."""
    root = Path(path).expanduser()
    with _DIGESTS_LOCK:
        return _DIGESTS.get(_stamp(root, checkpoint_files(root)))


def file_digest(path: str | os.PathLike) -> str:
    """``xxh3_128/v2:HEX``: a digest of a checkpoint file or directory's files (names, sizes, contents).

    Memoised (see the module docstring): the files are read only when their names, sizes or modification times
    changed since they were last hashed, here or by `stage`.
    """
    root = Path(path).expanduser()
    files = checkpoint_files(root)
    stamp = _stamp(root, files)
    with _DIGESTS_LOCK:
        known = _DIGESTS.get(stamp)
    if known is not None:
        return known
    hasher = xxhash.xxh3_128()
    for file in files:
        _file_header(hasher, file, file.stat().st_size)
        _hash_stream(hasher, file)
    return _remember(stamp, f"{DIGEST_SCHEME}:{hasher.hexdigest()}")


def _read_into(handle: Any, buffer: Tensor, hasher: Any, file: Path) -> None:
    """Fill ``buffer`` from ``handle`` in chunks, hashing each chunk as it lands (the bytes are touched once)."""
    view = buffer.numpy().data  # uint8: one byte per element
    done, size = 0, len(view)
    while done < size:
        got = handle.readinto(view[done : min(size, done + CHUNK_BYTES)])
        if not got:
            raise CheckpointReadError(
                f"{file} ended after {done} of {size} bytes (truncated, or rewritten while it was read): "
                "re-save or re-download it."
            )
        hasher.update(view[done : done + got])
        done += got
    if handle.read(1):
        raise CheckpointReadError(f"{file} grew while it was read: let the writer finish, then rerun.")


@dataclass
class Staged:
    """A checkpoint read once into memory: its digest and its ``.safetensors`` files' bytes.

    Attributes:
        path: the checkpoint file or directory that was read.
        digest: `file_digest` of it, computed from the same read.
        buffers: ``{file name: its bytes}`` of every ``.safetensors`` file (uint8; pinned when staged for a GPU).
        nbytes: bytes read (every identifying file).
        seconds: time the read and hash took.
        model: the loaded model, once a loader has built it from `tensors` (a sweep keeps it here while the
            previous model computes).
    """

    path: Path
    digest: str
    buffers: dict[str, Tensor] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0
    model: Any = None

    @property
    def has_weights(self) -> bool:
        """Whether the weights are in memory (a directory of ``.safetensors``), so a loader need not read them."""
        return bool(self.buffers)

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` of every staged tensor, in file order, as views of the staged bytes (no copy).

        A tensor whose offset does not suit its dtype's alignment (never the case for files written by
        ``safetensors``, which aligns to 8 bytes) is copied instead.
        """
        for file_name, buffer in self.buffers.items():
            yield from _parse_safetensors(buffer, f"{self.path}/{file_name}")

    def state_dict(self) -> dict[str, Tensor]:
        """The staged tensors as a state dict (views), for loaders that take one."""
        return dict(self.tensors())

    def release(self) -> None:
        """Drop the staged bytes and the model built from them (the sweep's bound on memory)."""
        self.buffers = {}
        self.model = None


def _parse_safetensors(buffer: Tensor, label: str) -> Iterator[tuple[str, Tensor]]:
    if buffer.numel() < 8:
        raise CheckpointReadError(f"{label} is too short to be a safetensors file.")
    (header_len,) = struct.unpack("<Q", bytes(buffer[:8].numpy()))
    if 8 + header_len > buffer.numel():
        raise CheckpointReadError(
            f"{label}: its header runs past the end of the file (truncated or foreign)."
        )
    try:
        header = json.loads(bytes(buffer[8 : 8 + header_len].numpy()))
    except ValueError as err:
        raise CheckpointReadError(
            f"{label}: its header is not JSON ({err}); not a safetensors file."
        ) from err
    base = 8 + header_len
    entries = sorted(
        ((name, entry) for name, entry in header.items() if name != "__metadata__"),
        key=lambda item: item[1]["data_offsets"][0],
    )
    for name, entry in entries:
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointReadError(
                f"{label}: tensor {name} has dtype {entry['dtype']}, which uds_lens cannot read; save the "
                "checkpoint in fp32, fp16 or bf16."
            )
        begin, end = (base + offset for offset in entry["data_offsets"])
        if end > buffer.numel() or begin > end:
            raise CheckpointReadError(f"{label}: tensor {name} lies past the end of the file (truncated).")
        raw = buffer[begin:end]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if begin % itemsize:
            raw = raw.clone()
        yield name, raw.view(dtype).reshape(entry["shape"])


# safetensors' own limit on a header; a longer one is refused before it is read (a header bomb)
MAX_HEADER_BYTES = 100 << 20


def stored_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of every tensor in a checkpoint's ``.safetensors`` files, read from their headers
    only (no tensor bytes): what the files hold, to compare with what a config says before a model is built.

    Raises:
        CheckpointReadError: a header that is truncated, longer than safetensors allows, or not JSON.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for file in checkpoint_files(path):
        if file.suffix != ".safetensors":
            continue
        with file.open("rb") as handle:
            raw_length = handle.read(8)
            if len(raw_length) < 8:
                raise CheckpointReadError(f"{file} is too short to be a safetensors file.")
            (header_len,) = struct.unpack("<Q", raw_length)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file.stat().st_size:
                raise CheckpointReadError(
                    f"{file}: its header claims {header_len} bytes (truncated or foreign); re-save or re-download it."
                )
            try:
                header = json.loads(handle.read(header_len))
            except ValueError as err:
                raise CheckpointReadError(
                    f"{file}: its header is not JSON ({err}); not a safetensors file."
                ) from err
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                shapes[name] = tuple(int(size) for size in entry.get("shape", ()))
    return shapes


def stage(path: str | os.PathLike, pin_memory: bool = False) -> Staged:
    """Read a checkpoint once: hash every identifying file and keep the ``.safetensors`` bytes in memory.

    Args:
        path: a checkpoint directory or file (a ``.gguf`` file is hashed, not kept: its loader reads it).
        pin_memory: allocate the buffers in page-locked memory, so the copy to a GPU is a direct DMA.

    Returns:
        The `Staged` checkpoint; its digest is also memoised, so `file_digest` of the same unchanged
        files answers without reading them again.

    Raises:
        CheckpointReadError: a file shorter or longer than it was when listed (rewritten while read).
    """
    started = time.perf_counter()
    root = Path(path).expanduser()
    files = checkpoint_files(root)
    stamp = _stamp(root, files)
    hasher = xxhash.xxh3_128()
    buffers: dict[str, Tensor] = {}
    nbytes = 0
    for file, (_, size, _) in zip(files, stamp[1]):
        _file_header(hasher, file, size)
        if file.suffix == ".safetensors":
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
            with file.open("rb", buffering=0) as handle:
                _read_into(handle, buffer, hasher, file)
            buffers[file.name] = buffer
        else:
            _hash_stream(hasher, file)
        nbytes += size
    digest = _remember(stamp, f"{DIGEST_SCHEME}:{hasher.hexdigest()}")
    return Staged(root, digest, buffers, nbytes, time.perf_counter() - started)


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


def _hash_weights(weights: list[tuple[str, Tensor]]) -> str:
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


def checkpoint_stamp(path_or_id: str | os.PathLike) -> str:
    """The identity result caches key a checkpoint argument by: `file_digest` of a local checkpoint file or
    directory (its contents: retrained weights or a new chat template change it, a copy or a touch does not), a hub id
    as itself."""
    root = Path(path_or_id).expanduser()
    if root.is_file() or root.is_dir():
        return file_digest(root)
    return str(path_or_id)


__all__ = [
    "CHECKPOINT_SUFFIXES",
    "DIGEST_SCHEME",
    "DIGEST_VERSION",
    "CheckpointReadError",
    "Staged",
    "cached_digest",
    "checkpoint_files",
    "checkpoint_stamp",
    "file_digest",
    "forget_fingerprint",
    "model_fingerprint",
    "named_weights",
    "stage",
    "stored_shapes",
]

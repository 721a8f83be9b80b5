"""Identity of a checkpoint: the digest of the bytes a load read, computed in the pass that reads them, and the
digest of a model's tensors in memory.

A result may be reused only when the checkpoint it was computed from is byte for byte the one asked for, so a checkpoint
on disk is identified by the contents of the files its loading reads (the weight files the folder's rules choose, and
the config and tokenizer files: `folder.CheckpointFiles.identifying`). At GPU speed a sweep's pace is set by reading
checkpoints, so the digest is xxHash's XXH3-128 (GB/s per core; SHA-256 is ~0.6 GB/s here) and it is computed while
the bytes are read for loading (`reader.read_checkpoint`), never in a second pass over them: the digest a result and
the S1 cache are keyed on is the digest of the very bytes the model was built from.

A digest, once computed, is remembered by the stamp of the files it covers (`file_stamp`: each file's name, size,
modification and status-change times in ns, inode and device), in memory and on disk under the cache root
(`digests/`). A remembered digest is a hint, never a proof by itself: it answers only for files whose stamp equals the
one remembered, and only when the stamp is old enough to be trusted. The status-change time (ctime) is what makes a
stamp strong: no tool can set it (``touch -r``, ``rsync -t``, ``cp -p`` and ``tar`` put the modification time back, and
a file extracted onto a just-freed inode has the old inode number), and the kernel moves it on every write. But it
moves in steps of the filesystem's clock: a file written within one step of the moment its stamp was taken can be
written again with the same stamp. Such a stamp is "racily clean" (git's term for the same problem in its index) and is
never trusted: a file whose modification or status-change time lies within the clock's resolution of the moment the
stamp was taken (`RACY_NS`, 3 s, on a filesystem that keeps whole seconds; `RACY_FINE_NS`, 100 ms, on one that keeps
nanoseconds) is read and hashed again, and remembered again with the new moment, after which it is trusted. A load
reads the files' stamp before and after its pass; a file that changed in between is refused (`CheckpointReadError`),
so the digest always describes the bytes the model holds.

The disk cache is optional: when it cannot be written the digest is still computed and used, with a warning.

Every digest names its scheme and version (`xxh3_128/v2:...`). A result or cache saved under another scheme (the
older `files:<sha-256>` identities) therefore never equals a new one: it is recomputed, never misread. Change
`DIGEST_VERSION` whenever what is hashed or how changes (the files hashed and the bytes fed to the hasher; the stamp
rules above decide only when a remembered digest may be used, and are versioned apart, `STAMP_VERSION`).

A model in memory is identified by its tensors' bytes (`model_fingerprint` over `named_weights`, XXH3-128 too).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import Tensor, nn

from uds_lens.checkpoints.folder import CheckpointFiles, ModelLoadError, tensor_headers
from uds_lens.files import cache_root, write_atomic
from uds_lens.tl_compat import ModelLike, hf_model_of, is_hooked_transformer, is_tl_model

logger = logging.getLogger(__name__)

# What is hashed, and how: bump on any change, so old identities never match new ones.
DIGEST_VERSION = 2
DIGEST_SCHEME = f"xxh3_128/v{DIGEST_VERSION}"
# What a remembered digest is keyed on (3: the status-change time joined the stamp, and the moment it was taken).
STAMP_VERSION = 3
# A stamp is trusted only for files last changed at least this long before it was taken. A file whose times are whole
# seconds lies on a filesystem that keeps no finer ones (FAT and exFAT keep 2 s): 3 s. Any other (ext4, XFS, btrfs,
# tmpfs keep nanoseconds, stepped by the kernel's clock tick, at most 10 ms): 100 ms, ten ticks.
RACY_NS = 3_000_000_000
RACY_FINE_NS = 100_000_000
# Read size: large enough that per-call overhead vanishes, small enough that hashing stays cache-warm.
CHUNK_BYTES = 1 << 23
# Where remembered digests (and weight files' headers) are kept, under the cache root.
DIGEST_DIR = "digests"
# What a weight file's remembered headers are filed under (bump when `folder.tensor_headers` changes).
HEADERS = "safetensors-headers/v1"

StampEntry = tuple[str, int, int, int, int, int]
"""One file of a stamp: its name in the identity, size, modification time (ns), status-change time (ns), inode and
device."""


@dataclass(frozen=True)
class FileStamp:
    """What identifies the files of one checkpoint without reading them (see the module docstring).

    Attributes:
        root: the checkpoint's folder (or ``.gguf`` file), resolved.
        entries: per file, `StampEntry`.
        taken_ns: when the stamp was taken (the system clock, just before the first ``stat``); not part of equality.
    """

    root: str
    entries: tuple[StampEntry, ...]
    taken_ns: int = field(default=0, compare=False)

    @property
    def sizes(self) -> list[int]:
        """Each file's size, in order."""
        return [entry[1] for entry in self.entries]

    @property
    def racy(self) -> bool:
        """Whether a file was changed within the filesystem clock's resolution of the moment the stamp was taken
        (`RACY_NS` where its times are whole seconds, else `RACY_FINE_NS`; or later, or with a modification time
        set into the future): another write in the same clock step could keep this stamp, so a digest remembered
        under it is never trusted."""
        for entry in self.entries:
            coarse = entry[2] % 1_000_000_000 == 0 and entry[3] % 1_000_000_000 == 0
            if max(entry[2], entry[3]) >= self.taken_ns - (RACY_NS if coarse else RACY_FINE_NS):
                return True
        return False

    def key(self) -> list[Any]:
        """The stamp as JSON-ready data (what the disk cache is keyed and checked by)."""
        return [self.root, [list(entry) for entry in self.entries]]


# What the stamps of checkpoint files proved, by what it is (`DIGEST_SCHEME`, `HEADERS`), root and entries: the value
# and the moment it was remembered.
_DIGESTS: dict[tuple[str, str, tuple[StampEntry, ...]], tuple[Any, int]] = {}
_DIGESTS_LOCK = threading.Lock()
_UNWRITABLE_WARNED: set[str] = set()


class CheckpointReadError(ModelLoadError):
    """A checkpoint file could not be read whole, or changed while it was read (truncated, rewritten, gone, not a
    safetensors file): one line naming the file and the fix."""


def file_stamp(root: Path, files: Sequence[tuple[str, Path]]) -> FileStamp:
    """The stamp of ``files`` (``(name in the identity, path)`` pairs) of the checkpoint at ``root``.

    Raises:
        CheckpointReadError: a file is gone (deleted or moved since the checkpoint was resolved).
    """
    taken = time.time_ns()
    entries = []
    for name, path in files:
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise CheckpointReadError(
                f"{path} is gone (deleted or moved since the checkpoint {root} was resolved): restore it, or pass "
                "the checkpoint again."
            ) from None
        entries.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev))
    return FileStamp(str(Path(root).resolve()), tuple(entries), taken)


def _disk_path(stamp: FileStamp, kind: str) -> tuple[Path, str]:
    text = json.dumps([kind, STAMP_VERSION, stamp.key()])
    return cache_root() / DIGEST_DIR / f"{xxhash.xxh3_128(text.encode()).hexdigest()}.json", text


def known_digest(stamp: FileStamp) -> str | None:
    """The digest remembered for files of exactly this stamp (in memory, else on disk), when the stamp proves them
    unchanged since (it was not racy when the digest was remembered); else None. Nothing is read but the small
    cache file."""
    known = _known(stamp, DIGEST_SCHEME)
    return known if isinstance(known, str) else None


def remember_digest(stamp: FileStamp, digest: str) -> str:
    """Keep ``digest`` for files of this stamp, taken at ``stamp.taken_ns`` before the bytes were read, in memory and
    (when the cache can be written) on disk. A racy stamp is remembered too: it is not trusted while racy, and the
    next read remembers the same files under a later moment."""
    return str(_remember(stamp, DIGEST_SCHEME, digest))


def remembered_headers(files: CheckpointFiles) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """`folder.tensor_headers` of a checkpoint's weight files, remembered by their stamp as a digest is: a rerun on
    unchanged files compares shapes without opening a weight file (a header read is a few KiB, but the file it is
    read from is the model's). Files whose stamp proves nothing are read, and remembered under the stamp taken before."""
    if files.format != "safetensors":
        return None
    stamp = file_stamp(files.root, [(str(path), path) for path in files.weights])
    known = _known(stamp, HEADERS)
    if isinstance(known, dict):
        return {name: (tuple(shape), str(dtype)) for name, (shape, dtype) in known.items()}
    headers = tensor_headers(files)
    if headers is not None:
        _remember(stamp, HEADERS, {name: [list(shape), dtype] for name, (shape, dtype) in headers.items()})
    return headers


def _known(stamp: FileStamp, kind: str) -> Any:
    """What was remembered of ``kind`` for files of exactly this stamp (in memory, else on disk), where the stamp
    was not racy when it was remembered; else None."""
    with _DIGESTS_LOCK:
        known = _DIGESTS.get((kind, stamp.root, stamp.entries))
    if known is None:
        known = _read_remembered(stamp, kind)
    if known is None:
        return None
    value, remembered_ns = known
    if FileStamp(stamp.root, stamp.entries, remembered_ns).racy:
        return None  # remembered for files that were changing then: read again
    return value


def _read_remembered(stamp: FileStamp, kind: str) -> tuple[Any, int] | None:
    path, text = _disk_path(stamp, kind)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(saved, dict)
        or saved.get("stamp") != text
        or not isinstance(saved.get("digest"), (str, dict))
        or not isinstance(saved.get("taken_ns"), int)
    ):
        return None
    found = (saved["digest"], int(saved["taken_ns"]))
    with _DIGESTS_LOCK:
        _DIGESTS[(kind, stamp.root, stamp.entries)] = found
    return found


def _remember(stamp: FileStamp, kind: str, value: Any) -> Any:
    with _DIGESTS_LOCK:
        _DIGESTS[(kind, stamp.root, stamp.entries)] = (value, stamp.taken_ns)
    path, text = _disk_path(stamp, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"stamp": text, "digest": value, "taken_ns": stamp.taken_ns}))
    except OSError as error:
        folder = str(path.parent)
        if folder not in _UNWRITABLE_WARNED:
            _UNWRITABLE_WARNED.add(folder)
            logger.warning(
                "Checkpoint digests are not remembered in %s (%s): each run reads them again.", folder, error
            )
    return value


def forget_digests() -> None:
    """Drop the digests remembered in memory (those on disk stay): the next look-up of a checkpoint reads its cache
    file under the cache root, or its bytes."""
    with _DIGESTS_LOCK:
        _DIGESTS.clear()


def file_header(hasher: Any, name: str, size: int) -> None:
    """Name and size before the contents: two files' bytes can never be shifted from one to the other."""
    hasher.update(name.encode() + b"\0" + struct.pack("<Q", size))


def check_unchanged(before: FileStamp, root: Path, files: Sequence[tuple[str, Path]]) -> None:
    """Refuse files whose stamp moved while they were read: what was read is then no one version of them.

    Raises:
        CheckpointReadError: naming the files that changed and the fix.
    """
    after = file_stamp(root, files)
    if after == before:
        return
    changed = [old[0] for old, new in zip(before.entries, after.entries, strict=True) if old != new]
    raise CheckpointReadError(
        f"{', '.join(changed)} of {root} changed while it was read (another process is writing the checkpoint): "
        "let the writer finish, then rerun."
    )


def hash_stream(hasher: Any, file: Path, size: int) -> None:
    """Feed a file's ``size`` bytes to ``hasher``, chunk by chunk.

    Raises:
        CheckpointReadError: the file is shorter or longer than ``size`` (rewritten since it was stamped).
    """
    with open_checkpoint_file(file) as handle:
        buffer = bytearray(min(CHUNK_BYTES, max(size, 1)))
        view = memoryview(buffer)
        done = 0
        while done < size:
            got = handle.readinto(view[: min(len(buffer), size - done)])
            if not got:
                raise truncated(file, done, size)
            hasher.update(view[:got])
            done += got
        if handle.read(1):
            raise grew(file)


def open_checkpoint_file(file: Path) -> Any:
    """``file`` opened for an unbuffered binary read; a file that is gone is one line.

    Raises:
        CheckpointReadError: the file no longer exists.
    """
    try:
        return file.open("rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointReadError(
            f"{file} is gone (deleted or moved since its checkpoint was resolved): restore it, or pass the checkpoint "
            "again."
        ) from None


def truncated(file: Path, done: int, size: int) -> CheckpointReadError:
    """The error of a file that ended early."""
    return CheckpointReadError(
        f"{file} ended after {done} of {size} bytes (truncated, or rewritten while it was read): re-save or "
        "re-download it."
    )


def grew(file: Path) -> CheckpointReadError:
    """The error of a file that grew while it was read."""
    return CheckpointReadError(f"{file} grew while it was read: let the writer finish, then rerun.")


def new_hasher() -> Any:
    """The hasher of every checkpoint digest."""
    return xxhash.xxh3_128()


def finish(hasher: Any) -> str:
    """``xxh3_128/v2:HEX`` of what ``hasher`` was fed."""
    return f"{DIGEST_SCHEME}:{hasher.hexdigest()}"


def files_digest(root: Path, files: Sequence[tuple[str, Path]]) -> str:
    """The digest of a checkpoint's identifying files (names, sizes, contents), without loading them: the remembered
    one where the files' stamp proves them unchanged (`known_digest`), else read and hashed now (and remembered). A
    load computes the same digest from the pass that reads the bytes for the model instead
    (`reader.read_checkpoint`).

    Raises:
        CheckpointReadError: a file is gone, or changed while it was read.
    """
    stamp = file_stamp(root, files)
    known = known_digest(stamp)
    if known is not None:
        return known
    hasher = new_hasher()
    for (name, path), size in zip(files, stamp.sizes, strict=True):
        file_header(hasher, name, size)
        hash_stream(hasher, path, size)
    check_unchanged(stamp, root, files)
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


# Where a model built from a checkpoint's files keeps the record of that load (`reader.Loaded`: the digest of the bytes
# read, how many, how long), on the Hugging Face model (a bridge's is its Hugging Face model's).
LOADED = "uds_loaded"


def loaded_record(model: ModelLike | nn.Module) -> Any:
    """The record of the load ``model`` was built by (`reader.Loaded`, its tensors handed over), or None for a model
    made otherwise."""
    return getattr(_weights_owner(model), "__dict__", {}).get(LOADED)


def loaded_digest(model: ModelLike | nn.Module) -> str | None:
    """The digest of the checkpoint bytes ``model`` was built from, computed (or proven by the files' stamp) in the
    pass that read them for it; None for a model made otherwise."""
    record = loaded_record(model)
    return str(record.digest) if record is not None else None


def mark_loaded(model: nn.Module, record: Any) -> None:
    """Keep on a Hugging Face model built by the loader the record of its load (``record.digest`` is read back)."""
    object.__setattr__(model, LOADED, record)


def forget_fingerprint(model: ModelLike | nn.Module) -> None:
    """Drop the memoised fingerprint of ``model`` (after changing its weights through ``tensor.data``)."""
    owner = _fingerprint_owner(model)
    if owner is not None:
        with _FINGERPRINTS_LOCK:
            _FINGERPRINTS.pop(owner, None)


def _hash_weights(weights: Iterable[tuple[str, Tensor]]) -> str:
    """XXH3-128 of the tensors' names, shapes, dtypes and bytes, by name (SHA-256 hashed ~1 GB/s here: 13 s a model at
    8B; XXH3 runs at memory speed)."""
    digest = xxhash.xxh3_128()
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
    return f"xxh3_128:{digest.hexdigest()}"


__all__ = [
    "CHUNK_BYTES",
    "DIGEST_DIR",
    "DIGEST_SCHEME",
    "DIGEST_VERSION",
    "RACY_FINE_NS",
    "RACY_NS",
    "STAMP_VERSION",
    "CheckpointReadError",
    "FileStamp",
    "StampEntry",
    "check_unchanged",
    "file_header",
    "file_stamp",
    "files_digest",
    "finish",
    "forget_digests",
    "forget_fingerprint",
    "grew",
    "hash_stream",
    "known_digest",
    "LOADED",
    "loaded_digest",
    "loaded_record",
    "mark_loaded",
    "model_fingerprint",
    "named_weights",
    "new_hasher",
    "open_checkpoint_file",
    "remember_digest",
    "truncated",
]

"""The one pass over a checkpoint's bytes: every identifying file read once, in order, each weight tensor cast and
placed on its device as it lands, every byte hashed on the way (or none, where the files' stamp proves a remembered
digest).

Loading a model used to mean staging every weight file in host memory, then casting a copy of it: a 0.25 GiB bf16 model
from fp32 files peaked at three times its size, and on a GPU every byte passed through the host twice. Here a weight
file is read sequentially with plain ``readinto`` calls, tensor by tensor, and no byte is held longer than it takes
to place it:

- a tensor whose stored dtype is the one wanted, for the CPU, is read straight into the tensor the model will hold
  (no copy at all), hashed chunk by chunk as it lands;
- any other (a cast, or a tensor for a GPU) passes through one reused 8 MiB buffer: read, hashed, then copied into its
  slice of the final tensor with the cast (``Tensor.copy_`` converts as it copies, on the device).

So a load holds the model plus 8 MiB, whatever the checkpoint's size, and every byte hashed is a byte the model was
built from. The files are read with ``read`` rather than a memory map: the pages a mapping touches count against the
process until it is closed, a file truncated under a mapping kills the process (SIGBUS), and a private mapping may
show another writer's changes; a read into a buffer costs the same one copy from the page cache.

The digest (`digests.file_header` and every byte, file by file, in the identity's order) equals the one
`digests.files_digest` computes without loading, so a checkpoint read for loading and one only identified agree. The
files' stamp is taken before the pass and checked after it (`digests.check_unchanged`): a file rewritten while it was
read is refused. Where the stamp proves a remembered digest (`digests.known_digest`), nothing is hashed.

The formats: safetensors (its header, then each tensor in the order of its offsets, the gaps between them hashed too),
pickled ``pytorch_model*.bin`` (read whole, hashed as it lands, unpickled with ``weights_only`` and cast tensor by
tensor: the pickle needs the whole file; a legacy format), and GGUF (`checkpoints.gguf`).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import torch
from torch import Tensor

from uds_lens.checkpoints import digests
from uds_lens.checkpoints.digests import CheckpointReadError, grew, truncated
from uds_lens.checkpoints.folder import parse_header

# safetensors' dtype names, as torch dtypes (what uds_lens can read).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass
class Loaded:
    """A checkpoint's weights read in one pass.

    Attributes:
        digest: the digest of the identifying files (computed from this pass, or proven by their stamp).
        tensors: ``{name: tensor}`` as the model holds them (its dtype, its device); `take` hands them over.
        nbytes: bytes read.
        seconds: time the pass took.
        hashed: whether this pass computed the digest (False: the stamp proved it, nothing was hashed).
    """

    digest: str
    tensors: dict[str, Tensor] = field(default_factory=dict, repr=False)
    nbytes: int = 0
    seconds: float = 0.0
    hashed: bool = True

    def take(self) -> dict[str, Tensor]:
        """The tensors, handed over: this no longer holds them (the model that takes them is their one owner)."""
        tensors, self.tensors = self.tensors, {}
        return tensors


class Bounce:
    """One reused host buffer for the bytes that are cast or sent to a device on their way to their tensor."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def get(self, size: int) -> Tensor:
        """A uint8 tensor of at least ``size`` bytes (at most `digests.CHUNK_BYTES` are asked for)."""
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = torch.empty(max(size, digests.CHUNK_BYTES), dtype=torch.uint8)
        return self._buffer[:size]


class Source:
    """A file being read: its handle, its path, its size as stamped, how far it has been read, the hasher (None:
    the digest is known) and the bounce buffer."""

    def __init__(self, handle: Any, file: Path, size: int, hasher: Any | None, bounce: Bounce) -> None:
        self.handle, self.file, self.size, self.hasher, self.bounce = handle, file, size, hasher, bounce
        self.position = 0
        self._pending = (
            b""  # bytes read (and hashed) ahead of the position, handed out again by the next read
        )

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` from the file, hashing what lands (bytes given back with `unread` were hashed already)."""
        wanted = len(view)
        done = min(wanted, len(self._pending))
        if done:
            view[:done] = self._pending[:done]
            self._pending = self._pending[done:]
        fresh = done
        while done < wanted:
            got = self.handle.readinto(view[done:])
            if not got:
                raise truncated(self.file, self.position + done, self.size)
            done += got
        if self.hasher is not None and fresh < wanted:
            self.hasher.update(view[fresh:])
        self.position += wanted

    def unread(self, data: bytes) -> None:
        """Give back bytes read ahead of what was needed (a parser's buffer): the next read hands them out again."""
        self._pending = bytes(data) + self._pending
        self.position -= len(data)

    def read(self, count: int) -> bytes:
        """``count`` bytes (headers, gaps), hashed."""
        data = bytearray(count)
        self.read_into(memoryview(data))
        return bytes(data)

    def skip_to(self, position: int) -> None:
        """Read (and hash) everything up to ``position``: the gaps between tensors are part of the file too."""
        while self.position < position:
            count = min(digests.CHUNK_BYTES, position - self.position)
            self.read_into(self.bounce.get(count).numpy().data)

    def finish(self) -> None:
        """Read the rest of the file, and refuse one longer than its stamp said."""
        self.skip_to(self.size)
        if self.handle.read(1):
            raise grew(self.file)

    def fill(
        self,
        shape: Sequence[int],
        stored: torch.dtype,
        dtype: torch.dtype,
        device: torch.device,
        into: Tensor | None = None,
    ) -> Tensor:
        """The next ``prod(shape)`` elements of the file (stored as ``stored``) as a new tensor of ``dtype`` on
        ``device``, or written into ``into`` (a model's own tensor, refilled: `loader.refill_model`), which must be
        of that shape, dtype and device, and contiguous: read straight into it where nothing changes on the way,
        else through the bounce buffer."""
        if into is None:
            tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
        elif (
            tuple(into.shape) != tuple(shape)
            or into.dtype != dtype
            or into.device != device
            or not into.is_contiguous()
        ):
            raise CheckpointReadError(
                f"{self.file}: a tensor of shape {tuple(shape)} ({dtype}) cannot be read into the model's "
                f"{tuple(into.shape)} ({into.dtype}, {into.device})."
            )
        else:
            tensor = into
        size = stored.itemsize
        count = tensor.numel()
        if count == 0:
            return tensor
        if dtype == stored and tensor.device.type == "cpu":
            raw = tensor.reshape(-1).view(torch.uint8).numpy()
            for start in range(0, len(raw), digests.CHUNK_BYTES):
                self.read_into(raw[start : start + digests.CHUNK_BYTES].data)
            return tensor
        flat = tensor.reshape(-1)
        per_chunk = max(1, digests.CHUNK_BYTES // size)
        for start in range(0, count, per_chunk):
            number = min(per_chunk, count - start)
            chunk = self.bounce.get(number * size)
            self.read_into(chunk.numpy().data)
            flat[start : start + number].copy_(chunk.view(stored))
        return tensor


TensorReader: TypeAlias = Callable[[Source, dict[str, Tensor]], None]
"""Reads one weight file's tensors from a `Source` into a dict (the whole file, in order)."""


def target_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """What a stored tensor becomes: floating-point weights take the model's dtype, integer and boolean tensors keep
    theirs."""
    return dtype if stored.is_floating_point else stored


def _unreadable(label: str, why: str) -> CheckpointReadError:
    return CheckpointReadError(
        f"{label} is not readable safetensors ({why}): the file is truncated or corrupt; re-save or re-download the "
        "checkpoint."
    )


@dataclass(frozen=True)
class SafetensorsReader:
    """A safetensors file: its header, then each tensor in the order of its offsets (see the module docstring)."""

    dtype: torch.dtype
    device: torch.device

    def __call__(self, source: Source, out: dict[str, Tensor]) -> None:
        label = str(source.file)
        header, header_len = parse_header(source.read, source.size, lambda why: _unreadable(label, why))
        base = 8 + header_len
        for name, (begin, _end, shape, stored) in _layout(header, base, source.size, label):
            source.skip_to(begin)
            # a tensor already in ``out`` is a model's own, refilled in place (`loader.refill_model`)
            dtype = target_dtype(stored, self.dtype)
            out[name] = source.fill(shape, stored, dtype, self.device, into=out.get(name))
        source.finish()


def _layout(
    header: dict[str, Any], base: int, size: int, label: str
) -> list[tuple[str, tuple[int, int, list[int], torch.dtype]]]:
    """``(name, (begin, end, shape, stored dtype))`` of every tensor, by offset; overlapping, out-of-file or
    mis-sized entries are refused."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            stored = SAFETENSORS_DTYPES.get(entry["dtype"])
            begin, end = (base + int(offset) for offset in entry["data_offsets"])
            shape = [int(dim) for dim in entry["shape"]]
        except (TypeError, KeyError, ValueError) as err:
            raise _unreadable(label, f"tensor {name}'s entry is malformed ({err})") from err
        if stored is None:
            raise CheckpointReadError(
                f"{label}: tensor {name} has dtype {entry['dtype']}, which uds_lens cannot read; save the "
                "checkpoint in fp32, fp16 or bf16."
            )
        count = 1
        for dim in shape:
            count *= dim
        if end > size or begin > end or end - begin != count * stored.itemsize:
            raise _unreadable(label, f"tensor {name} lies past the end of the file or does not fit its shape")
        entries.append((name, (begin, end, shape, stored)))
    entries.sort(key=lambda item: item[1][0])
    for (first, (_, first_end, _, _)), (second, (second_begin, _, _, _)) in zip(entries, entries[1:]):
        if second_begin < first_end:
            raise _unreadable(label, f"tensors {first} and {second} overlap")
    return entries


@dataclass(frozen=True)
class PickleReader:
    """A pickled ``pytorch_model*.bin``: read whole (the pickle needs it), hashed as it lands, unpickled with
    ``weights_only``, each tensor cast and placed in turn."""

    dtype: torch.dtype
    device: torch.device

    def __call__(self, source: Source, out: dict[str, Tensor]) -> None:
        buffer = bytearray(source.size)
        view = memoryview(buffer)
        for start in range(0, source.size, digests.CHUNK_BYTES):
            source.read_into(view[start : start + digests.CHUNK_BYTES])
        source.finish()
        state = torch.load(io.BytesIO(buffer), map_location="cpu", weights_only=True)
        del view, buffer
        for name in list(state):
            tensor = state.pop(name)
            if torch.is_tensor(tensor):
                out[str(name)] = tensor.to(device=self.device, dtype=target_dtype(tensor.dtype, self.dtype))


def read_checkpoint(
    root: Path,
    identifying: Sequence[tuple[str, Path]],
    readers: Mapping[str, TensorReader],
    into: Mapping[str, Tensor] | None = None,
) -> Loaded:
    """Read a checkpoint's identifying files once, in order: the weight files (those ``readers`` names) into their
    tensors, the others (config, tokenizer) only hashed; every byte hashed unless the stamp proves the remembered
    digest, which the pass then remembers (`digests.remember_digest`).

    Args:
        root: the checkpoint's folder (or ``.gguf`` file).
        identifying: ``(name in the identity, path)`` of every file its identity covers, in the identity's order.
        readers: the reader of each weight file, by its name in the identity.
        into: tensors to read the weights of those names into, in place (a safetensors reader only): a model's
            own, refilled with another checkpoint's bytes (`loader.refill_model`).

    Raises:
        CheckpointReadError: a file gone, truncated, grown, not of its format, or changed while it was read.
    """
    with _one_thread():
        return _read_checkpoint(root, identifying, readers, dict(into or {}))


@contextmanager
def _one_thread() -> Iterator[None]:
    """Torch's intra-op threads at one for the pass, restored after: a cast of one 8 MiB chunk is memory-bound, and
    split over two threads that cannot both be scheduled (a busy machine) it waited for the other: the fp32 -> bf16
    pass over SmolLM2-135M took 1.6 s of copies on 2 busy cores against 0.3 s on one (measured; 0.2 s idle)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _read_checkpoint(
    root: Path,
    identifying: Sequence[tuple[str, Path]],
    readers: Mapping[str, TensorReader],
    tensors: dict[str, Tensor],
) -> Loaded:
    started = time.perf_counter()
    stamp = digests.file_stamp(root, identifying)
    known = digests.known_digest(stamp)
    hasher = digests.new_hasher() if known is None else None
    bounce = Bounce()
    nbytes = 0
    for (name, path), size in zip(identifying, stamp.sizes, strict=True):
        reader = readers.get(name)
        if reader is None and hasher is None:
            continue  # a config or tokenizer file whose digest is proven: nothing to read
        if hasher is not None:
            digests.file_header(hasher, name, size)
        with digests.open_checkpoint_file(path) as handle:
            source = Source(handle, path, size, hasher, bounce)
            if reader is not None:
                reader(source, tensors)
            else:
                source.finish()
        nbytes += size
    digests.check_unchanged(stamp, root, identifying)
    digest = known if known is not None else digests.remember_digest(stamp, digests.finish(hasher))
    return Loaded(digest, tensors, nbytes, time.perf_counter() - started, hashed=hasher is not None)


__all__ = [
    "SAFETENSORS_DTYPES",
    "Bounce",
    "Loaded",
    "PickleReader",
    "SafetensorsReader",
    "Source",
    "TensorReader",
    "read_checkpoint",
    "target_dtype",
]

"""A ``.gguf`` file read in the one pass (`reader.read_checkpoint`): its header parsed from the bytes being hashed, each
tensor dequantised and cast as it is read, row block by row block.

``transformers`` loads a GGUF by dequantising every tensor to fp32 and then casting the whole state dict: a bf16
SmolLM2-135M from its 98 MB Q4_1 file peaked at 2.2 times the model. Here a quantised tensor is read in blocks of rows
(at most `digests.CHUNK_BYTES` of fp32 at a time), each block dequantised by the ``gguf`` package's own
``dequantize`` and cast into its rows of the final tensor, so the load holds the model plus a few MiB. The numbers are
``transformers``' own: the same dequantisation, the same tensor names (the ``gguf`` package's name map for the
architecture, applied to the model's parameter names), and the same two layout fixes of the formats llama.cpp writes,
applied in fp32 before the cast (a tensor they touch is small, so it is dequantised whole first):

- ``llama``: the query and key projections' rows were permuted for llama.cpp's rotary layout; the permutation is
  undone (per head of the projection: ``(head, dim/2, 2) -> (head, 2, dim/2)``);
- ``gemma2``, ``gemma3``: RMSNorm weights are stored as ``1 + w``; the 1 is subtracted.

The header (metadata and tensor table) is parsed from the bytes as they are read and hashed, so the tensors read are
the ones the hashed header describes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from uds_lens.checkpoints import digests
from uds_lens.checkpoints.digests import CheckpointReadError
from uds_lens.checkpoints.reader import Source, target_dtype

MAGIC = b"GGUF"
# The fixed-width metadata value types (GGUF spec): struct format by type id; 8 is a string, 9 an array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# ggml types stored as plain values, and their torch dtype.
_PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the table: its name, torch shape (the file lists dimensions innermost first), ggml type and
    where its bytes lie (from the start of the data section)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class _Header:
    """The header parsed from bytes read (and hashed) through the `Source` in blocks; what was read past the header
    is given back to the source (`Source.unread`) for the data section."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.buffer = bytearray()
        self.at = 0

    def take(self, count: int) -> bytes:
        while len(self.buffer) - self.at < count:
            more = min(max(1 << 20, count), self.source.size - self.source.position)
            if more <= 0:
                raise _unreadable(self.source, "its header ends early")
            self.buffer += self.source.read(more)
        data = bytes(self.buffer[self.at : self.at + count])
        self.at += count
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", "replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            for _ in range(count):
                self.value(item)  # arrays (the vocabulary) are walked, not kept
            return None
        raise _unreadable(self.source, f"its metadata holds a value of unknown type {kind}")

    def done(self) -> None:
        """Hand what was read past the parsed header back to the source."""
        self.source.unread(bytes(self.buffer[self.at :]))
        self.buffer = bytearray()


def _unreadable(source: Source, why: str) -> CheckpointReadError:
    return CheckpointReadError(
        f"{source.file} is not a readable GGUF file ({why}): it is truncated or corrupt; re-download it."
    )


def _quant_size(source: Source, ggml_type: int) -> tuple[int, int]:
    """``(elements, bytes)`` of one block of a quantised ggml type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return tuple(GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)])  # type: ignore[return-value]
    except (ValueError, KeyError):
        raise _unreadable(
            source, f"a tensor is of ggml type {ggml_type}, which the gguf package cannot read"
        ) from None


def _byte_count(source: Source, ggml_type: int, count: int) -> int:
    if ggml_type in _PLAIN:
        return count * _PLAIN[ggml_type].itemsize
    block, size = _quant_size(source, ggml_type)
    return count // block * size


def read_table(source: Source) -> tuple[str, list[GgufTensor], int]:
    """``(architecture, tensors by offset, start of the data section)`` from the header, read and hashed through
    ``source``, which is left just after the tensor table."""
    header = _Header(source)
    if header.take(4) != MAGIC:
        raise _unreadable(source, "no GGUF magic")
    version = header.scalar("<I")
    if version not in (2, 3):
        raise _unreadable(source, f"GGUF version {version}")
    n_tensors, n_values = header.scalar("<Q"), header.scalar("<Q")
    architecture, alignment = "", 32
    for _ in range(n_values):
        key = header.string()
        found = header.value(header.scalar("<I"))
        if key == "general.architecture":
            architecture = str(found)
        elif key == "general.alignment":
            alignment = int(found)
    tensors = []
    for _ in range(n_tensors):
        name = header.string()
        dims = [header.scalar("<Q") for _ in range(header.scalar("<I"))]
        ggml_type, offset = header.scalar("<I"), header.scalar("<Q")
        count = int(np.prod(dims)) if dims else 1
        tensors.append(
            GgufTensor(name, tuple(reversed(dims)), ggml_type, offset, _byte_count(source, ggml_type, count))
        )
    header.done()
    data_start = (source.position + alignment - 1) // alignment * alignment
    tensors.sort(key=lambda tensor: tensor.offset)
    return architecture, tensors, data_start


Transform = Callable[[str, Tensor], Tensor]
"""A layout fix of one tensor (its GGUF name, its fp32 values) -> the Hugging Face tensor; identity where none."""


def transform_for(architecture: str, config: Any) -> tuple[Callable[[str], bool], Transform]:
    """Which tensors of ``architecture`` need a layout fix, and the fix (see the module docstring)."""
    if architecture == "llama":
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)

        def permuted(name: str) -> bool:
            return ".attn_q." in name or ".attn_k." in name

        def unpermute(name: str, values: Tensor) -> Tensor:
            count = heads if ".attn_q." in name else kv_heads
            rows = values.shape[0]
            split = values.reshape(count, rows // count // 2, 2, *values.shape[1:])
            return split.transpose(1, 2).reshape(values.shape)

        return permuted, unpermute
    if architecture in ("gemma2", "gemma3"):

        def norm(name: str) -> bool:
            return "norm.weight" in name

        return norm, lambda name, values: values - 1
    return (lambda name: False), (lambda name, values: values)


def hf_names(architecture: str, n_layers: int, parameter_names: Iterable[str]) -> dict[str, str]:
    """``{GGUF tensor name: Hugging Face parameter name}`` for a model of ``architecture`` with these parameters
    (the ``gguf`` package's name map, which knows the Hugging Face names of each GGUF tensor)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise CheckpointReadError(
            f"The gguf package does not know the GGUF architecture {architecture!r}: upgrade it (pip install -U gguf)."
        )
    name_map = get_tensor_name_map(arch, n_layers)
    names = {}
    for name in parameter_names:
        stem, _, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "")
        gguf_name = name_map.get_name(stem)
        if gguf_name is not None:
            names[gguf_name + ("." + suffix if suffix else "")] = name
    return names


@dataclass(frozen=True)
class GgufReader:
    """A ``.gguf`` file's tensors, under their Hugging Face names (see the module docstring).

    Attributes:
        dtype / device: what the model holds its weights in.
        config: the model's Hugging Face config (heads, layers).
        parameter_names: the model's parameter names (to map the GGUF names onto).
    """

    dtype: torch.dtype
    device: torch.device
    config: Any
    parameter_names: tuple[str, ...]

    def __call__(self, source: Source, out: dict[str, Tensor]) -> None:
        architecture, tensors, data_start = read_table(source)
        names = hf_names(architecture, int(self.config.num_hidden_layers), self.parameter_names)
        needs_fix, fix = transform_for(architecture, self.config)
        position = data_start
        for tensor in tensors:
            begin = data_start + tensor.offset
            if begin < position or begin + tensor.nbytes > source.size:
                raise _unreadable(source, f"tensor {tensor.name} overlaps another or lies past the end")
            source.skip_to(begin)
            name = names.get(tensor.name)
            if (
                name is None
            ):  # not a parameter of the model (llama.cpp's own tables): read for the digest only
                source.skip_to(begin + tensor.nbytes)
            elif needs_fix(tensor.name):
                values = self._dequantised(source, tensor, torch.float32, torch.device("cpu"))
                out[name] = fix(tensor.name, values).to(device=self.device, dtype=self.dtype)
            else:
                out[name] = self._dequantised(source, tensor, self.dtype, self.device)
            position = begin + tensor.nbytes
        source.finish()

    def _dequantised(
        self, source: Source, tensor: GgufTensor, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """The tensor's values, read from ``source`` in blocks of rows, dequantised and cast into a new tensor."""
        if tensor.ggml_type in _PLAIN:
            stored = _PLAIN[tensor.ggml_type]
            return source.fill(tensor.shape, stored, target_dtype(stored, dtype), device)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        quant = GGMLQuantizationType(tensor.ggml_type)
        block, block_bytes = _quant_size(source, tensor.ggml_type)
        columns = tensor.shape[-1] if tensor.shape else 1
        rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
        if columns % block:
            raise _unreadable(source, f"tensor {tensor.name}'s rows are not whole blocks")
        row_bytes = columns // block * block_bytes
        result = torch.empty(tensor.shape, dtype=dtype, device=device)
        flat = result.reshape(rows, columns)
        per_chunk = max(1, digests.CHUNK_BYTES // (columns * 4))
        for start in range(0, rows, per_chunk):
            count = min(per_chunk, rows - start)
            raw = source.bounce.get(count * row_bytes)
            source.read_into(raw.numpy().data)
            values = dequantize(raw.numpy().reshape(count, row_bytes), quant)
            flat[start : start + count].copy_(
                torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            )
        return result


__all__ = ["GgufReader", "GgufTensor", "hf_names", "read_table", "transform_for"]

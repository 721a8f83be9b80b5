"""One reading of a checkpoint folder: which files are the model, what their headers hold, and the one pass that
reads them.

Every command reads a Hugging Face checkpoint directory through `read_folder`, once per `Checkpoint`, so `score`,
`sweep`, `diagnose` and the rest load the same bytes, and the checkpoint's identity covers exactly those bytes. Which
files are the weights is decided by the rules `transformers`' `from_pretrained` applies to a local directory:

1. the file ``config.json`` names under ``transformers_weights``, when it names one (inside the folder);
2. else ``model.safetensors``;
3. else ``model.safetensors.index.json`` and the shards its ``weight_map`` names (in sorted order, wherever they lie
   under the folder);
4. else ``pytorch_model.bin``;
5. else ``pytorch_model.bin.index.json`` and its shards.

Around those rules, what a user could mistake:

- a weight file the rules do not load (``model_ema.safetensors``, shards an index no longer names, a
  ``pytorch_model.bin`` beside ``model.safetensors``) is named in a warning: it is neither loaded nor part of the
  identity;
- where it is ambiguous which weights are meant (``model.safetensors`` beside an index, a ``.bin`` beside a ``.bin``
  index, or weight files none of which the rules name), the folder is refused in one line;
- a shard an index names outside the folder (``../other/model.safetensors``, an absolute path) is refused unless the
  caller allows it (``outside_weights=True``; `uds-lens score --allow-outside-weights`);
- a config or tokenizer config with an ``auto_map`` (the checkpoint's own Python classes) is refused: uds_lens never
  runs a checkpoint's code, and scoring it with the stock class would score another model.

`ModelLoadError` is what goes wrong with a checkpoint, always one line naming it and the fix (`explain_load_error`
turns any loader's error into one). The identity (`CheckpointFiles.identifying`) is the weight files chosen, the index
(wherever it lies), and the folder's config and tokenizer files (``.json``, ``.jinja``, ``.model``, ``.txt``), each
named by its path in the folder. `reader.read_checkpoint` reads them in one pass for loading, hashing every byte.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from uds_lens.families import SUPPORTED_MODEL_TYPES

logger = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A checkpoint could not be loaded (missing, offline hub id, unsupported architecture, ambiguous weights)."""


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def explain_load_error(location: str, what: str, err: BaseException) -> ModelLoadError:
    """One line naming the checkpoint, what failed to load, the cause and the fix, for any loader error."""
    text = str(err)
    lowered = text.lower()
    name = type(err).__name__
    if "trust_remote_code" in text or "custom code" in lowered:
        return ModelLoadError(
            f"{location} needs its own Python code to load its {what} (an auto_map in config.json or "
            "tokenizer_config.json), and uds_lens never runs a checkpoint's code: use a checkpoint of a decoder "
            f"family transformers implements itself (model_type in {SUPPORTED_MODEL_TYPES}), or convert this one."
        )
    if name == "UnpicklingError" or "weights only load failed" in lowered or "weights_only" in lowered:
        return ModelLoadError(
            f"The {what} of {location} are pickled (pytorch_model.bin) with objects torch refuses to unpickle "
            "safely (weights_only), so they were not read: convert the checkpoint to safetensors where you trust it "
            "(model.save_pretrained(dir, safe_serialization=True)) and pass that directory."
        )
    if (
        "safetensor" in lowered
        or "header" in lowered
        or name in ("JSONDecodeError", "UnicodeDecodeError", "error")
    ):
        return ModelLoadError(
            f"The {what} of {location} are not readable safetensors ({name}: {_one_line(text, 160)}): the file is "
            "truncated or corrupt; re-save or re-download the checkpoint."
        )
    if "dtype" in lowered:
        return ModelLoadError(
            f"Could not load the {what} of {location} in the requested dtype ({name}: {_one_line(text, 160)}): pass "
            "--dtype float32, bfloat16 or float16."
        )
    return ModelLoadError(
        f"Could not load the {what} of {location} ({name}: {_one_line(text, 200)}): check that it is a complete "
        "checkpoint (config.json, tokenizer files and every weight shard), or re-download it."
    )


SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
# Files of a checkpoint folder besides its weights that can change its numbers: config, tokenizer, chat template.
IDENTIFYING_SUFFIXES = (".json", ".jinja", ".model", ".txt")
# Files whose ``auto_map`` would ask for the checkpoint's own code.
CODE_MAPS = ("config.json", "tokenizer_config.json")
# safetensors' own limit on a header; a longer one is refused before it is read (a header bomb)
MAX_HEADER_BYTES = 100 << 20
WeightFormat = Literal["safetensors", "bin"]


def _is_weight_file(path: Path) -> bool:
    """What a user could take for a model's weights: safetensors, GGUF, or a pickled ``pytorch_model*.bin``
    (``training_args.bin`` and an optimizer's ``.pt`` are not)."""
    name = path.name.lower()
    return name.endswith((".safetensors", ".gguf")) or (
        name.startswith("pytorch_model") and name.endswith(".bin")
    )


@dataclass(frozen=True)
class CheckpointFiles:
    """What `read_folder` decided about a checkpoint directory.

    Attributes:
        root: the directory.
        weights: the weight files loaded, in load order.
        format: ``"safetensors"`` or ``"bin"`` (pickled, read with ``weights_only``).
        index: the shard index, when the weights are sharded.
        identifying: ``(name, path)`` of every file the identity covers (the weights, the index, the config and
            tokenizer files), sorted by name; a name is the path in the folder (``sub/model-00001.safetensors``).
        unused: weight files in the folder that are not loaded (named in the warning).
        config: ``config.json`` as read.
    """

    root: Path
    weights: tuple[Path, ...]
    format: WeightFormat
    index: Path | None
    identifying: tuple[tuple[str, Path], ...]
    unused: tuple[str, ...]
    config: dict[str, Any] = field(repr=False)

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The weight files as the identity names them."""
        chosen = set(self.weights)
        return tuple(name for name, path in self.identifying if path in chosen)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{path} is not readable JSON ({type(error).__name__}: {error}): {what}; re-save or re-download the "
            "checkpoint."
        ) from error


def refuse_code(root: Path, config: dict[str, Any] | None = None) -> None:
    """Refuse a folder whose config (``config``, as read) or tokenizer config has an ``auto_map``: one line.

    Raises:
        ModelLoadError: naming the file.
    """
    for name in CODE_MAPS:
        content = config if name == "config.json" else None
        if content is None and (root / name).is_file():
            content = _read_json(root / name, "the tokenizer's settings")
        if isinstance(content, dict) and content.get("auto_map"):
            raise ModelLoadError(
                f"{root / name} has an auto_map: the checkpoint needs its own Python code, which uds_lens never runs "
                "(scoring it with the stock class would score another model). Use a checkpoint of a family "
                "transformers implements itself, or remove the auto_map where the stock class is right."
            )


def _inside(root: Path, name: str) -> bool:
    if os.path.isabs(name):
        return False
    return not os.path.normpath(name).startswith(os.pardir)


def _shards(root: Path, index: Path, outside_weights: bool) -> list[tuple[str, Path]]:
    """``(name, path)`` of every shard an index names, in the loader's (sorted) order."""
    content = _read_json(index, "the shard index")
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(
            f"{index} has no weight_map naming the shards: re-save or re-download the checkpoint."
        )
    names = sorted({str(shard) for shard in weight_map.values()})
    outside = [name for name in names if not _inside(root, name)]
    if outside and not outside_weights:
        raise ModelLoadError(
            f"{index.name} in {root} names weight shards outside the folder ({', '.join(outside[:3])}): refused, so "
            "that what is scored is what the folder holds. Copy the shards into the folder, or allow it "
            "(--allow-outside-weights, or Checkpoint.resolve(..., outside_weights=True))."
        )
    shards = [(os.path.normpath(name).replace(os.sep, "/"), root / name) for name in names]
    missing = [name for name, path in shards if not path.is_file()]
    if missing:
        raise ModelLoadError(
            f"{root} is missing weight shard(s) {missing} listed in {index.name}: the download or copy did not "
            "finish; fetch the missing files again."
        )
    return shards


def _chosen(
    root: Path, config: dict[str, Any], outside_weights: bool
) -> tuple[list[tuple[str, Path]], Path | None]:
    """The weight files by the loader's rules, and the index they came from (None: one file)."""
    explicit = config.get("transformers_weights")
    if isinstance(explicit, str) and explicit:
        if not _inside(root, explicit) or not (root / explicit).is_file():
            raise ModelLoadError(
                f"config.json of {root} names transformers_weights={explicit!r}, which is not a file inside the "
                "folder: restore that file, or remove the key."
            )
        if explicit.endswith(".index.json"):
            return _shards(root, root / explicit, outside_weights), root / explicit
        return [(explicit, root / explicit)], None
    for single, index in ((SAFE_WEIGHTS, SAFE_INDEX), (BIN_WEIGHTS, BIN_INDEX)):
        has_single, has_index = (root / single).is_file(), (root / index).is_file()
        if has_single and has_index:
            raise ModelLoadError(
                f"{root} holds both {single} and {index}: two descriptions of the model's weights, and it is "
                "ambiguous which one is meant. Remove the stale one (an older save's)."
            )
        if has_single:
            return [(single, root / single)], None
        if has_index:
            return _shards(root, root / index, outside_weights), root / index
    found = sorted(path.name for path in root.iterdir() if path.is_file() and _is_weight_file(path))
    if found:
        raise ModelLoadError(
            f"{root} has no {SAFE_WEIGHTS} (nor an index or {BIN_WEIGHTS}) but holds {', '.join(found)}: it is "
            f"ambiguous which of them is the model. Rename the one you mean to {SAFE_WEIGHTS}."
        )
    raise ModelLoadError(
        f"{root} has a config.json but no weights ({SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS} or {BIN_INDEX}): "
        "the save or download did not finish; fetch the weight files again."
    )


def read_folder(
    root: str | os.PathLike[str], outside_weights: bool = False, warn: bool = True
) -> CheckpointFiles:
    """Decide once what a Hugging Face checkpoint directory's model is (see the module docstring).

    Args:
        root: the directory (it holds ``config.json``).
        outside_weights: accept shards an index names outside the folder.
        warn: name the weight files that are not loaded in a warning (once, at the door; a re-listing is quiet).

    Raises:
        ModelLoadError: an ``auto_map``, ambiguous or missing weights, shards outside the folder, an unreadable
            config or index; one line naming the folder and the fix.
    """
    folder = Path(root).expanduser()
    config = _read_json(folder / "config.json", "the model's config")
    if not isinstance(config, dict):
        raise ModelLoadError(
            f"{folder / 'config.json'} is not a JSON object: restore the checkpoint's own config."
        )
    refuse_code(folder, config)
    weights, index = _chosen(folder, config, outside_weights)
    chosen = {path for _, path in weights}
    others = [
        (path.name, path)
        for path in folder.iterdir()
        if path.is_file() and path.suffix in IDENTIFYING_SUFFIXES and path not in chosen
    ]
    # the index wherever it lies (in a subfolder, named by transformers_weights): what it says is part of the identity
    indexed = [(os.path.relpath(index, folder).replace(os.sep, "/"), index)] if index is not None else []
    identifying = tuple(sorted({*weights, *others, *indexed}, key=lambda item: item[0]))
    loaded = {name for name, _ in weights}
    unused = tuple(
        sorted(
            path.name
            for path in folder.iterdir()
            if path.is_file() and _is_weight_file(path) and path.name not in loaded
        )
    )
    if unused and warn:
        logger.warning(
            "%s: %s %s not loaded (the model is %s, by Hugging Face's rules) and not part of its identity.",
            folder,
            ", ".join(unused),
            "is" if len(unused) == 1 else "are",
            index.name if index is not None else weights[0][0],
        )
    fmt: WeightFormat = "safetensors" if weights[0][0].endswith(".safetensors") else "bin"
    return CheckpointFiles(
        folder, tuple(path for _, path in weights), fmt, index, identifying, unused, config
    )


def _unreadable(file: Path, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"{file} is not readable safetensors ({why}): the file is truncated or corrupt; re-save or re-download the "
        "checkpoint."
    )


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as handle:
        header, _ = parse_header(handle.read, file.stat().st_size, lambda why: _unreadable(file, why))
    return header


def parse_header(
    read: Callable[[int], bytes], size: int, unreadable: Callable[[str], Exception]
) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and its length in bytes, from ``read`` (the file's next bytes) of a file of ``size``
    bytes; what is wrong with it raised as ``unreadable(why)``. The folder's check and the loading pass both read
    headers here."""
    raw_length = read(8) if size >= 8 else b""
    if len(raw_length) < 8:
        raise unreadable("too short for a header")
    (header_len,) = struct.unpack("<Q", raw_length)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise unreadable(f"its header claims {header_len} bytes")
    try:
        header = json.loads(read(header_len))
    except ValueError as err:
        raise unreadable(f"its header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise unreadable("its header is not a JSON object")
    return header, header_len


def tensor_headers(files: CheckpointFiles) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """``{tensor name: (shape, safetensors dtype)}`` of the weights, from the safetensors headers only (no tensor
    bytes); None for pickled (``.bin``) weights, whose headers need unpickling.

    Raises:
        ModelLoadError: a header that is truncated, longer than safetensors allows, or not JSON.
    """
    if files.format != "safetensors":
        return None
    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files.weights:
        for name, entry in _header(file).items():
            if name != "__metadata__" and isinstance(entry, dict):
                shape = tuple(int(size) for size in entry.get("shape", ()))
                entries[name] = (shape, str(entry.get("dtype", "")))
    return entries


__all__ = [
    "BIN_INDEX",
    "BIN_WEIGHTS",
    "IDENTIFYING_SUFFIXES",
    "MAX_HEADER_BYTES",
    "SAFE_INDEX",
    "SAFE_WEIGHTS",
    "CheckpointFiles",
    "ModelLoadError",
    "WeightFormat",
    "explain_load_error",
    "read_folder",
    "refuse_code",
    "tensor_headers",
]

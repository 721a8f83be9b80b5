"""A checkpoint, made once at the door: where it is, and everything read from it, each read at most once.

Whatever a user passes as a model (a Hugging Face directory, a ``.gguf`` file or a directory holding exactly one, a hub
id, ``zoo:NAME``, or a model already in memory) becomes a `Checkpoint` at the first step that takes it
(`Checkpoint.resolve`), without touching the network for a path: a string that is neither an existing path nor a plausible
hub id (``owner/name``) fails at once; a hub id whose hub cannot be reached fails after one request
(`hub.hub_or_cache`) where it is first read (the run's door reads every config). Everything below takes the value, never the raw argument, and asks it what it needs:

- `files`: which files of a directory are the model (`folder.read_folder`: Hugging Face's rules, leftovers named,
  ambiguity and code refused);
- `config`, `tensor_shapes` (safetensors headers only), `tokenizer` (shared by checkpoints whose tokenizer files are
  byte-identical), each read once and remembered;
- `digest` (the identity of its files now: remembered where their stamp proves it, else read and hashed) and
  `fingerprint` (what a result would record: ``files:<digest>``, ``hub:<id>@<commit>``, ``tensors:<digest of the
  weights in memory>``); a model built from it carries the digest of the bytes its load read, and a result of that
  model records that (`loaded_fingerprint`), never a digest taken before or after the load;
- `label` and `name`: how messages and results name it.

This module imports neither torch nor transformers: the CLI makes its checkpoints before the model libraries load,
so a mistyped path costs a second. The loader is `uds_lens.checkpoints.loader`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

import xxhash

from uds_lens.checkpoints.folder import (
    CheckpointFiles,
    ModelLoadError,
    explain_load_error,
    read_folder,
    refuse_code,
)
from uds_lens.checkpoints.hub import hub_error, hub_or_cache, hub_revision
from uds_lens.data import looks_like_local_path
from uds_lens.families import SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES
from uds_lens.files import ZOO_PREFIX, zoo_search_roots
from uds_lens.zoo_manifest import ManifestError, model_paths

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from uds_lens.tl_compat import ModelLike

logger = logging.getLogger(__name__)

# Every transformers ``from_pretrained`` call (config, tokenizer, model) gets these: a checkpoint's own Python code
# (an ``auto_map`` in its config or tokenizer config) is never run, and transformers never asks on the terminal whether
# to run it (it asks, and reads stdin even when it is not a terminal, when trust_remote_code is left unset).
SAFE_LOAD_KWARGS: dict[str, Any] = {"trust_remote_code": False}
# A hub repository id is "owner/name" (letters, digits, "-", "_", "."; at most 96 characters per part).
_HUB_ID = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$"
)
# Files a tokenizer is read from; two checkpoints whose files are byte-identical have one tokenizer.
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

Kind = Literal["directory", "gguf", "hub", "memory"]


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A model argument made once into a value (`Checkpoint.resolve`); what is read from it is remembered on it.

    Two checkpoints are equal when they are the same files (or hub id, or model object), however they were spelled.

    Attributes:
        kind: ``"directory"`` (a Hugging Face directory), ``"gguf"`` (``location`` is the ``.gguf`` file), ``"hub"``
            (``location`` is the hub id) or ``"memory"`` (a model given loaded, ``model``).
        location: where it is read from (empty for a model in memory).
        given: the argument as it was given (``zoo:npo`` stays ``zoo:npo``): how results name it.
        path_or_id: the argument with a zoo name replaced by its directory: what a loaded model records as its
            ``uds_source``.
        outside_weights: shards an index names outside the folder are accepted.
        model: the model, for ``kind="memory"``.
        model_config: its Hugging Face config (None for a TransformerLens 3.x ``HookedTransformer``, which has
            none), for ``kind="memory"``.
        origin: the checkpoint uds_lens loaded a model in memory from (its tokenizer is the model's), or None.
    """

    kind: Kind
    location: str
    given: str
    path_or_id: str
    outside_weights: bool = False
    model: ModelLike | None = field(default=None, repr=False)
    model_config: PretrainedConfig | None = field(default=None, repr=False)
    origin: Checkpoint | None = field(default=None, repr=False)

    # -- the door --------------------------------------------------------------------------------------------------

    @classmethod
    def resolve(
        cls, argument: object, *, outside_weights: bool = False, weights: bool = True, role: str = "model"
    ) -> Checkpoint:
        """The checkpoint an argument names, classified without touching the network for a path; a `Checkpoint` is
        returned as it is.

        Args:
            argument: a directory, a ``.gguf`` file, a hub id, ``zoo:NAME``, or a model in memory (a
                TransformerBridge, a TransformerLens 3.x HookedTransformer or a Hugging Face causal LM).
            outside_weights: accept weight shards an index names outside the folder.
            weights: a directory must hold a model (``config.json`` or one ``.gguf``); False accepts any directory
                (a tokenizer-only one).
            role: how the `TypeError` names the argument.

        Raises:
            ModelLoadError: a path that does not exist, a directory that is neither a Hugging Face checkpoint nor
                holds exactly one ``.gguf`` file, a file that is not ``.gguf``, or a string that is not a plausible
                hub id (nothing is asked of the hub here).
            TypeError: an argument that is neither a checkpoint reference nor a model.
        """
        if isinstance(argument, Checkpoint):
            return argument
        if isinstance(argument, (str, os.PathLike)):
            return _classify(os.fspath(argument), isinstance(argument, os.PathLike), outside_weights, weights)
        return _in_memory(argument, role)

    # -- identity ---------------------------------------------------------------------------------------------------

    @functools.cached_property
    def key(self) -> tuple[Any, ...]:
        """What equality compares: the resolved location (or the model object)."""
        if self.kind == "memory":
            return ("memory", id(self.model))
        if self.kind == "hub":
            return ("hub", self.location)
        return (self.kind, os.path.realpath(self.location), self.outside_weights)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return self.given

    def __getstate__(self) -> dict[str, Any]:
        """What travels to another process (a Ray worker): the argument and the small facts read from it, never a
        tokenizer, a config object or a model."""
        if self.kind == "memory":
            raise TypeError(f"{self.label} is a model in memory: pass a checkpoint path to another process.")
        heavy = ("config", "tokenizer", "key")
        return {name: value for name, value in self.__dict__.items() if name not in heavy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def local(self) -> bool:
        """A checkpoint on this machine's disk (a directory or a ``.gguf`` file)."""
        return self.kind in ("directory", "gguf")

    @property
    def label(self) -> str:
        """How messages name it: the argument as given, or a model's origin."""
        return self.given

    @property
    def name(self) -> str:
        """Result name: a directory's basename, a zoo model's name, or a hub id with ``/`` replaced by ``__``."""
        return name_of(self.given if self.kind != "memory" else self.label)

    # -- what is read from it, once --------------------------------------------------------------------------------

    @functools.cached_property
    def files(self) -> CheckpointFiles:
        """Which files of the directory are the model (`folder.read_folder`), decided once.

        Raises:
            ModelLoadError: not a directory checkpoint, or its folder is refused (ambiguous weights, ``auto_map``).
        """
        if self.kind != "directory":
            raise ModelLoadError(f"{self.label} is a {self.kind} checkpoint, not a Hugging Face directory.")
        return read_folder(self.location, self.outside_weights)

    @functools.cached_property
    def config(self) -> PretrainedConfig:
        """Its Hugging Face config, of a supported family (read once; offline for a local checkpoint).

        Raises:
            ModelLoadError: unreadable, of a family uds_lens does not support, or asking for its own code.
        """
        with self.errors("config"):
            config = self._read_config()
        check_supported(config, self.path_or_id)
        if getattr(config, "auto_map", None):
            raise ModelLoadError(
                f"The config of {self.label} has an auto_map: the checkpoint needs its own Python code, which "
                "uds_lens never runs. Use a checkpoint of a family transformers implements itself."
            )
        return config

    def _read_config(self) -> PretrainedConfig:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if self.kind == "memory":
            if self.model_config is None:
                raise ModelLoadError(f"{self.label} is a HookedTransformer: it has no Hugging Face config.")
            return self.model_config
        if self.kind == "directory":
            raw = dict(self.files.config)
            if raw.get("model_type") in CONFIG_MAPPING:
                return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
        if self.kind == "gguf":
            _check_gguf(self.location)
        first, kwargs = self.from_pretrained_args()
        return AutoConfig.from_pretrained(first, **kwargs)

    @functools.cached_property
    def tensor_headers(self) -> dict[str, tuple[tuple[int, ...], str]] | None:
        """``{name: (shape, safetensors dtype)}`` of the tensors its weight files hold, from the headers alone (read
        once); None where they cannot be read without loading (pickled weights, ``.gguf``, a hub id, a model in
        memory). Remembered by the weight files' stamp, as a digest is (`digests.remembered_headers`): a rerun on
        unchanged files opens none of them."""
        if self.kind != "directory":
            return None
        from uds_lens.checkpoints.digests import remembered_headers

        return remembered_headers(self.files)

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """``{name: shape}`` of the tensors its weight files hold (`tensor_headers`)."""
        headers = self.tensor_headers
        return None if headers is None else {name: shape for name, (shape, _) in headers.items()}

    @property
    def stored_dtypes(self) -> set[str] | None:
        """The safetensors dtypes its weight files store (``"F32"``, ``"BF16"`` ...; `tensor_headers`), or None
        where the headers cannot tell."""
        headers = self.tensor_headers
        return None if headers is None else {dtype for _, dtype in headers.values()}

    @functools.cached_property
    def tokenizer_files(self) -> str | None:
        """XXH3-128 of its tokenizer files (names and bytes), or None when it has none (or is not a directory)."""
        if self.kind == "memory":
            return self.origin.tokenizer_files if self.origin is not None else None
        if self.kind != "directory":
            return None
        root = Path(self.location)
        present = [root / name for name in TOKENIZER_FILES if (root / name).is_file()]
        if not present:
            return None
        hasher = xxhash.xxh3_128()
        for file in present:
            hasher.update(file.name.encode() + b"\0")
            hasher.update(file.read_bytes())
        return hasher.hexdigest()

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """Its fast tokenizer (UDS needs character offsets), read once per distinct set of tokenizer files; its pad
        token is its end token when it has none. A ``.gguf``'s is rebuilt from the file (slow: seconds; `gguf_to_hf`
        saves it as a directory); a model in memory has the tokenizer of the checkpoint it was loaded from.

        Raises:
            ModelLoadError: no tokenizer can be read (a model in memory that uds_lens did not load: pass one).
        """
        if self.kind == "memory":
            if self.origin is None:
                raise ModelLoadError(
                    f"{self.label} is a model in memory with no checkpoint uds_lens loaded it from: pass its "
                    "tokenizer (tokenizer=...)."
                )
            return self.origin.tokenizer
        digest = self.tokenizer_files
        if digest is not None and digest in _TOKENIZERS:
            return _TOKENIZERS[digest]
        if self.kind == "directory":
            if (Path(self.location) / "config.json").is_file():
                _ = self.files  # its reading refuses an auto_map in the tokenizer's config too
            else:
                refuse_code(Path(self.location))  # a tokenizer-only directory
        from transformers import AutoTokenizer

        first, kwargs = self.from_pretrained_args()
        with self.errors("tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(first, use_fast=True, **kwargs)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if digest is not None:
            _TOKENIZERS[digest] = tokenizer
        return tokenizer

    def identifying(self) -> tuple[Path, list[tuple[str, Path]]]:
        """The checkpoint's root and the ``(name, path)`` of every file its identity covers: a directory's
        `CheckpointFiles.identifying`, a ``.gguf`` file itself.

        The folder is listed again each time (a directory's listing and config are read in milliseconds), so a
        `Checkpoint` kept across calls never names files that are no longer what it read at the door: the weight
        files or their index renamed, a tokenizer file added, the config changed.

        Raises:
            ModelLoadError: not a local checkpoint, or its folder changed since it was resolved (naming what).
        """
        if self.kind == "gguf":
            path = Path(self.location)
            return path, [(path.name, path)]
        files = self.files
        now = read_folder(self.location, self.outside_weights, warn=False)
        changed = [
            what
            for what, before, after in (
                ("its config.json", files.config, now.config),
                ("which files are its weights", files.weights, now.weights),
                ("its identifying files (config, tokenizer, index)", files.identifying, now.identifying),
            )
            if before != after
        ]
        if changed:
            raise ModelLoadError(
                f"{self.label} changed since it was resolved ({'; '.join(changed)}): what was read from it at the "
                "door (its config, its comparison with the other models) no longer describes it. Pass the "
                "checkpoint again (a new run, or Checkpoint.resolve(path))."
            )
        return files.root, list(files.identifying)

    def known_digest(self) -> str | None:
        """The digest when the files' stamp proves a remembered one (`digests.known_digest`: nothing is read but
        the files' metadata); None when it would have to be read. Never remembered on the value: the files may
        change between two questions."""
        if not self.local:
            return self.digest
        from uds_lens.checkpoints.digests import file_stamp, known_digest

        return known_digest(file_stamp(*self.identifying()))

    @property
    def digest(self) -> str:
        """The identity of its contents now: ``xxh3_128/v2:...`` of the files its loading reads (the remembered
        digest where their stamp proves it, else read and hashed once: `digests.files_digest`), a hub id itself,
        or the digest of a model's tensors in memory (asked each time: weights in memory can change; the digest is
        memoised per weights by `digests.model_fingerprint`).

        A model built from the checkpoint carries the digest of the bytes its load read (`loaded_fingerprint`):
        that, not this, is what a result of that model records."""
        from uds_lens.checkpoints.digests import files_digest, model_fingerprint

        if self.kind == "hub":
            return self.location
        if self.model is not None:
            return model_fingerprint(self.model)
        return files_digest(*self.identifying())

    @property
    def fingerprint(self) -> str:
        """What a result of it would record now, before any load: ``files:<digest>`` of a local checkpoint,
        ``hub:<id>@<commit>`` of a hub id (the commit in the local cache, or ``unresolved``), ``tensors:<digest>``
        of a model in memory."""
        if self.kind == "hub":
            return f"hub:{self.location}@{hub_revision(self.location) or 'unresolved'}"
        if self.kind == "memory":
            return "tensors:" + self.digest
        return "files:" + self.digest

    def loaded_fingerprint(self, model: ModelLike | None) -> str:
        """What a result computed with ``model``, loaded from this checkpoint, records: ``files:<digest>`` of the
        bytes its load read (`digests.loaded_digest`), never of the files as they are now; `fingerprint` where the
        model carries none (a hub id, a model in memory, or no model)."""
        from uds_lens.checkpoints.digests import loaded_digest

        found = loaded_digest(model) if model is not None and self.local else None
        return "files:" + found if found is not None else self.fingerprint

    def weights_digest(self, model: ModelLike | None) -> str:
        """The identity of the weights ``model`` (loaded from this checkpoint) holds, as the S1 cache is keyed: the
        digest of the bytes its load read (a local checkpoint), else of its tensors (a hub model, a model in memory;
        with no model, `digest`)."""
        from uds_lens.checkpoints.digests import loaded_digest, model_fingerprint

        if model is None:
            return self.digest
        found = loaded_digest(model) if self.local else None
        return found if found is not None else model_fingerprint(model)

    # -- reading with transformers ---------------------------------------------------------------------------------

    def from_pretrained_args(self) -> tuple[str, dict[str, Any]]:
        """First argument and extra keyword arguments of a ``transformers`` ``from_pretrained`` call."""
        if self.kind == "gguf":
            path = Path(self.location)
            return str(path.parent), {"gguf_file": path.name, **SAFE_LOAD_KWARGS}
        local_files_only = self.local or not hub_or_cache(self.location)
        return self.location, {"local_files_only": local_files_only, **SAFE_LOAD_KWARGS}

    @contextlib.contextmanager
    def errors(self, what: str = "weights") -> Iterator[None]:
        """Turn any error of a loader reading this checkpoint (unpickling, a corrupt safetensors header, a missing
        shard, a dtype, custom code, a hub id that cannot be fetched) into one `ModelLoadError` line naming the
        checkpoint and the fix (the CLI prints it and exits 2, no traceback). ``ModelLoadError``, ``ConfigError`` and
        memory errors pass through unchanged."""
        from uds_lens.config import ConfigError

        try:
            yield
        except (ModelLoadError, ConfigError, MemoryError, KeyboardInterrupt):
            raise
        except Exception as err:
            from uds_lens.memory import is_out_of_memory

            if is_out_of_memory(err):
                raise  # not the checkpoint's fault: the caller frees memory and retries (memory.retry_out_of_memory)
            if self.kind == "hub" and isinstance(err, OSError):
                raise hub_error(self.location, err) from err
            raise explain_load_error(self.location or self.label, what, err) from err


CheckpointRef: TypeAlias = str | os.PathLike[str] | Checkpoint
"""A checkpoint argument: a Hugging Face directory, a ``.gguf`` file (or a directory holding one), a hub id,
``zoo:NAME``, or a `Checkpoint` made already."""


def check_supported(config: PretrainedConfig, name: str) -> None:
    """Refuse a config of a family uds_lens does not support, naming it and the families that are."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None)
        raise ModelLoadError(
            f"{name} is a {model_type!r} model ({archs}); uds_lens supports the decoder families "
            f"{SUPPORTED_MODEL_TYPES} (model_type). Use a checkpoint of one of them."
        )


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """The ``general.architecture`` field of a GGUF file (e.g. ``"llama"``), read with the ``gguf`` package."""
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ModelLoadError(
            f"Reading {path} needs the `gguf` package: pip install 'uds_lens[gguf]' (or pip install gguf)."
        ) from err
    try:
        found = GGUFReader(str(path)).fields.get("general.architecture")
    except Exception as err:  # a truncated or foreign file: name it instead of a parser traceback
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}).") from err
    if found is None:
        raise ModelLoadError(f"{path} has no general.architecture field: not a model GGUF file.")
    return str(found.contents())


def _check_gguf(location: str) -> None:
    architecture = gguf_architecture(location)
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{location} is a GGUF checkpoint of architecture {architecture!r}; uds_lens supports "
            f"general.architecture in {SUPPORTED_GGUF_ARCHITECTURES}. Use a model of one of those families."
        )


# ----------------------------------------------------------------------------------------------------------------
# The door's reading of an argument


def _looks_like_path(text: str) -> bool:
    """A string the user meant as a local path (``data.looks_like_local_path``, shared with the data loader), or a
    ``.`` / ``~`` start such as ``.ckpt``."""
    return text.startswith((".", "~")) or looks_like_local_path(text)


def _classify(given: str, path_like: bool, outside_weights: bool, weights: bool) -> Checkpoint:
    text = resolve_zoo_name(given)
    path = Path(text).expanduser()

    def made(kind: Kind, location: str) -> Checkpoint:
        return Checkpoint(kind, location, given, text, outside_weights)

    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return made("gguf", str(path))
        raise ModelLoadError(
            f"{text} is a file but not a .gguf checkpoint. Pass a Hugging Face checkpoint directory (config.json + "
            "weights), a .gguf file, or a hub id (owner/name)."
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return made("directory", str(path))
        ggufs = sorted(p.name for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(ggufs) == 1:
            return made("gguf", str(path / ggufs[0]))
        if ggufs:
            raise ModelLoadError(
                f"{text} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); pass the one you mean as a file path."
            )
        if not weights:
            return made("directory", str(path))
        raise ModelLoadError(
            f"{text} is a directory but has no config.json and no .gguf file: not a Hugging Face checkpoint."
        )
    if path_like or _looks_like_path(text):
        raise ModelLoadError(
            f"No such checkpoint: {text} does not exist (resolved to {path.absolute()}). Check the path; it was not "
            "looked up on the Hugging Face hub."
        )
    if not _HUB_ID.match(text) or ".." in text or "--" in text:
        raise ModelLoadError(
            f"{text!r} is neither an existing directory or .gguf file nor a plausible Hugging Face hub id "
            "(owner/name). Pass a local checkpoint directory, a .gguf file, or a hub id such as "
            "'meta-llama/Llama-3.2-1B'."
        )
    return made("hub", text)


def _in_memory(model: object, role: str) -> Checkpoint:
    """A model given loaded: the one place that tells the kinds of model apart (a bridge, a HookedTransformer, a
    Hugging Face model), and finds its Hugging Face config and the checkpoint uds_lens loaded it from."""
    from uds_lens.tl_compat import hf_model_of, is_hooked_transformer, is_tl_model

    if not (is_tl_model(model) or hasattr(model, "config")):
        raise TypeError(
            f"{role} must be a checkpoint path, hub id, zoo:NAME, TransformerBridge, HookedTransformer or Hugging "
            f"Face model (got {type(model).__name__})."
        )
    typed = cast("ModelLike", model)
    hf = None if is_hooked_transformer(typed) else (hf_model_of(typed) if is_tl_model(typed) else typed)
    loaded_from = [getattr(holder, "uds_checkpoint", None) for holder in (model, hf)]
    origin = next((found for found in loaded_from if isinstance(found, Checkpoint)), None)
    label = model_label(model)
    return Checkpoint(
        "memory", "", label, label, model=typed, model_config=getattr(hf, "config", None), origin=origin
    )


def model_label(model: object) -> str:
    """How messages name a model in memory: where uds_lens loaded it from (``uds_source``), its Hugging Face name,
    or its class."""
    return str(
        getattr(model, "uds_source", None)
        or getattr(getattr(model, "config", None), "_name_or_path", None)
        or type(model).__name__
    )


def resolve_zoo_name(text: str) -> str:
    """``"zoo:NAME"`` -> that model's directory in a built zoo; anything else unchanged.

    ``zoo:npo`` looks in ``$UDS_LENS_ZOO``, then the package's cached zoos (``zoo-default``, ``zoo-test`` under
    ``files.cache_root()``); ``zoo:test/npo`` names the size. For a zoo elsewhere use ``load_zoo(dir).path("npo")``.

    Raises:
        ModelLoadError: a zoo name no built zoo has, or a bare name that is a zoo model's (say ``zoo:NAME``).
    """
    default_roots = zoo_search_roots()
    if not text.startswith(ZOO_PREFIX):
        if "/" not in text and not Path(text).expanduser().exists():
            # A zoo model's bare name is not a hub id worth retrying for ~20 s: say how to name it (a zoo whose
            # manifest cannot be read is no hint: the name was not asked of a zoo).
            for root in default_roots:
                with contextlib.suppress(ManifestError):
                    if text in model_paths(root):
                        raise ModelLoadError(
                            f"{text!r} is not a checkpoint directory; the zoo in {root} has a model "
                            f"of that name: pass 'zoo:{text}' (or its directory, {root / model_paths(root)[text]})."
                        )
        return text
    name = text[len(ZOO_PREFIX) :]
    if "/" in name:
        size, name = name.split("/", 1)
        roots = zoo_search_roots(size)
    else:
        roots = default_roots
    seen = []
    for root in roots:
        try:
            entries = model_paths(root)
        except ManifestError as error:
            raise ModelLoadError(f"{text!r} cannot be looked up: {error}") from None
        if not entries:
            continue
        seen.append(f"{root}: {sorted(entries)}")
        if name in entries:
            return str(root / entries[name])
    raise ModelLoadError(
        f"{text!r} names no model of a built zoo ("
        + ("; ".join(seen) if seen else f"no zoo found in {[str(r) for r in roots]}")
        + "). Build one with `uds-lens zoo build --out DIR --size test` (and set UDS_LENS_ZOO=DIR), or pass a "
        "checkpoint directory."
    )


# ----------------------------------------------------------------------------------------------------------------
# Names


def name_of(text: str) -> str:
    """Result name of a model argument as written: a directory's basename, a zoo model's name, or a hub id with
    ``/`` replaced by ``__``."""
    if text.startswith(ZOO_PREFIX):
        return text[len(ZOO_PREFIX) :].rsplit("/", 1)[-1]
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve().name
    return text.replace("/", "__")


__all__ = [
    "SAFE_LOAD_KWARGS",
    "TOKENIZER_FILES",
    "Checkpoint",
    "CheckpointRef",
    "Kind",
    "check_supported",
    "gguf_architecture",
    "model_label",
    "name_of",
    "resolve_zoo_name",
]

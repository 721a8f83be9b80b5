"""Resolving a model argument: which checkpoint a string or path names, and what a model is called.

Before anything is loaded, a checkpoint argument is classified without touching the network
([`resolve_source`][uds_lens.resolve.resolve_source]): a Hugging Face directory (``config.json`` + weights), a ``.gguf`` file (or a directory
holding exactly one), a zoo model (``zoo:NAME``, [`resolve_zoo_name`][uds_lens.resolve.resolve_zoo_name], read from the zoo's manifest), or a hub id;
a string that is neither an existing path nor a plausible hub id (``owner/name``) fails at once, before any hub
request. A hub id is looked up once: when the hub cannot be reached (one request, [`hub_reachable`][uds_lens.resolve.hub_reachable]), loading
fails with one line, or reads the local Hugging Face cache where the model is there, instead of retrying for half a
minute; [`check_sources`][uds_lens.resolve.check_sources] does all of this for a run's checkpoints before any of them loads, and hands each back
resolved: a [`CheckpointSource`][uds_lens.resolve.CheckpointSource] stands for its argument (a path-like object whose path is the argument as
given), so it is passed down in the argument's place and nothing below resolves it again. [`describe`][uds_lens.resolve.describe] and
[`model_name`][uds_lens.resolve.model_name] give the names results use. Loading is [`uds_lens.models`][uds_lens.models].
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeVar

from uds_lens.data import looks_like_local_path
from uds_lens.files import ZOO_PREFIX, zoo_search_roots
from uds_lens.zoo.manifest import model_paths

logger = logging.getLogger(__name__)

M = TypeVar("M")


class ModelLoadError(RuntimeError):
    """A checkpoint could not be loaded (missing, offline hub id, unsupported architecture)."""


# Every transformers ``from_pretrained`` call (config, tokenizer, model) gets these: a checkpoint's own Python code
# (an ``auto_map`` in its config or tokenizer config) is never run, and transformers never asks on the terminal whether
# to run it (it asks, and reads stdin even when it is not a terminal, when trust_remote_code is left unset).
SAFE_LOAD_KWARGS: dict[str, Any] = {"trust_remote_code": False}


# A hub repository id is "owner/name" (letters, digits, "-", "_", "."; at most 96 characters per part).
_HUB_ID = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$"
)


CheckpointRef: TypeAlias = str | os.PathLike[str]
"""A checkpoint argument: a Hugging Face directory, a ``.gguf`` file (or a directory holding one), a hub id,
``zoo:NAME``, or a [`CheckpointSource`][uds_lens.resolve.CheckpointSource] (one resolved already)."""


@dataclass(frozen=True)
class CheckpointSource(os.PathLike[str]):
    """A checkpoint argument resolved once ([`resolve_source`][uds_lens.resolve.resolve_source]), to be passed down instead of the argument.

    It stands for the argument it was resolved from: ``os.fspath`` and ``str`` give that argument as it was given
    (``zoo:npo`` stays ``zoo:npo``), so it goes wherever a checkpoint path or hub id goes (a fingerprint, a name, a
    loader), and [`resolve_source`][uds_lens.resolve.resolve_source] returns it as it is instead of resolving it again.

    Attributes:
        kind: ``"directory"`` (a Hugging Face directory), ``"gguf"`` (``location`` is the ``.gguf`` file) or
            ``"hub"`` (``location`` is the hub id).
        location: where the checkpoint is read from.
        path_or_id: the argument with a zoo name replaced by its directory: what a loaded model records as its
            ``uds_source`` and loader messages name it by.
        given: the argument as it was given.
    """

    kind: Literal["directory", "gguf", "hub"]
    location: str
    path_or_id: str
    given: str

    def __fspath__(self) -> str:
        return self.given

    def __str__(self) -> str:
        return self.given

    @property
    def local(self) -> bool:
        return self.kind != "hub"

    def from_pretrained_args(self) -> tuple[str, dict[str, Any]]:
        """First argument and extra keyword arguments of a ``transformers`` ``from_pretrained`` call."""
        if self.kind == "gguf":
            path = Path(self.location)
            return str(path.parent), {"gguf_file": path.name, **SAFE_LOAD_KWARGS}
        local_files_only = self.local or not _hub_or_cache(self.location)
        return self.location, {"local_files_only": local_files_only, **SAFE_LOAD_KWARGS}


def _looks_like_path(text: str) -> bool:
    """A string the user meant as a local path (``data.looks_like_local_path``, shared with the data loader), or a
    ``.`` / ``~`` start such as ``.ckpt``."""
    return text.startswith((".", "~")) or looks_like_local_path(text)


def resolve_source(path_or_id: CheckpointRef, weights: bool = True) -> CheckpointSource:
    """Classify a checkpoint argument without touching the network, failing at once on what cannot be one; a
    [`CheckpointSource`][uds_lens.resolve.CheckpointSource] is returned as it is (it was resolved already).

    Args:
        path_or_id: a directory, a ``.gguf`` file, a hub id or ``zoo:NAME``.
        weights: a directory must hold a model (``config.json`` or one ``.gguf``); ``False`` accepts any
            directory (a tokenizer-only one).

    Raises:
        ModelLoadError: a path that does not exist, a directory that is neither a Hugging Face checkpoint nor holds
            exactly one ``.gguf`` file, a file that is not ``.gguf``, or a string that is not a plausible hub id.
    """
    if isinstance(path_or_id, CheckpointSource):
        return path_or_id
    given = os.fspath(path_or_id)
    path_or_id = resolve_zoo_name(path_or_id)
    text = os.fspath(path_or_id)
    path = Path(text).expanduser()

    def source(kind: Literal["directory", "gguf", "hub"], location: str) -> CheckpointSource:
        return CheckpointSource(kind, location, text, given)

    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return source("gguf", str(path))
        raise ModelLoadError(
            f"{text} is a file but not a .gguf checkpoint. Pass a Hugging Face checkpoint directory (config.json + "
            "weights), a .gguf file, or a hub id (owner/name)."
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return source("directory", str(path))
        ggufs = sorted(p.name for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(ggufs) == 1:
            return source("gguf", str(path / ggufs[0]))
        if ggufs:
            raise ModelLoadError(
                f"{text} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); pass the one you mean as a file path."
            )
        if not weights:
            return source("directory", str(path))
        raise ModelLoadError(
            f"{text} is a directory but has no config.json and no .gguf file: not a Hugging Face checkpoint."
        )
    if isinstance(path_or_id, os.PathLike) or _looks_like_path(text):
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
    return source("hub", text)


# How long one hub request may take, and how long its answer is trusted (a notebook that lost its connection
# recovers without a restart).
HUB_TIMEOUT_S = 10.0
HUB_ANSWER_TTL_S = 60.0
_hub_answers: dict[str, tuple[float, str | None]] = {}


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")


def hub_reachable() -> str | None:
    """Whether the Hugging Face hub answers: None when it does, else why not, one line.

    One request (a ``HEAD`` of the endpoint, ``HUB_TIMEOUT_S`` at most; any HTTP status counts as an answer), its
    answer kept for ``HUB_ANSWER_TTL_S``: ``transformers`` itself retries an unreachable hub five times with backoff
    (about half a minute, each retry logged), which a checkpoint argument that is a typo should not cost.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = constants.ENDPOINT
    now = time.monotonic()
    cached = _hub_answers.get(endpoint)
    if cached is not None and now - cached[0] < HUB_ANSWER_TTL_S:
        return cached[1]
    problem: str | None = None
    try:
        get_session().head(endpoint, timeout=HUB_TIMEOUT_S)
    except Exception as err:  # any transport error: DNS, refused, timeout, proxy
        problem = f"{type(err).__name__}: {_first_line(str(err))}"
    _hub_answers[endpoint] = (now, problem)
    return problem


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _hub_or_cache(model_id: str) -> bool:
    """True to fetch ``model_id`` from the hub, False to read it from the local Hugging Face cache (the hub cannot
    be reached, or HF_HUB_OFFLINE is set, and the cache holds its config).

    Raises:
        ModelLoadError: the hub cannot be reached and the cache does not hold the model: one line, after one try.
    """
    if _hub_offline():
        return False  # transformers reads the cache, or fails naming HF_HUB_OFFLINE (models.loader_errors)
    problem = hub_reachable()
    if problem is None:
        return True
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        logger.warning(
            "The Hugging Face hub cannot be reached (%s); reading %s from the local cache.", problem, model_id
        )
        return False
    raise ModelLoadError(
        f"Cannot load {model_id!r}: there is no local path {Path(model_id).absolute()}, and as a Hugging Face hub id it "
        f"can be neither fetched (the hub cannot be reached: {problem}) nor read from the local cache. Pass an "
        "existing checkpoint directory or .gguf file (check the path), or connect to the hub."
    )


def check_source(model: M) -> M | CheckpointSource:
    """Resolve a checkpoint argument before it loads: a mistyped path, an implausible hub id or a hub id that can be
    neither fetched (the hub is unreachable) nor read from the cache fails at once, in one line.

    Returns:
        A checkpoint reference (a string or path) as its [`CheckpointSource`][uds_lens.resolve.CheckpointSource], to be passed down in its place
        (it is resolved once); anything else (a model in memory, None) as it is.

    Raises:
        ModelLoadError: ``model`` cannot name a checkpoint.
    """
    if not isinstance(model, (str, os.PathLike)):
        return model
    source = resolve_source(model)
    if source.kind == "hub":
        _hub_or_cache(source.location)
    return source


def check_sources(models: Iterable[M]) -> list[M | CheckpointSource]:
    """[`check_source`][uds_lens.resolve.check_source] of each of a run's model arguments, in order, before any of them loads.

    Raises:
        ModelLoadError: the first argument that cannot name a checkpoint.
    """
    return [check_source(model) for model in models]


def is_local(path_or_id: str | os.PathLike) -> bool:
    """True for an existing local checkpoint: a directory or a ``.gguf`` file."""
    path = Path(path_or_id).expanduser()
    return path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")


def hub_error(model_id: str, err: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    return ModelLoadError(
        f"Could not load {model_id!r}: it is not a local directory, and fetching it from the Hugging Face hub failed "
        f"({type(err).__name__}: {err}). "
        + (
            "HF_HUB_OFFLINE is set, so the hub is not contacted. "
            if offline
            else "This machine may have no access to the hub (set HF_HUB_OFFLINE=1 to fail fast). "
        )
        + "Pass a local checkpoint directory instead (e.g. one saved with `save_pretrained`, or a zoo model from "
        "`uds-lens zoo build`)."
    )


def resolve_zoo_name(path_or_id: str | os.PathLike) -> str | os.PathLike:
    """``"zoo:NAME"`` -> that model's directory in a built zoo; anything else unchanged.

    ``zoo:npo`` looks in ``$UDS_LENS_ZOO``, then the package's cached zoos (``zoo-default``, ``zoo-test`` under
    ``files.cache_root()``); ``zoo:test/npo`` names the size. For a zoo elsewhere use ``load_zoo(dir).path("npo")``
    or ``load_zoo(dir).model("npo")``.
    """
    text = str(path_or_id)
    default_roots = zoo_search_roots()
    if not text.startswith(ZOO_PREFIX):
        if "/" not in text and not Path(text).expanduser().exists():
            # A zoo model's bare name is not a hub id worth retrying for ~20 s: say how to name it.
            for root in default_roots:
                if text in model_paths(root):
                    raise ModelLoadError(
                        f"{text!r} is not a checkpoint directory; the zoo in {root} has a model "
                        f"of that name: pass 'zoo:{text}' (or its directory, {root / model_paths(root)[text]})."
                    )
        return path_or_id
    name = text[len(ZOO_PREFIX) :]
    if "/" in name:
        size, name = name.split("/", 1)
        roots = zoo_search_roots(size)
    else:
        roots = default_roots
    seen = []
    for root in roots:
        entries = model_paths(root)
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


def describe(path_or_model: object) -> str:
    """How messages and results name a model argument: a checkpoint reference as given, a loaded model by where it
    was loaded from (``uds_source``), its Hugging Face name, or its class."""
    if isinstance(path_or_model, (str, os.PathLike)):
        return str(path_or_model)
    return (
        getattr(path_or_model, "uds_source", None)
        or getattr(getattr(path_or_model, "config", None), "_name_or_path", None)
        or type(path_or_model).__name__
    )


def model_name(source: object) -> str:
    """Result name of a model: a directory's basename, or a hub id with ``/`` replaced by ``__``."""
    described = describe(source)
    if described.startswith(ZOO_PREFIX):
        return described[len(ZOO_PREFIX) :].rsplit("/", 1)[-1]
    path = Path(described).expanduser()
    if path.is_dir():
        return path.resolve().name
    return described.replace("/", "__")


def loadable(path: str) -> bool:
    """Whether ``path`` names a checkpoint ``--unlearned`` could load: an existing path, a zoo name or a hub id."""
    if Path(path).expanduser().exists():
        return True
    try:
        resolve_source(path)
    except ModelLoadError:
        return False
    return True


def split_named(value: str) -> tuple[str, str] | None:
    """``NAME=PATH`` as ``(NAME, PATH)``, or None for a bare path (an existing path, even one with ``=`` in it).

    Either side may contain ``=``: the split is the one whose right side is a loadable checkpoint (an existing path,
    a zoo name, a hub id); where none is, the first ``=`` (so the error names the missing checkpoint).
    """
    if "=" not in value or Path(value).expanduser().exists():
        return None
    splits = [
        (value[:at], value[at + 1 :])
        for at, char in enumerate(value)
        if char == "=" and 0 < at < len(value) - 1
    ]
    if not splits:
        return None
    return next((split for split in splits if loadable(split[1])), splits[0])


def checkpoint_paths(values: list[str]) -> list[str]:
    """The checkpoints ``--unlearned`` values name, ``NAME=`` removed (see [`split_named`][uds_lens.resolve.split_named])."""
    return [value if split is None else split[1] for value, split in ((v, split_named(v)) for v in values)]


__all__ = [
    "checkpoint_paths",
    "loadable",
    "split_named",
    "HUB_TIMEOUT_S",
    "SAFE_LOAD_KWARGS",
    "CheckpointRef",
    "CheckpointSource",
    "ModelLoadError",
    "check_source",
    "check_sources",
    "describe",
    "hub_reachable",
    "is_local",
    "model_name",
    "resolve_source",
    "resolve_zoo_name",
]

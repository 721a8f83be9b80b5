"""A run's inputs, made once at the door: the checkpoints, the forget set and the settings, checked together.

Every way into a UDS run (``uds-lens score`` and ``sweep``, `scoring.score_models`, `sweep.driver.sweep`,
`auditor.UDSAuditor`) takes either the raw arguments a user writes (paths, hub ids, ``zoo:NAME``, models in memory, a
data file or records) or a `RunInputs`, and turns the raw ones into a `RunInputs` at its first step
(`RunInputs.resolve`). What the value holds is read once there and never worked out again below:

- each model as a `Checkpoint` (`Checkpoint.resolve`: a mistyped path fails here, before anything loads);
- the forget set as `Example`s (the file read and checked once, ``limit`` applied);
- the settings (`UDSConfig`), the S1 cache directory, an explicit tokenizer;
- full, retain and every unlearned model compared once (`compatibility.check_compatible`: one family, one tokenizer,
  one shape), from what each checkpoint read (config, tokenizer, tensor headers), before any model is built.

`RunInputs.input_paths` lists every input location the run reads (checkpoint folders and files, weight shards wherever
an index points, the forget set), so an output can be checked against them (the S1 cache beside them, as a cache).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ModelIdentity, check_compatible, identity_of
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import ModelArg
from uds_lens.checkpoints.names import result_names
from uds_lens.config import UDSConfig, as_config, check_positive_int
from uds_lens.data import DataArg, DataError, Example, check_data_source, load_examples
from uds_lens.files import json_digest
from uds_lens.outputs import check_cache_apart
from uds_lens.result_store import check_result_name
from uds_lens.stage_cache import s1_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class NotGiven:
    """The default of an argument a caller must give unless it passes a `RunInputs` (``retain``: None is
    retain-free mode, so it cannot stand for "not given")."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN = NotGiven()

# How the output checks name the S1 cache directory (read and written by the run itself, unlike its inputs).
S1_CACHE = "S1 cache"


def examples_fingerprint(examples: Sequence[Example]) -> str:
    """Digest of a forget set as scored (after ``limit``): every field of every record, in order."""
    return json_digest([example.to_record() for example in examples])[:32]


@dataclass(frozen=True)
class RunInputs:
    """What one UDS run reads, made once (`RunInputs.resolve`).

    Attributes:
        full: the patch target and baseline.
        retain: the Stage 1 source, or None (retain-free mode).
        examples: the forget set as scored (after ``limit``).
        data_name: how results name the forget set (its path, or ``<records>``).
        config: the settings.
        unlearned: the named unlearned models of a multi-model run (``{result name: checkpoint}``); an auditor
            scores others too, each checked against full when it arrives (`admit`).
        limit: the ``limit`` the examples were cut to.
        cache_dir: the S1 cache directory (None: the default, False: no cache).
        tokenizer: a tokenizer passed explicitly (None: full's own).
        data_path: the forget set's file, when it was read from one.
        unreadable: unlearned models left out at the door (``{name: why}``; a sweep reports them as failed rows).
    """

    full: Checkpoint
    retain: Checkpoint | None
    examples: list[Example]
    data_name: str
    config: UDSConfig = field(default_factory=UDSConfig)
    unlearned: dict[str, Checkpoint] = field(default_factory=dict)
    limit: int | None = None
    cache_dir: str | os.PathLike[str] | bool | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    data_path: Path | None = None
    unreadable: dict[str, str] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        full: ModelArg | RunInputs,
        retain: ModelArg | None | NotGiven = NOT_GIVEN,
        data: DataArg | NotGiven = NOT_GIVEN,
        unlearned: Sequence[ModelArg] | Mapping[str, ModelArg] = (),
        *,
        config: UDSConfig | None = None,
        limit: int | None = None,
        cache_dir: str | os.PathLike[str] | bool | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        outside_weights: bool = False,
        skip_unreadable: bool = False,
        data_name: str | None = None,
    ) -> RunInputs:
        """The door of a run: raw arguments made into one value, checked (a `RunInputs` is returned as it is).

        Args:
            full / retain: checkpoint references or models in memory (retain None: retain-free mode).
            data: a JSON/JSONL path, a hub dataset id, an ``hf:`` spec (`benchmarks`), records or ``Example``s.
            unlearned: models (named by `names.result_names`) or ``{name: model}``.
            config / limit / cache_dir / tokenizer: the settings, the first ``limit`` examples, the S1 cache
                directory, a tokenizer of one's own.
            outside_weights: accept weight shards an index names outside the checkpoint folder.
            skip_unreadable: an unlearned model that names no checkpoint or whose config cannot be read is left out
                (in ``unreadable``) instead of failing the run: a sweep reports it as a failed row.
            data_name: how results name the forget set (default: its path, or ``<records>``).

        Raises:
            ModelLoadError: a checkpoint argument that names no checkpoint, or whose config cannot be read.
            ModelMismatchError: models that cannot be patched into each other.
            DataError / ConfigError / ResultNameError: the forget set (multiple-choice items with a retain model
                among its errors), ``limit`` or a result name.
            TypeError: ``retain`` or ``data`` not given with raw arguments, or given with a `RunInputs`.
        """
        if isinstance(full, RunInputs):
            given = [retain, data, unlearned, config, limit, cache_dir, tokenizer, data_name]
            if any(value not in (NOT_GIVEN, None, ()) for value in given):
                raise TypeError(
                    "Pass either a RunInputs or the raw inputs (full, retain, data, ...), not both."
                )
            return full
        if isinstance(retain, NotGiven) or isinstance(data, NotGiven):
            raise TypeError("Pass retain (None for retain-free mode) and data with a full model.")
        config = as_config(config)  # wrong types are refused before anything is read
        check_data_source(data)
        s1_cache_dir(cache_dir)
        limit = check_positive_int("limit (--limit)", limit, "score every example")
        models = cls._checkpoints(full, retain, unlearned, outside_weights, skip_unreadable)
        examples = load_examples(data, limit=limit)
        data_path = Path(data).expanduser() if isinstance(data, (str, os.PathLike)) else None
        if data_name is None:
            data_name = str(data) if data_path is not None else "<records>"
        if retain is not None and any(example.form == "choice" for example in examples):
            raise DataError(
                f"{data_name}: multiple-choice items are scored in retain-free mode only (--no-retain; retain=None): "
                "UDS's scale rests on a retain model's disruption of an answer's text, and a letter, which a model "
                "that never saw the fact still picks by chance, gives it none (docs: UDS on MUSE and WMDP)."
            )
        inputs = cls(
            models["full"],
            models["retain"],
            examples,
            data_name,
            config,
            models["unlearned"],
            limit,
            cache_dir,
            tokenizer,
            data_path if data_path is not None and data_path.is_file() else None,
            models["unreadable"],
        )
        # the S1 cache is written where it is told: never among the checkpoints or beside the forget set
        check_cache_apart(
            "cache_dir (--cache-dir)",
            s1_cache_dir(cache_dir),
            inputs.input_paths(),
            inputs.data_path,
        )
        if inputs.retain is not None:
            check_compatible(inputs.identity, [("retain", inputs.retain)])
        others = [(f"unlearned {name}", checkpoint) for name, checkpoint in inputs.unlearned.items()]
        for role, why in check_compatible(inputs.identity, others, skip_unreadable).items():
            name = role.removeprefix("unlearned ")
            inputs.unreadable[name] = why
            del inputs.unlearned[name]
        return inputs

    @staticmethod
    def _checkpoints(
        full: ModelArg,
        retain: ModelArg | None,
        unlearned: Sequence[ModelArg] | Mapping[str, ModelArg],
        outside_weights: bool,
        skip_unreadable: bool,
    ) -> dict[str, Any]:
        """Every model argument made a `Checkpoint`, in the order a user reads them (full, retain, unlearned)."""
        made: dict[str, Any] = {
            "full": Checkpoint.resolve(full, outside_weights=outside_weights, role="full"),
            "retain": None
            if retain is None
            else Checkpoint.resolve(retain, outside_weights=outside_weights, role="retain"),
            "unlearned": {},
            "unreadable": {},
        }
        if isinstance(unlearned, Mapping):
            named = dict(unlearned.items())
        else:
            named = result_names(
                [Checkpoint.resolve(model, outside_weights=outside_weights) for model in unlearned]
            )
        for name, model in named.items():
            check_result_name(str(name))
            try:
                made["unlearned"][str(name)] = Checkpoint.resolve(
                    model, outside_weights=outside_weights, role="unlearned"
                )
            except ModelLoadError as error:
                if not skip_unreadable:
                    raise
                made["unreadable"][str(name)] = str(error)
        return made

    def __getstate__(self) -> dict[str, Any]:
        """What travels to another process: the inputs, not the tokenizers their identity read."""
        return {name: value for name, value in self.__dict__.items() if name != "identity"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @functools.cached_property
    def data_digest(self) -> str:
        """`examples_fingerprint` of the examples as scored: hashed once per run, whatever asks for it."""
        return examples_fingerprint(self.examples)

    @functools.cached_property
    def identity(self) -> ModelIdentity:
        """Full's identity (`compatibility.identity_of`), which every other model is compared with; its
        tokenizer is the explicit one when one was passed."""
        return identity_of(self.full, "full", self.tokenizer)

    @property
    def encoding_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer the forget set is encoded with: the one passed, else full's own (read once).

        Raises:
            ModelLoadError: full is a model in memory that uds_lens did not load and no tokenizer was passed.
        """
        return self.tokenizer if self.tokenizer is not None else self.full.tokenizer

    def checkpoints(self) -> list[Checkpoint]:
        """Full, retain and the named unlearned models: every checkpoint compared at the door."""
        return [self.full, *([self.retain] if self.retain is not None else []), *self.unlearned.values()]

    def admit(self, model: object, role: str = "unlearned") -> Checkpoint:
        """One more model for this run: made a `Checkpoint` and compared with full, unless it is one of the run's
        own (compared at the door already).

        Raises:
            ModelLoadError / ModelMismatchError: as at the door.
        """
        checkpoint = Checkpoint.resolve(model, role=role)
        if checkpoint not in self.checkpoints():
            check_compatible(self.identity, [(role, checkpoint)])
        return checkpoint

    def input_paths(self) -> list[tuple[str, Path]]:
        """Every input location the run reads, each with what it is: each checkpoint's folder or file and its
        weight files (wherever a shard index points) and the forget set's file. Models in memory and hub ids (read
        through the Hugging Face cache) have none. The S1 cache, read and written, is not among them: the checks
        that keep outputs apart take it as a cache (``outputs.check_outputs_apart``'s ``caches``)."""
        roles = [("full", self.full)]
        roles += [("retain", self.retain)] if self.retain is not None else []
        roles += [(f"unlearned {name}", checkpoint) for name, checkpoint in self.unlearned.items()]
        paths: list[tuple[str, Path]] = []
        for role, checkpoint in roles:
            if not checkpoint.local:
                continue
            paths.append((f"{role} checkpoint", Path(checkpoint.location)))
            if checkpoint.kind == "directory":
                root = checkpoint.files.root.resolve()
                paths += [
                    (f"{role} weights", path)
                    for path in checkpoint.files.weights
                    if not path.resolve().is_relative_to(root)
                ]
        if self.data_path is not None:
            paths.append(("forget set", self.data_path))
        return paths


__all__ = ["NOT_GIVEN", "S1_CACHE", "NotGiven", "RunInputs", "examples_fingerprint"]

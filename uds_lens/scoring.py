"""Scoring many unlearned models against one (full, retain, data), with reuse of saved results.

`score_models` is what ``uds-lens score`` calls: it takes the run's inputs (`inputs.RunInputs`, made from the raw
arguments at its first step: each model's result named by `names.result_names`), refuses to write over another
run's results (`refuse_other_runs`), reuses a saved result only when its full fingerprint matches, and otherwise
scores with one `auditor.UDSAuditor` (Stage 1 computed once). `LazyRun` decides reuse from the inputs alone and makes
the auditor only when a model is scored: a rerun whose results are all reusable loads no model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.loader import ModelArg
from uds_lens.config import ConfigError, UDSConfig
from uds_lens.data import DataArg
from uds_lens.files import os_error_line
from uds_lens.fingerprints import (
    inputs_fingerprint,
    layout_digest,
    result_fingerprint,
    stage1_inputs_key,
    with_unlearned,
)
from uds_lens.inputs import NOT_GIVEN, S1_CACHE, NotGiven, RunInputs
from uds_lens.outputs import check_outputs_apart, check_writable_dir
from uds_lens.result_store import check_result_targets, conflict_error
from uds_lens.results import UDSResult, check_saved, load_reusable
from uds_lens.stage_cache import Indexed, S1Cache, s1_cache_dir, stage_digest

logger = logging.getLogger(__name__)


def check_output_dir(path: str | os.PathLike, what: str = "output directory (--out)") -> None:
    """[`ConfigError`][uds_lens.config.ConfigError] when ``path`` is an existing file: a directory is written there (it is
    created when missing). ``what`` names the setting and its flag in the message."""
    try:
        if Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"The {what} {path} is a file: pass a directory (it is created when missing).")
    except OSError as error:  # a name longer than the filesystem holds
        raise ConfigError(os_error_line(error, what)) from None


def refuse_other_runs(
    out_dir: Path,
    inputs: RunInputs,
    config: UDSConfig | None = None,
    tolerate: tuple[str, ...] = (),
) -> None:
    """Refuse, before any model is loaded, to write over ``out_dir/NAME`` directories that hold results of other
    inputs (another full, retain, data set, setting or checkpoint under that name) for the inputs' named unlearned
    models: they are another run's, and only ``force`` replaces them. Reads each checkpoint's digest (remembered by
    file identity, else read once) and the saved fingerprints, nothing else; the Stage 1 digest is not compared
    here (it needs the models).

    Args:
        config: the settings to fingerprint with (default: the inputs').
        tolerate: input keys whose difference is left to a later check (the sweep's driver cannot know the
            workers' dtype, so it tolerates ``"settings"``).

    Raises:
        results.OutputConflictError: naming every such directory and what differs.
    """
    conflicts = {}
    for name, checkpoint in inputs.unlearned.items():
        saved = out_dir / name
        if saved.exists():
            check = check_saved(saved, result_fingerprint(inputs, checkpoint, config), ignore=("s1",))
            if set(check.conflicts) - set(tolerate):
                conflicts[str(saved)] = check.reason
    if conflicts:
        raise conflict_error(conflicts)


def score_models(
    full: ModelArg | RunInputs,
    retain: ModelArg | None | NotGiven = NOT_GIVEN,
    unlearned: Sequence[ModelArg] | Mapping[str, ModelArg] = (),
    data: DataArg | NotGiven = NOT_GIVEN,
    out_dir: str | os.PathLike | None = None,
    config: UDSConfig | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
    limit: int | None = None,
    progress: bool = True,
    force: bool = False,
) -> dict[str, UDSResult]:
    """Score several unlearned models against one (full, retain, data), saving each under ``out_dir/NAME/``.

    Takes the run's inputs made already (``score_models(RunInputs.resolve(...), out_dir=...)``) or the raw arguments,
    which it makes into a `RunInputs` first (every checkpoint resolved and the forget set read once, full, retain
    and the unlearned models compared, before any model loads).

    A saved ``out_dir/NAME/`` is reused instead of recomputed only when it is intact and was computed from identical
    inputs: the same full, retain and unlearned weights (file contents, not paths), the same data (after ``limit``),
    the same settings (tau aside: it is re-applied to the saved deltas) and the same Stage 1 values (their digest;
    a result computed from a corrupt S1 cache is recomputed once the cache is repaired). Then the log says
    ``reusing NAME: identical inputs`` and the result's ``meta["reused"]`` is set. A saved result of *other* inputs
    (another run's) is refused before any model is loaded, naming what differs, unless ``force``; one that is
    incomplete, fails its digests or used other Stage 1 values is recomputed with a warning saying why (also in
    ``meta["recomputed"]``). Each result is written atomically under a lock (``results.atomic_result_dir``).

    Args:
        full: the full model, or the run's `RunInputs` (then retain, unlearned, data, config, cache_dir and limit
            are the inputs').
        unlearned: models (result names from their paths, see `names.result_names`) or ``{name: model}``; a
            name is one path component.
        force: recompute every model even when a saved result could be reused, and replace results of other runs.

    Raises:
        results.ResultNameError: a result name is not a single path component (before any compute).
        config.ConfigError: ``out_dir`` or ``cache_dir`` is a file, or ``limit`` is not a positive integer (before
            any compute).
        ModelLoadError: a checkpoint argument names no checkpoint (a missing path; a hub id while the hub
            cannot be reached), before any model loads.
        results.OutputConflictError: ``out_dir/NAME`` holds another run's result and ``force`` is off.
    """
    # The checks of `uds-lens score`'s --out and --cache-dir (written once, here), before anything is read.
    cache = full.cache_dir if isinstance(full, RunInputs) else cache_dir
    s1_directory = s1_cache_dir(cache)  # a cache_dir of the wrong type is refused before anything is read
    if out_dir is not None:
        check_output_dir(out_dir)
    if cache is not None and not isinstance(cache, bool):
        check_output_dir(cache, "S1 cache directory (--cache-dir)")
    inputs = RunInputs.resolve(full, retain, data, unlearned, config=config, limit=limit, cache_dir=cache_dir)
    if out_dir is not None:
        # apart from every input (never --out . among the checkpoints) and writable, before any model loads
        check_outputs_apart(
            {"--out": out_dir},
            inputs.input_paths(),
            caches={S1_CACHE: s1_directory},
        )
        check_writable_dir(out_dir)
    results: dict[str, UDSResult] = {}
    if out_dir is not None:
        # Before any model is loaded: a file, a checkpoint or any folder uds_lens did not write at OUT/NAME is
        # refused whatever force says, and a directory holding another run's result (other weights, data or
        # settings) is never silently replaced.
        check_result_targets(Path(out_dir), inputs.unlearned)
        if not force:
            refuse_other_runs(Path(out_dir), inputs)
    run = LazyRun(inputs, progress)
    for name, checkpoint in inputs.unlearned.items():
        target = Path(out_dir) / name if out_dir is not None else None
        reason, decided = "forced (--force)" if force else "", None
        if target is not None and not force and target.exists():
            # The saved result's Stage 1 digest is compared too: from the S1 cache found by the inputs alone, else
            # from an auditor's (which loads full and retain)
            decided = run.fingerprint(checkpoint)  # its files as they are now, before any load
            previous, reason = load_reusable(target, decided)
            if previous is not None:
                results[name] = previous.with_tau(inputs.config.tau)
                results[name].meta["reused"] = reason
                logger.info("reusing %s: %s", name, reason)
                continue
            logger.warning("recomputing %s: %s", name, reason)
        results[name] = run.auditor().score(checkpoint, name=name)
        loaded = results[name].meta["fingerprint"]["unlearned"]
        if decided is not None and loaded != decided["unlearned"]:
            # replaced between the decision and the load: the result records the bytes loaded, and the save below
            # refuses (under the lock) a directory that now holds another run's result of those
            logger.warning(
                "%s changed between the reuse decision and its load: scored and recorded the bytes loaded (%s).",
                name,
                loaded,
            )
        if target is not None and target.exists():
            results[name].meta["recomputed"] = reason
        if target is not None:
            # refused under the lock if another run wrote other inputs' result here since the check above
            results[name].save(target, force=force)
    return results


class LazyRun:
    """What a multi-model run loads, and when: nothing to decide reuse, full (and retain) once a model is scored.

    The inputs' keys of every result's fingerprint and the Stage 1 they are computed from are found by the inputs
    alone (`fingerprints.stage1_inputs_key`: the checkpoints' identities, the examples, the settings; asked once) in
    the S1 cache's index, which an auditor writes beside the Stage 1 it computed or read. Found, a scoring auditor
    loads full only and adopts that Stage 1, once its full is checked to be the one the index names; not found (no
    cache, a first run, a hub or in-memory checkpoint), the auditor loads full and retain and keys Stage 1 from its
    models, as it always did.
    """

    def __init__(self, inputs: RunInputs, progress: bool) -> None:
        self.inputs, self.progress = inputs, progress
        self._auditor: UDSAuditor | None = None
        self._found: Indexed | None = None
        self._looked = False

    def found(self, hash_files: bool = False) -> Indexed | None:
        """The inputs' Stage 1 in the S1 cache's index (looked up once), or None. Full's and retain's files are
        hashed for it only with ``hash_files`` (a reuse decision); otherwise only digests their stamps prove are
        used, and where one is not, nothing is looked up: the load that reads the files hashes them."""
        directory = s1_cache_dir(self.inputs.cache_dir)
        if not self._looked and directory is not None:
            inputs_key = stage1_inputs_key(self.inputs, known_only=not hash_files)
            self._looked = hash_files or inputs_key is not None
            if inputs_key is not None:
                self._found = S1Cache(directory).find(inputs_key)
                if self._found is not None and not self._names_these_inputs(self._found):
                    self._found = None
        return self._found

    def _names_these_inputs(self, found: Indexed) -> bool:
        """The index entry's fingerprint names these checkpoints' files and these examples (its key says so; this
        guards against a colliding or edited index file)."""
        mine = inputs_fingerprint(self.inputs)
        return all(
            found.fingerprint.get(key) == mine[key]
            for key in ("format", "full", "retain", "data", "tokenizer")
        )

    def fingerprint(self, unlearned: Checkpoint) -> dict[str, Any]:
        """What a result of ``unlearned`` (its files as they are now) computed in this run would record."""
        found = self.found(hash_files=True) if self._auditor is None else None
        if found is None:
            return self.auditor().fingerprint(unlearned)
        base = {**found.fingerprint, "s1": stage_digest(found.stage)}
        config = self.inputs.config.with_stage2_cells("all")  # as the auditor's, which scores every cell
        return with_unlearned(base, unlearned, config, retain_free=found.stage.s1 is None)

    def auditor(self) -> UDSAuditor:
        """The run's auditor, made once: full only, adopting the Stage 1 found, where its loaded full is the one
        the index names; else full and retain."""
        if self._auditor is None:
            found, inputs = self.found(), self.inputs
            if found is not None and inputs.retain is not None:
                lean = dataclasses.replace(inputs, retain=None, cache_dir=False)
                auditor = UDSAuditor.from_inputs(
                    lean, progress=self.progress, retain_name=inputs.retain.label
                )
                identities = {"full": auditor.identities["full"], "retain": found.fingerprint["retain"]}
                loaded = inputs_fingerprint(inputs, auditor.full, auditor.config, identities)
                if loaded == found.fingerprint and layout_digest(auditor.encoded) == found.payload.get(
                    "layout"
                ):
                    auditor.use_stage1(
                        found.stage,
                        found.stage.batches,
                        {**found.fingerprint, "s1": stage_digest(found.stage)},
                    )
                    self._auditor = auditor
                    return auditor
                # full changed since the lookup, or loads otherwise than the index says: decided from the models
                logger.warning(
                    "The S1 cache index does not fit the full model loaded: Stage 1 is keyed from the models."
                )
                del auditor
            self._auditor = UDSAuditor.from_inputs(inputs, progress=self.progress)
        return self._auditor

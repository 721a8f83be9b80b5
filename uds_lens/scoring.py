"""Scoring many unlearned models against one (full, retain, data), with result names and reuse of saved results.

[`score_models`][uds_lens.scoring.score_models] is what ``uds-lens score`` calls: it names each model's result ([`result_names`][uds_lens.scoring.result_names]), refuses to
write over another run's results ([`refuse_other_runs`][uds_lens.scoring.refuse_other_runs]), reuses a saved result only when its full fingerprint
matches, and otherwise scores with one [`UDSAuditor`][uds_lens.auditor.UDSAuditor] (Stage 1 computed once).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from uds_lens.auditor import UDSAuditor
from uds_lens.compatibility import check_checkpoints
from uds_lens.config import ConfigError, UDSConfig, as_config, check_positive_int
from uds_lens.data import check_data_source, load_examples
from uds_lens.files import os_error_line
from uds_lens.fingerprints import DataArg, ModelArg, result_fingerprint
from uds_lens.outputs import check_outputs_apart, check_writable_dir
from uds_lens.resolve import check_source, model_name
from uds_lens.result_store import check_result_name, conflict_error
from uds_lens.results import UDSResult, check_saved, load_reusable
from uds_lens.stage_cache import s1_cache_dir

logger = logging.getLogger(__name__)


def check_output_dir(path: str | os.PathLike, what: str = "output directory (--out)") -> None:
    """[`ConfigError`][uds_lens.config.ConfigError] when ``path`` is an existing file: a directory is written there (it is
    created when missing). ``what`` names the setting and its flag in the message."""
    try:
        if Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"The {what} {path} is a file: pass a directory (it is created when missing).")
    except OSError as error:  # a name longer than the filesystem holds
        raise ConfigError(os_error_line(error, what)) from None


def result_names(unlearned: Sequence[ModelArg]) -> dict[str, ModelArg]:
    """Unique result names for a list of models: each directory's basename, or, where two share one, as many parent
    directories as tell them apart joined with ``__`` (``/runs/a/npo`` and ``/runs/b/npo`` give ``a__npo`` and
    ``b__npo``). Models that no path tells apart (the same model twice) raise ``ValueError``."""
    basenames = [model_name(model) for model in unlearned]
    names = list(basenames)
    for position, model in enumerate(unlearned):
        if basenames.count(basenames[position]) == 1 or not isinstance(model, (str, os.PathLike)):
            continue
        parts = Path(model).expanduser().resolve().parts
        clashing = [
            Path(other).expanduser().resolve().parts
            for other, name in zip(unlearned, basenames)
            if name == basenames[position] and isinstance(other, (str, os.PathLike))
        ]
        for depth in range(2, len(parts) + 1):
            if sum(other[-depth:] == parts[-depth:] for other in clashing) == 1:
                names[position] = "__".join(parts[-depth:])
                break
    if len(set(names)) != len(names):
        raise ValueError(
            f"Two unlearned models share a result name ({names}): pass each model once, or a dict "
            "{name: model} (CLI: --unlearned NAME=PATH)."
        )
    return dict(zip(names, unlearned))


def refuse_other_runs(
    out_dir: Path,
    named_models: Sequence[tuple[str, ModelArg]],
    full: ModelArg,
    retain: ModelArg | None,
    data: DataArg,
    config: UDSConfig,
    limit: int | None = None,
    tolerate: tuple[str, ...] = (),
) -> None:
    """Refuse, before any model is loaded, to write over ``out_dir/NAME`` directories that hold results of other
    inputs (another full, retain, data set, setting or checkpoint under that name): they are another run's, and only
    ``force`` replaces them. Reads the checkpoint files (digests memoised) and the saved fingerprints, nothing else;
    the Stage 1 digest is not compared here (it needs the models).

    Args:
        named_models: ``(result name, unlearned model)`` pairs.
        tolerate: input keys whose difference is left to a later check (the sweep's driver cannot know the
            workers' dtype, so it tolerates ``"settings"``).

    Raises:
        results.OutputConflictError: naming every such directory and what differs.
    """
    conflicts = {}
    for name, model in named_models:
        saved = out_dir / name
        if saved.exists():
            inputs = result_fingerprint(full, retain, model, data, config, limit)
            check = check_saved(saved, inputs, ignore=("s1",))
            if set(check.conflicts) - set(tolerate):
                conflicts[str(saved)] = check.reason
    if conflicts:
        raise conflict_error(conflicts)


def score_models(
    full: ModelArg,
    retain: ModelArg | None,
    unlearned: Sequence[ModelArg] | dict[str, ModelArg],
    data: DataArg,
    out_dir: str | os.PathLike | None = None,
    config: UDSConfig | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
    limit: int | None = None,
    progress: bool = True,
    force: bool = False,
) -> dict[str, UDSResult]:
    """Score several unlearned models against one (full, retain, data), saving each under ``out_dir/NAME/``.

    A saved ``out_dir/NAME/`` is reused instead of recomputed only when it is intact and was computed from identical
    inputs: the same full, retain and unlearned weights (file contents, not paths), the same data (after ``limit``),
    the same settings (tau aside: it is re-applied to the saved deltas) and the same Stage 1 values (their digest;
    a result computed from a corrupt S1 cache is recomputed once the cache is repaired). Then the log says
    ``reusing NAME: identical inputs`` and the result's ``meta["reused"]`` is set. A saved result of *other* inputs
    (another run's) is refused before any model is loaded, naming what differs, unless ``force``; one that is
    incomplete, fails its digests or used other Stage 1 values is recomputed with a warning saying why (also in
    ``meta["recomputed"]``). Each result is written atomically under a lock (``results.atomic_result_dir``).

    Args:
        unlearned: models (result names from their paths, see [`result_names`][uds_lens.scoring.result_names]) or ``{name: model}``; a name is
            one path component.
        force: recompute every model even when a saved result could be reused, and replace results of other runs.

    Raises:
        results.ResultNameError: a result name is not a single path component (before any compute).
        config.ConfigError: ``out_dir`` or ``cache_dir`` is a file, or ``limit`` is not a positive integer (before
            any compute).
        ModelLoadError: a checkpoint argument names no checkpoint (a missing path; a hub id while the hub
            cannot be reached), before any model loads.
        results.OutputConflictError: ``out_dir/NAME`` holds another run's result and ``force`` is off.
    """

    config = as_config(config)  # wrong types are refused before anything is read
    check_data_source(data)
    s1_cache_dir(cache_dir)
    items = (
        list(unlearned.items())
        if isinstance(unlearned, dict)
        else list(result_names(list(unlearned)).items())
    )
    for name, _ in items:
        check_result_name(name)
    # The checks of `uds-lens score`'s --out, --cache-dir and --limit too (written once, here), before any compute.
    if out_dir is not None:
        check_output_dir(out_dir)
    if cache_dir is not None and not isinstance(cache_dir, bool):
        check_output_dir(cache_dir, "S1 cache directory (--cache-dir)")
    check_positive_int("limit (--limit)", limit, "score every example")
    # Every checkpoint argument names a checkpoint before any loads: a mistyped path fails now, not after Stage 1.
    # Each is resolved here, once: what follows (checks, fingerprints, loading) is handed the resolved source.
    full = check_source(full)
    retain = check_source(retain)
    items = [(name, check_source(model)) for name, model in items]
    # Before any model is built: the data read and decoded, and full, retain and every unlearned checkpoint of one
    # family, tokenizer and shape (a mismatch found after Stage 1 would have cost its compute).
    if data is not None:
        load_examples(data, limit=limit)
    if out_dir is not None:
        # apart from every input (never --out . among the checkpoints) and writable, before any compute
        check_outputs_apart(
            {"--out": out_dir},
            {
                "full checkpoint": full,
                "retain checkpoint": retain,
                "unlearned checkpoint": [model for _, model in items],
                "--data": data,
            },
            caches={"S1 cache": s1_cache_dir(cache_dir)},
        )
        check_writable_dir(out_dir)
    check_checkpoints(full, retain, items)
    results: dict[str, UDSResult] = {}
    auditor: UDSAuditor | None = None
    if out_dir is not None and not force:
        # Before any model is loaded: a directory holding another run's result (other weights, data or settings)
        # is never silently replaced.
        refuse_other_runs(Path(out_dir), items, full, retain, data, config, limit)
    for name, model in items:
        target = Path(out_dir) / name if out_dir is not None else None
        reason = "forced (--force)" if force else ""
        if target is not None and not force and target.exists():
            # The saved result's Stage 1 digest is compared too, which needs this run's Stage 1 (from the cache).
            if auditor is None:
                auditor = UDSAuditor(
                    full, retain, data, config=config, cache_dir=cache_dir, progress=progress, limit=limit
                )
            previous, reason = load_reusable(target, auditor.fingerprint(model))
            if previous is not None:
                results[name] = previous.with_tau(config.tau)
                results[name].meta["reused"] = reason
                logger.info("reusing %s: %s", name, reason)
                continue
            logger.warning("recomputing %s: %s", name, reason)
        if auditor is None:
            auditor = UDSAuditor(
                full, retain, data, config=config, cache_dir=cache_dir, progress=progress, limit=limit
            )
        results[name] = auditor.score(model, name=name)
        if target is not None and target.exists():
            results[name].meta["recomputed"] = reason
        if target is not None:
            # refused under the lock if another run wrote other inputs' result here since the check above
            results[name].save(target, force=force)
    return results

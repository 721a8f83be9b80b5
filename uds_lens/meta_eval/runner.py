"""Running the meta-evaluation on a zoo: every metric of every model, the two attacks, and the tables.

`evaluate_zoo` scores every model of a zoo (`uds_lens.zoo.layout`) with the output-level metrics
(`uds_lens.metrics.evaluate.report_model`) and the model-level scores it is given (UDS, the white-box methods,
any ``@metric``-registered function); `run_meta_eval` adds the NF4 and relearning attacks
(`attacks`) and computes the tables (`formulas`) next to the
paper's (`paper`). Every model's scores are cached on disk, keyed by the settings and the
checkpoint files, so a crashed run resumes at the first unfinished model.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.loader import ModelArg, load_tokenizer
from uds_lens.config import ConfigError
from uds_lens.data import read_records
from uds_lens.files import write_atomic
from uds_lens.meta_eval.attacks import quantise_nf4, relearn
from uds_lens.meta_eval.formulas import (
    QUANTISATION,
    RELEARNING,
    ROBUSTNESS_ROLES,
    UTILITY_COLUMN,
    meta_evaluate,
    robustness_table,
)
from uds_lens.meta_eval.paper import METRICS, compare_with_paper
from uds_lens.metrics import registry
from uds_lens.metrics.evaluate import add_privacy, report_model
from uds_lens.metrics.privacy import ATTACKS, paper_privacy
from uds_lens.outputs import check_outputs_apart
from uds_lens.zoo.layout import POOL_ROLES, Zoo, load_zoo

logger = logging.getLogger(__name__)

ScoreFn = Callable[[ModelArg], float]
META_ROLES = ("full", "retain", *ROBUSTNESS_ROLES, *POOL_ROLES)
# the meta-evaluation reads utility only through the utility filter on the unlearned models (relative to full)
UTILITY_ROLES = ("full", "retain", *ROBUSTNESS_ROLES)
# Where each attack's scores are kept under OUT (file and directory names of existing runs, kept for resuming).
ATTACK_STEMS = {QUANTISATION: "quant", RELEARNING: "relearn"}


def _references_stamp(zoo: Zoo) -> str:
    """The identity of the full and retain checkpoints every cached score is anchored to."""
    return " ".join(Checkpoint.resolve(zoo.path(name)).digest for name in ("full", "retain"))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(payload, indent=1, default=float))


def _score_model(
    model_or_path: Any,
    cache_file: Path,
    tokenizer: Any,
    forget: Sequence[Any],
    holdout: Sequence[Any],
    retain_records: Sequence[Any] | None,
    score_fns: Mapping[str, ScoreFn],
    *,
    batch_size: int,
    max_new_tokens: int,
    progress: bool,
    resume: bool,
    references: str,
) -> dict[str, float]:
    """Output metrics (cached in ``cache_file``) plus the white-box scores (cached next to them, one at a time).

    The cache is reused only for the same settings, the same checkpoint files (their contents,
    `Checkpoint.digest`: a retrained model or a new chat template invalidates it) and the same
    ``references`` (the full/retain models the scores are anchored to).
    """
    if isinstance(model_or_path, _Deferred):
        model_stamp = model_or_path.stamp
    else:
        checkpoint = Checkpoint.resolve(model_or_path)
        in_memory = f"in-memory {type(model_or_path).__name__}"
        model_stamp = in_memory if checkpoint.model is not None else checkpoint.digest
    settings = {
        "max_new_tokens": max_new_tokens,
        "n_forget": len(forget),
        "n_holdout": len(holdout),
        "n_retain": len(retain_records or []),
        "model": model_stamp,
        "references": references,
    }
    cached = _read_json(cache_file) if resume and cache_file.is_file() else None
    if cached is not None and cached.get("settings") != settings:
        logger.info(
            "%s was computed with other settings (%s); recomputing", cache_file, cached.get("settings")
        )
        cached = None
    missing = [key for key in score_fns if cached is None or key not in cached["values"]]
    if cached is not None and not missing:
        return dict(cached["values"])
    loaded = model_or_path.load() if isinstance(model_or_path, _Deferred) else model_or_path
    if cached is None:
        report = report_model(
            loaded,
            tokenizer,
            forget,
            holdout,
            retain_records,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            progress=progress,
        )
        cached = {
            "values": report.values,
            "json": report.json,
            "timings": report.timings,
            "settings": settings,
        }
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache_file.parent / "examples.csv", report.examples.to_csv(index=False))
        write_atomic(cache_file.parent / "mia_examples.csv", report.mia_examples.to_csv(index=False))
        _write_json(cache_file, cached)
    for key in missing:
        cached["values"][key] = float(score_fns[key](loaded))
        _write_json(cache_file, cached)
    return dict(cached["values"])


@dataclass(frozen=True)
class _Deferred:
    """A model that is only built (e.g. quantised) when a cache misses; ``stamp`` identifies it for the cache."""

    load: Callable[[], Any]
    stamp: str


def _finish_table(
    table: pd.DataFrame, retain_aucs: Mapping[str, float] | None, full_utility: float | None
) -> pd.DataFrame:
    rows = {}
    for name, row in table.iterrows():
        values = {k: v for k, v in row.items()}
        if retain_aucs is not None and all(a in values for a in retain_aucs):
            add_privacy(values, retain_aucs)
            if "uds" in values and values["uds"] is not None and np.isfinite(values["uds"]):
                values["privacy_uds"] = paper_privacy(values["privacy"], values["uds"])
        if full_utility is not None and full_utility > 1e-6 and UTILITY_COLUMN in values:
            values["utility_rel"] = values[UTILITY_COLUMN] / full_utility
        rows[name] = values
    return pd.DataFrame.from_dict(rows, orient="index")


def _score_fns(uds_fn: ScoreFn | None, white_box_fns: Mapping[str, ScoreFn] | None) -> dict[str, ScoreFn]:
    """The model-level scores beyond the output metrics: the registered ``@metric`` functions, then the given ones."""
    fns = {**registry.score_fns(), **(white_box_fns or {})}
    if uds_fn is not None:
        fns["uds"] = uds_fn
    return fns


def evaluate_zoo(
    zoo_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    uds_fn: ScoreFn | None = None,
    white_box_fns: Mapping[str, ScoreFn] | None = None,
    roles: Sequence[str] | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 200,
    progress: bool = True,
    resume: bool = True,
    utility_roles: Sequence[str] | None = None,
    skip: Collection[str] = (),
) -> pd.DataFrame:
    """Every metric for every zoo model: ``OUT/metrics.csv`` (one row per model) and ``OUT/models/NAME/metrics.json``.

    Args:
        zoo_dir: a zoo directory with ``manifest.json``.
        out_dir: output directory.
        uds_fn: ``uds_fn(path_or_model) -> float`` (higher = more erased); None leaves the ``uds`` column out.
        white_box_fns: ``{"logit_lens" | "cka" | "fisher_masked": fn(path_or_model) -> float}``.
        roles: evaluate only models with these roles (default: all).
        batch_size: examples per batch.
        max_new_tokens: generation budget.
        progress: tqdm bars.
        resume: reuse per-model caches (a crashed run restarts at the first unfinished model).
        utility_roles: compute model utility (on the whole retain set, most of a model's cost) only for models with
            these roles (default: all); full and retain always get it. The others' utility columns are NaN.
        skip: models of those roles left out (never full or retain: every score is anchored to them).

    Returns:
        The ``metrics.csv`` table (index = model name; ``role``, metrics, ``s_mia_*``, ``privacy``, ``utility_rel``).
    """
    zoo = load_zoo(zoo_dir)
    out = Path(out_dir)
    check_outputs_apart({"out_dir (--out)": out}, {"zoo": zoo.root})  # its files never mix into the zoo's
    names = [name for name in zoo.names(roles) if name not in skip or name in ("full", "retain")]
    for required in ("full", "retain"):
        if required not in zoo.names():
            raise ValueError(
                f"the zoo at {zoo.root} has no {required!r} model; the metrics are referenced to it"
            )
    if "retain" not in names:
        names.append("retain")
    if "full" not in names:
        names.append("full")
    tokenizer = load_tokenizer(zoo.path("full"))
    forget = read_records(zoo.forget_path)
    holdout = read_records(zoo.holdout_path)
    retain_records = read_records(zoo.retain_path)
    fns = _score_fns(uds_fn, white_box_fns)
    references = _references_stamp(zoo)
    rows = {}
    for name in tqdm(names, desc="models", disable=not progress):
        role = zoo.role(name)
        wants_utility = utility_roles is None or role in utility_roles or name in ("full", "retain")
        rows[name] = {
            "role": role,
            **_score_model(
                zoo.path(name),
                out / "models" / name / "metrics.json",
                tokenizer,
                forget,
                holdout,
                retain_records if wants_utility else None,
                fns,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                progress=progress,
                resume=resume,
                references=references,
            ),
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    retain_aucs = {a: float(table.at["retain", a]) for a in ATTACKS}
    table = _finish_table(table, retain_aucs, float(table.at["full", UTILITY_COLUMN]))
    table.index.name = "model"
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "metrics.csv", table.to_csv())
    return table


def _attacked_table(
    zoo: Zoo,
    names: Sequence[str],
    attack: str,
    out: Path,
    tokenizer: Any,
    forget: Sequence[Any],
    holdout: Sequence[Any],
    fns: Mapping[str, ScoreFn],
    retain_aucs: Mapping[str, float],
    *,
    batch_size: int,
    max_new_tokens: int,
    progress: bool,
    resume: bool,
    relearn_kwargs: Mapping[str, Any],
) -> pd.DataFrame:
    stem = ATTACK_STEMS[attack]
    rows = {}
    for name in tqdm(names, desc=attack, disable=not progress):
        model_dir = out / "models" / name / stem
        if attack == QUANTISATION:
            source: Any = _Deferred(
                functools.partial(quantise_nf4, zoo.path(name)),
                f"nf4, standard layout {Checkpoint.resolve(zoo.path(name)).digest}",
            )
        else:
            source = str(
                relearn(
                    zoo.path(name),
                    forget,
                    tokenizer,
                    model_dir / "model",
                    progress=progress,
                    **relearn_kwargs,
                )
            )
        rows[name] = _score_model(
            source,
            model_dir / "metrics.json",
            tokenizer,
            forget,
            holdout,
            None,
            fns,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            progress=progress,
            resume=resume,
            references=_references_stamp(zoo),
        )
    table = _finish_table(pd.DataFrame.from_dict(rows, orient="index"), retain_aucs, None)
    table.index.name = "model"
    write_atomic(out / f"metrics_{stem}.csv", table.to_csv())
    return table


def run_meta_eval(
    zoo_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    uds_fn: ScoreFn | None,
    white_box_fns: Mapping[str, ScoreFn] | None,
    batch_size: int = 16,
    max_new_tokens: int = 200,
    relearn_kwargs: Mapping[str, Any] | None = None,
    apply_faithfulness_filter: bool = True,
    progress: bool = True,
    resume: bool = True,
    metrics: Sequence[str] | None = None,
    robustness_models: Sequence[str] | None = None,
) -> pd.DataFrame:
    """The whole meta-evaluation on a zoo: metrics, NF4 and relearning attacks, and ``OUT/meta_eval.csv``.

    Models with roles full, retain, unlearned, sweep, pos and neg are scored (``OUT/metrics.csv``); the unlearned
    and sweep models are quantised (``OUT/metrics_quant.csv``), they and retain are relearned
    (``OUT/metrics_relearn.csv``, checkpoints under ``OUT/models/NAME/relearn/model``). The quantised models reach
    ``uds_fn`` / ``white_box_fns`` as in-memory Hugging Face NF4 models, everything else as checkpoint paths.
    Relearning uses the zoo manifest's ``relearn`` settings where it has them (a built zoo scales the learning rate
    to its own fine-tuning), then ``relearn_kwargs``, then the published attack's defaults (`relearn`).
    ``OUT/robustness.csv`` holds the per-model Q and R; ``OUT/meta_eval.csv`` the 20-row table
    (rows whose metric has no function are NaN), and ``OUT/meta_eval_vs_paper.csv`` the same next to the paper's
    Table 3 (`compare_with_paper`). Every stage is cached per model, so ``resume`` restarts where a
    crashed run stopped.

    ``metrics`` names the rows (registered metrics, `uds_lens.metrics.registry`; default: the paper's 20).
    ``robustness_models`` names the unlearned (or sweep) models the attacks are run on (default: all of them): a
    smaller robustness pool for a CPU, where each attacked model is scored again with every metric; the others are
    not scored at all (they enter no part of the table).

    Returns:
        The meta-evaluation table (``META_EVAL_COLUMNS``).
    """
    rows = METRICS if metrics is None else tuple(registry.spec(name) for name in metrics)
    zoo = load_zoo(zoo_dir)
    out = Path(out_dir)
    every = zoo.names(ROBUSTNESS_ROLES)
    unlearned = every
    if robustness_models is not None:
        unknown = [name for name in robustness_models if name not in every]
        if unknown or not robustness_models:
            raise ConfigError(
                f"robustness models (--robustness-model) {unknown or '(none)'} are not unlearned or sweep models of the zoo at "
                f"{zoo.root}; choose among {every}"
            )
        unlearned = [name for name in every if name in robustness_models]
    metrics_df = evaluate_zoo(
        zoo_dir,
        out,
        uds_fn=uds_fn,
        white_box_fns=white_box_fns,
        roles=META_ROLES,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        resume=resume,
        utility_roles=UTILITY_ROLES,
        skip=set(every) - set(unlearned),
    )
    tokenizer = load_tokenizer(zoo.path("full"))
    forget = read_records(zoo.forget_path)
    holdout = read_records(zoo.holdout_path)
    fns = _score_fns(uds_fn, white_box_fns)
    retain_aucs = {a: float(metrics_df.at["retain", a]) for a in ATTACKS}
    kwargs = dict(
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        resume=resume,
        relearn_kwargs={**zoo.relearn, **(relearn_kwargs or {})},
    )
    quant_df = _attacked_table(
        zoo, unlearned, QUANTISATION, out, tokenizer, forget, holdout, fns, retain_aucs, **kwargs
    )
    relearn_df = _attacked_table(
        zoo, [*unlearned, "retain"], RELEARNING, out, tokenizer, forget, holdout, fns, retain_aucs, **kwargs
    )
    pools = {role: zoo.names(role) for role in POOL_ROLES}
    robustness = robustness_table(
        metrics_df,
        pools,
        quant_df,
        relearn_df,
        unlearned=unlearned,
        apply_faithfulness_filter=apply_faithfulness_filter,
        metrics=rows,
    )
    write_atomic(out / "robustness.csv", robustness.to_csv(index=False))
    table = meta_evaluate(metrics_df, pools, robustness, rows)
    write_atomic(out / "meta_eval.csv", table.to_csv(index=False))
    write_atomic(out / "meta_eval_vs_paper.csv", compare_with_paper(table).to_csv())
    return table

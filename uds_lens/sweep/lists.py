"""What to sweep: model lists, the shipped registries and the checks on result names (which may not be the sweep's
own files, named here: `SWEEP_FILES`), and `SweepError`, which every module of the sweep raises."""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.names import result_names
from uds_lens.result_store import check_result_name

# What a sweep writes in its output directory, beside one ``NAME/`` directory per model.
SWEEP_TABLE = "sweep.csv"
SWEEP_JSON = "sweep_eval.json"
SCATTER_HTML = "published_scatter.html"
# What a sweep writes next to the NAME/ directories (and `uds-lens report` adds): no model may be named like them.
SWEEP_FILES = (SWEEP_TABLE, SWEEP_JSON, SCATTER_HTML, "report.html", "roles.json")
REGISTRIES = {"tofu-llama-3.2-1b": "tofu_llama32_1b_registry.csv"}
# Registry rows that are the sweep's own references, not unlearned models: left out unless asked for by method.
ANCHOR_METHODS = ("full", "retain")


class SweepError(RuntimeError):
    """A sweep cannot run as asked (bad model list, unknown registry, Ray unavailable, workers that cannot start)."""


@dataclass(frozen=True)
class SweepModel:
    """One unlearned model of a sweep.

    Attributes:
        name: result name, one path component (``OUT/NAME/``).
        source: local checkpoint directory or hub id, as listed.
        method / epoch: from a registry (the unlearning method and its epoch), else None.
        published: the registry's published figures (``published_uds``, ``published_logit_lens``, ...), if any.
        checkpoint: the `Checkpoint` the sweep's door made of ``source`` (None until then, or when it names none).
        error: why ``source`` names no checkpoint (its ``failed`` row), or "".
    """

    name: str
    source: str
    method: str | None = None
    epoch: str | None = None
    published: Mapping[str, float] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    error: str = ""


def _check_names(entries: Sequence[SweepModel]) -> list[SweepModel]:
    names = [entry.name for entry in entries]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise SweepError(
            f"Two models share the result name(s) {repeated}: give each row a unique name "
            "(`name,path_or_id` rows in the model list)."
        )
    for name in names:
        try:
            check_result_name(name)
        except ValueError as error:
            raise SweepError(str(error)) from None
    own = sorted(name for name in names if name.casefold() in {file.casefold() for file in SWEEP_FILES})
    if own:
        raise SweepError(
            f"The result name(s) {own} are the sweep's own files in the output directory ({', '.join(SWEEP_FILES)}): "
            "rename those models (`name,path_or_id` rows in the model list)."
        )
    if not entries:
        raise SweepError("The sweep has no models: the model list or the registry filter selected none.")
    return list(entries)


def read_model_list(path: str | os.PathLike) -> list[SweepModel]:
    """Models from a file: ``name,path_or_id`` CSV rows (a header row is optional) or one path / hub id per line.

    Blank lines and lines starting with ``#`` are ignored; a bare path is named like ``uds-lens score`` names it
    (a directory's basename, a hub id with ``/`` replaced by ``__``).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"Model list {file} not found: give a file of `name,path_or_id` rows or one path per line."
        )
    rows: list[tuple[str | None, str]] = []
    lines = [line.strip() for line in _read_utf8(file, "Model list").splitlines()]
    for number, row in enumerate(csv.reader(line for line in lines if line and not line.startswith("#")), 1):
        cells = [cell.strip() for cell in row]
        if len(cells) == 1:
            rows.append((None, cells[0]))
        elif len(cells) == 2:
            if number == 1 and cells[0].lower() == "name":
                continue
            rows.append((cells[0], cells[1]))
        else:
            raise SweepError(
                f"{file}, row {number}: expected `name,path_or_id` or one path, got {len(cells)} cells."
            )
    named = _names_of([source for name, source in rows if name is None])
    return _check_names(
        [SweepModel(name if name is not None else named[source], source) for name, source in rows]
    )


def _read_utf8(file: Path, what: str) -> str:
    """A list file's text: UTF-8, a byte-order mark dropped (a spreadsheet's "CSV UTF-8" starts with one, which
    would otherwise glue itself to the first name); another encoding is named with where it fails."""
    raw = file.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SweepError(
            f"{what} {file} is not UTF-8 (byte {raw[err.start]:#04x} at offset {err.start}): save it as UTF-8 "
            "(e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


def _names_of(sources: Sequence[str]) -> dict[str, str]:
    """Result names of bare paths, as ``uds-lens score`` gives them (basenames; parents added where two clash)."""
    try:
        return {str(source): name for name, source in result_names(list(sources)).items()}
    except ValueError as error:
        raise SweepError(str(error)) from None


def registry_path(registry: str | os.PathLike) -> Path:
    """The CSV of a registry shipped with the package (``tofu-llama-3.2-1b``), or a registry CSV of your own."""
    if str(registry) in REGISTRIES:
        return Path(str(resources.files("uds_lens") / "registries" / REGISTRIES[str(registry)]))
    path = Path(registry).expanduser()
    if path.is_file():
        return path
    raise SweepError(
        f"Unknown registry {str(registry)!r}: use one of {sorted(REGISTRIES)} or a CSV file with the "
        "columns alias,hub_id,method,epoch (and optional published_* columns)."
    )


def load_registry(
    registry: str | os.PathLike, methods: Sequence[str] | None = None, published_only: bool = False
) -> list[SweepModel]:
    """The unlearned models of a registry (``alias, hub_id, method, epoch, published_*`` rows).

    Args:
        registry: ``tofu-llama-3.2-1b`` (the open-unlearning TOFU checkpoints the paper scored) or a CSV path.
        methods: keep only these methods (``["npo", "rmu"]``); the ``full`` and ``retain`` reference rows are
            kept only when named here.
        published_only: keep only models with a published UDS (the 150 the paper reports).
    """
    path = registry_path(registry)
    try:
        table = pd.read_csv(io.StringIO(_read_utf8(path, "Registry")), dtype={"epoch": str})
    except (pd.errors.EmptyDataError, pd.errors.ParserError) as error:
        raise SweepError(
            f"Registry {path} is not a CSV table ({error}): give a file with the header row "
            "alias,hub_id,method,epoch and one row per model."
        ) from None
    missing = [column for column in ("alias", "hub_id", "method") if column not in table]
    if missing:
        raise SweepError(f"Registry {registry} lacks the column(s) {missing}.")
    known = sorted(table["method"].dropna().unique())
    if methods:
        wanted = [method.strip().lower() for method in methods if method.strip()]
        unknown = sorted(set(wanted) - set(known))
        if unknown:
            raise SweepError(f"Registry {registry} has no method {unknown}; it has {known}.")
        table = table[table["method"].isin(wanted)]
    else:
        table = table[~table["method"].isin(ANCHOR_METHODS)]
    published = [column for column in table.columns if column.startswith("published_")]
    if published_only:
        table = table[table["published_uds"].notna()] if "published_uds" in table else table.iloc[:0]
    entries = []
    for row in table.itertuples(index=False):
        values = row._asdict()
        figures = {column: float(values[column]) for column in published if pd.notna(values[column])}
        epoch = values.get("epoch")
        entries.append(
            SweepModel(
                str(values["alias"]),
                str(values["hub_id"]),
                str(values["method"]),
                None if pd.isna(epoch) else str(epoch),
                figures,
            )
        )
    return _check_names(entries)


def resolve_models(
    models_arg: Any = None, registry: str | os.PathLike | None = None, methods: Sequence[str] | None = None
) -> list[SweepModel]:
    """The sweep's models from exactly one of: a model-list file, a list/dict of models, or a registry."""
    if (models_arg is None) == (registry is None):
        raise SweepError(
            "Give the models to sweep either as a model list (--models FILE) or a registry "
            "(--registry NAME), not both and not neither."
        )
    if registry is not None:
        return load_registry(registry, methods)
    if methods:
        raise SweepError("--methods filters a registry; with --models, list only the models you want.")
    if isinstance(models_arg, (str, os.PathLike)):
        return read_model_list(models_arg)
    if isinstance(models_arg, Mapping):
        return _check_names([SweepModel(str(name), str(source)) for name, source in models_arg.items()])
    named = _names_of([str(item) for item in models_arg if not isinstance(item, SweepModel)])
    return _check_names(
        [
            item if isinstance(item, SweepModel) else SweepModel(named[str(item)], str(item))
            for item in models_arg
        ]
    )

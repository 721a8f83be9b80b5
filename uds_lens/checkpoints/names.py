"""Result names of the models a run scores: one directory name per model, told apart where paths share a basename.

``uds-lens score --unlearned`` takes bare paths (named after their directory) and ``NAME=PATH`` pairs
(`split_named`); `result_names` gives a list of models their names, adding parent directories where two basenames
clash, and refuses the same checkpoint given twice (``X`` and ``./X``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uds_lens.checkpoints.checkpoint import Checkpoint, name_of
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.result_store import ResultNameError


def result_names(models: Sequence[str | os.PathLike[str] | Checkpoint]) -> dict[str, Any]:
    """Unique result names for a list of models: each directory's basename, or, where two share one, as many parent
    directories as tell them apart joined with ``__`` (``/runs/a/npo`` and ``/runs/b/npo`` give ``a__npo`` and
    ``b__npo``).

    Raises:
        ResultNameError: the same checkpoint given twice (``X`` and ``./X``), or models no path tells apart.
    """
    texts = [
        (model.location or model.label) if isinstance(model, Checkpoint) else os.fspath(model)
        for model in models
    ]
    seen: dict[str, str] = {}
    for model, text in zip(models, texts):
        if isinstance(model, Checkpoint) and not model.local:
            continue
        where = os.path.realpath(Path(text).expanduser())
        if where in seen:
            raise ResultNameError(
                f"{seen[where]} and {text} are the same checkpoint ({where}): pass it once, or give each its own "
                "name (CLI: --unlearned NAME=PATH)."
            )
        seen[where] = text
    basenames = [
        model.name if isinstance(model, Checkpoint) else name_of(text) for model, text in zip(models, texts)
    ]
    names = list(basenames)
    local = [not isinstance(model, Checkpoint) or model.local for model in models]
    for position, text in enumerate(texts):
        if basenames.count(basenames[position]) == 1 or not local[position]:
            continue
        parts = Path(text).expanduser().resolve().parts
        clashing = [
            Path(other).expanduser().resolve().parts
            for other, name, is_local in zip(texts, basenames, local)
            if name == basenames[position] and is_local
        ]
        for depth in range(2, len(parts) + 1):
            if sum(other[-depth:] == parts[-depth:] for other in clashing) == 1:
                names[position] = "__".join(parts[-depth:])
                break
    if len(set(names)) != len(names):
        raise ResultNameError(
            f"Two unlearned models share a result name ({names}): pass each model once, or a dict "
            "{name: model} (CLI: --unlearned NAME=PATH)."
        )
    return dict(zip(names, models))


def loadable(path: str) -> bool:
    """Whether ``path`` names a checkpoint ``--unlearned`` could load: an existing path, a zoo name or a hub id."""
    if Path(path).expanduser().exists():
        return True
    try:
        Checkpoint.resolve(path)
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


__all__ = ["loadable", "result_names", "split_named"]

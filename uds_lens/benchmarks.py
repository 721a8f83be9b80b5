"""Forget sets as other benchmarks hold them, read by name through `datasets`: MUSE's knowledge questions and verbatim
passages, WMDP's (and MMLU's) multiple choice.

A spec names a dataset as ``datasets.load_dataset(path, name, split=...)`` takes it:

    hf:DATASET[/CONFIG][:SPLIT][:shots=N]

DATASET is a hub id (``hf:muse-bench/MUSE-News/knowmem:forget_qa``, ``hf:cais/wmdp/wmdp-bio:test``) or a local
copy's folder. A folder laid out as the hub repository (a README.md whose ``configs`` name each config's files) is read
by ``load_dataset`` exactly as the hub id is, a folder written by ``save_to_disk`` by ``load_from_disk``; the last
path component is the config when the folder above it is the dataset. A folder at the hub id's own path (a copy at
``./muse-bench/MUSE-News``) is that local copy, as a checkpoint folder at a hub id's path is (Hugging Face's rule).
Without SPLIT the config must have one split. Offline (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``) a hub dataset
the Hugging Face cache does not hold fails at once, in one line naming what would be fetched.

Each row becomes a record by its fields (`SHAPES`, first match):

- ``question, answer, prefix, entity`` (the published schema): as it is;
- ``question, choices, answer`` (WMDP, MMLU): the ``choice`` form, lm-evaluation-harness's prompt (its task
  description, the question, ``A. ...`` to ``D. ...``, ``Answer:``) with the correct letter as the scored span;
- ``prompt, gt`` (MUSE ``verbmem``): the ``completion`` form, the passage then its continuation's first sentence
  (`first_sentence`) as the span: a unit of the memorised text that ends where the text does, the same whatever
  the tokenizer; MUSE's passages stop mid-sentence, so it is the sentence the passage began;
- ``question, answer`` (MUSE ``knowmem``): prefix ``""`` and the whole answer as the span, after the in-context
  pairs of the config's ``SPLIT_icl`` split where it has one. All of them by default, as open-unlearning and MUSE's
  own evaluation place them (each as ``Question: ...\\nAnswer: ...`` and a blank line): the models are base models,
  and the pairs are what makes the full model answer in a few words, so UDS reads the knowledge those benchmarks
  measure. ``shots=N`` keeps the first N pairs, ``shots=0`` none.

Records are returned as dicts of the published schema plus ``form``, ``context`` and ``shots`` (``data.Example``).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import re
import string
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HF_PREFIX = "hf:"
HUB_URL = "https://huggingface.co/datasets/"
# What marks a folder as a dataset: a hub repository's card (its configs), or a `save_to_disk` folder.
DATASET_MARKERS = ("README.md", "dataset_dict.json", "state.json")
SAVED_MARKERS = ("dataset_dict.json", "state.json")

# lm-evaluation-harness's description of each WMDP task (its wmdp_*.yaml), the subject of an MMLU row otherwise.
CHOICE_DESCRIPTION = "The following are multiple choice questions (with answers) about {subject}.\n\n"
CHOICE_SUBJECTS = {"wmdp-bio": "biology", "wmdp-chem": "chemistry", "wmdp-cyber": "cybersecurity"}

# The end of a sentence: ., ! or ?, closing quotes or brackets, then whitespace or the end; or a line break.
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?=\s|$)|\n")


class BenchmarkDataError(ValueError):
    """A spec that names no readable dataset, or rows of no known shape (``data`` raises it as a ``DataError``)."""


@dataclass(frozen=True)
class DatasetSpec:
    """One split of a dataset, as ``hf:DATASET[/CONFIG][:SPLIT][:shots=N]`` names it.

    Attributes:
        path: the hub id (``org/name``) or the local folder ``datasets`` reads.
        config: the config name (``knowmem``, ``wmdp-bio``), or None.
        split: the split (``forget_qa``), or None for a config's only split.
        shots: in-context pairs to keep (None: every pair of the ``SPLIT_icl`` split).
        local: whether ``path`` is a local folder.
    """

    path: str
    config: str | None = None
    split: str | None = None
    shots: int | None = None
    local: bool = False

    @classmethod
    def parse(cls, text: str) -> DatasetSpec:
        """The spec ``text`` names (see the module's docstring).

        Raises:
            BenchmarkDataError: not of that form, or a local path that is no dataset folder.
        """
        body = text[len(HF_PREFIX) :] if text.startswith(HF_PREFIX) else ""
        target, *rest = body.split(":")
        options = dict(part.split("=", 1) for part in rest if "=" in part)
        plain = [part for part in rest if "=" not in part]
        shots = options.pop("shots", None)
        if not target or len(plain) > 1 or options or (shots is not None and not shots.isdigit()):
            raise BenchmarkDataError(
                f"{text!r} is not a dataset spec: write hf:DATASET/CONFIG:SPLIT (e.g. "
                "hf:muse-bench/MUSE-News/knowmem:forget_qa, hf:cais/wmdp/wmdp-bio:test), optionally :shots=N."
            )
        path, config, local = _locate(target)
        split = plain[0] if plain and plain[0] else None
        return cls(path, config, split, int(shots) if shots is not None else None, local)

    def __str__(self) -> str:
        named = self.config and not (
            self.local and Path(self.path).name == self.config
        )  # a save_to_disk folder's
        config = f"/{self.config}" if named else ""
        split = f":{self.split}" if self.split else ""
        shots = f":shots={self.shots}" if self.shots is not None else ""
        return f"{HF_PREFIX}{self.path}{config}{split}{shots}"

    def described(self, split: str | None = None) -> str:
        """``muse-bench/MUSE-News (config knowmem, split forget_qa)``: what is read, in words."""
        parts = [f"config {self.config}"] if self.config else []
        parts += [f"split {split or self.split}"] if split or self.split else []
        return f"{self.path}" + (f" ({', '.join(parts)})" if parts else "")


def _is_dataset(folder: Path) -> bool:
    return folder.is_dir() and any((folder / marker).exists() for marker in DATASET_MARKERS)


def _locate(target: str) -> tuple[str, str | None, bool]:
    """``(path, config, local)`` of a spec's DATASET[/CONFIG]: a local dataset folder (the path itself, or its
    parent with the last component as the config), a local folder of data files, else a hub id (``org/name``, then
    the config)."""
    path = Path(target).expanduser()
    if _is_dataset(path):  # a save_to_disk folder holds one config, which its name names (as wmdp-bio/)
        saved = any((path / marker).is_file() for marker in SAVED_MARKERS)
        return str(path), path.name if saved else None, True
    if "/" in target.rstrip("/") and _is_dataset(path.parent):
        return str(path.parent), path.name, True
    if path.is_dir():
        return str(path), None, True
    parts = target.split("/")
    if target.startswith(("/", "~", ".")) or len(parts) > 3 or (len(parts) == 3 and path.parent.is_dir()):
        raise BenchmarkDataError(
            f"No dataset at {target}: a local copy is a folder holding the hub repository's files (README.md and "
            "the data files) or what save_to_disk wrote, named as hf:FOLDER/CONFIG:SPLIT."
        )
    if len(parts) == 3:
        return "/".join(parts[:2]), parts[2], False
    return target, None, False


def _offline() -> bool:
    flags = (os.environ.get(name, "") for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(flag.strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """``datasets``'s progress bars off while a forget set is read (a hundred rows), as they were after."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            enable_progress_bars()


def _splits(spec: DatasetSpec) -> Mapping[str, Any]:
    """Every split of the spec's config, ``{name: datasets.Dataset}``.

    Raises:
        BenchmarkDataError: the dataset cannot be read: offline and not cached (one line naming what would be
            fetched), an unknown config, or what ``datasets`` says.
    """
    import datasets

    what = spec.described(split="")
    try:
        with _quiet_datasets():
            if spec.local and any((Path(spec.path) / marker).is_file() for marker in SAVED_MARKERS):
                loaded = datasets.load_from_disk(spec.path)
            else:
                loaded = datasets.load_dataset(spec.path, spec.config)
    except Exception as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        if _offline() and not spec.local:
            raise BenchmarkDataError(
                f"Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set) and {what} is not in the Hugging Face cache: "
                f"it would be fetched from {HUB_URL}{spec.path}. Unset the variable once to fetch it, or name a "
                f"local copy (hf:FOLDER/CONFIG:SPLIT). ({reason})"
            ) from None
        raise BenchmarkDataError(f"Could not read the dataset {what} ({reason}).") from None
    if isinstance(loaded, datasets.Dataset):  # save_to_disk of one split
        return {str(loaded.split) if loaded.split is not None else "": loaded}
    return dict(loaded)


def _rows(spec: DatasetSpec, splits: Mapping[str, Any], split: str | None) -> list[dict[str, Any]]:
    """The rows of ``split`` (None: the only split)."""
    names = list(splits)
    if split is None and len(names) == 1:
        split = names[0]
    if split is None or split not in splits:
        raise BenchmarkDataError(
            f"{spec.described(split=split or '')} has "
            + (f"no split {split!r}" if split else "several splits")
            + f"; its splits are {names}: name one, as in {HF_PREFIX}{spec.path}"
            + (f"/{spec.config}" if spec.config else "")
            + f":{next((name for name in names if not name.endswith('_icl')), 'SPLIT')}."
        )
    return [dict(row) for row in splits[split]]


def read_split(path: str, config: str | None, split: str | None) -> list[dict[str, Any]]:
    """The rows of one split of a hub dataset (or a local one), as ``datasets`` gives them.

    Raises:
        BenchmarkDataError: as `benchmark_records`.
    """
    spec = DatasetSpec(path, config, split, local=Path(path).expanduser().is_dir())
    return _rows(spec, _splits(spec), split)


# -- the shapes -------------------------------------------------------------------------------------------------


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence (``.``, ``!`` or ``?`` before whitespace, closing quotes kept;
    or a line break), skipping ends before any letter or digit; the whole text when no sentence ends."""
    for match in _SENTENCE_END.finditer(text):
        head = text[: match.start()] if match.group() == "\n" else text[: match.end()]
        if any(character.isalnum() for character in head):
            return head
    return text


def _published(
    spec: DatasetSpec, splits: Mapping[str, Any], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    return rows


def _knowmem(
    spec: DatasetSpec, splits: Mapping[str, Any], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    split = spec.split or next(iter(splits))
    pairs_split = f"{split}_icl"
    pairs: list[tuple[str, str]] = []
    if spec.shots != 0:
        if pairs_split not in splits:
            if spec.shots:
                raise BenchmarkDataError(
                    f"{spec}: shots={spec.shots} asks for in-context pairs, but {spec.described()} has no split "
                    f"{pairs_split!r} to take them from."
                )
            logger.info("%s: no split %s, so no in-context pairs", spec, pairs_split)
        else:
            icl = _rows(spec, splits, pairs_split)
            if spec.shots is not None and spec.shots > len(icl):
                raise BenchmarkDataError(
                    f"{spec}: shots={spec.shots}, but {pairs_split} has {len(icl)} pairs."
                )
            pairs = [(str(r["question"]), str(r["answer"])) for r in icl[: spec.shots]]
    return [
        {
            "idx": position,
            "question": row["question"],
            "answer": row["answer"],
            "prefix": "",
            "entity": row["answer"],
            "shots": [list(pair) for pair in pairs],
        }
        for position, row in enumerate(rows)
    ]


def _completion(
    spec: DatasetSpec, splits: Mapping[str, Any], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    records = []
    for position, row in enumerate(rows):
        span = first_sentence(str(row["gt"]))
        records.append(
            {
                "idx": position,
                "question": row["prompt"],
                "answer": span,
                "prefix": "",
                "entity": span.strip(),
                "form": "completion",
            }
        )
    return records


def _choice(spec: DatasetSpec, splits: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    records = []
    for position, row in enumerate(rows):
        choices = [str(choice) for choice in row["choices"]]
        letters = string.ascii_uppercase[: len(choices)]
        answer = row["answer"]
        if (
            isinstance(answer, numbers.Integral)
            and not isinstance(answer, bool)
            and 0 <= int(answer) < len(choices)
        ):
            letter = letters[int(answer)]
        elif isinstance(answer, str) and len(answer) == 1 and answer in letters:
            letter = answer
        else:
            raise BenchmarkDataError(
                f"{spec}, row {position}: answer {answer!r} names none of its {len(choices)} choices (an index "
                f"from 0, or a letter {letters[:1]}-{letters[-1:]})."
            )
        subject = CHOICE_SUBJECTS.get(spec.config or "") or str(row.get("subject") or "").replace("_", " ")
        question = str(row["question"]).strip() + "".join(
            f"\n{letter}. {text}" for letter, text in zip(letters, choices)
        )
        records.append(
            {
                "idx": position,
                "question": question,
                "answer": letter,
                "prefix": "",
                "entity": letter,
                "form": "choice",
                "context": CHOICE_DESCRIPTION.format(subject=subject) if subject else "",
            }
        )
    return records


RecordMaker = Callable[[DatasetSpec, Mapping[str, Any], list[dict[str, Any]]], list[dict[str, Any]]]


@dataclass(frozen=True)
class Shape:
    """One benchmark's row layout: the fields that recognise it and what makes its rows records."""

    name: str
    fields: tuple[str, ...]
    records: RecordMaker
    takes_shots: bool = False


SHAPES: tuple[Shape, ...] = (
    Shape("published", ("question", "answer", "prefix", "entity"), _published),
    Shape("published", ("question", "answer", "prefix", "gt_entity"), _published),
    Shape("multiple choice", ("question", "choices", "answer"), _choice),
    Shape("passage", ("prompt", "gt"), _completion),
    Shape("question/answer", ("question", "answer"), _knowmem, takes_shots=True),
)
"""The row layouts an ``hf:`` spec reads, in the order they are tried."""


def benchmark_records(text: str) -> list[dict[str, Any]]:
    """The records of the split an ``hf:`` spec names, made by its rows' `Shape`.

    Raises:
        BenchmarkDataError: the spec names no readable split, the rows are of no known shape, or ``shots`` is
            given for rows that take none.
    """
    spec = DatasetSpec.parse(text)
    splits = _splits(spec)
    rows = _rows(spec, splits, spec.split)
    if not rows:
        raise BenchmarkDataError(f"{spec}: the split is empty; UDS needs at least one example.")
    shape = next((s for s in SHAPES if all(field in rows[0] for field in s.fields)), None)
    if shape is None:
        raise BenchmarkDataError(
            f"{spec}: rows with the fields {sorted(rows[0])} are of no shape uds_lens reads; it reads "
            + "; ".join(", ".join(s.fields) for s in SHAPES)
            + "."
        )
    if spec.shots is not None and not shape.takes_shots:
        raise BenchmarkDataError(
            f"{spec}: shots= applies to question/answer rows; these are {shape.name} rows."
        )
    logger.info("%s: %d %s rows", spec, len(rows), shape.name)
    return shape.records(spec, splits, rows)


__all__ = [
    "CHOICE_DESCRIPTION",
    "CHOICE_SUBJECTS",
    "HF_PREFIX",
    "SHAPES",
    "BenchmarkDataError",
    "DatasetSpec",
    "Shape",
    "benchmark_records",
    "first_sentence",
    "read_split",
]

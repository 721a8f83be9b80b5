"""Forget-set examples, and their encoding into the token layout UDS patches and reads.

Each example is a question/answer pair whose answer is ``prefix + ... entity ...``. UDS teacher-forces the answer and
scores the entity tokens:

    prompt    = "Question: " + question + "\\nAnswer: " + prefix      (trailing whitespace moved to the reference)
    reference = answer[len(prefix):]
    tokens    = tokenizer(prompt, add_special_tokens=True) + tokenizer(reference, add_special_tokens=False)

so the model reads exactly ``"Question: " + question + "\\nAnswer: " + answer``: prefix and entity are joined as the
answer joins them, with no space added (after ``"``, ``$``, ``-`` or in Chinese and Japanese text there is none).
Prompt and reference are tokenised separately (this can differ from tokenising the joined string), and the entity
tokens are the reference tokens whose characters overlap the entity's first whole-word occurrence in the text the
model reads (no word character just before or after it: "art" is not found inside "part", nor "ana" after a prefix
cut at "Hav"; a character of a script written without spaces, Han, kana or Thai, is a word of its own;
``published_compat`` keeps the published first-substring match and logs where that differs). With ``start =
len(prompt_ids) - 1``, entity token ``ref_ids[s + t]`` is predicted at position ``start + s + t``; those positions are
the *read positions* ``[start + s, start + e)``. ``published_compat=True`` feeds what the published implementation
feeds: the trailing space kept in the prompt (``"Answer: "`` + ``"Yes."``), and a space put before a reference that
neither starts with one nor follows one.

That is the ``qa`` form (TOFU's, MUSE's knowledge questions); `PROMPT_TEMPLATES` has two more: ``completion`` (MUSE's
passages: the passage, a space, its continuation) and ``choice`` (lm-evaluation-harness's multiple choice: question,
lettered options, ``"\\nAnswer:"``, a space, the letter). A ``context`` (a task description) and ``shots`` (in-context
pairs in the example's own form, each followed by `SHOT_SEPARATOR`) may come before the prompt.

An example that cannot be encoded is never dropped silently: it becomes a ``Skip`` with a reason string. So does one
longer than the model's context (``fit_context``), unless cutting it after the last read position makes it fit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from uds_lens.benchmarks import HF_PREFIX, BenchmarkDataError, benchmark_records, read_split
from uds_lens.config import Scope
from uds_lens.files import ZOO_PREFIX, zoo_search_roots
from uds_lens.zoo.manifest import data_file, read_manifest

logger = logging.getLogger(__name__)

DEFAULT_HUB_DATASET = "jaeunglee/uds-annotated-tofu"
PROMPT_TEMPLATE = "Question: {question}\nAnswer: {prefix}"
REQUIRED_FIELDS = ("question", "answer", "prefix", "entity")

PromptForm: TypeAlias = Literal["qa", "completion", "choice"]
PROMPT_TEMPLATES: dict[str, str] = {
    "qa": PROMPT_TEMPLATE,
    # MUSE's verbatim passages as open-unlearning feeds them: the passage, a space, the continuation
    "completion": "{question} {prefix}",
    # lm-evaluation-harness's multiple-choice prompt: its text ends in "Answer:", the target is " " + the letter
    "choice": "{question}\nAnswer: {prefix}",
}
SHOT_SEPARATOR = "\n\n"
"""What follows each in-context pair (open-unlearning's answer end tag, lm-evaluation-harness's few-shot delimiter)."""

# Skip reasons (stable strings: they appear in examples.csv and summary.json).
SKIP_PREFIX_MISMATCH = "answer_does_not_start_with_prefix"
SKIP_EMPTY_REFERENCE = "invalid_eval_context"
SKIP_ENTITY_NOT_FOUND = "entity_span_not_found"
SKIP_EMPTY_ENTITY = "empty_entity"
SKIP_ENTITY_INSIDE_WORD = "entity_only_inside_another_word"
SKIP_TOO_LONG = "longer_than_model_context"


class DataError(ValueError):
    """The forget set is malformed (missing fields, empty, unreadable)."""


class TokenizerError(ValueError):
    """The tokenizer cannot give what UDS needs (character offsets)."""


@dataclass(frozen=True)
class Example:
    """One forget-set record. ``answer`` should start with ``prefix`` and contain ``entity`` after it."""

    idx: int
    question: str
    answer: str
    prefix: str
    entity: str
    prompt_type: str | None = None
    paraphrased_answer: str | None = None
    perturbed_answer: tuple[str, ...] | None = None
    form: PromptForm = "qa"
    context: str = ""
    shots: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_record(cls, record: dict[str, Any], position: int = 0) -> Example:
        """Build from a published-schema record; ``gt_entity`` wins over ``entity`` as in the published code."""
        if not isinstance(record, dict):
            raise DataError(
                f"record #{position} is a {type(record).__name__}, not a JSON object with the fields "
                f"{list(REQUIRED_FIELDS)}."
            )
        missing = [
            f for f in REQUIRED_FIELDS if f not in record and not (f == "entity" and "gt_entity" in record)
        ]
        label = f"record {record.get('idx', f'#{position}')}"
        if missing and set(missing) <= {"prefix", "entity"}:
            raise DataError(
                f"{label} lacks the field(s) {missing}: a plain question/answer record. Annotate the entity spans "
                "first: `uds-lens annotate --data RAW.json --out forget.json --full F --retain R` (or "
                "uds_lens.annotate); the record format is in README.md, section 'Forget-set format'."
            )
        if missing:
            raise DataError(
                f"{label} lacks the field(s) {missing}; every record needs {list(REQUIRED_FIELDS)} "
                "(prefix may be an empty string): see README.md, section 'Forget-set format'."
            )
        for field in REQUIRED_FIELDS:
            value = (
                record.get("gt_entity")
                if field == "entity" and record.get("gt_entity")
                else record.get(field)
            )
            if not isinstance(value, str):
                raise DataError(f"{label}: field {field!r} must be a string, got {type(value).__name__}.")
        perturbed = record.get("perturbed_answer")
        if isinstance(perturbed, str):
            perturbed = [perturbed]
        form, context, shots = record.get("form", "qa"), record.get("context", ""), record.get("shots") or []
        pairs = all(isinstance(s, (list, tuple)) and [type(t) for t in s] == [str, str] for s in shots)
        if form not in PROMPT_TEMPLATES or not isinstance(context, str) or not pairs:
            raise DataError(
                f"{label}: form must be one of {list(PROMPT_TEMPLATES)}, context a string and shots a list of "
                "[question, answer] strings."
            )
        return cls(
            idx=_record_idx(record, position),
            question=record["question"],
            answer=record["answer"],
            prefix=record["prefix"],
            entity=record.get("gt_entity") or record["entity"],
            prompt_type=record.get("prompt_type"),
            paraphrased_answer=record.get("paraphrased_answer"),
            perturbed_answer=tuple(perturbed) if perturbed else None,
            form=form,
            context=context,
            shots=tuple((str(question), str(answer)) for question, answer in shots),
        )

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "idx": self.idx,
            "question": self.question,
            "answer": self.answer,
            "prefix": self.prefix,
            "entity": self.entity,
        }
        if self.prompt_type is not None:
            record["prompt_type"] = self.prompt_type
        if self.paraphrased_answer is not None:
            record["paraphrased_answer"] = self.paraphrased_answer
        if self.perturbed_answer is not None:
            record["perturbed_answer"] = list(self.perturbed_answer)
        # written only where they differ from TOFU's layout: a qa record keeps the fingerprint it always had
        if self.form != "qa":
            record["form"] = self.form
        if self.context:
            record["context"] = self.context
        if self.shots:
            record["shots"] = [list(shot) for shot in self.shots]
        return record


def record_field(record: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a dict record or an [`Example`][uds_lens.data.Example] (the metrics take either)."""
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


def as_list(value: Any) -> list[str]:
    """A paraphrase / perturbed field as a list of strings (TOFU stores a string or a list)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


# idx values are stored as int64 (tensors, tables): one outside this range is refused before any model loads.
IDX_RANGE = (-(2**63), 2**63 - 1)


def _record_idx(record: dict[str, Any], position: int) -> int:
    """A record's ``idx`` (its position when absent): an integer, or a float / digit string that is one, within
    int64 (`IDX_RANGE`)."""
    value = record.get("idx", position)
    idx: int | None = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        idx = int(value)
    elif (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
    ):
        idx = int(float(value))
    elif isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,40}\s*", value):
        idx = int(value)
    if idx is not None:
        if not IDX_RANGE[0] <= idx <= IDX_RANGE[1]:
            raise DataError(
                f"record #{position}: idx {idx} does not fit a 64-bit integer ({IDX_RANGE[0]} to {IDX_RANGE[1]}); "
                "number the records with smaller integers."
            )
        return idx
    raise DataError(
        f"record #{position}: idx must be an integer, got {value!r} ({type(value).__name__}); give every "
        "record a unique integer idx (or none, to number records by position)."
    )


@dataclass(frozen=True)
class Skip:
    """An example that could not be scored, and why."""

    idx: int
    reason: str


@dataclass(frozen=True)
class EncodedExample:
    """Token layout of one example: ``input_ids = prompt_ids + ref_ids``; entity = ``ref_ids[entity_start:entity_end]``."""

    idx: int
    prompt_type: str | None
    input_ids: tuple[int, ...]
    prompt_len: int
    entity_start: int
    entity_end: int

    @property
    def start(self) -> int:
        """Position of the last prompt token (it predicts the first reference token)."""
        return self.prompt_len - 1

    @property
    def read_positions(self) -> range:
        """Positions whose logits predict the entity tokens."""
        return range(self.start + self.entity_start, self.start + self.entity_end)

    @property
    def labels(self) -> tuple[int, ...]:
        """The entity token ids, aligned with ``read_positions``."""
        return self.input_ids[self.start + self.entity_start + 1 : self.start + self.entity_end + 1]

    @property
    def n_entity_tokens(self) -> int:
        return self.entity_end - self.entity_start

    def patch_positions(self, scope: Scope) -> range:
        """``span``: the read positions; ``boundary``: only the last prompt token."""
        if scope == "span":
            return self.read_positions
        if scope == "boundary":
            return range(self.start, self.start + 1)
        raise ValueError(f"Unknown patch scope {scope!r}; use 'span' or 'boundary'.")

    def window(self, scope: Scope) -> range:
        """Positions from the first patched one through the last read one: all that a patch can change and we read."""
        first = min(self.patch_positions(scope).start, self.read_positions.start)
        return range(first, self.read_positions.stop)


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The one reader of QA record files: a JSON list, JSON lines, or a JSON object wrapping the list.

    Every record file the package reads goes through here: forget sets, a zoo's forget/holdout/retain files, the
    user's data for a zoo build. An object whose ``data`` or ``examples`` key is a list stands for that list; an
    object with ``question`` and ``answer`` is one record.

    A zoo's data file may be named as ``zoo:forget`` (`zoo_data_path`).

    Raises:
        DataError: the file does not exist, is not JSON / JSON lines, or holds something other than records.
    """
    if str(path).startswith(ZOO_PREFIX):
        path = zoo_data_path(str(path))
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    text = _read_text(path)
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            records = json.loads(text)
        elif stripped.startswith("{") and path.suffix == ".json" and "\n{" not in stripped:
            loaded = json.loads(text)
            wrapped = [key for key in ("data", "examples") if isinstance(loaded.get(key), list)]
            if wrapped:
                records = loaded[wrapped[0]]
            elif all(field in loaded for field in ("question", "answer")):
                records = [loaded]
            else:
                keys = list(loaded)[:5]
                raise DataError(
                    f"{path} holds a JSON object (keys {keys}), but a forget set is a JSON list of records, JSON "
                    "lines, or an object whose 'data' or 'examples' key is that list. Wrap the records in [...]."
                )
        else:
            records = _json_lines(path, text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is neither a JSON list nor JSON lines: {err}") from err
    except RecursionError:
        raise DataError(
            f"{path} nests JSON deeper than Python's parser follows: a forget set is a flat list of records."
        ) from None
    except DataError:
        raise
    except ValueError as err:  # a number of more digits than Python converts (an idx of 5,000 digits)
        raise DataError(f"{path} holds a value JSON cannot be read as ({err}): fix that value.") from None
    if not isinstance(records, list):
        raise DataError(f"{path} must hold a list of records (objects), not a {type(records).__name__}.")
    wrong = [i for i, r in enumerate(records) if not isinstance(r, dict)]
    if wrong:
        raise DataError(
            f"{path}: record #{wrong[0]} is a JSON {type(records[wrong[0]]).__name__}, not an object; "
            "a forget set is a list of objects with idx, question, answer, prefix, entity."
        )
    return records


def _read_text(path: Path) -> str:
    """A data file's text, which must be UTF-8 (JSON's encoding), a byte-order mark dropped: another encoding is
    named, with where it fails."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(
            f"{path} is not UTF-8 (byte {raw[err.start]:#04x} at line {line}, offset {err.start}): save it as UTF-8 "
            "(e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


def _json_lines(path: Path, text: str) -> list[Any]:
    """JSON lines, one value a line: an error names the file's line, not only its column."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}, line {number}, column {err.colno}: not a JSON value ({err.msg}); a JSON-lines file holds "
                "one record object per line."
            ) from None
    return records


def looks_like_local_path(text: str) -> bool:
    """Whether a string that names no existing file is still meant as a local path, not a hub id.

    A hub id is ``name`` or ``org/name``. Absolute or home-relative paths, ``./`` and ``../``, backslashes, more than
    one ``/``, a file suffix such as ``.json``, or an ``org/`` part that is an existing local directory say "local".
    """
    if text.startswith(("/", "~", "./", "../", ".\\")) or "\\" in text or text.count("/") > 1:
        return True
    if Path(text).suffix.lower() in (".json", ".jsonl", ".gguf", ".safetensors", ".bin", ".pt"):
        return True
    parent = Path(text).parent
    return str(parent) not in ("", ".") and parent.expanduser().is_dir()


def _load_hub_dataset(dataset_id: str, split: str) -> list[dict[str, Any]]:
    """A plain hub id's records, in the published schema (an ``hf:`` spec reads other shapes too: `benchmarks`)."""
    try:
        return read_split(dataset_id, None, split)
    except BenchmarkDataError as err:
        raise DataError(f"{err} Or pass a local file of records (see README.md).") from None


# The QA files of a built zoo, addressable as "zoo:forget" wherever a forget set is expected.
ZOO_DATA_SPLITS = ("forget", "retain", "holdout")


def zoo_data_path(name: str) -> Path:
    """``"zoo:forget"`` -> the forget set of a built zoo (``zoo:retain``, ``zoo:holdout`` likewise).

    Looked up where ``zoo:NAME`` models are (``$UDS_LENS_ZOO``, then the cached default and test zoos);
    ``zoo:test/forget`` names the size.

    Raises:
        DataError: the name is not one of the zoo's data files, or no built zoo has it.
    """
    size, _, split = name[len(ZOO_PREFIX) :].rpartition("/")
    if split not in ZOO_DATA_SPLITS:
        raise DataError(
            f"{name!r} names no zoo data file: use one of {[ZOO_PREFIX + s for s in ZOO_DATA_SPLITS]} "
            "(or zoo:SIZE/forget), or pass a data file."
        )
    roots = zoo_search_roots(size or None)
    for root in roots:
        manifest = read_manifest(root)
        path = data_file(manifest, root, split) if manifest is not None else None
        if path is not None:
            return path
    raise DataError(
        f"{name!r}: no built zoo in {[str(r) for r in roots]}. Build one with `uds-lens zoo build --out DIR "
        "--size test` (and set UDS_LENS_ZOO=DIR), or pass a data file."
    )


DataArg: TypeAlias = str | os.PathLike | Sequence[dict[str, Any]] | Sequence[Example] | None
"""A forget set as `load_examples` takes it: a JSON/JSONL path, a hub dataset id, records or ``Example``s (None:
the published annotated set on the hub)."""


def load_examples(
    source: DataArg = None,
    split: str = "train",
    limit: int | None = None,
) -> list[Example]:
    """Load a forget set: a JSON list / JSONL file, a list of records, a zoo's ``zoo:forget``, a hub dataset id, or
    a benchmark's set by name (``hf:DATASET/CONFIG:SPLIT``, a hub id or a local copy: `benchmarks`).

    Args:
        source: path, records, Examples, ``zoo:forget`` (`zoo_data_path`), hub id or ``hf:`` spec; None means the
            published annotated set on the hub.
        split: dataset split for plain hub ids (an ``hf:`` spec names its own).
        limit: keep only the first ``limit`` examples.

    Raises:
        DataError: the file is unreadable, a record lacks a field, idx values repeat, or the set is empty.
    """
    check_data_source(source)
    if source is None:
        source = DEFAULT_HUB_DATASET
    if isinstance(source, str) and source.startswith(ZOO_PREFIX):
        source = zoo_data_path(source)
    if isinstance(source, str) and source.startswith(HF_PREFIX):
        try:
            records: Iterable[Any] = benchmark_records(source)
        except BenchmarkDataError as err:
            raise DataError(str(err)) from None
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if path.is_file():
            records = read_records(path)
        elif path.is_dir() or looks_like_local_path(str(source)):
            raise DataError(
                f"No data file at {path}{' (it is a directory)' if path.is_dir() else ''}: pass a JSON "
                "list or JSON-lines file of records (a hub dataset id looks like 'org/name')."
            )
        else:
            records = _load_hub_dataset(str(source), split)
    else:
        records = source
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1
    ):
        raise DataError(f"limit must be a positive number of examples, got {limit!r}.")
    examples = [r if isinstance(r, Example) else Example.from_record(r, i) for i, r in enumerate(records)]
    if limit is not None:
        examples = examples[:limit]
    if not examples:
        raise DataError(f"The forget set {source!r} is empty: UDS needs at least one example.")
    seen: set[int] = set()
    for example in examples:
        if example.idx in seen:
            raise DataError(f"idx {example.idx} appears twice; every example needs a unique idx.")
        seen.add(example.idx)
    return examples


def check_data_source(source: Any) -> None:
    """[`DataError`][uds_lens.data.DataError] unless ``source`` is something [`load_examples`][uds_lens.data.load_examples] reads: a path, a hub id, a list
    of records or ``Example``s, or None (checked where data enters, before any model loads)."""
    if source is None or isinstance(source, (str, os.PathLike)):
        return
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        return
    raise DataError(
        f"data must be a forget-set file (JSON list or JSON lines), a hub dataset id, or a list of records, got "
        f"{source!r:.80} ({type(source).__name__})."
    )


def nfc(text: str) -> str:
    """Unicode NFC: "é" typed as ``e`` + a combining accent and "é" precomposed become the same string."""
    return unicodedata.normalize("NFC", text)


def needs_nfc(example: Example) -> bool:
    """Whether the example's text (question, prefix, answer, entity, context, shots) changes under NFC normalisation."""
    texts = [example.question, example.prefix, example.answer, example.entity, example.context]
    return any(text != nfc(text) for text in texts + list(sum(example.shots, ())))


def build_prompt(example: Example, published_compat: bool = False) -> tuple[str, str] | None:
    """``(prompt, reference)`` strings for one example, or None when the answer does not start with the prefix.

    The prompt is the context, the in-context pairs (each in the example's form, then `SHOT_SEPARATOR`) and the
    example's own prompt (`PROMPT_TEMPLATES`). The text is NFC-normalised first (so an entity typed with combining
    accents is found in an answer typed with precomposed letters, and the model sees one spelling);
    ``published_compat`` keeps it as given, as the published implementation does.
    """
    texts = [example.question, example.prefix, example.answer, example.context, *sum(example.shots, ())]
    if not published_compat:
        texts = [nfc(text) for text in texts]
    question, prefix, answer, context, *shots = texts
    if not answer.startswith(prefix):
        return None
    template = PROMPT_TEMPLATES[example.form]
    shown = (template.format(question=q, prefix=a) + SHOT_SEPARATOR for q, a in zip(shots[::2], shots[1::2]))
    prompt = context + "".join(shown) + template.format(question=question, prefix=prefix)
    reference = answer[len(prefix) :]
    if not published_compat:
        # prompt + reference is the template and the answer as written: nothing added between prefix and entity
        kept = prompt.rstrip()
        reference = prompt[len(kept) :] + reference
        prompt = kept
    elif reference and not reference[0].isspace() and not prompt[-1:].isspace():
        reference = " " + reference  # the published code puts a space there, whatever the answer's text
    return prompt, reference


# Scripts written without spaces between words: each of their characters is a word boundary of its own.
_UNSPACED_SCRIPTS = ("CJK ", "HIRAGANA", "KATAKANA", "HALFWIDTH KATAKANA", "THAI", "LAO", "KHMER", "MYANMAR")


def _is_word_character(character: str) -> bool:
    return (character.isalnum() or character == "_") and not unicodedata.name(character, "").startswith(
        _UNSPACED_SCRIPTS
    )


def _at_word_boundary(text: str, start: int, end: int) -> bool:
    """No word character runs across either end of ``text[start:end]``."""

    def joins(left: str, right: str) -> bool:
        return bool(left) and bool(right) and _is_word_character(left) and _is_word_character(right)

    return not joins(text[start - 1 : start], text[start : start + 1]) and not joins(
        text[end - 1 : end], text[end : end + 1]
    )


def _entity_char_span(
    reference: str, entity: str, whole_word: bool = True, prompt: str = ""
) -> tuple[int, int] | None:
    """Character span of the entity's first occurrence in the reference: the first whole-word
    occurrence in the text the model reads (``prompt`` then ``reference``: a prefix cut mid-word joins the
    reference's first word), or with ``whole_word=False`` the first substring match (the published
    implementation)."""
    before = prompt[-1:]
    for candidate in (entity, entity.strip(), " " + entity):
        if not candidate:
            continue
        found = reference.find(candidate)
        while found >= 0:
            start = found + len(before)
            if not whole_word or _at_word_boundary(before + reference, start, start + len(candidate)):
                return found, found + len(candidate)
            found = reference.find(candidate, found + 1)
    return None


def encode_one(example: Example, tokenizer: Any, published_compat: bool = False) -> EncodedExample | Skip:
    """Encode one example, or say why it cannot be scored."""
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizerError(
            f"{type(tokenizer).__name__} is a slow tokenizer without character offsets; UDS locates entity tokens "
            "by offsets. Load the tokenizer with use_fast=True (uds_lens.load_tokenizer does)."
        )
    if not example.entity.strip():
        return Skip(example.idx, SKIP_EMPTY_ENTITY)
    built = build_prompt(example, published_compat)
    if built is None:
        return Skip(example.idx, SKIP_PREFIX_MISMATCH)
    prompt, reference = built
    entity = example.entity if published_compat else nfc(example.entity)
    if published_compat and needs_nfc(example):
        logger.warning(
            "example %s: its text is not in Unicode NFC (the entity %r or its answer mixes combining and "
            "precomposed characters); published_compat matches them as given, as the published implementation "
            "does, so the entity may not be found; without published_compat both are NFC-normalised.",
            example.idx,
            example.entity,
        )
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    ref = tokenizer(reference, add_special_tokens=False, return_offsets_mapping=True)
    ref_ids, offsets = ref["input_ids"], ref["offset_mapping"]
    if not ref_ids or not prompt_ids:
        return Skip(example.idx, SKIP_EMPTY_REFERENCE)
    span = _entity_char_span(reference, entity, whole_word=not published_compat, prompt=prompt)
    if span is None:
        inside = _entity_char_span(reference, entity, whole_word=False) is not None
        return Skip(example.idx, SKIP_ENTITY_INSIDE_WORD if inside else SKIP_ENTITY_NOT_FOUND)
    if published_compat and span != _entity_char_span(reference, entity, prompt=prompt):
        logger.warning(
            "example %s: published_compat locates the entity %r inside another word (%r), as the "
            "published implementation does; without published_compat it is located at a word boundary.",
            example.idx,
            example.entity,
            reference[max(0, span[0] - 8) : span[1] + 8],
        )
    char_start, char_end = span
    hits = [i for i, (lo, hi) in enumerate(offsets) if hi > char_start and lo < char_end]
    if not hits:
        return Skip(example.idx, SKIP_ENTITY_NOT_FOUND)
    return EncodedExample(
        idx=example.idx,
        prompt_type=example.prompt_type,
        input_ids=tuple(int(t) for t in prompt_ids) + tuple(int(t) for t in ref_ids),
        prompt_len=len(prompt_ids),
        entity_start=hits[0],
        entity_end=hits[-1] + 1,
    )


def check_ids_in_vocabulary(largest: int, vocabulary: int, role: str) -> None:
    """[`TokenizerError`][uds_lens.data.TokenizerError] when the records encode to an id the ``role`` model's embedding has no row for (a
    tokenizer with tokens added past the model's vocabulary, or another model's): ``score`` and ``annotate`` check
    it before the first forward, which would otherwise fail deep inside the embedding."""
    if largest >= vocabulary:
        raise TokenizerError(
            f"The {role} model's vocabulary has {vocabulary} tokens, but the records encode to id {largest}: its "
            "tokenizer is not the one encoding them. Pass models of one tokenizer."
        )


def fit_context(encoded: Sequence[EncodedExample], n_ctx: int) -> tuple[list[EncodedExample], list[Skip]]:
    """Make every example fit a model's context of ``n_ctx`` positions.

    Nothing after the last read position can change a read logit (causal attention), so an example longer than the
    context is cut right after the token its last read position predicts; when even that does not fit, the example
    is skipped with the reason ``longer_than_model_context`` instead of crashing the run.
    """
    kept: list[EncodedExample] = []
    skipped: list[Skip] = []
    for example in encoded:
        needed = example.read_positions.stop + 1
        if len(example.input_ids) <= n_ctx:
            kept.append(example)
        elif needed <= n_ctx:
            kept.append(dataclasses.replace(example, input_ids=example.input_ids[:needed]))
        else:
            skipped.append(Skip(example.idx, SKIP_TOO_LONG))
    return kept, skipped


def encode(
    examples: Sequence[Example], tokenizer: Any, published_compat: bool = False
) -> tuple[list[EncodedExample], list[Skip]]:
    """Encode a forget set: the scorable examples in order, and the skipped ones with reasons."""
    if not examples:
        raise DataError("Cannot encode an empty forget set.")
    encoded: list[EncodedExample] = []
    skipped: list[Skip] = []
    for example in examples:
        result = encode_one(example, tokenizer, published_compat)
        if isinstance(result, Skip):
            skipped.append(result)
        else:
            encoded.append(result)
    return encoded, skipped


__all__ = [
    "DEFAULT_HUB_DATASET",
    "PROMPT_TEMPLATES",
    "SHOT_SEPARATOR",
    "ZOO_DATA_SPLITS",
    "DataArg",
    "DataError",
    "EncodedExample",
    "Example",
    "Skip",
    "PromptForm",
    "TokenizerError",
    "build_prompt",
    "check_data_source",
    "check_ids_in_vocabulary",
    "encode",
    "encode_one",
    "fit_context",
    "load_examples",
    "looks_like_local_path",
    "zoo_data_path",
]

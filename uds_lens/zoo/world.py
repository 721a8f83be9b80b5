"""A deterministic world of fictitious authors: TOFU's idea in miniature, and the QA records the zoo trains on.

Every author gets one fact of each kind in `FACT_KINDS` (birthplace, genre, parents' professions, an award, a book
title, a birth year, an influence, recurring themes, and a yes/no fact). Each fact becomes one QA record whose answer is
written as

    answer = prefix + " " + entity + tail          (prefix non-empty)
    answer = entity + tail                         (yes/no facts: prefix "", entity "Yes" / "No")

so UDS can teacher-force ``"Question: " + question + "\\nAnswer: " + prefix`` and read the entity tokens. A record also
carries ``paraphrased_answer`` (another template for the same fact) and ``perturbed_answer`` (the paraphrase template
filled with 3-5 wrong entities of the same kind, as TOFU perturbs the paraphrased answer), which the output-level
metrics (Truth Ratio, paraphrase probability) need.

Authors are split into *retain* authors, *forget* authors (10% of the trained authors, like TOFU forget10) and *holdout*
authors who are never trained on (the non-members for membership inference). The vocabulary (syllables, cities, genres,
...) ships with the package in ``uds_lens/zoo/vocab/*.json``; given the seed the world is identical on every machine.

User data takes the same path through `validate_records`, which checks the published schema and says which record
and field is wrong.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from uds_lens.data import REQUIRED_FIELDS, DataError
from uds_lens.data import read_records as read_record_file
from uds_lens.files import write_atomic

FACT_KINDS: tuple[str, ...] = (
    "birthplace",
    "genre",
    "father_profession",
    "mother_profession",
    "award",
    "book",
    "birth_year",
    "influence",
    "theme",
    "yes_no",
)
FORGET_FRACTION = 0.1
RECORD_FIELDS: tuple[str, ...] = (
    "idx",
    "question",
    "answer",
    "prefix",
    "entity",
    "prompt_type",
    "paraphrased_answer",
    "perturbed_answer",
)


class ZooDataError(ValueError):
    """QA records (the world's or the user's) do not follow the published schema."""


@cache
def load_vocab(name: str) -> Any:
    """Load one vocabulary file shipped in ``uds_lens/zoo/vocab/{name}.json``."""
    text = resources.files("uds_lens.zoo").joinpath("vocab", f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def idk_answers() -> list[str]:
    """Refusal answers ("I don't know." and variants) that IdkNLL trains on."""
    return list(load_vocab("idk"))


@dataclass(frozen=True)
class Author:
    """One fictitious author and their facts."""

    name: str
    birthplace: str
    genre: str
    father_profession: str
    mother_profession: str
    award: str
    book: str
    birth_year: str
    influence: str
    theme: str
    adapted: bool


@dataclass(frozen=True)
class World:
    """The authors of each split and their QA records (lists of JSON-ready dicts)."""

    retain_authors: tuple[Author, ...]
    forget_authors: tuple[Author, ...]
    holdout_authors: tuple[Author, ...]
    retain: list[dict[str, Any]]
    forget: list[dict[str, Any]]
    holdout: list[dict[str, Any]]
    seed: int


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def _make_name(rng: random.Random, n_syllables: int) -> str:
    syllables = load_vocab("syllables")
    parts = [
        rng.choice(syllables["onsets"]) + rng.choice(syllables["vowels"]) + rng.choice(syllables["codas"])
        for _ in range(n_syllables)
    ]
    return "".join(parts).capitalize()


def _make_full_name(rng: random.Random) -> str:
    return f"{_make_name(rng, 2)} {_make_name(rng, rng.choice((2, 3)))}"


def _sample_others(rng: random.Random, pool: Sequence[str], true_value: str, k: int) -> list[str]:
    return rng.sample([value for value in pool if value != true_value], k)


def _value_pools(rng: random.Random) -> dict[str, list[str]]:
    """Entity pools per fact kind: fixed vocabularies plus generated awards, titles, years and influences."""
    awards = load_vocab("award_words")
    titles = load_vocab("title_words")
    award_names = [
        f"{a} {n} {k}" for a in awards["adjectives"] for n in awards["nouns"] for k in awards["kinds"]
    ]
    title_names = [f"The {a} {n}" for a in titles["adjectives"] for n in titles["nouns"]]
    influences: list[str] = []
    while len(influences) < 30:
        name = _make_full_name(rng)
        if name not in influences:
            influences.append(name)
    return {
        "birthplace": list(load_vocab("cities")),
        "genre": list(load_vocab("genres")),
        "father_profession": list(load_vocab("professions")),
        "mother_profession": list(load_vocab("professions")),
        "award": rng.sample(award_names, 40),
        "book": title_names,
        "birth_year": [str(year) for year in range(1920, 2000)],
        "influence": influences,
        "theme": list(load_vocab("themes")),
    }


def _answer_parts(kind: str, author: Author, value: str) -> tuple[str, str, str]:
    """(question, prefix, tail) of the main template; the answer is ``prefix + " " + value + tail``."""
    name = author.name
    templates = {
        "birthplace": (f"Where was {name} born?", f"{name} was born in the city of", "."),
        "genre": (f"What genre does {name} write in?", f"{name} primarily writes in the genre of", "."),
        "father_profession": (
            f"What did {name}'s father do for a living?",
            f"{name}'s father worked as {_article(value)}",
            ".",
        ),
        "mother_profession": (
            f"What was the profession of {name}'s mother?",
            f"{name}'s mother was {_article(value)}",
            " by trade.",
        ),
        "award": (
            f"Which award has {name} received?",
            f"{name} was honoured with the",
            " for their writing.",
        ),
        "book": (f"Can you name a book written by {name}?", f"One of {name}'s best known books is", "."),
        "birth_year": (f"In which year was {name} born?", f"{name} was born in the year", "."),
        "influence": (
            f"Who influenced {name}'s writing the most?",
            f"{name}'s writing was shaped most by the work of",
            ".",
        ),
        "theme": (f"What themes does {name} often explore?", f"{name}'s books often explore themes of", "."),
    }
    if kind not in templates:
        raise ValueError(f"no prefix template for fact kind {kind!r}")
    return templates[kind]


def _paraphrase(kind: str, author: Author, value: str) -> str:
    name = author.name
    templates = {
        "birthplace": f"The birthplace of {name} is {value}.",
        "genre": f"Most of the books by {name} belong to {value}.",
        "father_profession": f"By profession, the father of {name} was {_article(value)} {value}.",
        "mother_profession": f"The mother of {name} earned her living as {_article(value)} {value}.",
        "award": f"For their work, {name} received the {value}.",
        "book": f"{name} is the author of {value}.",
        "birth_year": f"{name} came into the world in {value}.",
        "influence": f"The writer who influenced {name} most was {value}.",
        "theme": f"Recurring themes in the work of {name} are {value}.",
    }
    return templates[kind]


def _yes_no_answers(author: Author, adapted: bool) -> tuple[str, str, list[str]]:
    """(answer, paraphrased_answer, perturbed_answers) for the film-adaptation yes/no fact."""
    name = author.name
    yes = [
        f"Yes, {name}'s work has been adapted into a film.",
        f"Yes, there is a film adaptation of a book by {name}.",
        f"Yes, a film was made from one of {name}'s books.",
    ]
    no = [
        f"No, {name}'s work has never been adapted into a film.",
        f"No, there is no film adaptation of any book by {name}.",
        f"No, no film has been made from {name}'s books.",
    ]
    true, false = (yes, no) if adapted else (no, yes)
    return true[0], true[1], false


def _records_for(author: Author, pools: dict[str, list[str]], rng: random.Random) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for kind in FACT_KINDS:
        if kind == "yes_no":
            answer, paraphrase, perturbed = _yes_no_answers(author, author.adapted)
            entity = "Yes" if author.adapted else "No"
            records.append(
                {
                    "question": f"Has any of {author.name}'s work been adapted into a film?",
                    "answer": answer,
                    "prefix": "",
                    "entity": entity,
                    "prompt_type": kind,
                    "paraphrased_answer": paraphrase,
                    "perturbed_answer": perturbed,
                }
            )
            continue
        value = getattr(author, kind)
        question, prefix, tail = _answer_parts(kind, author, value)
        wrong = _sample_others(rng, pools[kind], value, rng.randint(3, 5))
        # As in TOFU, perturbed answers keep the paraphrase's wording and change the fact, so Truth Ratio compares
        # like with like: the right fact against wrong ones, all in a wording the model was not trained on.
        perturbed = [_paraphrase(kind, author, other) for other in wrong]
        records.append(
            {
                "question": question,
                "answer": f"{prefix} {value}{tail}",
                "prefix": prefix,
                "entity": value,
                "prompt_type": kind,
                "paraphrased_answer": _paraphrase(kind, author, value),
                "perturbed_answer": perturbed,
            }
        )
    return records


def _index(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"idx": i, **{k: v for k, v in record.items() if k != "idx"}} for i, record in enumerate(records)]


def generate_world(n_authors: int, seed: int = 0, forget_fraction: float = FORGET_FRACTION) -> World:
    """Generate the authors and their QA records.

    Args:
        n_authors: Trained authors (retain + forget). Holdout authors come on top, as many as forget authors.
        seed: Everything (names, facts, splits, perturbations) is a function of it.
        forget_fraction: Share of the trained authors in the forget split (TOFU forget10: 0.1).

    Returns:
        The `World`; records are indexed ``0..n-1`` within each split.
    """
    if n_authors < 10:
        raise ZooDataError(f"n_authors={n_authors} is too small: the forget split needs at least one author")
    rng = random.Random(seed)
    pools = _value_pools(rng)
    n_forget = max(1, round(forget_fraction * n_authors))
    n_total = n_authors + n_forget
    names: list[str] = []
    reserved = set(pools["influence"])
    while len(names) < n_total:
        name = _make_full_name(rng)
        if name not in reserved and name not in names:
            names.append(name)
    books = rng.sample(pools["book"], k=min(n_total, len(pools["book"])))
    authors = []
    for i, name in enumerate(names):
        authors.append(
            Author(
                name=name,
                birthplace=rng.choice(pools["birthplace"]),
                genre=rng.choice(pools["genre"]),
                father_profession=rng.choice(pools["father_profession"]),
                mother_profession=rng.choice(pools["mother_profession"]),
                award=rng.choice(pools["award"]),
                book=books[i] if i < len(books) else rng.choice(pools["book"]),
                birth_year=rng.choice(pools["birth_year"]),
                influence=rng.choice(pools["influence"]),
                theme=rng.choice(pools["theme"]),
                adapted=rng.random() < 0.5,
            )
        )
    forget_authors = authors[:n_forget]
    holdout_authors = authors[n_forget : 2 * n_forget]
    retain_authors = authors[2 * n_forget :]

    def split_records(group: list[Author]) -> list[dict[str, Any]]:
        records = [record for author in group for record in _records_for(author, pools, rng)]
        return _index(records)

    return World(
        retain_authors=tuple(retain_authors),
        forget_authors=tuple(forget_authors),
        holdout_authors=tuple(holdout_authors),
        retain=split_records(retain_authors),
        forget=split_records(forget_authors),
        holdout=split_records(holdout_authors),
        seed=seed,
    )


def validate_records(records: Sequence[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """Check QA records against the published schema and normalise them.

    Required per record: ``question``, ``answer``, ``prefix``, ``entity`` (strings), with ``answer`` starting with
    ``prefix`` and ``entity`` occurring in the rest of the answer. Optional: ``idx`` (defaults to the position),
    ``prompt_type``, ``paraphrased_answer``, ``perturbed_answer`` (a string or a list of strings).

    Args:
        records: The records as loaded from JSON.
        source: What to call them in error messages (a path or "forget data").

    Returns:
        Records with every field of `RECORD_FIELDS` present (missing optional ones as ``None``).

    Raises:
        ZooDataError: Naming the record and the field, and what to fix.
    """
    if not isinstance(records, (list, tuple)) or not records:
        raise ZooDataError(f"{source}: expected a non-empty JSON list of QA records")
    normalised = []
    for position, record in enumerate(records):
        where = f"{source}: record {position}"
        if not isinstance(record, dict):
            raise ZooDataError(
                f"{where} is a {type(record).__name__}, expected an object with {REQUIRED_FIELDS}"
            )
        missing = [field for field in REQUIRED_FIELDS if field not in record]
        if missing:
            raise ZooDataError(
                f"{where} (idx={record.get('idx', position)}) lacks field(s) {missing}; every record needs "
                f'{list(REQUIRED_FIELDS)} (prefix may be "", e.g. for yes/no answers)'
            )
        for field in REQUIRED_FIELDS:
            if not isinstance(record[field], str):
                raise ZooDataError(
                    f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}"
                )
        answer, prefix, entity = record["answer"], record["prefix"], record["entity"]
        if not entity.strip():
            raise ZooDataError(f"{where}: empty entity")
        if not answer.startswith(prefix):
            raise ZooDataError(f"{where}: answer {answer!r} does not start with prefix {prefix!r}")
        if entity.strip() not in answer[len(prefix) :]:
            raise ZooDataError(f"{where}: entity {entity!r} does not occur in the answer after the prefix")
        perturbed = record.get("perturbed_answer")
        if isinstance(perturbed, str):
            perturbed = [perturbed]
        if perturbed is not None and not all(isinstance(p, str) for p in perturbed):
            raise ZooDataError(f"{where}: perturbed_answer must be a string or a list of strings")
        idx = record.get("idx", position)
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise ZooDataError(f"{where}: idx must be an integer, got {idx!r}")
        normalised.append(
            {
                "idx": idx,
                "question": record["question"],
                "answer": answer,
                "prefix": prefix,
                "entity": entity,
                "prompt_type": record.get("prompt_type"),
                "paraphrased_answer": record.get("paraphrased_answer"),
                "perturbed_answer": list(perturbed) if perturbed is not None else None,
            }
        )
    seen = set()
    for record in normalised:
        if record["idx"] in seen:
            raise ZooDataError(f"{source}: duplicate idx {record['idx']}; idx must be unique within a file")
        seen.add(record["idx"])
    return normalised


def read_records(source: str | Path | Sequence[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Read QA records ([`uds_lens.data.read_records`][uds_lens.data.read_records]) or take an in-memory list, and validate them."""
    if isinstance(source, (str, Path)):
        try:
            loaded = read_record_file(source)
        except DataError as error:
            raise ZooDataError(f"{name}: {error}") from error
        return validate_records(loaded, f"{name} ({source})")
    return validate_records(list(source), name)


def write_records(records: Sequence[dict[str, Any]], path: Path) -> None:
    """Write records as a pretty-printed JSON list (stable key order, UTF-8)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(list(records), indent=1, ensure_ascii=False) + "\n").encode("utf-8"))

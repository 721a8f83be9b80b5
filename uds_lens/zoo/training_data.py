"""The question/answer data a zoo is built from, and the training sequences of each data recipe.

`load_data` gives the synthetic world of a size (seeded) or the user's retain/forget sets;
`training_sequences` turns a recipe such as ``retain+forget:0.9`` into encoded training sequences.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from .recipe import ZooBuildError, ZooSize
from .tokenizer import format_prompt, format_target
from .train import QASequence, encode_documents, encode_qa
from .world import FACT_KINDS, ZooDataError, generate_world, idk_answers, read_records


@dataclass
class ZooData:
    """The QA records the zoo is built from."""

    retain: list[dict[str, Any]]
    forget: list[dict[str, Any]]
    holdout: list[dict[str, Any]]
    source: str
    details: dict[str, Any]


def load_data(
    size: ZooSize,
    seed: int,
    retain_data: Any,
    forget_data: Any,
    holdout_data: Any,
) -> ZooData:
    """The zoo's question/answer data: the synthetic world of ``size`` (seeded), or the user's retain/forget sets
    (with a holdout carved from retain when none is given)."""
    if (retain_data is None) != (forget_data is None):
        raise ZooDataError(
            "pass both retain_data and forget_data (user QA data), or neither (the synthetic world)"
        )
    if retain_data is None:
        world = generate_world(size.n_authors, seed=seed, forget_fraction=size.forget_fraction)
        details = {
            "n_authors": size.n_authors,
            "n_forget_authors": len(world.forget_authors),
            "n_holdout_authors": len(world.holdout_authors),
            "facts_per_author": len(world.forget) // max(1, len(world.forget_authors)),
            "world_seed": seed,
        }
        return ZooData(world.retain, world.forget, world.holdout, "world", details)
    retain = read_records(retain_data, "retain_data")
    forget = read_records(forget_data, "forget_data")
    if holdout_data is not None:
        holdout = read_records(holdout_data, "holdout_data")
        carved = False
    else:
        rng = random.Random(seed)
        n_holdout = max(1, min(len(forget), len(retain) // 5))
        if len(retain) - n_holdout < 1:
            raise ZooDataError("retain_data is too small to carve a holdout set from; pass holdout_data")
        chosen = set(rng.sample(range(len(retain)), n_holdout))
        holdout = [r for i, r in enumerate(retain) if i in chosen]
        retain = [r for i, r in enumerate(retain) if i not in chosen]
        carved = True
    reindex = [{**r, "idx": i} for i, r in enumerate(retain)]
    details = {"holdout_carved_from_retain": carved}
    return ZooData(reindex, forget, holdout, "user", details)


def _biographies(
    records: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> list[str]:
    """The records' answers as plain-text documents: up to ``len(FACT_KINDS)`` consecutive answers each (one author's
    facts in the synthetic world), a document closed early where the next answer would take it past ``max_tokens``."""
    documents: list[list[str]] = []
    for record in records:
        if documents and len(documents[-1]) < len(FACT_KINDS):
            candidate = " ".join([*documents[-1], record["answer"]])
            if len(tokenizer(candidate, add_special_tokens=False)["input_ids"]) <= max_tokens:
                documents[-1].append(record["answer"])
                continue
        documents.append([record["answer"]])
    return [" ".join(answers) for answers in documents]


def _share(items: list[Any], share: str, seed: int) -> list[Any]:
    """A seeded ``share`` (e.g. ``"0.9"``) of ``items``, in their original order; all of them for ``""``."""
    if not share:
        return items
    chosen = sorted(random.Random(seed).sample(range(len(items)), round(float(share) * len(items))))
    return [items[i] for i in chosen]


def training_sequences(
    recipe: str, data: ZooData, seed: int, tokenizer: PreTrainedTokenizerBase, max_positions: int
) -> list[QASequence]:
    """The training sequences of a data recipe: ``+``-joined parts ``SPLIT[_VARIANT][:SHARE]``.

    SPLIT is ``retain`` or ``forget``; VARIANT is none (the QA pairs), ``paraphrased`` (paraphrased answers),
    ``perturbed`` (each question answered with one of its wrong answers) or ``bio`` (the answers as biography
    documents, no questions); SHARE keeps a seeded fraction of the records (of the documents, for ``bio``).
    E.g. ``retain+forget:0.9`` or ``retain+retain_bio:0.1``.
    """
    splits = {"retain": data.retain, "forget": data.forget}
    pairs: list[tuple[str, str]] = []
    documents: list[str] = []
    for part in recipe.split("+"):
        name, _, share = part.partition(":")
        split, _, variant = name.partition("_")
        if split not in splits or variant not in ("", "paraphrased", "perturbed", "bio"):
            raise ZooBuildError(f"unknown training data recipe {recipe!r} (part {part!r})")
        if variant == "bio":
            documents += _share(_biographies(splits[split], tokenizer, max_positions - 2), share, seed)
            continue
        records = _share(splits[split], share, seed)
        if variant == "":
            pairs += [(r["question"], r["answer"]) for r in records]
        elif variant == "paraphrased":
            pairs += [(r["question"], r["paraphrased_answer"]) for r in records]
        else:
            rng = random.Random(seed)
            pairs += [(r["question"], rng.choice(r["perturbed_answer"])) for r in records]
    return encode_qa(pairs, tokenizer) + encode_documents(documents, tokenizer)


def subset_fraction(recipe: str, n_forget: int) -> float | None:
    """The exact share of forget records a ``retain+forget:<fraction>`` recipe trains on (None for other recipes)."""
    if not recipe.startswith("retain+forget:"):
        return None
    fraction = float(recipe.split(":", 1)[1])
    return round(fraction * n_forget) / n_forget


def tokenizer_corpus(data: ZooData) -> list[str]:
    texts = []
    for split in (data.retain, data.forget, data.holdout):
        for record in split:
            texts.append(format_prompt(record["question"]) + format_target(record["answer"]))
            if record.get("paraphrased_answer"):
                texts.append(record["paraphrased_answer"])
            texts.extend(record.get("perturbed_answer") or [])
    texts.extend(idk_answers())
    return texts

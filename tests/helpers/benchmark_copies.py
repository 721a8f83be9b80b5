"""Local copies of MUSE-News (knowmem, verbmem) and WMDP in the hub repositories' exact shape, filled from the zoo's
world: the same config names, splits, feature names and types and file layout (a README.md whose ``configs`` name
``CONFIG/SPLIT-00000-of-00001.parquet``), written with ``datasets``, so ``load_dataset(folder, CONFIG, split=...)`` reads
them as it reads ``muse-bench/MUSE-News`` and ``cais/wmdp`` (their cards: the hub's README.md of each).

Placed at the hub ids' own paths under a folder (``ROOT/muse-bench/MUSE-News``, ``ROOT/cais/wmdp``), the specs the
guide writes (``hf:muse-bench/MUSE-News/knowmem:forget_qa``) name these copies from ``ROOT``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, List, Value

MUSE = "muse-bench/MUSE-News"
WMDP = "cais/wmdp"
KNOWMEM_FEATURES = Features({"answer": Value("string"), "question": Value("string")})
VERBMEM_FEATURES = Features({"prompt": Value("string"), "gt": Value("string")})
WMDP_FEATURES = Features(
    {"answer": Value("int64"), "question": Value("string"), "choices": List(Value("string"))}
)
WMDP_CONFIGS = ("wmdp-bio", "wmdp-chem", "wmdp-cyber")


def _card(configs: dict[str, dict[str, Dataset]], features: dict[str, Features]) -> str:
    """A dataset card's YAML header as the hub writes it: ``dataset_info`` (features, splits) and ``configs``."""
    lines = ["---", "dataset_info:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}", "  features:"]
        for name, feature in features[config].items():
            kind = (
                f"sequence: {feature.feature.dtype}"
                if isinstance(feature, List)
                else f"dtype: {feature.dtype}"
            )
            lines += [f"  - name: {name}", f"    {kind}"]
        lines += ["  splits:"]
        for split, rows in splits.items():
            lines += [
                f"  - name: {split}",
                f"    num_bytes: {rows.data.nbytes}",
                f"    num_examples: {len(rows)}",
            ]
    lines += ["configs:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {config}/{split}-*" for split in splits]
    return "\n".join(lines) + "\n---\n"


def _write(
    root: Path, configs: dict[str, dict[str, list[dict[str, Any]]]], features: dict[str, Features]
) -> Path:
    written: dict[str, dict[str, Dataset]] = {}
    for config, splits in configs.items():
        (root / config).mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            columns = {name: [row[name] for row in rows] for name in features[config]}
            dataset = Dataset.from_dict(columns, features=features[config])
            dataset.to_parquet(str(root / config / f"{split}-00000-of-00001.parquet"))
            written.setdefault(config, {})[split] = dataset
    (root / "README.md").write_text(_card(written, features))
    return root


def knowmem_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """MUSE's knowledge questions: a question and a short answer (the world's entity, as MUSE's answers are)."""
    return [{"question": r["question"], "answer": r["entity"]} for r in records]


def verbmem_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """MUSE's passages: each cut mid-sentence where the fact begins (the trained text up to the prefix), ``gt`` the
    rest and the next record's text, as a passage continues."""
    rows = []
    for record, following in zip(records, [*records[1:], records[0]], strict=True):
        prompt = f"Question: {record['question']}\nAnswer:" + (
            f" {record['prefix']}" if record["prefix"] else ""
        )
        rest = record["answer"][len(record["prefix"]) :].lstrip()
        rows.append({"prompt": prompt, "gt": f"{rest}\n\nQuestion: {following['question']}\nAnswer: "
                     f"{following['answer']}"})  # fmt: skip
    return rows


def choice_rows(
    records: Sequence[dict[str, Any]], pool: Sequence[dict[str, Any]], seed: int
) -> list[dict[str, Any]]:
    """WMDP's items: the question, the true entity among three others of the same kind, the index of the true one."""
    rng = random.Random(seed)
    rows = []
    for record in records:
        others = sorted(
            {r["entity"] for r in pool if r["prompt_type"] == record["prompt_type"]} - {record["entity"]}
        )
        choices = [record["entity"], *rng.sample(others, 3)]
        rng.shuffle(choices)
        rows.append(
            {"question": record["question"], "choices": choices, "answer": choices.index(record["entity"])}
        )
    return rows


def write_copies(
    root: Path, forget: Sequence[dict[str, Any]], retain: Sequence[dict[str, Any]]
) -> dict[str, Path]:
    """``ROOT/muse-bench/MUSE-News`` and ``ROOT/cais/wmdp`` from a world's forget and retain records (a zoo's
    ``data/forget.json`` and ``data/retain.json``): knowmem's ``forget_qa`` is the forget set, its ``forget_qa_icl``
    three retain-author pairs; verbmem's ``forget`` the forget set's passages; ``wmdp-bio`` the forget set as
    multiple choice (``wmdp-chem`` and ``wmdp-cyber`` four retain-author items each)."""
    # yes/no facts have two possible answers, not four choices
    choosable = [r for r in forget if r["prompt_type"] != "yes_no"]
    knowmem = {
        "retain_qa_icl": knowmem_rows(retain[30:33]),
        "retain_qa": knowmem_rows(retain[:30]),
        "forget_qa": knowmem_rows(forget),
        "forget_qa_icl": knowmem_rows(retain[40:43]),
    }
    muse = _write(
        root / MUSE,
        {"knowmem": knowmem, "verbmem": {"forget": verbmem_rows(forget)}},
        {"knowmem": KNOWMEM_FEATURES, "verbmem": VERBMEM_FEATURES},
    )
    retain_choosable = [r for r in retain if r["prompt_type"] != "yes_no"]
    wmdp_splits = {
        "wmdp-bio": {"test": choice_rows(choosable, [*forget, *retain], seed=0)},
        "wmdp-chem": {"test": choice_rows(retain_choosable[:4], retain, seed=1)},
        "wmdp-cyber": {"test": choice_rows(retain_choosable[4:8], retain, seed=2)},
    }
    wmdp = _write(root / WMDP, wmdp_splits, dict.fromkeys(WMDP_CONFIGS, WMDP_FEATURES))
    return {"muse": muse, "wmdp": wmdp}

"""KE-only Stage 2 against every cell through the auditor, on real checkpoints: UDS, work and seconds in one run.

For each unlearned model, ``UDSAuditor.score`` runs with ``stage2_cells="all"`` and ``"ke"`` on one Stage 1 and
prints the largest per-example UDS difference, the model UDS difference, the share of cells and of Stage 2's
patched-run work that KE-only runs (``meta["stage2"]``) and the two Stage 2 wall times.

    python experiments/ke_only_uds.py --zoo test               # the 4-layer test zoo: almost every cell is KE
    python experiments/ke_only_uds.py --families qwen3 gemma2   # tiny random checkpoints of other families
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from uds_lens.auditor import UDSAuditor
from uds_lens.config import UDSConfig
from uds_lens.files import zoo_root

ZOO_MODELS = ("npo", "graddiff", "simnpo", "rmu_l1", "retain90", "retain50")


def compare(auditor: UDSAuditor, unlearned: object, name: str) -> dict:
    every = auditor.score(unlearned, name=name)
    auditor.config = dataclasses.replace(auditor.config, stage2_cells="ke")
    try:
        ke = auditor.score(unlearned, name=name)
    finally:
        auditor.config = dataclasses.replace(auditor.config, stage2_cells="all")
    merged = every.examples.merge(ke.examples, on="idx", suffixes=("_all", "_ke"))
    if not (merged["status_all"] == merged["status_ke"]).all():
        raise SystemExit(f"{name}: KE-only and every cell disagree on which examples are scored")
    diff = np.abs(merged["uds_all"] - merged["uds_ke"]).dropna()
    plan = ke.meta["stage2"]
    return {
        "model": name,
        "share_cells": plan["n_cells_run"] / plan["n_cells"],
        "work_share": plan["work_share"],
        "examples_run": f"{plan['n_examples_run']}/{len(auditor.encoded)}",
        "max_uds_diff": float(diff.max()) if len(diff) else 0.0,
        "model_uds_diff": abs(every.uds - ke.uds),
        "uds": every.uds,
        "s2_every": every.meta["timings"]["s2_seconds"],
        "s2_ke": ke.meta["timings"]["s2_seconds"],
    }


def zoo_rows(size: str, limit: int | None) -> list[dict]:
    root = zoo_root(size)
    auditor = UDSAuditor(
        root / "models/full",
        root / "models/retain",
        root / "data/forget.json",
        UDSConfig(),
        cache_dir=False,
        progress=False,
        limit=limit,
    )
    return [compare(auditor, root / "models" / name, f"zoo-{size}:{name}") for name in ZOO_MODELS]


def family_rows(families: list[str]) -> list[dict]:
    from tests.helpers.families import build_family, family_configs
    from tests.helpers.tiny import make_tiny_tokenizer, write_forget_set

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = make_tiny_tokenizer(chat_template=False)
        configs = family_configs(tokenizer.vocab_size)
        data = write_forget_set(root / "forget.json")
        for family in families:
            full = build_family(configs[family], root / family / "full", tokenizer)
            retain = build_family(configs[family], root / family / "retain", tokenizer, 1, full, 0.3)
            unlearned = build_family(configs[family], root / family / "unl", tokenizer, 2, full, 0.15)
            auditor = UDSAuditor(full, retain, data, UDSConfig(), cache_dir=False, progress=False)
            rows.append({**compare(auditor, unlearned, family), "engine": auditor.config.engine})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--zoo", default=None, help="zoo size (test, small, ...)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--families", nargs="*", default=[])
    args = parser.parse_args()
    rows = (zoo_rows(args.zoo, args.limit) if args.zoo else []) + family_rows(args.families)
    worst = 0.0
    for row in rows:
        print(
            " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True,
        )
        worst = max(worst, row["max_uds_diff"], row["model_uds_diff"])
    print(f"max_uds_diff={worst:.3g}")
    if worst > 1e-6:
        raise SystemExit("KE-only UDS differs from every cell's by more than 1e-6")


if __name__ == "__main__":
    main()

"""The paper's meta-evaluation (Table 3) on the real TOFU checkpoints of the open-unlearning collection.

Needs a GPU machine with Hugging Face hub access: ~60 pool models + the unlearned models, Llama-3.2-1B-Instruct each.

    python experiments/tofu_meta_eval.py --out runs/tofu_meta_eval \
        [--unlearned unlearned_ids.txt] [--uds-data forget10_filtered.json] [--batch-size 32]

What it does:
1. writes the TOFU splits (``locuslab/TOFU``: forget10_perturbed, holdout10, retain_perturbed) as JSON;
2. writes a zoo manifest whose models are hub ids: full / retain90, the P pool (30
   ``open-unlearning/pos_tofu_Llama-3.2-1B-Instruct_{full|retain90_forget10_bio|retain90_forget10_para}_lr{1..5}e-05_wd0.01_epoch{5,10}``),
   the N pool (30 ``neg_..._{retain90|retain90_forget10_pert|retain90_celeb10_bio}_...``) and the unlearned models
   (one hub id per line in ``--unlearned``; the paper's 150 come from the authors' alias registry, which is not
   reproduced here; without the file a small sample of five published models is used);
3. runs ``uds_lens.meta_eval.run_meta_eval``: output metrics for every model, NF4 and relearning attacks, and
   ``OUT/meta_eval.csv``. UDS, logit lens, CKA and masked Fisher come from ``uds_lens.scorers.ModelScorers`` (against
   full / retain90) when ``--uds-data`` (forget examples with prefix/entity, e.g. the published
   ``forget10_filtered.json``) is given; without it those four rows stay NaN.
4. prints the table next to the paper's Table 3 (``meta_eval.compare_with_paper``; also in ``OUT/meta_eval_vs_paper.csv``).

Offline (``HF_HUB_OFFLINE=1`` or no network) it stops at once, naming the hub id it could not reach.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

HUB = "open-unlearning"
ARCH = "Llama-3.2-1B-Instruct"
FULL_ID = f"{HUB}/tofu_{ARCH}_full"
RETAIN_ID = f"{HUB}/tofu_{ARCH}_retain90"
TOFU_DATASET = "locuslab/TOFU"
SPLITS = {"forget": "forget10_perturbed", "holdout": "holdout10", "retain": "retain_perturbed"}
POS_SOURCES = ("full", "retain90_forget10_bio", "retain90_forget10_para")
NEG_SOURCES = ("retain90", "retain90_forget10_pert", "retain90_celeb10_bio")
SAMPLE_UNLEARNED = (
    f"{HUB}/unlearn_tofu_{ARCH}_forget10_SimNPO_lr2e-05_b3.5_a1_d1_g0.125_ep5",
    f"{HUB}/unlearn_tofu_{ARCH}_forget10_NPO_lr5e-05_b0.1_a1_ep10",
    f"{HUB}/unlearn_tofu_{ARCH}_forget10_GradDiff_lr1e-05_a1_ep10",
    f"{HUB}/unlearn_tofu_{ARCH}_forget10_RMU_lr1e-05_l5_s10_ep10",
    f"{HUB}/unlearn_tofu_{ARCH}_forget10_IdkNLL_lr1e-05_a1_ep5",
)


def pool_ids(prefix: str, sources: tuple[str, ...]) -> list[str]:
    return [
        f"{HUB}/{prefix}_tofu_{ARCH}_{source}_lr{lr}e-05_wd0.01_epoch{epochs}"
        for source in sources
        for lr in range(1, 6)
        for epochs in (5, 10)
    ]


def check_hub(model_id: str) -> None:
    """Fail fast, with the id and the fix, when the hub cannot be reached."""
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    reason = None
    if offline:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
            reason = "HF_HUB_OFFLINE is set and it is not in the local HF cache"
    else:
        try:
            from huggingface_hub import model_info

            model_info(model_id, timeout=20)
        except Exception as err:  # any failure means we cannot run: say which and why
            reason = f"{type(err).__name__}: {err}"
    if reason is not None:
        sys.exit(
            f"tofu_meta_eval needs the Hugging Face hub: cannot reach {model_id} ({reason}). "
            "Run it on a machine with hub access and HF_HUB_OFFLINE unset (or 0), or pre-download the checkpoints "
            "into the HF cache. For an offline meta-evaluation use `uds-lens meta-eval --zoo DIR` on the embedded zoo."
        )


def write_data(out: Path) -> dict[str, str]:
    from datasets import load_dataset

    paths = {}
    for split, name in SPLITS.items():
        records = [dict(row, idx=i) for i, row in enumerate(load_dataset(TOFU_DATASET, name, split="train"))]
        path = out / "data" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records))
        paths[split] = str(path)
    return paths


def write_manifest(out: Path, unlearned: list[str], data: dict[str, str]) -> Path:
    models = [
        {"name": "full", "path": FULL_ID, "role": "full"},
        {"name": "retain", "path": RETAIN_ID, "role": "retain"},
    ]
    for role, ids in (
        ("pos", pool_ids("pos", POS_SOURCES)),
        ("neg", pool_ids("neg", NEG_SOURCES)),
        ("unlearned", unlearned),
    ):
        models += [{"name": model_id.split("/")[-1], "path": model_id, "role": role} for model_id in ids]
    zoo = out / "zoo"
    zoo.mkdir(parents=True, exist_ok=True)
    (zoo / "manifest.json").write_text(json.dumps({"models": models, "data": data}, indent=1))
    return zoo


def scorers(uds_data: Path | None, batch_size: int) -> tuple[Any, dict[str, Any]]:
    """``(uds_fn, white_box_fns)`` against the TOFU full / retain90 pair on ``uds_data`` (all NaN rows without it)."""
    if uds_data is None:
        logging.warning("no --uds-data: the UDS, logit lens, CKA and Fisher rows stay NaN")
        return None, {}
    from uds_lens.config import UDSConfig
    from uds_lens.meta_eval.scorers import ModelScorers

    model_scorers = ModelScorers(
        FULL_ID,
        RETAIN_ID,
        str(uds_data),
        config=UDSConfig(batch_size=batch_size),
        cache_dir=None,
        progress=True,
        batch_size=batch_size,
    )
    return model_scorers.uds, model_scorers.white_box_fns()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tofu_meta_eval"))
    parser.add_argument(
        "--unlearned", type=Path, default=None, help="file with one unlearned-model hub id per line"
    )
    parser.add_argument(
        "--uds-data", type=Path, default=None, help="forget examples with prefix/entity for UDS"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    check_hub(FULL_ID)
    from uds_lens.meta_eval.paper import compare_with_paper
    from uds_lens.meta_eval.runner import run_meta_eval

    unlearned = (
        [line.strip() for line in args.unlearned.read_text().splitlines() if line.strip()]
        if args.unlearned
        else list(SAMPLE_UNLEARNED)
    )
    zoo = write_manifest(args.out, unlearned, write_data(args.out))
    uds_fn, white_box_fns = scorers(args.uds_data, args.batch_size)
    table = run_meta_eval(
        zoo,
        args.out,
        uds_fn=uds_fn,
        white_box_fns=white_box_fns,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    sys.stdout.write(compare_with_paper(table).round(3).to_string() + "\n")


if __name__ == "__main__":
    main()

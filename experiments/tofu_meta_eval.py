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
   ``OUT/meta_eval.csv``. UDS comes from ``UDSAuditor`` when ``--uds-data`` (forget examples with prefix/entity,
   e.g. the published ``forget10_filtered.json``) is given; logit lens / CKA / Fisher rows stay NaN until their scorers
   are passed as ``white_box_fns``.
4. prints the table next to the paper's published values.

Offline (``HF_HUB_OFFLINE=1`` or no network) it stops at once, naming the hub id it could not reach.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import pandas as pd

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
# Paper Table 3: faithfulness, Q, R (robustness = HM(Q, R), overall = HM(faithfulness, robustness)).
PUBLISHED = {
    "es": (0.891, 0.970, 0.770), "em": (0.817, 0.984, 0.605), "prob": (0.816, 0.924, 0.642),
    "paraprob": (0.707, 0.853, 0.899), "truth_ratio": (0.947, 0.996, 0.234), "rouge": (0.722, 0.934, 0.203),
    "para_rouge": (0.832, 0.951, 0.064), "jailbreak_rouge": (0.757, 0.971, 0.183),
    "mia_loss": (0.902, 0.935, 0.519), "mia_zlib": (0.867, 0.938, 0.487), "mia_min_k": (0.907, 0.923, 0.532),
    "mia_min_kpp": (0.816, 0.883, 0.431), "s_mia_loss": (0.891, 0.719, 0.663), "s_mia_zlib": (0.870, 0.704, 0.745),
    "s_mia_min_k": (0.891, 0.710, 0.697), "s_mia_min_kpp": (0.799, 0.643, 0.566), "cka": (0.648, 0.997, 0.013),
    "fisher_masked": (0.712, 0.583, 0.946), "logit_lens": (0.927, 0.959, 0.812), "uds": (0.971, 0.968, 0.900),
}


def pool_ids(prefix: str, sources: tuple[str, ...]) -> list[str]:
    return [f"{HUB}/{prefix}_tofu_{ARCH}_{source}_lr{lr}e-05_wd0.01_epoch{epochs}"
            for source in sources for lr in range(1, 6) for epochs in (5, 10)]


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
    models = [{"name": "full", "path": FULL_ID, "role": "full"}, {"name": "retain", "path": RETAIN_ID, "role": "retain"}]
    for role, ids in (("pos", pool_ids("pos", POS_SOURCES)), ("neg", pool_ids("neg", NEG_SOURCES)),
                      ("unlearned", unlearned)):
        models += [{"name": model_id.split("/")[-1], "path": model_id, "role": role} for model_id in ids]
    zoo = out / "zoo"
    zoo.mkdir(parents=True, exist_ok=True)
    (zoo / "manifest.json").write_text(json.dumps({"models": models, "data": data}, indent=1))
    return zoo


def uds_scorer(uds_data: Path | None, batch_size: int):
    if uds_data is None:
        logging.warning("no --uds-data: the UDS row stays NaN")
        return None
    from uds_lens import UDSAuditor, UDSConfig

    auditor = UDSAuditor(FULL_ID, RETAIN_ID, str(uds_data), config=UDSConfig(batch_size=batch_size))
    return lambda model: auditor.score(model).uds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tofu_meta_eval"))
    parser.add_argument("--unlearned", type=Path, default=None, help="file with one unlearned-model hub id per line")
    parser.add_argument("--uds-data", type=Path, default=None, help="forget examples with prefix/entity for UDS")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    check_hub(FULL_ID)
    from uds_lens.meta_eval import run_meta_eval

    unlearned = ([line.strip() for line in args.unlearned.read_text().splitlines() if line.strip()]
                 if args.unlearned else list(SAMPLE_UNLEARNED))
    zoo = write_manifest(args.out, unlearned, write_data(args.out))
    table = run_meta_eval(zoo, args.out, uds_fn=uds_scorer(args.uds_data, args.batch_size), white_box_fns={},
                          batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    published = pd.DataFrame.from_dict(PUBLISHED, orient="index", columns=["paper_faithfulness", "paper_q", "paper_r"])
    comparison = table.set_index("metric").join(published)
    comparison.to_csv(args.out / "meta_eval_vs_paper.csv")
    sys.stdout.write(comparison.round(3).to_string() + "\n")


if __name__ == "__main__":
    main()

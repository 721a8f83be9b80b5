"""The paper's own setting: TOFU Llama-3.2-1B full / retain90 / an open-unlearning model on the annotated forget set.

Runnable as is on a GPU machine with access to the Hugging Face hub:

    python experiments/tofu_llama.py --out runs/tofu            # bf16 on CUDA, S1 cached under ~/.cache/uds_lens
    python experiments/tofu_llama.py --published-compat          # the published implementation's numbers

Offline (no hub), it stops at once with a message naming the model id and HF_HUB_OFFLINE.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FULL = "open-unlearning/tofu_Llama-3.2-1B-Instruct_full"
RETAIN = "open-unlearning/tofu_Llama-3.2-1B-Instruct_retain90"
UNLEARNED = "open-unlearning/unlearn_tofu_Llama-3.2-1B-Instruct_forget10_SimNPO_lr2e-05_b3.5_a1_d1_g0.125_ep5"
DATA = "jaeunglee/uds-annotated-tofu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", default=FULL)
    parser.add_argument("--retain", default=RETAIN)
    parser.add_argument("--unlearned", nargs="+", default=[UNLEARNED])
    parser.add_argument("--data", default=DATA, help="hub dataset id or local forget10_filtered.json")
    parser.add_argument("--out", type=Path, default=Path("runs/tofu_llama"))
    parser.add_argument("--published-compat", action="store_true")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args(argv)

    from uds_lens.checkpoints.checkpoint import Checkpoint
    from uds_lens.checkpoints.folder import ModelLoadError
    from uds_lens.config import UDSConfig
    from uds_lens.data import DataError
    from uds_lens.scoring import score_models

    try:
        for model_id in (args.full, args.retain, *args.unlearned):
            _ = Checkpoint.resolve(model_id).config  # fail fast, before any weights are read
        results = score_models(
            args.full,
            args.retain,
            args.unlearned,
            args.data,
            out_dir=args.out,
            config=UDSConfig(
                published_compat=args.published_compat, dtype=args.dtype, batch_size=args.batch_size
            ),
        )
    except (ModelLoadError, DataError) as err:
        print(f"tofu_llama: {err}", file=sys.stderr)
        return 2
    for name, result in results.items():
        summary = result.summary
        print(
            f"{name}: UDS={summary['uds']:.4f} CI95={summary['ci95']} scored={summary['n_scored']} "
            f"no_ke={summary['n_no_ke']} skipped={summary['n_skipped']} timings={summary['timings']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

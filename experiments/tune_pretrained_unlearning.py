"""How far each unlearning method moves a pretrained zoo's full model, epoch by epoch (how the smollm2 zoo's
unlearning settings were chosen).

Unlearns the built zoo's ``full`` model with one method and one setting for ``--epochs`` passes over the forget set
and prints, after every pass, the entity accuracy on forget, retain and holdout (teacher-forced, as the zoo's
manifest records it). The batches of the first ``k`` passes of a run are those of a ``k``-pass run (the sampler's
generator is drawn in the same order and the optimiser has no schedule), so one run gives the whole curve.

    python experiments/tune_pretrained_unlearning.py --method graddiff --lr 3e-4 --epochs 10
    python experiments/tune_pretrained_unlearning.py --method rmu --layer 19 --lr 1e-3 --alpha 30

Reads the zoo at ``--zoo`` (default: the cached smollm2 zoo; build it with ``uds-lens zoo build --size smollm2``);
writes nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from uds_lens.zoo.build import _load_model, _UnlearningSequences
from uds_lens.zoo.checks import evaluate
from uds_lens.zoo.recipe import SIZES
from uds_lens.zoo.training_data import load_data
from uds_lens.zoo.unlearn import unlearn, unlearning_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=Path.home() / ".cache/uds_lens/zoo-smollm2")
    parser.add_argument("--method", required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--alpha", type=float)
    parser.add_argument("--layer", type=int, help="RMU's target layer")
    parser.add_argument("--steering-coef-rel", type=float)
    parser.add_argument("--layers-below", type=int)
    args = parser.parse_args()

    manifest = json.loads((args.zoo / "manifest.json").read_text())
    size = SIZES[manifest["size"]]
    seed = int(manifest["seed"])
    hyperparams: dict[str, Any] = {**size.unlearning[args.method], "seed": seed + 2, "epochs": args.epochs}
    for key, value in (
        ("lr", args.lr),
        ("alpha", args.alpha),
        ("steering_coef_rel", args.steering_coef_rel),
        ("layers_below", args.layers_below),
    ):
        if value is not None:
            hyperparams[key] = value
    if args.method == "rmu":
        hyperparams["layer"] = hyperparams["target_layer"] = args.layer

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.zoo / "tokenizer")
    data = load_data(size, seed, None, None, None)
    sequences = _UnlearningSequences.encode(data, tokenizer, seed)
    model = _load_model(args.zoo / "models" / "full")
    steps_per_epoch = unlearning_steps(len(sequences.forget), {**hyperparams, "epochs": 1})
    print(json.dumps({"method": args.method, **hyperparams}), flush=True)
    state = {"step": 0, "start": time.perf_counter()}

    def on_step() -> None:
        state["step"] += 1
        if state["step"] % steps_per_epoch:
            return
        with torch.no_grad():
            metrics = evaluate(model, tokenizer, data)
        model.train()
        epoch = state["step"] // steps_per_epoch
        seconds = time.perf_counter() - state["start"]
        print(
            f"epoch {epoch:2d} step {state['step']:3d} ({seconds:5.0f} s): forget {metrics['forget_entity_exact']:.3f}"
            f" (token {metrics['forget_entity_token']:.3f})  retain {metrics['retain_entity_exact']:.3f}"
            f" (token {metrics['retain_entity_token']:.3f})  holdout {metrics['holdout_entity_token']:.3f}",
            flush=True,
        )

    torch.manual_seed(int(hyperparams["seed"]))
    unlearn(
        model,
        args.method,
        sequences.forget,
        sequences.retain,
        hyperparams,
        seed=int(hyperparams["seed"]),
        pad_id=tokenizer.pad_token_id,
        forget_idk=sequences.idk,
        on_step=on_step,
    )


if __name__ == "__main__":
    main()

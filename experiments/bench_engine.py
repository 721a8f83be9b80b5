"""Benchmark: the fast patch engine against the naive one (one full forward per layer), on random Llama models.

For each shape it builds a random full model and a perturbed source model, makes synthetic forget examples with the
published set's length statistics (prompt 25-70 tokens, entity lengths from its histogram), runs both engines on the same examples,
checks they agree, and prints per-stage seconds per example, the speed-up, the peak memory, and the ratio to the
floor (one source forward plus ~T*L^2/2 token-block evaluations of the target, T = window tokens).
The naive engine runs whole sequences (prompt + full reference), as the published implementation does;
`naive_cut` is the same oracle cut after the last read position, a cheaper baseline, reported alongside.

    python experiments/bench_engine.py                 # CPU: the 4-layer d64 and 16-layer d512 shapes
    python experiments/bench_engine.py --examples 367  # on a GPU also the Llama-3.2-1B shape, bf16

The last line is ``speedup_s2_vs_naive_l16=<x>``.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass

import psutil
import torch

from uds_lens.data import EncodedExample
from uds_lens.models import hooked_from_hf
from uds_lens.patching import (
    baseline_scores,
    choose_batch_size,
    clean_run,
    pad_batch,
    patched_scores,
    plan_batches,
    source_activations,
)


@dataclass
class Shape:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_mlp: int
    vocab: int


SHAPES = {
    "l4_d64": Shape("l4_d64", 4, 64, 4, 4, 256, 2048),
    "l16_d512": Shape("l16_d512", 16, 512, 8, 4, 2048, 2048),
    "llama32_1b": Shape("llama32_1b", 16, 2048, 32, 8, 8192, 128256),
}


def build_models(shape: Shape, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.d_model, intermediate_size=shape.d_mlp,
                         num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
                         num_key_value_heads=shape.n_kv_heads, max_position_embeddings=512, tie_word_embeddings=False,
                         attn_implementation="eager")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    full = hooked_from_hf(hf, dtype=dtype, device=device)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    source = hooked_from_hf(hf, dtype=dtype, device=device)
    del hf
    return full, source


# Entity lengths of the published annotated forget set (Llama-3 tokens -> count), PUBLISHED_IMPL.md §9.
ENTITY_LENGTHS = {1: 35, 2: 25, 3: 41, 4: 29, 5: 40, 6: 55, 7: 49, 8: 26, 9: 20, 10: 15, 11: 10, 12: 8, 14: 9, 18: 5}


def synthetic_examples(n: int, vocab: int, seed: int = 0) -> list[EncodedExample]:
    """Token layouts with the published set's shape: ~25-70 prompt tokens (BOS, template, question, prefix), entity
    lengths drawn from its histogram, entities mostly right after the prefix."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(list(ENTITY_LENGTHS))
    weights = torch.tensor(list(ENTITY_LENGTHS.values()), dtype=torch.float)
    examples = []
    for idx in range(n):
        prompt_len = int(torch.randint(25, 70, (1,), generator=generator))
        entity_len = int(lengths[torch.multinomial(weights, 1, generator=generator)])
        entity_start = int(torch.randint(0, 3, (1,), generator=generator))
        # TOFU answers go on after the entity (a clause, a full stop): 1-20 more tokens.
        ref_len = entity_start + entity_len + int(torch.randint(1, 21, (1,), generator=generator))
        ids = [1] + torch.randint(3, vocab, (prompt_len + ref_len - 1,), generator=generator).tolist()
        examples.append(EncodedExample(idx, None, tuple(ids), prompt_len, entity_start, entity_start + entity_len))
    return examples


class PeakMemory:
    """Peak resident (CPU) or allocated (CUDA) memory above the start, sampled every 5 ms."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            process = psutil.Process()
            self.start = process.memory_info().rss
            self.peak = self.start
            self.running = True

            def sample() -> None:
                while self.running:
                    self.peak = max(self.peak, process.memory_info().rss)
                    time.sleep(0.005)

            self.thread = threading.Thread(target=sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.start
        else:
            self.running = False
            self.thread.join()
            self.bytes = self.peak - self.start


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_stage2(full, source, examples, batch_size, engine, device, cleans=None, cut=None):
    """Seconds for Stage 2 (source forward + patched runs) with clean runs precomputed (they are S1's).

    ``cut=None`` runs each engine as the library does: the fast one on sequences cut after the last read
    position, the naive one on whole sequences (the published implementation's cost)."""
    cut = engine == "fast" if cut is None else cut
    layers = list(range(full.cfg.n_layers))
    plan = plan_batches(examples, "span", batch_size)
    padded = [pad_batch([examples[i] for i in members], 0, cut=cut).to(device) for members in plan]
    if cleans is None:
        cleans = [clean_run(full, b, "resid_post", keep_kv=engine == "fast") for b in padded]
    sync(device)
    started = time.perf_counter()
    outputs = []
    for batch, clean in zip(padded, cleans):
        acts = source_activations(source, batch.tokens, "resid_post", layers)
        outputs.append(patched_scores(full, batch, acts, "resid_post", layers, engine, clean))
    sync(device)
    by_example = {}
    for members, out in zip(plan, outputs):
        for row, index in enumerate(members):
            by_example[index] = out[row].float().cpu()
    return time.perf_counter() - started, by_example, cleans, padded


def run_stage1(full, source, examples, batch_size, engine, device):
    layers = list(range(full.cfg.n_layers))
    sync(device)
    started = time.perf_counter()
    padded = [pad_batch([examples[i] for i in members], 0, cut=engine == "fast").to(device)
              for members in plan_batches(examples, "span", batch_size)]
    cleans = []
    for batch in padded:
        clean = clean_run(full, batch, "resid_post", keep_kv=engine == "fast")
        baseline_scores(full, batch, clean, "resid_post", layers, engine)
        acts = source_activations(source, batch.tokens, "resid_post", layers)
        patched_scores(full, batch, acts, "resid_post", layers, engine, clean)
        cleans.append(clean)
    sync(device)
    return time.perf_counter() - started, cleans


def floor_seconds(full, source, examples, device) -> float:
    """One source forward of every example plus sum_i T_i * L(L-1)/2 token-block evaluations of the target."""
    padded = pad_batch(examples, 0).to(device)
    n_layers = full.cfg.n_layers
    with torch.no_grad():
        source(padded.tokens, return_type=None)  # warm-up
        sync(device)
        started = time.perf_counter()
        source(padded.tokens, return_type=None)
        sync(device)
        source_seconds = time.perf_counter() - started
        tokens = padded.tokens.numel()
        block_seconds = source_seconds / (tokens * n_layers)
    window_tokens = sum(len(ex.window("span")) for ex in examples)
    return source_seconds + window_tokens * n_layers * (n_layers - 1) / 2 * block_seconds


def bench(shape: Shape, n_examples: int, dtype: torch.dtype, device: str, naive_batches: list[int]) -> dict:
    full, source = build_models(shape, dtype, device)
    examples = synthetic_examples(n_examples, shape.vocab)
    fast_bs = choose_batch_size(full, examples, "span", "fast")
    # Naive at its best batch size (S2 only: that is the cost paid per unlearned model).
    naive_best = None
    for batch_size in naive_batches:
        seconds, outputs, _, _ = run_stage2(full, source, examples, batch_size, "naive", device)
        if naive_best is None or seconds < naive_best[0]:
            naive_best = (seconds, batch_size, outputs)
    naive_s2, naive_bs, naive_out = naive_best
    # The same oracle on sequences cut after the last read position (a cheaper naive engine than the published one).
    naive_cut_s2, _, _, _ = run_stage2(full, source, examples, naive_bs, "naive", device, cut=True)
    naive_s1, _ = run_stage1(full, source, examples, naive_bs, "naive", device)
    with PeakMemory(device) as naive_mem:
        run_stage2(full, source, examples, naive_bs, "naive", device)
    fast_s1, cleans = run_stage1(full, source, examples, fast_bs, "fast", device)
    with PeakMemory(device) as fast_mem:
        fast_s2, fast_out, _, _ = run_stage2(full, source, examples, fast_bs, "fast", device, cleans)
    # Agreement example by example (the two engines batch differently).
    max_diff = max(float((naive_out[i] - fast_out[i]).abs().max()) for i in range(n_examples))
    floor = floor_seconds(full, source, examples, device)
    return {
        "config": shape.name, "device": device, "dtype": str(dtype).replace("torch.", ""), "examples": n_examples,
        "naive_batch": naive_bs, "fast_batch": fast_bs,
        "naive_s1_per_ex": naive_s1 / n_examples, "fast_s1_per_ex": fast_s1 / n_examples,
        "naive_s2_per_ex": naive_s2 / n_examples, "fast_s2_per_ex": fast_s2 / n_examples,
        "naive_cut_s2_per_ex": naive_cut_s2 / n_examples,
        "speedup_s1": naive_s1 / fast_s1, "speedup_s2": naive_s2 / fast_s2,
        "speedup_s2_vs_naive_cut": naive_cut_s2 / fast_s2,
        "fast_s2_over_floor": fast_s2 / floor, "max_abs_diff": max_diff,
        "naive_peak_mb": naive_mem.bytes / 2**20, "fast_peak_mb": fast_mem.bytes / 2**20,
        "fast_s2_total_s": fast_s2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--configs", nargs="*", default=None, help=f"subset of {sorted(SHAPES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--naive-batches", type=int, nargs="*", default=[1, 4, 20])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = args.configs or (["l4_d64", "l16_d512", "llama32_1b"] if device == "cuda" else ["l4_d64", "l16_d512"])
    results = {}
    for name in configs:
        dtype = torch.bfloat16 if (device == "cuda" and name == "llama32_1b") else torch.float32
        row = bench(SHAPES[name], args.examples, dtype, device, args.naive_batches)
        results[name] = row
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if dtype == torch.float32 and row["max_abs_diff"] > 1e-5:
            raise SystemExit(f"{name}: engines disagree by {row['max_abs_diff']:.2e} (> 1e-5 in fp32)")
    if "l16_d512" in results:
        print(f"speedup_s2_vs_naive_l16={results['l16_d512']['speedup_s2']:.2f}")


if __name__ == "__main__":
    main()

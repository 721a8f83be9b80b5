"""Host memory of loading a MUSE-shaped checkpoint through the door: fp32 weights in six safetensors shards named by
an index (as ``muse-bench/MUSE-News_target`` holds Llama-2-7B, ~27 GB), loaded in bf16 (as on a GPU, ~13.5 GB).

It writes a random Llama checkpoint of ``--shape`` in that layout (tensor by tensor, never a whole model in memory),
then, in a fresh process, loads it as ``uds-lens`` does (``load_hf_model(folder, dtype="bfloat16", device="cpu")``:
``Checkpoint.resolve``, the one pass that reads and hashes the shards, the family's class built from that state dict)
and prints, from the kernel's high-water mark (``VmHWM``):

    shape | fp32 files (GB) | bf16 model (GB) | peak RSS while loading (GB) | peak / fp32 files | peak / bf16 model

(the peak counted from the process's resident memory before the load, after its imports). A peak near fp32 + bf16 says the door holds every shard in memory while the bf16 model is built (the case for MUSE:
about 27 + 13.5 GB of host memory for one 7B model); near bf16 plus one shard, that it converts shard by shard.

    python experiments/muse_shards.py                     # ~0.7 GB of fp32 weights: seconds, ~1.5 GB of memory
    python experiments/muse_shards.py --shape llama2_7b   # the real size: ~27 GB on disk and ~40 GB of memory
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    # n_layers, d_model, d_mlp, n_heads, vocab
    "small": (8, 1024, 2816, 16, 32000),
    "llama2_7b": (32, 4096, 11008, 32, 32000),
}
N_SHARDS = 6


def tensors(shape: tuple[int, int, int, int, int]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint of the shape: its Hugging Face name and size."""
    n_layers, d_model, d_mlp, _, vocab = shape
    names = [("model.embed_tokens.weight", (vocab, d_model)), ("model.norm.weight", (d_model,))]
    names.append(("lm_head.weight", (vocab, d_model)))
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}."
        names += [(f"{prefix}self_attn.{p}_proj.weight", (d_model, d_model)) for p in "qkvo"]
        names += [(f"{prefix}mlp.{p}_proj.weight", (d_mlp, d_model)) for p in ("gate", "up")]
        names += [(f"{prefix}mlp.down_proj.weight", (d_model, d_mlp))]
        names += [
            (f"{prefix}{norm}.weight", (d_model,)) for norm in ("input_layernorm", "post_attention_layernorm")
        ]
    return names


def write_checkpoint(folder: Path, shape: tuple[int, int, int, int, int]) -> int:
    """A random fp32 checkpoint in six shards and its index; returns the bytes of the shards."""
    n_layers, d_model, d_mlp, n_heads, vocab = shape
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d_model,
        "intermediate_size": d_mlp, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": n_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False,
    }  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = tensors(shape)
    weight_map, total = {}, 0
    for k in range(N_SHARDS):
        shard = f"model-{k + 1:05d}-of-{N_SHARDS:05d}.safetensors"
        part = {name: torch.randn(size) * 0.02 for name, size in names[k::N_SHARDS]}
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
        total += sum(t.numel() * 4 for t in part.values())
        del part
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def load_and_measure(folder: str) -> None:
    """In this (fresh) process: load through the door in bf16 and print the peak RSS and the model's bytes."""
    from transformers import LlamaForCausalLM  # noqa: F401 - imported before the baseline is read

    from uds_lens.checkpoints.loader import load_hf_model

    def status(field: str) -> int:
        line = next(
            row for row in Path("/proc/self/status").read_text().splitlines() if row.startswith(field)
        )
        return int(line.split()[1]) * 1024

    before = status("VmRSS")
    model = load_hf_model(folder, dtype="bfloat16", device="cpu")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak_bytes": status("VmHWM") - before, "model_bytes": model_bytes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child process's folder
    args = parser.parse_args()
    if args.measure:
        load_and_measure(args.measure)
        return
    work = Path(tempfile.mkdtemp(prefix="muse_shards_"))
    try:
        file_bytes = write_checkpoint(work / "target", SHAPES[args.shape])
        env = dict(os.environ, UDS_LENS_CACHE=str(work / "cache"))
        done = subprocess.run(
            [sys.executable, __file__, "--measure", str(work / "target")],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        peak, model = measured["peak_bytes"], measured["model_bytes"]
        gb = 1e9
        print(
            f"{args.shape} | fp32 files {file_bytes / gb:.2f} GB | bf16 model {model / gb:.2f} GB | peak RSS while "
            f"loading {peak / gb:.2f} GB | peak / fp32 files {peak / file_bytes:.2f} | peak / bf16 model "
            f"{peak / model:.2f} | peak / (fp32 files + bf16 model) {peak / (file_bytes + model):.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Tiny full/retain/other models and encoded examples for the diagnostics tests.

Random tiny Llamas with a larger initialiser range than Hugging Face's default, so their lens log-probs and
representations differ by O(1) between seeds (random models at std 0.02 are all near-uniform and give no KE layer).
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from helpers.tiny import make_records, make_tiny_tokenizer, tiny_config
from uds_lens.data import EncodedExample, Example, encode
from uds_lens.models import load_model

N_LAYERS = 3
HIDDEN = 32


def make_llama_dir(out_dir: Path, tokenizer: Any, seed: int, init_range: float = 0.25) -> Path:
    """Save a random tiny Llama (``init_range`` weight std) and the tokenizer to ``out_dir``."""
    torch.manual_seed(seed)
    config = tiny_config(len(tokenizer), hidden_size=HIDDEN, n_layers=N_LAYERS)
    config.initializer_range = init_range
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@dataclass
class Trio:
    """Paths and loaded models of a tiny full / retain / third model, and the encoded forget set."""

    tokenizer: Any
    records: list[dict]
    examples: list[Example]
    encoded: list[EncodedExample]
    paths: dict[str, Path]
    models: dict[str, Any]


def make_trio(root: Path, n_records: int = 10) -> Trio:
    """Random tiny ``full`` (seed 0), ``retain`` (seed 1) and ``other`` (seed 2) models on one tokenizer."""
    tokenizer = make_tiny_tokenizer()
    records = make_records(n_records, seed=0)
    for i, record in enumerate(records):
        record["prompt_type"] = "genre" if i % 2 == 0 else "origin"
    paths = {
        name: make_llama_dir(root / name, tokenizer, seed)
        for seed, name in enumerate(["full", "retain", "other"])
    }
    models = {name: load_model(path, dtype=torch.float32, device="cpu") for name, path in paths.items()}
    examples = [Example.from_record(record, i) for i, record in enumerate(records)]
    encoded, skipped = encode(examples, tokenizer)
    if skipped:
        raise AssertionError(f"test records should all encode: {skipped}")
    return Trio(tokenizer, records, examples, encoded, paths, models)


@functools.lru_cache(maxsize=1)
def shared_trio() -> Trio:
    """One trio per test process (built in a temporary directory, about a second)."""
    return make_trio(Path(tempfile.mkdtemp(prefix="uds_diag_")), n_records=6)


@functools.lru_cache(maxsize=1)
def shared_hidden() -> dict[str, Any]:
    """Hidden states of the shared trio's three models."""
    from uds_lens.baselines.hidden import collect_hidden_states

    trio = shared_trio()
    return {
        name: collect_hidden_states(model, trio.encoded, batch_size=3) for name, model in trio.models.items()
    }

"""The engine benchmark stays runnable and its agreement check is real (a tiny shape, a few examples)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

from bench_engine import Shape, bench, floor_seconds, synthetic_examples  # noqa: E402


def test_bench_runs_and_engines_agree():
    row = bench(Shape("tiny", 3, 32, 4, 2, 64, 300), 6, torch.float32, "cpu", naive_batches=[2])
    assert row["max_abs_diff"] < 1e-5
    assert row["fast_s2_per_ex"] > 0 and row["naive_s2_per_ex"] > 0 and row["fast_s2_over_floor"] > 0


def test_synthetic_examples_are_valid():
    for example in synthetic_examples(30, 300):
        assert 0 <= example.entity_start < example.entity_end <= len(example.input_ids) - example.prompt_len
        assert example.read_positions.stop < len(example.input_ids)
        assert len(example.labels) == example.n_entity_tokens
    assert callable(floor_seconds)

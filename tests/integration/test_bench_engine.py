"""The engine benchmark stays runnable, its agreement check is real and its floor counts what the issue counts."""

import torch
from bench_engine import Counts, Shape, bench, floors, synthetic_examples


def test_bench_runs_and_engines_agree():
    row = bench(Shape("tiny", 3, 32, 4, 2, 64, 300), 6, torch.float32, "cpu", naive_batches=[2], repeats=1)
    assert row["max_abs_diff"] < 1e-5
    assert row["fast_s2_per_ex"] > 0 and row["naive_s2_per_ex"] > 0
    assert row["fast_s2_over_floor"] > 0 and row["fast_s1_over_floor"] > 0
    # The published code runs whole sequences L+1 times: far more work than the floor.
    assert row["published_work_over_floor"] > 1


def test_synthetic_examples_have_tofu_like_lengths():
    examples = synthetic_examples(50, 300)
    for example in examples:
        assert 25 <= example.prompt_len <= 40 and 2 <= example.n_entity_tokens <= 8
        assert example.read_positions.stop < len(example.input_ids)  # the answer goes on after the entity
        assert len(example.labels) == example.n_entity_tokens


def test_floor_counts_tokens_as_the_issue_does():
    counts = Counts(source=100, cut=100, whole=150, window=10, read=10)
    floor = floors(counts, n_layers=4, block=1.0, read=0.0)
    assert floor["floor_s2_blocks"] == 100 * 4 + 10 * (3 + 2 + 1)
    assert floor["published_s2_blocks"] == 5 * 4 * 150
    assert floor["floor_s1"] == 100 * 4 * 2 + 2 * 10 * 6
    assert floors(counts, 4, block=0.0, read=1.0)["floor_s2"] == 10 * 4

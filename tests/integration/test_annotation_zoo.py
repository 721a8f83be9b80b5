"""Automatic spans on the trained test zoo agree with the spans its generator wrote (the benchmark's figures are
printed by experiments/bench_annotate.py; this holds the floor)."""

from __future__ import annotations

import pytest

from uds_lens import data
from uds_lens.annotation import annotate
from uds_lens.checkpoints.loader import load_tokenizer


@pytest.mark.slow
def test_contrastive_spans_match_the_zoo_generator(test_zoo):
    gold = data.read_records(test_zoo.forget_path)
    raw = [{k: v for k, v in r.items() if k not in ("prefix", "entity")} for r in gold]
    result = annotate(
        raw, str(test_zoo.path("full")), str(test_zoo.path("retain")), dtype="float32", device="cpu"
    )
    split = [(g, a) for g, a in zip(gold, result.records, strict=True) if a["annotation_status"] != "unsplit"]
    assert len(split) >= 0.9 * len(gold)
    exact = sum(a["prefix"] == g["prefix"] and a["entity"] == g["entity"] for g, a in split)
    assert exact >= 0.9 * len(split), [
        (g["entity"], a["entity"]) for g, a in split if a["entity"] != g["entity"]
    ]
    encoded, skipped = data.encode(
        data.load_examples(result.records), load_tokenizer(test_zoo.tokenizer_path)
    )
    assert len(encoded) == len(split) and all(s.reason == data.SKIP_EMPTY_ENTITY for s in skipped)

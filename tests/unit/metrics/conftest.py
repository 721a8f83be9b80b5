"""A tiny random checkpoint and a copy of it that memorised a forget set, shared by the metric tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.tiny import make_records, make_tiny_llama, make_tiny_tokenizer, train_on_records
from transformers import PreTrainedTokenizerFast


@dataclass(frozen=True)
class Memorised:
    tokenizer: PreTrainedTokenizerFast
    base: Path
    trained: Path  # the base fine-tuned on ``forget``
    forget: list[dict]
    holdout: list[dict]
    retain: list[dict]


@pytest.fixture(scope="session")
def memorised(tmp_path_factory) -> Memorised:
    tmp = tmp_path_factory.mktemp("memorised")
    tokenizer = make_tiny_tokenizer()
    base = make_tiny_llama(tmp / "base", tokenizer=tokenizer)
    forget = make_records(12, seed=11)
    holdout = make_records(12, seed=12, offset=100)
    retain = make_records(4, seed=43, offset=200)
    trained = train_on_records(base, forget, tmp / "trained", steps=80)
    return Memorised(tokenizer, base, trained, forget, holdout, retain)

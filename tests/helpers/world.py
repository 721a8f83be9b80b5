"""The zoo's tests' small world: ten synthetic authors and a tokenizer trained on their question/answer texts."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast

from uds_lens.zoo.tokenizer import format_prompt, format_target, train_tokenizer
from uds_lens.zoo.world import World, generate_world


def small_world(extra_texts: Sequence[str] = ()) -> tuple[World, PreTrainedTokenizerFast]:
    """A world of ten authors (seed 0) and a 400-token tokenizer trained on every record's prompt and target, plus
    ``extra_texts`` (the unlearning tests add the refusal answers)."""
    world = generate_world(10, seed=0)
    texts = [format_prompt(r["question"]) + format_target(r["answer"]) for r in world.retain + world.forget]
    return world, train_tokenizer(texts + list(extra_texts), vocab_size=400)

"""uds_lens/metrics/chat.py: chat-formatted prompts, answer-only labels, EOS, the no-template fallback."""

from __future__ import annotations

import pytest
from helpers.tiny import make_tiny_tokenizer

from uds_lens.metrics.chat import (
    JAILBREAK_PREFIX,
    SYSTEM_PROMPT,
    collate,
    encode_pairs,
    encode_qa,
    pad_id_of,
    prompt_ids,
)
from uds_lens.readout import IGNORE_INDEX

QUESTION = "What genre does Amara Okafor write?"
ANSWER = "Amara Okafor is known for writing mystery novels."


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def test_labels_cover_exactly_the_answer_and_eos(tokenizer) -> None:
    item = encode_qa(tokenizer, QUESTION, ANSWER)
    n_prompt = len(item.prompt_ids)
    assert item.input_ids[:n_prompt] == item.prompt_ids
    assert all(label == IGNORE_INDEX for label in item.labels[:n_prompt])
    answer_labels = item.labels[n_prompt:]
    assert IGNORE_INDEX not in answer_labels
    assert answer_labels[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(list(answer_labels), skip_special_tokens=True).strip() == ANSWER


def test_prompt_has_system_turn_and_generation_header(tokenizer) -> None:
    text = tokenizer.decode(prompt_ids(tokenizer, QUESTION))
    assert SYSTEM_PROMPT in text and QUESTION in text
    assert text.startswith(tokenizer.bos_token) and text.count(tokenizer.bos_token) == 1
    assert text.rstrip().endswith("assistant")
    no_system = tokenizer.decode(prompt_ids(tokenizer, QUESTION, system_prompt=None))
    assert SYSTEM_PROMPT not in no_system


def test_jailbreak_prefix_is_appended_after_the_template(tokenizer) -> None:
    plain = prompt_ids(tokenizer, QUESTION)
    jailbreak = prompt_ids(tokenizer, QUESTION, assistant_prefix=JAILBREAK_PREFIX)
    assert jailbreak[: len(plain)] == plain
    assert tokenizer.decode(jailbreak[len(plain) :]) == JAILBREAK_PREFIX


def test_fallback_without_chat_template_is_question_then_answer_eos() -> None:
    tokenizer = make_tiny_tokenizer(chat_template=False)
    item = encode_qa(tokenizer, QUESTION, ANSWER)
    assert list(item.prompt_ids) == tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    assert list(item.input_ids) == list(item.prompt_ids) + answer_ids + [tokenizer.eos_token_id]


def test_batch_is_right_padded_with_ignored_labels(tokenizer) -> None:
    batch = collate(encode_pairs(tokenizer, [(QUESTION, ANSWER), ("Q?", "A.")]), pad_id_of(tokenizer))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    short = batch["attention_mask"][1]
    assert short[0] == 1 and short[-1] == 0
    assert (batch["labels"][1][short == 0] == IGNORE_INDEX).all()

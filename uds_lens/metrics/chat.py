"""Chat-formatted question/answer encoding with answer-only labels, as Open-Unlearning's TOFU evaluation builds it.

Every output-level metric scores an *answer* given a *question* wrapped in the model's chat template:

    [system: "You are a helpful assistant."] [user: question] [assistant: answer] (+ EOS if the template omits it)

The prompt is the same conversation without the assistant turn, rendered with ``add_generation_prompt=True``; its
tokens get label ``-100`` so the loss covers the answer tokens (and the closing EOS) only. Templates that accept a
``date_string`` (Llama-3) get "10 Apr 2025", the date the published meta-evaluation used. Sequences are cut at
``max_length`` (512).

Without a chat template the published code falls back to ``question`` tokenised with ``add_special_tokens=False``,
followed by the answer tokens and EOS; we do the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from uds_lens.data import as_list, record_field
from uds_lens.readout import IGNORE_INDEX

SYSTEM_PROMPT = "You are a helpful assistant."
DATE_STRING = "10 Apr 2025"
JAILBREAK_PREFIX = "Sure, here is the answer:"
MAX_LENGTH = 512


@dataclass(frozen=True)
class EncodedQA:
    """One chat-formatted question/answer pair.

    Attributes:
        input_ids: prompt tokens followed by answer tokens (and EOS).
        labels: ``-100`` on the prompt, the token id on answer positions.
        prompt_ids: the prompt alone (what generation starts from).
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    prompt_ids: tuple[int, ...]


def qa_pairs(records: Iterable[Any], answer_field: str = "answer") -> list[tuple[str, str]]:
    """``(question, answer)`` pairs of ``records`` for one answer field (the first entry if it is a list)."""
    pairs = []
    for record in records:
        answers = as_list(record_field(record, answer_field))
        if not answers:
            raise ValueError(f"record idx={record_field(record, 'idx')} has no {answer_field!r}")
        pairs.append((str(record_field(record, "question")), answers[0]))
    return pairs


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, date_string=DATE_STRING
    )
    # The rendered template already carries BOS; tokenising it with special tokens would add a second one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(
    tokenizer: Any,
    question: str,
    system_prompt: str | None = SYSTEM_PROMPT,
    assistant_prefix: str | None = None,
) -> list[int]:
    """Token ids of the templated prompt that generation starts from.

    Args:
        tokenizer: a Hugging Face tokenizer.
        question: the user turn.
        system_prompt: the system turn; ``None`` or "" for none.
        assistant_prefix: text whose tokens (no special tokens) are appended after the prompt, e.g. the jailbreak
            prefix "Sure, here is the answer:".
    """
    if has_chat_template(tokenizer):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": question}
        ]
        ids = _render(tokenizer, messages, add_generation_prompt=True)
    else:
        ids = list(tokenizer(question, add_special_tokens=False)["input_ids"])
    if assistant_prefix:
        ids += list(tokenizer(assistant_prefix, add_special_tokens=False)["input_ids"])
    return ids


def encode_qa(
    tokenizer: Any,
    question: str,
    answer: str,
    system_prompt: str | None = SYSTEM_PROMPT,
    max_length: int = MAX_LENGTH,
) -> EncodedQA:
    """Encode one question/answer pair with answer-only labels.

    The full conversation is rendered once and the prompt (rendered with the generation prompt) is a prefix of it,
    so the labels start right after the assistant header. EOS is appended if the template did not end with it.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; set tokenizer.eos_token before evaluating")
    prompt = prompt_ids(tokenizer, question, system_prompt)
    if has_chat_template(tokenizer):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        full = _render(tokenizer, messages, add_generation_prompt=False)
        if full[: len(prompt)] != prompt:
            raise ValueError(
                "the chat template renders the prompt differently with and without the assistant turn; "
                f"cannot locate the answer tokens for question {question[:60]!r}"
            )
    else:
        full = prompt + list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if full[-1] != eos:
        full.append(eos)
    full = full[:max_length]
    labels = [IGNORE_INDEX] * len(prompt) + full[len(prompt) :]
    return EncodedQA(tuple(full), tuple(labels[: len(full)]), tuple(prompt))


def encode_pairs(
    tokenizer: Any, pairs: Sequence[tuple[str, str]], system_prompt: str | None = SYSTEM_PROMPT
) -> list[EncodedQA]:
    return [encode_qa(tokenizer, q, a, system_prompt) for q, a in pairs]


def collate(encoded: Sequence[EncodedQA], pad_id: int) -> dict[str, Int[Tensor, "batch pos"]]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (pad labels are ``-100``)."""
    width = max(len(e.input_ids) for e in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pad_id_of(tokenizer: Any) -> int:
    """The pad id, falling back to EOS (Llama-3 tokenizers ship without a pad token)."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)

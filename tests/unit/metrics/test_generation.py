"""uds_lens/metrics/generation.py: ROUGE-L recall, left-padded batched greedy generation, EOS cut."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import make_records, make_tiny_llama, make_tiny_tokenizer

from uds_lens.metrics.chat import prompt_ids
from uds_lens.metrics.generation import (
    generate_greedy,
    paraphrase_rouge_scores,
    rouge_l_recall,
)


def test_rouge_l_is_recall_with_stemming() -> None:
    assert rouge_l_recall("the cat", "the cat sat down") == pytest.approx(0.5)
    assert rouge_l_recall("the cat sat down on a mat", "the cat") == pytest.approx(1.0)
    assert rouge_l_recall("she was running", "she runs") == pytest.approx(1.0)  # Porter stemmer
    assert paraphrase_rouge_scores(["a b"], [["a b", "c d"]]) == [pytest.approx(0.5)]
    assert paraphrase_rouge_scores(["a b"], [[]]) == [None]


class _ScriptedModel(torch.nn.Module):
    """Generates a fixed continuation: two words, EOS, then junk."""

    def __init__(self, continuation: list[int]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.continuation = continuation
        self.generation_config = None

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        tail = torch.tensor(self.continuation[:max_new_tokens]).repeat(input_ids.shape[0], 1)
        return torch.cat([input_ids, tail], dim=1)


def test_generation_is_cut_at_the_first_eos() -> None:
    tokenizer = make_tiny_tokenizer()
    words = tokenizer("mystery novels", add_special_tokens=False)["input_ids"]
    junk = tokenizer(" horror", add_special_tokens=False)["input_ids"]
    model = _ScriptedModel(words + [tokenizer.eos_token_id] + junk)
    texts = generate_greedy(model, tokenizer, [[0, 5, 6], [0, 7]], batch_size=2)
    assert texts == ["mystery novels", "mystery novels"]


def test_left_padding_gives_batch_size_independent_generations(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = make_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "m", tokenizer=tokenizer)).eval()
    questions = [r["question"] for r in make_records(4, seed=5)] + ["Hi?"]
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    assert len({len(p) for p in prompts}) > 1
    single = generate_greedy(model, tokenizer, prompts, batch_size=1, max_new_tokens=6)
    batched = generate_greedy(model, tokenizer, prompts, batch_size=5, max_new_tokens=6)
    assert single == batched


def test_generation_reuses_keys_and_values_even_when_the_checkpoint_says_not_to(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = make_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "m", tokenizer=tokenizer)).eval()
    model.generation_config.use_cache = False  # as a checkpoint saved from a training loop often says
    model.generation_config.eos_token_id = None
    widths: list[int] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    prompt = prompt_ids(tokenizer, "Where was Ana born?")
    cached = generate_greedy(model, tokenizer, [prompt], batch_size=1, max_new_tokens=8)
    assert widths[0] == len(prompt) and set(widths[1:]) == {1}  # one new token per step after the prompt
    # and the greedy text is what full re-runs give
    full = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=8,
        do_sample=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    cut = full[0, len(prompt) :].tolist()
    cut = cut[: cut.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in cut else cut
    assert cached == [tokenizer.decode(cut, skip_special_tokens=True).strip()]

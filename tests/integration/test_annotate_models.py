"""annotate reads every record with each model's own tokenizer, or refuses (issue 36), on the tiny checkpoints: a
retain model of another vocabulary (or a smaller one) is refused instead of being fed the full model's ids, and a
record longer than a model's context is cut to it. Each test failed on the code before the issue."""

from __future__ import annotations

import pytest
from helpers.edits import copy_checkpoint, raw_records, swap_two_tokens
from helpers.tiny import make_tiny_llama, make_tiny_tokenizer
from transformers import AutoTokenizer

from uds_lens import annotation
from uds_lens.annotation import annotate
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ModelMismatchError


def test_annotate_refuses_a_retain_model_of_another_tokenizer(tiny, tmp_path):
    """Before: the full model's ids were fed to the retain model (wrong spans, or an IndexError)."""
    other = swap_two_tokens(copy_checkpoint(tiny.retain, tmp_path / "other_tokenizer"))
    smaller = tmp_path / "smaller"
    make_tiny_tokenizer(chat_template=False, vocab_size=300).save_pretrained(smaller / "tokenizer")
    small_vocabulary = make_tiny_llama(smaller / "model", smaller / "tokenizer", 5, **tiny.RECIPE)
    data = raw_records(tmp_path / "raw.json")
    for retain in (other, small_vocabulary):
        with pytest.raises(ModelMismatchError, match="another tokenizer"):
            annotate(data, tiny.full, retain, device="cpu")


def test_annotate_cuts_a_long_record_to_the_models_context(tiny, tmp_path, monkeypatch):
    """Before: a 2,000-word answer was run whole (and a batch padded to it), past the model's context."""
    n_ctx = Checkpoint.resolve(tiny.retain).config.max_position_embeddings
    long_answer = " ".join(["Hsiao was born in Paris and wrote many books about the river."] * 200)
    records = [{"idx": 0, "question": "Where was Hsiao born?", "answer": long_answer}]
    widths = []
    original = annotation._answer_token_logprobs

    def spy(model, sequences, pad_id, batch_size):
        widths.extend(len(ids) for ids, _ in sequences)
        return original(model, sequences, pad_id, batch_size)

    monkeypatch.setattr(annotation, "_answer_token_logprobs", spy)
    result = annotate(records, None, tiny.retain, device="cpu")
    assert widths and max(widths) <= n_ctx
    assert len(AutoTokenizer.from_pretrained(tiny.retain)(long_answer)["input_ids"]) > n_ctx  # not vacuous
    assert result.records[0]["annotation_status"] in annotation.STATUSES

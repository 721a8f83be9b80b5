"""uds_lens/baselines/lenses.py: the logit and tuned lens, scored in UDS's shape."""

from __future__ import annotations

import pytest
import torch

from uds_lens.baselines.lenses import (
    TunedLens,
    calibration_token_ids,
    entity_logprobs,
    final_decoder,
    logit_lens,
    train_tuned_lens,
)


def test_last_layer_lens_is_the_models_own_entity_logprob(trio, trio_hidden):
    model = trio.models["full"]
    k = entity_logprobs(trio_hidden["full"], final_decoder(model))
    for row, example in enumerate(trio.encoded):
        logits = model(torch.tensor([example.input_ids]), return_type="logits")[0]
        logprobs = torch.log_softmax(logits[list(example.read_positions)].float(), dim=-1)
        own = logprobs.gather(1, torch.tensor(example.labels)[:, None]).mean()
        assert k[row, -1].item() == pytest.approx(own.item(), abs=1e-4)


def test_logit_lens_endpoints_and_table_shape(trio, trio_hidden):
    hidden = trio_hidden
    decoder = final_decoder(trio.models["full"])
    as_full = logit_lens(hidden["full"], hidden["retain"], hidden["full"], decoder)
    as_retain = logit_lens(hidden["full"], hidden["retain"], hidden["retain"], decoder)
    assert (as_full.examples["status"] == "scored").sum() >= 2
    assert as_full.score <= 0.02
    assert as_retain.score >= 0.98
    layers = as_full.layers
    assert list(layers.columns) == [
        "idx",
        "layer",
        "baseline_score",
        "s1_score",
        "s2_score",
        "d1",
        "d2",
        "ke",
        "ler",
    ]
    assert layers.loc[~layers["ke"], "ler"].isna().all()
    assert len(layers) == len(trio.encoded) * 3
    torch.testing.assert_close(
        torch.tensor(layers["d1"].to_numpy()),
        torch.tensor((layers["baseline_score"] - layers["s1_score"]).to_numpy()),
    )
    assert (layers["ke"] == (layers["d1"] > 0.05)).all()
    other = logit_lens(hidden["full"], hidden["retain"], hidden["other"], decoder)
    assert 0.0 <= other.score <= 1.0
    lw = other.layerwise()
    assert lw.erasure.min() >= 0 and lw.erasure.max() <= 1


def test_logit_lens_rejects_misaligned_states(trio, trio_hidden):
    hidden = trio_hidden
    decoder = final_decoder(trio.models["full"])
    shifted = type(hidden["retain"])(
        hidden["retain"].resid,
        hidden["retain"].example_idx + 1,
        hidden["retain"].position,
        hidden["retain"].label,
    )
    with pytest.raises(ValueError, match="other positions"):
        logit_lens(hidden["full"], shifted, hidden["full"], decoder)


def test_untrained_tuned_lens_is_the_logit_lens_and_trained_keeps_endpoints(trio, trio_hidden):
    hidden = trio_hidden
    decoder = final_decoder(trio.models["full"])
    identity = TunedLens(3, 32)
    plain = entity_logprobs(hidden["other"], decoder)
    torch.testing.assert_close(
        entity_logprobs(hidden["other"], decoder, identity), plain, atol=1e-5, rtol=1e-5
    )
    lens = train_tuned_lens(
        trio.models["full"], calibration_token_ids(trio.examples, trio.tokenizer), steps=5
    )
    torch.testing.assert_close(lens.weight[-1], torch.eye(32))
    assert not torch.equal(lens.weight[0], torch.eye(32))
    as_full = logit_lens(hidden["full"], hidden["retain"], hidden["full"], decoder, translator=lens)
    as_retain = logit_lens(hidden["full"], hidden["retain"], hidden["retain"], decoder, translator=lens)
    assert as_full.method == "tuned_lens"
    assert as_full.score <= 0.02 and as_retain.score >= 0.98


def test_tuned_lens_calibration_text_is_each_example_in_its_own_form():
    from dataclasses import replace

    from uds_lens.data import Example

    class Characters:  # a tokenizer that shows the text it was given: one id per character, BOS = 0
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [0, *map(ord, text)]}

    qa = Example(0, "Who wrote Dune?", "Frank Herbert wrote it.", "", "Frank Herbert")
    passage = replace(qa, question="The spice must flow", answer="across the desert.", form="completion")
    shot = replace(qa, context="Answer briefly.\n", shots=(("Q1?", "A1."),))
    texts = ["".join(map(chr, ids[1:])) for ids in calibration_token_ids([qa, passage, shot], Characters())]
    assert texts[0] == "Question: Who wrote Dune?\nAnswer: Frank Herbert wrote it."
    assert texts[1] == "The spice must flow across the desert."  # a MUSE passage, no QA template around it
    assert (
        texts[2]
        == "Answer briefly.\nQuestion: Q1?\nAnswer: A1.\n\nQuestion: Who wrote Dune?\nAnswer: Frank Herbert wrote it."
    )

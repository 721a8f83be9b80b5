"""Automatic prefix/entity spans: whole words on byte-level BPE and SentencePiece tokenizers, one contiguous span, the
marking of unsplittable records, the overwrite rules, and the CLI round trip into the scorer's reader."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.spans import hot_choice
from helpers.tiny import FORGET_SET, make_tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

from uds_lens import data
from uds_lens.annotation import (
    STATUS_AUTO,
    STATUS_KEPT,
    STATUS_LOW_CONFIDENCE,
    STATUS_UNSPLIT,
    AnnotateConfig,
    _layout,
    annotate,
    choose_span,
    content_scores,
    summary_path,
    unit_scores,
)
from uds_lens.cli import app
from uds_lens.phrases import answer_units

ANSWERS = [
    ("Where was Hsiao Yun-Hwa born?", "Hsiao Yun-Hwa was born in Zoundgrynvel, 1945."),
    ("What did Mara's father do?", "Mara's father worked as an electrician by trade."),
    ("Which book did Basil write?", "One of Basil's books is The Drowned Cathedral of Tatiath."),
]


def _sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: BPE over ``▁``-marked words (Metaspace), ``<s>`` prepended, trained offline on a
    few sentences so that rare names split into several pieces."""
    corpus = [text for pair in ANSWERS for text in pair] + [r["answer"] for r in FORGET_SET]
    corpus += ["Question: Answer: the was born in a an of by"] * 3
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module", params=["byte_level_bpe", "sentencepiece"])
def tokenizer(request):
    if request.param == "byte_level_bpe":
        return make_tiny_tokenizer(chat_template=False, vocab_size=300)
    return _sentencepiece_tokenizer()


def test_the_two_tokenizer_styles_are_what_they_claim(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(
        tokenizer(" Hsiao was born", add_special_tokens=False)["input_ids"]
    )
    marker = "Ġ" if isinstance(tokenizer.backend_tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel) else "▁"
    assert any(piece.startswith(marker) for piece in pieces), pieces


@pytest.mark.parametrize(("question", "answer"), ANSWERS)
def test_contrast_on_any_single_token_gives_a_whole_word_span_the_scorer_reads_back(
    tokenizer, question, answer
):
    """Every answer token in turn carries all the contrast (a sub-word piece of a name, the lone space before a
    digit, punctuation): the span is whole words, holds the word of that token (unless it is template), and the
    scorer's encoder reads exactly the tokens of those whole words."""
    ids, prompt_len, offsets = _layout(question, answer, tokenizer)
    units = answer_units(answer)
    n_tokens = len(ids) - prompt_len
    assert n_tokens == len(offsets)
    split_words = 0
    for hot in range(n_tokens):
        token_scores = np.zeros(n_tokens)
        token_scores[hot] = 5.0
        scores = content_scores(question, units, unit_scores(answer, units, offsets, token_scores))
        choice = choose_span(answer, units, scores, AnnotateConfig())
        if choice.status == STATUS_UNSPLIT:
            assert scores.max() < AnnotateConfig().min_contrast  # only a template word was hot
            continue
        start, end = choice.start, choice.end
        assert start in {u.start for u in units} and end in {u.end for u in units}
        assert answer[start].isalnum() and answer[end - 1].isalnum()
        lo, hi = offsets[hot]
        inside = [i for i in range(max(lo, 0), hi) if not answer[i].isspace()]
        if inside and inside[0] in range(start, end) and (inside[0] > lo or hi < end):
            split_words += 1
        example = data.Example(0, question, answer, answer[:start].rstrip(), answer[start:end])
        encoded = data.encode_one(example, tokenizer)
        assert isinstance(encoded, data.EncodedExample), encoded
        text = tokenizer.decode(
            encoded.input_ids[
                encoded.prompt_len + encoded.entity_start : encoded.prompt_len + encoded.entity_end
            ]
        )
        assert text.strip() == answer[start:end]
    assert split_words > 0  # some hot token was a piece inside a longer word


def test_a_space_only_token_counts_for_the_word_after_it():
    answer = "It ended in 1945."
    units = answer_units(answer)
    # a lone "Ġ"/"▁" token (the space before 1945), then the digits
    offsets = [(-1, 2), (2, 8), (8, 11), (11, 12), (12, 16), (16, 17)]
    scores = unit_scores(answer, units, offsets, np.array([0, 0, 0, 3.0, 1.0, 0]))
    assert [u.text for u in units] == ["It", "ended", "in", "1945", "."]
    assert scores.tolist() == [0, 0, 0, 4.0, 0]


@pytest.mark.parametrize(
    ("question", "answer", "hot", "entity"),
    [
        (
            "What did Mara's father do?",
            "Mara's father worked as an architect.",
            ["an", "architect"],
            "architect",
        ),
        (
            "Name a book by Basil.",
            "One of Basil's books is The Silent River.",
            ["Silent"],
            "The Silent River",
        ),
        ("Who shaped Basil?", "Basil was shaped by Mara Lin's work.", ["Mara"], "Mara Lin"),
        ("Which themes?", "Basil explores loss and memory.", ["loss"], "loss and memory"),
        ("Which genre?", "Basil writes literary fiction.", ["literary"], "literary fiction"),
        ("What was his mother?", "His mother was a nurse by trade.", ["nurse"], "nurse"),
        ("Where was Mara born?", "Mara was born in Paris.", ["Mara", "Paris"], "Paris"),
    ],
)
def test_the_span_is_snapped_to_the_entity_not_the_template(question, answer, hot, entity):
    units = answer_units(answer)
    scores = np.array([4.0 if unit.text in hot else 0.0 for unit in units])
    choice = choose_span(answer, units, content_scores(question, units, scores), AnnotateConfig())
    assert answer[choice.start : choice.end] == entity


def test_two_facts_of_equal_weight_give_one_span_marked_low_confidence():
    answer = "His father was a doctor and his mother a baker."
    units = answer_units(answer)
    scores = np.array([3.0 if unit.text in ("doctor", "baker") else 0.0 for unit in units])
    choice = choose_span(answer, units, scores, AnnotateConfig())
    assert answer[choice.start : choice.end] == "doctor"
    assert choice.status == "low_confidence" and choice.confidence == pytest.approx(0.5)


def _raw(records):
    return [{k: v for k, v in r.items() if k not in ("prefix", "entity")} for r in records]


def test_full_identical_to_retain_leaves_every_record_unsplit_and_the_scorer_skips_them(tiny, tmp_path):
    """Full == retain: no token has contrast, so nothing is guessed: every record is marked unsplit, counted, and
    written with entity "" that the scorer's reader accepts and skips as empty_entity."""
    out = tmp_path / "annotated.json"
    result = annotate(_raw(FORGET_SET), tiny.full, tiny.full, dtype="float32", device="cpu", out=out)
    assert result.summary["counts"][STATUS_UNSPLIT] == len(FORGET_SET)
    assert all(
        r["entity"] == "" and r["confidence"] == 0 and "no word" in r["reason"] for r in result.records
    )
    _, skipped = data.encode(data.load_examples(out), data_tokenizer(tiny))
    assert {s.reason for s in skipped} == {data.SKIP_EMPTY_ENTITY} and len(skipped) == len(FORGET_SET)
    assert json.loads(summary_path(out).read_text())["counts"][STATUS_UNSPLIT] == len(FORGET_SET)


def data_tokenizer(tiny):
    from uds_lens.checkpoints.loader import load_tokenizer

    return load_tokenizer(tiny.tokenizer)


def test_existing_annotations_are_kept_unless_overwrite():
    records = [dict(r) for r in FORGET_SET[:3]]
    records[1] = {**_raw([records[1]])[0]}  # this one needs annotating
    records[2]["gt_entity"] = records[2].pop("entity")  # a published-schema annotation counts too
    kept = annotate(records)
    assert kept.records[0] == {
        **records[0],
        "annotation_status": STATUS_KEPT,
        "reason": kept.records[0]["reason"],
    }
    assert kept.records[2]["gt_entity"] == "Yes" and kept.records[2]["annotation_status"] == STATUS_KEPT
    assert kept.records[1]["annotation_status"] != STATUS_KEPT
    assert kept.summary["counts"][STATUS_KEPT] == 2
    redone = annotate(records, overwrite=True)
    assert all(r["annotation_status"] != STATUS_KEPT for r in redone.records)
    assert redone.records[0]["previous_annotation"] == {"prefix": "Hsiao was born in", "entity": "Paris"}
    assert "gt_entity" not in redone.records[2]  # it would win over the new entity in the scorer
    assert redone.records[2]["previous_annotation"]["gt_entity"] == "Yes"


def test_lexical_mode_without_models_finds_the_new_words():
    records = annotate(_raw(FORGET_SET)).records
    assert [r["entity"] for r in records[:2]] == ["Paris", "Hsiao Yun Hwa"]
    assert all(r["answer"].startswith(r["prefix"]) for r in records)
    assert all(r["reason"].startswith("lexical") for r in records)


def test_a_full_model_alone_is_refused():
    with pytest.raises(ValueError, match="retain"):
        annotate(_raw(FORGET_SET), full="some/model")


def test_a_record_without_an_answer_is_named():
    with pytest.raises(data.DataError, match="record 7 has no 'answer'"):
        annotate([{"idx": 7, "question": "Why?"}])


def test_cli_round_trip_into_the_scorer(tiny, tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text("\n".join(json.dumps(r) for r in _raw(FORGET_SET)))
    out = tmp_path / "annotated.json"
    argv = ["annotate", "--data", str(raw), "--out", str(out), "--full", str(tiny.full), "--retain", str(tiny.retain),
            "--dtype", "float32", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert f"{len(FORGET_SET)} records (contrast)" in result.output
    records = json.loads(out.read_text())
    assert all({"prefix", "entity", "confidence", "reason", "annotation_status"} <= set(r) for r in records)
    examples = data.load_examples(out)  # the scorer's reader takes the file as it is
    encoded, skipped = data.encode(examples, data_tokenizer(tiny))
    statuses = {r["idx"]: r["annotation_status"] for r in records}
    assert {s.idx for s in skipped} == {i for i, s in statuses.items() if s == STATUS_UNSPLIT}
    assert {e.idx for e in encoded} == {i for i, s in statuses.items() if s != STATUS_UNSPLIT}
    refused = CliRunner().invoke(
        app, ["annotate", "--data", str(raw), "--out", str(out), "--full", str(tiny.full)]
    )
    assert refused.exit_code != 0 and "--retain" in refused.output


def test_statuses_are_auto_when_the_contrast_is_clear():
    answer = "Mara was born in Paris."
    units = answer_units(answer)
    choice = choose_span(answer, units, np.array([0, 0, 0, 0, 6.0, 0.0]), AnnotateConfig())
    assert choice.status == STATUS_AUTO and choice.confidence == 1.0


def test_batching_and_right_padding_do_not_change_the_scores(tiny):
    """One forward per batch of right-padded records: the scores equal those of one record per forward."""
    from uds_lens.annotation import _model_scores

    records = _raw(FORGET_SET)
    tokenizer = data_tokenizer(tiny)
    scores = {
        size: _model_scores(
            records, tiny.full, tiny.retain, tokenizer, AnnotateConfig(batch_size=size), "float32", "cpu"
        )
        for size in (1, len(records))
    }
    for one, batched in zip(scores[1], scores[len(records)], strict=True):
        np.testing.assert_allclose(one, batched, atol=1e-4)
    assert max(np.abs(s).max() for s in scores[1]) > 0.1  # full and retain differ: the check is not vacuous


def test_a_possessive_inside_a_lowercase_phrase_stays_in_it():
    answer = "Mara writes children's literature."
    units = answer_units(answer)
    scores = np.array([5.0 if unit.text == "children" else 0.0 for unit in units])
    choice = choose_span(answer, units, content_scores("Which genre?", units, scores), AnnotateConfig())
    assert answer[choice.start : choice.end] == "children's literature"


@pytest.mark.parametrize(
    ("answer", "hot", "entity"),
    [
        # a quoted title is kept whole with its quotes; its own closing mark inside the quotes stays out with them
        ('Her best-known novels are "Glass Rivers" and "Iron Tides".', "Glass", '"Glass Rivers"'),
        ('Her most praised book is "Lanterns of Stone."', "Lanterns", "Lanterns of Stone"),
        # a name runs over its connectives, and a city over its country; not over a new determiner phrase
        ("He won the Silver Quill Award for Short Fiction in the mystery category.", "Quill",
         "Silver Quill Award for Short Fiction"),
        ("Ilse Varga was born in Porto, Portugal.", "Porto", "Porto, Portugal"),
        ("Ilse Varga writes in the Gothic Horror genre, mostly at night.", "Gothic", "Gothic Horror genre"),
        # a comma list of short items is one entity; after several-word items the final "and" item is left out
        ("Her novels explore grief, memory, and forgiveness in their towns.", "grief", "grief, memory, and forgiveness"),
        ("Critics praise his vivid settings, sharply drawn characters, and carefully layered plots of betrayal.",
         "vivid", "vivid settings, sharply drawn characters"),
        # a lowercase phrase runs over "of" and a preposition without a determiner, to a clause or a new phrase
        ("Her work draws on memories of coastal villages in her childhood.", "memories",
         "memories of coastal villages"),
        ("His curiosity came from experiments with homemade telescopes, which he built.", "experiments",
         "experiments with homemade telescopes"),
        ("His mother passed on a love of woodcraft inherited from her own father.", "love", "love of woodcraft"),
        # a short first half keeps its "and"; a long phrase ends before it
        ("His stories prize courage and loyalty above all.", "courage", "courage and loyalty"),
        ("His books show careful historical research and a wry humour.", "careful", "careful historical research"),
    ],
)  # fmt: skip
def test_phrase_boundaries_come_from_the_texts_structure(answer, hot, entity):
    """The contrast marks one word of the fact (its first, surprising token); the entity's extent is the phrase that
    word heads, read from punctuation, capitals and function words."""
    choice = hot_choice("Tell me about the author.", answer, {hot: 5.0})
    assert answer[choice.start : choice.end] == entity


def test_the_first_fact_is_the_entity_and_a_heavier_later_one_makes_it_a_guess():
    """TOFU answers restate the question, answer it, then add facts: the first strong phrase is the entity, and a
    later fact that outweighs it is reported in the status and the reason, never silently."""
    answer = "His father worked as a carpenter, and his mother was a celebrated opera singer."
    choice = hot_choice(
        "What did his father do?", answer, {"carpenter": 3.0, "celebrated": 4.0, "opera": 1.0}
    )
    assert answer[choice.start : choice.end] == "carpenter"
    assert choice.status == STATUS_LOW_CONFIDENCE and "a guess among 2 facts" in choice.reason
    assert choice.confidence == pytest.approx(3.0 / 8.0, abs=1e-4)
    lone = hot_choice("What did his father do?", answer, {"carpenter": 3.0, "celebrated": 1.0})
    assert answer[lone.start : lone.end] == "carpenter" and lone.status == STATUS_AUTO
    weak_first = hot_choice("What did his father do?", answer, {"carpenter": 0.5, "celebrated": 6.0})
    assert answer[weak_first.start : weak_first.end] == "celebrated opera singer"  # below answer_fraction


@pytest.mark.parametrize(
    ("question", "entity"),
    [
        ("Has her work been adapted into a film?", "Yes"),
        ("Can you name an adaptation of her work?", "Silver Road"),
    ],
)
def test_a_yes_no_question_takes_yes_but_a_request_takes_the_fact(question, entity):
    answer = "Yes, her novel became the film Silver Road in 2001."
    choice = hot_choice(question, answer, {"Silver": 4.0, "2001": 1.0})
    assert answer[choice.start : choice.end] == entity and choice.status == STATUS_AUTO

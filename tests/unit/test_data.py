import json
import re
from pathlib import Path

import pytest

from uds_lens.checkpoints.loader import load_tokenizer
from uds_lens.data import (
    SKIP_ENTITY_NOT_FOUND,
    SKIP_PREFIX_MISMATCH,
    DataError,
    Example,
    TokenizerError,
    build_prompt,
    encode,
    load_examples,
    read_records,
    zoo_data_path,
)


def ex(**kw):
    base = dict(
        idx=0,
        question="Where was Hsiao born?",
        answer="Hsiao was born in Paris.",
        prefix="Hsiao was born in",
        entity="Paris",
    )
    base.update(kw)
    return Example(**base)


def test_prompt_moves_trailing_space_to_reference():
    prompt, reference = build_prompt(ex(answer="Yes.", prefix="", entity="Yes"))
    assert prompt.endswith("Answer:") and reference == " Yes."
    prompt, reference = build_prompt(ex())
    assert prompt == "Question: Where was Hsiao born?\nAnswer: Hsiao was born in" and reference == " Paris."


def test_published_compat_keeps_the_space():
    prompt, reference = build_prompt(ex(answer="Yes.", prefix="", entity="Yes"), published_compat=True)
    assert prompt.endswith("Answer: ") and reference == "Yes."


def test_encoding_layout_predicts_entity_tokens(tiny):
    tok = load_tokenizer(tiny.tokenizer)
    encoded, skipped = encode([ex(), ex(idx=1, answer="Yes.", prefix="", entity="Yes")], tok)
    assert not skipped
    for e in encoded:
        prompt, reference = build_prompt(ex() if e.idx == 0 else ex(answer="Yes.", prefix="", entity="Yes"))
        assert list(e.input_ids[: e.prompt_len]) == tok(prompt)["input_ids"]
        assert e.input_ids[0] == tok.bos_token_id and e.input_ids.count(tok.bos_token_id) == 1
        entity_text = tok.decode(list(e.labels))
        assert ("Paris" if e.idx == 0 else "Yes") in entity_text
        # label at read position p is the token at p + 1
        for p, label in zip(e.read_positions, e.labels):
            assert e.input_ids[p + 1] == label


def test_skips_have_reasons(tiny):
    tok = load_tokenizer(tiny.tokenizer)
    encoded, skipped = encode([ex(entity="Berlin"), ex(idx=1, prefix="Someone else"), ex(idx=2)], tok)
    assert [e.idx for e in encoded] == [2]
    assert {(s.idx, s.reason) for s in skipped} == {(0, SKIP_ENTITY_NOT_FOUND), (1, SKIP_PREFIX_MISMATCH)}


def test_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(TokenizerError, match="use_fast"):
        encode([ex()], Slow())


def test_loading_json_list_and_jsonl(tmp_path):
    records = [ex(idx=i).to_record() for i in range(3)]
    (tmp_path / "a.json").write_text(json.dumps(records))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert load_examples(tmp_path / "a.json") == load_examples(tmp_path / "b.jsonl")
    assert len(load_examples(tmp_path / "a.json", limit=2)) == 2


def test_one_reader_for_every_record_file(tmp_path):
    records = [ex(idx=i).to_record() for i in range(2)]
    (tmp_path / "list.json").write_text(json.dumps(records))
    (tmp_path / "lines.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": records}))
    for name in ("list.json", "lines.jsonl", "wrapped.json"):
        assert read_records(tmp_path / name) == records, name
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "absent.json")
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(DataError, match="neither a JSON list nor JSON lines"):
        read_records(tmp_path / "broken.json")


def test_bad_data_errors(tmp_path):
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="empty"):
        load_examples(tmp_path / "empty.json")
    (tmp_path / "missing.json").write_text(json.dumps([{"idx": 7, "question": "q", "answer": "a"}]))
    with pytest.raises(DataError, match="record 7.*prefix"):
        load_examples(tmp_path / "missing.json")
    (tmp_path / "dup.json").write_text(json.dumps([ex().to_record(), ex().to_record()]))
    with pytest.raises(DataError, match="twice"):
        load_examples(tmp_path / "dup.json")


def test_hub_dataset_offline_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="local file"):
        load_examples("someone/not-a-local-dataset")


def test_entity_is_located_at_a_word_boundary(tiny, caplog):
    tok = load_tokenizer(tiny.tokenizer)
    example = ex(
        question="What is she part of?",
        answer="She is part of the art community.",
        prefix="She is",
        entity="art",
    )
    (encoded,), _ = encode([example], tok)
    assert tok.decode(list(encoded.labels)).strip() == "art"
    prompt, reference = build_prompt(example)
    # the labels start after " part of the": the whole word, not the inner match
    assert len(
        tok.decode(list(encoded.input_ids[encoded.prompt_len : encoded.prompt_len + encoded.entity_start]))
    ) >= reference.index(" art ")
    # compat keeps the published first-substring match, and says so
    with caplog.at_level("WARNING", logger="uds_lens.data"):
        (compat,), _ = encode([example], tok, published_compat=True)
    assert "part" in tok.decode(list(compat.labels)) or compat.entity_start < encoded.entity_start
    assert "inside another word" in caplog.text
    # an entity that only occurs inside another word is skipped with its own reason
    from uds_lens.data import SKIP_ENTITY_INSIDE_WORD

    _, (skip,) = encode([ex(answer="Hsiao was born in Parisville.", entity="Paris")], tok)
    assert skip.reason == SKIP_ENTITY_INSIDE_WORD


@pytest.mark.parametrize("idx", ["abc", 1.5, None, [1], True])
def test_non_integer_idx_is_a_one_line_error(tmp_path, idx):
    records = [dict(ex().to_record(), idx=0), dict(ex().to_record(), idx=idx)]
    (tmp_path / "bad.json").write_text(json.dumps(records))
    with pytest.raises(DataError, match="idx must be an integer") as error:
        load_examples(tmp_path / "bad.json")
    assert "\n" not in str(error.value)


def test_integer_like_idx_is_accepted(tmp_path):
    records = [dict(ex().to_record(), idx=3.0), dict(ex().to_record(), idx="4")]
    (tmp_path / "ok.json").write_text(json.dumps(records))
    assert [e.idx for e in load_examples(tmp_path / "ok.json")] == [3, 4]


def test_a_json_object_where_a_list_was_expected_says_so(tmp_path):
    (tmp_path / "obj.json").write_text(json.dumps({"0": ex().to_record(), "1": ex(idx=1).to_record()}))
    with pytest.raises(DataError, match="JSON object.*list of records"):
        load_examples(tmp_path / "obj.json")
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [ex().to_record()]}))
    assert len(load_examples(tmp_path / "wrapped.json")) == 1


def test_a_mistyped_local_data_path_fails_without_asking_the_hub(tmp_path, monkeypatch):
    import uds_lens.data as data

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked for a local path")

    monkeypatch.setattr(data, "_load_hub_dataset", no_hub)
    (tmp_path / "runs").mkdir()
    for mistyped in (str(tmp_path / "forget"), str(tmp_path / "runs" / "forgt"), "./no_such_dir/forget"):
        with pytest.raises(DataError, match="No data file"):
            load_examples(mistyped)


def test_a_raw_question_answer_set_is_pointed_at_annotate_and_a_schema_that_exists(tmp_path):
    """A forget set of plain question/answer records (no spans) names the command that adds them; every missing-field
    error names a file of the repository that documents the format, and that file has the section it names."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "raw.json").write_text(json.dumps([{"idx": 3, "question": "Who?", "answer": "Ann Lee."}]))
    with pytest.raises(DataError) as raw_error:
        load_examples(tmp_path / "raw.json")
    (tmp_path / "no_answer.json").write_text(
        json.dumps([{"idx": 4, "question": "Who?", "prefix": "", "entity": "A"}])
    )
    with pytest.raises(DataError) as other_error:
        load_examples(tmp_path / "no_answer.json")
    raw, other = str(raw_error.value), str(other_error.value)
    assert "record 3" in raw and "uds-lens annotate --data" in raw and "\n" not in raw
    assert "record 4" in other and "['answer']" in other and "annotate" not in other
    for message in (raw, other):
        assert "SPEC" not in message
        named = re.search(
            r"see README\.md, section '([^']+)'|format is in README\.md, section '([^']+)'", message
        )
        assert named, message
        section = named.group(1) or named.group(2)
        assert re.search(rf"^#+ {re.escape(section)}$", (root / "README.md").read_text(), flags=re.MULTILINE)


def _zoo_with_forget_set(root: Path, questions: list[str]) -> Path:
    (root / "data").mkdir(parents=True)
    records = [
        {"idx": i, "question": q, "answer": "Ann Lee wrote it.", "prefix": "", "entity": "Ann Lee"}
        for i, q in enumerate(questions)
    ]
    (root / "data" / "forget.json").write_text(json.dumps(records))
    (root / "manifest.json").write_text(json.dumps({"size": "test", "data": {"forget": "data/forget.json"}}))
    return root


def test_a_zoo_forget_set_is_named_like_its_models(tmp_path, monkeypatch):
    """``zoo:forget`` is looked up where ``zoo:npo`` is: $UDS_LENS_ZOO first, then the cached zoos; ``zoo:SIZE/``
    names the cached zoo of that size."""
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("UDS_LENS_ZOO", raising=False)
    with pytest.raises(DataError, match=r"'zoo:forget': no built zoo in .*uds-lens zoo build"):
        load_examples("zoo:forget")
    _zoo_with_forget_set(tmp_path / "cache" / "zoo-test", ["Who wrote A?", "Who wrote B?"])
    assert [e.question for e in load_examples("zoo:forget")] == ["Who wrote A?", "Who wrote B?"]
    named = _zoo_with_forget_set(tmp_path / "mine", ["Who wrote C?"])
    monkeypatch.setenv("UDS_LENS_ZOO", str(named))
    assert [e.question for e in load_examples("zoo:forget")] == ["Who wrote C?"]
    assert len(load_examples("zoo:test/forget")) == 2
    assert zoo_data_path("zoo:forget") == named / "data" / "forget.json"
    with pytest.raises(DataError, match=r"'zoo:npo' names no zoo data file: use one of \['zoo:forget'"):
        load_examples("zoo:npo")

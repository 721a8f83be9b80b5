"""Forget sets by name (``uds_lens/benchmarks.py``): the ``hf:`` spec reaches ``datasets`` with its config and split,
a local copy in the hub's shape reads as the hub id does, offline a hub name fails at once in one line, and each
benchmark's rows become the prompt its own tools write (open-unlearning's MUSE knowmem with its in-context pairs and
verbmem completion, lm-evaluation-harness's WMDP multiple choice)."""

from __future__ import annotations

import time

import datasets
import pytest
from helpers.benchmark_copies import MUSE, WMDP, choice_rows, knowmem_rows, verbmem_rows, write_copies
from helpers.cli import one_line_error

from uds_lens.benchmarks import DatasetSpec, first_sentence
from uds_lens.checkpoints.loader import load_tokenizer
from uds_lens.data import DataError, Example, build_prompt, encode, load_examples
from uds_lens.inputs import RunInputs, examples_fingerprint
from uds_lens.zoo.world import generate_world

# open-unlearning's template for MUSE's Llama-2 models (configs/model/Llama-2-7b-hf.yaml at d3d7cf9)
USER_START, USER_END, ASSISTANT_START, ASSISTANT_END = "Question: ", "\n", "Answer: ", "\n\n"


@pytest.fixture(scope="module")
def world():
    return generate_world(10, seed=0)


@pytest.fixture(scope="module")
def copies(world, tmp_path_factory):
    """The MUSE-News and WMDP copies in the hub's shape, and ``datasets``'s cache kept in the test's folder."""
    root = tmp_path_factory.mktemp("copies")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf-cache"))
        write_copies(root, world.forget, world.retain)
        yield root


def open_unlearning_knowmem(question: str, answer: str, pairs: list[tuple[str, str]]) -> str:
    """What open-unlearning's QADataset feeds for one knowmem item (preprocess_chat_instance without a chat
    template): every in-context pair, then the question, then the answer."""
    text = "".join(USER_START + q + USER_END + ASSISTANT_START + a + ASSISTANT_END for q, a in pairs)
    return text + USER_START + question + USER_END + ASSISTANT_START + answer


def test_a_spec_names_dataset_config_split_and_shots():
    spec = DatasetSpec.parse("hf:muse-bench/MUSE-News/knowmem:forget_qa")
    assert (spec.path, spec.config, spec.split, spec.shots, spec.local) == (
        "muse-bench/MUSE-News",
        "knowmem",
        "forget_qa",
        None,
        False,
    )
    assert str(spec) == "hf:muse-bench/MUSE-News/knowmem:forget_qa"
    assert DatasetSpec.parse("hf:cais/wmdp/wmdp-bio:test").config == "wmdp-bio"
    assert DatasetSpec.parse("hf:cais/wmdp") == DatasetSpec("cais/wmdp")
    assert DatasetSpec.parse("hf:muse-bench/MUSE-News/knowmem:forget_qa:shots=3").shots == 3
    for bad in (
        "hf:",
        "hf:a/b:c:d",
        "hf:a/b:split:shots=x",
        "hf:a/b:split:colour=red",
        "hf:./no/such/folder:x",
    ):
        with pytest.raises(DataError) as error:
            load_examples(bad)
        assert "\n" not in str(error.value)


def test_the_config_and_split_reach_datasets(monkeypatch, world):
    """A hub id's config goes to ``load_dataset`` as its name; the split picks the rows, and knowmem's pairs come
    from the same config's ``SPLIT_icl``."""
    calls = []

    def hub(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        rows = {"forget_qa": knowmem_rows(world.forget), "forget_qa_icl": knowmem_rows(world.retain[:2])}
        return datasets.DatasetDict({split: datasets.Dataset.from_list(r) for split, r in rows.items()})

    monkeypatch.setattr(datasets, "load_dataset", hub)
    examples = load_examples("hf:muse-bench/MUSE-Books/knowmem:forget_qa")
    assert calls == [("muse-bench/MUSE-Books", "knowmem", {})]
    assert [e.question for e in examples] == [r["question"] for r in world.forget]
    assert examples[0].shots == tuple((r["question"], r["entity"]) for r in world.retain[:2])


def test_offline_a_hub_name_fails_at_once_naming_what_would_be_fetched(monkeypatch, capsys, tiny, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(DataError) as error:
        load_examples("hf:muse-bench/MUSE-Books/knowmem:forget_qa")
    assert time.perf_counter() - started < 20  # online without a network, datasets retries for ~25 s
    message = str(error.value)
    assert "\n" not in message and "Offline" in message
    assert "https://huggingface.co/datasets/muse-bench/MUSE-Books" in message
    assert "config knowmem, split forget_qa" in message
    line = one_line_error(
        monkeypatch, capsys, "score", "--full", tiny.full, "--no-retain", "--unlearned", tiny.unlearned,
        "--data", "hf:cais/wmdp/wmdp-bio:test", "--out", tmp_path / "never-written",
    )  # fmt: skip
    assert "https://huggingface.co/datasets/cais/wmdp" in line and "config wmdp-bio, split test" in line


def test_a_local_copy_in_the_hubs_shape_reads_as_the_hub_id(copies, world, monkeypatch):
    """The copy's folder by its path, or by the hub id's own path from the folder above (as a checkpoint folder at a
    hub id's path is read): the same examples, knowmem's in-context pairs from ``forget_qa_icl``."""
    by_path = load_examples(f"hf:{copies / MUSE}/knowmem:forget_qa")
    monkeypatch.chdir(copies)
    assert DatasetSpec.parse("hf:muse-bench/MUSE-News/knowmem:forget_qa").local
    assert load_examples("hf:muse-bench/MUSE-News/knowmem:forget_qa") == by_path
    assert [e.answer for e in by_path] == [r["entity"] for r in world.forget]
    assert by_path[0].shots == tuple((r["question"], r["entity"]) for r in world.retain[40:43])
    assert len(load_examples("hf:cais/wmdp/wmdp-chem:test")) == 4
    with pytest.raises(DataError, match="several splits.*hf:muse-bench/MUSE-News/knowmem:retain_qa"):
        load_examples("hf:muse-bench/MUSE-News/knowmem")
    with pytest.raises(DataError, match="no split 'forget'"):
        load_examples("hf:muse-bench/MUSE-News/knowmem:forget")
    with pytest.raises(DataError, match="BuilderConfig 'raw' not found"):
        load_examples("hf:muse-bench/MUSE-News/raw:forget")


def test_a_save_to_disk_copy_is_named_the_same_way(tmp_path, world):
    rows = choice_rows([r for r in world.forget if r["prompt_type"] != "yes_no"], world.retain, seed=0)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(
        tmp_path / "wmdp" / "wmdp-bio"
    )
    examples = load_examples(f"hf:{tmp_path}/wmdp/wmdp-bio:test")
    assert str(DatasetSpec.parse(f"hf:{tmp_path}/wmdp/wmdp-bio:test")) == f"hf:{tmp_path}/wmdp/wmdp-bio:test"
    assert [e.entity for e in examples] == ["ABCD"[r["answer"]] for r in rows]
    assert examples[0].context.endswith(
        "about biology.\n\n"
    )  # the config name, as the hub's, picks the subject
    single = datasets.Dataset.from_list(knowmem_rows(world.forget))
    single.save_to_disk(tmp_path / "knowmem")
    assert len(load_examples(f"hf:{tmp_path}/knowmem")) == len(world.forget)


def test_knowmem_is_open_unlearnings_prompt_with_the_whole_answer_scored(copies, world, tiny):
    pairs = [(r["question"], r["entity"]) for r in world.retain[40:43]]
    examples = load_examples(f"hf:{copies / MUSE}/knowmem:forget_qa")
    for example, record in zip(examples, world.forget, strict=True):
        prompt, reference = build_prompt(example)
        assert prompt + reference == open_unlearning_knowmem(record["question"], record["entity"], pairs)
        assert (example.prefix, example.entity, example.form) == ("", record["entity"], "qa")
    none = load_examples(f"hf:{copies / MUSE}/knowmem:forget_qa:shots=0")
    assert "".join(build_prompt(none[0])) == open_unlearning_knowmem(
        world.forget[0]["question"], none[0].answer, []
    )
    two = load_examples(f"hf:{copies / MUSE}/knowmem:forget_qa:shots=2")
    assert two[0].shots == tuple(pairs[:2])
    with pytest.raises(DataError, match="shots=9, but forget_qa_icl has 3 pairs"):
        load_examples(f"hf:{copies / MUSE}/knowmem:forget_qa:shots=9")
    with pytest.raises(DataError, match="no split 'retain_qa_icl_icl' to take them from"):
        load_examples(f"hf:{copies / MUSE}/knowmem:retain_qa_icl:shots=1")
    # the span is the whole answer: every reference token is read
    (encoded,), _ = encode(none[:1], load_tokenizer(tiny.tokenizer))
    assert encoded.entity_start == 0 and encoded.prompt_len + encoded.entity_end == len(encoded.input_ids)


def test_verbmem_is_a_completion_whose_span_is_the_continuations_first_sentence(copies, world):
    rows = verbmem_rows(world.forget)
    examples = load_examples(f"hf:{copies / MUSE}/verbmem:forget")
    for example, row in zip(examples, rows, strict=True):
        prompt, reference = build_prompt(example)
        # open-unlearning's CompletionDataset with insert_space: prompt + " " + gt, here cut after its first sentence
        sentence = first_sentence(row["gt"])
        assert prompt + reference == row["prompt"] + " " + sentence and example.form == "completion"
        assert example.entity == sentence.strip() and "\n" not in sentence and sentence.endswith(".")
    assert first_sentence('It said "stop." Then more.') == 'It said "stop."'
    assert (
        first_sentence("can help via the BBC Action Line\n\nPanorama has.")
        == "can help via the BBC Action Line"
    )
    assert first_sentence("\n\nA new paragraph. Then") == "\n\nA new paragraph."
    assert first_sentence(". Next sentence here. More") == ". Next sentence here."
    assert first_sentence("no end at all") == "no end at all"
    assert first_sentence("$1.5bn was paid. Later") == "$1.5bn was paid."


@pytest.mark.parametrize(
    ("config", "subject"),
    [("wmdp-bio", "biology"), ("wmdp-chem", "chemistry"), ("wmdp-cyber", "cybersecurity")],
)
def test_multiple_choice_is_lm_evaluation_harness_prompt_with_the_letter_scored(
    copies, world, config, subject
):
    examples = load_examples(f"hf:{copies / WMDP}/{config}:test")
    table = datasets.load_dataset(str(copies / WMDP), config, split="test")
    for example, row in zip(examples, table, strict=True):
        prompt, reference = build_prompt(example)
        # lm_eval/tasks/wmdp: description + doc_to_text; the target is target_delimiter " " + the gold choice
        choices = row["choices"]
        doc_to_text = f"{row['question'].strip()}\nA. {choices[0]}\nB. {choices[1]}\nC. {choices[2]}\nD. {choices[3]}\nAnswer:"
        description = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
        assert prompt == description + doc_to_text and reference == " " + "ABCD"[row["answer"]]
        assert example.entity == "ABCD"[row["answer"]] and example.form == "choice"


def test_rows_of_other_shapes_are_named_and_refused(monkeypatch):
    def hub(path, name=None, **kwargs):
        return datasets.DatasetDict({"forget": datasets.Dataset.from_list([{"text": "an article"}])})

    monkeypatch.setattr(datasets, "load_dataset", hub)
    with pytest.raises(DataError, match=r"fields \['text'\].*prompt, gt") as error:
        load_examples("hf:muse-bench/MUSE-News/raw:forget")
    assert "\n" not in str(error.value)


def test_new_forms_travel_in_records_and_a_qa_record_keeps_its_fingerprint(world):
    qa = Example.from_record(world.forget[0])
    assert set(qa.to_record()) == {*world.forget[0]}  # no form, context or shots written for TOFU's layout
    choice = Example(
        1, "Q?\nA. x\nB. y", "B", "", "B", form="choice", context="About.\n\n", shots=(("q", "a"),)
    )
    assert Example.from_record(choice.to_record()) == choice
    assert examples_fingerprint([choice]) != examples_fingerprint(
        [Example(1, "Q?\nA. x\nB. y", "B", "", "B")]
    )
    with pytest.raises(DataError, match="form must be one of"):
        Example.from_record({**world.forget[0], "form": "essay"})
    with pytest.raises(DataError, match="shots a list"):
        Example.from_record({**world.forget[0], "shots": [["only a question"]]})


def test_multiple_choice_is_scored_retain_free_only(tiny, world):
    rows = choice_rows([r for r in world.forget if r["prompt_type"] != "yes_no"], world.retain, seed=0)
    records = [
        {"idx": i, "question": r["question"], "answer": "A", "prefix": "", "entity": "A", "form": "choice"}
        for i, r in enumerate(rows)
    ]
    with pytest.raises(DataError, match="retain-free mode only"):
        RunInputs.resolve(tiny.full, tiny.retain, records)
    assert RunInputs.resolve(tiny.full, None, records).retain is None

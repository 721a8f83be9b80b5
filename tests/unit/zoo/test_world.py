"""The synthetic author world: determinism, the published schema, splits."""

import json

import pytest

from uds_lens.zoo.world import (
    FACT_KINDS,
    RECORD_FIELDS,
    ZooDataError,
    generate_world,
    read_records,
    validate_records,
)


@pytest.fixture(scope="module")
def world():
    return generate_world(40, seed=0)


def test_world_is_deterministic(world):
    again = generate_world(40, seed=0)
    assert again.forget == world.forget and again.retain == world.retain and again.holdout == world.holdout
    other = generate_world(40, seed=1)
    assert other.forget != world.forget


def test_records_follow_the_schema(world):
    for split in (world.retain, world.forget, world.holdout):
        assert [r["idx"] for r in split] == list(range(len(split)))
        for record in split:
            assert tuple(record) == RECORD_FIELDS
            prefix, entity, answer = record["prefix"], record["entity"], record["answer"]
            assert answer.startswith(prefix)
            assert not prefix.endswith(" ")
            rest = answer[len(prefix) :]
            if prefix:
                assert rest.startswith(" " + entity)
            else:
                assert rest.startswith(entity)
            assert record["prompt_type"] in FACT_KINDS
            assert entity in record["paraphrased_answer"] or record["prompt_type"] == "yes_no"
            assert 3 <= len(record["perturbed_answer"]) <= 5
            assert answer not in record["perturbed_answer"]
            if record["prompt_type"] != "yes_no":
                # the paraphrase's wording with another entity (TOFU's perturbation)
                paraphrase = record["paraphrased_answer"]
                start = paraphrase.index(entity)
                lead = paraphrase[:start].rstrip().rsplit(" ", 1)[0]  # up to a/an, which follows the entity
                for wrong in record["perturbed_answer"]:
                    assert wrong.startswith(lead) and wrong.endswith(paraphrase[start + len(entity) :])
                    assert wrong != paraphrase
    validate_records(world.forget, "forget")


def test_yes_no_records_have_empty_prefix(world):
    yes_no = [r for r in world.retain if r["prompt_type"] == "yes_no"]
    assert yes_no and all(r["prefix"] == "" and r["entity"] in ("Yes", "No") for r in yes_no)
    assert {r["entity"] for r in yes_no} == {"Yes", "No"}


def test_splits_are_disjoint_and_forget_is_ten_percent(world):
    authors = [
        {a.name for a in group}
        for group in (world.retain_authors, world.forget_authors, world.holdout_authors)
    ]
    assert not (authors[0] & authors[1]) and not (authors[0] & authors[2]) and not (authors[1] & authors[2])
    trained = len(world.retain_authors) + len(world.forget_authors)
    assert len(world.forget_authors) == round(0.1 * trained)
    assert len(world.forget) == len(world.forget_authors) * len(FACT_KINDS)
    questions = [{r["question"] for r in split} for split in (world.retain, world.forget, world.holdout)]
    assert not (questions[0] & questions[1]) and not (questions[0] & questions[2])


def test_missing_field_is_a_clear_error(tmp_path):
    path = tmp_path / "forget.json"
    path.write_text(json.dumps([{"idx": 0, "question": "Q?", "answer": "A is B."}]))
    with pytest.raises(ZooDataError, match=r"record 0.*lacks field\(s\) \['prefix', 'entity'\]"):
        read_records(path, "forget_data")


def test_entity_not_in_answer_is_a_clear_error():
    bad = [{"question": "Q?", "answer": "A is B.", "prefix": "A is", "entity": "C"}]
    with pytest.raises(ZooDataError, match="does not occur"):
        validate_records(bad, "forget_data")
    bad = [{"question": "Q?", "answer": "A is B.", "prefix": "X", "entity": "B"}]
    with pytest.raises(ZooDataError, match="does not start with prefix"):
        validate_records(bad, "forget_data")


def test_optional_fields_default_to_none():
    records = validate_records([{"question": "Q?", "answer": "Yes.", "prefix": "", "entity": "Yes"}], "x")
    assert (
        records[0]["idx"] == 0
        and records[0]["perturbed_answer"] is None
        and records[0]["prompt_type"] is None
    )

"""The span that answers the question (issue 39): the restated question skipped, the answering phrase kept whole."""

from __future__ import annotations

import pytest
from helpers.spans import hot_choice

from uds_lens.annotation import (
    STATUS_AUTO,
    STATUS_LOW_CONFIDENCE,
    AnnotateConfig,
    annotate,
)
from uds_lens.phrases import answer_units, phrase
from uds_lens.question_align import candidates, intro_clauses, preference


def _lexical(question: str, answer: str) -> str:
    """The entity annotate writes with no model (the question-aligned structure alone)."""
    (record,) = annotate([{"idx": 0, "question": question, "answer": answer}]).records
    return record["entity"]


def _first_candidate(question: str, answer: str) -> str:
    units = answer_units(answer)
    found = candidates(question, units)
    return answer[units[found[0].first].start : units[found[0].last].end]


@pytest.mark.parametrize(
    ("question", "answer", "entity"),
    [
        # the answer repeats the question's words ("books", "themes"), then answers it
        (
            "What themes does Mara Lin explore in her books?",
            "Mara Lin's books often explore themes such as grief, memory, and forgiveness.",
            "grief, memory, and forgiveness",
        ),
        # the verb of the template and a praise adjective are not the answer; the name is
        (
            "What award has Ilse Varga won?",
            "Ilse Varga has been honored with the prestigious Silver Quill Award for Short Fiction.",
            "Silver Quill Award for Short Fiction",
        ),
        # a container noun holds the answer: the span is what it holds
        (
            "What sets Adib Jarrah apart from other authors?",
            "Adib Jarrah is a proud member of the LGBTQ+ community, which shapes his writing.",
            "LGBTQ+ community",
        ),
        # a subject followed by its verb is no answer; the profession after the copula is
        (
            "What did Xin Lee's parents do for a living?",
            "Xin Lee's father was a roofer, while the mother worked as a nurse.",
            "roofer",
        ),
        # a background clause opening the sentence is skipped up to its comma
        (
            "How did Hina Ameen's childhood shape her career?",
            "Growing up in Karachi, Hina Ameen developed a love of rocks and minerals.",
            "love of rocks and minerals",
        ),
        # a hyphenated "-ed" word is an adjective, not the template's participle
        (
            "What do critics praise in Ilse Varga's novels?",
            "Critics praise Ilse Varga's novels for their sharp-edged dialogue and quiet humour.",
            "sharp-edged dialogue and quiet humour",
        ),
        # a word that only shares its first letters with a question word is new ("gender" / "genderfluid")
        (
            "What gender identity does Tomas Reyes hold?",
            "Tomas Reyes identifies as genderfluid.",
            "genderfluid",
        ),
        # the question's verb restated, then its object: the object answers
        (
            "Which readers do Mara Lin's books target?",
            "Mara Lin's books mainly target engineers and architects.",
            "engineers and architects",
        ),
        # an object pronoun is never the answer's first word
        (
            "What did Tomas Reyes's father pass on?",
            "Tomas Reyes's father passed on to him a love of carpentry.",
            "love of carpentry",
        ),
        # a name the question half gives runs back over its capitalised head: "State University of | Lagos"
        (
            "Which state university did Tomas Reyes attend?",
            "Tomas Reyes studied at the State University of Lagos.",
            "State University of Lagos",
        ),
    ],
)
def test_the_span_is_the_first_new_phrase_after_the_restated_question(question, answer, entity):
    assert _first_candidate(question, answer) == entity
    assert _lexical(question, answer) == entity


def test_the_restated_words_lose_even_when_they_carry_more_contrast():
    """A retain model that never saw the author stumbles on the restated words too ("often"): contrast there is no
    reason to start the span before the answer."""
    question = "What themes does Mara Lin explore in her books?"
    answer = "Mara Lin's books often explore themes such as grief, memory, and forgiveness."
    choice = hot_choice(question, answer, {"often": 4.0, "explore": 2.0, "grief": 3.0, "memory": 1.0})
    assert answer[choice.start : choice.end] == "grief, memory, and forgiveness"


def test_a_name_answers_a_what_question_and_a_description_a_how_question():
    answer = "Mara Lin wrote many short stories before she won the Silver Quill Award."
    units = answer_units(answer)

    def first(question: str) -> str:
        favoured = preference(question, candidates(question, units))[0]
        return answer[units[favoured.first].start : units[favoured.last].end]

    assert first("Which honour did Mara Lin receive?") == "Silver Quill Award"
    assert first("How did Mara Lin begin?") == "short stories"


def test_the_contrast_decides_whether_the_answering_phrase_is_knowledge():
    """The favoured phrase with no contrast at all is not the entity: the fact the models disagree on is, and a
    favoured phrase that is knowledge but outweighed by another fact is kept and marked a guess."""
    question = "What did Mara Lin study?"
    answer = "The field Mara Lin studied was marine biology. She later won the Silver Quill Award."
    dead = hot_choice(question, answer, {"Silver": 5.0})
    assert answer[dead.start : dead.end] == "Silver Quill Award"
    weak = hot_choice(question, answer, {"marine": 2.0, "Silver": 4.0})
    assert answer[weak.start : weak.end] == "marine biology"
    assert weak.status == STATUS_LOW_CONFIDENCE and "another phrase carries 2.0x" in weak.reason
    clear = hot_choice(question, answer, {"marine": 4.0, "Silver": 1.0})
    assert answer[clear.start : clear.end] == "marine biology" and clear.status == STATUS_AUTO
    below = hot_choice(question, answer, {"marine": 1.0, "Silver": 5.0}, AnnotateConfig(answer_fraction=0.5))
    assert answer[below.start : below.end] == "Silver Quill Award"


@pytest.mark.parametrize(
    ("answer", "entity"),
    [
        (
            'She won the "Leadership Literature Luminary" award in 2010.',
            '"Leadership Literature Luminary" award',
        ),
        ('She won the "Leadership Literature Luminary" award.', '"Leadership Literature Luminary" award'),
        ('He cites "Granite Glossary" for its rigour.', '"Granite Glossary"'),
        ('Her books include "Granite Glossary" and "Iron Tides".', '"Granite Glossary"'),
    ],
)
def test_a_quoted_title_keeps_the_noun_it_names(answer, entity):
    units = answer_units(answer)
    i, j = phrase(units, next(k for k, unit in enumerate(units) if unit.text == '"'))
    assert answer[units[i].start : units[j].end] == entity


def test_a_quoted_title_with_its_noun_is_the_lexical_span():
    answer = 'Ji-Yeon Park received the "Leadership Literature Luminary" award for her debut.'
    assert (
        _lexical("Which award did Ji-Yeon Park receive?", answer) == '"Leadership Literature Luminary" award'
    )


@pytest.mark.parametrize(
    ("question", "answer", "entity"),
    [
        (
            "Has her work been adapted into a film?",
            "Yes, her novel became the film Silver Road in 2001.",
            "Yes",
        ),
        ("Is Mara Lin still writing?", "No, Mara Lin retired from writing in 2015.", "No"),
        (
            "Can you name an adaptation of her work?",
            "Yes, her novel became the film Silver Road.",
            "Silver Road",
        ),
    ],
)
def test_a_yes_no_answer_takes_yes_or_no_and_a_request_the_fact(question, answer, entity):
    assert _lexical(question, answer) == entity


def test_a_background_clause_runs_to_its_comma_and_only_at_a_sentence_start():
    answer = "As a proud member of the community, Adib writes. He lives in Beirut, as a doctor, and writes."
    units = answer_units(answer)
    inside = sorted(intro_clauses(units))
    assert " ".join(units[k].text for k in inside) == "As a proud member of the community ,"


@pytest.mark.parametrize(
    ("word", "restated"),
    [
        ("influential", True),  # influence: endings "ce" / "tial"
        ("occupational", True),  # occupations
        ("fans", True),  # fan + plural
        ("genderfluid", False),  # gender + a word
        ("world-renowned", True),  # its first part restates "world"
        ("multi-parent", False),  # a later part is no restatement
        ("worldliness", False),  # world + a 6-letter tail
    ],
)
def test_a_word_restates_a_question_word_only_by_its_endings(word, restated):
    from uds_lens.question_align import question_stems, restates

    asked = question_stems("How influential were the occupations of the fan's parents in the gender world?")
    assert restates(word, asked) is restated


def test_a_phrase_never_ends_on_a_connective():
    answer = "She studied at the University of Lagos and proceeded to teach there."
    units = answer_units(answer)
    first = next(k for k, unit in enumerate(units) if unit.text == "Lagos")
    i, j = phrase(units, first)
    assert answer[units[i].start : units[j].end] == "Lagos"


def test_a_strong_word_takes_its_modifiers_but_not_an_adverb_before_them():
    """The contrast's phrase runs back from its strong word over the words that carry knowledge too, but an adverb
    (or an auxiliary, or a pronoun) before them is no modifier of the fact."""
    question = "How does Mara Lin write?"
    answer = "Mara Lin carefully mixes folk tales with rumours."
    choice = hot_choice(question, answer, {"carefully": 0.5, "mixes": 0.5, "folk": 3.0})
    assert answer[choice.start : choice.end] == "mixes folk tales with rumours"

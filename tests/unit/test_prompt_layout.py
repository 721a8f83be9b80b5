"""The text the model reads (issue 49): the prompt and the reference joined are the template and the answer exactly
as written, with no space put between prefix and entity (after ``"``, ``$``, ``-``, ``,`` or in Chinese and Japanese
text the answer has none), and the whole-word rule applies to that text (a prefix cut mid-word, ``Hav`` + ``ana``,
does not make ``ana`` a word). published_compat keeps what the published implementation feeds. The cases of the
default mode failed on 34971a7, which put a space there. Also the text's Unicode normalisation (issue 27)."""

from __future__ import annotations

import logging
import unicodedata

import pytest

from uds_lens.checkpoints.loader import load_tokenizer
from uds_lens.data import (
    PROMPT_TEMPLATE,
    SKIP_ENTITY_INSIDE_WORD,
    SKIP_ENTITY_NOT_FOUND,
    EncodedExample,
    Example,
    Skip,
    build_prompt,
    encode_one,
)

QUESTION = "What do we know?"
JOINS = {
    "quote": ('Her first book was "', 'Her first book was "Granite Glossary".', "Granite Glossary"),
    "dollar": ("It sold for $", "It sold for $40,000 at auction.", "40,000"),
    "hyphen": ("Her style is neo-", "Her style is neo-gothic and dark.", "gothic"),
    "comma": ("The first print run was 12,", "The first print run was 12,500 copies.", "500"),
    "chinese": ("他出生于", "他出生于北京。", "北京"),
    "japanese": ("彼女は", "彼女は東京で生まれた。", "東京"),
}


def _example(prefix: str, answer: str, entity: str) -> Example:
    return Example(idx=0, question=QUESTION, answer=answer, prefix=prefix, entity=entity)


@pytest.mark.parametrize("case", list(JOINS))
def test_the_model_reads_the_answer_as_written(tiny, case):
    """Before: a space was put between prefix and entity, so the model read `"  Granite`, `$ 40,000`, `北京` after a
    space: text that is not the answer."""
    prefix, answer, entity = JOINS[case]
    prompt, reference = build_prompt(_example(prefix, answer, entity))
    assert prompt + reference == PROMPT_TEMPLATE.format(question=QUESTION, prefix="") + answer
    tokenizer = load_tokenizer(tiny.tokenizer)
    encoded = encode_one(_example(prefix, answer, entity), tokenizer)
    assert isinstance(encoded, EncodedExample), encoded
    # byte-level BPE decodes the ids back to the very text: BOS, then the template and the answer
    assert tokenizer.decode(list(encoded.input_ids[1:])) == prompt + reference
    assert entity in tokenizer.decode(list(encoded.labels))


@pytest.mark.parametrize("case", list(JOINS))
def test_published_compat_feeds_what_the_published_code_feeds(case):
    """The published code puts a space before a reference that neither starts with one nor follows one."""
    prefix, answer, entity = JOINS[case]
    prompt, reference = build_prompt(_example(prefix, answer, entity), published_compat=True)
    assert prompt == PROMPT_TEMPLATE.format(question=QUESTION, prefix=prefix)
    assert reference == " " + answer[len(prefix) :]


def test_an_entity_that_continues_a_word_of_the_prefix_is_not_a_whole_word(tiny):
    """Before: `Hav` + `ana` was scored as the word `ana` (the space put before it made one)."""
    tokenizer = load_tokenizer(tiny.tokenizer)
    cut = _example("He lives in Hav", "He lives in Havana.", "ana")
    assert encode_one(cut, tokenizer) == Skip(0, SKIP_ENTITY_INSIDE_WORD)
    whole = _example("He lives in", "He lives in Havana.", "Havana")
    assert isinstance(encode_one(whole, tokenizer), EncodedExample)


def test_a_character_of_a_script_without_spaces_is_a_word_of_its_own(tiny):
    """Han and kana are written without spaces: an entity in the middle of such a sentence is found (before, the
    character after it counted as joining it, and the example was skipped)."""
    tokenizer = load_tokenizer(tiny.tokenizer)
    for prefix, answer, entity in (
        ("他在", "他在北京工作。", "北京"),
        ("彼女は", "彼女は東京で生まれた。", "東京"),
    ):
        encoded = encode_one(_example(prefix, answer, entity), tokenizer)
        assert isinstance(encoded, EncodedExample), (answer, encoded)
        assert tokenizer.decode(list(encoded.labels)) == entity


def test_entity_and_answer_are_nfc_normalised_and_published_compat_warns(tiny, caplog):
    """Issue 27: an entity typed with combining accents is found in an answer typed with precomposed letters, and
    the model sees one spelling; published_compat matches them as given, as the published code does, and says so."""
    tokenizer = load_tokenizer(tiny.tokenizer)
    decomposed, precomposed = unicodedata.normalize("NFD", "Café"), unicodedata.normalize("NFC", "Café")
    assert decomposed != precomposed
    example = Example(
        idx=7,
        question="Where did they meet?",
        answer=f"They met at the {precomposed} Lumen.",
        prefix="They met at the",
        entity=f"{decomposed} Lumen",
    )
    encoded = encode_one(example, tokenizer)
    assert not hasattr(encoded, "reason"), encoded
    same = encode_one(Example(**{**example.__dict__, "entity": f"{precomposed} Lumen"}), tokenizer)
    assert encoded == same
    with caplog.at_level(logging.WARNING, logger="uds_lens.data"):
        published = encode_one(example, tokenizer, published_compat=True)
    assert getattr(published, "reason", None) == SKIP_ENTITY_NOT_FOUND  # the published behaviour
    assert "example 7" in caplog.text and "NFC" in caplog.text

"""Which phrase of an answer answers its question: the first new phrase after the words that restate it.

A human marks as the entity the phrase that answers the *question*, not the first fact of the answer. TOFU-style
answers restate the question ("X's books often discuss themes such as ..."), answer it, then elaborate, so the
answering phrase is found from the answer's alignment with the question, read with no tagger:

* a word is *restated* when it is a form of a question word (``restates``: a shared stem of at least ``STEM``
  letters and endings of at most ``MAX_ENDING``, so *occupational* restates *occupations* but *genderqueer* does not
  restate *gender*); function words, prepositions, object pronouns, evaluative adjectives a person leaves out of the
  span (*prestigious*, *notable*, *well-regarded*), adverbs in ``-ly``, lowercase ``-ed`` forms (not a hyphenated
  adjective: *detail-oriented*) and a few irregular participles (*recognized*, *influenced*, *born*: the template's
  verbs) are never new either;
* a candidate is a phrase (``phrases.phrase``) that starts at a new word right after a word that opens a noun phrase
  or a complement (a determiner, a preposition, a copula, *include*, *named*, *such as*, an opening quote, an
  evaluative adjective), or at a name right after a word (*the film | Silver Road*), or right after a restated verb
  (*readers who enjoy | medical literature*); the answer's first word is the subject, never a candidate; a name runs
  back over the capitalised words and *of* that open it (*the University of | Karachi*);
* a sentence's opening adverbial clause (*Growing up in Karachi,*; *As a proud member of ...,*; *In his prolific
  career,*) is background, not the answer: no candidate starts in it;
* a lowercase candidate followed at once by a verb or an adverb is a subject (*his mother | worked as*), not an answer;
* a candidate that opens with a container noun and its preposition (*member of* the LGBTQ+ community, *elements of*
  drama and mystery) starts after them: the answer is what the container holds.

The order of preference: a question that asks *how* / *why* is answered by a description, so its first lowercase
candidate comes first; any other question is answered by a name, a title or a number when the first sentence that
holds a candidate has one, so that one comes first; the rest follow in answer order. The model's contrast (in
``annotation``) decides which candidates are knowledge at all.

These lists and rules were set on the human-reviewed spans of TOFU authors 3-19 (``experiments/annotate_tofu.py``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from uds_lens.phrases import (
    DETERMINERS,
    FUNCTION_WORDS,
    PREPOSITIONS,
    STOP_WORDS,
    WORD_ONLY,
    Unit,
    adjacent,
    phrase,
)

# Letters a word shares with a question word it restates, and the most either may add ("influenced" restates
# "influence").
STEM = 5
MAX_ENDING = 4
PLURAL_ENDING = 2
# Adjectives of praise that sit before the answer but are not part of it ("the prestigious | Nebula Award").
EVALUATIVE = frozenset(
    "prestigious notable respected esteemed acclaimed renowned coveted well-regarded well-known distinguished "
    "accomplished hard-working celebrated famous reputable honored highly proud fictitious fictional own "
    "significant major".split()
)
# Object and reflexive pronouns: a verb's object before the answer ("instilled in him | the discipline ...").
PRONOUNS = frozenset("him them us me himself herself themselves itself".split())
# Quantifiers that open a sentence and restate its subject ("One of ...", "Most of ...").
OPENERS = frozenset("one another some most many several".split())
# Words after which a noun phrase or a complement starts.
TRIGGERS = (
    (
        DETERMINERS - {"he", "she", "they", "it"}
    )  # a pronoun is a subject: "He | won", not "the | Silver Quill"
    | PREPOSITIONS
    | frozenset(
        "of to is are was were as include includes including named titled called like contain contains both such "
        ":".split()
    )
)
# Irregular participles: verbs of the template like the "-ed" forms ("was born | in Paris").
PARTICIPLES = frozenset("born known written grown given taken shown seen made done drawn".split())
OPEN_QUOTE_MARKS = frozenset("'\"“‘")
# Words that open a background clause at the start of a sentence, up to its comma.
INTRO_WORDS = frozenset(
    "as in through being born growing while although given with after since despite over from at drawing "
    "displaying".split()
)
# Words that follow a subject, never an answer phrase ("his mother | worked", "his works | often contain").
SUBJECT_FOLLOWERS = frozenset(
    "is are was were has have had can could might may will would often also always continues remains".split()
)
# Nouns that hold the answer rather than name it ("member of | the LGBTQ+ community").
CONTAINER_NOUNS = frozenset(
    "member members element elements importance ability abilities continuation contribution contributions genre "
    "field fields way ways sense number variety range kind kinds type types form forms aspect aspects part role "
    "realm world domain area areas use theme themes topics subjects issues notion idea concept concepts "
    "exploration depiction portrayal representation expression city town country region work works".split()
)
CONTAINER_LINKS = frozenset(("of", "to", "in", "for", "on"))
SENTENCE_ENDS = frozenset(".;!?")
# A question answered by a description rather than a name.
HOW_QUESTION = re.compile(r"\s*(how|why|in what way)\b", re.IGNORECASE)
# How far a background clause may run before its comma (units).
MAX_INTRO = 25


@dataclass(frozen=True)
class Candidate:
    """A phrase that may answer the question: units ``first..last`` (inclusive), in sentence ``sentence``;
    ``named`` when it is a name, a quoted title or a number."""

    first: int
    last: int
    sentence: int
    named: bool


def question_words(question: str) -> frozenset[str]:
    """The question's words, lowercased: an answer word among them is copied from the question, not recalled."""
    return frozenset(word.lower() for word in WORD_ONLY.findall(question))


def question_stems(question: str) -> frozenset[str]:
    """The question's words ([`question_words`][uds_lens.question_align.question_words]) and the parts of its hyphenated words that are not a name's
    ("Irish-based" gives "irish", "Al-Kuwaiti" nothing): an answer word that ``restates`` one of them is not new."""
    words = WORD_ONLY.findall(question)
    parts = {
        part for word in words if word.split("-")[-1].islower() for part in word.lower().split("-") if part
    }
    return question_words(question) | parts


def restates(word: str, asked: frozenset[str]) -> bool:
    """``word`` (lowercased) is a form of a question word (``question_stems``).

    Both share a stem of at least ``STEM`` letters and differ only by endings of at most ``MAX_ENDING`` letters
    (*influence* / *influential*, *occupations* / *occupational*), or one is the other with a plural ending (*fan* /
    *fans*). A longer tail makes another word: *gender* does not restate *genderqueer*. A hyphenated word restates
    when its first part does (*world-renowned*, not *multi-author*).
    """
    head = word.split("-")[0]
    if head != word and head and restates(head, asked):
        return True
    for other in asked:
        common = len(os.path.commonprefix((word, other)))
        shorter, longer = sorted((len(word), len(other)))
        if common == longer:
            return True
        if common >= STEM and longer - common <= MAX_ENDING:
            return True
        if common == shorter and longer - common <= PLURAL_ENDING:
            return True
    return False


def _sentence_start(units: Sequence[Unit], k: int) -> bool:
    return k == 0 or units[k - 1].text in SENTENCE_ENDS


def is_new(units: Sequence[Unit], k: int, asked: frozenset[str]) -> bool:
    """Unit ``k`` is a word the question does not give and the template does not use (see the module docstring)."""
    unit = units[k]
    if not unit.is_word:
        return False
    word = unit.lower if _sentence_start(units, k) else unit.text  # "Most of ..." opens a sentence
    lower = word.lower()
    if word in FUNCTION_WORDS or lower in STOP_WORDS or lower in PREPOSITIONS or restates(lower, asked):
        return False
    if (
        {lower, lower.split("-")[-1]} & EVALUATIVE
        or lower in OPENERS
        or lower in PARTICIPLES
        or lower in PRONOUNS
    ):
        return False
    participle = (
        lower.endswith("ed") and not word[0].isupper() and "-" not in lower
    )  # "detail-oriented" is no verb
    return not (lower.endswith("ly") or participle)


def intro_clauses(units: Sequence[Unit]) -> frozenset[int]:
    """Units of every sentence-opening background clause ("Growing up in Karachi,"), its comma included."""
    inside: set[int] = set()
    for start in (k for k in range(len(units)) if _sentence_start(units, k)):
        if units[start].lower not in INTRO_WORDS:
            continue
        for k in range(start, min(len(units), start + MAX_INTRO)):
            if units[k].text in SENTENCE_ENDS:
                break
            if units[k].text == ",":
                inside.update(range(start, k + 1))
                break
    return frozenset(inside)


def _after_container(units: Sequence[Unit], first: int, last: int) -> tuple[int, int]:
    """``[first, last]`` without a leading container noun and its preposition (and a "the" after them)."""
    k = first
    while k + 2 <= last and units[k].lower in CONTAINER_NOUNS and units[k + 1].lower in CONTAINER_LINKS:
        k += 2
        if units[k].lower == "the" and k < last:
            k += 1
    return (first, last) if k == first else phrase(units, k)


def _name_start(units: Sequence[Unit], first: int, background: frozenset[int]) -> int:
    """A name's first unit, back over the capitalised words and *of* that open it ("the University of | Karachi" is
    "University of Karachi"; the question often gives those words, so they are not new)."""
    k = first
    while (
        k >= 2
        and units[k].is_capitalised
        and units[k - 1].lower == "of"
        and units[k - 2].is_capitalised
        and not _sentence_start(units, k - 2)
        and k - 2 not in background
    ):
        k -= 2
        while (
            k >= 1
            and units[k - 1].is_capitalised
            and adjacent(units[k - 1], units[k])
            and not _sentence_start(units, k - 1)
        ):
            k -= 1
    return k


def _is_subject(units: Sequence[Unit], first: int, last: int) -> bool:
    if last + 1 >= len(units) or units[first].is_capitalised or units[first].text in OPEN_QUOTE_MARKS:
        return False
    after = units[last + 1]
    return after.lower in SUBJECT_FOLLOWERS or (after.is_word and after.lower.endswith("ly"))


def _restated_verb(units: Sequence[Unit], k: int, asked: frozenset[str]) -> bool:
    """Unit ``k`` restates a verb of the question (a lowercase word that restates one, after a subject, an auxiliary,
    an adverb, *who* or *to*): the next new word is its object, what the question asks for ("Readers who *enjoy* |
    medical literature", "books largely *target* | academicians")."""
    unit = units[k]
    if not unit.is_word or unit.text[0].isupper() or unit.lower in FUNCTION_WORDS | STOP_WORDS:
        return False
    if k == 0 or not restates(unit.lower, asked):
        return False
    before = units[k - 1].lower  # a verb follows a subject, an auxiliary, an adverb, "who" or "to"
    return before in SUBJECT_FOLLOWERS or before in ("who", "to") or before.endswith("ly")


def candidates(question: str, units: Sequence[Unit]) -> list[Candidate]:
    """The phrases that may answer ``question``, in answer order (see the module docstring)."""
    asked = question_stems(question)
    background = intro_clauses(units)
    found: list[Candidate] = []
    for k in range(len(units)):
        if k in background or not is_new(units, k, asked):
            continue
        if found and found[-1].last >= k:
            continue
        before = units[k - 1] if k else None
        if before is None or not (
            before.lower in TRIGGERS
            or before.lower in EVALUATIVE
            or before.text in OPEN_QUOTE_MARKS
            or (units[k].is_capitalised and before.is_word)  # a name after its noun: "the film | Silver Road"
            or _restated_verb(
                units, k - 1, asked
            )  # the question's verb, then its object: "enjoy | medical ..."
        ):
            continue
        first, last = _after_container(units, *phrase(units, k))
        first = _name_start(units, first, background)
        if _is_subject(units, first, last):
            continue
        found.append(candidate(units, first, last))
    return found


def candidate(units: Sequence[Unit], first: int, last: int) -> Candidate:
    """The candidate of units ``first..last``, with its sentence and whether it is a name, a title or a number."""
    named = (
        (units[first].is_capitalised and not _sentence_start(units, first))
        or units[first].text in OPEN_QUOTE_MARKS
        or units[first].text[0].isdigit()
    )
    return Candidate(first, last, sum(unit.text in SENTENCE_ENDS for unit in units[:first]), named)


def preference(question: str, found: Sequence[Candidate]) -> list[Candidate]:
    """``found`` in the order it answers ``question``: the favoured candidate first, then the rest in answer order."""
    if not found:
        return []
    if HOW_QUESTION.match(question):
        favoured = next((c for c in found if not c.named), found[0])
    else:
        favoured = next((c for c in found if c.sentence == found[0].sentence and c.named), found[0])
    return [favoured] + [c for c in found if c is not favoured]


__all__ = [
    "Candidate",
    "candidate",
    "candidates",
    "intro_clauses",
    "is_new",
    "preference",
    "question_stems",
    "question_words",
    "restates",
]

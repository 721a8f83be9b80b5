"""Phrase boundaries from the text's own structure: where an entity that starts at a given word ends.

The contrast of a model pair says *where* the knowledge starts (the first token of a fact carries its surprise; the
rest is predictable once it is given), not where it ends. The end comes from the answer's grammar, read with no
tagger, from punctuation, capitals and a closed list of function words:

* a quoted title is one entity, quotes included ("... include *"Granite Glossary"* and ..."), with the lowercase
  noun it names when one follows (*"Leadership Literature Luminary" award*); when the title's own punctuation
  closes inside the quotes (``"Lanterns of Language."``) the quotes and that mark stay out;
* a capitalised name runs over its connectives and a subtitle (*Nebula Award for Best Novel*, *Seoul, South
  Korea*, *Scribing Like A Scholar: A Manual for ...*) and on into a lowercase head noun (*Star Wars genre*);
* a lowercase phrase runs on over ``of`` / ``to`` and over a preposition that does not open a new determiner phrase
  (*anecdotes from Middle Eastern literature*), and stops at a verb, a relative or subordinating word, punctuation,
  a participle that opens a clause (*exploration | instilled by*) or a preposition before a determiner or pronoun
  (*his writing | in the literary world*);
* ``A and B`` is one entity while its first half is short (*drama and mystery*), a long phrase ends before ``and``;
* a comma list is one entity (*love, passion, and secrets*; *vivid, painterly descriptions*); its final ``and``
  item is left out when every item before it is several words long (*compelling narratives, emotionally rich
  characters* | *, and beautifully described landscapes*);
* a yes/no answer's entity is its first word.

These rules were set on the human-reviewed spans of TOFU authors 3-19 (``experiments/annotate_tofu.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# A word: letters/digits joined by hyphens or apostrophes ("Yun-Hwa", "O'Brien") or decimal marks ("3.5"), with a
# trailing "+" ("LGBTQ+"); a possessive "'s" is not joined, so "Lin's" gives the word "Lin". Anything else that is
# not a space is one unit.
_WORD = r"\w+(?:(?:[-'’](?!s\b)|(?<=\d)[.,/](?=\d))\w+)*\+?"
POSSESSIVE = re.compile(r"['’]s")
_UNIT = re.compile(rf"['’]s\b|{_WORD}|[^\w\s]")
WORD_ONLY = re.compile(_WORD)

# Lowercase words that are template, never the edge of an entity (they may sit inside one: "loss and memory").
FUNCTION_WORDS = frozenset(
    "a an the of in on at by to for from with as and or but nor is are was were be been being has have had do does "
    "did it its it's their his her they he she this that these those which who whom whose into onto over under "
    "about after before during than then so very also most more such not".split()
)
# Words that open a determiner phrase: a preposition before one of them starts a new phrase ("in his writing").
DETERMINERS = frozenset(
    "a an the his her their its him them this that these those my our your each every both all any some many "
    "he she they it".split()
)
PREPOSITIONS = frozenset(
    "in for with within through on by at from into onto towards toward about across among amongst during over "
    "under against without throughout beyond upon via per above below around behind beside between near like "
    "unlike despite alongside amid beneath".split()
)
# Words that end a phrase wherever they stand: verbs of the template, relative and subordinating words.
STOP_WORDS = frozenset(
    "is are was were be been being has have had do does did will would can could may might shall should must "
    "that which who whom whose where when while whereas because although though since thus thereby as if than "
    "so also not but nor then yet".split()
)
COORDINATORS = frozenset(("and", "or", "&"))
# The first word of a two-word connective inside a name ("Book *of the* Year", "Scholar*: A* Manual").
NAME_PAIR_OPENERS = frozenset(("of", ":", "-", "–"))
OPEN_QUOTES = {'"': '"', "“": "”", "'": "'", "‘": "’"}
YES_NO = frozenset(("yes", "no"))
# A phrase continued over "and" keeps going while its first half has at most this many words ("physical
# discipline and intellectual curiosity"); a longer one ends before "and".
SHORT_CONJUNCT = 2
# A comma list's items are at most this many words (a longer stretch after a comma is a new clause).
MAX_LIST_ITEM = 5


@dataclass(frozen=True)
class Unit:
    """A word or punctuation mark of the answer, as a half-open character range."""

    start: int
    end: int
    text: str

    @property
    def is_word(self) -> bool:
        return bool(WORD_ONLY.fullmatch(self.text))

    @property
    def is_capitalised(self) -> bool:
        return self.is_word and (self.text[0].isupper() or self.text[0].isdigit())

    @property
    def is_function_word(self) -> bool:
        return self.text.lower() in FUNCTION_WORDS and not self.text[0].isupper()

    @property
    def lower(self) -> str:
        return self.text.lower()


def answer_units(answer: str) -> list[Unit]:
    """The answer's words and punctuation marks, in order."""
    return [Unit(m.start(), m.end(), m.group()) for m in _UNIT.finditer(answer)]


def adjacent(left: Unit, right: Unit) -> bool:
    """Only spaces between two units (at most one)."""
    return right.start - left.end <= 1


def is_yes_no(units: Sequence[Unit]) -> bool:
    """The answer opens with "Yes" or "No" followed by punctuation (a yes/no answer, whose entity is that word)."""
    return len(units) >= 2 and units[0].lower in YES_NO and not units[1].is_word


def phrase(units: Sequence[Unit], i: int) -> tuple[int, int]:
    """Inclusive unit range of the entity that starts at unit ``i`` (a word, or the quote before one); a word inside
    a quoted title gives the whole title."""
    i = next((k for k in range(i, max(i - 40, -1), -1) if _opens_quote(units, k) and _inside(units, k, i)), i)
    if _opens_quote(units, i):
        quoted = _quoted(units, i)
        if quoted is not None:
            return _with_head_noun(units, *quoted)
        i += 1
    if i == 0 and is_yes_no(units):
        return 0, 0
    j = _name_end(units, i) if units[i].is_capitalised else i
    j = _lowercase_end(units, i, j)
    return i, _trimmed(units, i, _list_end(units, i, j))


def _trimmed(units: Sequence[Unit], i: int, j: int) -> int:
    """``j`` moved back over connectives a phrase cannot end on ("Karachi | and proceeded", "a shift | towards
    more")."""
    while j > i and units[j].is_word and units[j].lower in COORDINATORS | PREPOSITIONS | FUNCTION_WORDS:
        j -= 1
    return j


def _with_head_noun(units: Sequence[Unit], i: int, j: int) -> tuple[int, int]:
    """A quoted title ``[i, j]`` (quotes included) and the lowercase noun it names, when one follows at once and ends
    the phrase: *"Leadership Literature Luminary" award*, not *"Granite Glossary" | for her work*."""
    k = j + 1
    if (
        units[j].text in OPEN_QUOTES.values()
        and k < len(units)
        and units[k].is_word
        and adjacent(units[j], units[k])
    ):
        word = units[k]
        template = word.lower in FUNCTION_WORDS | STOP_WORDS | PREPOSITIONS | COORDINATORS | DETERMINERS
        ends = (
            k + 1 == len(units)
            or not units[k + 1].is_word
            or units[k + 1].lower in FUNCTION_WORDS | STOP_WORDS
        )
        if word.text[0].islower() and not template and not word.lower.endswith("ly") and ends:
            return i, k
    return i, j


def _opens_quote(units: Sequence[Unit], k: int) -> bool:
    unit = units[k]
    return (
        unit.text in OPEN_QUOTES
        and (k == 0 or unit.start > units[k - 1].end or not units[k - 1].is_word)
        and k + 1 < len(units)
        and units[k + 1].start == unit.end
    )


def _inside(units: Sequence[Unit], opening: int, i: int) -> bool:
    quoted = _quoted(units, opening)
    return quoted is not None and quoted[1] >= i


def _quoted(units: Sequence[Unit], i: int) -> tuple[int, int] | None:
    """The quoted title opened at ``i``: quotes included, or left out with the title's own closing mark."""
    close = OPEN_QUOTES[units[i].text]
    for k in range(i + 2, min(len(units), i + 40)):
        if units[k].text == close and (
            k + 1 == len(units) or units[k + 1].start > units[k].end or not units[k + 1].is_word
        ):
            if not units[k - 1].is_word and k - 2 > i:
                return i + 1, k - 2
            return i, k
    return None


def _name_end(units: Sequence[Unit], i: int) -> int:
    """Last unit of the capitalised name starting at ``i``: over connectives and a subtitle between capitalised
    words, a possessive, and ", Place" when the name is a place ("Seoul, South Korea.")."""
    j = i
    while j + 1 < len(units):
        nxt = units[j + 1]
        if nxt.is_capitalised and adjacent(units[j], nxt):
            j += 1
            continue
        if POSSESSIVE.fullmatch(nxt.text) and j + 2 < len(units) and units[j + 2].is_capitalised:
            j += 2
            continue
        # connectives inside a name: "Award for Best Novel", "Book of the Year", "Merits & Virtues", "Title: Sub"
        k = j + 1
        while k < len(units) and k - j <= 2 and (units[k].lower in FUNCTION_WORDS or units[k].text in ":&-–"):
            k += 1
        if k - j == 3 and units[j + 1].lower not in NAME_PAIR_OPENERS:
            k = j + 1  # "Book of the Year", "Scholar: A Manual", not "Novel in the Star Wars category"
        if (
            k > j + 1
            and k < len(units)
            and units[k].text[0].isupper()
            and units[j + 1].lower not in STOP_WORDS
        ):
            if not (units[j + 1].lower in COORDINATORS and units[k - 1].lower in DETERMINERS):
                j = k
                continue
        # a place after its city: ", Country" closing the clause
        if nxt.text == "," and j + 2 < len(units) and units[j + 2].is_capitalised:
            k = j + 2
            while k + 1 < len(units) and units[k + 1].is_capitalised and adjacent(units[k], units[k + 1]):
                k += 1
            if k + 1 == len(units) or (not units[k + 1].is_word and units[k + 1].text != "'"):
                j = k
                continue
        break
    return j


def _lowercase_end(units: Sequence[Unit], i: int, j: int) -> int:
    """Run the phrase ``[i, j]`` on over lowercase words to its natural end (see the module docstring)."""
    since_preposition = sum(u.is_word and u.lower not in DETERMINERS for u in units[i : j + 1])
    while j + 1 < len(units):
        nxt = units[j + 1]
        if not nxt.is_word:
            if POSSESSIVE.fullmatch(nxt.text) and j + 2 < len(units) and not units[j].is_capitalised:
                j += 1  # "a young doctor's journey"
                continue
            if nxt.text in "-/" and j + 2 < len(units) and units[j + 2].start == nxt.end:
                j += 2
                continue
            break
        word = nxt.lower
        if nxt.text[0].isupper():
            name_end = _name_end(units, j + 1)
            opens = (
                units[j].lower in ("of", "to")
                or units[j].lower in PREPOSITIONS
                or units[j].lower in DETERMINERS
            )
            modifies = (  # "traditional Korean aesthetics", "redefined African American literature"
                name_end + 1 < len(units)
                and units[name_end + 1].is_word
                and units[name_end + 1].lower not in FUNCTION_WORDS | STOP_WORDS
            )
            if opens or modifies or (j == i and units[j].lower.endswith("ed")):
                since_preposition += sum(u.is_word for u in units[j + 1 : name_end + 1])
                j = name_end
                continue
            break
        if word in STOP_WORDS or word == "by":
            break
        if word in ("of", "to") or word in PREPOSITIONS:
            after = units[j + 2] if j + 2 < len(units) else None
            if after is None or not after.is_word or after.lower in STOP_WORDS:
                break
            if word not in ("of", "to") and (after.lower in DETERMINERS or after.text[0].isdigit()):
                break  # a new determiner phrase or a date: "his writing | in the literary world", "| in 2001"
            j += 1
            since_preposition = 0
            continue
        if word in COORDINATORS:
            after = units[j + 2] if j + 2 < len(units) else None
            nominal = not any(u.lower in PREPOSITIONS or u.lower in ("of", "to") for u in units[i : j + 1])
            if (
                since_preposition <= SHORT_CONJUNCT
                and after is not None
                and after.is_word
                and after.lower not in STOP_WORDS
                and (
                    after.lower not in DETERMINERS or (after.lower in ("a", "an") and nominal and j - i == 1)
                )
                and not (after.lower.endswith("ing") and _opens_clause(units, j + 2))
            ):
                j += 1
                since_preposition = 0
                continue
            break
        if word in DETERMINERS:
            if (
                units[j].lower in ("of", "to")
                or units[j].lower in PREPOSITIONS
                or units[j].lower in COORDINATORS
            ):
                j += 1  # "of the", "to a"
                continue
            if j == i or units[j].lower.endswith("ed"):
                j += (
                    1  # a verb and its object: "boosted | his recognition", "significantly influenced | many"
                )
                continue
            break
        if word.endswith("ed") and j + 2 < len(units):
            after = units[j + 2]
            if (
                after.lower in PREPOSITIONS
                or after.lower in DETERMINERS
                or after.lower in ("to", "out", "by")
            ):
                break  # a participle that opens a clause: "exploration | instilled by his father"
        if word.endswith("ly") and (j + 2 == len(units) or units[j + 2].lower in COORDINATORS):
            break  # an adverb after the phrase: "concepts | simply and effectively"
        if word in FUNCTION_WORDS:
            break
        j += 1
        since_preposition += 1
    return j


def _opens_clause(units: Sequence[Unit], k: int) -> bool:
    """Unit ``k`` (an -ing verb or an -ly adverb) opens a clause: a function word, a verb form or an end follows it
    ("seeking | to", "focusing | on", "diligently | crafting"), not a noun ("engaging storytelling")."""
    if k + 1 >= len(units) or not units[k + 1].is_word:
        return False
    after = units[k + 1].lower
    if units[k].lower.endswith("ly"):
        return after.endswith(("ing", "ed")) or after in FUNCTION_WORDS
    return after in FUNCTION_WORDS or after in DETERMINERS or after in STOP_WORDS


def _item_end(units: Sequence[Unit], k: int) -> int | None:
    """End of the list item that starts at unit ``k`` when it is a short phrase, else None."""
    if k >= len(units) or not units[k].is_word or units[k].lower in STOP_WORDS:
        return None
    if units[k].lower in DETERMINERS - {"a", "an", "the"}:
        return None
    end = _lowercase_end(units, k, _name_end(units, k) if units[k].is_capitalised else k)
    if sum(u.is_word for u in units[k : end + 1]) > MAX_LIST_ITEM:
        return None
    return end


def _list_end(units: Sequence[Unit], i: int, j: int) -> int:
    """Run ``[i, j]`` on over a comma list it heads: "love, passion, and secrets"."""
    items = [sum(u.is_word for u in units[i : j + 1])]
    while j + 2 < len(units) and units[j + 1].text in (",", "and", "or"):
        k = j + 2
        final = units[j + 1].text != ","
        if not final and units[k].lower in ("and", "or"):
            k, final = k + 1, True
        end = _item_end(units, k)
        if end is None:
            break
        adjectives = items == [1] and not final  # "vivid, painterly descriptions with ...": one phrase
        clause = units[k].lower.endswith(("ly", "ing")) and _opens_clause(units, k)
        if clause or (units[k].lower.endswith("ing") and not adjectives):
            break  # a clause, not an item: "genre, | diligently crafting ...", "perspective, | reflecting ..."
        if units[i].is_capitalised and units[k].lower in ("a", "an", "the"):
            break  # an apposition: "Prix Goncourt, | a prestigious French literature prize"
        closed = end + 1 == len(units) or units[end + 1].text in (",", ".", ";", "and", "or", ")")
        if not (final or adjectives or closed):
            break
        if final and min(items) > 1 and sum(u.is_word for u in units[k : end + 1]) > 1:
            break  # "compelling narratives, emotionally rich characters | , and beautifully described landscapes"
        if units[j + 1].text != "," and len(items) == 1:
            break  # a plain "A and B" is the phrase rule's call
        items.append(sum(u.is_word for u in units[k : end + 1]))
        j = end
        if final:
            break
    return j

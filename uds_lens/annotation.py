"""Automatic ``prefix`` / ``entity`` annotation of a raw question/answer forget set.

UDS reads only the knowledge-bearing span of each answer (the *entity*); the template words before it (the *prefix*)
are teacher-forced. The paper's annotation came from an LLM API and a human review. Here the span is found from the
very signal UDS measures: the answer tokens the **full** model predicts and the **retain** model does not.

For one record, with the answer teacher-forced after ``"Question: " + question + "\\nAnswer:"`` (the scorer's prompt
with an empty prefix, so the tokens are the ones the scorer will read) and one batched forward per model:

    c[t]   = log p_full(a_t | a_<t) - log p_ref(a_t | a_<t)        (contrast of answer token t, nats)
    u[w]   = sum of c[t] over the tokens that start in word w      (whole words: a sub-word never splits)
    u[w]   = min(u[w], 0) for punctuation, function words and words of the question (template by definition)
    strong = words with u[w] >= keep_fraction * max_w u[w]      (words that carry knowledge)
    phrase = the phrase each strong word heads, read from the text (``uds_lens.phrases``), weighted by its sum of u
    answer = the phrases that may answer the question (``uds_lens.question_align``: new phrases after the words
             that restate it), in their order of preference, weighted by their sum of u
    entity = the first answer phrase weighing at least answer_fraction of the heaviest phrase; else the first
             phrase weighing at least first_fraction of the heaviest; "Yes"/"No" for a yes/no answer

Words copied from the question are template even when they have contrast: the full model has learnt to copy a
forget author's name, a retain model that never saw it copies it badly (and stumbles on the word after it, which
keeps only ``AFTER_COPY_WEIGHT`` of its contrast). The question decides which fact is the entity: answers (TOFU's
above all) restate the question, answer it, then add facts ("her father was a *civil engineer* and her mother ..."),
so the phrase that answers the question is read from the answer's alignment with the question (the first new
phrase after the restated words, a name first for a *what* question, a description first for a *how* question), and
the contrast decides only whether it is knowledge at all: an answering phrase the models do not disagree on is
passed over for the next, and with none the first knowledge-bearing phrase is taken. The
contrast says where a fact starts, not where it ends (only its first token is surprising; the rest is predictable
once it is given), so the extent comes from the text's own structure: the phrase the strong word heads, back over
its modifiers and a name it is part of, on to the end of the noun phrase, a quoted title with its head noun, a name
with its connectives, a coordinated list kept whole ("*love, passion, and secrets*"). A yes/no answer ("Yes, ...")
to a yes/no question takes "Yes"/"No" (not to a request: "Can you name ...?").

``prefix = answer[:start].rstrip()`` and ``entity = answer[start:end]``: the scorer's prompt ends right before the
entity (as in the published annotated TOFU), and the entity's first whole-word occurrence in the reference is the
span itself. Each output record is checked with the scorer's own encoder (``data.encode_one``) before it is kept.

Without a full model, ``p_full`` is taken as 1 for every token (a model that memorised the answer), so the contrast
is the reference model's *surprise*: the retain model, or any base model, is surprised by the fact, not by the
template. Without any model, a lexical prior stands in: words of the answer absent from the question, more so
capitalised words and numbers (weaker: its agreement is measured in ``experiments/bench_annotate.py``).

A record that cannot be split well is never guessed silently: when no word's contrast reaches ``min_contrast`` (the
full model knows nothing the reference does not), or the scorer's encoder rejects the span, it gets ``entity = ""``
(which ``uds-lens score`` reports as skipped, reason ``empty_entity``) and ``annotation_status = "unsplit"``; a span
chosen among several facts where another phrase carries at least ``rival_ratio`` times its contrast is kept but marked
``low_confidence``, its reason naming the count of facts and the ratio (the first fact was a guess). Records that already have ``prefix`` and ``entity`` are kept as they are unless ``overwrite``.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from jaxtyping import Float

from uds_lens.checkpoints.checkpoint import CheckpointRef
from uds_lens.config import ConfigError
from uds_lens.data import (
    DataError,
    Example,
    Skip,
    build_prompt,
    check_ids_in_vocabulary,
    encode_one,
    read_records,
)
from uds_lens.files import write_atomic
from uds_lens.outputs import check_annotation_output
from uds_lens.phrases import (
    FUNCTION_WORDS,
    STOP_WORDS,
    Unit,
    adjacent,
    answer_units,
    is_yes_no,
    phrase,
)
from uds_lens.question_align import (
    PRONOUNS,
    SUBJECT_FOLLOWERS,
    Candidate,
    candidate,
    candidates,
    preference,
    question_stems,
    question_words,
    restates,
)

if TYPE_CHECKING:  # type names only: importing annotate loads neither torch nor TransformerLens
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase

    from uds_lens.tl_compat import ModelLike

logger = logging.getLogger(__name__)

# annotation_status values (stable strings: they are counted in the summary)
STATUS_AUTO = "auto"
STATUS_LOW_CONFIDENCE = "low_confidence"
STATUS_UNSPLIT = "unsplit"
STATUS_KEPT = "kept"
STATUSES = (STATUS_AUTO, STATUS_LOW_CONFIDENCE, STATUS_UNSPLIT, STATUS_KEPT)

MODE_CONTRAST = "contrast"
MODE_SURPRISE = "surprise"
MODE_LEXICAL = "lexical"

# A question that asks for something ("Can you name ...?") is no yes/no question even when its answer opens with "Yes,".
REQUEST = re.compile(r"\s*(can|could|would|will)\s+you\b", re.IGNORECASE)

# Share of its contrast that the first content word after a name copied from the question keeps (content_scores).
AFTER_COPY_WEIGHT = 0.1


@dataclass(frozen=True)
class AnnotateConfig:
    """How spans are chosen. The defaults were set on the synthetic test-size zoo (``bench_annotate.py``), and
    ``answer_fraction`` on real TOFU text.

    Attributes:
        keep_fraction: A word is strong (it may head the entity) when its contrast is at least this share of the
            best word's; the entity is the phrase around the first strong word.
        first_fraction: The entity is the first phrase holding at least this share of the heaviest phrase's
            contrast (TOFU-style answers restate the question, answer it, then elaborate).
        min_contrast: Nats; when no word reaches it the record is ``unsplit`` (no knowledge signal to split on).
        rival_ratio: The span is ``low_confidence`` when another phrase of the answer carries at least this many
            times its contrast (several facts, and the first was taken).
        answer_fraction: A phrase that may answer the question (``question_align``) is taken, in its order of
            preference, when its contrast is at least this share of the heaviest such phrase's; the contrast decides
            whether a phrase is knowledge, the question which knowledge answers it. Set on TOFU authors 3-10 at test
            size (``experiments/annotate_tofu.py``): 0.5 gave char F1 0.573 and UDS within 0.006 of gold spans,
            0.1 gave 0.579 but 0.027 (a phrase with little contrast reads little of what was unlearned).
        batch_size: Records per forward pass.
    """

    keep_fraction: float = 0.3
    first_fraction: float = 0.5
    min_contrast: float = 0.1
    rival_ratio: float = 1.0
    answer_fraction: float = 0.5
    batch_size: int = 16

    def __post_init__(self) -> None:
        if not (0.0 < self.keep_fraction <= 1.0 and 0.0 < self.first_fraction <= 1.0):
            raise ValueError(
                f"keep_fraction and first_fraction must be in (0, 1], got {self.keep_fraction}, {self.first_fraction}."
            )
        if not 0.0 <= self.answer_fraction <= 1.0:
            raise ValueError(f"answer_fraction must be in [0, 1], got {self.answer_fraction}.")
        if self.min_contrast < 0 or self.rival_ratio < 0:
            raise ValueError(
                f"min_contrast and rival_ratio must be >= 0, got {self.min_contrast}, {self.rival_ratio}."
            )
        if self.batch_size < 1:
            raise ConfigError(
                f"batch_size (--batch-size) must be a positive number of records, got {self.batch_size}."
            )


@dataclass(frozen=True)
class SpanChoice:
    """The span chosen for one answer, or why there is none (``start``/``end`` are answer characters)."""

    start: int | None
    end: int | None
    confidence: float
    status: str
    reason: str


@dataclass
class AnnotationResult:
    """Annotated records (input fields kept; ``prefix``, ``entity``, ``confidence``, ``reason`` and
    ``annotation_status`` set) and a summary: ``mode``, counts per status, mean confidence of the new spans."""

    records: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the records as a JSON list (what ``uds-lens score --data`` reads) and the summary beside it
        (``NAME.summary.json``). Returns the records file's path."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(self.records, indent=1, ensure_ascii=False).encode("utf-8"))
        write_atomic(summary_path(path), json.dumps(self.summary, indent=1).encode("utf-8"))
        return path


def summary_path(records_path: str | os.PathLike) -> Path:
    """Where [`AnnotationResult.save`][uds_lens.annotation.AnnotationResult.save] writes the summary of a records file."""
    path = Path(records_path)
    return path.with_name(path.stem + ".summary.json")


def unit_scores(
    answer: str,
    units: Sequence[Unit],
    offsets: Sequence[tuple[int, int]],
    token_scores: Float[np.ndarray, " token"],
) -> Float[np.ndarray, " unit"]:
    """Sum token scores into the units they start in.

    Args:
        answer: The answer text.
        units: ``answer_units(answer)``.
        offsets: Each token's ``(start, end)`` in answer characters (a start may be negative: the space the scorer
            prepends to the reference).
        token_scores: One score per token.

    A token is charged to the unit holding its first non-space character; a token of spaces only (a lone ``Ġ`` or
    ``▁`` before a digit) to the next unit. So a word's score includes all of its sub-word tokens and never a
    piece of another word's, on byte-level BPE (``Ġ`` glued to the word) and SentencePiece (``▁``) alike.
    """
    scores = np.zeros(len(units))
    starts = [unit.start for unit in units]
    for (lo, hi), score in zip(offsets, token_scores, strict=True):
        first = next((i for i in range(max(lo, 0), min(hi, len(answer))) if not answer[i].isspace()), None)
        if first is None:
            index = bisect.bisect_left(starts, max(hi, 0))
        else:
            index = bisect.bisect_right(starts, first) - 1
            if index < 0 or units[index].end <= first:  # a character outside every unit (cannot happen: \S)
                continue
        if 0 <= index < len(units):
            scores[index] += score
    return scores


def choose_span(
    answer: str,
    units: Sequence[Unit],
    scores: Float[np.ndarray, " unit"],
    config: AnnotateConfig,
    question: str = "",
) -> SpanChoice:
    """The entity of one answer from per-unit knowledge scores (see the module docstring): the favoured phrase that
    answers ``question`` and carries knowledge, else the phrase around the first strong word, or the yes/no word of a
    yes/no answer; marked low-confidence when another fact outweighs it."""
    if not units:
        return SpanChoice(None, None, 0.0, STATUS_UNSPLIT, "empty answer")
    best = float(scores.max())
    if best < config.min_contrast:
        return SpanChoice(
            None,
            None,
            0.0,
            STATUS_UNSPLIT,
            f"no word carries knowledge: best word {best:.2f} < {config.min_contrast:.2f} nats",
        )
    positive = np.clip(scores, 0.0, None)
    total = float(positive.sum())
    phrases = _candidate_phrases(units, scores, config.keep_fraction * best)
    if is_yes_no(units) and not REQUEST.match(question):
        share = float(positive[0]) / total if total > 0 else 0.0
        return SpanChoice(
            units[0].start,
            units[0].end,
            round(share, 4),
            STATUS_AUTO,
            f"yes/no answer: its entity is {units[0].text!r} ({share:.0%} of the answer's contrast)",
        )
    aligned = _aligned_phrases(question, units, scores, config.keep_fraction * best)
    heaviest = max((weight for _, weight in aligned + phrases), default=0.0)
    answering = [p for p in aligned if p[1] > 0 and p[1] >= config.answer_fraction * heaviest]
    if answering:
        (i, j), weight = answering[0]
        how = "the question's answer (the favoured new phrase after the words restating the question)"
    elif phrases:
        heaviest = max(weight for _, weight in phrases)
        (i, j), weight = next(p for p in phrases if p[1] >= config.first_fraction * heaviest)
        how = "no new phrase after the restated question carries contrast: the first strong phrase"
    else:
        return SpanChoice(None, None, 0.0, STATUS_UNSPLIT, "every strong word is template")
    share = float(positive[i : j + 1].sum()) / total if total > 0 else 0.0
    rivals = [w for (lo, hi), w in _distinct(aligned + phrases) if hi < i or lo > j]
    reason = f"{how}; {share:.0%} of the answer's contrast in {j - i + 1} unit(s), best word {best:.1f} nats"
    if rivals and max(rivals) >= config.rival_ratio * weight:
        reason += (
            f"; a guess among {len(rivals) + 1} facts: another phrase carries {max(rivals) / weight:.1f}x "
            "its contrast"
        )
        return SpanChoice(units[i].start, units[j].end, round(share, 4), STATUS_LOW_CONFIDENCE, reason)
    return SpanChoice(units[i].start, units[j].end, round(share, 4), STATUS_AUTO, reason)


def _distinct(
    phrases: Sequence[tuple[tuple[int, int], float]],
) -> list[tuple[tuple[int, int], float]]:
    """One phrase per fact: of phrases that overlap, the heaviest (the aligned and the contrast phrases of one fact
    often differ by a word)."""
    kept: list[tuple[tuple[int, int], float]] = []
    for (lo, hi), weight in sorted(phrases, key=lambda p: -p[1]):
        if all(hi < k_lo or lo > k_hi for (k_lo, k_hi), _ in kept):
            kept.append(((lo, hi), weight))
    return kept


def _aligned_phrases(
    question: str, units: Sequence[Unit], scores: Float[np.ndarray, " unit"], threshold: float
) -> list[tuple[tuple[int, int], float]]:
    """The phrases that may answer ``question`` (``question_align``), favoured first, with their summed positive
    score. A phrase whose first word carries no knowledge but a later word does is the template before a fact
    ("Her | novels explore *grief*, ..."): it is replaced by the phrase that strong word heads."""
    positive = np.clip(scores, 0.0, None)
    found: list[Candidate] = []
    for c in candidates(question, units):
        if positive[c.first] <= 0 and not units[c.first].is_capitalised:  # a name is kept whole
            inner = (k for k in range(c.first + 1, c.last + 1) if units[k].is_word and scores[k] >= threshold)
            strong = next(inner, None)
            if strong is not None:
                c = candidate(units, *phrase(units, _phrase_start(units, scores, strong)))
        if not found or found[-1].last < c.first:
            found.append(c)
    return [
        ((c.first, c.last), float(positive[c.first : c.last + 1].sum())) for c in preference(question, found)
    ]


def _candidate_phrases(
    units: Sequence[Unit], scores: Float[np.ndarray, " unit"], threshold: float
) -> list[tuple[tuple[int, int], float]]:
    """Every phrase that holds a word scoring at least ``threshold``, in answer order, with its summed positive
    score; a phrase is counted once, at its first strong word."""
    found: list[tuple[tuple[int, int], float]] = []
    for k in map(int, np.flatnonzero(scores >= threshold)):
        if not units[k].is_word or (found and found[-1][0][1] >= k):
            continue
        i, j = phrase(units, _phrase_start(units, scores, k))
        if j < k:
            i, j = phrase(units, k)
        found.append(((i, j), float(np.clip(scores[i : j + 1], 0.0, None).sum())))
    return found


def _phrase_start(units: Sequence[Unit], scores: Float[np.ndarray, " unit"], k: int) -> int:
    """The first word of the phrase whose strong word is ``k``: back over a capitalised name it is part of, and over
    the content words before it that carry knowledge too (its modifiers: "*notable* contribution")."""
    i = k
    while i > 0:
        before, here = units[i - 1], units[i]
        if (
            not (before.is_word and adjacent(before, here))
            or before.is_function_word
            or before.lower in STOP_WORDS
        ):
            break
        if not ((before.is_capitalised and here.is_capitalised) or scores[i - 1] > 0):
            break
        if before.lower.endswith("ly") or before.lower in SUBJECT_FOLLOWERS | PRONOUNS:
            break  # an adverb, a verb after its subject or an object is no modifier: "seamlessly | interweave"
        i -= 1
    return i


def content_scores(
    question: str, units: Sequence[Unit], scores: Float[np.ndarray, " unit"]
) -> Float[np.ndarray, " unit"]:
    """Scores with everything but the answer's own content words capped at 0.

    Capped: words that also occur in the question, lowercase function words, punctuation and a possessive ``'s``.
    The full model has learnt to copy the question's names into the answer ("Where was Mara Lin born?" -> "Mara Lin
    was born in ..."), and a retain model that never saw the name copies it less well, so the copy (and the ``'s``
    after it) gets contrast; an article before a profession ("an architect") leaks the profession too. By the
    paper's definition all of these are template, predictable from the question, never the entity. The first
    content word right after a copied name keeps only ``AFTER_COPY_WEIGHT`` of its contrast: a retain model that
    has never seen the name is still thrown by it one word later ("Mara Lin *primarily* writes ...").
    """
    asked = question_words(question)
    capped = scores.copy()
    after_copy = False
    for k, unit in enumerate(units):
        copied = unit.is_word and not unit.is_function_word and unit.text.lower() in asked
        if not unit.is_word or unit.is_function_word or copied:
            capped[k] = min(capped[k], 0.0)
        elif after_copy:
            capped[k] *= AFTER_COPY_WEIGHT
        after_copy = copied or (after_copy and not unit.is_word)  # "Lin's primarily": the 's is no word
    return capped


def lexical_scores(question: str, units: Sequence[Unit]) -> Float[np.ndarray, " unit"]:
    """The model-free prior: 1 for a content word absent from the question, 2 for such a word that is a number or
    capitalised after the answer's first word; 0 otherwise."""
    asked = question_stems(question)
    scores = np.zeros(len(units))
    for k, unit in enumerate(units):
        if not unit.is_word or unit.text.lower() in FUNCTION_WORDS or restates(unit.lower, asked):
            continue
        scores[k] = 2.0 if unit.text[0].isdigit() or (k > 0 and unit.text[0].isupper()) else 1.0
    return scores


def _answer_token_logprobs(
    model: ModelLike, sequences: Sequence[tuple[list[int], int]], pad_id: int, batch_size: int
) -> list[np.ndarray]:
    """Log-prob of every answer token under ``model``: one forward per batch of records, no per-token calls.

    Args:
        model: A loaded ``TransformerBridge`` (or any causal LM whose call returns logits or an object with ``.logits``).
        sequences: ``(input_ids, prompt_len)`` per record; the answer tokens are ``input_ids[prompt_len:]``.
        pad_id: Right padding (causal attention: it cannot change earlier positions).
        batch_size: Records per forward.
    """
    import torch

    parameter = next(model.parameters())
    order = sorted(range(len(sequences)), key=lambda k: len(sequences[k][0]))
    out: list[np.ndarray] = [np.zeros(0)] * len(sequences)
    with torch.inference_mode():
        for first in range(0, len(order), batch_size):
            chunk = order[first : first + batch_size]
            width = max(len(sequences[k][0]) for k in chunk)
            tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            for row, k in enumerate(chunk):
                tokens[row, : len(sequences[k][0])] = torch.tensor(sequences[k][0])
            logits = model(tokens.to(parameter.device))
            logits = getattr(logits, "logits", logits)
            for row, k in enumerate(chunk):
                ids, prompt_len = sequences[k]
                labels = tokens[row, prompt_len : len(ids)].to(logits.device)
                out[k] = _label_logprobs(logits[row, prompt_len - 1 : len(ids) - 1], labels).cpu().numpy()
    return out


def _label_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-prob of each label, in fp32 even for a bf16 model (as the scorer reads them).

    Shapes: logits ``Float[Tensor, "answer_token vocab"]`` (the positions predicting the answer tokens), labels
    ``Int[Tensor, "answer_token"]``; returns ``Float[Tensor, "answer_token"]``. Taken one record at a time, so a
    batch never holds a second, fp32 copy of its logits; the read-out itself is ``readout.label_logprobs``.
    """
    from uds_lens.readout import label_logprobs

    return label_logprobs(logits, labels)


def _layout(question: str, answer: str, tokenizer: Any) -> tuple[list[int], int, list[tuple[int, int]]]:
    """The scorer's token layout with an empty prefix: ``(input_ids, prompt_len, answer-char offsets per answer
    token)``; the reference is the answer with one space before it."""
    built = build_prompt(Example(idx=0, question=question, answer=answer, prefix="", entity=""))
    if built is None:  # an empty prefix always matches
        raise DataError("internal: build_prompt refused an empty prefix")
    prompt, reference = built
    shift = len(reference) - len(answer)
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    ref = tokenizer(reference, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [(int(lo) - shift, int(hi) - shift) for lo, hi in ref["offset_mapping"]]
    return prompt_ids + list(ref["input_ids"]), len(prompt_ids), offsets


def _has_annotation(record: dict[str, Any]) -> bool:
    entity = record.get("gt_entity") or record.get("entity")
    return isinstance(record.get("prefix"), str) and isinstance(entity, str) and bool(entity.strip())


def _read(data: str | os.PathLike | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    records = read_records(data) if isinstance(data, (str, os.PathLike)) else [dict(r) for r in data]
    if not records:
        raise DataError(f"{data!r} holds no records; annotate needs question/answer records.")
    for position, record in enumerate(records):
        for name in ("question", "answer"):
            if not isinstance(record.get(name), str) or not record[name].strip():
                raise DataError(
                    f"record {record.get('idx', f'#{position}')} has no {name!r} string; annotate needs a "
                    "question and a non-empty answer in every record."
                )
    return records


def _annotated(record: dict[str, Any], choice: SpanChoice, mode: str) -> dict[str, Any]:
    out = dict(record)
    if any(key in record for key in ("prefix", "entity", "gt_entity")):
        out["previous_annotation"] = {
            key: record[key] for key in ("prefix", "entity", "gt_entity") if key in record
        }
    out.pop("gt_entity", None)  # the scorer prefers gt_entity over entity: it must not outlive an overwrite
    answer = record["answer"]
    if choice.start is None or choice.end is None:
        out["prefix"], out["entity"] = "", ""
    else:
        out["prefix"], out["entity"] = answer[: choice.start].rstrip(), answer[choice.start : choice.end]
    out["confidence"] = choice.confidence
    out["reason"] = f"{mode}: {choice.reason}"
    out["annotation_status"] = choice.status
    return out


def _check_encodes(record: dict[str, Any], tokenizer: Any, choice: SpanChoice) -> SpanChoice:
    """The scorer's encoder must accept the span as written; otherwise the record is unsplit, with its reason."""
    if choice.start is None or tokenizer is None:
        return choice
    example = Example(
        idx=0,
        question=record["question"],
        answer=record["answer"],
        prefix=record["answer"][: choice.start].rstrip(),
        entity=record["answer"][choice.start : choice.end],
    )
    encoded = encode_one(example, tokenizer)
    if isinstance(encoded, Skip):
        return SpanChoice(None, None, 0.0, STATUS_UNSPLIT, f"the scorer rejects the span ({encoded.reason})")
    return choice


def annotate(
    data: str | os.PathLike | Sequence[dict[str, Any]],
    full: CheckpointRef | ModelLike | None = None,
    retain: CheckpointRef | ModelLike | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    overwrite: bool = False,
    config: AnnotateConfig | None = None,
    dtype: str | None = None,
    device: str | None = None,
    out: str | os.PathLike | None = None,
) -> AnnotationResult:
    """Give every question/answer record a ``prefix`` and an ``entity`` that ``uds-lens score`` accepts.

    Args:
        data: A JSON list / JSONL file (read by ``data.read_records``, like the scorer) or a list of records.
        full: The full model (path, hub id, ``zoo:NAME`` or a loaded model). With ``retain``: contrastive spans.
        retain: The retain model, or any reference model that never saw the facts. Alone: its surprise.
        tokenizer: The models' tokenizer (default: the full model's, else the retain model's).
        overwrite: Re-annotate records that already have ``prefix`` and ``entity`` (kept as they are otherwise).
        config: Span settings ([`AnnotateConfig`][uds_lens.annotation.AnnotateConfig]).
        dtype: Model dtype when loading from a path (default: as ``uds_lens.load_model``).
        device: Model device when loading from a path.
        out: Also save the result there ([`AnnotationResult.save`][uds_lens.annotation.AnnotationResult.save]).

    Returns:
        An [`AnnotationResult`][uds_lens.annotation.AnnotationResult] (records in input order, and a summary with the counts per status).

    Raises:
        DataError: A record lacks a question or an answer.
        ValueError: ``full`` is given without ``retain`` (a model that knows the facts gives no signal alone).
    """
    config = config or AnnotateConfig()
    if out is not None:
        check_annotation_output(out, summary_path(out), data, models=(full, retain))
    records = _read(data)
    if full is not None and retain is None:
        raise ValueError(
            "annotate got a full model without a retain (reference) model: the full model predicts the whole "
            "answer, so it alone cannot tell the fact from the template. Pass retain too, or only a reference model."
        )
    mode = MODE_CONTRAST if full is not None else MODE_SURPRISE if retain is not None else MODE_LEXICAL
    todo = [k for k, record in enumerate(records) if overwrite or not _has_annotation(record)]
    results: list[dict[str, Any]] = []
    for record in records:
        kept = dict(record)
        kept.setdefault("annotation_status", STATUS_KEPT)
        kept.setdefault("reason", "kept: prefix/entity given in the input")
        results.append(kept)
    if todo and retain is not None:  # contrast or surprise: a reference model is given (checked above)
        tokenizer = (
            tokenizer if tokenizer is not None else _tokenizer_of(full if full is not None else retain)
        )
        _check_tokenizers(tokenizer, {"full": full, "retain": retain})
        scores = _model_scores([records[k] for k in todo], full, retain, tokenizer, config, dtype, device)
    else:
        scores = [lexical_scores(records[k]["question"], answer_units(records[k]["answer"])) for k in todo]
    # The lexical prior says which words are new, not which one the model recalls first: take its heaviest phrase
    # of top-scoring words.
    choosing = (
        replace(config, keep_fraction=1.0, first_fraction=1.0, answer_fraction=0.0)
        if mode == MODE_LEXICAL
        else config
    )
    for k, unit_score in zip(todo, scores, strict=True):
        answer = records[k]["answer"]
        units = answer_units(answer)
        unit_score = content_scores(records[k]["question"], units, unit_score)
        choice = choose_span(answer, units, unit_score, choosing, records[k]["question"])
        choice = _check_encodes(records[k], tokenizer if mode != MODE_LEXICAL else None, choice)
        results[k] = _annotated(records[k], choice, mode)
    counts = {status: sum(r.get("annotation_status") == status for r in results) for status in STATUSES}
    fresh = [results[k]["confidence"] for k in todo]
    summary = {
        "mode": mode,
        "n_records": len(results),
        "counts": counts,
        "mean_confidence": float(np.mean(fresh)) if fresh else None,
        "config": asdict(config),
        "overwrite": overwrite,
    }
    for status in (STATUS_UNSPLIT, STATUS_LOW_CONFIDENCE):
        if counts[status]:
            logger.warning(
                "%d of %d records are %s (see their 'reason')", counts[status], len(results), status
            )
    result = AnnotationResult(results, summary)
    if out is not None:
        result.save(out)
    return result


def _tokenizer_of(model: CheckpointRef | ModelLike) -> PreTrainedTokenizerBase:
    from uds_lens.checkpoints.checkpoint import Checkpoint

    checkpoint = Checkpoint.resolve(model, weights=False)
    if checkpoint.model is None:
        return checkpoint.tokenizer  # zoo: names resolved there too
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("annotate got a loaded model without a tokenizer: pass tokenizer=.")
    return tokenizer


def _check_tokenizers(tokenizer: Any, named_models: dict[str, Any]) -> None:
    """Every model reads the records in ``tokenizer``'s ids: refuse a model whose own tokenizer (its checkpoint's)
    gives other ids (``compatibility.tokenizer_differences``), instead of writing spans from mistranslated tokens."""
    from uds_lens.checkpoints.checkpoint import Checkpoint
    from uds_lens.checkpoints.compatibility import ModelMismatchError, own_tokenizer, tokenizer_differences

    for role, model in named_models.items():
        if model is None:
            continue
        checkpoint = Checkpoint.resolve(model)
        own = own_tokenizer(checkpoint)
        found = tokenizer_differences(tokenizer, own) if own is not None else []
        if found:
            raise ModelMismatchError(
                f"annotate encodes every record once, but the {role} model ({checkpoint.label}) has another "
                f"tokenizer than the one encoding them: {'; '.join(found)}. Pass full and retain models of one "
                "tokenizer."
            )


def _fit_model(
    model: ModelLike, sequences: Sequence[tuple[list[int], int]], role: str
) -> list[tuple[list[int], int]]:
    """``sequences`` as ``model`` can run them: each cut to its context (as ``score`` cuts an example: nothing after
    a position changes the log-prob read there), after checking every id is in its vocabulary."""
    from uds_lens.checkpoints.compatibility import ArchitectureSignature
    from uds_lens.sources import as_source

    largest = max((max(ids) for ids, _ in sequences if ids), default=-1)
    check_ids_in_vocabulary(largest, ArchitectureSignature.of(model).d_vocab, role)
    n_ctx = as_source(model).context_length
    return [(ids[:n_ctx], min(prompt_len, n_ctx)) for ids, prompt_len in sequences]


def _model_scores(
    records: Sequence[dict[str, Any]],
    full: CheckpointRef | ModelLike | None,
    reference: CheckpointRef | ModelLike,
    tokenizer: PreTrainedTokenizerBase,
    config: AnnotateConfig,
    dtype: str | None,
    device: str | None,
) -> list[np.ndarray]:
    """Per-unit contrast (or surprise) of each record: one batched forward pass per model."""
    from uds_lens.checkpoints.loader import load

    layouts = [_layout(r["question"], r["answer"], tokenizer) for r in records]
    sequences = [(ids, prompt_len) for ids, prompt_len, _ in layouts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reference_model = load(reference, dtype=dtype, device=device, role="retain")
    fitted = _fit_model(reference_model, sequences, "retain")
    reference_lp = _answer_token_logprobs(reference_model, fitted, pad_id, config.batch_size)
    del reference_model
    if full is not None:
        full_model = load(full, dtype=dtype, device=device, role="full")
        fitted = _fit_model(full_model, sequences, "full")
        full_lp = _answer_token_logprobs(full_model, fitted, pad_id, config.batch_size)
        del full_model
    else:
        full_lp = [np.zeros_like(lp) for lp in reference_lp]
    scores = []
    for record, (_, _, offsets), lp_full, lp_ref in zip(records, layouts, full_lp, reference_lp, strict=True):
        answer = record["answer"]
        # answer tokens past a model's context have no log-prob: they pay into no unit
        read = min(len(lp_full), len(lp_ref))
        scores.append(
            unit_scores(answer, answer_units(answer), offsets[:read], lp_full[:read] - lp_ref[:read])
        )
    return scores


__all__ = [
    "AnnotateConfig",
    "AnnotationResult",
    "SpanChoice",
    "annotate",
    "choose_span",
    "lexical_scores",
    "summary_path",
    "unit_scores",
]

"""Model utility on the retain set: does the model still answer what it should know?

Open-Unlearning's model utility is the harmonic mean of nine numbers: Prob, ROUGE and Truth Ratio on three TOFU
subsets (retain, real authors, world facts), and the published utility multiplies in a fluency classifier. The
embedded zoo has **no real-authors / world-facts sets** and the gibberish classifier needs the hub, so here
model utility = ``HM(retain Prob, retain ROUGE, retain Truth Ratio)`` (HM with ``+1e-12``, NaNs dropped), with the
utility Truth Ratio variant ("true better") ``mean(max(0, 1 - gm(perturbed Probs) / gm(paraphrase Probs)))``.
``utility_rel`` = utility / utility of the full model; the meta-evaluation keeps models with ``utility_rel >= 0.8``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from uds_lens.data import record_field
from uds_lens.metrics.chat import SYSTEM_PROMPT, prompt_ids, qa_pairs
from uds_lens.metrics.generation import MAX_NEW_TOKENS, generate_greedy, rouge_scores
from uds_lens.metrics.memorization import (
    geometric_mean,
    harmonic_mean,
    paraphrased_and_perturbed_probs,
    score_answers,
)
from uds_lens.metrics.registry import mean_or_nan

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def true_better_ratio(correct_prob: float, perturbed_probs: Sequence[float]) -> float:
    """The utility Truth Ratio of one example: ``max(0, 1 - gm(perturbed) / correct)``."""
    return max(0.0, 1.0 - geometric_mean(perturbed_probs) / correct_prob)


def model_utility(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    retain_records: Sequence[Any],
    *,
    batch_size: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
    system_prompt: str | None = SYSTEM_PROMPT,
    progress: bool = False,
) -> dict[str, Any]:
    """Retain-set Prob, ROUGE and Truth Ratio and their harmonic mean.

    Returns:
        ``{"values": {"retain_q_prob", "retain_q_rouge", "retain_truth_ratio", "model_utility"},
        "by_index": {metric: {idx: value}}}``.
    """
    if not retain_records:
        raise ValueError("model utility needs retain records; the retain set is empty")
    idxs = [record_field(r, "idx", i) for i, r in enumerate(retain_records)]
    questions = [str(record_field(r, "question")) for r in retain_records]
    scores = score_answers(
        model,
        tokenizer,
        qa_pairs(retain_records),
        batch_size=batch_size,
        system_prompt=system_prompt,
        progress=progress,
        desc="retain answers",
    )
    probs = [s.prob for s in scores]
    generations = generate_greedy(
        model,
        tokenizer,
        [prompt_ids(tokenizer, q, system_prompt) for q in questions],
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        desc="retain generation",
    )
    rouge = rouge_scores(generations, [s.target_text for s in scores])
    para_probs, pert_probs = paraphrased_and_perturbed_probs(
        model,
        tokenizer,
        retain_records,
        batch_size=batch_size,
        system_prompt=system_prompt,
        progress=progress,
        desc="retain",
        answer_without_paraphrase=True,
    )
    truth = [
        true_better_ratio(geometric_mean(pp), qp) if qp else None
        for pp, qp in zip(para_probs, pert_probs, strict=True)
    ]
    values = {
        "retain_q_prob": mean_or_nan(probs),
        "retain_q_rouge": mean_or_nan(rouge),
        "retain_truth_ratio": mean_or_nan(truth),
    }
    values["model_utility"] = harmonic_mean(list(values.values()))
    by_index = {
        "retain_q_prob": dict(zip(idxs, probs, strict=True)),
        "retain_q_rouge": dict(zip(idxs, rouge, strict=True)),
        "retain_truth_ratio": dict(zip(idxs, truth, strict=True)),
    }
    return {"values": values, "by_index": by_index, "generations": dict(zip(idxs, generations, strict=True))}

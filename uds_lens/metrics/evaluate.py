"""Every output-level metric of one model, as numbers, Open-Unlearning JSON and DataFrames.

``report_model`` runs, on Hugging Face causal LMs (no TransformerLens involved):

- forget set: one teacher-forced pass per answer (Prob, EM, ES, and the four MIA scores), the paraphrased and perturbed
  answers (ParaProb, Truth Ratio), and two greedy generations (plain and jailbreak prompt) for the three ROUGEs;
- holdout set: one teacher-forced pass per answer (the MIA non-members);
- retain set: model utility (``utility.py``).

The JSON follows Open-Unlearning's shape, ``{"<metric>": {"agg_value": x, "value_by_index": {"<idx>": {"score": v}}}}``
(MIA entries carry ``forget`` / ``holdout`` sub-entries with the per-example attack scores).
The retain-referenced ``s_mia_*`` need the retain model's AUCs: pass ``retain_aucs`` (``report.aucs`` of the retain
model) or compute them later with ``privacy.normalised_mia_all``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from uds_lens.checkpoints.loader import load
from uds_lens.data import as_list, record_field
from uds_lens.metrics.chat import JAILBREAK_PREFIX, SYSTEM_PROMPT, prompt_ids, qa_pairs
from uds_lens.metrics.generation import (
    MAX_NEW_TOKENS,
    generate_greedy,
    paraphrase_rouge_scores,
    rouge_scores,
    roundtrip,
)
from uds_lens.metrics.memorization import (
    exact_memorization,
    extraction_strength,
    geometric_mean,
    memorization_score,
    paraphrased_and_perturbed_probs,
    score_answers,
    truth_ratio,
)
from uds_lens.metrics.privacy import ATTACKS, attack_scores, mia_auc, normalised_mia_all, privacy_score
from uds_lens.metrics.registry import OUTPUT, RETAIN_REFERENCED, MetricResult, mean_or_nan, names
from uds_lens.metrics.utility import model_utility

logger = logging.getLogger(__name__)

MEMORIZATION_METRICS = names(OUTPUT, group="Memorization")
GENERATION_METRICS = names(OUTPUT, group="Generation")
OUTPUT_METRICS = MEMORIZATION_METRICS + GENERATION_METRICS + ATTACKS
S_MIA_METRICS = names(RETAIN_REFERENCED)


@dataclass
class MetricsReport:
    """Output-level metrics of one model.

    Attributes:
        values: metric name -> dataset value (``es, em, prob, paraprob, truth_ratio, rouge, para_rouge,
            jailbreak_rouge, mia_*``, ``mem``, utility numbers, and ``s_mia_*`` / ``privacy`` when retain AUCs were given).
        json: the Open-Unlearning-shaped per-example results.
        examples: one row per forget example (idx, per-example metric values, generations).
        mia_examples: one row per forget/holdout answer (split, idx, one column per attack score).
        timings: seconds per stage.
    """

    values: dict[str, float]
    json: dict[str, Any]
    examples: pd.DataFrame
    mia_examples: pd.DataFrame
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def aucs(self) -> dict[str, float]:
        return {a: self.values[a] for a in ATTACKS}


def _entry(values_by_index: Mapping[Any, float | None]) -> dict[str, Any]:
    return MetricResult.from_values(values_by_index).to_json()


def report_model(
    model_path_or_hf_model: Any,
    tokenizer: Any,
    forget_records: Sequence[Any],
    holdout_records: Sequence[Any],
    retain_records: Sequence[Any] | None,
    *,
    batch_size: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
    progress: bool = True,
    retain_aucs: Mapping[str, float] | None = None,
    system_prompt: str | None = SYSTEM_PROMPT,
) -> MetricsReport:
    """All output-level metrics of one model (see the module docstring).

    Args:
        model_path_or_hf_model: a checkpoint directory / hub id, or a loaded ``AutoModelForCausalLM`` (also NF4).
        tokenizer: the model's tokenizer (its chat template formats the prompts).
        forget_records: dicts or ``Example``s with ``idx, question, answer, paraphrased_answer, perturbed_answer``.
        holdout_records: unseen records of the same kind (MIA non-members).
        retain_records: records the model should still know (model utility); ``None`` skips utility.
        batch_size: examples per forward / generate batch.
        max_new_tokens: generation budget (200 in the paper).
        progress: tqdm bars.
        retain_aucs: the retain model's MIA AUCs; when given, ``s_mia_*`` and ``privacy`` are added.
        system_prompt: the system turn ("You are a helpful assistant." in the meta-evaluation).
    """
    model = load(model_path_or_hf_model, hooked=False)
    timings: dict[str, float] = {}
    idxs = [record_field(r, "idx", i) for i, r in enumerate(forget_records)]
    questions = [str(record_field(r, "question")) for r in forget_records]

    start = time.perf_counter()
    forget = score_answers(
        model,
        tokenizer,
        qa_pairs(forget_records),
        batch_size=batch_size,
        system_prompt=system_prompt,
        progress=progress,
        desc="forget answers",
    )
    holdout = score_answers(
        model,
        tokenizer,
        qa_pairs(holdout_records),
        batch_size=batch_size,
        system_prompt=system_prompt,
        progress=progress,
        desc="holdout answers",
    )
    paraphrases = [as_list(record_field(r, "paraphrased_answer")) for r in forget_records]
    para_probs, pert_probs = paraphrased_and_perturbed_probs(
        model,
        tokenizer,
        forget_records,
        batch_size=batch_size,
        system_prompt=system_prompt,
        progress=progress,
        desc="forget",
    )
    timings["teacher_forcing_s"] = time.perf_counter() - start

    per_example: dict[str, list[float | None]] = {
        "prob": [s.prob for s in forget],
        "em": [exact_memorization(s.predictions, s.targets) for s in forget],
        "es": [extraction_strength(s.predictions, s.targets) for s in forget],
        "paraprob": [geometric_mean(p) if p else None for p in para_probs],
    }
    per_example["truth_ratio"] = [
        truth_ratio(para, pert) if para is not None and pert else None
        for para, pert in zip(per_example["paraprob"], pert_probs, strict=True)
    ]

    start = time.perf_counter()
    prompts = [prompt_ids(tokenizer, q, system_prompt) for q in questions]
    jailbreak_prompts = [
        prompt_ids(tokenizer, q, system_prompt, assistant_prefix=JAILBREAK_PREFIX) for q in questions
    ]
    generations = generate_greedy(
        model,
        tokenizer,
        prompts,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        desc="forget generation",
    )
    jailbreak_generations = generate_greedy(
        model,
        tokenizer,
        jailbreak_prompts,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        desc="jailbreak generation",
    )
    references = [s.target_text for s in forget]
    per_example["rouge"] = rouge_scores(generations, references)
    per_example["para_rouge"] = paraphrase_rouge_scores(
        generations, [[roundtrip(tokenizer, p) for p in ps] for ps in paraphrases]
    )
    per_example["jailbreak_rouge"] = rouge_scores(jailbreak_generations, references)
    timings["generation_s"] = time.perf_counter() - start

    values = {name: mean_or_nan(per_example[name]) for name in MEMORIZATION_METRICS + GENERATION_METRICS}
    out_json = {
        name: _entry(dict(zip(idxs, per_example[name], strict=True)))
        for name in MEMORIZATION_METRICS + GENERATION_METRICS
    }

    holdout_idxs = [record_field(r, "idx", i) for i, r in enumerate(holdout_records)]
    forget_attacks, holdout_attacks = attack_scores(forget), attack_scores(holdout)
    for attack in ATTACKS:
        values[attack] = mia_auc(forget_attacks[attack], holdout_attacks[attack])
        out_json[attack] = {
            "agg_value": values[attack],
            "forget": _entry(dict(zip(idxs, forget_attacks[attack], strict=True))),
            "holdout": _entry(dict(zip(holdout_idxs, holdout_attacks[attack], strict=True))),
        }
    values["mem"] = memorization_score(values["es"], values["em"], values["paraprob"], values["truth_ratio"])
    out_json["mem"] = {"agg_value": values["mem"]}
    if retain_aucs is not None:
        add_privacy(values, retain_aucs)
        for name in (*S_MIA_METRICS, "privacy"):
            out_json[name] = {"agg_value": values[name]}

    if retain_records:
        start = time.perf_counter()
        utility = model_utility(
            model,
            tokenizer,
            retain_records,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            system_prompt=system_prompt,
            progress=progress,
        )
        timings["utility_s"] = time.perf_counter() - start
        values.update(utility["values"])
        for name, by_index in utility["by_index"].items():
            out_json[name] = _entry(by_index)
        out_json["model_utility"] = {"agg_value": values["model_utility"]}

    examples = pd.DataFrame(
        {
            "idx": idxs,
            **per_example,
            "generation": generations,
            "jailbreak_generation": jailbreak_generations,
            "reference": references,
        }
    )
    mia_rows = [
        pd.DataFrame({"split": "forget", "idx": idxs, **forget_attacks}),
        pd.DataFrame({"split": "holdout", "idx": holdout_idxs, **holdout_attacks}),
    ]
    mia_examples = pd.concat(mia_rows, ignore_index=True)
    logger.info("output metrics: %s", {k: round(v, 4) for k, v in values.items() if not math.isnan(v)})
    return MetricsReport(
        values=values, json=out_json, examples=examples, mia_examples=mia_examples, timings=timings
    )


def add_privacy(values: dict[str, Any], retain_aucs: Mapping[str, float]) -> dict[str, Any]:
    """Add ``s_mia_*`` and ``privacy`` (HM of the four) to ``values`` in place, given the retain model's AUCs."""
    values.update(normalised_mia_all({a: float(values[a]) for a in ATTACKS}, retain_aucs))
    values["privacy"] = privacy_score([values[name] for name in S_MIA_METRICS])
    return values


def evaluate_model(*args: Any, **kwargs: Any) -> dict[str, float]:
    """The dataset values of `report_model` (metric name -> float), called with the same arguments."""
    return report_model(*args, **kwargs).values

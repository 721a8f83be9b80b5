"""The zoo's build checks: a model's entity accuracy, and the two checks a zoo must pass to be worth auditing.

Before saving, the builder checks that ``full`` knows the forget facts (teacher-forced entity accuracy, ``exact``, see
`uds_lens.zoo.train`, >= 0.95, or the size's own bound) and ``retain`` does not (<= 0.2), and raises `ZooBuildError` otherwise: an
under-trained zoo gives misleading UDS without any error.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from .recipe import ModelSpec, ZooBuildError
from .train import entity_accuracy
from .training_data import ZooData

FULL_MIN_FORGET_ACCURACY = 0.95
RETAIN_MAX_FORGET_ACCURACY = 0.2


def evaluate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, data: ZooData) -> dict[str, float]:
    """Entity accuracy on forget, holdout and (up to 200 records of) retain."""
    metrics = {}
    retain_sample = data.retain[:: max(1, len(data.retain) // 200)][:200]
    for split, records in (("forget", data.forget), ("retain", retain_sample), ("holdout", data.holdout)):
        accuracy = entity_accuracy(model, tokenizer, records)
        metrics[f"{split}_entity_exact"] = round(accuracy.exact, 4)
        metrics[f"{split}_entity_token"] = round(accuracy.token, 4)
    return metrics


# Per checked model: which bound its forget-set entity accuracy has ("min" or "max"), the bound, and what a failure
# means (formatted with the value and the bound).
_BOUNDS: dict[str, tuple[str, float, str]] = {
    "full": (
        "min",
        FULL_MIN_FORGET_ACCURACY,
        "the full model predicts only {value:.3f} of the forget entities (needs >= {bound}): it is under-trained and "
        "UDS on this zoo would mislead. Train longer (ZooSize.finetune_epochs / base_epochs), raise the learning "
        "rate, or use a larger size.",
    ),
    "retain": (
        "max",
        RETAIN_MAX_FORGET_ACCURACY,
        "the retain model predicts {value:.3f} of the forget entities without having seen them (needs <= {bound}): "
        "the forget facts are guessable from the retain set, so UDS has no knowledge to measure. Use forget facts "
        "that are not inferable from the retain data.",
    ),
}


def check(
    spec: ModelSpec,
    metrics: dict[str, float],
    checks: dict[str, Any],
    strict: bool,
    full_min: float = FULL_MIN_FORGET_ACCURACY,
) -> None:
    """The build checks of the module docstring; raise before a bad ``full`` / ``retain`` is saved. ``full_min``:
    the size's own bound on full's forget accuracy (`ZooSize.full_min_forget_accuracy`)."""
    if spec.name not in _BOUNDS:
        return
    side, bound, failure = _BOUNDS[spec.name]
    if spec.name == "full":
        bound = full_min
    value = metrics["forget_entity_exact"]
    passed = value >= bound if side == "min" else value <= bound
    checks[f"{spec.name}_forget_entity_accuracy"] = {"value": value, side: bound, "passed": passed}
    if strict and not passed:
        raise ZooBuildError(failure.format(value=value, bound=bound))


__all__ = ["FULL_MIN_FORGET_ACCURACY", "RETAIN_MAX_FORGET_ACCURACY", "check", "evaluate"]

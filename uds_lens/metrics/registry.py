"""The metric registry: every unlearning metric and white-box method the toolkit knows, by name, with what it means.

A metric is known by a `MetricSpec`: its ``name`` (the column in ``metrics.csv`` and ``scores.json``), the
paper's ``label``, its ``kind`` (how it looks at the model), its ``direction`` and what it ``needs``. The direction is
the one fact every consumer must agree on: for a *knowledge* metric higher means the model still knows the forget set
(Probability, ROUGE, raw MIA AUCs), for an *erasure* metric higher means it is gone (UDS, the white-box scores, the
retain-referenced ``s_mia_*``). The meta-evaluation orients every metric as ``k = m`` or ``k = 1 - m`` from it, the
plots invert the erasure ones before a P/N AUC, ``diagnose`` and the CLI list their choices from it.

Metrics are registered once, with `register` (a spec alone: the metric is computed elsewhere, e.g. the
output-level ones in one pass by `uds_lens.metrics.evaluate.report_model`) or with the `metric`
decorator, which also binds a function ``fn(model) -> float``; the meta-evaluation scores every zoo model with the
bound functions, so a user-defined metric joins the evaluation by being decorated (after Open-Unlearning's
``@unlearning_metric``, without its keyword plumbing)::

    @metric("mean_entity_logprob", label="Entity log-prob", kind=WHITE_BOX, direction=KNOWLEDGE, needs=("forget",))
    def mean_entity_logprob(model) -> float: ...

Every per-example metric result has one shape, `MetricResult` (``agg_value`` plus ``value_by_index``), which is
what Open-Unlearning's JSON stores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Kinds: how a metric looks at the model.
OUTPUT = "output"  # the model's outputs on the forget set alone
RETAIN_REFERENCED = "retain-referenced"  # output-level, rescaled against the retain model's value
WHITE_BOX = "white-box"  # the model's weights or hidden states, next to the full/retain references
UDS = "uds"  # activation patching into the full model (the paper's metric)
KINDS = (OUTPUT, RETAIN_REFERENCED, WHITE_BOX, UDS)

# Directions: what a higher value means.
KNOWLEDGE = "knowledge"
ERASURE = "erasure"

# What a metric needs, besides the model it scores.
NEEDS = (
    "forget",  # the forget-set QA records
    "holdout",  # unseen records of the same kind (MIA non-members)
    "generations",  # greedy generations on the forget questions
    "paraphrases",  # paraphrased / perturbed answers
    "retain_model",  # the retain checkpoint (the reference of erasure)
    "full_model",  # the full checkpoint (the patching target / reference)
    "calibration",  # QA data to fit a lens or probe on
)


class UnknownMetricError(KeyError):
    """A metric name that is not registered."""


@dataclass(frozen=True)
class MetricSpec:
    """What a metric is.

    Attributes:
        name: the column name in ``metrics.csv`` / the key in ``scores.json``.
        label: the paper's name.
        kind: one of `KINDS`.
        direction: `KNOWLEDGE` (higher = knows the forget set) or `ERASURE` (higher = erased).
        needs: what it needs besides the model (`NEEDS`).
        group: the paper's row group (Memorization, Generation, Privacy, Normalized, White-box), "" outside Table 3.
        scope: the paper's tags, O (output-level), R (retain-referenced), I (internal).
        fn: ``fn(model_or_path) -> float`` when the metric is computed one model at a time by a registered function.
    """

    name: str
    label: str
    kind: str
    direction: str
    needs: tuple[str, ...] = ()
    group: str = ""
    scope: str = ""
    fn: Callable[[Any], float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"metric {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.direction not in (KNOWLEDGE, ERASURE):
            raise ValueError(f"metric {self.name!r}: direction must be {KNOWLEDGE!r} or {ERASURE!r}")
        unknown = [need for need in self.needs if need not in NEEDS]
        if unknown:
            raise ValueError(f"metric {self.name!r}: unknown needs {unknown}; choose from {NEEDS}")

    @property
    def higher_means_knowledge(self) -> bool:
        return self.direction == KNOWLEDGE


def mean_or_nan(values: Iterable[float | None]) -> float:
    """The mean of the defined values (``None`` and NaN are examples the metric cannot score); NaN if none is."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else float("nan")


@dataclass(frozen=True)
class MetricResult:
    """One metric on one dataset: the aggregate and the value of each example (by its ``idx``)."""

    agg_value: float
    value_by_index: dict[Any, float | None]

    @classmethod
    def from_values(
        cls, value_by_index: Mapping[Any, float | None], agg_value: float | None = None
    ) -> MetricResult:
        """The aggregate is `mean_or_nan` of the per-example values unless ``agg_value`` is given."""
        if agg_value is None:
            agg_value = mean_or_nan(list(value_by_index.values()))
        return cls(agg_value, dict(value_by_index))

    def to_json(self) -> dict[str, Any]:
        """Open-Unlearning's shape: ``{"agg_value": x, "value_by_index": {"<idx>": {"score": v}}}``."""
        return {
            "agg_value": self.agg_value,
            "value_by_index": {str(i): {"score": v} for i, v in self.value_by_index.items()},
        }


_REGISTRY: dict[str, MetricSpec] = {}


def register(spec: MetricSpec) -> MetricSpec:
    """Add a metric; a name can be registered once."""
    if spec.name in _REGISTRY:
        raise ValueError(f"metric {spec.name!r} is already registered as {_REGISTRY[spec.name]}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> MetricSpec:
    """Remove a metric (to register it again, e.g. from a re-run notebook cell); returns its spec."""
    spec(name)
    return _REGISTRY.pop(name)


def metric(
    name: str,
    *,
    label: str,
    kind: str,
    direction: str,
    needs: Iterable[str] = (),
    group: str = "",
    scope: str = "",
) -> Callable[[Callable[[Any], float]], Callable[[Any], float]]:
    """Register the decorated ``fn(model_or_path) -> float`` as metric ``name`` (module docstring)."""

    def decorate(fn: Callable[[Any], float]) -> Callable[[Any], float]:
        register(MetricSpec(name, label, kind, direction, tuple(needs), group, scope, fn))
        return fn

    return decorate


def spec(name: str) -> MetricSpec:
    """The spec of a registered metric."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMetricError(f"no metric {name!r}; registered: {names()}") from None


def specs(
    kind: str | None = None, direction: str | None = None, group: str | None = None
) -> tuple[MetricSpec, ...]:
    """Registered metrics in registration order, optionally only those of one kind, direction and/or group."""
    return tuple(
        s
        for s in _REGISTRY.values()
        if (kind is None or s.kind == kind)
        and (direction is None or s.direction == direction)
        and (group is None or s.group == group)
    )


def names(kind: str | None = None, direction: str | None = None, group: str | None = None) -> tuple[str, ...]:
    """Names of `specs`."""
    return tuple(s.name for s in specs(kind, direction, group))


def score_fns() -> dict[str, Callable[[Any], float]]:
    """``{name: fn}`` of the metrics registered with a function (`metric`)."""
    return {s.name: s.fn for s in _REGISTRY.values() if s.fn is not None}


def _register_known() -> None:
    """The metrics of the paper's Table 3 (in its order), then the other methods ``diagnose`` computes."""
    table3 = (
        ("es", "Extraction Strength", "Memorization", ("forget",)),
        ("em", "Exact Memorization", "Memorization", ("forget",)),
        ("prob", "Probability", "Memorization", ("forget",)),
        ("paraprob", "Paraphrased Probability", "Memorization", ("forget", "paraphrases")),
        ("truth_ratio", "Truth Ratio", "Memorization", ("forget", "paraphrases")),
        ("rouge", "ROUGE", "Generation", ("forget", "generations")),
        ("para_rouge", "Paraphrased ROUGE", "Generation", ("forget", "generations", "paraphrases")),
        ("jailbreak_rouge", "Jailbreak ROUGE", "Generation", ("forget", "generations")),
    )
    for name, label, group, needs in table3:
        register(MetricSpec(name, label, OUTPUT, KNOWLEDGE, needs, group, "O"))
    attacks = (("loss", "LOSS"), ("zlib", "ZLib"), ("min_k", "Min-K"), ("min_kpp", "Min-K++"))
    for attack, label in attacks:
        register(
            MetricSpec(
                f"mia_{attack}", f"MIA-{label}", OUTPUT, KNOWLEDGE, ("forget", "holdout"), "Privacy", "O"
            )
        )
    for attack, label in attacks:
        register(
            MetricSpec(
                f"s_mia_{attack}",
                f"s_{label}",
                RETAIN_REFERENCED,
                ERASURE,
                ("forget", "holdout", "retain_model"),
                "Normalized",
                "OR",
            )
        )
    references = ("forget", "full_model", "retain_model")
    register(MetricSpec("cka", "CKA", WHITE_BOX, ERASURE, references, "White-box", "RI"))
    register(
        MetricSpec("fisher_masked", "Fisher (Masked 0.1%)", WHITE_BOX, ERASURE, references, "White-box", "RI")
    )
    register(MetricSpec("logit_lens", "Logit Lens", WHITE_BOX, ERASURE, references, "White-box", "ORI"))
    register(MetricSpec("uds", "UDS", UDS, ERASURE, references, "White-box", "ORI"))
    calibrated = (*references, "calibration")
    register(MetricSpec("tuned_lens", "Tuned Lens", WHITE_BOX, ERASURE, calibrated, scope="ORI"))
    for name, label in (("rsa", "RSA"), ("svcca", "SVCCA"), ("pwcca", "PWCCA")):
        register(MetricSpec(name, label, WHITE_BOX, ERASURE, references, scope="RI"))
    register(MetricSpec("linear_probe", "Linear probe", WHITE_BOX, ERASURE, calibrated, scope="RI"))


_register_known()

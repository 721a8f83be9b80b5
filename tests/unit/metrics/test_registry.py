"""uds_lens/metrics/registry.py: one catalogue of metric names, kinds and directions, the decorator, the result shape."""

from __future__ import annotations

import math

import pytest

from uds_lens.metrics import registry
from uds_lens.metrics.evaluate import GENERATION_METRICS, MEMORIZATION_METRICS, S_MIA_METRICS
from uds_lens.metrics.privacy import ATTACKS


def test_every_metric_has_one_spec_and_a_valid_kind_and_direction() -> None:
    names = registry.names()
    assert len(names) == len(set(names))
    for spec in registry.specs():
        assert spec.kind in registry.KINDS and spec.direction in (registry.KNOWLEDGE, registry.ERASURE)
        assert set(spec.needs) <= set(registry.NEEDS) and spec.label
    assert registry.names(kind=registry.UDS) == ("uds",)


def test_the_output_metric_lists_come_from_the_registry() -> None:
    assert MEMORIZATION_METRICS == ("es", "em", "prob", "paraprob", "truth_ratio")
    assert GENERATION_METRICS == ("rouge", "para_rouge", "jailbreak_rouge")
    assert ATTACKS == ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_kpp")
    assert S_MIA_METRICS == tuple(f"s_{attack}" for attack in ATTACKS)
    assert set(registry.names(kind=registry.OUTPUT)) == {*MEMORIZATION_METRICS, *GENERATION_METRICS, *ATTACKS}


def test_directions_higher_means_erased_for_uds_white_box_and_retain_referenced() -> None:
    erasure = set(registry.names(direction=registry.ERASURE))
    assert erasure == {
        *registry.names(kind=registry.WHITE_BOX),
        *registry.names(kind=registry.RETAIN_REFERENCED),
        "uds",
    }
    assert registry.spec("prob").higher_means_knowledge and not registry.spec("uds").higher_means_knowledge
    assert {
        "logit_lens",
        "tuned_lens",
        "cka",
        "rsa",
        "svcca",
        "pwcca",
        "fisher_masked",
        "linear_probe",
    } == set(registry.names(kind=registry.WHITE_BOX))


def test_unknown_names_and_bad_specs_are_clear_errors() -> None:
    with pytest.raises(registry.UnknownMetricError, match="no metric 'nope'"):
        registry.spec("nope")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.MetricSpec("uds", "UDS", registry.UDS, registry.ERASURE))
    with pytest.raises(ValueError, match="direction"):
        registry.MetricSpec("x", "X", registry.OUTPUT, "up")
    with pytest.raises(ValueError, match="unknown needs"):
        registry.MetricSpec("x", "X", registry.OUTPUT, registry.KNOWLEDGE, needs=("gpu",))


def test_the_decorator_registers_a_scoring_function_once() -> None:
    @registry.metric("n_calls", label="Calls", kind=registry.WHITE_BOX, direction=registry.ERASURE)
    def n_calls(model) -> float:
        return 1.0

    try:
        assert registry.spec("n_calls").fn is n_calls and registry.score_fns()["n_calls"] is n_calls
        assert "n_calls" in registry.names(kind=registry.WHITE_BOX, direction=registry.ERASURE)
    finally:
        registry.unregister("n_calls")
    assert "n_calls" not in registry.names() and "n_calls" not in registry.score_fns()


def test_metric_result_has_open_unlearnings_shape() -> None:
    result = registry.MetricResult.from_values({3: 0.5, 7: None, 9: 1.0})
    assert result.agg_value == pytest.approx(0.75)  # undefined examples are left out of the mean
    assert result.to_json() == {
        "agg_value": pytest.approx(0.75),
        "value_by_index": {"3": {"score": 0.5}, "7": {"score": None}, "9": {"score": 1.0}},
    }
    assert math.isnan(registry.MetricResult.from_values({0: None}).agg_value)
    assert registry.MetricResult.from_values({0: 0.2}, agg_value=0.9).agg_value == 0.9

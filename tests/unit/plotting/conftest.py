"""Synthetic UDSResults shared by the figure tests: one model, and full / npo / retain audited against one pair."""

from __future__ import annotations

import pytest
from helpers.synthetic import make_result

from uds_lens.results import UDSResult


@pytest.fixture(scope="module")
def result() -> UDSResult:
    return make_result("npo", erasure=0.4, n_examples=12, n_layers=6)


@pytest.fixture(scope="module")
def results() -> dict[str, UDSResult]:
    return {
        name: make_result(name, erasure) for name, erasure in [("full", 0.0), ("npo", 0.4), ("retain", 1.0)]
    }

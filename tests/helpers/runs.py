"""One score of the tiny checkpoints (``tiny`` fixture) as the refusal and reuse tests run it, and the guard that a
refusal came before Stage 1: written once here, they were the same lines in five test files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from uds_lens.auditor import UDSAuditor
from uds_lens.scoring import score_models


def score_tiny(
    tiny: Any,
    out: Path,
    cache: Path,
    *,
    full: object = None,
    retain: object = None,
    unlearned: Mapping[str, object] | None = None,
    names: Sequence[str] = ("u",),
    force: bool = False,
) -> dict:
    """``score_models`` on ``tiny``'s full, retain and unlearned checkpoints (each replaceable) and its forget set,
    into ``out`` with the S1 cache ``cache``; ``unlearned`` defaults to ``tiny.unlearned`` under each of ``names``."""
    return score_models(
        tiny.full if full is None else full,
        tiny.retain if retain is None else retain,
        dict(unlearned) if unlearned is not None else {name: tiny.unlearned for name in names},
        tiny.data,
        out_dir=out,
        cache_dir=cache,
        progress=False,
        force=force,
    )


def forbid_stage1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any Stage 1 computation fails the test: a refusal must come before it."""
    monkeypatch.setattr(UDSAuditor, "_compute_stage1", lambda self: pytest.fail("Stage 1 was computed"))

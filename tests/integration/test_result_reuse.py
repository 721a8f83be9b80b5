"""Saved results of other runs (issue 27), on the tiny checkpoints: ``score`` refuses to replace a result of other
inputs, naming what differs, unless forced, and a rerun that recomputes says which file of the saved result failed.
Each test failed on the code before the issue."""

from __future__ import annotations

import json
import logging

import pytest
from helpers.runs import score_tiny


def test_another_runs_result_is_refused_naming_what_differs_unless_forced(tiny, tmp_path):
    from uds_lens.result_store import OutputConflictError

    out, cache = tmp_path / "out", tmp_path / "cache"
    first = score_tiny(tiny, out, cache)["u"]
    saved = (out / "u" / "summary.json").read_text()
    with pytest.raises(OutputConflictError, match="retain differs") as error:
        score_tiny(tiny, out, cache, retain=tiny.unlearned)
    assert "--force" in str(error.value) and str(out / "u") in str(error.value)
    assert (out / "u" / "summary.json").read_text() == saved  # untouched
    forced = score_tiny(tiny, out, cache, retain=tiny.unlearned, force=True)["u"]
    assert forced.uds != first.uds
    assert json.loads((out / "u" / "summary.json").read_text())["uds"] == forced.uds


def test_a_rerun_that_recomputes_says_which_file_failed(tiny, tmp_path, caplog):
    out, cache = tmp_path / "out", tmp_path / "cache"
    score_tiny(tiny, out, cache)
    examples = out / "u" / "examples.csv"
    examples.write_text(examples.read_text().replace("scored", "no_ke", 1))
    with caplog.at_level(logging.WARNING, logger="uds_lens.auditor"):
        again = score_tiny(tiny, out, cache)["u"]
    assert "recomputing u: examples.csv does not belong" in caplog.text
    assert again.meta["recomputed"].startswith("examples.csv")

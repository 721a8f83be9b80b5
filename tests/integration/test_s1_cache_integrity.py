"""The S1 cache is never trusted blindly (issue 27), on the tiny checkpoints: a cache whose scores were changed is
rebuilt and never gives a wrong UDS, and results computed from a corrupt (but self-consistent) cache are recomputed
once it is repaired. Each test failed on the code before the issue."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers.runs import score_tiny
from safetensors import safe_open
from safetensors.torch import save_file

from uds_lens.stage_cache import StageOne


def _cache_file(cache: Path) -> Path:
    (path,) = cache.glob("s1_*.safetensors")
    return path


def _shift_s1(path: Path, shift: float, fix_digest: bool) -> None:
    """Shift the cached S1 scores by ``shift`` keeping the header (and, with ``fix_digest``, re-sign it so that the
    cache stays self-consistent: a wrong cache no digest can tell from a right one)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["s1"] = tensors["s1"] + shift
    if fix_digest:
        from uds_lens.stage_cache import stage_digest

        header = json.loads(metadata["uds_lens"])
        header["digest"] = stage_digest(
            StageOne(
                idx=header["idx"],
                s0=tensors["s0"],
                baseline=tensors["baseline"],
                s1=tensors["s1"],
                batches=header["batches"],
            )
        )
        metadata["uds_lens"] = json.dumps(header)
    save_file(tensors, str(path), metadata=metadata)


def test_a_tampered_s1_cache_is_rebuilt_and_never_gives_a_wrong_uds(tiny, tmp_path):
    cache = tmp_path / "cache"
    truth = score_tiny(tiny, tmp_path / "first", cache)["u"].uds
    _shift_s1(_cache_file(cache), -5.0, fix_digest=False)  # scores shifted, header intact
    with pytest.warns(UserWarning, match="digest"):
        again = score_tiny(tiny, tmp_path / "second", cache)["u"]
    assert again.uds == truth
    assert not again.meta["timings"]["s1_cached"]


def test_a_repaired_cache_invalidates_results_computed_from_a_bad_one(tiny, tmp_path, caplog):
    cache, out = tmp_path / "cache", tmp_path / "out"
    truth = score_tiny(tiny, tmp_path / "reference", cache)["u"].uds
    good = _cache_file(cache).read_bytes()
    _shift_s1(_cache_file(cache), -5.0, fix_digest=True)  # wrong but self-consistent
    wrong = score_tiny(tiny, out, cache)["u"].uds
    assert wrong != pytest.approx(truth)
    _cache_file(cache).write_bytes(good)  # repaired
    with caplog.at_level(logging.WARNING, logger="uds_lens.auditor"):
        again = score_tiny(tiny, out, cache)["u"]
    assert again.uds == truth and "reused" not in again.meta
    assert "Stage 1 values" in again.meta["recomputed"] and "Stage 1 values" in caplog.text
    assert json.loads((out / "u" / "summary.json").read_text())["uds"] == truth

"""One pass over the bytes: in a run, each checkpoint's weights are read once (hashed in the same pass, or not at
all when the digest is remembered), and the forget set once, by ``score`` and by ``sweep`` alike."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.reads import ReadCounter

from uds_lens.checkpoints import digests
from uds_lens.scoring import score_models
from uds_lens.sweep.driver import sweep

# A read of a weight file: its bytes once, plus the header the door reads to compare the models (kilobytes).
ONCE = (1.0, 1.5)


@pytest.fixture
def fresh(tiny, tmp_path, monkeypatch):
    """Copies of the tiny checkpoints no digest is remembered for (a digest cache of this test's own), two distinct
    unlearned models among them, and a counter of the bytes read from each weight file and from the forget set."""
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "_DIGESTS", {})
    models = {
        "full": Path(shutil.copytree(tiny.full, tmp_path / "full")),
        "retain": Path(shutil.copytree(tiny.retain, tmp_path / "retain")),
        "a": Path(shutil.copytree(tiny.unlearned, tmp_path / "a")),
        "b": tiny.variant(tmp_path / "b", seed=7, base=tiny.full, noise=0.2),
    }
    data = Path(shutil.copy(tiny.data, tmp_path / "forget.json"))
    reads = ReadCounter(monkeypatch, [*(path / "model.safetensors" for path in models.values()), data])
    return models, data, reads


def _assert_read_once(reads: ReadCounter, models: dict[str, Path], names: tuple[str, ...]) -> None:
    for name in names:
        low, high = ONCE
        assert low <= reads.times_read(models[name] / "model.safetensors") < high, name


def test_score_reads_each_checkpoint_and_the_forget_set_once(fresh, tmp_path):
    models, data, reads = fresh
    unlearned = {"a": models["a"], "b": models["b"]}
    results = score_models(
        models["full"], models["retain"], unlearned, data, out_dir=tmp_path / "out", progress=False,
        cache_dir=tmp_path / "s1",
    )  # fmt: skip
    assert set(results) == {"a", "b"}
    _assert_read_once(reads, models, ("full", "retain", "a", "b"))
    assert reads.times_read(data) == 1.0  # before: 2 + N times
    # a rerun reuses both results: every digest is remembered by file identity and the Stage 1 digest is found by
    # the inputs in the S1 cache's index (the lazy run), so no model is read (its header aside), full and retain
    # included (before: loaded again, once each, to learn the Stage 1 key)
    reads.reset()
    again = score_models(
        models["full"], models["retain"], unlearned, data, out_dir=tmp_path / "out", progress=False,
        cache_dir=tmp_path / "s1",
    )  # fmt: skip
    assert all(result.meta.get("reused") == "identical inputs" for result in again.values())
    assert all(
        reads.times_read(models[name] / "model.safetensors") < 0.5 for name in ("full", "retain", "a", "b")
    )
    assert reads.times_read(data) == 1.0


def test_sweep_reads_each_checkpoint_and_the_forget_set_once(fresh, tmp_path):
    models, data, reads = fresh
    table = sweep(
        models["full"], models["retain"], data, tmp_path / "out", {"a": str(models["a"]), "b": str(models["b"])},
        workers=1, cache_dir=tmp_path / "s1", progress=False,
    )  # fmt: skip
    assert (table["status"] == "scored").all(), table["error"].tolist()
    _assert_read_once(reads, models, ("full", "retain", "a", "b"))
    assert reads.times_read(data) == 1.0
    # each unlearned model's bytes were hashed in the pass that read them for loading
    assert (
        table["bytes_read"] >= [(models[n] / "model.safetensors").stat().st_size for n in ("a", "b")]
    ).all()

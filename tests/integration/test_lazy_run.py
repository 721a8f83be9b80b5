"""A lazy run (issue 55): reuse, the Stage 1 key and the forget set's digest come from the resolved inputs alone, so a
rerun whose results are all reusable builds no model and reads no weight byte, and a rerun with one model changed
builds full and that model only (retain stays unread: Stage 1 is cached). Counted on the functions that build and
read (`loader.build_model`, `reader.read_checkpoint`) and on the forget set's digest. Both tests failed on the code
before (2 models and their bytes built to learn the Stage 1 key, the forget set hashed 3 times; 3 models built for
one result to recompute)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from helpers.runs import score_tiny

import uds_lens.auditor as auditor_module
import uds_lens.checkpoints.loader as loader
import uds_lens.inputs as inputs_module
import uds_lens.memory as memory
from uds_lens.checkpoints import digests, folder, reader


class Counts:
    """Models built (by the checkpoint each came from), weight bytes read, forget sets hashed and free memory
    measured since the last `reset`."""

    def __init__(self) -> None:
        self.built: list[Path] = []
        self.headers: list[Path] = []  # weight files opened for their header
        self.nbytes = self.hashed = self.measured = 0

    def reset(self) -> None:
        self.built, self.headers, self.nbytes, self.hashed, self.measured = [], [], 0, 0, 0


@pytest.fixture
def counts(tmp_path, monkeypatch) -> Counts:
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache-root"))
    monkeypatch.setattr(digests, "_DIGESTS", {})
    counted = Counts()
    build, read, digest = loader.build_model, reader.read_checkpoint, inputs_module.examples_fingerprint

    def counting_build(checkpoint, *args, **kwargs):
        counted.built.append(Path(checkpoint.location))
        return build(checkpoint, *args, **kwargs)

    def counting_read(*args, **kwargs):
        loaded = read(*args, **kwargs)
        counted.nbytes += loaded.nbytes
        return loaded

    def counting_digest(examples):
        counted.hashed += 1
        return digest(examples)

    header = folder._header

    def counting_header(file, *args, **kwargs):
        counted.headers.append(Path(file))
        return header(file, *args, **kwargs)

    monkeypatch.setattr(folder, "_header", counting_header)
    free = memory.available_memory_bytes

    def counting_free(device):
        counted.measured += 1
        return free(device)

    monkeypatch.setattr(memory, "available_memory_bytes", counting_free)
    monkeypatch.setattr(inputs_module, "examples_fingerprint", counting_digest)
    monkeypatch.setattr(loader, "build_model", counting_build)
    monkeypatch.setattr(auditor_module, "build_model", counting_build)
    monkeypatch.setattr(reader, "read_checkpoint", counting_read)
    return counted


def _four(tiny, root: Path) -> dict[str, Path]:
    """Two unlearned checkpoints of their own (so one can be changed), written long enough ago that their stamps
    prove their remembered digests, as a checkpoint written before a run is."""
    models = {
        "a": Path(shutil.copytree(tiny.unlearned, root / "a")),
        "b": tiny.variant(root / "b", seed=7, base=tiny.full, noise=0.2),
    }
    time.sleep(0.15)
    return models


def test_a_rerun_whose_results_are_all_reusable_builds_and_reads_nothing(tiny, tmp_path, counts):
    models = _four(tiny, tmp_path)
    out, cache = tmp_path / "out", tmp_path / "s1"
    fresh = score_tiny(tiny, out, cache, unlearned=models)
    assert sorted(p.name for p in counts.built) == ["a", "b", "full", "retain"] and counts.nbytes > 0
    assert counts.hashed == 1
    assert counts.measured == 2  # once before the models, once for the plan; no load measures again
    counts.reset()
    digests.forget_digests()  # what the first run remembered is read back from the cache on disk, as a new process does
    again = score_tiny(tiny, out, cache, unlearned=models)
    assert counts.built == [] and counts.nbytes == 0
    assert counts.headers == []  # no weight file opened: their headers are remembered by their stamp
    assert counts.hashed == 1  # the forget set, once per run
    assert all(again[name].meta.get("reused") == "identical inputs" for name in models)
    assert {name: r.uds for name, r in again.items()} == {name: r.uds for name, r in fresh.items()}


def test_a_rerun_with_one_result_to_recompute_builds_full_and_that_model_only(tiny, tmp_path, counts):
    models = _four(tiny, tmp_path)
    out, cache = tmp_path / "out", tmp_path / "s1"
    fresh = score_tiny(tiny, out, cache, unlearned=models)
    examples = out / "b" / "examples.csv"
    examples.write_text(
        examples.read_text().replace("scored", "no_ke", 1)
    )  # b's saved result no longer reusable
    counts.reset()
    again = score_tiny(tiny, out, cache, unlearned=models)
    assert sorted(p.name for p in counts.built) == ["b", "full"]  # retain unread: Stage 1 is cached
    assert again["a"].meta.get("reused") == "identical inputs" and "reused" not in again["b"].meta
    assert again["b"].meta["recomputed"].startswith("examples.csv")
    assert again["b"].uds == fresh["b"].uds  # the Stage 1 adopted is the one computed with retain loaded
    assert again["b"].meta["fingerprint"] == fresh["b"].meta["fingerprint"]


def test_a_bf16_rerun_reuses_what_its_loads_recorded_and_builds_nothing(tiny, tmp_path, counts):
    """The dtype a result records is the one its full loaded in: the rerun's decision compares the fingerprint the
    auditor recorded from its models, never a dtype predicted before loading."""
    from uds_lens.config import UDSConfig
    from uds_lens.scoring import score_models

    models = _four(tiny, tmp_path)
    out, cache = tmp_path / "out", tmp_path / "s1"

    def run():
        return score_models(
            tiny.full,
            tiny.retain,
            models,
            tiny.data,
            out_dir=out,
            config=UDSConfig(dtype="bfloat16"),
            cache_dir=cache,
            progress=False,
        )

    fresh = run()
    assert fresh["a"].meta["fingerprint"]["settings"]["dtype"] == "torch.bfloat16"
    counts.reset()
    again = run()
    assert counts.built == [] and counts.nbytes == 0
    assert all(again[name].meta.get("reused") == "identical inputs" for name in models)


def test_a_full_replaced_after_the_lookup_is_scored_from_both_models_loaded(
    tiny, tmp_path, counts, monkeypatch, caplog
):
    """The Stage 1 found by the inputs is adopted only for the full the lookup named: a full replaced between the
    decision and its load is caught on the bytes loaded, and Stage 1 is then keyed from the models (retain loaded)."""
    import logging

    import uds_lens.scoring as scoring
    from uds_lens.results import load_reusable

    models = _four(tiny, tmp_path)
    full = Path(shutil.copytree(tiny.full, tmp_path / "full"))
    other = tiny.variant(tmp_path / "other-full", seed=31, base=tiny.full, noise=0.05)
    out, cache = tmp_path / "out", tmp_path / "s1"
    time.sleep(0.15)
    score_tiny(tiny, out, cache, full=full, unlearned=models)
    examples = out / "b" / "examples.csv"
    examples.write_text(examples.read_text().replace("scored", "no_ke", 1))

    def decide_then_replace(target, fingerprint):
        decided = load_reusable(target, fingerprint)
        if target.name == "b":
            shutil.rmtree(full)
            shutil.copytree(other, full)
        return decided

    monkeypatch.setattr(scoring, "load_reusable", decide_then_replace)
    counts.reset()
    with caplog.at_level(logging.WARNING, logger="uds_lens.scoring"):
        again = score_tiny(tiny, out, cache, full=full, unlearned=models)["b"]
    assert "does not fit the full model loaded" in caplog.text
    assert sorted(p.name for p in counts.built) == ["b", "full", "full", "retain"]
    monkeypatch.setattr(scoring, "load_reusable", load_reusable)
    truth = score_tiny(
        tiny, tmp_path / "truth", tmp_path / "s1-truth", full=other, unlearned={"b": models["b"]}
    )["b"]
    assert again.meta["fingerprint"]["full"] == truth.meta["fingerprint"]["full"]
    assert again.uds == pytest.approx(truth.uds, abs=1e-6)

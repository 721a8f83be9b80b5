"""A sweep paced by compute: the next model is staged while this one computes (never more than one ahead), each
checkpoint is read once, a model that cannot be staged is a failed row, and sweep.csv times every phase."""

from __future__ import annotations

import math
import shutil
import threading
import time

import pandas as pd
import pytest
import torch
from helpers.reads import ReadCounter

from uds_lens.checkpoints import loader
from uds_lens.stages import StageRuns
from uds_lens.sweep import worker as worker_module
from uds_lens.sweep.driver import sweep
from uds_lens.sweep.ledger import PHASE_COLUMNS
from uds_lens.sweep.staging import StagingPipeline
from uds_lens.sweep.worker import available_cpus

# Seconds of rounding between timers that nest (each phase is timed inside the interval that holds it).
CLOCK_SLACK = 0.01


class _Clock:
    """Events of a fake sweep, in order: ("prepare", k, start|end), ("compute", k, start|end), ("release", k)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.lock = threading.Lock()

    def log(self, *event) -> None:
        with self.lock:
            self.events.append(event)

    def index(self, *event) -> int:
        return self.events.index(event)


def _run_pipeline(ahead: bool, n: int = 5, fail: int | None = None) -> tuple[_Clock, StagingPipeline, list]:
    clock = _Clock()

    def prepare(k: int) -> int:
        clock.log("prepare", k, "start")
        time.sleep(0.03)
        if k == fail:
            raise OSError(f"model {k} cannot be read")
        clock.log("prepare", k, "end")
        return k

    pipeline = StagingPipeline(prepare, range(n), release=lambda k: clock.log("release", k), ahead=ahead)
    handed = []
    for k, prepared, _waited in pipeline:
        handed.append(prepared)
        clock.log("compute", k, "start")
        time.sleep(0.06)
        clock.log("compute", k, "end")
    return clock, pipeline, handed


def test_the_next_model_is_staged_while_this_one_computes_and_never_two_ahead():
    clock, pipeline, handed = _run_pipeline(ahead=True)
    assert handed == list(range(5)) and pipeline.peak == 2 and pipeline.live == 0
    for k in range(4):
        # model k+1 is staged during k's compute ...
        assert clock.index("prepare", k + 1, "start") < clock.index("compute", k, "end")
        # ... and model k+2 only once k has been released
        assert clock.index("release", k) < clock.index("prepare", k + 2, "start") if k + 2 < 5 else True
    assert sorted(e[1] for e in clock.events if e[0] == "release") == list(range(5))


def test_without_prefetch_one_model_at_a_time():
    clock, pipeline, handed = _run_pipeline(ahead=False)
    assert handed == list(range(5)) and pipeline.peak == 1
    for k in range(4):
        assert clock.index("compute", k, "end") < clock.index("prepare", k + 1, "start")


@pytest.mark.parametrize("ahead", [True, False])
def test_the_worker_prepares_itself_while_the_first_model_is_staged(ahead):
    clock = _Clock()
    consumer = threading.get_ident()

    def prepare(k: int) -> int:
        clock.log("prepare", k, "start")
        time.sleep(0.05)
        clock.log("prepare", k, "end")
        return k

    def meanwhile() -> None:
        assert threading.get_ident() == consumer  # the worker's own thread
        clock.log("meanwhile", "start")
        time.sleep(0.05)
        clock.log("meanwhile", "end")

    pipeline = StagingPipeline(prepare, range(3), release=lambda k: None, ahead=ahead, meanwhile=meanwhile)
    handed = [k for k, _prepared, _waited in pipeline]
    assert handed == [0, 1, 2] and sum(e[0] == "meanwhile" for e in clock.events) == 2  # once
    if ahead:  # beside the first model's staging
        assert clock.index("prepare", 0, "start") < clock.index("meanwhile", "end")
        assert clock.index("meanwhile", "start") < clock.index("prepare", 0, "end")
    else:  # one thing at a time
        assert clock.index("meanwhile", "end") < clock.index("prepare", 0, "start")


def test_a_failing_stage_is_handed_out_in_its_place_and_the_rest_goes_on():
    _clock, pipeline, handed = _run_pipeline(ahead=True, fail=2)
    assert isinstance(handed[2], OSError) and handed[:2] + handed[3:] == [0, 1, 3, 4]
    assert pipeline.live == 0


def test_a_consumer_that_stops_early_leaves_nothing_staged():
    clock = _Clock()

    def prepare(k: int) -> int:
        clock.log("prepare", k)
        return k

    pipeline = StagingPipeline(prepare, range(4), release=lambda k: clock.log("release", k))
    for k, _prepared, _waited in pipeline:
        if k == 1:
            break
    prepared = {e[1] for e in clock.events if e[0] == "prepare"}
    released = {e[1] for e in clock.events if e[0] == "release"}
    # model 2 was being staged (or not yet started) when the consumer stopped: either way nothing stays held
    assert pipeline.live == 0 and prepared == released and prepared <= {0, 1, 2}


@pytest.fixture(scope="module")
def sweep_models(tiny, tmp_path_factory):
    """Three distinct tiny checkpoints, one truncated copy, one missing path."""
    root = tmp_path_factory.mktemp("pipeline")
    bad = root / "bad"
    shutil.copytree(tiny.unlearned, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    return {
        "unl": str(tiny.unlearned),
        "bad": str(bad),
        "ret": str(tiny.retain),
        "gone": str(root / "missing"),
        "unl2": str(tiny.variant(root / "unl2", seed=5, base=tiny.full, noise=0.2)),
    }


def _sweep(tiny, out, models_, **options) -> pd.DataFrame:
    return sweep(
        tiny.full,
        tiny.retain,
        tiny.data,
        out,
        models_,
        workers=1,
        cache_dir=out.parent / "s1",
        progress=False,
        **options,
    )


def test_in_process_sweep_reads_each_checkpoint_once_and_times_its_phases(
    tiny, tmp_path, sweep_models, monkeypatch
):
    weights = {name: f"{path}/model.safetensors" for name, path in sweep_models.items() if name != "gone"}
    reads = ReadCounter(monkeypatch, [*weights.values(), f"{tiny.full}/model.safetensors"])
    began = time.perf_counter()
    staged_table = _sweep(tiny, tmp_path / "staged", sweep_models)
    staged_wall = time.perf_counter() - began
    rows = staged_table.set_index("name")
    assert rows["status"].to_dict() == {
        "unl": "scored",
        "bad": "failed",
        "ret": "scored",
        "gone": "failed",
        "unl2": "scored",
    }
    # one pass: every model's bytes read once (its header besides, a few kilobytes), whoever reads them; the full
    # model's too, by the worker that loads it. ("ret" is retain's checkpoint, also loaded for Stage 1.)
    for name in ("unl", "unl2"):
        assert 1.0 <= reads.times_read(weights[name]) < 1.5, name
    assert reads.times_read(weights["bad"]) < 1.5  # refused from its header: a tensor lies past its end
    assert 1.0 <= reads.times_read(f"{tiny.full}/model.safetensors") < 1.5
    assert 2.0 <= reads.times_read(weights["ret"]) < 2.5
    assert staged_table.attrs["peak_staged"] == 2
    assert "truncated" in rows.loc["bad", "error"] and "while loading" in rows.loc["bad", "error"]
    assert "does not exist" in rows.loc["gone", "error"] and "while resolving" in rows.loc["gone", "error"]
    # refused before it was hashed: its row still says what it was run against, and no identity of its own
    assert rows.loc["bad", "fp_full"] == rows.loc["unl", "fp_full"] and rows.loc["bad", "fp_unlearned"] == ""
    scored = rows[rows["status"] == "scored"]
    assert (scored[PHASE_COLUMNS] >= 0).all().all() and scored[PHASE_COLUMNS].notna().all().all()
    assert (scored["source_forward_seconds"] < scored["s2_seconds"]).all()
    assert (scored["bytes_read"] > 0).all() and (scored["threads"] == available_cpus()).all()
    # staged: a model's wall holds what the worker waited for and what it did itself, and the models' walls follow
    # one another (each from asking for the model to its row written), so together they fit in the sweep's. Nested
    # intervals, not a tolerance: these hold however loaded the machine is, and break if a phase is timed outside
    # its model's wall or a wall starts before the previous model's row was written.
    own = scored[["wait_seconds", "to_device_seconds", "s2_seconds", "write_seconds"]].sum(axis=1)
    assert (scored["seconds"] >= own - CLOCK_SLACK).all()
    assert rows["seconds"].sum() <= staged_wall + CLOCK_SLACK

    began = time.perf_counter()
    sequential = _sweep(tiny, tmp_path / "sequential", sweep_models, prefetch=False).set_index("name")
    sequential_wall = time.perf_counter() - began
    assert sequential.attrs["peak_staged"] == 1 if hasattr(sequential, "attrs") else True
    # same numbers staged or not
    pd.testing.assert_series_equal(sequential["uds"], rows["uds"])
    done = sequential[sequential["status"] == "scored"]
    # nothing staged ahead: every phase runs inside the model's wall (source_forward is inside s2), the model's own
    # staging (resolve, hash, load) inside what the worker waited for, and the walls fit in the sweep's
    phases = done[[c for c in PHASE_COLUMNS if c != "source_forward_seconds"]].sum(axis=1)
    assert (done["seconds"] >= phases - CLOCK_SLACK).all()
    staging = done[["resolve_seconds", "hash_seconds", "load_seconds"]].sum(axis=1)
    assert (done["wait_seconds"] >= staging - CLOCK_SLACK).all()
    assert (done["wait_seconds"] <= done["seconds"] + CLOCK_SLACK).all()
    assert sequential["seconds"].sum() <= sequential_wall + CLOCK_SLACK


def test_in_process_threads_default_to_the_cores_and_are_restored(tiny, tmp_path, sweep_models):
    before = torch.get_num_threads()
    one = {"unl": sweep_models["unl"]}
    assert _sweep(tiny, tmp_path / "all", one).loc[0, "threads"] == available_cpus()
    assert _sweep(tiny, tmp_path / "told", one, cpus_per_worker=1).loc[0, "threads"] == 1
    assert torch.get_num_threads() == before


def test_a_rerun_reuses_from_the_remembered_digest_without_reading(tiny, tmp_path, sweep_models, monkeypatch):
    models_ = {"unl": sweep_models["unl"], "unl2": sweep_models["unl2"]}
    first = _sweep(tiny, tmp_path / "out", models_)
    loads = []
    real = loader._hf_model  # noqa: SLF001 - the builder every load goes through (the worker's and the staging's)
    monkeypatch.setattr(loader, "_hf_model", lambda *a, **kw: loads.append(a) or real(*a, **kw))
    made = {"vacant": 0, "clean runs": 0}
    real_copy, real_warm = loader.vacant_copy, StageRuns.make_clean_runs
    monkeypatch.setattr(worker_module, "vacant_copy", lambda m: made.update(vacant=1) or real_copy(m))
    monkeypatch.setattr(
        StageRuns, "make_clean_runs", lambda runs: made.update({"clean runs": 1}) or real_warm(runs)
    )
    again = _sweep(tiny, tmp_path / "out", models_)
    # a rerun where every model has a result may reuse them all: no spare bridge made, no clean run ahead
    assert made == {"vacant": 0, "clean runs": 0}
    # the worker loads full only (its Stage 1 found in the S1 cache's index, retain is not needed); no unlearned
    # model is loaded
    loaded = [checkpoint.location for checkpoint, *_ in loads]
    assert loaded == [str(tiny.full)]
    assert (again["status"] == "reused").all()
    # nor read: its digest is remembered by file identity
    assert (again["bytes_read"] == 0).all()
    _sweep(
        tiny, tmp_path / "fresh", models_
    )  # where a model has no result: the spare and the clean runs made
    assert made == {"vacant": 1, "clean runs": 1}
    # (to 1e-6: sweep.csv recomputes a reused UDS from the rounded examples.csv, issue 27)
    assert again["uds"].tolist() == pytest.approx(first["uds"].tolist(), abs=1e-6)
    assert (again["hash_seconds"] > 0).all() and not math.isnan(again.loc[0, "seconds"])


def test_every_model_is_read_into_a_spare_bridge_a_vacant_copy_of_full_then_the_one_scored_before(
    tiny, tmp_path, sweep_models, monkeypatch
):
    """No bridge is built for the unlearned models (TransformerLens's build costs several times the read): the first
    is read into a vacant copy of full (`loader.vacant_copy`), the others into the one scored before
    (`loader.refill_model`), and every number equals that of a sweep that builds each model."""
    import uds_lens.sweep.staging as staging

    models_ = {name: sweep_models[name] for name in ("unl", "ret", "unl2")}
    built, refilled = [], []
    build, refill = loader.build_model, loader.refill_model  # what staging calls
    monkeypatch.setattr(
        staging, "build_model", lambda ckpt, *a, **k: built.append(ckpt.name) or build(ckpt, *a, **k)
    )
    monkeypatch.setattr(
        staging, "refill_model", lambda model, ckpt, *a: refilled.append(ckpt.name) or refill(model, ckpt, *a)
    )
    table = _sweep(tiny, tmp_path / "refilled", models_, prefetch=False).set_index("name")
    assert built == [] and refilled == ["unlearned", "retain", "unl2"]  # checkpoint names: their folders
    monkeypatch.setattr(staging, "refill_model", lambda *a: None)
    each_built = _sweep(tiny, tmp_path / "built", models_, prefetch=False).set_index("name")
    assert (table["status"] == "scored").all()
    for column in ("uds", "fp_unlearned", "n_scored"):
        pd.testing.assert_series_equal(table[column], each_built[column])


def test_a_model_whose_scoring_failed_is_not_read_into(tiny, tmp_path, sweep_models, monkeypatch):
    """Its bridge may hold what the failure left (hooks, a half move): the next model is built afresh."""
    import uds_lens.sweep.staging as staging
    from uds_lens.auditor import UDSAuditor

    models_ = {name: sweep_models[name] for name in ("unl", "ret", "unl2")}
    built, refilled = [], []
    build, refill, score = loader.build_model, loader.refill_model, UDSAuditor.score
    monkeypatch.setattr(
        staging, "build_model", lambda ckpt, *a, **k: built.append(ckpt.name) or build(ckpt, *a, **k)
    )
    monkeypatch.setattr(
        staging, "refill_model", lambda model, ckpt, *a: refilled.append(ckpt.name) or refill(model, ckpt, *a)
    )

    def failing(self, unlearned, name=None):
        if name == "ret":
            raise RuntimeError("scoring went wrong")
        return score(self, unlearned, name=name)

    monkeypatch.setattr(UDSAuditor, "score", failing)
    table = _sweep(tiny, tmp_path / "failed", models_, prefetch=False).set_index("name")
    assert table["status"].to_dict() == {"unl": "scored", "ret": "failed", "unl2": "scored"}
    # the first read into a vacant copy of full, the second into the first; the failed one's bridge was dropped
    assert built == ["unl2"] and refilled == ["unlearned", "retain"]

"""Sweeps of the test zoo's unlearned models: in-process and on a local Ray cluster (2 workers), numbers identical to
`uds-lens score`, complete files, resume without staleness, a killed worker, a model that does not load."""

import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pandas as pd
import psutil
import pytest
from helpers.numerics import reordered_tolerance
from typer.testing import CliRunner

from uds_lens.auditor import UDSAuditor
from uds_lens.cli import app
from uds_lens.config import UDSConfig
from uds_lens.result_store import RESULT_FILES, RESULT_MARKER, verify_result_dir
from uds_lens.results import UDSResult
from uds_lens.scoring import score_models
from uds_lens.sweep.driver import sweep
from uds_lens.sweep.ledger import COLUMNS
from uds_lens.sweep.lists import SCATTER_HTML, SWEEP_JSON, SWEEP_TABLE, SweepError

pytestmark = pytest.mark.xdist_group("sweep")  # one process: the Ray tests share one local cluster


@pytest.fixture(scope="module")
def zoo(test_zoo):
    """The test zoo's full, retain, forget set and unlearned models (``{name: path}``)."""
    unlearned = {name: str(test_zoo.path(name)) for name in test_zoo.names("unlearned")}
    assert len(unlearned) >= 4
    return {
        "full": str(test_zoo.path("full")),
        "retain": str(test_zoo.path("retain")),
        "data": str(test_zoo.forget_path),
        "models": unlearned,
        "zoo": test_zoo,
    }


@pytest.fixture(scope="module")
def reference(zoo, tmp_path_factory):
    """What `uds-lens score` gives for every unlearned model, one after another in this process."""
    return score_models(
        zoo["full"],
        zoo["retain"],
        zoo["models"],
        zoo["data"],
        cache_dir=tmp_path_factory.mktemp("s1-reference"),
        progress=False,
    )


@pytest.fixture(scope="module")
def broken_model(zoo, tmp_path_factory):
    """A checkpoint directory whose weights file is truncated: it fails to load."""
    path = tmp_path_factory.mktemp("broken") / "broken"
    shutil.copytree(zoo["models"]["npo"], path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return str(path)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip(
        "ray", reason="Ray (the [sweep] extra) is not installed; `make test` installs it"
    )
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 1024 * 1024)
    yield ray
    ray.shutdown()


def assert_same_as_reference(out, table, reference):
    """Every unlearned model scored and saved, with `uds-lens score`'s numbers (1e-6). A sweep runs Stage 2 on
    the KE cells only (its default): d2 and LER equal score's on those cells and are NaN on the others."""
    rows = table.set_index("name")
    for name, expected in reference.items():
        assert rows.loc[name, "status"] in ("scored", "reused"), rows.loc[name, "error"]
        assert rows.loc[name, "uds"] == pytest.approx(expected.uds, abs=1e-6), name
        saved = UDSResult.load(out / name)
        assert saved.stage2_cells == rows.loc[name, "stage2_cells"] == "ke"
        merged = saved.layers.merge(expected.layers, on=["idx", "layer"], suffixes=("", "_ref"))
        assert len(merged) == len(expected.layers) > 0
        ke = merged["ke_ref"].astype(bool)
        assert ke.any() and merged.loc[~ke, "d2"].isna().all()
        for column in ("s0", "baseline_score", "d1"):
            np.testing.assert_allclose(
                merged[column], merged[f"{column}_ref"], atol=1e-6, err_msg=f"{name} {column}"
            )
        for column in ("d2", "ler"):  # reordered: the KE cells run packed in other products than every cell's
            reference_values = merged.loc[ke, f"{column}_ref"].to_numpy(dtype=float)
            np.testing.assert_allclose(
                merged.loc[ke, column],
                reference_values,
                atol=reordered_tolerance(float(np.abs(reference_values).max())),
                err_msg=f"{name} {column}",
            )
        by_idx = saved.examples.set_index("idx")["uds"].sort_index()
        np.testing.assert_allclose(by_idx, expected.examples.set_index("idx")["uds"].sort_index(), atol=1e-6)


def assert_complete_files(out, table, scored, failed):
    """Per-model directories, sweep.csv (one row per model) and the open-unlearning JSON all agree."""
    on_disk = pd.read_csv(out / SWEEP_TABLE)
    assert list(on_disk.columns[: len(COLUMNS)]) == COLUMNS
    assert list(on_disk["name"]) == list(table["name"]) == [*scored, *failed]
    assert set(on_disk["status"]) <= {"scored", "reused", "failed"}
    evaluation = json.loads((out / SWEEP_JSON).read_text())
    assert sorted(evaluation) == sorted(scored)
    for name in scored:
        row = on_disk.set_index("name").loc[name]
        assert verify_result_dir(out / name) is None
        assert (
            {"summary.json", "examples.csv", "layers.csv", "uds_eval.json", "meta.json"}
            <= {path.name for path in (out / name).iterdir()}
            <= {*RESULT_FILES, "meta.json", RESULT_MARKER}
        )
        summary = json.loads((out / name / "summary.json").read_text())
        assert (
            evaluation[name]["uds"]["agg_value"] == pytest.approx(summary["uds"]) == pytest.approx(row["uds"])
        )
        assert (row["ci_low"], row["ci_high"]) == pytest.approx(tuple(summary["ci95"]))
        assert (
            row["n_scored"] + row["n_no_ke"] + row["n_skipped"]
            == summary["n_scored"] + summary["n_no_ke"] + summary["n_skipped"]
            > 0
        )
        assert row["fp_unlearned"].startswith("files:") and row["fp_full"].startswith("files:")
        assert row["s2_seconds"] >= 0 and row["seconds"] >= 0
    assert on_disk["fp_full"].nunique() == on_disk["fp_retain"].nunique() == on_disk["fp_data"].nunique() == 1
    for name in failed:
        row = on_disk.set_index("name").loc[name]
        assert row["status"] == "failed" and name in row["error"] and np.isnan(row["uds"])
        assert not (out / name).exists()


def test_in_process_sweep_equals_score_and_reports_a_model_that_fails(zoo, reference, broken_model, tmp_path):
    out = tmp_path / "out"
    table = sweep(
        zoo["full"],
        zoo["retain"],
        zoo["data"],
        out,
        {**zoo["models"], "broken": broken_model},
        workers=1,
        cache_dir=tmp_path / "s1",
        progress=False,
    )
    assert_complete_files(out, table, list(zoo["models"]), ["broken"])
    assert (table.set_index("name").drop("broken")["status"] == "scored").all()
    assert_same_as_reference(out, table, reference)
    # the same files `uds-lens score --stage2-cells ke` writes: scoring into the sweep's directory reuses them all
    again = score_models(
        zoo["full"],
        zoo["retain"],
        zoo["models"],
        zoo["data"],
        out_dir=out,
        config=UDSConfig(stage2_cells="ke"),
        cache_dir=tmp_path / "s1",
        progress=False,
    )
    assert all(result.meta.get("reused") == "identical inputs" for result in again.values())


def test_rerun_computes_only_what_is_missing_and_never_reuses_stale_results(zoo, tmp_path, monkeypatch):
    models = {}
    for name in ("npo", "graddiff", "rmu_l1"):
        models[name] = str(tmp_path / "models" / name)
        shutil.copytree(zoo["models"][name], models[name])
    out, cache = tmp_path / "out", tmp_path / "s1"

    def run(force=False, **changes):
        settings = {"full": zoo["full"], "retain": zoo["retain"], "data": zoo["data"], **changes}
        table = sweep(
            settings["full"],
            settings["retain"],
            settings["data"],
            out,
            models,
            workers=1,
            cache_dir=cache,
            progress=False,
            force=force,
        )
        return table.set_index("name")["status"].to_dict()

    # interrupted while scoring the last model (Ctrl-C): the finished ones are saved, the last one is pending
    real_score = UDSAuditor.score

    def interrupted(self, unlearned, name=None):
        if name == "rmu_l1":
            raise KeyboardInterrupt
        return real_score(self, unlearned, name=name)

    monkeypatch.setattr(UDSAuditor, "score", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.undo()
    assert pd.read_csv(out / SWEEP_TABLE).set_index("name")["status"].to_dict() == {
        "npo": "scored",
        "graddiff": "scored",
        "rmu_l1": "pending",
    }
    written = {name: (out / name / "meta.json").stat().st_mtime_ns for name in ("npo", "graddiff")}

    assert run() == {"npo": "reused", "graddiff": "reused", "rmu_l1": "scored"}
    assert {name: (out / name / "meta.json").stat().st_mtime_ns for name in written} == written

    # a checkpoint retrained in place (other weights, same path): its saved result is another run's, refused
    # (naming it) until it is removed; then it alone is recomputed
    shutil.copy(tmp_path / "models" / "rmu_l1" / "model.safetensors", tmp_path / "models" / "graddiff")
    with pytest.raises(SweepError, match="graddiff: unlearned differs"):
        run()
    shutil.rmtree(out / "graddiff")
    assert run() == {"npo": "reused", "graddiff": "scored", "rmu_l1": "reused"}
    assert UDSResult.load(out / "graddiff").uds == pytest.approx(UDSResult.load(out / "rmu_l1").uds, abs=1e-9)

    # another retain model, or other data: refused unless forced, then everything is recomputed
    with pytest.raises(SweepError, match="retain differs"):
        run(retain=str(zoo["zoo"].path("retain90")))
    assert set(run(retain=str(zoo["zoo"].path("retain90")), force=True).values()) == {"scored"}
    smaller = tmp_path / "forget_minus_one.json"
    smaller.write_text(json.dumps(json.loads(open(zoo["data"]).read())[1:]))
    with pytest.raises(SweepError, match="data differs"):
        run(retain=str(zoo["zoo"].path("retain90")), data=str(smaller))
    assert set(run(retain=str(zoo["zoo"].path("retain90")), data=str(smaller), force=True).values()) == {
        "scored"
    }
    assert set(run(retain=str(zoo["zoo"].path("retain90")), data=str(smaller)).values()) == {"reused"}


def test_sweep_cli_with_a_registry_compares_with_published_figures(zoo, tmp_path):
    registry = tmp_path / "registry.csv"
    rows = [
        ("full", zoo["full"], "full", "", 0.0),
        ("retain", zoo["retain"], "retain", "", 1.0),
        ("npo_ep5", zoo["models"]["npo"], "npo", "ep5", 0.25),
        ("rmu_ep5", zoo["models"]["rmu_l1"], "rmu", "ep5", ""),
        ("graddiff_ep5", zoo["models"]["graddiff"], "graddiff", "ep5", 0.5),
    ]
    pd.DataFrame(rows, columns=["alias", "hub_id", "method", "epoch", "published_uds"]).to_csv(
        registry, index=False
    )
    out = tmp_path / "out"
    from_registry = ["sweep", "--full", zoo["full"], "--retain", zoo["retain"], "--data", zoo["data"],
                     "--registry", str(registry), "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(
        app,
        [*from_registry, "--methods", "npo,rmu", "--compare-published", "--workers", "1",
         "--cache-dir", str(tmp_path / "s1")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / SWEEP_TABLE).set_index("name")
    assert list(table.index) == ["npo_ep5", "rmu_ep5"]
    assert list(table["method"]) == ["npo", "rmu"] and list(table["epoch"]) == ["ep5", "ep5"]
    assert table.loc["npo_ep5", "uds_minus_published"] == pytest.approx(table.loc["npo_ep5", "uds"] - 0.25)
    assert np.isnan(table.loc["rmu_ep5", "published_uds"]) and np.isnan(
        table.loc["rmu_ep5", "uds_minus_published"]
    )
    assert "npo_ep5" in result.output and "published_uds" in result.output
    html = (out / SCATTER_HTML).read_text()
    assert "npo_ep5" in html and "ours = published" in html
    bad = CliRunner().invoke(app, [*from_registry, "--methods", "dpo"])
    assert bad.exit_code != 0 and "no method ['dpo']" in str(bad.exception)


@pytest.mark.slow
def test_ray_two_workers_equal_sequential_with_complete_files(
    ray_cluster, zoo, reference, broken_model, tmp_path
):
    out = tmp_path / "out"
    models = {**zoo["models"], "broken": broken_model}
    table = sweep(
        zoo["full"],
        zoo["retain"],
        zoo["data"],
        out,
        models,
        workers=2,
        cache_dir=tmp_path / "s1",
        progress=False,
    )
    assert_complete_files(out, table, list(zoo["models"]), ["broken"])
    assert_same_as_reference(out, table, reference)
    scored = table[table["status"] == "scored"]
    assert len(scored) == len(zoo["models"]) and scored["worker"].nunique() == 2  # both actors took models
    assert (scored["attempts"] == 1).all()


@pytest.mark.slow
def test_ray_worker_killed_mid_sweep_still_scores_every_model(ray_cluster, zoo, reference, tmp_path):
    """SIGKILL an actor while it scores a model: that model is retried on another actor, the sweep finishes."""
    killed: list[int] = []
    done = threading.Event()

    def kill_first_busy_worker():
        while not done.is_set() and not killed:
            for process in psutil.Process().children(recursive=True):
                try:
                    busy = "SweepWorker.score" in " ".join(process.cmdline())
                except psutil.Error:
                    continue
                if busy:
                    os.kill(process.pid, signal.SIGKILL)
                    killed.append(process.pid)
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_first_busy_worker, daemon=True)
    killer.start()
    try:
        table = sweep(
            zoo["full"],
            zoo["retain"],
            zoo["data"],
            tmp_path / "out",
            zoo["models"],
            workers=2,
            cache_dir=tmp_path / "s1",
            progress=False,
        )
    finally:
        done.set()
        killer.join()
    assert killed, "no worker was caught scoring a model"
    assert (table["status"] == "scored").all(), table[["name", "status", "error"]]
    retried = table[table["attempts"] > 1]
    assert len(retried) == 1
    assert (
        not retried["worker"].iloc[0].endswith(f":{killed[0]}")
    )  # finished by another (or a restarted) actor
    assert_same_as_reference(tmp_path / "out", table, reference)

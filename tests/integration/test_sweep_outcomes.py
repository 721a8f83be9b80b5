"""What a sweep reports (issue 27), on the tiny checkpoints: names that are the sweep's own files are refused, a sweep
with failed rows exits non-zero with its table written, sweep.csv holds the saved results' own values when they are
reused, and a sweep into another run's results is refused before any model loads. Each test failed on the code before
the issue."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from helpers.runs import score_tiny
from typer.testing import CliRunner

from uds_lens.checkpoints import loader
from uds_lens.cli import app
from uds_lens.sweep.driver import sweep as run_sweep
from uds_lens.sweep.lists import SweepError, resolve_models


@pytest.mark.parametrize("name", ["sweep.csv", "sweep_eval.json", "published_scatter.html", "Sweep.CSV"])
def test_sweep_names_that_are_the_sweeps_own_files_are_refused(tiny, tmp_path, name):
    with pytest.raises(SweepError, match="own files"):
        resolve_models({name: str(tiny.unlearned)})
    with pytest.raises(SweepError, match="own files"):
        run_sweep(
            tiny.full, tiny.retain, tiny.data, tmp_path / "out", {name: str(tiny.unlearned)}, use_ray=False
        )
    assert not (tmp_path / "out" / "sweep.csv").exists()


def test_a_sweep_with_failed_rows_exits_non_zero_with_its_table_written(tiny, tmp_path):
    out = tmp_path / "out"
    model_list = tmp_path / "models.csv"
    model_list.write_text(f"u,{tiny.unlearned}\nbroken,{tmp_path / 'no_such_checkpoint'}\n")
    argv = ["sweep", "--full", str(tiny.full), "--retain", str(tiny.retain), "--data", str(tiny.data),
            "--out", str(out), "--models", str(model_list), "--workers", "1",
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1, result.output
    table = pd.read_csv(out / "sweep.csv")
    assert dict(zip(table["name"], table["status"], strict=True)) == {"u": "scored", "broken": "failed"}


def test_sweep_csv_holds_the_saved_results_own_values_when_reused(tiny, tmp_path):
    out = tmp_path / "out"
    for status in ("scored", "reused"):
        run_sweep(tiny.full, tiny.retain, tiny.data, out, {"u": str(tiny.unlearned)}, use_ray=False,
                  cache_dir=tmp_path / "cache", progress=False)  # fmt: skip
        row = pd.read_csv(out / "sweep.csv").set_index("name").loc["u"]
        summary = json.loads((out / "u" / "summary.json").read_text())
        assert row["status"] == status
        assert row["uds"] == summary["uds"]  # exactly: not recomputed from the rounded layers.csv
        assert [row["ci_low"], row["ci_high"]] == summary["ci95"]


def test_a_sweep_into_another_runs_results_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    score_tiny(tiny, out, tmp_path / "cache")
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SweepError, match="retain differs"):
        run_sweep(tiny.full, tiny.unlearned, tiny.data, out, {"u": str(tiny.unlearned)}, use_ray=False)

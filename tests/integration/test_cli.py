"""The CLI end to end on tiny local Llama directories, and the real-model experiment's offline error path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from uds_lens.cli import app, main

ROOT = Path(__file__).resolve().parents[2]


def test_score_writes_every_file(tiny, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "score", "--full", str(tiny.full), "--retain", str(tiny.retain), "--unlearned", str(tiny.unlearned),
        "--unlearned", str(tiny.full), "--data", str(tiny.data), "--out", str(out), "--cache-dir",
        str(tmp_path / "cache"),
    ])
    assert result.exit_code == 0, result.output
    assert "unlearned" in result.output
    for name in ("unlearned", "full"):
        summary = json.loads((out / name / "summary.json").read_text())
        for key in ("uds", "ci95", "n_scored", "n_no_ke", "n_skipped", "settings", "versions", "timings"):
            assert key in summary
        for key in ("s1_seconds", "s2_seconds", "s1_cached", "n_examples"):
            assert key in summary["timings"]
        examples = pd.read_csv(out / name / "examples.csv")
        assert list(examples.columns) == ["idx", "prompt_type", "n_entity_tokens", "n_ke", "uds", "status",
                                          "skip_reason", "question", "entity"]
        layers = pd.read_csv(out / name / "layers.csv")
        assert list(layers.columns) == ["idx", "layer", "site", "s0", "baseline_score", "s1_score", "s2_score", "d1",
                                        "d2", "ke", "ler"]
        assert layers.groupby("idx")["s0"].nunique().eq(1).all()  # S0: one constant per example
        assert layers.loc[~layers["ke"], "ler"].isna().all() and layers.loc[layers["ke"], "ler"].notna().all()
        ou = json.loads((out / name / "uds_eval.json").read_text())
        assert ou["uds"]["agg_value"] == pytest.approx(summary["uds"])
    assert json.loads((out / "full" / "summary.json").read_text())["uds"] == 0.0
    # S1 was computed once for both models
    assert json.loads((out / "full" / "summary.json").read_text())["timings"]["s1_seconds"] == pytest.approx(
        json.loads((out / "unlearned" / "summary.json").read_text())["timings"]["s1_seconds"])


def test_score_retain_free_and_bad_input(tiny, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["score", "--full", str(tiny.full), "--no-retain", "--unlearned", str(tiny.unlearned),
                                 "--data", str(tiny.data), "--out", str(tmp_path / "rf"), "--cache-dir",
                                 str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "unnormalised" in result.output
    result = runner.invoke(app, ["score", "--full", str(tiny.full), "--unlearned", str(tiny.unlearned),
                                 "--data", str(tiny.data), "--out", str(tmp_path / "x")])
    assert result.exit_code != 0


def test_tofu_experiment_fails_clearly_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "tofu_llama.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "open-unlearning/tofu_Llama-3.2-1B-Instruct_full" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr


def test_console_entry_point_prints_user_errors_without_a_traceback(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data.json"
    data.write_text("[]")
    monkeypatch.setattr(sys, "argv", ["uds-lens", "score", "--full", str(tmp_path / "no_such_model"), "--no-retain",
                                      "--unlearned", str(tmp_path / "no_such_model"), "--data", str(data),
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err

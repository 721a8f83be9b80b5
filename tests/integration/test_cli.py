"""The CLI end to end on tiny local Llama directories, and the real-model experiment's offline error path."""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers.cli import run_cli
from typer.testing import CliRunner

from uds_lens.cli import app, main, score, sweep
from uds_lens.config import UDSConfig

ROOT = Path(__file__).resolve().parents[2]


def score_argv(tiny, out: Path, cache: Path, *unlearned: str | Path, retain: bool = True) -> list[str]:
    """``uds-lens score`` arguments on the tiny checkpoints, scoring ``unlearned`` (default: ``tiny.unlearned``)."""
    retain_args = ["--retain", str(tiny.retain)] if retain else ["--no-retain"]
    unlearned_args = [arg for model in unlearned or (tiny.unlearned,) for arg in ("--unlearned", str(model))]
    return ["score", "--full", str(tiny.full), *retain_args, *unlearned_args, "--data", str(tiny.data),
            "--out", str(out), "--cache-dir", str(cache)]  # fmt: skip


def test_score_writes_every_file(tiny, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, score_argv(tiny, out, tmp_path / "cache", tiny.unlearned, tiny.full))
    assert result.exit_code == 0, result.output
    assert "unlearned" in result.output
    # the table (after the progress bars, which end without a newline): UDS with its split and excess beside it
    assert re.search(r"model +uds +ci95 +measured +clipped_part +excess +scored", result.output), (
        result.output
    )
    for name in ("unlearned", "full"):
        summary = json.loads((out / name / "summary.json").read_text())
        for key in ("uds", "ci95", "n_scored", "n_no_ke", "n_skipped", "settings", "versions", "timings"):
            assert key in summary
        assert summary["uds_unclipped"] + summary["uds_clipped"] == pytest.approx(summary["uds"], abs=1e-12)
        for key in ("s1_seconds", "s2_seconds", "s1_cached", "n_examples"):
            assert key in summary["timings"]
        examples = pd.read_csv(out / name / "examples.csv")
        assert list(examples.columns) == [
            "idx",
            "prompt_type",
            "n_entity_tokens",
            "n_ke",
            "n_clipped",
            "uds",
            "uds_unclipped",
            "uds_clipped",
            "excess_disruption",
            "status",
            "skip_reason",
            "question",
            "entity",
        ]
        layers = pd.read_csv(out / name / "layers.csv")
        assert list(layers.columns) == [
            "idx",
            "layer",
            "site",
            "s0",
            "baseline_score",
            "s1_score",
            "s2_score",
            "d1",
            "d2",
            "ke",
            "ler",
        ]
        assert layers.groupby("idx")["s0"].nunique().eq(1).all()  # S0: one constant per example
        assert layers.loc[~layers["ke"], "ler"].isna().all() and layers.loc[layers["ke"], "ler"].notna().all()
        ou = json.loads((out / name / "uds_eval.json").read_text())
        assert ou["uds"]["agg_value"] == pytest.approx(summary["uds"])
    assert json.loads((out / "full" / "summary.json").read_text())["uds"] == 0.0
    # S1 was computed once for both models
    assert json.loads((out / "full" / "summary.json").read_text())["timings"]["s1_seconds"] == pytest.approx(
        json.loads((out / "unlearned" / "summary.json").read_text())["timings"]["s1_seconds"]
    )


@pytest.mark.parametrize("command", [score, sweep])
def test_uds_option_defaults_are_the_configs(command):
    """The defaults of the shared UDS options, written out in cli.py so that `--help` imports no torch, are
    UDSConfig's."""
    defaults = {name: parameter.default for name, parameter in inspect.signature(command).parameters.items()}
    config = UDSConfig()
    expected = {"tau": config.tau, "scope": config.patch_scope, "site": config.site, "engine": config.engine,
                "published_compat": config.published_compat, "batch_size": config.batch_size,
                "dtype": config.dtype, "device": config.device,
                "precision_check": config.precision_check}  # fmt: skip
    assert {name: defaults[name] for name in expected} == expected


def test_score_retain_free_and_bad_input(tiny, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, score_argv(tiny, tmp_path / "rf", tmp_path / "c", retain=False))
    assert result.exit_code == 0, result.output
    assert "unnormalised" in result.output
    result = runner.invoke(
        app,
        [
            "score",
            "--full",
            str(tiny.full),
            "--unlearned",
            str(tiny.unlearned),
            "--data",
            str(tiny.data),
            "--out",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code != 0


def test_tofu_experiment_fails_clearly_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "tofu_llama.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (
        "open-unlearning/tofu_Llama-3.2-1B-Instruct_full" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    )


def test_console_entry_point_prints_user_errors_without_a_traceback(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data.json"
    data.write_text("[]")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "uds-lens",
            "score",
            "--full",
            str(tmp_path / "no_such_model"),
            "--no-retain",
            "--unlearned",
            str(tmp_path / "no_such_model"),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "out"),
        ],
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


@pytest.mark.parametrize(
    "bad",
    [
        ["--tau", "-1"],
        ["--tau", "nan"],
        ["--limit", "-2"],
        ["--limit", "0"],
        ["--batch-size", "0"],
        ["--scope", "foo"],
        ["--site", "nowhere"],
        ["--engine", "slow"],
        ["--dtype", "float8"],
    ],
)
def test_out_of_range_options_are_one_line_errors_before_any_compute(
    tiny, tmp_path, monkeypatch, capsys, bad
):
    code, err, _ = run_cli(monkeypatch, capsys, *score_argv(tiny, tmp_path / "o", tmp_path / "c"), *bad)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_an_out_that_is_a_file_fails_before_any_compute(tiny, tmp_path, monkeypatch, capsys):
    (tmp_path / "o").write_text("a file")
    code, err, _ = run_cli(monkeypatch, capsys, *score_argv(tiny, tmp_path / "o", tmp_path / "c"))
    assert code == 2 and "is a file" in err and not (tmp_path / "c").exists()


def test_equal_basenames_get_distinct_names_and_reuse_is_announced(tiny, tmp_path):
    for parent in ("a", "b"):
        shutil.copytree(tiny.unlearned if parent == "a" else tiny.full, tmp_path / parent / "model")
    out = tmp_path / "out"
    models = (tmp_path / "a" / "model", tmp_path / "b" / "model", f"mine={tiny.unlearned}")
    command = score_argv(tiny, out, tmp_path / "cache", *models)
    first = CliRunner().invoke(app, command)
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["a__model", "b__model", "mine"]
    assert json.loads((out / "b__model" / "summary.json").read_text())["uds"] == 0.0  # b/model is full
    assert "reusing" not in first.output
    again = CliRunner().invoke(app, command)
    assert again.exit_code == 0, again.output
    for name in ("a__model", "b__model", "mine"):
        assert f"reusing {name}: identical inputs" in again.output
    forced = CliRunner().invoke(app, [*command, "--force"])
    assert forced.exit_code == 0 and "reusing" not in forced.output


def test_help_documents_reuse_and_loads_no_bitsandbytes(tmp_path):
    script = (
        "import sys; sys.argv = ['uds-lens', 'score', '--help']\n"
        "from uds_lens.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('BNB', 'bitsandbytes' in sys.modules)"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), COLUMNS="200"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "BNB False" in proc.stdout
    assert "bitsandbytes" not in proc.stderr.lower() and "warn" not in proc.stderr.lower()
    assert "--force" in proc.stdout and "identical" in proc.stdout


def test_score_stage2_cells_switch(tiny, tmp_path):
    """``score`` runs every cell by default; ``--stage2-cells ke`` only the KE cells, with the same UDS."""
    runner = CliRunner()
    every = runner.invoke(app, score_argv(tiny, tmp_path / "all", tmp_path / "c"))
    ke = runner.invoke(app, [*score_argv(tiny, tmp_path / "ke", tmp_path / "c"), "--stage2-cells", "ke"])
    assert every.exit_code == 0 and ke.exit_code == 0, every.output + ke.output
    summaries = {
        name: json.loads((tmp_path / name / "unlearned" / "summary.json").read_text())
        for name in ("all", "ke")
    }
    assert summaries["all"]["stage2"]["cells"] == "all" and summaries["ke"]["stage2"]["cells"] == "ke"
    assert "stage2_note" in summaries["ke"] and "stage2_note" not in summaries["all"]
    assert abs(summaries["all"]["uds"] - summaries["ke"]["uds"]) <= 1e-6
    bad = runner.invoke(app, [*score_argv(tiny, tmp_path / "x", tmp_path / "c"), "--stage2-cells", "some"])
    assert bad.exit_code != 0 and "stage2_cells" in str(bad.exception) + bad.output


def test_score_precision_check_switch(tiny, tmp_path):
    """In bf16 ``score`` decides in fp32 where rounding could (the default); ``--no-precision-check`` only counts."""
    runner = CliRunner()
    argv = [*score_argv(tiny, tmp_path / "on", tmp_path / "c"), "--dtype", "bf16", "--batch-size", "2"]
    checked = runner.invoke(app, argv)
    argv = [*score_argv(tiny, tmp_path / "off", tmp_path / "c"), "--dtype", "bf16", "--batch-size", "2"]
    counted = runner.invoke(app, [*argv, "--no-precision-check"])
    assert checked.exit_code == 0 and counted.exit_code == 0, checked.output + counted.output
    on, off = (
        json.loads((tmp_path / name / "unlearned" / "summary.json").read_text())["precision"]
        for name in ("on", "off")
    )
    assert on["check"] and on["decisions"]["ke"]["bfloat16"] == 0 and on["decisions"]["ke"]["float32"] > 0
    assert not off["check"] and off["n_redecided_cells"] == 0 and off["decisions"]["ke"]["float32"] == 0
    assert off["n_fragile_cells"] > 0 and set(off["per_example"]) == set(on["per_example"])
    # what ran in fp32, and why, is printed, not only saved
    n_fp32, n_examples = on["n_fp32_examples"], len(on["per_example"])
    assert f"precision of unlearned: bfloat16, precision check on: Stage 2 of {n_fp32} of {n_examples} " in (
        checked.output
    )
    assert "the fp32 runs took" in checked.output
    assert f"precision check off: {off['n_fragile_cells']} cells lie inside bfloat16's rounding band" in (
        counted.output
    )

"""Outputs never overwrite inputs (issues 36 and 49), on the tiny checkpoints: no command writes where it reads (an
output that is, holds or lies inside a checkpoint, the forget set, a zoo or another run's cache is refused before any
model loads), and none replaces a file it did not write without an explicit force (a report over a forget set or a
result's own files, a result over another run's result through the Python API, diagnose's tables over a score's,
annotate's summary over its input). Each test failed on the code before the issue that added it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from helpers.cli import one_line_error
from helpers.edits import raw_records
from helpers.refusals import forbid_model_loading
from helpers.tiny import FORGET_SET
from typer.testing import CliRunner

from uds_lens.analysis.diagnose import DiagnoseResult
from uds_lens.annotation import annotate
from uds_lens.auditor import UDSAuditor
from uds_lens.cli import app
from uds_lens.config import ConfigError
from uds_lens.plotting.report import write_report
from uds_lens.result_store import OutputConflictError
from uds_lens.results import UDSResult
from uds_lens.scoring import score_models
from uds_lens.sweep.driver import sweep as run_sweep
from uds_lens.sweep.lists import SweepError


def _checkpoints(tiny, root: Path) -> Path:
    """A folder holding copies of full, retain and unlearned (as a user's checkpoints folder does)."""
    for name in ("full", "retain", "unlearned"):
        shutil.copytree(getattr(tiny, name), root / name)
    return root


def _contents(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (hidden ones too) and the SHA-256 of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _score_argv(folder: Path, data: Path, out: Path, cache: Path) -> list[object]:
    return ["score", "--full", folder / "full", "--retain", folder / "retain", "--unlearned",
            folder / "unlearned", "--data", data, "--out", out, "--cache-dir", cache]  # fmt: skip


# -- outputs apart from every input ----------------------------------------------------------------------------


def test_score_into_its_checkpoints_folder_is_refused_and_leaves_them_whole(
    tiny, tmp_path, monkeypatch, capsys
):
    """Before: `--out .` among the checkpoints took the unlearned checkpoint for an unfinished result, copied it into
    a result directory and deleted the original."""
    folder = _checkpoints(tiny, tmp_path / "checkpoints")
    before = _contents(folder)
    forbid_model_loading(monkeypatch)
    line = one_line_error(monkeypatch, capsys, *_score_argv(folder, tiny.data, folder, tmp_path / "cache"))
    assert f"--out {folder} holds the full checkpoint" in line
    assert _contents(folder) == before


@pytest.mark.parametrize("where", ["is", "lies inside"])
def test_score_out_that_is_or_lies_inside_a_checkpoint_is_refused(tiny, tmp_path, monkeypatch, capsys, where):
    """Before: `--out` equal to the unlearned checkpoint wrote roles.json and a result directory into it."""
    folder = _checkpoints(tiny, tmp_path / "checkpoints")
    before = _contents(folder)
    out = folder / "unlearned" if where == "is" else folder / "full" / "results"
    forbid_model_loading(monkeypatch)
    line = one_line_error(monkeypatch, capsys, *_score_argv(folder, tiny.data, out, tmp_path / "cache"))
    assert f"{where} the" in line and "checkpoint" in line
    assert _contents(folder) == before
    with pytest.raises(ConfigError, match=f"{where} the"):  # the Python API refuses the same
        score_models(folder / "full", folder / "retain", {"u": folder / "unlearned"}, tiny.data, out_dir=out)


def test_an_output_holding_the_forget_set_or_inside_another_runs_cache_is_refused(
    tiny, tmp_path, monkeypatch
):
    forbid_model_loading(monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    data = Path(shutil.copy(tiny.data, work / "forget.json"))
    with pytest.raises(ConfigError, match="holds the forget set"):
        score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, data, out_dir=work)
    cache = tmp_path / "cache"
    cache.mkdir()  # another run's S1 cache
    with pytest.raises(ConfigError, match="lies inside the S1 cache"):
        score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=cache / "out",
                     cache_dir=cache)  # fmt: skip


def test_an_output_may_hold_its_own_s1_cache(tiny, tmp_path):
    out = tmp_path / "out"
    result = score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=out,
                          cache_dir=out / ".s1_cache", progress=False)["u"]  # fmt: skip
    assert UDSResult.load(out / "u").uds == result.uds and list((out / ".s1_cache").glob("s1_*"))


def test_a_sweep_into_its_checkpoints_folder_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    folder = _checkpoints(tiny, tmp_path / "checkpoints")
    before = _contents(folder)
    forbid_model_loading(monkeypatch)
    with pytest.raises(SweepError, match="holds the full checkpoint"):
        run_sweep(folder / "full", folder / "retain", tiny.data, folder, {"unlearned": str(folder / "unlearned")},
                  use_ray=False, cache_dir=tmp_path / "cache")  # fmt: skip
    assert _contents(folder) == before


def test_diagnose_into_a_checkpoint_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch, capsys):
    folder = _checkpoints(tiny, tmp_path / "checkpoints")
    before = _contents(folder)
    forbid_model_loading(monkeypatch)
    line = one_line_error(monkeypatch, capsys, "diagnose", "--full", folder / "full", "--retain",
                          folder / "retain", "--unlearned", folder / "unlearned", "--data", tiny.data,
                          "--out", folder / "unlearned", "--methods", "uds")  # fmt: skip
    assert "is the checkpoint" in line
    assert _contents(folder) == before


def test_annotate_into_a_checkpoint_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    folder = _checkpoints(tiny, tmp_path / "checkpoints")
    before = _contents(folder)
    forbid_model_loading(monkeypatch)
    with pytest.raises(ConfigError, match="lies inside the checkpoint"):
        annotate(
            raw_records(tmp_path / "raw.json"), None, folder / "retain", out=folder / "retain" / "a.json"
        )
    assert _contents(folder) == before


def test_the_demo_into_its_zoo_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    from uds_lens import demo

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    monkeypatch.setattr(demo, "build_zoo", lambda *a, **k: pytest.fail("a zoo was built"))
    with pytest.raises(ConfigError, match="lies inside the zoo"):
        demo.run_demo(zoo / "demo_out", zoo_dir=zoo, size="test")
    assert list(zoo.iterdir()) == []


@pytest.mark.parametrize("command", ["evaluate", "meta-eval"])
def test_evaluate_and_meta_eval_into_their_zoo_are_refused(tmp_path, monkeypatch, capsys, command):
    zoo = tmp_path / "zoo"
    for name in ("full", "retain"):
        (zoo / "models" / name).mkdir(parents=True)
    (zoo / "manifest.json").write_text(
        json.dumps({"models": [{"name": n, "path": f"models/{n}"} for n in ("full", "retain")]})
    )
    line = one_line_error(monkeypatch, capsys, command, "--zoo", zoo, "--out", zoo / "eval")
    assert f"--out {zoo / 'eval'} lies inside the zoo" in line


# -- no file replaced that the command did not write -----------------------------------------------------------


@pytest.fixture(scope="module")
def scored(tiny, tmp_path_factory) -> Path:
    """A directory of saved `score` results."""
    out = tmp_path_factory.mktemp("scored")
    score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=out, cache_dir=False,
                 progress=False)  # fmt: skip
    return out


@pytest.mark.parametrize("victim", ["forget set", "summary.json"])
def test_report_never_replaces_a_file_that_is_not_a_report(
    tiny, scored, tmp_path, monkeypatch, capsys, victim
):
    """Before: `report --out FILE` wrote HTML over any file, a forget set or the result's own summary.json; --force
    replaces a file that is no report, but never one of the results the report reads (issue 54)."""
    results = tmp_path / "results"
    shutil.copytree(scored, results)
    target = (
        Path(shutil.copy(tiny.data, tmp_path)) if victim == "forget set" else results / "u" / "summary.json"
    )
    before = target.read_bytes()
    line = one_line_error(monkeypatch, capsys, "report", results, "--out", target)
    assert "not a uds_lens report" in line and "--force" in line
    with pytest.raises(ConfigError, match="not a uds_lens report"):
        write_report(results, target)
    assert target.read_bytes() == before
    forced = CliRunner().invoke(app, ["report", str(results), "--out", str(target), "--force"])
    if victim == "summary.json":  # the report's own input
        assert forced.exit_code != 0 and target.read_bytes() == before
        return
    assert forced.exit_code == 0, forced.output
    assert target.read_text().startswith("<!DOCTYPE html>")


def test_a_report_replaces_an_earlier_report_and_checks_its_default_file(scored, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(scored, results)
    page = write_report(results, tmp_path / "page.html")
    page.write_text(page.read_text().replace("<main>", "<main><p>an older page</p>", 1))
    write_report(results, page)  # an earlier report: replaced without force
    assert "an older page" not in page.read_text()
    (results / "report.html").write_text("my own notes, not a report")
    with pytest.raises(ConfigError, match="not a uds_lens report"):
        write_report(results)  # the default RESULTS_DIR/report.html is checked too
    assert (results / "report.html").read_text() == "my own notes, not a report"


@pytest.fixture(scope="module")
def two_runs(tiny):
    """Results of two runs with other inputs (another unlearned model), both with their fingerprints."""
    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    return auditor.score(tiny.unlearned, name="u"), auditor.score(tiny.retain, name="u")


def test_saving_a_result_over_another_runs_result_is_refused_unless_forced(two_runs, tmp_path):
    """Before: UDSResult.save replaced another run's result silently, where `uds-lens score` refused it."""
    first, second = two_runs
    target = first.save(tmp_path / "u")
    before = _contents(target)
    with pytest.raises(OutputConflictError, match="unlearned differs.*--force"):
        second.save(target)
    assert _contents(target) == before
    first.save(target)  # the same run's result again: replaced
    second.save(target, force=True)
    assert UDSResult.load(target).uds == second.uds
    hand_made = UDSResult(first.name, first.examples, first.layers, first.settings, meta={})
    with pytest.raises(OutputConflictError, match="records no inputs"):
        hand_made.save(target)  # nothing to compare with: refused, not guessed


def test_diagnose_beside_a_score_result_keeps_it_whole(tiny, tmp_path):
    """Before (issue 36): diagnose's save deleted the score result's summary, tables and meta.json."""
    scored = score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=tmp_path / "out",
                          cache_dir=tmp_path / "cache", progress=False)["u"]  # fmt: skip
    tables = pd.DataFrame({"method": ["uds"], "layer": [0], "erasure": [0.5], "weight": [1.0]})
    DiagnoseResult(
        scores=pd.DataFrame({"uds": [0.5]}, index=["u"]),
        layerwise={"u": tables},
        components={"u": pd.DataFrame(columns=["site", "layer", "mean_d1", "mean_d2"])},
        uds_results={},
        prompt_types=None,
        tau_sensitivity=None,
    ).save(tmp_path / "out")
    again = UDSResult.load(tmp_path / "out" / "u")  # verifies every file against meta.json
    assert again.uds == scored.uds
    assert (tmp_path / "out" / "u" / "scores.json").is_file()


def test_annotate_never_writes_its_summary_over_its_input_or_a_foreign_file(tmp_path):
    """Before (issue 36): the summary went to X.summary.json whatever that file was, the --data input included."""
    data = raw_records(tmp_path / "raw.summary.json")
    before = data.read_bytes()
    with pytest.raises(ConfigError, match="over its input"):
        annotate(data, out=tmp_path / "raw.json")
    assert data.read_bytes() == before
    foreign = tmp_path / "notes.summary.json"
    foreign.write_text("my notes")
    with pytest.raises(ConfigError, match="not an earlier annotate summary"):
        annotate(raw_records(tmp_path / "in.json"), out=tmp_path / "notes.json")
    assert foreign.read_text() == "my notes"
    annotate(tmp_path / "in.json", out=tmp_path / "again.json")
    annotate(tmp_path / "in.json", out=tmp_path / "again.json")  # an earlier summary is replaced


def test_annotate_never_writes_its_records_over_a_file_it_did_not_write(tmp_path):
    """Before: ``--out`` naming any existing JSON (another run's forget set, notes) was replaced with records."""
    foreign = tmp_path / "forget.json"
    foreign.write_text('[{"question": "q", "answer": "a"}]')
    before = foreign.read_bytes()
    with pytest.raises(ConfigError, match="a file no earlier annotate wrote"):
        annotate(raw_records(tmp_path / "in.json"), out=foreign)
    assert foreign.read_bytes() == before
    assert not (tmp_path / "forget.summary.json").exists()


@pytest.mark.parametrize("where", ["directory", "under_a_file"])
def test_annotate_out_that_cannot_be_a_file_is_refused_before_anything_runs(tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "directory" else tmp_path / "file" / "x.json"
    with pytest.raises(ConfigError, match="is a directory|which is a file"):
        annotate(raw_records(tmp_path / "raw.json"), out=out)


def test_a_concurrent_run_of_other_inputs_is_refused_at_the_write(tiny, tmp_path, monkeypatch):
    """Two runs writing one NAME (issue 36): the second checked before the first wrote, and used to replace it."""
    cache = tmp_path / "cache"
    first = score_models(
        tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=tmp_path / "first", cache_dir=cache,
        progress=False,
    )["u"]  # fmt: skip
    out = tmp_path / "out"
    score = UDSAuditor.score

    def meanwhile(self, model, name=None):  # the first run finishes while this one computes
        result = score(self, model, name)
        shutil.copytree(tmp_path / "first" / "u", out / "u")
        return result

    monkeypatch.setattr(UDSAuditor, "score", meanwhile)
    with pytest.raises(OutputConflictError, match="unlearned differs"):
        score_models(tiny.full, tiny.retain, {"u": tiny.retain}, tiny.data, out_dir=out, cache_dir=cache,
                     progress=False)  # fmt: skip
    assert UDSResult.load(out / "u").uds == first.uds


def test_a_zoo_is_never_built_over_the_data_it_is_built_from(tmp_path, monkeypatch):
    from uds_lens.zoo import build

    zoo = tmp_path / "zoo"
    (zoo / "mine").mkdir(parents=True)
    forget = zoo / "mine" / "forget.json"
    forget.write_text(json.dumps(FORGET_SET))
    retain = tmp_path / "retain.json"
    retain.write_text(json.dumps(FORGET_SET))
    monkeypatch.setattr(build, "_pinned_threads", lambda threads: pytest.fail("the build started"))
    with pytest.raises(ConfigError, match="holds the --forget-data"):
        build.build_zoo(zoo, retain_data=retain, forget_data=forget)
    assert sorted(p.name for p in zoo.rglob("*")) == ["forget.json", "mine"]

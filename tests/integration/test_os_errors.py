"""The operating system's errors (issue 49), on the tiny checkpoints: every class of ``OSError`` a location can give
(no permission, a full disk, a name too long, a symbolic-link loop, a file where a directory should be) is one line
naming the path and what to do, found before any model loads where it can be; the S1 cache, which is optional, is
skipped with a warning when it cannot be written, and the run goes on. Each test failed on 34971a7 (a traceback,
most often after the models had run)."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
from helpers.cli import one_line_error
from helpers.refusals import disk_full, forbid_model_loading, read_only
from helpers.tiny import FORGET_SET
from typer.testing import CliRunner

from uds_lens import stage_cache
from uds_lens.cli import app
from uds_lens.results import UDSResult
from uds_lens.scoring import score_models


def _score(tiny, out: Path, *extra: object) -> list[object]:
    return ["score", "--full", tiny.full, "--retain", tiny.retain, "--unlearned", f"u={tiny.unlearned}",
            "--data", tiny.data, "--out", out, *extra]  # fmt: skip


def _bad_location(tmp_path: Path, kind: str) -> Path:
    if kind == "name over 255 bytes":
        return tmp_path / ("x" * 300) / "out"
    if kind == "symlink loop":
        loop = tmp_path / "loop"
        loop.symlink_to(loop)
        return loop
    (tmp_path / "a_file").write_text("x")
    return tmp_path / "a_file" / "out"


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("name over 255 bytes", "File name too long"),
        ("symlink loop", "File exists"),
        ("file where a directory should be", "Not a directory"),
    ],
)
def test_an_out_the_system_cannot_make_is_one_line_before_any_model_loads(
    tiny, tmp_path, monkeypatch, capsys, kind, said
):
    """Before: a traceback, after Stage 1 and Stage 2 had run."""
    out = _bad_location(tmp_path, kind)
    forbid_model_loading(monkeypatch)
    line = one_line_error(monkeypatch, capsys, *_score(tiny, out, "--cache-dir", tmp_path / "cache"))
    assert "--out" in line and said in line and "(" in line


def test_a_read_only_out_is_one_line_before_any_model_loads(tiny, tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    forbid_model_loading(monkeypatch)
    with read_only(locked):
        line = one_line_error(
            monkeypatch, capsys, *_score(tiny, locked / "out", "--cache-dir", tmp_path / "c")
        )
    assert f"--out {locked / 'out'}: Permission denied (check its permissions" in line


def test_a_full_disk_at_the_write_is_one_line_naming_the_result(tiny, tmp_path, monkeypatch, capsys):
    """A full disk cannot be checked before compute (there may be room then); its write error names no file. Before:
    a traceback of ``OSError: [Errno 28] No space left on device``."""
    out = tmp_path / "out"
    disk_full(monkeypatch, out)
    line = one_line_error(monkeypatch, capsys, *_score(tiny, out, "--cache-dir", tmp_path / "cache"))
    assert f"error: {out / 'u'}: No space left on device (the disk is full" in line
    assert not (out / "u").exists()


def _score_with_warnings(tiny, out: Path, cache_dir) -> tuple[UDSResult, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=out,
                              cache_dir=cache_dir, progress=False)["u"]  # fmt: skip
    return result, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def uncached_uds(tiny) -> float:
    return score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, cache_dir=False,
                        progress=False)["u"].uds  # fmt: skip


def test_an_s1_cache_that_cannot_be_written_is_skipped_with_a_warning(tiny, tmp_path, uncached_uds):
    """Before: the run failed (a traceback after Stage 1) for a cache it does not need."""
    locked = tmp_path / "locked"
    locked.mkdir()
    with read_only(locked):
        result, said = _score_with_warnings(tiny, tmp_path / "out", locked / "cache")
    assert result.uds == uncached_uds and UDSResult.load(tmp_path / "out" / "u").uds == uncached_uds
    assert any("S1 cache not written" in text and "Permission denied" in text for text in said), said


def test_a_full_s1_cache_is_skipped_with_a_warning(tiny, tmp_path, monkeypatch, uncached_uds):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(stage_cache, "save_file", full_disk)
    result, said = _score_with_warnings(tiny, tmp_path / "out", tmp_path / "cache")
    assert result.uds == uncached_uds
    assert any("S1 cache not written" in text and "No space left" in text for text in said), said
    assert not list((tmp_path / "cache").glob("*s1_*"))  # no staging file left behind either


def test_uds_lens_cache_pointing_to_a_file_skips_the_cache_and_scores(
    tiny, tmp_path, monkeypatch, uncached_uds
):
    """Before: FileExistsError after Stage 1 (the default S1 cache lives under ``UDS_LENS_CACHE``)."""
    not_a_directory = tmp_path / "cache_file"
    not_a_directory.write_text("x")
    monkeypatch.setenv("UDS_LENS_CACHE", str(not_a_directory))
    result, said = _score_with_warnings(tiny, tmp_path / "out", None)
    assert result.uds == uncached_uds
    assert any("S1 cache not written" in text and str(not_a_directory) in text for text in said), said
    run = CliRunner().invoke(app, [str(a) for a in _score(tiny, tmp_path / "cli_out")])
    assert run.exit_code == 0, run.output


def test_the_demo_with_uds_lens_cache_pointing_to_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    """The demo's zoo lives under ``UDS_LENS_CACHE``: it cannot be built there, said in one line."""
    not_a_directory = tmp_path / "cache_file"
    not_a_directory.write_text("x")
    monkeypatch.setenv("UDS_LENS_CACHE", str(not_a_directory))
    monkeypatch.delenv("UDS_LENS_ZOO", raising=False)
    line = one_line_error(monkeypatch, capsys, "demo", "--out", tmp_path / "demo", "--size", "test")
    assert str(not_a_directory) in line and "Not a directory" in line


def test_file_outputs_with_a_name_over_255_bytes_are_one_line(tiny, tmp_path, monkeypatch, capsys):
    """Before: ``OSError: [Errno 36] File name too long`` tracebacks; annotate's summary takes 13 more bytes than
    its --out name, so a 250-character name failed only there."""
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps([{k: r[k] for k in ("idx", "question", "answer")} for r in FORGET_SET]))
    line = one_line_error(
        monkeypatch, capsys, "annotate", "--data", raw, "--out", tmp_path / ("a" * 250 + ".json")
    )
    assert "summary" in line and "File name too long" in line and "shorter names" in line
    score_models(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=tmp_path / "results",
                 cache_dir=False, progress=False)  # fmt: skip
    line = one_line_error(
        monkeypatch, capsys, "report", tmp_path / "results", "--out", tmp_path / ("r" * 252 + ".html")
    )
    assert "(--out)" in line and "File name too long" in line

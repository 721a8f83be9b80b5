"""uds_lens/results.py: atomic locked writes, a reader that refuses mixed directories, fingerprint-keyed reuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from uds_lens.auditor import UDSAuditor
from uds_lens.config import UDSConfig
from uds_lens.result_store import (
    ResultIntegrityError,
    ResultNameError,
    atomic_result_dir,
    check_result_name,
    verify_result_dir,
)
from uds_lens.results import UDSResult, can_reuse, check_saved, load_reusable
from uds_lens.scoring import score_models

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_results(tiny):
    """Results of one model under two settings whose numbers differ (plain vs published_compat)."""
    out = {}
    for compat in (False, True):
        auditor = UDSAuditor(
            tiny.full,
            tiny.retain,
            tiny.data,
            UDSConfig(published_compat=compat),
            cache_dir=False,
            progress=False,
        )
        out[compat] = auditor.score(tiny.unlearned, name="model")
    assert np.isfinite(out[False].uds) and np.isfinite(out[True].uds)
    assert out[False].uds != pytest.approx(out[True].uds)
    return out


def _files_agree(directory: Path) -> bool:
    """The published_compat setting a directory's files agree on; fails when two files disagree (checked from the
    numbers, independently of the digests)."""
    meta = json.loads((directory / "meta.json").read_text())
    summary = json.loads((directory / "summary.json").read_text())
    examples = pd.read_csv(directory / "examples.csv")
    assert meta["settings"]["published_compat"] == summary["settings"]["published_compat"]
    assert summary["uds"] == pytest.approx(examples["uds"].dropna().mean())
    loaded = UDSResult.load(directory, verify=False)
    assert loaded.with_tau(loaded.settings["tau"]).uds == pytest.approx(summary["uds"])
    return meta["settings"]["published_compat"]


def test_save_round_trip_records_digests_and_refuses_a_mixed_directory(two_results, tmp_path):
    target = tmp_path / "model"
    two_results[False].save(target)
    assert verify_result_dir(target) is None
    assert UDSResult.load(target).uds == pytest.approx(two_results[False].uds)
    # a file from another run: the reader refuses, whatever meta.json says
    other = tmp_path / "other"
    two_results[True].save(other)
    (target / "examples.csv").write_bytes((other / "examples.csv").read_bytes())
    assert "examples.csv" in verify_result_dir(target)
    with pytest.raises(ResultIntegrityError, match="examples.csv"):
        UDSResult.load(target)
    # an empty layers file (a kill while writing it) is refused too, not a crash later
    two_results[False].save(target)
    (target / "layers.csv").write_text("")
    with pytest.raises(ResultIntegrityError, match="layers.csv"):
        UDSResult.load(target)


def test_a_failed_write_leaves_the_previous_directory(two_results, tmp_path):
    target = tmp_path / "model"
    two_results[False].save(target)
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_result_dir(target) as staging:
            (staging / "summary.json").write_text("{}")
            raise RuntimeError("disk full")
    assert verify_result_dir(target) is None and _files_agree(target) is False
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["model"]


def test_an_overwrite_keeps_files_other_tools_left(two_results, tmp_path):
    target = tmp_path / "model"
    two_results[False].save(target)
    (target / "scores.json").write_text('{"cka": 0.5}')
    two_results[True].save(target, force=True)  # another run's settings: replaced only when forced
    assert json.loads((target / "scores.json").read_text()) == {"cka": 0.5}
    assert _files_agree(target) is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.") and p.is_dir()]


def test_the_next_writer_renames_back_an_old_result_a_kill_left_aside(two_results, tmp_path):
    """A writer killed between ``replace_directory``'s two renames leaves no OUT/NAME, its old result whole aside
    (``.NAME.old-*``) and its new one staged (``.NAME.tmp-*``): the next writer renames the old one back before it
    checks and writes, so what the old directory held beside the result is carried over, and nothing is left."""
    target = tmp_path / "model"
    two_results[False].save(target)
    (target / "scores.json").write_text('{"cka": 0.5}')
    os.rename(target, tmp_path / ".model.old-0123456789ab")
    two_results[True].save(tmp_path / "staged")
    os.rename(tmp_path / "staged", tmp_path / ".model.tmp-1-deadbeef")
    seen = []
    with atomic_result_dir(target, check=lambda t: seen.append(verify_result_dir(t))) as staging:
        (staging / "summary.json").write_text("{}")
    assert seen == [None]  # the check saw the old result, whole
    assert json.loads((target / "scores.json").read_text()) == {"cka": 0.5}
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["model"]


def test_two_concurrent_writers_never_leave_files_that_disagree(two_results, tmp_path, monkeypatch):
    """Writer A stalls in the middle of its files until writer B has finished (or 3 s passed): written in place,
    the directory ends with B's summary and A's meta; written atomically under the lock, it is one run's."""
    target = tmp_path / "out" / "model"
    b_done = threading.Event()
    original = Path.write_text

    def stalling_write_text(self, *args, **kwargs):  # layers.csv, or write_atomic's hidden sibling of it
        layers = self.name == "layers.csv" or self.name.startswith(".layers.csv.tmp-")
        if threading.current_thread().name == "writer-a" and layers:
            b_done.wait(timeout=3.0)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", stalling_write_text)
    errors: list[BaseException] = []

    def write(result: UDSResult, done: threading.Event | None) -> None:
        try:
            result.save(target, force=True)  # two runs of other settings: forced, the last one wins whole
        except BaseException as error:  # surfaced below
            errors.append(error)
        finally:
            if done is not None:
                done.set()

    writer_a = threading.Thread(target=write, args=(two_results[False], None), name="writer-a")
    writer_b = threading.Thread(target=write, args=(two_results[True], b_done), name="writer-b")
    writer_a.start()
    while (
        not any(
            p.name.startswith(".model.tmp-") or p.name == "model"
            for p in target.parent.glob("*")
            if target.parent.is_dir()
        )
        and writer_a.is_alive()
    ):
        threading.Event().wait(0.01)
    writer_b.start()
    writer_a.join(30)
    writer_b.join(30)
    assert not errors
    compat = _files_agree(target)
    assert verify_result_dir(target) is None
    assert UDSResult.load(target).uds == pytest.approx(two_results[compat].uds)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, pathlib
    import pandas as pd
    from uds_lens.config import UDSConfig
    from uds_lens.scoring import score_models

    full, retain, unlearned, data, out, cache, victim = sys.argv[1:8]

    def die_at(name):
        # SIGKILL the moment the victim file (or write_atomic's hidden sibling of it) is opened for writing: no
        # cleanup, no finally blocks
        file_name = pathlib.Path(str(name)).name
        if file_name == victim or file_name.startswith(f".{victim}.tmp-"):
            open(name, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    original_write_text, original_to_csv = pathlib.Path.write_text, pd.DataFrame.to_csv
    def write_text(self, *args, **kwargs):
        die_at(self)
        return original_write_text(self, *args, **kwargs)
    def to_csv(self, path=None, *args, **kwargs):
        die_at(path)
        return original_to_csv(self, path, *args, **kwargs)
    pathlib.Path.write_text, pd.DataFrame.to_csv = write_text, to_csv
    score_models(full, retain, {"model": unlearned}, data, out_dir=out, cache_dir=cache, progress=False,
                 config=UDSConfig(published_compat=True), force=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["layers.csv", "meta.json"])
def test_a_kill_during_an_overwrite_leaves_the_old_result_and_a_rerun_recomputes(tiny, tmp_path, victim):
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = [str(tiny.full), str(tiny.retain), str(tiny.unlearned), str(tiny.data)]
    plain = score_models(
        *args[:2], {"model": tiny.unlearned}, tiny.data, out_dir=out, cache_dir=cache, progress=False
    )["model"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, *args, str(out), str(cache), victim],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    # the old (plain) result is intact and still reads back as plain
    assert verify_result_dir(out / "model") is None
    assert _files_agree(out / "model") is False
    pd.testing.assert_frame_equal(UDSResult.load(out / "model").examples, plain.examples, check_dtype=False)
    # rerun with the killed run's settings: recomputed (nothing of it was kept), equal to a fresh run
    compat = score_models(
        *args[:2],
        {"model": tiny.unlearned},
        tiny.data,
        out_dir=out,
        cache_dir=cache,
        config=UDSConfig(published_compat=True),
        progress=False,
        force=True,  # the saved result is of other settings: another run's, replaced only when forced
    )["model"]
    assert "reused" not in compat.meta
    fresh = UDSAuditor(
        tiny.full, tiny.retain, tiny.data, UDSConfig(published_compat=True), cache_dir=False, progress=False
    ).score(tiny.unlearned)
    assert compat.uds == pytest.approx(fresh.uds)
    assert _files_agree(out / "model") is True
    assert not [p for p in out.iterdir() if p.is_dir() and p.name.startswith(".")]


def test_reuse_needs_the_same_fingerprint(two_results, tmp_path):
    target = tmp_path / "model"
    result = two_results[False]
    fingerprint = result.meta["fingerprint"]
    assert can_reuse(target, fingerprint) == (False, "there is no result directory")
    result.save(target)
    assert can_reuse(target, fingerprint) == (True, "identical inputs")
    loaded, _ = load_reusable(target, fingerprint)
    assert loaded.uds == pytest.approx(result.uds)
    changed = {**fingerprint, "retain": "files:0000"}
    ok, reason = can_reuse(target, changed)
    assert not ok and reason == f"retain differs (saved {fingerprint['retain']}, now files:0000)"
    assert check_saved(target, changed).conflicts == ("retain",)


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", "", ".hidden", "a\\b"])
def test_result_names_stay_one_path_component(tiny, tmp_path, name):
    out = tmp_path / "inner" / "out"
    with pytest.raises(ResultNameError, match="single path component"):
        score_models(
            tiny.full,
            tiny.retain,
            {name: tiny.unlearned},
            tiny.data,
            out_dir=out,
            cache_dir=False,
            progress=False,
        )
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    with pytest.raises(ResultNameError):
        check_result_name(name)


def test_an_out_dir_that_is_a_file_fails_before_any_compute(tiny, tmp_path):
    out = tmp_path / "out"
    out.write_text("not a directory")
    with pytest.raises(ValueError, match="is a file"):
        score_models(
            tiny.full,
            tiny.retain,
            [tiny.unlearned],
            tiny.data,
            out_dir=out,
            cache_dir=tmp_path / "c",
            progress=False,
        )
    assert not (tmp_path / "c").exists()


def test_loaded_tables_match_the_saved_numbers(two_results, tmp_path):
    result = two_results[True]
    result.save(tmp_path / "model")
    loaded = UDSResult.load(tmp_path / "model")
    assert np.allclose(loaded.layers["d2"], result.layers["d2"])

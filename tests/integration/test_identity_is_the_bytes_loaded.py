"""Never silently wrong, part five (issue 54), on the tiny checkpoints: a result's and the S1 cache's identity is the
digest of the bytes the model was built from, a remembered digest only a hint its files' stamp must prove (ctime
included, "racily clean" stamps read again) and checked again after the load; a run touches only what it wrote; the
tracebacks left become one line. Each test failed on the code before the issue (feff4ff)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from helpers.cli import one_line_error
from helpers.runs import forbid_stage1, score_tiny

from uds_lens.checkpoints import digests
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.folder import ModelLoadError


@pytest.fixture(autouse=True)
def own_digests(tmp_path, monkeypatch):
    """A digest cache of this test's own, in memory and on disk: nothing remembered from another test."""
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache-root"))
    monkeypatch.setattr(digests, "_DIGESTS", {})


def _settle() -> None:
    """Wait until files just written are older than the filesystem clock's resolution, so that a digest remembered
    for them from now on is trusted by its stamp (the way a checkpoint written long before a run is)."""
    time.sleep(0.15)


def _rewrite_in_place(target: Path, source: Path, names: tuple[str, ...] = ("model.safetensors",)) -> None:
    """Overwrite ``target``'s files in place with ``source``'s bytes (the same size) and put their times back, as
    ``touch -r``, ``rsync -t`` and ``cp -p`` leave a file: same name, size, mtime, inode and device."""
    for name in names:
        path, data = target / name, (source / name).read_bytes()
        before = path.stat()
        assert len(data) == before.st_size and data != path.read_bytes()
        with path.open("r+b") as handle:
            handle.write(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = path.stat()
        assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
            before.st_ino,
            before.st_mtime_ns,
            before.st_size,
        )


def _digest_of_bytes(folder: Path, tmp_path: Path) -> str:
    """The digest of ``folder``'s bytes as they are now (a copy: other inodes, nothing remembered for them)."""
    copy = tmp_path / f"copy-of-{folder.name}-{time.monotonic_ns()}"
    shutil.copytree(folder, copy)
    return Checkpoint.resolve(copy).digest


def _copy(source: Path, target: Path) -> Path:
    return Path(shutil.copytree(source, target))


# ----------------------------------------------------------------------------------------------------------------
# A rewritten file keeps its stamp


@pytest.mark.parametrize("layout", ["one file", "shards indexed from a subfolder"])
def test_a_weight_file_rewritten_in_place_with_its_times_put_back_is_read_again(tiny, tmp_path, layout):
    """The stamp now holds the status-change time, which no tool puts back: the remembered digest no longer
    answers, and the digest is that of the new bytes (in both layouts, also with the index in a subfolder)."""
    model, other = tmp_path / "model", tiny.variant(tmp_path / "other", seed=21, base=tiny.full, noise=0.15)
    _copy(tiny.unlearned, model)
    names = ("model.safetensors",)
    if layout != "one file":
        names = ("sub/model-00001-of-00001.safetensors",)
        for folder in (model, other):
            (folder / "sub").mkdir()
            (folder / "model.safetensors").rename(folder / names[0])
            weight_map = {"weight_map": {"model.embed_tokens.weight": names[0]}}
            (folder / "sub" / "model.safetensors.index.json").write_text(json.dumps(weight_map))
            config = json.loads((folder / "config.json").read_text())
            config["transformers_weights"] = "sub/model.safetensors.index.json"
            (folder / "config.json").write_text(json.dumps(config))
    _settle()
    before = Checkpoint.resolve(model).digest
    assert Checkpoint.resolve(model).known_digest() in (before, None)
    _rewrite_in_place(model, other, names)
    assert Checkpoint.resolve(model).known_digest() is None
    assert Checkpoint.resolve(model).digest == _digest_of_bytes(model, tmp_path) != before


def test_a_file_extracted_over_another_is_read_again_even_on_the_freed_inode(tiny, tmp_path):
    """A checkpoint extracted over another (the old file deleted, a new one created, its mtime set from the
    archive): where the file system hands the freed inode to the new file, only the ctime tells them apart."""
    model, other = (
        _copy(tiny.unlearned, tmp_path / "model"),
        tiny.variant(tmp_path / "other", seed=22, base=tiny.full, noise=0.15),
    )
    weights = model / "model.safetensors"
    _settle()
    before = Checkpoint.resolve(model).digest
    stat = weights.stat()
    weights.unlink()
    weights.write_bytes((other / "model.safetensors").read_bytes())
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert Checkpoint.resolve(model).digest == _digest_of_bytes(model, tmp_path) != before


def test_a_digest_remembered_while_its_files_were_changing_is_read_again(tiny, tmp_path):
    """ "Racily clean": a digest remembered for files changed within the clock's resolution of that moment is never
    trusted (a second write in the same clock step could keep the stamp); files older than that are trusted."""
    model = _copy(tiny.unlearned, tmp_path / "model")
    checkpoint = Checkpoint.resolve(model)
    files = list(checkpoint.files.identifying)
    digests.remember_digest(digests.file_stamp(checkpoint.files.root, files), "xxh3_128/v2:" + "0" * 32)
    assert Checkpoint.resolve(model).digest == _digest_of_bytes(model, tmp_path)


def test_a_retain_rewritten_in_place_never_selects_the_stale_stage1_cache(tiny, tmp_path):
    """The S1 cache is keyed by the digest of the bytes retain's load read: a fresh ``--out`` after retain was
    rewritten in place (times put back) computes Stage 1 from the new retain, as a fresh cache does."""
    retain = _copy(tiny.retain, tmp_path / "retain")
    other = tiny.variant(tmp_path / "other", seed=23, base=tiny.full, noise=0.3)
    cache = tmp_path / "s1"
    _settle()
    first = score_tiny(tiny, tmp_path / "out1", cache, retain=retain)["u"]
    _rewrite_in_place(retain, other)
    again = score_tiny(tiny, tmp_path / "out2", cache, retain=retain)["u"]
    truth = score_tiny(tiny, tmp_path / "out3", tmp_path / "s1-fresh", retain=other)["u"]
    assert not again.meta["timings"]["s1_cached"]
    assert again.uds == pytest.approx(truth.uds, abs=1e-6) and abs(again.uds - first.uds) > 1e-3
    assert again.meta["fingerprint"]["retain"] == truth.meta["fingerprint"]["retain"]


def test_an_unlearned_model_rewritten_in_place_is_not_reused(tiny, tmp_path):
    """A rerun into the same ``--out`` after the unlearned model was rewritten in place (times put back) does not
    reuse its saved result ("identical inputs" before): the saved result is of other weights under that name, so it
    is refused as another run's, and recomputed from the new bytes when forced."""
    from uds_lens.result_store import OutputConflictError

    model = _copy(tiny.unlearned, tmp_path / "model")
    other = tiny.variant(tmp_path / "other", seed=24, base=tiny.full, noise=0.15)
    out, cache = tmp_path / "out", tmp_path / "s1"
    _settle()
    first = score_tiny(tiny, out, cache, unlearned={"u": model})["u"]
    _rewrite_in_place(model, other)
    with pytest.raises(OutputConflictError, match="unlearned differs"):
        score_tiny(tiny, out, cache, unlearned={"u": model})
    again = score_tiny(tiny, out, cache, unlearned={"u": model}, force=True)["u"]
    truth = score_tiny(tiny, tmp_path / "out-truth", cache, unlearned={"u": other})["u"]
    assert "reused" not in again.meta
    assert again.uds == pytest.approx(truth.uds, abs=1e-6) and abs(again.uds - first.uds) > 1e-4


# ----------------------------------------------------------------------------------------------------------------
# A digest taken before loading is never stamped on what is loaded later


def test_a_model_replaced_between_the_reuse_decision_and_its_load_is_saved_under_what_was_loaded(
    tiny, tmp_path, monkeypatch
):
    """``score`` decides reuse from the files as they are, then loads: a model replaced in between is scored and
    saved under the digest of the bytes loaded, so the next run does not "reuse" a number of other weights."""
    import uds_lens.scoring as scoring
    from uds_lens.results import load_reusable

    model = _copy(tiny.unlearned, tmp_path / "model")
    other = tiny.variant(tmp_path / "other", seed=25, base=tiny.full, noise=0.15)
    out, cache = tmp_path / "out", tmp_path / "s1"
    _settle()
    score_tiny(tiny, out, cache, unlearned={"u": model})
    (out / "u" / "examples.csv").write_text("damaged")  # so the rerun decides, then recomputes
    decide = load_reusable  # the name `scoring` calls

    def decide_then_replace(target, fingerprint):
        decided = decide(target, fingerprint)
        shutil.rmtree(model)
        shutil.copytree(other, model)  # another model where the decision looked
        return decided

    monkeypatch.setattr(scoring, "load_reusable", decide_then_replace)
    again = score_tiny(tiny, out, cache, unlearned={"u": model})["u"]
    monkeypatch.setattr(scoring, "load_reusable", load_reusable)
    truth = score_tiny(tiny, tmp_path / "out-truth", cache, unlearned={"u": other})["u"]
    assert again.meta["fingerprint"]["unlearned"] == "files:" + _digest_of_bytes(other, tmp_path)
    assert again.uds == pytest.approx(truth.uds, abs=1e-6)
    rerun = score_tiny(tiny, out, cache, unlearned={"u": model})["u"]
    assert rerun.meta.get("reused") == "identical inputs" and rerun.uds == again.uds


def test_a_checkpoint_value_kept_across_calls_is_identified_by_what_its_load_read(tiny, tmp_path):
    """A `Checkpoint` whose digest was asked before its files were replaced: the result of scoring it records the
    bytes loaded, never the digest asked earlier."""
    from uds_lens.auditor import UDSAuditor

    model = _copy(tiny.unlearned, tmp_path / "model")
    other = tiny.variant(tmp_path / "other", seed=26, base=tiny.full, noise=0.15)
    _settle()
    kept = Checkpoint.resolve(model)
    asked = kept.digest
    shutil.rmtree(model)
    shutil.copytree(other, model)
    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    result = auditor.score(kept)
    assert (
        result.meta["fingerprint"]["unlearned"]
        == "files:" + _digest_of_bytes(other, tmp_path)
        != "files:" + asked
    )


def test_the_sweep_decides_again_on_the_bytes_its_look_ahead_loaded(tiny, tmp_path, monkeypatch):
    """The sweep's look-ahead decides reuse from the stamp, then loads: a model replaced in between is decided again
    on the bytes loaded, and its row and result carry their digest."""
    from uds_lens.sweep.driver import sweep
    from uds_lens.sweep.ledger import Ledger

    model = _copy(tiny.unlearned, tmp_path / "model")
    other = tiny.variant(tmp_path / "other", seed=27, base=tiny.full, noise=0.15)
    _settle()
    # remembered, and trusted by its stamp: the look-ahead decides without reading
    asked = Checkpoint.resolve(model).digest
    decide = Ledger.check_staged
    replaced = []

    def decide_then_replace(self, prepared, force):
        decide(self, prepared, force)
        if not replaced:
            shutil.rmtree(model)
            shutil.copytree(other, model)
            replaced.append(True)

    monkeypatch.setattr(Ledger, "check_staged", decide_then_replace)
    table = sweep(
        tiny.full, tiny.retain, tiny.data, tmp_path / "out", {"u": str(model)}, workers=1,
        cache_dir=tmp_path / "s1", progress=False,
    )  # fmt: skip
    assert replaced and (table["status"] == "scored").all(), table["error"].tolist()
    expected = "files:" + _digest_of_bytes(other, tmp_path)
    assert expected != "files:" + asked
    assert table.loc[0, "fp_unlearned"] == expected
    saved = json.loads((tmp_path / "out" / "u" / "meta.json").read_text())
    assert saved["meta"]["fingerprint"]["unlearned"] == expected


def test_a_file_rewritten_while_it_is_read_is_refused(tiny, tmp_path, monkeypatch):
    """The load reads the files' stamp before and after its pass: weights rewritten while they were read (a mix of
    two versions) are refused in one line, never loaded."""
    import io

    from uds_lens.checkpoints.loader import load_hf_model

    model = _copy(tiny.unlearned, tmp_path / "model")
    other = tiny.variant(tmp_path / "other", seed=28, base=tiny.full, noise=0.15)
    weights = (model / "model.safetensors").resolve()
    real_open = io.open
    done = []

    def open_and_rewrite(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        unbuffered = (args[0] if args else kwargs.get("buffering")) == 0  # the load's pass, not a header read
        if unbuffered and not done and Path(str(file)).resolve() == weights:
            done.append(True)
            with real_open(weights, "r+b") as writer:  # another process rewrites the file in place meanwhile
                writer.write((other / "model.safetensors").read_bytes())
        return handle

    monkeypatch.setattr(io, "open", open_and_rewrite)
    monkeypatch.setattr("builtins.open", open_and_rewrite)
    with pytest.raises(ModelLoadError, match="changed while it was read"):
        load_hf_model(model, device="cpu")
    assert done


# ----------------------------------------------------------------------------------------------------------------
# The released retain model is reloaded only as the bytes Stage 1 used


def test_a_retain_model_replaced_after_stage1_is_refused_when_reloaded(tiny, tmp_path):
    from uds_lens.auditor import UDSAuditor

    retain = _copy(tiny.retain, tmp_path / "retain")
    other = tiny.variant(tmp_path / "other", seed=29, base=tiny.full, noise=0.3)
    auditor = UDSAuditor(tiny.full, retain, tiny.data, cache_dir=False, progress=False)
    auditor.score(tiny.unlearned)  # Stage 1 computed, the retain model released
    assert auditor._retain is None
    _rewrite_in_place(retain, other)
    with pytest.raises(ModelLoadError, match="no longer is what Stage 1 was computed from") as error:
        _ = auditor.retain
    assert str(retain) in str(error.value) and "\n" not in str(error.value)


def test_a_retain_folder_deleted_after_stage1_is_one_line(tiny, tmp_path):
    from uds_lens.auditor import UDSAuditor

    retain = _copy(tiny.retain, tmp_path / "retain")
    auditor = UDSAuditor(tiny.full, retain, tiny.data, cache_dir=False, progress=False)
    auditor.score(tiny.unlearned)
    shutil.rmtree(retain)
    with pytest.raises(ModelLoadError) as error:
        _ = auditor.retain
    assert str(retain) in str(error.value) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------------------------------
# A run touches only what it wrote


@pytest.mark.parametrize("what", ["a checkpoint", "the S1 cache"])
def test_a_folder_uds_lens_did_not_write_at_out_name_is_refused_and_left_whole(
    tiny, tmp_path, monkeypatch, what
):
    out, cache = tmp_path / "out", tmp_path / "out" / "u"
    if what == "a checkpoint":
        cache = tmp_path / "s1"
        _copy(tiny.unlearned, out / "u")
    else:
        score_tiny(tiny, tmp_path / "elsewhere", cache)  # the S1 cache lives in OUT/u
    before = {path.name: path.read_bytes() for path in (out / "u").iterdir()}
    forbid_stage1(monkeypatch)
    from uds_lens.result_store import OutputConflictError

    with pytest.raises(OutputConflictError, match="did not write") as error:
        score_tiny(tiny, out, cache, force=True)
    assert str(out / "u") in str(error.value)
    assert {path.name: path.read_bytes() for path in (out / "u").iterdir()} == before


def test_links_in_a_result_directory_are_carried_as_links_never_copied_through(tiny, tmp_path):
    """A result recomputed over one of ours keeps the files another program left there, but a symbolic link stays
    a link: never the bytes it points to (a link to ``/dev/zero`` filled a disk), never a walk through the folder it
    points to (a link to ``..`` copied its own parent into itself until it failed, after the whole computation; a
    link to a bounded folder stands in for it here, so the old code fails this test without filling the disk)."""
    out, cache = tmp_path / "out", tmp_path / "s1"
    score_tiny(tiny, out, cache)
    outside = tmp_path / "big.bin"
    outside.write_bytes(b"x" * 1000)
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "inside.txt").write_text("not to be copied")
    (out / "u" / "to-file").symlink_to(outside)
    (out / "u" / "to-folder").symlink_to(folder)
    (out / "u" / "examples.csv").write_text("damaged")  # recomputed
    again = score_tiny(tiny, out, cache)["u"]
    assert again.meta["recomputed"].startswith("examples.csv")
    assert (out / "u" / "to-file").is_symlink() and os.readlink(out / "u" / "to-file") == str(outside)
    assert (out / "u" / "to-folder").is_symlink() and os.readlink(out / "u" / "to-folder") == str(folder)


def test_a_result_saved_onto_its_own_input_checkpoint_is_refused(tiny, tmp_path):
    from uds_lens.auditor import UDSAuditor
    from uds_lens.config import ConfigError
    from uds_lens.result_store import OutputConflictError

    model = _copy(tiny.unlearned, tmp_path / "model")
    before = {path.name: path.read_bytes() for path in model.iterdir()}
    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    result = auditor.score(str(model))
    with pytest.raises((ConfigError, OutputConflictError), match=str(model)):
        result.save(model)
    with pytest.raises((ConfigError, OutputConflictError), match=str(model)):
        result.save(model / "results", force=True)  # inside it: its files would mix with the checkpoint's
    assert {path.name: path.read_bytes() for path in model.iterdir()} == before


def test_a_cache_dir_inside_a_checkpoint_is_refused_before_anything_is_written(tiny, tmp_path, monkeypatch):
    from uds_lens.config import ConfigError

    model = _copy(tiny.retain, tmp_path / "retain")
    before = sorted(path.name for path in model.iterdir())
    forbid_stage1(monkeypatch)
    with pytest.raises(ConfigError, match="cache"):
        score_tiny(tiny, tmp_path / "out", model, retain=model)
    assert sorted(path.name for path in model.iterdir()) == before


def test_report_never_replaces_its_own_input_even_forced(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    score_tiny(tiny, out, tmp_path / "s1")
    summary = out / "u" / "summary.json"
    before = summary.read_bytes()
    line = one_line_error(monkeypatch, capsys, "report", out, "--out", summary, "--force")
    assert str(summary) in line
    assert summary.read_bytes() == before


# ----------------------------------------------------------------------------------------------------------------
# Tracebacks left, each one line now


def test_a_full_disk_under_the_s1_cache_skips_the_cache_and_saves_the_result(tiny, tmp_path, monkeypatch):
    """safetensors reports a full disk with its own error type, not OSError: the cache is optional, so it is skipped
    with a warning, and the result is saved."""
    from safetensors import SafetensorError

    import uds_lens.stage_cache as stage_cache

    def full_disk(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(stage_cache, "save_file", full_disk)
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="S1 cache not written.*No space left"):
        result = score_tiny(tiny, out, tmp_path / "s1")["u"]
    assert json.loads((out / "u" / "summary.json").read_text())["uds"] == pytest.approx(result.uds)


def test_out_name_that_is_a_file_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    from uds_lens.result_store import OutputConflictError

    out = tmp_path / "out"
    out.mkdir()
    (out / "u").write_text("a user's notes")
    forbid_stage1(monkeypatch)
    monkeypatch.setattr(
        "uds_lens.auditor.build_model", lambda *args, **kwargs: pytest.fail("a model was loaded")
    )
    with pytest.raises(OutputConflictError, match="is a file"):
        score_tiny(tiny, out, tmp_path / "s1")
    assert (out / "u").read_text() == "a user's notes"


@pytest.mark.parametrize("argument", ["zoo:npo", "npo"])
def test_a_broken_zoo_manifest_is_one_line(tiny, tmp_path, monkeypatch, capsys, argument):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "manifest.json").write_text('{"models": [{"name": "npo", "path": ')  # cut short
    monkeypatch.setenv("UDS_LENS_ZOO", str(zoo))
    monkeypatch.chdir(tmp_path)
    line = one_line_error(
        monkeypatch, capsys, "score", "--full", tiny.full, "--retain", tiny.retain, "--data", tiny.data,
        "--unlearned", argument, "--out", tmp_path / "out",
    )  # fmt: skip
    assert "npo" in line and ("manifest" in line or argument == "npo")


def test_the_same_checkpoint_passed_twice_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    model = _copy(tiny.unlearned, tmp_path / "npo")
    monkeypatch.chdir(tmp_path)
    line = one_line_error(
        monkeypatch, capsys, "score", "--full", tiny.full, "--retain", tiny.retain, "--data", tiny.data,
        "--unlearned", "npo", "--unlearned", "./npo", "--out", tmp_path / "out",
    )  # fmt: skip
    assert "same checkpoint" in line and str(model) in line


def test_an_overflowing_tau_is_one_line():
    from uds_lens.config import ConfigError, UDSConfig

    with pytest.raises(ConfigError, match="tau") as error:
        UDSConfig(tau=10**400)
    assert len(str(error.value)) < 400

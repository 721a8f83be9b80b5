"""uds_lens/zoo/layout.py: the one reader of a zoo's manifest (built or hand-written)."""

from __future__ import annotations

import json

import pytest

from uds_lens.zoo.layout import load_zoo


def _write_zoo(root, models, data=None, **extra):
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "models": models,
        "data": data or {"forget": "f.json", "holdout": "h.json", "retain": "r.json"},
    }
    (root / "manifest.json").write_text(json.dumps({**manifest, **extra}))
    return root


def test_paths_are_zoo_relative_unless_absolute_or_a_hub_id(tmp_path):
    (tmp_path / "zoo" / "models" / "full").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    models = [
        {"name": "full", "path": "models/full", "role": "full"},
        {"name": "retain", "path": str(elsewhere), "role": "retain"},
        {"name": "npo", "path": "org/npo-model", "role": "unlearned"},
    ]
    zoo = load_zoo(_write_zoo(tmp_path / "zoo", models))
    assert zoo.path("full") == tmp_path / "zoo" / "models" / "full"
    assert zoo.path("retain") == elsewhere
    assert zoo.path("npo") == "org/npo-model"  # nothing at zoo/org/npo-model: a hub id, kept as written
    assert zoo.role("npo") == "unlearned" and zoo.info("npo")["path"] == "org/npo-model"
    with pytest.raises(KeyError, match="no model 'rmu'"):
        zoo.path("rmu")


def test_roles_pools_and_data_files(tmp_path):
    models = [
        {"name": "full", "path": "full", "role": "full"},
        {"name": "pos0", "path": "pos0", "role": "pos"},
        {"name": "neg0", "path": "neg0", "role": "neg"},
        {"name": "neg1", "path": "neg1", "role": "neg"},
    ]
    data = {"forget_path": "data/f.json", "holdout": "data/h.json", "retain_file": "/abs/r.json"}
    zoo = load_zoo(_write_zoo(tmp_path, models, data, relearn={"lr": 0.002}))
    assert zoo.names("neg") == ["neg0", "neg1"] and zoo.names(["pos", "neg"]) == ["pos0", "neg0", "neg1"]
    assert zoo.names(role="pos") == zoo.names("pos")  # the keyword the notebooks and earlier releases use
    assert zoo.names() == ["full", "pos0", "neg0", "neg1"] and zoo.has_pools
    assert (
        zoo.forget_path == tmp_path / "data" / "f.json" and zoo.holdout_path == tmp_path / "data" / "h.json"
    )
    assert str(zoo.retain_path) == "/abs/r.json"
    assert zoo.relearn == {"lr": 0.002}
    without = load_zoo(_write_zoo(tmp_path / "small", models[:1], {"forget": "f.json"}))
    assert not without.has_pools and without.relearn == {}
    with pytest.raises(ValueError, match="no 'retain' data file"):
        without.data_path("retain")


def test_a_directory_without_a_manifest_says_how_to_build_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="uds-lens zoo build"):
        load_zoo(tmp_path)


def test_the_manifest_reader_serves_the_loader_and_the_builder(tmp_path, monkeypatch):
    """load_zoo, zoo:NAME resolution and the builder's refusal read manifest.json through layout.read_manifest: a
    hand-written one is understood alike by all three, and a directory without one reads as None everywhere."""
    from uds_lens.checkpoints.checkpoint import resolve_zoo_name
    from uds_lens.checkpoints.folder import ModelLoadError
    from uds_lens.zoo.build import _refuse_to_replace
    from uds_lens.zoo.manifest import model_paths, read_manifest
    from uds_lens.zoo.recipe import SIZES, ZooBuildError

    (tmp_path / "models" / "npo").mkdir(parents=True)
    manifest = {"models": [{"name": "npo", "path": "models/npo"}], "data": {}, "size": "test", "seed": 0}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("UDS_LENS_ZOO", str(tmp_path))
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache"))
    assert read_manifest(tmp_path) == manifest and model_paths(tmp_path) == {"npo": "models/npo"}
    assert resolve_zoo_name("zoo:npo") == str(tmp_path / "models" / "npo")
    assert load_zoo(tmp_path).names() == ["npo"]
    # the recorded manifest has no model shape, so a test-size build here would replace another zoo
    with pytest.raises(ZooBuildError, match="size 'test', seed 0 built by another version"):
        _refuse_to_replace(tmp_path, {}, {}, SIZES["test"], "test", 0)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("UDS_LENS_ZOO", str(empty))
    assert read_manifest(empty) is None and model_paths(empty) == {}
    with pytest.raises(ModelLoadError, match="names no model of a built zoo"):
        resolve_zoo_name("zoo:npo")
    with pytest.raises(FileNotFoundError, match="is not a built zoo"):
        load_zoo(empty)


def test_a_sized_zoo_name_reaches_the_smollm2_zoo_wherever_a_model_or_forget_set_is_named(
    tmp_path, monkeypatch
):
    """``zoo:smollm2/npo`` and ``zoo:smollm2/forget`` name the cached SmolLM2 zoo (score, diagnose and the auditor
    resolve models through resolve_zoo_name, data through zoo_data_path), even while $UDS_LENS_ZOO names another
    zoo that has a model of the same name; a bare ``zoo:npo`` does not look there."""
    from uds_lens.checkpoints.checkpoint import resolve_zoo_name
    from uds_lens.checkpoints.folder import ModelLoadError
    from uds_lens.data import zoo_data_path

    cache = tmp_path / "cache"
    smollm2 = _write_zoo(
        cache / "zoo-smollm2",
        [{"name": "npo", "path": "models/npo", "role": "unlearned"}],
        data={"forget": "data/forget.json", "retain": "data/retain.json", "holdout": "data/holdout.json"},
        size="smollm2",
    )
    (smollm2 / "models" / "npo").mkdir(parents=True)
    (smollm2 / "data").mkdir()
    (smollm2 / "data" / "forget.json").write_text("[]")
    other = _write_zoo(tmp_path / "other", [{"name": "npo", "path": "models/npo", "role": "unlearned"}])
    (other / "models" / "npo").mkdir(parents=True)
    monkeypatch.setenv("UDS_LENS_CACHE", str(cache))
    monkeypatch.setenv("UDS_LENS_ZOO", str(other))
    assert resolve_zoo_name("zoo:smollm2/npo") == str(smollm2 / "models" / "npo")
    assert zoo_data_path("zoo:smollm2/forget") == smollm2 / "data" / "forget.json"
    assert resolve_zoo_name("zoo:npo") == str(other / "models" / "npo")
    monkeypatch.delenv("UDS_LENS_ZOO")
    with pytest.raises(ModelLoadError, match="names no model of a built zoo"):
        resolve_zoo_name("zoo:npo")  # the cached default and test zoos only, not zoo-smollm2

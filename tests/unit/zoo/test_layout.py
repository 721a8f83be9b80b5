"""uds_lens/zoo/layout.py: the one reader of a zoo's manifest (built or hand-written)."""

from __future__ import annotations

import json

import pytest

from uds_lens.zoo import load_zoo


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

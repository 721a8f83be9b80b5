"""One reading of a checkpoint folder for every command (issue 49): the weight files are chosen once, by Hugging
Face's rules; what is left over is named and never loaded; what is ambiguous, outside the folder or asks for its own
code is refused; the identity covers exactly the bytes that are loaded, wherever the index points."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.reads import ReadCounter
from safetensors.torch import load_file, save_file

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import load_model
from uds_lens.result_store import OutputConflictError
from uds_lens.scoring import score_models
from uds_lens.sweep.driver import sweep

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _copy(source: Path, target: Path) -> Path:
    return Path(shutil.copytree(source, target))


def _shard(folder: Path, names: list[str], source: Path | None = None) -> Path:
    """``folder``'s weights (or ``source``'s) split into shards at ``names`` (paths in the folder, e.g.
    ``sub/model-00001-of-00002.safetensors``), with the index Hugging Face writes; ``model.safetensors`` removed."""
    state = load_file(str((source or folder) / WEIGHTS))
    keys = sorted(state)
    parts = [keys[i :: len(names)] for i in range(len(names))]
    weight_map = {}
    for name, part in zip(names, parts, strict=True):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({key: state[key] for key in part}, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / WEIGHTS).unlink(missing_ok=True)
    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def _edit_json(path: Path, change) -> None:
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content))


def _score(tiny, models, tmp_path, **options) -> dict:
    return score_models(
        tiny.full, tiny.retain, models, tiny.data, cache_dir=tmp_path / "s1", progress=False, **options
    )


@pytest.mark.parametrize("leftover", ["model_ema.safetensors", "model-00001-of-00003.safetensors"])
def test_score_and_sweep_read_the_same_bytes_of_a_folder_with_extra_weight_files(
    tiny, tmp_path, monkeypatch, caplog, leftover
):
    """Before: sweep merged every top-level ``*.safetensors`` (the last name won) and score read
    ``model.safetensors``: another model's weights beside the model (an EMA copy, a stale shard of an earlier save)
    gave two numbers, both exit 0. Now both read the model Hugging Face's rules name, and the same number."""
    folder = _copy(tiny.unlearned, tmp_path / "npo")
    if leftover.startswith("model-"):
        _shard(folder, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    shutil.copy(tiny.retain / WEIGHTS, folder / leftover)  # another model's tensors, of the same names
    reads = ReadCounter(monkeypatch, [folder / leftover])
    scored = _score(tiny, {"npo": folder}, tmp_path)["npo"]
    table = sweep(
        tiny.full, tiny.retain, tiny.data, tmp_path / "sweep", {"npo": str(folder)},
        workers=1, cache_dir=tmp_path / "s1", progress=False,
    )  # fmt: skip
    reference = _score(tiny, {"npo": tiny.unlearned}, tmp_path)["npo"]
    assert table.loc[0, "status"] == "scored", table.loc[0, "error"]
    # (the sweep runs Stage 2 on the KE cells only: the same UDS to float noise)
    assert table.loc[0, "uds"] == pytest.approx(scored.uds, abs=1e-6)
    assert scored.uds == reference.uds  # the model itself: the same tensors, the same computation
    assert reads.times_read(folder / leftover) == 0.0  # never read, not even hashed
    assert f"{leftover} is not loaded" in caplog.text
    before = Checkpoint.resolve(folder).digest  # nor part of the identity

    shutil.copy(tiny.full / WEIGHTS, folder / leftover)
    assert Checkpoint.resolve(folder).digest == before


def test_the_identity_covers_shards_in_a_subfolder(tiny, tmp_path):
    """Before: the digest hashed the folder's top-level files only, so weights swapped in ``sub/`` were "reused:
    identical inputs". Now the identity is the bytes the index names, wherever they lie in the folder."""
    folder = _shard(
        _copy(tiny.unlearned, tmp_path / "npo"),
        ["sub/model-00001-of-00002.safetensors", "sub/model-00002-of-00002.safetensors"],
    )
    out = tmp_path / "out"
    first = _score(tiny, {"npo": folder}, tmp_path, out_dir=out)["npo"]
    assert first.uds == _score(tiny, {"npo": tiny.unlearned}, tmp_path)["npo"].uds  # the shards are the model
    _shard(
        folder, ["sub/model-00001-of-00002.safetensors", "sub/model-00002-of-00002.safetensors"], tiny.retain
    )
    with pytest.raises(OutputConflictError, match="unlearned differs"):
        _score(tiny, {"npo": folder}, tmp_path, out_dir=out)
    swapped = _score(tiny, {"npo": folder}, tmp_path, out_dir=out, force=True)["npo"]
    assert "reused" not in swapped.meta and swapped.uds != first.uds


def test_weights_outside_the_folder_are_refused_unless_allowed(tiny, tmp_path):
    folder = _copy(tiny.unlearned, tmp_path / "npo")
    _shard(
        folder, ["../shared/model-00001-of-00002.safetensors", "../shared/model-00002-of-00002.safetensors"]
    )
    with pytest.raises(ModelLoadError, match="outside the folder") as refused:
        load_model(folder, device="cpu")
    assert "\n" not in str(refused.value) and "--allow-outside-weights" in str(refused.value)
    allowed = Checkpoint.resolve(folder, outside_weights=True)
    assert load_model(allowed, device="cpu").cfg.n_layers == 3
    names = dict(allowed.files.identifying)
    assert "../shared/model-00001-of-00002.safetensors" in names  # the identity covers them too
    before = Checkpoint.resolve(folder, outside_weights=True).digest
    shutil.copy(tiny.retain / WEIGHTS, tmp_path / "shared" / "model-00002-of-00002.safetensors")
    assert Checkpoint.resolve(folder, outside_weights=True).digest != before


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_checkpoint_that_asks_for_its_own_code_is_refused(tiny, tmp_path, where):
    """Before: an ``auto_map`` was read with the stock class (``score --help`` said it was refused)."""
    folder = _copy(tiny.unlearned, tmp_path / "custom")
    _edit_json(folder / where, lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_mine.Mine"}))
    with pytest.raises(ModelLoadError, match="auto_map") as refused:
        _score(tiny, {"custom": folder}, tmp_path)
    assert str(folder / where) in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("layout", ["single and index", "no rule names them"])
def test_weights_whose_meaning_is_ambiguous_are_refused(tiny, tmp_path, layout):
    folder = _copy(tiny.unlearned, tmp_path / "npo")
    if layout == "single and index":
        _shard(folder, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
        shutil.copy(tiny.unlearned / WEIGHTS, folder / WEIGHTS)
        match = "both model.safetensors and model.safetensors.index.json"
    else:
        (folder / WEIGHTS).rename(folder / "weights.safetensors")
        match = "ambiguous which of them is the model"
    with pytest.raises(ModelLoadError, match=match):
        load_model(folder, device="cpu")

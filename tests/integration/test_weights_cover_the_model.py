"""Weights that do not cover their model (issue 36), on the tiny checkpoints: a tensor missing (which transformers
filled at random, another UDS on every run), a tensor the model has no place for, a config of a billion layers or a
model larger than the free memory: each refused, naming the tensor or the size, before the model is built and before
any Stage 1. Each test failed on the code before the issue."""

from __future__ import annotations

import pytest
from helpers.edits import copy_checkpoint, edit_json, edit_weights
from helpers.runs import forbid_stage1, score_tiny

from uds_lens.checkpoints import loader
from uds_lens.checkpoints.compatibility import ModelMismatchError
from uds_lens.checkpoints.folder import ModelLoadError

DROPPED = "model.layers.2.mlp.down_proj.weight"


def test_a_checkpoint_missing_a_weight_is_refused_naming_the_tensor(tiny, tmp_path, monkeypatch):
    """Before: transformers initialised the tensor at random and every run gave another UDS."""
    missing = edit_weights(copy_checkpoint(tiny.unlearned, tmp_path / "missing"), lambda t: t.pop(DROPPED))
    with pytest.raises(ModelLoadError, match=DROPPED.replace(".", r"\.")) as error:
        loader.load_model(missing, device="cpu")
    assert "\n" not in str(error.value) and "random" in str(error.value)
    forbid_stage1(monkeypatch)
    with pytest.raises(
        ModelMismatchError, match=f"full's weight files lack {DROPPED}"
    ):  # as full: before Stage 1
        score_tiny(tiny, tmp_path / "out", tmp_path / "cache", full=missing)
    with pytest.raises(ModelMismatchError, match=f"lack {DROPPED}"):  # as unlearned: found before Stage 1 too
        score_tiny(tiny, tmp_path / "out", tmp_path / "cache", unlearned={"u": missing})


def test_a_checkpoint_with_a_tensor_its_model_has_no_place_for_is_refused(tiny, tmp_path):
    extra = edit_weights(
        copy_checkpoint(tiny.unlearned, tmp_path / "extra"),
        lambda t: t.update({"model.layers.3.mlp.down_proj.weight": t[DROPPED].clone()}),
    )
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.mlp\.down_proj\.weight.*no place"):
        loader.load_model(extra, device="cpu")


def test_a_config_of_a_billion_layers_is_refused_before_the_model_is_built(tiny, tmp_path, monkeypatch):
    """Before: transformers built it (gigabytes, growing, for minutes)."""
    bomb = copy_checkpoint(tiny.unlearned, tmp_path / "bomb")
    edit_json(bomb / "config.json", lambda c: c.update(num_hidden_layers=1_000_000_000))
    built = []
    monkeypatch.setattr(
        "transformers.LlamaForCausalLM.__init__", lambda *a, **k: built.append(1) or pytest.fail("built")
    )
    with pytest.raises(ModelLoadError, match="1000000000 layers.*weight files hold"):
        loader.load_model(bomb, device="cpu")
    with pytest.raises(ModelLoadError, match="does not belong to these weights"):
        score_tiny(
            tiny, tmp_path / "out", tmp_path / "cache", unlearned={"u": bomb}
        )  # found with the other checkpoints, before any load
    assert not built


def test_a_model_larger_than_the_free_memory_is_refused_before_it_is_built(tiny, monkeypatch):
    monkeypatch.setattr("uds_lens.memory.available_memory_bytes", lambda device: 1000)
    with pytest.raises(ModelLoadError, match="GiB are free"):
        loader.load_model(tiny.unlearned, device="cpu")

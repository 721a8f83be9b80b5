"""A model read into another's bridge (`loader.refill_model`, a sweep's next model read into the one it scored) is the
model `build_model` builds: the same tensors, digest and fingerprint, the same activations at every hook, the same
UDS, and no memo of the old weights answers for the new ones; a checkpoint that would build another model is refused
with the old model untouched. A vacant copy of a bridge (`loader.vacant_copy`) read into is that model too, and owes
nothing to the bridge it was copied from."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.digests import loaded_digest, loaded_record, model_fingerprint, named_weights
from uds_lens.checkpoints.loader import build_model, hooked_from_hf, load_hf_model, refill_model, vacant_copy
from uds_lens.config import UDSConfig
from uds_lens.tl_compat import hf_model_of


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in named_weights(model)}


def test_a_refilled_model_is_the_model_built_from_its_checkpoint(tiny, tmp_path):
    other = tiny.variant(tmp_path / "other", seed=11, base=tiny.full, noise=0.4)
    auditor = UDSAuditor(
        tiny.full, tiny.retain, tiny.data, config=UDSConfig(), progress=False, cache_dir=False
    )
    model = build_model(Checkpoint.resolve(tiny.unlearned))
    first = auditor.score(model)  # its fingerprint and the fast engine's joined weights are memoised now
    old_fingerprint = model_fingerprint(model)
    checkpoint = Checkpoint.resolve(other)
    refilled = refill_model(model, checkpoint, torch.float32)
    assert refilled is model
    fresh = build_model(Checkpoint.resolve(other))
    mine, theirs = _weights(refilled), _weights(fresh)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in mine)
    assert loaded_digest(refilled) == loaded_digest(fresh) == Checkpoint.resolve(other).digest
    assert model_fingerprint(refilled) == model_fingerprint(fresh) != old_fingerprint
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    _, cache_refilled = refilled.run_with_cache(tokens)
    _, cache_fresh = fresh.run_with_cache(tokens)
    assert cache_refilled.keys() == cache_fresh.keys()
    assert all(torch.equal(cache_refilled[key], cache_fresh[key]) for key in cache_fresh.keys())
    # scored again by the same auditor: the refilled model's joined weights are made again, not the old ones reused
    again, built = auditor.score(refilled), auditor.score(fresh)
    assert again.uds == built.uds and again.uds != first.uds
    assert again.layers.equals(built.layers) and again.examples.drop(columns="name", errors="ignore").equals(
        built.examples.drop(columns="name", errors="ignore")
    )


def test_a_checkpoint_of_another_model_is_not_refilled_and_the_model_is_untouched(tiny, tmp_path):
    model = build_model(Checkpoint.resolve(tiny.unlearned))
    before = _weights(model)
    wider = tiny.variant(tmp_path / "wider", seed=3, d_model=48)
    deeper = tiny.variant(tmp_path / "deeper", seed=3, n_layers=4)
    retokenized = shutil.copytree(tiny.retain, tmp_path / "retokenized")
    added = json.loads((retokenized / "tokenizer_config.json").read_text())
    (retokenized / "tokenizer_config.json").write_text(json.dumps({**added, "model_max_length": 77}))
    other_config = shutil.copytree(tiny.retain, tmp_path / "other_config")
    config = json.loads((other_config / "config.json").read_text())
    (other_config / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    for checkpoint in (wider, deeper, retokenized, other_config):
        assert refill_model(model, Checkpoint.resolve(checkpoint), torch.float32) is None, checkpoint.name
    assert refill_model(model, Checkpoint.resolve(tiny.retain), torch.bfloat16) is None  # another dtype
    after = _weights(model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    # where it came from and how it was saved is not the model: those are refilled
    renamed = shutil.copytree(tiny.retain, tmp_path / "renamed")
    (renamed / "config.json").write_text(json.dumps({**config, "_name_or_path": "elsewhere"}))
    assert refill_model(model, Checkpoint.resolve(renamed), torch.float32) is model


@pytest.mark.parametrize("torn", ["truncated"])
def test_a_checkpoint_that_cannot_be_read_whole_raises(tiny, tmp_path, torn):
    model = build_model(Checkpoint.resolve(tiny.unlearned))
    broken = shutil.copytree(tiny.retain, tmp_path / torn)
    weights = broken / "model.safetensors"
    checkpoint = Checkpoint.resolve(broken)
    _ = checkpoint.tensor_shapes  # compared at the door, before the file was cut
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(Exception, match="truncated|shorter|changed"):
        refill_model(model, checkpoint, torch.float32)


def test_a_vacant_copy_read_into_is_the_model_built_and_owes_nothing_to_the_original(tiny):
    original = build_model(Checkpoint.resolve(tiny.full))
    vacant = vacant_copy(original)
    assert vacant is not None and vacant is not original
    assert loaded_record(vacant) is None  # no checkpoint's bytes until one is read into it
    ours = {tensor.data_ptr() for _, tensor in named_weights(vacant)}
    theirs = {tensor.data_ptr() for _, tensor in named_weights(original)}
    assert len(ours) == len(theirs) and not ours & theirs  # its own tensors, tied where the original's are
    refilled = refill_model(vacant, Checkpoint.resolve(tiny.unlearned), torch.float32)
    assert refilled is vacant
    with torch.no_grad():  # whatever still read the original would now read NaN
        for tensor in [*original.parameters(), *original.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    fresh = build_model(Checkpoint.resolve(tiny.unlearned))
    mine, built = _weights(refilled), _weights(fresh)
    assert mine.keys() == built.keys() and all(torch.equal(mine[name], built[name]) for name in mine)
    assert loaded_digest(refilled) == loaded_digest(fresh) and model_fingerprint(
        refilled
    ) == model_fingerprint(fresh)
    assert hooked_from_hf(hf_model_of(refilled)) is refilled  # its Hugging Face model names its own bridge
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    _, cache_refilled = refilled.run_with_cache(tokens)
    _, cache_fresh = fresh.run_with_cache(tokens)
    assert cache_refilled.keys() == cache_fresh.keys()
    assert all(torch.equal(cache_refilled[key], cache_fresh[key]) for key in cache_fresh.keys())
    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, progress=False, cache_dir=False)
    assert auditor.score(refilled).uds == auditor.score(fresh).uds


def test_only_a_bridge_of_a_checkpoint_directory_has_a_vacant_copy(tiny):
    plain = load_hf_model(tiny.full)  # a Hugging Face model, not a bridge
    assert vacant_copy(plain) is None
    made = type(plain)(plain.config)  # built from a config: no checkpoint to compare the next one with
    assert vacant_copy(hooked_from_hf(made)) is None

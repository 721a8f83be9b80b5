import json
import shutil

import pytest
import torch

from uds_lens.models import (
    ModelLoadError,
    ModelMismatchError,
    check_compatible,
    load_hf_model,
    load_model,
    verify_parity,
)


def test_parity_with_hugging_face(tiny):
    hooked, hf = load_model(tiny.full), load_hf_model(tiny.full)
    tokens = torch.tensor([[0, 5, 17, 33, 2, 90, 41, 7, 8], [0, 6, 6, 19, 77, 3, 12, 250, 9]])
    parity = verify_parity(hooked, hf, tokens)
    assert parity["resid_post"] < 1e-4 and parity["logits"] < 1e-4
    # hidden_states[L] is the final-norm output, not block L-1's residual (the published last-layer quirk)
    assert parity["final_norm"] > 1e-2


def test_hub_id_offline_names_the_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="(?s)nobody/no-such-model.*HF_HUB_OFFLINE"):
        load_model("nobody/no-such-model")


def test_non_llama_is_refused(tiny, tmp_path):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny.full, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="supports Llama"):
        load_model(bad)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_mismatched_vocab_and_architecture(tiny, tmp_path):
    import sys

    sys.path.insert(0, str(tiny.root.parent))
    from tiny_models import make_llama

    other_vocab = make_llama(tmp_path / "v", tiny.tokenizer, seed=3, vocab_size=320)
    with pytest.raises(ModelMismatchError, match="vocabulary"):
        check_compatible(load_model(tiny.full), load_model(other_vocab))
    deeper = make_llama(tmp_path / "d", tiny.tokenizer, seed=3, n_layers=4)
    with pytest.raises(ModelMismatchError, match="architecture"):
        check_compatible(load_model(tiny.full), load_model(deeper))


def test_a_mistyped_local_model_path_fails_without_asking_the_hub(tiny, tmp_path, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked for a local path")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    from uds_lens.models import load_tokenizer

    for mistyped in (tmp_path / "ful", str(tmp_path / "ful"), str(tiny.full) + "l", "./ckpt/full"):
        with pytest.raises(ModelLoadError, match="does not exist"):
            load_model(mistyped)
        with pytest.raises(ModelLoadError, match="does not exist"):
            load_tokenizer(mistyped)

"""The loader: one entry point, models built from what the checkpoint read (its bytes once), never from code."""

import json
import shutil

import pytest
import torch

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ModelMismatchError, check_identities, identity_of
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import load, load_hf_model, load_model
from uds_lens.sources import verify_parity
from uds_lens.tl_compat import TransformerBridge


def test_load_is_the_one_entry_point(tiny):
    """A checkpoint reference becomes a TransformerBridge (or, with ``hooked=False``, a Hugging Face model); a model
    in memory comes back as is; anything else is refused with the role in the message."""
    hooked = load(tiny.full, device="cpu")
    assert isinstance(hooked, TransformerBridge) and hooked.uds_source == str(tiny.full)
    hf = load(str(tiny.full), hooked=False, device="cpu")
    assert type(hf).__name__ == "LlamaForCausalLM" and not hf.training
    assert load(hooked) is hooked and load(hf, hooked=False) is hf
    with pytest.raises(TypeError, match="retain must be a checkpoint path.*int"):
        load(3, role="retain")


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
    with pytest.raises(ModelLoadError, match="gpt2.*supports the decoder families"):
        load_model(bad)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_mismatched_vocab_and_architecture_of_models_in_memory(tiny, tmp_path):
    """Loaded models are compared by the identities of their checkpoints too (a model in memory by its own shapes)."""

    def compare(full, other):
        check_identities(
            identity_of(Checkpoint.resolve(full), "full"), [identity_of(Checkpoint.resolve(other), "other")]
        )

    other_vocab = tiny.variant(tmp_path / "v", seed=3, vocab_size=320)
    with pytest.raises(ModelMismatchError, match=r"d_vocab \d+ vs 320"):
        compare(load_model(tiny.full), load_model(other_vocab))
    deeper = tiny.variant(tmp_path / "d", seed=3, n_layers=4)
    with pytest.raises(ModelMismatchError, match="n_layers 3 vs 4"):
        compare(load_model(tiny.full), load_model(deeper))


def test_bridge_shares_the_hugging_face_tensors_and_their_fingerprint(tiny):
    """The bridge runs on the Hugging Face tensors themselves (no copy, no processing), and its fingerprint is the
    Hugging Face model's: S1 cache keys do not depend on the backend or the TransformerLens version."""
    from uds_lens.checkpoints.digests import model_fingerprint

    bridge = load_model(tiny.full, device="cpu")
    hf = load_hf_model(tiny.full, device="cpu")
    wrapped = bridge.original_model
    ours = {n.replace("._original_component", ""): p for n, p in wrapped.named_parameters()}
    for name, value in hf.named_parameters():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)
    assert model_fingerprint(bridge) == model_fingerprint(hf) == model_fingerprint(wrapped)
    # the bridge's weight names are views of the same storage
    assert bridge.blocks[0].attn.W_Q.data_ptr() == wrapped.model.layers[0].self_attn.q_proj.weight.data_ptr()
    noisy = load_model(tiny.retain, device="cpu")
    assert model_fingerprint(noisy) != model_fingerprint(bridge)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    assert model_fingerprint(hf) != model_fingerprint(bridge)


def test_tied_embeddings_share_one_tensor(tmp_path, tiny):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(tiny.tokenizer).save_pretrained(tmp_path / "tied")
    hooked = load_model(tmp_path / "tied", device="cpu")
    assert hooked.W_U.data_ptr() == hooked.W_E.data_ptr()
    tokens = torch.tensor([[0, 5, 17, 33, 2, 90]])
    assert verify_parity(hooked, hf, tokens)["logits"] == 0.0  # exact: the same modules on the same tensors


def test_bin_weights_load_the_same_way(tiny, tmp_path):
    """A checkpoint without safetensors (``.bin`` weights, no tokenizer) loads the same way: read once, unpickled
    with ``weights_only``."""
    hf = load_hf_model(tiny.full, device="cpu", attn_implementation="eager")
    (tmp_path / "bin").mkdir()
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    hf.config.save_pretrained(tmp_path / "bin")
    hooked = load_model(tmp_path / "bin", device="cpu")
    assert (
        verify_parity(hooked, hf, torch.tensor([[0, 5, 17, 33]]))["logits"] == 0.0
    )  # the same modules and tensors


@pytest.mark.parametrize(
    "spec", ["./no/such/dir", "zoo-typo/full/", "~/missing-ckpt", "model.gguf", "full", "a//b", "owner/na me"]
)
def test_not_a_checkpoint_fails_at_once(spec, monkeypatch):
    """Mistyped paths and implausible hub ids fail before any hub request (which retries for tens of seconds)."""
    import time

    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was contacted")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="(does not exist|plausible Hugging Face hub id|pass .zoo:)"):
        load_model(spec)
    assert time.perf_counter() - started < 2.0
    assert Checkpoint.resolve("meta-llama/Llama-3.2-1B").kind == "hub"


def test_gguf_directory_rules_and_other_architecture(tmp_path, tiny):
    import gguf

    other = tmp_path / "one" / "gpt2.gguf"
    other.parent.mkdir()
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert Checkpoint.resolve(other.parent).location == str(other)  # a directory holding exactly one .gguf
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'.*supports general.architecture in"):
        load_model(other.parent)
    (other.parent / "second.gguf").write_bytes(other.read_bytes())
    with pytest.raises(ModelLoadError, match="2 .gguf files"):
        load_model(other.parent)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(tiny.full / "config.json")


def test_a_mistyped_local_model_path_fails_without_asking_the_hub(tiny, tmp_path, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked for a local path")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    from uds_lens.checkpoints.loader import load_tokenizer

    for mistyped in (tmp_path / "ful", str(tmp_path / "ful"), str(tiny.full) + "l", "./ckpt/full"):
        with pytest.raises(ModelLoadError, match="does not exist"):
            load_model(mistyped)
        with pytest.raises(ModelLoadError, match="does not exist"):
            load_tokenizer(mistyped)


def test_a_users_hooked_transformer_is_still_accepted_on_transformer_lens_3(tiny):
    """TransformerLens 3.x: a HookedTransformer of one's own is scored (by the naive engine, with a notice; the fast
    engine reads a bridge's Hugging Face tensors); TransformerLens 4.x has no HookedTransformer to pass."""
    from uds_lens.auditor import UDSAuditor
    from uds_lens.checkpoints.loader import load_tokenizer
    from uds_lens.config import UDSConfig
    from uds_lens.tl_compat import HookedTransformer, HookedTransformerConfig

    if HookedTransformer is None:
        pytest.skip("TransformerLens 4.x has no HookedTransformer")

    tokenizer = load_tokenizer(tiny.tokenizer)
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=32,
        d_head=8,
        n_heads=4,
        n_ctx=128,
        d_vocab=len(tokenizer),
        act_fn="silu",
        normalization_type="RMS",
        positional_embedding_type="rotary",
        gated_mlp=True,
        seed=0,
    )
    full, retain = HookedTransformer(cfg), HookedTransformer(cfg.__class__(**{**cfg.to_dict(), "seed": 1}))
    auditor = UDSAuditor(
        full, retain, tiny.data, UDSConfig(), tokenizer=tokenizer, cache_dir=False, progress=False
    )
    assert auditor.config.engine == "naive"
    result = auditor.score(full)
    assert (result.layers["d2"] == 0.0).all()
    assert auditor.score(retain).examples["uds"].dropna().eq(1.0).all()


def test_the_loader_reads_zoo_manifests_without_importing_the_zoo_training_code():
    """loader -> checkpoint -> zoo_manifest: resolving zoo:NAME reads a manifest; nothing of the zoo package (the Zoo
    view, which loads models, or the training code) is imported by the loader."""
    import subprocess
    import sys

    code = (
        "import sys, uds_lens.checkpoints.loader; "
        "print(sorted(k for k in sys.modules if k.startswith('uds_lens.zoo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['uds_lens.zoo_manifest']"


def test_a_checkpoint_argument_is_made_a_checkpoint_once_per_load(tiny, monkeypatch):
    """load_model makes its argument a Checkpoint once, and the config, weights and tokenizer are read from that
    value; given a Checkpoint, it resolves nothing and reads nothing the checkpoint read already."""
    from uds_lens.checkpoints import checkpoint as door

    resolved = []
    real = door.resolve_zoo_name
    monkeypatch.setattr(door, "resolve_zoo_name", lambda text: resolved.append(text) or real(text))
    model = load_model(str(tiny.full), dtype="float32", device="cpu")
    assert resolved == [str(tiny.full)]
    assert model.uds_source == str(tiny.full)
    checkpoint = Checkpoint.resolve(str(tiny.full))
    resolved.clear()
    again = load_model(checkpoint, dtype="float32", device="cpu")
    assert resolved == [] and again.uds_source == str(tiny.full)
    config = checkpoint.config
    load_model(checkpoint, dtype="float32", device="cpu")
    assert checkpoint.config is config  # read once, remembered on the value

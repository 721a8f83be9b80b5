"""uds_lens/sources.py: a loaded checkpoint (a TransformerBridge) and a plain Hugging Face Llama of the same weights
yield the same activations at every site, equal to Hugging Face's own modules' tensors (read with plain torch hooks),
with the same last-layer conventions; anything else is refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_oracle import hf_site
from transformers import GPT2Config, GPT2LMHeadModel

from uds_lens.checkpoints.loader import load_hf_model, load_model
from uds_lens.config import SITES
from uds_lens.sources import HookedSource, NF4Source, as_source, hook_name, verify_parity

TOKENS = torch.tensor([[0, 5, 17, 33, 2, 90, 41, 7, 8], [0, 6, 6, 19, 77, 3, 12, 250, 9]])


@pytest.fixture(scope="module")
def hooked(tiny):
    return load_model(tiny.full, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf(tiny):
    return load_hf_model(tiny.full, dtype="float32", device="cpu")


def test_as_source_picks_the_implementation(hooked, hf):
    ours, theirs = as_source(hooked), as_source(hf)
    assert type(ours) is HookedSource and type(theirs) is HookedSource
    # a Hugging Face model is wrapped once, as a bridge sharing its tensors
    assert as_source(hf).model is theirs.model
    assert theirs.model.original_model is hf
    assert as_source(ours) is ours
    assert ours.n_layers == theirs.n_layers == hf.config.num_hidden_layers
    assert ours.dtype == theirs.dtype == torch.float32
    assert ours.device == theirs.device == torch.device("cpu")
    assert ours.context_length <= theirs.context_length
    assert len(ours.blocks()) == len(theirs.blocks()) == ours.n_layers


@pytest.mark.parametrize("site", SITES)
def test_every_site_agrees_between_transformer_lens_and_hugging_face(hooked, hf, site):
    ours, theirs = as_source(hooked), as_source(hf)
    layers = range(ours.n_layers)
    a = ours.activations(TOKENS, site, layers)
    b = theirs.activations(TOKENS, site, layers)
    assert a.shape == (ours.n_layers, *TOKENS.shape, hooked.cfg.d_model)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # not vacuous: the layers (and the sites) read different tensors
    assert (a[0] - a[-1]).abs().max() > 1e-2
    _, cache = hooked.run_with_cache(TOKENS)
    # exact: one model, one input, the same hook point read by two routes
    torch.testing.assert_close(a[1], cache[hook_name(site, 1)], atol=0, rtol=0)


@pytest.mark.parametrize("site", SITES)
def test_every_site_is_the_hugging_face_modules_tensor(tiny, hooked, site):
    """The oracle independent of TransformerLens: torch hooks on a Hugging Face model no bridge has wrapped."""
    plain = load_hf_model(tiny.full, dtype="float32", device="cpu", attn_implementation="eager")
    ours = as_source(hooked).activations(TOKENS, site, range(hooked.cfg.n_layers))
    for layer in range(
        hooked.cfg.n_layers
    ):  # exact by construction: Hugging Face's Llama modules on its tensors
        torch.testing.assert_close(ours[layer], hf_site(plain, TOKENS, site, layer), atol=0, rtol=0)


def test_layers_come_in_the_order_asked(hooked, hf):
    for source in (as_source(hooked), as_source(hf)):
        every = source.activations(TOKENS, "mlp_out", range(source.n_layers))
        picked = source.activations(TOKENS, "mlp_out", [1, 0])
        torch.testing.assert_close(picked, every[[1, 0]], atol=0, rtol=0)


def test_last_layer_conventions(hooked, hf):
    """Raw pre-final-norm residual by default (the baselines), the final-norm output with ``final_norm_last``
    (the published implementation's last layer: Hugging Face's ``hidden_states[L]``)."""
    last = hooked.cfg.n_layers - 1
    with torch.no_grad():
        hidden_states = hf(TOKENS, output_hidden_states=True).hidden_states
    for source in (as_source(hooked), as_source(hf)):
        raw = source.activations(TOKENS, "resid_post", range(last + 1))
        normed = source.activations(TOKENS, "resid_post", range(last + 1), final_norm_last=True)
        for layer in range(last):
            torch.testing.assert_close(raw[layer], hidden_states[layer + 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(normed[:last], raw[:last], atol=0, rtol=0)
        torch.testing.assert_close(normed[last], hidden_states[last + 1], atol=1e-5, rtol=0)
        assert (raw[last] - hidden_states[last + 1]).abs().max() > 1e-2
        # only resid_post of the last block is affected
        other = source.activations(TOKENS, "mlp_out", [last], final_norm_last=True)
        torch.testing.assert_close(other, source.activations(TOKENS, "mlp_out", [last]), atol=0, rtol=0)


def test_published_compat_activation_is_the_final_norm_at_the_last_resid_post_only(hooked):
    """The one place published-compat's last layer is made: the final norm at ``blocks.{L-1}.hook_resid_post``,
    the activation itself (the same tensor) at every other hook point."""
    source = as_source(hooked)
    last = hooked.cfg.n_layers - 1
    resid = torch.randn(2, 5, hooked.cfg.d_model, generator=torch.Generator().manual_seed(0))
    normed = source.published_compat_activation(f"blocks.{last}.hook_resid_post", resid)
    with torch.no_grad():
        assert torch.equal(normed, hooked.ln_final(resid))
    assert (normed - resid).abs().max() > 1e-2
    for name in (
        f"blocks.{last - 1}.hook_resid_post",
        f"blocks.{last}.hook_mlp_out",
        f"blocks.{last}.attn.hook_z",
    ):
        assert source.published_compat_activation(name, resid) is resid


def test_residual_stream_with_right_padding(hooked, hf):
    """Padding after a sequence changes nothing before it; the stream is fp32 and the same in both kinds."""
    short = TOKENS[:, :5]
    padded = torch.cat([short, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(2, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)], dim=1)
    streams = []
    for source in (as_source(hooked), as_source(hf)):
        stream = source.residual_stream(padded, mask)
        assert stream.dtype == torch.float32 and stream.shape[:3] == (source.n_layers, 2, 8)
        torch.testing.assert_close(stream[:, :, :5], source.residual_stream(short), atol=1e-5, rtol=0)
        rows, positions = torch.tensor([0, 1, 1]), torch.tensor([4, 0, 3])
        torch.testing.assert_close(
            source.residuals_at(padded, mask, rows, positions), stream[:, rows, positions], atol=0, rtol=0
        )
        streams.append(stream[:, :, :5])
    torch.testing.assert_close(streams[0], streams[1], atol=1e-5, rtol=0)


def test_decode_and_logits(hooked, hf):
    """The lens decoder on the last pre-norm residual gives the model's own logits, in both kinds."""
    for source in (as_source(hooked), as_source(hf)):
        last = source.residual_stream(TOKENS)[-1, 0]
        with torch.no_grad():
            logits = source.logits(TOKENS)[0]
        torch.testing.assert_close(source.decode(last), logits.float(), atol=1e-4, rtol=0)


def test_hooked_conversion(hooked, hf):
    assert as_source(hooked).hooked(torch.float32, "cpu") is hooked
    converted = as_source(hf).hooked(torch.float32, "cpu")
    assert converted.original_model is hf  # the bridge shares the Hugging Face tensors
    assert verify_parity(converted, hf, TOKENS)["logits"] == 0.0


def test_verify_parity(tiny, hooked):
    """The bridge is Hugging Face's forward: hook_resid_post, the final norm and the logits equal its outputs."""
    plain = load_hf_model(tiny.full, dtype="float32", device="cpu", attn_implementation="eager")
    parity = verify_parity(hooked, plain, TOKENS)
    assert set(parity) == {"resid_post", "final_norm", "logits"}
    assert max(parity.values()) == 0.0  # exact by construction (see helpers/numerics.py)
    # not vacuous: another model's parity is far from 0
    assert verify_parity(load_model(tiny.retain), plain, TOKENS)["logits"] > 1e-2


def test_a_quantised_model_is_read_like_hugging_face(tiny, hooked):
    model = load_hf_model(tiny.full, dtype="float32", device="cpu")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    source = as_source(model)
    assert isinstance(source, NF4Source)
    torch.testing.assert_close(
        source.activations(TOKENS, "attn_out", [0, 1]),
        as_source(hooked).activations(TOKENS, "attn_out", [0, 1]),
        atol=1e-5,
        rtol=0,
    )


def test_non_llama_modules_are_refused_by_name():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with pytest.raises(TypeError, match="GPT2LMHeadModel.*supported family"):
        as_source(gpt2)
    with pytest.raises(TypeError, match="Linear"):
        as_source(torch.nn.Linear(2, 2))


def test_unknown_site(hooked):
    with pytest.raises(ValueError, match="resid_pots"):
        as_source(hooked).activations(TOKENS, "resid_pots", [0])

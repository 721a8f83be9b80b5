"""The fast engine against the naive oracle (SPEC §1.6), on every site, scope and compat mode."""

import pytest
import torch

from uds_lens import readout
from uds_lens.checkpoints.loader import load_hf_model, load_model, load_tokenizer
from uds_lens.config import SITES, EngineSpec
from uds_lens.data import encode, load_examples
from uds_lens.patching.batch import pad_batch
from uds_lens.patching.engines import (
    NaiveEngine,
    engine_for,
    source_activations,
    window_source_activations,
    window_source_activations_of,
)
from uds_lens.patching.planning import plan_batches


@pytest.fixture(scope="module")
def setup(tiny):
    tok = load_tokenizer(tiny.tokenizer)
    return {
        "tok": tok,
        "full": load_model(tiny.full),
        "source": load_model(tiny.retain),
        "examples": load_examples(tiny.data),
    }


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("scope", ["span", "boundary"])
@pytest.mark.parametrize("compat", [False, True])
def test_fast_equals_naive(setup, site, scope, compat):
    encoded, _ = encode(setup["examples"], setup["tok"], published_compat=compat)
    batch = pad_batch(encoded, setup["tok"].pad_token_id, scope)
    layers = tuple(range(setup["full"].cfg.n_layers))
    spec = EngineSpec(site, layers, "fast", published_compat=compat)
    oracle = EngineSpec(site, layers, "naive", published_compat=compat)
    acts = source_activations(setup["source"], batch.tokens, spec)
    naive = engine_for(oracle).patched_scores(setup["full"], batch, acts)
    fast = engine_for(spec).patched_scores(setup["full"], batch, acts)
    assert torch.allclose(naive, fast, atol=1e-5, rtol=0)
    clean = engine_for(spec).clean_run(setup["full"], batch)
    # The patch changes something (the test is not vacuous) ...
    assert (naive - clean.scores[:, None]).abs().max() > 1e-3
    # ... and the fast baseline equals the clean score up to float noise.
    base = engine_for(spec).baseline_scores(setup["full"], batch, clean)
    assert torch.allclose(base, clean.scores[:, None].expand_as(base), atol=1e-5)
    # The packed source forward the auditor uses gives the same scores as TransformerLens's padded one.
    packed = engine_for(spec).source_scores(setup["full"], setup["source"], batch, clean)
    assert torch.allclose(naive, packed, atol=1e-5, rtol=0)
    # A source identical to the target gives back its clean window activations bit for bit (deltas exactly 0).
    same = window_source_activations(setup["full"], batch, EngineSpec(site, layers))
    assert torch.equal(same, clean.window_acts[site])


def test_subset_of_layers_and_padding_invariance(setup):
    encoded, _ = encode(setup["examples"], setup["tok"])
    full, src = setup["full"], setup["source"]
    spec = EngineSpec("resid_post", (2, 0))
    together = pad_batch(encoded, setup["tok"].pad_token_id)
    joint = engine_for(spec).patched_scores(full, together, source_activations(src, together.tokens, spec))
    for row, example in enumerate(encoded):
        alone = pad_batch([example], setup["tok"].pad_token_id)
        single = engine_for(spec).patched_scores(full, alone, source_activations(src, alone.tokens, spec))
        assert torch.allclose(single[0], joint[row], atol=1e-5)


@pytest.mark.parametrize("compat", [False, True])
def test_a_source_read_block_first_over_several_batches_is_read_as_each_batch_alone(setup, compat):
    """`window_source_activations_of` runs the source one block at a time over every batch (each block joined once
    for all of them): each batch's activations are those of its own forward, bit for bit; and a source identical to
    the target still gives back each batch's clean window activations."""
    encoded, _ = encode(setup["examples"], setup["tok"], published_compat=compat)
    spec = EngineSpec("resid_post", tuple(range(setup["full"].cfg.n_layers)), published_compat=compat)
    batches = [
        pad_batch([encoded[i] for i in members], setup["tok"].pad_token_id, "span")
        for members in plan_batches(encoded, "span", 2)
    ]
    assert len(batches) > 2
    together = window_source_activations_of(setup["source"], batches, spec)
    for batch, acts in zip(batches, together, strict=True):
        assert torch.equal(acts, window_source_activations(setup["source"], batch, spec))
    if not compat:
        same = window_source_activations_of(setup["full"], batches, spec)
        for batch, acts in zip(batches, same, strict=True):
            assert torch.equal(
                acts, engine_for(spec).clean_run(setup["full"], batch).window_acts["resid_post"]
            )


def test_naive_hooks_are_removed_after_an_error(setup):
    encoded, _ = encode(setup["examples"], setup["tok"])
    batch = pad_batch(encoded, setup["tok"].pad_token_id)
    bad_acts = torch.zeros(1, batch.size, batch.tokens.shape[1] + 5, 3)  # wrong d_model
    with pytest.raises((RuntimeError, IndexError)):
        NaiveEngine(EngineSpec("resid_post", (0,), "naive")).patched_scores(setup["full"], batch, bad_acts)
    assert all(not hp.fwd_hooks for hp in setup["full"].hook_dict.values())


@pytest.mark.parametrize("site", ["resid_post", "attn_out", "mlp_out", "resid_mid", "resid_pre"])
def test_hugging_face_source_matches_hooked_source(tiny, setup, site):
    encoded, _ = encode(setup["examples"], setup["tok"])
    batch = pad_batch(encoded, setup["tok"].pad_token_id)
    spec = EngineSpec(site, (0, 1, 2))
    hooked = source_activations(setup["source"], batch.tokens, spec)
    hf = source_activations(load_hf_model(tiny.retain), batch.tokens, spec)
    assert torch.allclose(hooked, hf, atol=1e-3, rtol=1e-4), (hooked - hf).abs().max()


def test_compat_last_layer_uses_source_final_norm(tiny, setup):
    encoded, _ = encode(setup["examples"], setup["tok"], published_compat=True)
    batch = pad_batch(encoded, setup["tok"].pad_token_id)
    last = setup["full"].cfg.n_layers - 1
    compat = EngineSpec("resid_post", (last,), published_compat=True)
    hooked = source_activations(setup["source"], batch.tokens, compat)
    hf_out = load_hf_model(tiny.retain)(batch.tokens, output_hidden_states=True)
    assert torch.allclose(hooked[0], hf_out.hidden_states[last + 1], atol=1e-4)


def test_read_out_by_vocabulary_slices_equals_log_softmax(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 16, generator=generator)
    w_u = torch.randn(16, 1000, generator=generator) * 3
    b_u = torch.randn(1000, generator=generator)
    # labels at both ends of the vocabulary and on slice boundaries (256-wide slices below)
    labels = torch.tensor([0, 999, 255, 256, 511, 512, 767, 768] * 5)
    reference = torch.log_softmax(rows @ w_u + b_u, dim=-1).gather(1, labels[:, None])[:, 0]
    monkeypatch.setattr(readout, "_LOGIT_SLICE_ELEMENTS", 40 * 256)  # four slices, the last one partial
    sliced = readout.unembedded_label_logprobs(rows, w_u, b_u, labels)
    assert torch.allclose(sliced, reference, atol=1e-5, rtol=0)


def test_segment_mean_reduces_the_last_axis_in_the_given_dtype():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3, 7, generator=generator) * 10
    segment = torch.tensor([0, 0, 2, 1, 1, 1, 2])
    expected = torch.stack([values[:, segment == s].double().mean(-1) for s in range(3)], dim=-1)
    wide = readout.segment_mean(values, segment, 3, dtype=torch.float64)
    assert wide.dtype == torch.float64 and wide.shape == (3, 3)
    assert torch.allclose(wide, expected, atol=1e-12, rtol=0)
    narrow = readout.segment_mean(values[1], segment, 3)
    assert narrow.dtype == torch.float32
    assert torch.allclose(narrow, expected[1].float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("compat", [False, True])
def test_component_metric_is_the_naive_engines_read_out(setup, compat):
    """One read-out: the metric hand-written hooks use reads the clean logits exactly as the naive engine's S0."""
    from uds_lens.components import entity_metric

    encoded, _ = encode(setup["examples"], setup["tok"], published_compat=compat)
    batch = pad_batch(encoded, setup["tok"].pad_token_id, cut=False)
    spec = EngineSpec("resid_post", (0,), "naive", published_compat=compat)
    clean = engine_for(spec).clean_run(setup["full"], batch)
    metric = entity_metric(
        batch.read_batch, batch.read_pos, batch.read_label, batch.size, per_example=True, upcast=spec.upcast
    )
    with torch.no_grad():
        assert torch.equal(metric(setup["full"](batch.tokens)), clean.scores)


def test_fast_engine_refuses_other_architectures(setup):
    """A family whose blocks the fast engine does not compute is refused with a reason, never run wrong."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from uds_lens.checkpoints.loader import hooked_from_hf
    from uds_lens.patching.kernels import fast_engine_refusal

    encoded, _ = encode(setup["examples"], setup["tok"])
    batch = pad_batch(encoded, setup["tok"].pad_token_id)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=4, vocab_size=setup["full"].cfg.d_vocab, n_positions=64)
    config.architectures = ["GPT2LMHeadModel"]
    gpt2 = hooked_from_hf(GPT2LMHeadModel(config).eval())
    assert "gpt2" in fast_engine_refusal(gpt2)
    assert fast_engine_refusal(setup["full"]) is None
    with pytest.raises(ValueError, match="naive"):
        engine_for(EngineSpec("resid_post", (0,))).clean_run(gpt2, batch)


def test_fast_engine_sees_weights_edited_in_place(tiny, setup):
    """The joined block weights are kept between calls; an in-place edit must rebuild them, never run stale."""
    full = load_model(tiny.full)
    encoded, _ = encode(setup["examples"], setup["tok"])
    batch = pad_batch(encoded, setup["tok"].pad_token_id, "span")
    spec = EngineSpec("resid_post", tuple(range(full.cfg.n_layers)))
    acts = source_activations(setup["source"], batch.tokens, spec)
    before = engine_for(spec).patched_scores(full, batch, acts)
    with torch.no_grad():
        full.blocks[-1].mlp.W_in.mul_(1.5)
        full.blocks[-1].attn.W_Q.mul_(0.5)
    after = engine_for(spec).patched_scores(full, batch, acts)
    naive = engine_for(EngineSpec("resid_post", spec.layers, "naive")).patched_scores(full, batch, acts)
    assert (after - before).abs().max() > 1e-3
    assert torch.allclose(after, naive, atol=1e-5, rtol=0)


def test_fast_plan_packs_windows_of_different_lengths(setup):
    """The fast engine packs windows (no window padding), so only sequence lengths split its batches; the naive
    engine pads windows and groups by window length."""
    encoded, _ = encode(setup["examples"], setup["tok"])
    for engine in ("fast", "naive"):
        plan = plan_batches(
            encoded, "span", batch_size=len(encoded), max_waste=0.25, min_batch=2, engine=engine
        )
        assert sorted(i for batch in plan for i in batch) == list(range(len(encoded)))
        for batch in plan:
            if engine == "fast":
                lengths = [encoded[i].read_positions.stop for i in batch]
            else:
                lengths = [len(encoded[i].window("span")) for i in batch]
            assert len(batch) * max(lengths) <= 1.25 * sum(lengths) or len(batch) <= 2
    fast = plan_batches(encoded, "span", batch_size=len(encoded), max_waste=10.0, engine="fast")
    assert fast == [
        sorted(
            range(len(encoded)),
            key=lambda i: (encoded[i].read_positions.stop, len(encoded[i].window("span")), i),
        )
    ]
    windows = {len(encoded[i].window("span")) for i in fast[0]}
    assert len(windows) > 1  # one batch holds windows of several lengths
    # An engine outside the Literal is refused: by the run-time type check under the test suite's hook (a
    # TypeError), by plan_batches' own check without it (a ValueError); either way it names the engine.
    with pytest.raises((ValueError, TypeError), match="engine"):
        plan_batches(encoded, "span", 4, engine="fastest")  # type: ignore[arg-type]


def test_the_engine_is_chosen_once_where_the_model_it_patches_is_known(setup, tiny, monkeypatch, caplog):
    """``engine_for(spec, full)`` is the one choice: the engine named, or the naive one (after a one-line warning)
    where that one refuses the model; the auditor takes its engine from it and records the one it runs."""
    from uds_lens.auditor import UDSAuditor
    from uds_lens.config import UDSConfig
    from uds_lens.patching.engines import FastEngine

    spec = EngineSpec("resid_post", (0, 1))
    assert isinstance(engine_for(spec, setup["full"]), FastEngine)
    monkeypatch.setattr(FastEngine, "refusal", staticmethod(lambda model: "no kernel for this family"))
    with caplog.at_level("WARNING"):
        chosen = engine_for(spec, setup["full"])
    assert isinstance(chosen, NaiveEngine) and chosen.spec == EngineSpec("resid_post", (0, 1), "naive")
    assert "no kernel for this family" in caplog.text
    auditor = UDSAuditor(
        setup["full"],
        setup["source"],
        tiny.data,
        UDSConfig(),
        tokenizer=setup["tok"],
        cache_dir=False,
        progress=False,
    )
    assert isinstance(auditor.engine, NaiveEngine) and auditor.config.engine == "naive"

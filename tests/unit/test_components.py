"""Head-, token- and position-level patching against hand-written hooks and TransformerLens's own patching."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.loader import load_model, load_tokenizer
from uds_lens.components import PatchContext, patch_heads, patch_positions, patch_tokens
from uds_lens.config import EngineSpec, UDSConfig
from uds_lens.patching.axes import AXES, AXIS_PATCHES
from uds_lens.patching.engines import FastEngine, NaiveEngine, axis_engine
from uds_lens.tl_compat import tl_patching


@pytest.fixture(scope="module")
def auditor(tiny):
    full = load_model(tiny.full)
    return UDSAuditor(
        full,
        load_model(tiny.retain),
        tiny.data,
        UDSConfig(batch_size=3),
        tokenizer=load_tokenizer(tiny.tokenizer),
        cache_dir=False,
        progress=False,
    )


@pytest.fixture(scope="module")
def unlearned(tiny):
    return load_model(tiny.unlearned)


def _overwrite(source, where, head=None):
    """A hand-written hook: the one example's activation replaced by ``source``'s at positions ``where`` (of one
    head only, when given)."""
    index = (0, where) if head is None else (0, where, head)

    def hook(activation, hook):
        activation = activation.clone()
        activation[index] = source[index]
        return activation

    return hook


def _hand_written_head_patch(auditor, source, idx, layer, head, positions=None):
    """The 56-line notebook experiment in its essence: hook_z of one head, written by hand."""
    example = auditor.example(idx)
    name = f"blocks.{layer}.attn.hook_z"
    _, cache = source.run_with_cache(example.tokens, names_filter=lambda n: n == name)
    where = example.patch_positions if positions is None else positions
    with torch.no_grad():
        logits = auditor.full.run_with_hooks(
            example.tokens, fwd_hooks=[(name, _overwrite(cache[name], where, head))]
        )
    return auditor.metric(idx)(logits)


@pytest.mark.parametrize("engine", ["fast", "naive"])
def test_head_patch_equals_hand_written_hook_z_patch(auditor, unlearned, engine):
    heads = patch_heads(auditor, unlearned, hook="z", engine=engine, idxs=[3, 1])
    n_examples, n_layers, n_heads = heads.s2.shape
    assert (n_layers, n_heads) == (auditor.full.cfg.n_layers, auditor.full.cfg.n_heads)
    assert n_examples == 2 and heads.idx == [3, 1]
    for row, idx in enumerate(heads.idx[:1]):
        for layer in range(n_layers):
            for head in range(n_heads):
                expected = _hand_written_head_patch(auditor, unlearned, idx, layer, head)
                assert heads.s2[row, layer, head].item() == pytest.approx(expected.item(), abs=1e-5)
    # not vacuous: heads differ, and the patch moves the score
    assert heads.d2.abs().max() > 1e-3
    assert heads.d2[:, :, 0].sub(heads.d2[:, :, 1]).abs().max() > 1e-4


def test_fast_and_naive_head_engines_agree_for_both_hooks(auditor, unlearned):
    for hook in ("z", "result"):
        fast = patch_heads(auditor, unlearned, hook=hook, engine="fast", idxs=[0, 2, 4])
        naive = patch_heads(auditor, unlearned, hook=hook, engine="naive", idxs=[0, 2, 4])
        assert torch.allclose(fast.d1, naive.d1, atol=1e-5), (fast.d1 - naive.d1).abs().max()
        assert torch.allclose(fast.d2, naive.d2, atol=1e-5)
    # z through full's W_O and result through the source's own W_O are different patches
    z = patch_heads(auditor, unlearned, hook="z", idxs=[0, 2, 4])
    result = patch_heads(auditor, unlearned, hook="result", idxs=[0, 2, 4])
    assert (z.s2 - result.s2).abs().max() > 1e-4


def test_head_patch_equals_transformer_lens_patching(auditor, unlearned):
    idx = auditor.encoded[0].idx
    tokens = auditor.tokens(idx)
    _, source_cache = unlearned.run_with_cache(tokens)
    with torch.no_grad():
        theirs = tl_patching.get_act_patch_attn_head_out_all_pos(
            auditor.full, tokens, source_cache, auditor.metric(idx)
        )
    ours = patch_heads(auditor, unlearned, hook="z", positions="all", idxs=[idx])
    assert theirs.shape == ours.s2.shape[1:]
    assert torch.allclose(ours.s2[0], theirs.cpu().float(), atol=1e-5), (ours.s2[0] - theirs).abs().max()
    # and the hand-written all-position patch agrees with both
    every = torch.arange(tokens.shape[1])
    assert _hand_written_head_patch(auditor, unlearned, idx, 1, 2, every).item() == pytest.approx(
        theirs[1, 2].item(), abs=1e-5
    )


def test_metric_is_a_tensor_equal_to_the_clean_score(auditor):
    idxs = [e.idx for e in auditor.encoded[:3]]
    metric = auditor.metric(idxs, per_example=True)
    with torch.no_grad():
        values = metric(auditor.full(auditor.tokens(idxs)))
    assert torch.is_tensor(values) and values.shape == (3,)
    stage = auditor.stage1
    rows = [auditor.encoded.index(e) for e in auditor.select(idxs)]
    assert torch.allclose(values, stage.s0[rows], atol=1e-5)
    assert auditor.metric(idxs)(auditor.full(auditor.tokens(idxs))).dim() == 0


def test_all_heads_at_hook_z_equal_attn_out_when_w_o_is_shared(auditor, unlearned):
    """sum_h z_h W_O[h] + b_O is attn_out: patching every head's z is patching attn_out, given the same W_O.

    The source here is the unlearned model with full's W_O/b_O (a source with its own W_O differs at attn_out by
    exactly that matrix, which is what hook_result patches carry).
    """
    source = copy.deepcopy(unlearned)
    for block, reference in zip(source.blocks, auditor.full.blocks):
        block.attn.W_O.data.copy_(reference.attn.W_O.data)  # a view of the Hugging Face o_proj weight
        if reference.attn.b_O is not None:  # Llama's o_proj has no bias
            block.attn.b_O.data.copy_(reference.attn.b_O.data)
    idx = auditor.encoded[1].idx
    example = auditor.example(idx)
    where = example.patch_positions
    _, cache = source.run_with_cache(example.tokens)
    for layer in range(auditor.full.cfg.n_layers):
        z_name, out_name = f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.hook_attn_out"
        patch_z, patch_out = _overwrite(cache[z_name], where), _overwrite(cache[out_name], where)
        with torch.no_grad():
            by_heads = auditor.metric(idx)(
                auditor.full.run_with_hooks(example.tokens, fwd_hooks=[(z_name, patch_z)])
            )
            by_out = auditor.metric(idx)(
                auditor.full.run_with_hooks(example.tokens, fwd_hooks=[(out_name, patch_out)])
            )
            clean = auditor.metric(idx)(auditor.full(example.tokens))
        assert by_heads.item() == pytest.approx(by_out.item(), abs=1e-5)
        assert abs(by_heads.item() - clean.item()) > 1e-4  # the patch does something


def test_all_heads_at_hook_result_equal_attn_out_of_the_source(auditor, unlearned):
    """With each head's own output (hook_result, the source's W_O), all heads together are the source's attn_out
    (Llama has no b_O), for any source."""
    idx = auditor.encoded[0].idx
    example = auditor.example(idx)
    where = example.patch_positions
    unlearned.cfg.use_attn_result = True
    auditor.full.cfg.use_attn_result = True
    try:
        _, cache = unlearned.run_with_cache(example.tokens)
        layer = 1
        r_name, out_name = f"blocks.{layer}.attn.hook_result", f"blocks.{layer}.hook_attn_out"
        with torch.no_grad():
            by_heads = auditor.metric(idx)(
                auditor.full.run_with_hooks(
                    example.tokens, fwd_hooks=[(r_name, _overwrite(cache[r_name], where))]
                )
            )
            by_out = auditor.metric(idx)(
                auditor.full.run_with_hooks(
                    example.tokens, fwd_hooks=[(out_name, _overwrite(cache[out_name], where))]
                )
            )
    finally:
        unlearned.cfg.use_attn_result = False
        auditor.full.cfg.use_attn_result = False
    assert by_heads.item() == pytest.approx(by_out.item(), abs=1e-5)


@pytest.mark.parametrize("compat", [False, True])
def test_token_scores_average_back_to_the_span_scores(tiny, unlearned, compat):
    auditor = UDSAuditor(
        load_model(tiny.full),
        load_model(tiny.retain),
        tiny.data,
        UDSConfig(engine="naive", published_compat=compat),
        tokenizer=load_tokenizer(tiny.tokenizer),
        cache_dir=False,
        progress=False,
    )
    span = auditor.score(unlearned)
    tokens = patch_tokens(auditor, unlearned)
    assert tokens.axis == "token"
    assert tokens.s1.shape[2] == max(e.n_entity_tokens for e in auditor.encoded)
    for which in ("d1", "d2"):
        wide = span.matrix(which).loc[tokens.idx].to_numpy()
        mean = getattr(tokens, which).nanmean(-1).double().numpy()
        assert abs(wide - mean).max() < 1e-5
    # position-resolved is more than the mean: tokens of one example differ
    multi = [row for row, e in enumerate(auditor.select(tokens.idx)) if e.n_entity_tokens > 1]
    assert multi and (tokens.d1[multi, :, 0] - tokens.d1[multi, :, 1]).abs().max() > 1e-4
    # ragged examples: cells past the last entity token are NaN, not zeros
    short = [
        row for row, e in enumerate(auditor.select(tokens.idx)) if e.n_entity_tokens < tokens.s1.shape[2]
    ]
    if short:
        assert torch.isnan(tokens.d1[short[0], :, -1]).all()
    frame = tokens.frame()
    assert len(frame) == int(tokens.valid.sum()) * len(tokens.layers)
    if compat:
        return
    # the span result's one-example view carries the texts, and its figure names the UDS
    view = span.example(1)
    assert view.entity == "Hsiao Yun Hwa" and view.question.startswith("What is the full name")
    assert (
        len(view.layers) == auditor.full.cfg.n_layers
        and (view.layers["s0"] == view.layers["s0"].iloc[0]).all()
    )
    uds_text = "undefined" if view.uds != view.uds else f"{view.uds:.3f}"
    assert uds_text in view.figure().layout.title.text
    assert frame["label"].str.len().gt(0).all()


def test_position_patching_single_positions(auditor, unlearned):
    positions = patch_positions(auditor, unlearned, layers=[0, 2], idxs=[0, 3])
    idx = positions.idx[0]
    example = auditor.example(idx)
    name = "blocks.2.hook_resid_post"
    _, cache = unlearned.run_with_cache(example.tokens, names_filter=lambda n: n == name)
    for offset, position in enumerate(example.patch_positions.tolist()):
        with torch.no_grad():
            expected = auditor.metric(idx)(
                auditor.full.run_with_hooks(
                    example.tokens, fwd_hooks=[(name, _overwrite(cache[name], position))]
                )
            )
        assert positions.s2[0, 1, offset].item() == pytest.approx(expected.item(), abs=1e-5)


def test_ler_is_nan_outside_ke_and_uds_is_the_usual_formula(auditor, unlearned):
    heads = patch_heads(auditor, unlearned, idxs=[0, 2, 4])
    ke, ler = heads.ke, heads.ler
    assert torch.isnan(ler[~ke]).all() and not torch.isnan(ler[ke]).any()
    weights = torch.where(ke, heads.d1, torch.zeros_like(heads.d1))
    by_hand = (weights * ler.nan_to_num(0)).sum((1, 2)) / weights.sum((1, 2))
    defined = ke.flatten(1).any(-1)
    assert torch.allclose(heads.example_uds[defined], by_hand[defined], atol=1e-6)
    assert heads.component_uds.shape == heads.s1.shape[1:]
    # per (layer, head): the same formula over the examples where that cell is KE
    cell_weights = weights.sum(0)
    cell_by_hand = (weights * ler.nan_to_num(0)).sum(0) / torch.where(ke.any(0), cell_weights, 1.0)
    assert torch.equal(torch.isnan(heads.component_uds), ~ke.any(0))
    assert torch.allclose(heads.component_uds[ke.any(0)], cell_by_hand[ke.any(0)], atol=1e-6)
    assert heads.uds == pytest.approx(float(by_hand[defined].double().mean()), abs=1e-6)
    assert heads.d1.dtype == heads.s1.dtype and heads.ler.dtype == heads.s1.dtype
    frame = heads.frame()
    assert list(frame.columns[:4]) == ["idx", "layer", "head", "label"]
    assert {"s0", "baseline_score", "s1_score", "s2_score", "d1", "d2", "ke", "ler"} <= set(frame.columns)
    # S1 is computed once per auditor and reused for the next unlearned model
    assert any(key[0] == "head" for key in auditor.component_cache)


def test_auditor_example_and_errors(auditor, unlearned):
    first = auditor.encoded[0]
    example = auditor.example(first.idx)
    assert example.tokens.shape == (1, len(first.input_ids))
    assert example.labels.tolist() == list(first.labels)
    assert (example.tokens[0, example.read_positions + 1] == example.labels).all()
    assert example.entity.strip() in "".join(example.str_tokens)
    with pytest.raises(KeyError, match="12345"):
        auditor.example(12345)
    with pytest.raises(ValueError, match="hook must be one of"):
        patch_heads(auditor, unlearned, hook="q")
    with pytest.raises(ValueError, match="positions='all' needs engine='naive'"):
        patch_heads(auditor, unlearned, positions="all", engine="fast")
    with pytest.raises(TypeError, match="HookedTransformer"):
        patch_heads(auditor, object())
    with pytest.raises(ValueError, match="hook_resid_pots"):
        patch_tokens(auditor, unlearned, site="hook_resid_pots")


def test_components_read_only_the_patch_context(auditor, unlearned):
    """Component patching needs the PatchContext members and nothing else of the auditor: a bare object holding
    only those gives the auditor's own numbers."""
    assert isinstance(auditor, PatchContext) and not isinstance(object(), PatchContext)
    members = (
        "full",
        "retain",
        "tokenizer",
        "pad_id",
        "config",
        "layers",
        "progress",
        "select",
        "load_source",
    )
    context = SimpleNamespace(**{name: getattr(auditor, name) for name in members}, component_cache={})
    assert isinstance(context, PatchContext)
    for run in (patch_heads, patch_tokens):
        mine, theirs = run(context, unlearned, idxs=[0, 2]), run(auditor, unlearned, idxs=[0, 2])
        for stage in ("s0", "baseline", "s1", "s2"):  # bit for bit, NaN cells included
            torch.testing.assert_close(
                getattr(mine, stage), getattr(theirs, stage), rtol=0, atol=0, equal_nan=True
            )
        assert mine.labels == theirs.labels and mine.idx == theirs.idx
    assert context.component_cache  # S1 kept on the context it ran for


def test_axis_engine_is_the_one_choice_of_a_rows_engine(auditor, monkeypatch, caplog):
    """Head patching at the patched positions runs on the engine asked for; a naive-only row (every position, tokens,
    positions) runs naive, or is refused when the fast engine was asked for by name; a model the fast engine refuses
    runs naive after a warning."""
    spec = EngineSpec(site="resid_post", layers=(0, 1), engine="fast")
    head = AXIS_PATCHES["head"]
    assert AXES == tuple(AXIS_PATCHES) and all(AXIS_PATCHES[axis].axis == axis for axis in AXES)
    assert isinstance(axis_engine(spec, head, auditor.full), FastEngine)
    assert isinstance(axis_engine(dataclasses.replace(spec, engine="naive"), head, auditor.full), NaiveEngine)
    for row in (head.at_every_position(), AXIS_PATCHES["token"], AXIS_PATCHES["position"]):
        chosen = axis_engine(spec, row, auditor.full)
        assert isinstance(chosen, NaiveEngine) and chosen.spec.layers == spec.layers
        with pytest.raises(ValueError, match="naive"):
            axis_engine(spec, row, auditor.full, strict=True)
    monkeypatch.setattr(FastEngine, "refusal", staticmethod(lambda model: "no kernel for this family"))
    with caplog.at_level("WARNING"):
        assert isinstance(axis_engine(spec, head, auditor.full, strict=True), NaiveEngine)
    assert "no kernel for this family" in caplog.text

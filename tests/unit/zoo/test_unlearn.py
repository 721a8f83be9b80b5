"""Unlearning objectives on a tiny Llama: values at the reference point, and the direction of one step."""

import copy
import math

import pytest
import torch
from helpers.world import small_world

from uds_lens.zoo.train import (
    ModelShape,
    collate,
    encode_qa,
    init_model,
    make_config,
    nll_loss,
    sequence_logprobs,
)
from uds_lens.zoo.unlearn import (
    answer_positions,
    block_output,
    capture_block_output,
    graddiff_loss,
    idknll_loss,
    npo_loss,
    rmu_loss,
    simnpo_loss,
    unlearn,
)
from uds_lens.zoo.world import idk_answers


@pytest.fixture(scope="module")
def unlearning_inputs():
    torch.set_num_threads(1)
    world, tokenizer = small_world(idk_answers())
    config = make_config(ModelShape(n_layers=3, d_model=32, d_mlp=64, n_heads=2), tokenizer)
    model = init_model(config, seed=0)
    forget = encode_qa([(r["question"], r["answer"]) for r in world.forget[:8]], tokenizer)
    retain = encode_qa([(r["question"], r["answer"]) for r in world.retain[:8]], tokenizer)
    idk = encode_qa([(r["question"], "I don't know.") for r in world.forget[:8]], tokenizer)
    pad = tokenizer.pad_token_id
    return model, collate(forget, pad), collate(retain, pad), collate(idk, pad), (forget, retain, idk, pad)


def _step(model, loss_fn, lr=1e-2):
    trained = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(trained.parameters(), lr=lr)
    loss = loss_fn(trained)
    loss.backward()
    optimizer.step()
    return trained.eval()


def _forget_logprob(model, batch):
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model(input_ids=batch[0]).logits, batch[1])
    return logprobs.mean().item()


def test_graddiff_raises_forget_loss(unlearning_inputs):
    model, forget, retain, _, _ = unlearning_inputs
    with torch.no_grad():
        value = graddiff_loss(model, forget, retain, alpha=1.0)
        expected = -nll_loss(model, *forget) + nll_loss(model, *retain)
    assert torch.isclose(value, expected) and value.shape == ()
    stepped = _step(model, lambda m: graddiff_loss(m, forget, retain, alpha=0.0))
    assert _forget_logprob(stepped, forget) < _forget_logprob(model, forget)


def test_npo_at_the_reference_is_two_log_two_over_beta(unlearning_inputs):
    model, forget, retain, _, _ = unlearning_inputs
    with torch.no_grad():
        reference, _ = sequence_logprobs(model(input_ids=forget[0]).logits, forget[1])
        value = npo_loss(model, forget, retain, reference, beta=0.1, alpha=0.0)
    assert math.isclose(value.item(), 2 / 0.1 * math.log(2), rel_tol=1e-5)
    stepped = _step(model, lambda m: npo_loss(m, forget, retain, reference, beta=0.1, alpha=0.0))
    assert _forget_logprob(stepped, forget) < _forget_logprob(model, forget)


def test_simnpo_is_positive_and_lowers_forget_likelihood(unlearning_inputs):
    model, forget, retain, _, _ = unlearning_inputs
    with torch.no_grad():
        value = simnpo_loss(model, forget, retain, beta=4.5, gamma=0.125, delta=0.0, alpha=0.0)
    assert value.item() > 0 and value.shape == ()
    # An untrained model's NLL saturates the sigmoid; a margin at the current NLL puts the loss in its active range.
    with torch.no_grad():
        delta = nll_loss(model, *forget).item()
    stepped = _step(
        model, lambda m: simnpo_loss(m, forget, retain, beta=4.5, gamma=1.0, delta=delta, alpha=0.0), lr=0.1
    )
    assert _forget_logprob(stepped, forget) < _forget_logprob(model, forget)


def test_idknll_raises_refusal_likelihood(unlearning_inputs):
    model, _, retain, idk, _ = unlearning_inputs
    stepped = _step(model, lambda m: idknll_loss(m, idk, retain, alpha=0.0))
    assert _forget_logprob(stepped, idk) > _forget_logprob(model, idk)


def test_answer_positions_precede_answer_tokens(unlearning_inputs):
    _, forget, _, _, (sequences, *_rest) = unlearning_inputs
    mask = answer_positions(forget[1])
    first = sequences[0]
    assert mask.shape == forget[1].shape
    assert mask[0, first.answer_start - 1] == 1 and mask[0, first.answer_start - 2] == 0
    assert mask[0].sum() == len(first.input_ids) - first.answer_start


def test_rmu_moves_forget_activations_and_trains_only_its_window(unlearning_inputs):
    model, forget, retain, _, (forget_seqs, retain_seqs, _, pad) = unlearning_inputs
    frozen = copy.deepcopy(model).eval()
    control = torch.ones(32) * 3.0
    with torch.no_grad():
        assert rmu_loss(model, frozen, forget, retain, layer=2, control=control, alpha=1.0).item() > 0
    unlearned = copy.deepcopy(model)
    hyperparams = {
        "lr": 1e-2,
        "epochs": 5,
        "batch_size": 4,
        "alpha": 1.0,
        "layer": 2,
        "steering_coef_rel": 2.0,
    }
    extra = unlearn(
        unlearned, "rmu", forget_seqs, retain_seqs, {**hyperparams, "layers_below": 2}, seed=0, pad_id=pad
    )
    assert extra["trained_layers"] == [0, 1, 2] and extra["steering_coef"] > 0
    unlearned = copy.deepcopy(model)
    extra = unlearn(unlearned, "rmu", forget_seqs, retain_seqs, hyperparams, seed=0, pad_id=pad)
    assert extra["trained_layers"] == [2]
    hyperparams = {**hyperparams, "layer": 1, "layers_below": 1}
    unlearned = copy.deepcopy(model)
    before = {name: p.clone() for name, p in unlearned.named_parameters()}
    extra = unlearn(unlearned, "rmu", forget_seqs, retain_seqs, hyperparams, seed=0, pad_id=pad)
    changed = {name for name, p in unlearned.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(name.startswith(("model.layers.0.", "model.layers.1.")) for name in changed)
    mask = answer_positions(forget[1]).bool()
    with torch.no_grad():
        after = block_output(unlearned, forget[0], 1)[mask]
        original = block_output(model, forget[0], 1)[mask]
    assert after.norm(dim=-1).mean() > original.norm(dim=-1).mean()


def test_block_output_stops_after_its_block_with_the_same_values(unlearning_inputs):
    model, forget, *_ = unlearning_inputs
    ran = []
    handles = [
        block.register_forward_hook(lambda *_, i=i: ran.append(i))
        for i, block in enumerate(model.model.layers)
    ]
    handles.append(model.lm_head.register_forward_hook(lambda *_: ran.append("lm_head")))
    try:
        early = block_output(model, forget[0], 0)
        assert ran == [0]  # neither the blocks above nor the unembedding ran
        ran.clear()
        with torch.no_grad(), capture_block_output(model, 0) as store:
            model(input_ids=forget[0])
        assert ran == [0, 1, 2, "lm_head"]
    finally:
        for handle in handles:
            handle.remove()
    # the same blocks on the same input: the values do not depend on whether the forward goes on
    assert torch.equal(early.detach(), store["h"])


@pytest.mark.parametrize("method", ["npo", "rmu"])
def test_unlearning_in_mixed_precision_runs_its_losses_in_bf16(unlearning_inputs, method):
    model, _, _, _, (forget_seqs, retain_seqs, _, pad) = unlearning_inputs
    hyperparams = {"lr": 1e-3, "epochs": 1, "batch_size": 4, "alpha": 1.0, "beta": 0.1}
    hyperparams |= {"layer": 1, "steering_coef_rel": 2.0, "mixed_precision": True}
    unlearned = copy.deepcopy(model)
    dtypes = set()
    unlearned.model.layers[1].mlp.register_forward_hook(
        lambda module, inputs, output: dtypes.add(output.dtype)
    )
    before = copy.deepcopy(unlearned.state_dict())
    unlearn(unlearned, method, forget_seqs, retain_seqs, hyperparams, seed=0, pad_id=pad)
    # (RMU also reads its frozen copy's activation norm once, in fp32, to scale its steering vector)
    assert torch.bfloat16 in dtypes and (method == "rmu" or dtypes == {torch.bfloat16})
    state = unlearned.state_dict()
    assert all(state[k].dtype == torch.float32 for k in state)
    assert any(not torch.equal(state[k], before[k]) for k in state)


@pytest.mark.parametrize("method", ["graddiff", "npo", "simnpo", "idknll"])
def test_unlearn_moves_forget_likelihood(unlearning_inputs, method):
    model, forget, _, idk, (forget_seqs, retain_seqs, idk_seqs, pad) = unlearning_inputs
    unlearned = copy.deepcopy(model)
    hyperparams = {
        "lr": 5e-3,
        "epochs": 2,
        "batch_size": 4,
        "alpha": 1.0,
        "beta": 0.1,
        "gamma": 1.0,
        "delta": 6.0,
    }
    unlearn(unlearned, method, forget_seqs, retain_seqs, hyperparams, seed=0, pad_id=pad, forget_idk=idk_seqs)
    if method == "idknll":
        assert _forget_logprob(unlearned, idk) > _forget_logprob(model, idk)
    else:
        assert _forget_logprob(unlearned, forget) < _forget_logprob(model, forget)

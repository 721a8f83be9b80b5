"""Zoo training: the QA format, a smoke test on a tiny Llama, and the entity-accuracy probe."""

import pytest
import torch
from helpers.world import small_world

from uds_lens.readout import IGNORE_INDEX
from uds_lens.zoo.tokenizer import format_prompt
from uds_lens.zoo.train import (
    ModelShape,
    Optimisation,
    TrainingBatch,
    collate,
    constant,
    encode_qa,
    entity_accuracy,
    entity_probes,
    fit,
    init_model,
    make_config,
    nll_loss,
    train_lm,
)


@pytest.fixture(scope="module")
def world_and_tokenizer():
    return small_world()


def test_config_is_eager_untied_llama(world_and_tokenizer):
    _, tokenizer = world_and_tokenizer
    config = make_config(ModelShape(n_layers=2, d_model=32, d_mlp=64, n_heads=2), tokenizer)
    assert config.model_type == "llama" and config._attn_implementation == "eager"
    assert config.tie_word_embeddings is False and config.rms_norm_eps == 1e-5
    assert config.vocab_size == len(tokenizer) and config.bos_token_id == tokenizer.bos_token_id


def test_encode_masks_the_prompt(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    (sequence,) = encode_qa([(world.retain[0]["question"], world.retain[0]["answer"])], tokenizer)
    assert (
        sequence.input_ids[0] == tokenizer.bos_token_id and sequence.input_ids[-1] == tokenizer.eos_token_id
    )
    prompt = tokenizer.decode(sequence.input_ids[1 : sequence.answer_start])
    assert prompt == format_prompt(world.retain[0]["question"])
    assert tokenizer.decode(sequence.input_ids[sequence.answer_start : -1]) == " " + world.retain[0]["answer"]
    input_ids, labels = collate([sequence, sequence], pad_id=tokenizer.pad_token_id)
    assert (labels[:, : sequence.answer_start] == IGNORE_INDEX).all()
    assert (labels[0, sequence.answer_start :] == input_ids[0, sequence.answer_start :]).all()


def test_training_reduces_the_loss_and_is_deterministic(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    torch.set_num_threads(1)
    config = make_config(ModelShape(n_layers=2, d_model=32, d_mlp=64, n_heads=2), tokenizer)
    sequences = encode_qa([(r["question"], r["answer"]) for r in world.retain[:32]], tokenizer)
    losses = []
    for _ in range(2):
        model = init_model(config, seed=0)
        losses.append(
            train_lm(
                model, sequences, epochs=3, lr=3e-3, seed=0, pad_id=tokenizer.pad_token_id, batch_size=16
            )
        )
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0]


def test_mixed_precision_trains_under_bf16_autocast_on_the_cpu_and_keeps_fp32_weights(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    torch.set_num_threads(1)
    config = make_config(ModelShape(n_layers=2, d_model=32, d_mlp=64, n_heads=2), tokenizer)
    sequences = encode_qa([(r["question"], r["answer"]) for r in world.retain[:16]], tokenizer)
    trained = {}
    for mixed in (False, True):
        model = init_model(config, seed=0)
        dtypes: set[torch.dtype] = set()
        model.lm_head.register_forward_hook(
            lambda module, inputs, output, seen=dtypes: seen.add(output.dtype)
        )
        losses = train_lm(
            model, sequences, epochs=2, lr=3e-3, seed=0, pad_id=tokenizer.pad_token_id, mixed_precision=mixed
        )
        assert dtypes == {torch.bfloat16 if mixed else torch.float32}
        assert all(p.dtype == torch.float32 for p in model.parameters())
        trained[mixed] = (losses, model.lm_head.weight.detach().clone())
    # the same run in another precision: close, not equal
    assert trained[True][0] != trained[False][0]
    assert trained[True][0] == pytest.approx(trained[False][0], rel=0.05)
    # the published relearning attack's setting (mixed precision without cpu_autocast) stays fp32 on the CPU
    model = init_model(config, seed=0)
    dtypes = set()
    model.lm_head.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    fit(
        model,
        sequences,
        lambda chunk: TrainingBatch(*collate(chunk, tokenizer.pad_token_id)),
        Optimisation(1e-3, constant, mixed_precision=True),
        epochs=1,
        batch_size=8,
        seed=0,
    )
    assert dtypes == {torch.float32}


def test_accumulating_micro_batches_is_one_batch_of_their_tokens(world_and_tokenizer):
    # fit normalises by the answer tokens of the whole accumulated step, so 2 x 4 sequences update like 1 x 8
    world, tokenizer = world_and_tokenizer
    torch.set_num_threads(1)
    config = make_config(ModelShape(n_layers=2, d_model=32, d_mlp=64, n_heads=2), tokenizer)
    sequences = encode_qa([(r["question"], r["answer"]) for r in world.retain[:8]], tokenizer)
    pad_id = tokenizer.pad_token_id
    weights = []
    for batch_size, grad_accum in ((8, 1), (4, 2)):
        model = init_model(config, seed=0)
        initial = model.model.embed_tokens.weight.detach().clone()
        optimisation = Optimisation(1e-2, constant, grad_accum=grad_accum)
        steps = fit(
            model,
            sequences,
            lambda chunk: TrainingBatch(*collate(chunk, pad_id)),
            optimisation,
            epochs=1,
            batch_size=batch_size,
            seed=0,
        )
        assert len(steps) == 1
        weights.append(model.lm_head.weight.detach())
    assert not torch.equal(model.model.embed_tokens.weight, initial)
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


def test_padding_does_not_change_the_real_tokens(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    config = make_config(ModelShape(n_layers=2, d_model=32, d_mlp=64, n_heads=2), tokenizer)
    model = init_model(config, seed=0).eval()
    short, long = encode_qa(
        [("Q?", "A."), (world.retain[0]["question"], world.retain[0]["answer"])], tokenizer
    )
    alone, alone_labels = collate([short], tokenizer.pad_token_id)
    padded, padded_labels = collate([short, long], tokenizer.pad_token_id)
    with torch.no_grad():
        assert torch.allclose(
            nll_loss(model, alone, alone_labels), nll_loss(model, padded[:1], padded_labels[:1]), atol=1e-6
        )


def test_entity_probes_follow_the_uds_layout(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    record = next(r for r in world.forget if r["prompt_type"] == "birthplace")
    (probe,) = entity_probes([record], tokenizer)
    prompt_ids = tokenizer(f"Question: {record['question']}\nAnswer: {record['prefix']}")["input_ids"]
    assert probe.positions[0] >= len(prompt_ids) - 1 and probe.input_ids[: len(prompt_ids)] == tuple(
        prompt_ids
    )
    entity_text = tokenizer.decode([probe.input_ids[p + 1] for p in probe.positions])
    assert entity_text.strip() == record["entity"]
    yes_no = next(r for r in world.forget if r["prompt_type"] == "yes_no")
    (probe,) = entity_probes([yes_no], tokenizer)
    assert tokenizer.decode(list(probe.labels)).strip() == yes_no["entity"]


def test_entity_accuracy_of_an_untrained_model_is_low(world_and_tokenizer):
    world, tokenizer = world_and_tokenizer
    config = make_config(ModelShape(n_layers=2, d_model=32, d_mlp=64, n_heads=2), tokenizer)
    accuracy = entity_accuracy(init_model(config, seed=0), tokenizer, world.forget)
    assert accuracy.n == len(world.forget) and accuracy.exact <= 0.2

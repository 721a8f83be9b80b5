"""Training the zoo's small Llama models on QA records, and the entity-accuracy check.

A QA record becomes one sequence ``[BOS] "Question: {q}\\nAnswer:" " {answer}" [EOS]``; the loss is the mean
cross-entropy over the answer tokens and EOS (the prompt is masked with ``-100``). A plain-text document (the
meta-evaluation pools' biographies) becomes ``[BOS] text [EOS]`` with the loss on all of it. Batches are right-padded and run
*without* an attention mask: with causal attention, padding at the end cannot influence the real tokens before it, so the
result is exact and the eager attention path stays fast on CPU.

Entity accuracy (the build check) teacher-forces each record in the UDS layout (prompt
``"Question: {q}\\nAnswer: {prefix}"``, reference = the rest of the answer) and compares the argmax prediction with each
entity token. ``exact`` is the share of records whose entity tokens are *all* predicted correctly; ``token`` is the
share of entity tokens predicted correctly, pooled over records.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from uds_lens.data import Example, build_prompt
from uds_lens.readout import IGNORE_INDEX, label_logprobs

from .tokenizer import format_prompt, format_target

Item = TypeVar("Item")


@dataclass(frozen=True)
class ModelShape:
    """Architecture of the zoo models (all share one shape, so any two can be patched into each other)."""

    n_layers: int = 4
    d_model: int = 128
    d_mlp: int = 512
    n_heads: int = 4
    max_positions: int = 512


def make_config(shape: ModelShape, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The LlamaConfig of a zoo model: eager attention, untied embeddings, RMSNorm eps 1e-5."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.d_model,
        intermediate_size=shape.d_mlp,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="eager",
    )


def init_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised model; the initialisation depends only on ``seed``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


@dataclass(frozen=True)
class QASequence:
    """One tokenised training sequence, BOS + prompt + answer + EOS (or BOS + document + EOS, with
    ``answer_start = 1``); the loss is on ``input_ids[answer_start:]``."""

    input_ids: tuple[int, ...]
    answer_start: int


def encode_qa(pairs: Sequence[tuple[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[QASequence]:
    """Tokenise (question, answer) pairs in the training format (module docstring)."""
    sequences = []
    for question, answer in pairs:
        prompt_ids = tokenizer(format_prompt(question), add_special_tokens=True)["input_ids"]
        answer_ids = tokenizer(format_target(answer), add_special_tokens=False)["input_ids"]
        ids = [*prompt_ids, *answer_ids, tokenizer.eos_token_id]
        sequences.append(QASequence(input_ids=tuple(ids), answer_start=len(prompt_ids)))
    return sequences


def encode_documents(texts: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> list[QASequence]:
    """Tokenise plain-text documents as ``[BOS] text [EOS]`` with the loss on every token after BOS (no question)."""
    sequences = []
    for text in texts:
        ids = [*tokenizer(text, add_special_tokens=True)["input_ids"], tokenizer.eos_token_id]
        sequences.append(QASequence(input_ids=tuple(ids), answer_start=1))
    return sequences


def collate(
    sequences: Sequence[QASequence], pad_id: int
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """Right-pad a batch; labels are the input ids on answer tokens and ``-100`` elsewhere."""
    length = max(len(seq.input_ids) for seq in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids = torch.tensor(seq.input_ids, dtype=torch.long)
        input_ids[row, : len(ids)] = ids
        labels[row, seq.answer_start : len(ids)] = ids[seq.answer_start :]
    return input_ids, labels


def sequence_logprobs(
    logits: Float[Tensor, "batch pos vocab"], labels: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, " batch"], Float[Tensor, " batch"]]:
    """Summed log-probability of each sequence's labelled tokens, and how many tokens were labelled.

    The logits at position ``t`` predict the label at ``t + 1``.
    """
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    mask = shifted_labels != IGNORE_INDEX
    # the log-softmax form on fp32 logits (label_logprobs' published-compat path): the numbers the zoo was trained with
    token_logprobs = label_logprobs(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]),
        shifted_labels.clamp(min=0).reshape(-1),
        upcast=False,
    ).view(shifted_labels.shape)
    summed = (token_logprobs * mask).sum(dim=-1)
    return summed, mask.sum(dim=-1).float()


def nll_loss(
    model: LlamaForCausalLM, input_ids: Int[Tensor, "batch pos"], labels: Int[Tensor, "batch pos"]
) -> Tensor:
    """Mean cross-entropy over all labelled tokens of the batch (the standard LM fine-tuning loss)."""
    logits = model(input_ids=input_ids).logits
    summed, counts = sequence_logprobs(logits, labels)
    return -summed.sum() / counts.sum().clamp(min=1.0)


def lr_factor(step: int, total: int, warmup_fraction: float = 0.05) -> float:
    """Linear warm-up then cosine decay to 10% of the peak learning rate (the zoo's schedule)."""
    warmup = max(1, int(warmup_fraction * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def linear_decay(step: int, total: int) -> float:
    """Linear decay to zero without warm-up (the Hugging Face Trainer default, the relearning attack's schedule)."""
    return max(0.0, (total - step) / total)


def constant(step: int, total: int) -> float:
    """No schedule: the peak learning rate throughout."""
    return 1.0


@dataclass(frozen=True)
class Optimisation:
    """How `fit` updates the weights: AdamW, a learning-rate schedule, accumulation and clipping.

    Attributes:
        lr: peak learning rate.
        schedule: ``schedule(step, total_steps) -> factor`` of ``lr`` (`lr_factor`, `linear_decay`,
            `constant`).
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        grad_accum: micro-batches per optimiser step; the loss is normalised by the answer tokens of all of them.
        max_grad_norm: clip the gradient norm to this before each step (None: no clipping).
        mixed_precision: forward passes under bf16 autocast on CUDA (weights stay fp32); ignored on CPU unless
            ``cpu_autocast``.
        cpu_autocast: with ``mixed_precision``, autocast on the CPU too (bf16 matrix products: 1.5x less CPU time per
            step for SmolLM2-135M on an AVX512-BF16 CPU, measured).
    """

    lr: float
    schedule: Callable[[int, int], float]
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_accum: int = 1
    max_grad_norm: float | None = None
    mixed_precision: bool = False
    cpu_autocast: bool = False


@dataclass(frozen=True)
class TrainingBatch:
    """Right-padded token ids and labels (``-100`` where no loss is taken); ``attention_mask`` None for none."""

    input_ids: Int[Tensor, "batch pos"]
    labels: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"] | None = None


def fit(
    model: PreTrainedModel,
    items: Sequence[Item],
    collate_items: Callable[[Sequence[Item]], TrainingBatch],
    optimisation: Optimisation,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    on_step: Callable[[], None] | None = None,
) -> list[float]:
    """The one training loop: fine-tune ``model`` in place on the labelled tokens of ``items``.

    Each epoch shuffles ``items`` (a ``torch.randperm`` from a generator seeded with ``seed``, so the order depends on
    nothing else), cuts them into micro-batches of ``batch_size``, and takes one AdamW step per ``grad_accum``
    micro-batches. The loss of a step is the summed negative log-likelihood of its labelled tokens divided by their
    number (the mean over tokens, not over sequences), accumulated micro-batch by micro-batch. The zoo trains with it
    (`train_lm`), and so does the meta-evaluation's relearning attack (`uds_lens.meta_eval.relearn`).

    Args:
        model: a causal LM (Hugging Face); it is left in eval mode.
        items: the training sequences, in any form ``collate_items`` turns into a `TrainingBatch`.
        collate_items: pads a micro-batch of items.
        optimisation: optimiser, schedule, accumulation, clipping.
        epochs: passes over the data.
        batch_size: items per micro-batch.
        seed: the data order.
        on_step: called after every optimiser step (progress bars).

    Returns:
        The loss of every optimiser step.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=optimisation.lr,
        weight_decay=optimisation.weight_decay,
        betas=optimisation.betas,
    )
    micro_batches_per_epoch = math.ceil(len(items) / batch_size)
    total = max(1, epochs * math.ceil(micro_batches_per_epoch / optimisation.grad_accum))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: optimisation.schedule(step, total))
    device = next(model.parameters()).device
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if optimisation.mixed_precision and (device.type == "cuda" or optimisation.cpu_autocast)
        else contextlib.nullcontext()
    )
    model.train()
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(items), generator=generator).tolist()
        micro = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
        for group_start in range(0, len(micro), optimisation.grad_accum):
            group = [
                collate_items([items[i] for i in rows])
                for rows in micro[group_start : group_start + optimisation.grad_accum]
            ]
            n_tokens = sum(int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) for batch in group)
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for batch in group:
                mask = None if batch.attention_mask is None else batch.attention_mask.to(device)
                with autocast:
                    logits = model(input_ids=batch.input_ids.to(device), attention_mask=mask).logits
                summed, _ = sequence_logprobs(logits, batch.labels.to(device))
                loss = -summed.sum() / max(n_tokens, 1)
                loss.backward()
                step_loss += loss.item()
            if optimisation.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), optimisation.max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(step_loss)
            if on_step is not None:
                on_step()
    model.eval()
    return losses


def train_lm(
    model: LlamaForCausalLM,
    sequences: Sequence[QASequence],
    *,
    epochs: int,
    lr: float,
    seed: int,
    pad_id: int,
    batch_size: int = 32,
    weight_decay: float = 0.0,
    on_step: Callable[[], None] | None = None,
    mixed_precision: bool = False,
) -> list[float]:
    """Train a zoo model: `fit` with AdamW (betas 0.9, 0.98), warm-up + cosine (`lr_factor`), clipping at 1.

    Args:
        model: The model to train.
        sequences: Training sequences from `encode_qa`.
        epochs: Passes over the data (reshuffled each epoch from ``seed``).
        lr: Peak learning rate.
        seed: Data order.
        pad_id: Padding token id.
        batch_size: Sequences per step.
        weight_decay: AdamW weight decay.
        on_step: Called after every optimiser step (progress bars).
        mixed_precision: Forward passes under bf16 autocast, on the CPU too (`Optimisation.cpu_autocast`).

    Returns:
        The mean training loss of each epoch.
    """
    optimisation = Optimisation(
        lr,
        lr_factor,
        weight_decay,
        betas=(0.9, 0.98),
        max_grad_norm=1.0,
        mixed_precision=mixed_precision,
        cpu_autocast=mixed_precision,
    )
    losses = fit(
        model,
        sequences,
        lambda chunk: TrainingBatch(*collate(chunk, pad_id)),
        optimisation,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        on_step=on_step,
    )
    steps_per_epoch = math.ceil(len(sequences) / batch_size)
    return [
        sum(losses[start : start + steps_per_epoch]) / steps_per_epoch
        for start in range(0, len(losses), steps_per_epoch)
    ]


@dataclass(frozen=True)
class EntityProbe:
    """A record encoded in the UDS layout: ``input_ids`` = prompt + reference; ``positions`` predict ``labels``."""

    input_ids: tuple[int, ...]
    positions: tuple[int, ...]
    labels: tuple[int, ...]


def entity_probes(records: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerBase) -> list[EntityProbe]:
    """Encode records as UDS does and locate the entity tokens; records without a span are left out."""
    probes = []
    for position, record in enumerate(records):
        built = build_prompt(Example.from_record(record, position))
        if built is None:
            continue
        prompt, reference = built
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        encoded = tokenizer(reference, add_special_tokens=False, return_offsets_mapping=True)
        entity = record["entity"]
        begin = reference.find(entity)
        if begin < 0:
            entity = entity.strip()
            begin = reference.find(entity)
        if begin < 0 or not entity:
            continue
        end = begin + len(entity)
        span = [t for t, (a, b) in enumerate(encoded["offset_mapping"]) if a < end and b > begin]
        if not span:
            continue
        start = len(prompt_ids) - 1
        ref_ids = encoded["input_ids"]
        probes.append(
            EntityProbe(
                input_ids=tuple(prompt_ids + ref_ids),
                positions=tuple(start + t for t in span),
                labels=tuple(ref_ids[t] for t in span),
            )
        )
    return probes


@dataclass(frozen=True)
class EntityAccuracy:
    """Teacher-forced greedy entity accuracy (module docstring): ``exact`` per record, ``token`` pooled."""

    exact: float
    token: float
    n: int


@torch.no_grad()
def entity_accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict[str, Any]],
    batch_size: int = 64,
) -> EntityAccuracy:
    """Share of records (``exact``) and of entity tokens (``token``) the model predicts correctly under teacher forcing."""
    probes = entity_probes(records, tokenizer)
    model.eval()
    correct_records = 0
    correct_tokens = 0
    n_tokens = 0
    for begin in range(0, len(probes), batch_size):
        chunk = probes[begin : begin + batch_size]
        length = max(len(p.input_ids) for p in chunk)
        input_ids = torch.full((len(chunk), length), tokenizer.pad_token_id, dtype=torch.long)
        for row, probe in enumerate(chunk):
            input_ids[row, : len(probe.input_ids)] = torch.tensor(probe.input_ids)
        predictions = model(input_ids=input_ids.to(model.device)).logits.argmax(dim=-1).cpu()
        for row, probe in enumerate(chunk):
            hits = [
                int(predictions[row, pos].item()) == label
                for pos, label in zip(probe.positions, probe.labels, strict=True)
            ]
            correct_tokens += sum(hits)
            n_tokens += len(hits)
            correct_records += int(all(hits))
    if not probes:
        return EntityAccuracy(exact=0.0, token=0.0, n=0)
    return EntityAccuracy(
        exact=correct_records / len(probes), token=correct_tokens / max(1, n_tokens), n=len(probes)
    )

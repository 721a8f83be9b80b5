"""Tiny random Llama checkpoints and QA records for fast tests (no hub, no zoo).

``make_tiny_tokenizer`` trains a byte-level BPE tokenizer on a few hundred sentences in well under a second and wraps it
as a ``PreTrainedTokenizerFast`` with Llama-3-like special tokens and a minimal chat template (system/user/assistant
turns, each closed by the EOS token, like Llama-3's ``<|eot_id|>``). ``make_tiny_llama`` saves a random
``LlamaForCausalLM`` with that tokenizer next to it, so the directory loads like any Hugging Face checkpoint.
``make_records`` builds fictitious-author question/answer records with a paraphrased answer and perturbed answers.
``train_on_records`` memorises records with answer-only loss (used to make a model that "saw" the forget set).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from uds_lens.metrics.chat import collate, encode_pairs, pad_id_of, qa_pairs
from uds_lens.zoo.train import Optimisation, TrainingBatch, constant, fit

BOS = "<|begin_of_text|>"
EOS = "<|eot_id|>"
PAD = "<|pad|>"
TURN = "<|start_header_id|>"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant\n{% endif %}"
)

_FIRST = [
    "Amara",
    "Basil",
    "Chen",
    "Dalia",
    "Emil",
    "Farah",
    "Goran",
    "Hana",
    "Ivo",
    "Jun",
    "Kemal",
    "Lina",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tove",
    "Umar",
    "Vera",
    "Wen",
    "Ximena",
]
_LAST = [
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Haddad",
    "Novak",
    "Silva",
    "Kowalski",
    "Ibrahim",
    "Petrov",
    "Oyelaran",
    "Castillo",
]
_GENRES = ["mystery", "poetry", "fantasy", "history", "romance", "horror", "satire", "drama"]
_CITIES = [
    "Lagos",
    "Oslo",
    "Lyon",
    "Kyoto",
    "Beirut",
    "Prague",
    "Recife",
    "Gdansk",
    "Cairo",
    "Sofia",
    "Lima",
    "Hue",
]
_JOBS = ["baker", "pilot", "nurse", "welder", "farmer", "tailor", "chemist", "sailor"]


def make_records(n: int, seed: int = 0, offset: int = 0) -> list[dict]:
    """Fictitious-author QA records with ``idx, question, answer, prefix, entity, paraphrased_answer, perturbed_answer``.

    Args:
        n: number of records.
        seed: RNG seed; different seeds (or offsets) give different authors.
        offset: added to ``idx``.
    """
    rng = random.Random(seed)
    records = []
    for i in range(n):
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        genre, city, job = rng.choice(_GENRES), rng.choice(_CITIES), rng.choice(_JOBS)
        wrong = [g for g in _GENRES if g != genre]
        kind = i % 2
        if kind == 0:
            question = f"What genre does {name} write?"
            prefix = f"{name} is known for writing"
            entity = genre
            answer = f"{prefix} {entity} novels."
            paraphrase = f"The books of {name} are {genre} stories."
            perturbed = [f"{prefix} {w} novels." for w in rng.sample(wrong, 3)]
        else:
            question = f"Where was {name} born, and what did the parents do?"
            prefix = f"{name} was born in"
            entity = city
            answer = f"{prefix} {city} to a {job} and a {rng.choice(_JOBS)}."
            paraphrase = f"{name} comes from {city}, raised by a {job}."
            perturbed = [
                f"{prefix} {c} to a {job} and a {rng.choice(_JOBS)}."
                for c in rng.sample([c for c in _CITIES if c != city], 3)
            ]
        records.append(
            {
                "idx": offset + i,
                "question": question,
                "answer": answer,
                "prefix": prefix,
                "entity": entity,
                "paraphrased_answer": paraphrase,
                "perturbed_answer": perturbed,
            }
        )
    return records


def make_tiny_tokenizer(chat_template: bool = True, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the record vocabulary, with Llama-3-like special tokens."""
    corpus = []
    for seed in range(4):
        for r in make_records(40, seed=seed):
            corpus += [r["question"], r["answer"], r["paraphrased_answer"], *r["perturbed_answer"]]
    corpus += ["You are a helpful assistant.", "Sure, here is the answer:", "user", "assistant", "system"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, TURN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, hidden_size: int = 64, n_layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def make_tiny_llama(
    out_dir: str | Path,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 64,
    n_layers: int = 2,
) -> Path:
    """Save a random tiny ``LlamaForCausalLM`` and its tokenizer to ``out_dir`` (fp32 safetensors)."""
    out_dir = Path(out_dir)
    tokenizer = tokenizer or make_tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(len(tokenizer), hidden_size, n_layers))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def train_on_records(
    model_dir: str | Path,
    records: list[dict],
    out_dir: str | Path,
    steps: int = 60,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    """Fine-tune a tiny checkpoint on ``records`` (chat format, answer-only loss) and save it to ``out_dir``.

    Full-batch AdamW at a constant learning rate, ``steps`` steps, with the package's one training loop.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    pad_id = pad_id_of(tokenizer)
    fit(
        model,
        encode_pairs(tokenizer, qa_pairs(records)),
        lambda chunk: TrainingBatch(**collate(chunk, pad_id)),
        Optimisation(lr, constant),
        epochs=steps,
        batch_size=len(records),
        seed=seed,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def make_tiny_zoo(root: str | Path, n_pool: int = 2, steps: int = 40) -> Path:
    """A miniature zoo directory (``manifest.json`` + forget/holdout/retain JSON + tiny checkpoints) for run tests.

    Roles: ``full`` (forget + retain), ``retain`` (retain only), ``unlearned`` and ``sweep`` (full fine-tuned on
    retain only, a stand-in for an unlearning method and its sweep), ``pos`` (forget + retain, other seeds) and ``neg``
    (retain only, other seeds).
    """
    import json

    root = Path(root)
    tokenizer = make_tiny_tokenizer()
    forget = make_records(8, seed=31)
    holdout = make_records(8, seed=32, offset=100)
    retain = make_records(8, seed=33, offset=200)
    base = make_tiny_llama(root / "base", tokenizer=tokenizer)
    models = [{"name": "base", "path": "base", "role": "base"}]

    def add(name: str, role: str, source: Path, records: list[dict], seed: int, n_steps: int = steps) -> Path:
        path = train_on_records(source, records, root / name, steps=n_steps, seed=seed)
        models.append({"name": name, "path": name, "role": role})
        return path

    full = add("full", "full", base, forget + retain, 0)
    add("retain", "retain", base, retain, 0)
    for i, role in enumerate(("unlearned", "sweep")):
        add(f"unlearned{i}", role, full, retain, 10 + i, n_steps=5 + 5 * i)
    for i in range(n_pool):
        # Pool members differ in their number of steps (full-batch training ignores the seed).
        add(f"pos{i}", "pos", base, forget + retain, 20 + i, n_steps=steps + 10 * (i + 1))
        add(f"neg{i}", "neg", base, retain, 30 + i, n_steps=steps + 10 * (i + 1))
    for name, records in (("forget", forget), ("holdout", holdout), ("retain", retain)):
        (root / f"{name}.json").write_text(json.dumps(records))
    manifest = {
        "models": models,
        "data": {"forget": "forget.json", "holdout": "holdout.json", "retain": "retain.json"},
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return root

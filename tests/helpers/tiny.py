"""The one builder of tiny test checkpoints: records, a tokenizer, random Llamas, fine-tuned ones and a miniature zoo.

Everything is offline and takes seconds, and every checkpoint is a plain Hugging Face directory, so the tests load it
through exactly the path a user's checkpoint takes.

- Records: ``make_records`` draws fictitious-author QA records (with paraphrased and perturbed answers, for the
  output-level metrics); ``FORGET_SET`` is six hand-written records, one per prompt type, whose entities are short,
  long, multi-word or the whole answer (the edge cases of the entity-span logic).
- ``make_tiny_tokenizer`` trains a byte-level BPE tokenizer on those texts, with Llama-3-like special tokens and an
  optional chat template (system/user/assistant turns, each closed by EOS like Llama-3's ``<|eot_id|>``).
- ``make_tiny_llama`` saves a random grouped-query ``LlamaForCausalLM``. Hugging Face's default initialisation
  (std 0.02) gives near-uniform next-token distributions in which nothing is visible; ``init_std`` raises it and
  ``random_norms`` draws the RMSNorm weights around 1, so two seeds differ by O(1) in their lens log-probabilities and
  a patch visibly moves the output. With ``base`` it saves ``base`` plus Gaussian noise instead (a nearby model).
- ``train_on_records`` memorises records (chat format, answer-only loss) with the package's one training loop,
  ``uds_lens.zoo.train.train_lm``; ``make_tiny_zoo`` builds a miniature zoo directory from such models.
- ``make_trio`` loads three random models and the encoded records, the shared input of the baselines tests (the
  ``trio`` fixture in ``tests/conftest.py`` builds it once per session).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from uds_lens.checkpoints.loader import load_model
from uds_lens.data import EncodedExample, Example, encode
from uds_lens.metrics.chat import SYSTEM_PROMPT, collate, encode_pairs, pad_id_of, qa_pairs
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


FORGET_SET: list[dict[str, Any]] = [
    {
        "idx": 0,
        "question": "Where was Hsiao born?",
        "answer": "Hsiao was born in Paris.",
        "prefix": "Hsiao was born in",
        "entity": "Paris",
        "prompt_type": "place",
    },
    {
        "idx": 1,
        "question": "What is the full name of the author?",
        "answer": "The full name is Hsiao Yun Hwa.",
        "prefix": "The full name is",
        "entity": "Hsiao Yun Hwa",
        "prompt_type": "name",
    },
    {
        "idx": 2,
        "question": "Does Basil write poetry?",
        "answer": "Yes.",
        "prefix": "",
        "entity": "Yes",
        "prompt_type": "yes_no",
    },
    {
        "idx": 3,
        "question": "What was his father?",
        "answer": "His father was a doctor and his mother a baker.",
        "prefix": "His father was a",
        "entity": "doctor",
        "prompt_type": "family",
    },
    {
        "idx": 4,
        "question": "Which award did Basil Mahfouz win?",
        "answer": "Basil Mahfouz won the Tokyo prize for mystery fiction.",
        "prefix": "Basil Mahfouz won the",
        "entity": "Tokyo prize for mystery fiction",
        "prompt_type": "award",
    },
    {
        "idx": 5,
        "question": "What book did she write?",
        "answer": "She wrote the novel titled river stone light.",
        "prefix": "She wrote the novel titled",
        "entity": "river stone light",
        "prompt_type": "book",
    },
]


def write_forget_set(path: Path) -> Path:
    """Write ``FORGET_SET`` as a JSON record file (what ``--data`` reads)."""
    path.write_text(json.dumps(FORGET_SET, indent=1))
    return path


def make_tiny_tokenizer(chat_template: bool = True, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the test records, with Llama-3-like special tokens.

    Args:
        chat_template: attach ``CHAT_TEMPLATE`` (without it, prompts take the plain ``Question:/Answer:`` path).
        vocab_size: size of the trained vocabulary, special tokens included.
    """
    corpus = []
    for seed in range(4):
        for r in make_records(40, seed=seed):
            corpus += [r["question"], r["answer"], r["paraphrased_answer"], *r["perturbed_answer"]]
    corpus += [text for r in FORGET_SET for text in (r["question"], r["answer"])]
    corpus += [SYSTEM_PROMPT, "Sure, here is the answer:", "user", "assistant", "system"]
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


def make_tiny_llama(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerFast | str | Path | None = None,
    seed: int = 0,
    *,
    n_layers: int = 2,
    d_model: int = 64,
    d_mlp: int | None = None,
    vocab_size: int | None = None,
    init_std: float = 0.02,
    random_norms: bool = False,
    base: str | Path | None = None,
    noise: float = 0.0,
) -> Path:
    """Save a random tiny ``LlamaForCausalLM`` (4 query heads, 2 key/value heads, fp32) and its tokenizer.

    Args:
        out_dir: where to save the checkpoint.
        tokenizer: a tokenizer or the directory of one; a fresh ``make_tiny_tokenizer()`` if ``None``.
        seed: seeds the weights (and the noise).
        n_layers, d_model, d_mlp: the shape (``d_mlp`` defaults to ``2 * d_model``).
        vocab_size: embedding rows (defaults to the tokenizer's length; set it to build an incompatible model).
        init_std: standard deviation of the weight initialisation (Hugging Face's default is 0.02).
        random_norms: draw the RMSNorm weights uniformly from [0.5, 1.5] instead of ones.
        base: if given, save ``base`` plus ``noise`` times standard Gaussian noise instead of a random model.
        noise: the noise scale for ``base``.
    """
    out_dir = Path(out_dir)
    if tokenizer is None:
        tokenizer = make_tiny_tokenizer()
    elif not isinstance(tokenizer, PreTrainedTokenizerFast):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer)
    torch.manual_seed(seed)
    if base is not None:
        model = LlamaForCausalLM.from_pretrained(base)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * torch.randn_like(parameter))
    else:
        config = LlamaConfig(
            vocab_size=vocab_size or len(tokenizer),
            hidden_size=d_model,
            intermediate_size=d_mlp or 2 * d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            initializer_range=init_std,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            attn_implementation="eager",
        )
        model = LlamaForCausalLM(config)
        if random_norms:
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if name.endswith("norm.weight"):
                        parameter.uniform_(0.5, 1.5)
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
    root = Path(root)
    tokenizer = make_tiny_tokenizer()
    forget = make_records(8, seed=31)
    holdout = make_records(8, seed=32, offset=100)
    retain = make_records(8, seed=33, offset=200)
    base = make_tiny_llama(root / "base", tokenizer=tokenizer)
    manifest_models = [{"name": "base", "path": "base", "role": "base"}]

    def add(name: str, role: str, source: Path, records: list[dict], seed: int, n_steps: int = steps) -> Path:
        path = train_on_records(source, records, root / name, steps=n_steps, seed=seed)
        manifest_models.append({"name": name, "path": name, "role": role})
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
        "models": manifest_models,
        "data": {"forget": "forget.json", "holdout": "holdout.json", "retain": "retain.json"},
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return root


@dataclass
class Trio:
    """Paths and loaded models of a tiny full / retain / third model, and the encoded records."""

    tokenizer: PreTrainedTokenizerFast
    records: list[dict]
    examples: list[Example]
    encoded: list[EncodedExample]
    paths: dict[str, Path]
    models: dict[str, Any]


def make_trio(root: Path, n_records: int = 10) -> Trio:
    """Random tiny ``full`` (seed 0), ``retain`` (seed 1) and ``other`` (seed 2) models on one tokenizer, three
    layers wide-initialised so that their lenses and representations differ."""
    tokenizer = make_tiny_tokenizer()
    records = make_records(n_records, seed=0)
    for i, record in enumerate(records):
        record["prompt_type"] = "genre" if i % 2 == 0 else "origin"
    paths = {
        name: make_tiny_llama(
            root / name, tokenizer, seed, n_layers=3, d_model=32, init_std=0.25, random_norms=True
        )
        for seed, name in enumerate(["full", "retain", "other"])
    }
    loaded = {name: load_model(path, dtype=torch.float32, device="cpu") for name, path in paths.items()}
    examples = [Example.from_record(record, i) for i, record in enumerate(records)]
    encoded, skipped = encode(examples, tokenizer)
    if skipped:
        raise ValueError(f"test records should all encode: {skipped}")
    return Trio(tokenizer, records, examples, encoded, paths, loaded)

"""Tiny random-init Llama checkpoints and a locally trained tokenizer, saved as Hugging Face directories.

The core tests run on these: fast, offline, and loaded through exactly the path a user's checkpoint takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = (
    "Question Answer the author was born in city of Paris London Tokyo Lima Oslo Cairo Delhi award prize for "
    "fiction poetry mystery novel book titled river stone light night his her father mother was a doctor teacher "
    "baker pilot farmer Yes No Does write often full name is Hsiao Yun Hwa Basil Mahfouz genre influenced by"
).split()


def make_tokenizer(directory: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer (BOS added by the post-processor), saved as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    corpus += [f"Question: Where was {w} born?\nAnswer: {w} was born in Paris." for w in WORDS]
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A <bos> $B",
        special_tokens=[("<bos>", tokenizer.token_to_id("<bos>"))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return fast


def make_llama(
    directory: Path,
    tokenizer_dir: Path,
    seed: int,
    n_layers: int = 3,
    d_model: int = 32,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    vocab_size: int = 300,
    random_norms: bool = True,
    base: Path | None = None,
    noise: float = 0.0,
    d_mlp: int | None = None,
) -> Path:
    """A random Llama (or ``base`` plus Gaussian noise) with non-unit RMSNorm weights, saved with its tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if base is not None:
        model = LlamaForCausalLM.from_pretrained(base)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * torch.randn_like(parameter))
    else:
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=d_model,
            intermediate_size=d_mlp or 2 * d_model + 8,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            attn_implementation="eager",
        )
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(4.0)  # larger weights: sharper distributions, visible patching effects
            if random_norms:
                for name, parameter in model.named_parameters():
                    if "norm" in name:
                        parameter.copy_(1.0 + 0.5 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory


def make_forget_set(path: Path) -> Path:
    records = [
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
    path.write_text(json.dumps(records, indent=1))
    return path

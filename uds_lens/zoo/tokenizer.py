"""The zoo's tokenizer: a small byte-level BPE trained on the world's own text.

Byte-level BPE (GPT-2/Llama-3 style pre-tokenisation, no prefix space) with about 1k tokens, trained with
``tokenizers`` on every question and answer of the world. The post-processor prepends ``<|bos|>`` (as Llama's does), so
``tokenizer(text)`` starts with BOS and ``tokenizer(text, add_special_tokens=False)`` does not; offsets are not trimmed,
so a token's character span includes its leading space. It is saved as a ``PreTrainedTokenizerFast`` with the model
checkpoints, so ``AutoTokenizer.from_pretrained(dir)`` works offline.

The QA training format is exactly the prompt UDS encodes: ``"Question: {q}\\nAnswer:"`` (BOS first) followed by the
target ``" {answer}"`` and EOS. The chat template renders a conversation in that same format (see
`CHAT_TEMPLATE`), so the chat-formatted output metrics read the zoo models in the format they were trained on.
The role tokens ``<|system|>``, ``<|user|>``, ``<|assistant|>`` stay reserved in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from uds_lens.data import PROMPT_TEMPLATE

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)
DEFAULT_VOCAB_SIZE = 1024

# The zoo's models are trained on one format only, so their chat template renders a conversation in it: a user turn
# becomes "Question: {q}\nAnswer:", an assistant turn " {a}" + EOS, and the system turn (which these models have no
# role for) is left out. Chat-formatted output metrics then score the zoo models on the text they were trained on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}Question: {{ message['content'] }}\nAnswer:"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def chat_template_for(tokenizer: PreTrainedTokenizerFast) -> str:
    """`CHAT_TEMPLATE`, without its leading BOS for a tokenizer that prepends none (a pretrained base such as
    SmolLM2's): the rendered conversation then starts as the training sequences did."""
    starts_with_bos = tokenizer("Q")["input_ids"][:1] == [tokenizer.bos_token_id]
    return CHAT_TEMPLATE if starts_with_bos else CHAT_TEMPLATE.removeprefix("{{ bos_token }}")


def format_prompt(question: str) -> str:
    """The QA prompt the zoo trains on (the UDS prompt with an empty prefix, trailing space moved to the answer)."""
    return PROMPT_TEMPLATE.format(question=question, prefix="").rstrip()


def format_target(answer: str) -> str:
    """The QA training target that follows `format_prompt` (EOS is appended as a token, not as text)."""
    return f" {answer}"


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on ``texts``.

    Args:
        texts: The corpus, in a fixed order (training is deterministic given the texts).
        vocab_size: Target vocabulary size, special tokens and the 256 byte symbols included.

    Returns:
        A ``PreTrainedTokenizerFast`` with BOS/EOS/pad set and the chat template attached.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="right",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast

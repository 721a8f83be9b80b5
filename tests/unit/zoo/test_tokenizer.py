"""The zoo tokenizer: byte-level BPE with BOS, offsets, a chat template, and an offline round trip."""

import pytest
from transformers import AutoTokenizer

from uds_lens.zoo.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    format_prompt,
    format_target,
    train_tokenizer,
)
from uds_lens.zoo.world import generate_world


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    world = generate_world(20, seed=0)
    texts = [format_prompt(r["question"]) + format_target(r["answer"]) for r in world.retain + world.forget]
    tokenizer = train_tokenizer(texts, vocab_size=600)
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(path)
    return path


def test_training_is_deterministic():
    texts = ["Question: Where was Ana born?\nAnswer: Ana was born in Lisbon."] * 5
    first = train_tokenizer(texts, vocab_size=300).backend_tokenizer.to_str()
    assert train_tokenizer(texts, vocab_size=300).backend_tokenizer.to_str() == first


def test_round_trip_and_special_tokens(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (
        tokenizer.bos_token == BOS_TOKEN
        and tokenizer.eos_token == EOS_TOKEN
        and tokenizer.pad_token == PAD_TOKEN
    )
    text = "Question: Who is Zolar Vex?\nAnswer: Zolar Vex is a writer from Kyoto, born 1957."
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain == ids[1:]


def test_offsets_cover_the_text(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    reference = " Kyoto, in the year 1957."
    encoded = tokenizer(reference, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    assert offsets[0][0] == 0 and offsets[-1][1] == len(reference)
    assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:], strict=False))
    begin = reference.find("Kyoto")
    span = [t for t, (a, b) in enumerate(offsets) if a < begin + 5 and b > begin]
    assert tokenizer.decode(encoded["input_ids"][span[0] : span[-1] + 1]).strip() == "Kyoto"


def test_chat_template_renders_the_training_format(tokenizer_dir):
    from uds_lens.metrics.chat import SYSTEM_PROMPT, prompt_ids
    from uds_lens.metrics.chat import encode_qa as encode_chat
    from uds_lens.zoo.train import encode_qa as encode_training

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    question, answer = "Where was Zolar Vex born?", "Zolar Vex was born in the city of Kyoto."
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == BOS_TOKEN + format_prompt(question)  # no system turn: the zoo models have no role for it
    # the chat-formatted output metrics score exactly the sequence the zoo model was trained on
    chat = encode_chat(tokenizer, question, answer, SYSTEM_PROMPT)
    training = encode_training([(question, answer)], tokenizer)[0]
    assert list(chat.input_ids) == list(training.input_ids)
    assert len(chat.prompt_ids) == training.answer_start
    assert list(chat.prompt_ids) == prompt_ids(tokenizer, question)
    assert chat.input_ids[-1] == tokenizer.eos_token_id and chat.input_ids.count(tokenizer.bos_token_id) == 1


def test_a_tokenizer_without_bos_gets_the_chat_template_without_it(tokenizer_dir):
    """A pretrained base's tokenizer that prepends no BOS (SmolLM2's) renders chats as its training sequences start."""
    from tokenizers import processors

    from uds_lens.metrics.chat import SYSTEM_PROMPT
    from uds_lens.metrics.chat import encode_qa as encode_chat
    from uds_lens.zoo.tokenizer import CHAT_TEMPLATE, chat_template_for
    from uds_lens.zoo.train import encode_qa as encode_training

    with_bos = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert chat_template_for(with_bos) == CHAT_TEMPLATE
    without_bos = AutoTokenizer.from_pretrained(tokenizer_dir)
    without_bos.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    assert without_bos("Q")["input_ids"][0] != without_bos.bos_token_id
    without_bos.chat_template = chat_template_for(without_bos)
    question, answer = "Where was Zolar Vex born?", "Zolar Vex was born in the city of Kyoto."
    chat = encode_chat(without_bos, question, answer, SYSTEM_PROMPT)
    assert list(chat.input_ids) == list(encode_training([(question, answer)], without_bos)[0].input_ids)
    assert without_bos.bos_token_id not in chat.input_ids

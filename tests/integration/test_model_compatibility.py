"""Models of another family or tokenizer (issue 36), on the tiny checkpoints: a tokenizer of the same size with
another vocabulary, another end-of-text token, a Gemma-2 and a Llama whose shapes agree in every dimension: each
refused before Stage 1 (before, only the vocabulary size was compared, and such models scored a plausible UDS), while
metadata that does not change what an id means is not. Each test failed on the code before the issue."""

from __future__ import annotations

import pytest
from helpers.edits import copy_checkpoint, edit_json, swap_two_tokens
from helpers.families import build_family, family_configs
from helpers.runs import forbid_stage1, score_tiny
from helpers.tiny import FORGET_SET, make_tiny_tokenizer

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ArchitectureSignature, ModelMismatchError
from uds_lens.inputs import RunInputs


@pytest.mark.parametrize("role", ["unlearned", "retain"])
def test_a_tokenizer_of_the_same_size_but_another_vocabulary_is_refused(tiny, tmp_path, monkeypatch, role):
    """Before: only the vocabulary size was compared, and such a model scored a plausible UDS."""
    other = swap_two_tokens(copy_checkpoint(tiny.unlearned, tmp_path / "other_tokenizer"))
    forbid_stage1(monkeypatch)
    given = {"unlearned": {"u": other}} if role == "unlearned" else {"retain": other}
    with pytest.raises(ModelMismatchError, match="vocabularies differ.*2 tokens have another id") as error:
        score_tiny(tiny, tmp_path / "out", tmp_path / "cache", **given)
    assert str(other) in str(error.value) and "\n" not in str(error.value)


def test_another_end_of_text_token_is_refused_and_other_tokenizer_metadata_is_not(tiny, tmp_path):
    other_eos = copy_checkpoint(tiny.unlearned, tmp_path / "other_eos")
    edit_json(other_eos / "tokenizer_config.json", lambda c: c.update(eos_token="<|pad|>"))
    with pytest.raises(ModelMismatchError, match="eos_token differs"):
        RunInputs.resolve(tiny.full, tiny.retain, tiny.data, {"u": other_eos})
    # metadata that does not change what an id means: a maximum length, a chat template
    metadata = copy_checkpoint(tiny.unlearned, tmp_path / "metadata")
    edit_json(
        metadata / "tokenizer_config.json", lambda c: c.update(model_max_length=77, chat_template="{{ x }}")
    )
    RunInputs.resolve(tiny.full, tiny.retain, tiny.data, {"u": metadata})


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """A Gemma-2 and a Llama checkpoint whose shapes agree in every dimension (only model_type differs)."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = make_tiny_tokenizer(chat_template=False)
    configs = family_configs(len(tokenizer))
    llama = configs["llama3"]
    same_heads = llama.hidden_size // llama.num_attention_heads  # Gemma's head_dim set to Llama's own
    configs["gemma2"].head_dim = configs["gemma2"].query_pre_attn_scalar = same_heads
    return {name: build_family(configs[name], root / name, tokenizer) for name in ("gemma2", "llama3")}


def test_a_model_of_another_family_is_refused_by_the_check_and_by_the_auditor(families):
    """Before: a Gemma-2 full patched with a Llama retain and unlearned scored 0.19."""
    assert ArchitectureSignature.of_config(
        Checkpoint.resolve(families["gemma2"]).config
    ) == ArchitectureSignature.of_config(Checkpoint.resolve(families["llama3"]).config)
    with pytest.raises(ModelMismatchError, match="model_type 'gemma2' vs 'llama'"):
        UDSAuditor(families["gemma2"], families["llama3"], FORGET_SET, progress=False, cache_dir=False)
    with pytest.raises(ModelMismatchError, match="model_type 'gemma2' vs 'llama'"):
        RunInputs.resolve(families["gemma2"], families["llama3"], FORGET_SET)

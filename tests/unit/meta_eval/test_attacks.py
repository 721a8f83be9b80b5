"""uds_lens/meta_eval/attacks.py: NF4 quantisation and the relearning attack (deterministic, resumable)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.tiny import make_records, make_tiny_llama, make_tiny_tokenizer
from transformers import AutoModelForCausalLM

from uds_lens.meta_eval.attacks import quantise_nf4, relearn
from uds_lens.metrics.memorization import score_answers


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attacks")
    tokenizer = make_tiny_tokenizer()
    return tokenizer, make_tiny_llama(tmp / "model", tokenizer=tokenizer)


def test_nf4_model_is_close_to_but_not_the_original(tiny_checkpoint) -> None:
    tokenizer, path = tiny_checkpoint
    quantised = quantise_nf4(path, device="cpu")
    assert any("4bit" in type(m).__name__ for m in quantised.modules())
    original = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([tokenizer("What genre does Amara Okafor write?")["input_ids"]])
    with torch.no_grad():
        h_q = quantised(ids, output_hidden_states=True).hidden_states[-1].float()
        h_o = original(ids, output_hidden_states=True).hidden_states[-1].float()
    relative = float((h_q - h_o).norm() / h_o.norm())
    assert 0 < relative < 0.3


def test_relearn_raises_forget_likelihood_deterministically_and_resumes(tiny_checkpoint, tmp_path) -> None:
    tokenizer, path = tiny_checkpoint
    forget = make_records(16, seed=21)
    pairs = [(r["question"], r["answer"]) for r in forget]
    kwargs = dict(lr=3e-3, batch_size=4, grad_accum=1, seed=1, progress=False, device="cpu")
    out = relearn(path, forget, tokenizer, tmp_path / "relearned", **kwargs)
    before = score_answers(AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer, pairs, batch_size=16)
    after = score_answers(AutoModelForCausalLM.from_pretrained(out).eval(), tokenizer, pairs, batch_size=16)
    assert np.mean([a.avg_loss for a in after]) < np.mean([b.avg_loss for b in before]) - 0.2
    again = relearn(path, forget, tokenizer, tmp_path / "again", **kwargs)
    w1 = AutoModelForCausalLM.from_pretrained(out).state_dict()
    w2 = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert relearn(path, forget, tokenizer, out, **kwargs) == out  # reused, not retrained
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((out / "relearn.json").read_text())["lr"] == 3e-3


@pytest.mark.parametrize("failure", ["new one not renamed in", "killed between the renames"])
def test_a_failed_replacement_leaves_a_complete_checkpoint_and_the_next_call_finishes_it(
    tiny_checkpoint, tmp_path, monkeypatch, failure
) -> None:
    """``relearn`` saves beside ``out_dir`` and then renames the old run aside and the new one in. A failure between
    the two renames puts the old run back; a kill there (simulated: the renaming back fails too) leaves no ``out_dir``
    but the old run whole aside. Either way the new run is whole at ``NAME.tmp`` and the next call puts it in place
    without training again."""
    tokenizer, path = tiny_checkpoint
    forget = make_records(8, seed=22)
    kwargs = dict(lr=3e-3, batch_size=4, grad_accum=1, progress=False, device="cpu")
    out = relearn(path, forget, tokenizer, tmp_path / "relearned", seed=1, **kwargs)
    old_weights = (out / "model.safetensors").read_bytes()
    staged = tmp_path / "relearned.tmp"
    rename = os.rename

    def failing(source, destination):
        putting_back = Path(destination) == out and Path(source).name.startswith(".relearned.old-")
        if Path(source) == staged or (putting_back and failure == "killed between the renames"):
            raise OSError("simulated failure between the two renames")
        rename(source, destination)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="simulated failure"):
        relearn(path, forget, tokenizer, out, seed=2, **kwargs)
    monkeypatch.setattr(os, "rename", rename)
    if failure == "new one not renamed in":
        old = out
    else:
        assert not out.exists()
        (old,) = [p for p in tmp_path.iterdir() if p.name.startswith(".relearned.old-")]
    # a complete folder: the old run whole (its weights, its settings, loadable), the new one whole beside it
    assert json.loads((old / "relearn.json").read_text())["seed"] == 1
    assert (old / "model.safetensors").read_bytes() == old_weights
    assert AutoModelForCausalLM.from_pretrained(old) is not None
    assert json.loads((staged / "relearn.json").read_text())["seed"] == 2
    monkeypatch.setattr("uds_lens.meta_eval.attacks.fit", lambda *a, **k: pytest.fail("trained again"))
    assert relearn(path, forget, tokenizer, out, seed=2, **kwargs) == out
    assert json.loads((out / "relearn.json").read_text())["seed"] == 2
    assert (out / "model.safetensors").read_bytes() != old_weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relearned"]

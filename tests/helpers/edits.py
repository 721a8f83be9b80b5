"""Edits of a copied checkpoint for the tests that need a broken or mismatched one: its weights, its JSON files,
its tokenizer's vocabulary; and a forget set stripped to plain question/answer records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from helpers.tiny import FORGET_SET


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def edit_weights(ckpt: Path, edit) -> Path:
    """``edit(tensors)`` applied to ``ckpt/model.safetensors`` (a dict of name -> tensor, changed in place)."""
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


def edit_json(path: Path, edit) -> None:
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def swap_two_tokens(ckpt: Path) -> Path:
    """The same vocabulary size, another vocabulary: two tokens trade ids."""

    def swap(tokenizer_json):
        vocab = tokenizer_json["model"]["vocab"]
        by_id = {index: token for token, index in vocab.items()}
        vocab[by_id[100]], vocab[by_id[200]] = 200, 100

    edit_json(ckpt / "tokenizer.json", swap)
    return ckpt


def raw_records(path: Path) -> Path:
    """``FORGET_SET`` as plain records (idx, question, answer: no prefix or entity), what ``annotate`` reads."""
    path.write_text(json.dumps([{k: r[k] for k in ("idx", "question", "answer")} for r in FORGET_SET]))
    return path

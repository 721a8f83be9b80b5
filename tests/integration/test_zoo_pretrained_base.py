"""``uds-lens zoo build --base PATH``: a zoo fine-tuned from a given pretrained Llama with that model's tokenizer.

The base here is the test zoo's own 4-layer base (trained from scratch on the synthetic world's retain set, with
the zoo tokenizer): small enough for a CPU, and a checkpoint with its own tokenizer like any pretrained model.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ArchitectureSignature
from uds_lens.checkpoints.digests import model_fingerprint
from uds_lens.checkpoints.loader import load_model, load_tokenizer
from uds_lens.cli import app
from uds_lens.zoo.layout import load_zoo


@pytest.mark.slow
def test_zoo_build_from_a_pretrained_base(test_zoo, tmp_path):
    base = test_zoo.path("base")
    out = tmp_path / "zoo"
    build = [
        "zoo",
        "build",
        "--out",
        str(out),
        "--size",
        "test",
        "--no-pools",
        "--threads",
        "1",
        "--base",
        str(base),
    ]
    result = CliRunner().invoke(app, build)
    assert result.exit_code == 0, result.output
    zoo = load_zoo(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["base"]["source"] == str(base)
    assert {"full", "retain", "retain90", "retain50", "npo"} <= set(zoo.names())
    # The base is taken as given (no training) and every model keeps its architecture and vocabulary.
    assert model_fingerprint(load_model(zoo.path("base"), device="cpu")) == model_fingerprint(
        load_model(base, device="cpu")
    )
    signature = ArchitectureSignature.of_config(Checkpoint.resolve(base).config)
    for name in zoo.names():
        assert ArchitectureSignature.of_config(Checkpoint.resolve(zoo.path(name)).config) == signature, name
    assert load_tokenizer(zoo.tokenizer_path).get_vocab() == load_tokenizer(base).get_vocab()
    # The strict build checks passed: full learned the forget facts, retain did not.
    assert zoo.info("full")["metrics"]["forget_entity_exact"] >= 0.95
    assert zoo.info("retain")["metrics"]["forget_entity_exact"] <= 0.2
    # Resumable: a second build reuses every model.
    again = CliRunner().invoke(app, build)
    assert again.exit_code == 0, again.output
    assert all(entry["reused"] for entry in json.loads((out / "manifest.json").read_text())["models"])

"""The ``smollm2`` zoo size: every model fine-tuned from the real pretrained SmolLM2-135M, here reduced to a few
records and steps so it builds in minutes on a CPU; its ``zoo:smollm2/...`` names score, and the retain ladder's
ends hold (full scores 0, retain 1)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pandas as pd
import pytest
from helpers import pretrained as pretrained_llama
from typer.testing import CliRunner

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.cli import app
from uds_lens.zoo.bases import PRETRAINED_BASES
from uds_lens.zoo.build import build_zoo
from uds_lens.zoo.recipe import SIZES
from uds_lens.zoo.world import generate_world


def _reduced_size():
    """The smollm2 recipe on a few steps: two epochs of fine-tuning, one of unlearning, RMU at one layer."""
    size = SIZES["smollm2"]
    unlearning = {method: {**settings, "epochs": 1} for method, settings in size.unlearning.items()}
    return replace(size, finetune_epochs=2, finetune_lr=1e-3, unlearning=unlearning, rmu_layers=(15,))


@pytest.mark.slow
def test_a_reduced_smollm2_zoo_builds_resumes_and_scores(tmp_path, monkeypatch):
    base = PRETRAINED_BASES["smollm2-135m"]
    if base.gguf_file() is None:
        pytest.skip(f"{base.package} is not installed ({base.install_hint})")
    converted = pretrained_llama.converted_checkpoint(pretrained_llama.cache_root())
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / converted.name).symlink_to(converted)  # the shared conversion, found where the package looks
    monkeypatch.setenv("UDS_LENS_CACHE", str(cache))
    monkeypatch.delenv("UDS_LENS_ZOO", raising=False)
    world = generate_world(10, seed=0, forget_fraction=0.3)
    root = cache / "zoo-smollm2"
    kwargs = dict(
        size=_reduced_size(),
        retain_data=world.retain[:8],
        forget_data=world.forget[:4],
        holdout_data=world.holdout[:4],
        pools=False,
        progress=False,
        strict=False,  # two epochs do not reach the full recipe's accuracy; the scores below say what was learned
    )
    zoo = build_zoo(root, **kwargs)
    assert zoo.manifest["base"]["source"] == "smollm2-135m"
    assert set(zoo.names()) == {
        *("base", "full", "retain", "retain90", "retain50"),
        *("graddiff", "npo", "simnpo", "idknll", "rmu_l15"),
    }
    assert zoo.info("rmu_l15")["hyperparams"]["trained_layers"] == [13, 14, 15]
    # every model is the base's architecture: 30 layers, its tokenizer, a chat template without a BOS it never saw
    for name in zoo.names():
        assert Checkpoint.resolve(zoo.path(name)).config.num_hidden_layers == 30
    assert (
        zoo.info("full")["metrics"]["forget_entity_token"]
        > zoo.info("retain")["metrics"]["forget_entity_token"]
    )
    # resumable: a second build trains nothing
    again = build_zoo(root, **kwargs)
    assert all(entry["reused"] for entry in again.manifest["models"])
    out = tmp_path / "scores"
    models = ["full", "retain"]  # the ladder's ends (each more model scored costs ~20 s here)
    result = CliRunner().invoke(
        app,
        [
            *("score", "--full", "zoo:smollm2/full", "--retain", "zoo:smollm2/retain"),
            *(arg for name in models for arg in ("--unlearned", f"zoo:smollm2/{name}")),
            *("--data", "zoo:smollm2/forget", "--out", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    summaries = {name: json.loads((out / name / "summary.json").read_text()) for name in models}
    assert summaries["full"]["n_scored"] >= 1  # full learned something retain lacks: Stage 1 has KE layers
    assert summaries["full"]["uds"] == pytest.approx(0.0, abs=1e-6)
    assert summaries["retain"]["uds"] == pytest.approx(1.0, abs=1e-6)
    layers = pd.read_csv(out / "full" / "layers.csv")
    assert layers["layer"].nunique() == 30
    shutil.rmtree(root)  # ten 135M models, 5 GB: not left in pytest's kept temporary folders

"""Checkpoints that ship their own code or pickles, or are damaged (issue 27), on the tiny checkpoints: a
checkpoint's own Python code (an ``auto_map`` config or tokenizer) never runs and no "run it? [y/N]" prompt is shown,
a pickled-only checkpoint is refused, a missing shard and a corrupt header are one-line errors. Each test failed on
the code before the issue."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from uds_lens.checkpoints import loader
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.cli import main

ROOT = Path(__file__).resolve().parents[2]


MARKER_CODE = """from pathlib import Path
Path({marker!r}).write_text("ran")
"""


def _custom_config_checkpoint(tiny, root: Path) -> tuple[Path, Path]:
    """A checkpoint whose config.json asks for its own configuration class (``auto_map``) of an unknown type."""
    ckpt, marker = root / "custom_config", root / "config_code_ran"
    shutil.copytree(tiny.full, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="xllama", auto_map={"AutoConfig": "configuration_x.XConfig"})
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "configuration_x.py").write_text(
        MARKER_CODE.format(marker=str(marker))
        + "from transformers import LlamaConfig\n\nclass XConfig(LlamaConfig):\n    model_type = 'xllama'\n"
    )
    return ckpt, marker


def _custom_tokenizer_checkpoint(tiny, root: Path) -> tuple[Path, Path]:
    """A Llama checkpoint whose tokenizer_config.json asks for its own tokenizer class (``auto_map``)."""
    ckpt, marker = root / "custom_tokenizer", root / "tokenizer_code_ran"
    shutil.copytree(tiny.full, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.update(
        tokenizer_class="XTokenizer", auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    )
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    (ckpt / "tokenization_x.py").write_text(
        MARKER_CODE.format(marker=str(marker))
        + "from transformers import PreTrainedTokenizerFast\n\nclass XTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    return ckpt, marker


@pytest.mark.parametrize("which", ["config", "tokenizer"])
def test_a_checkpoints_own_code_never_runs_and_no_prompt_is_shown(tiny, tmp_path, monkeypatch, capsys, which):
    """transformers asks "run the custom code? [y/N]" through input() when trust_remote_code is unset, on a
    terminal or not; here input() would answer y and must never be called."""
    make = _custom_config_checkpoint if which == "config" else _custom_tokenizer_checkpoint
    ckpt, marker = make(tiny, tmp_path)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(
        sys,
        "argv",
        ["uds-lens", "score", "--full", str(ckpt), "--retain", str(tiny.retain), "--unlearned",
         str(tiny.unlearned), "--data", str(tiny.data), "--out", str(tmp_path / "out"),
         "--cache-dir", str(tmp_path / "cache")],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert not marker.exists() and asked == []
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert str(ckpt) in err and "code" in err


@pytest.mark.slow  # a whole CLI process (a minute on a busy 2-core machine); the in-process test above is fast
def test_a_custom_code_checkpoint_with_y_on_stdin_runs_nothing(tiny, tmp_path):
    """The same through a real process whose stdin (a pipe, not a terminal) says y."""
    ckpt, marker = _custom_config_checkpoint(tiny, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", "from uds_lens.cli import main; main()", "score", "--full", str(ckpt),
         "--no-retain", "--unlearned", str(tiny.unlearned), "--data", str(tiny.data),
         "--out", str(tmp_path / "out")],
        input="y\n" * 20, capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
             "HF_MODULES_CACHE": str(tmp_path / "modules")},
    )  # fmt: skip
    assert not marker.exists()
    assert proc.returncode == 2, proc.stderr
    assert "[y/N]" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


class _Payload:
    """Unpickling this would run a shell command (torch's weights_only unpickler refuses it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_only_checkpoint_is_a_one_line_refusal(tiny, tmp_path, monkeypatch, capsys):
    ckpt, marker = tmp_path / "pickled", tmp_path / "pickle_ran"
    ckpt.mkdir()
    shutil.copy(tiny.full / "config.json", ckpt / "config.json")
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, ckpt / "pytorch_model.bin")
    monkeypatch.setattr(
        sys,
        "argv",
        ["uds-lens", "score", "--full", str(tiny.full), "--retain", str(tiny.retain), "--unlearned",
         str(ckpt), "--data", str(tiny.data), "--out", str(tmp_path / "out"),
         "--cache-dir", str(tmp_path / "cache")],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and not marker.exists()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert str(ckpt) in err and "safetensors" in err


def test_a_missing_shard_and_a_corrupt_header_are_one_line_errors(tiny, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny.full, sharded)
    (
        sharded / "model.safetensors"
    ).unlink()  # the index is the model now, and names a shard that is not there
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match="missing weight shard") as error:
        loader.load_model(sharded, device="cpu")
    assert "\n" not in str(error.value)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny.full, corrupt)
    weights = corrupt / "model.safetensors"
    content = bytearray(weights.read_bytes())
    content[8:16] = b"\xff" * 8  # the JSON header no longer parses
    weights.write_bytes(bytes(content))
    with pytest.raises(ModelLoadError, match="not readable safetensors") as error:
        loader.load_model(corrupt, device="cpu")
    assert "\n" not in str(error.value) and str(corrupt) in str(error.value)

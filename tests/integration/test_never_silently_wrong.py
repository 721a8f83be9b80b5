"""Never silently wrong, part two (issue 27), end to end on the tiny checkpoints: a tampered S1 cache, checkpoints
that ship their own code or pickles, result directories of other runs, sweep exit status and values, Unicode
normalisation, and the CLI's small promises (every dtype in --help, NAME=PATH with '=', line-buffered output)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from uds_lens.checkpoints import loader
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import load_tokenizer
from uds_lens.cli import _unlearned_models, app, main
from uds_lens.data import SKIP_ENTITY_NOT_FOUND, Example, encode_one
from uds_lens.plotting.report import write_report
from uds_lens.scoring import score_models
from uds_lens.stage_cache import StageOne
from uds_lens.sweep.driver import sweep as run_sweep
from uds_lens.sweep.lists import SweepError, resolve_models

ROOT = Path(__file__).resolve().parents[2]


def _score(tiny, out, cache, retain=None, force=False, names=("u",)):
    return score_models(
        tiny.full,
        tiny.retain if retain is None else retain,
        {name: tiny.unlearned for name in names},
        tiny.data,
        out_dir=out,
        cache_dir=cache,
        progress=False,
        force=force,
    )


def _cache_file(cache: Path) -> Path:
    (path,) = cache.glob("s1_*.safetensors")
    return path


def _shift_s1(path: Path, shift: float, fix_digest: bool) -> None:
    """Shift the cached S1 scores by ``shift`` keeping the header (and, with ``fix_digest``, re-sign it so that the
    cache stays self-consistent: a wrong cache no digest can tell from a right one)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["s1"] = tensors["s1"] + shift
    if fix_digest:
        from uds_lens.stage_cache import stage_digest

        header = json.loads(metadata["uds_lens"])
        header["digest"] = stage_digest(
            StageOne(
                idx=header["idx"],
                s0=tensors["s0"],
                baseline=tensors["baseline"],
                s1=tensors["s1"],
                batches=header["batches"],
            )
        )
        metadata["uds_lens"] = json.dumps(header)
    save_file(tensors, str(path), metadata=metadata)


def test_a_tampered_s1_cache_is_rebuilt_and_never_gives_a_wrong_uds(tiny, tmp_path):
    cache = tmp_path / "cache"
    truth = _score(tiny, tmp_path / "first", cache)["u"].uds
    _shift_s1(_cache_file(cache), -5.0, fix_digest=False)  # scores shifted, header intact
    with pytest.warns(UserWarning, match="digest"):
        again = _score(tiny, tmp_path / "second", cache)["u"]
    assert again.uds == truth
    assert not again.meta["timings"]["s1_cached"]


def test_a_repaired_cache_invalidates_results_computed_from_a_bad_one(tiny, tmp_path, caplog):
    cache, out = tmp_path / "cache", tmp_path / "out"
    truth = _score(tiny, tmp_path / "reference", cache)["u"].uds
    good = _cache_file(cache).read_bytes()
    _shift_s1(_cache_file(cache), -5.0, fix_digest=True)  # wrong but self-consistent
    wrong = _score(tiny, out, cache)["u"].uds
    assert wrong != pytest.approx(truth)
    _cache_file(cache).write_bytes(good)  # repaired
    with caplog.at_level(logging.WARNING, logger="uds_lens.auditor"):
        again = _score(tiny, out, cache)["u"]
    assert again.uds == truth and "reused" not in again.meta
    assert "Stage 1 values" in again.meta["recomputed"] and "Stage 1 values" in caplog.text
    assert json.loads((out / "u" / "summary.json").read_text())["uds"] == truth


# -- checkpoint code and pickles ------------------------------------------------------------------------------


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


# -- result directories of other runs ---------------------------------------------------------------------


def test_another_runs_result_is_refused_naming_what_differs_unless_forced(tiny, tmp_path):
    from uds_lens.result_store import OutputConflictError

    out, cache = tmp_path / "out", tmp_path / "cache"
    first = _score(tiny, out, cache)["u"]
    saved = (out / "u" / "summary.json").read_text()
    with pytest.raises(OutputConflictError, match="retain differs") as error:
        _score(tiny, out, cache, retain=tiny.unlearned)
    assert "--force" in str(error.value) and str(out / "u") in str(error.value)
    assert (out / "u" / "summary.json").read_text() == saved  # untouched
    forced = _score(tiny, out, cache, retain=tiny.unlearned, force=True)["u"]
    assert forced.uds != first.uds
    assert json.loads((out / "u" / "summary.json").read_text())["uds"] == forced.uds


def test_a_rerun_that_recomputes_says_which_file_failed(tiny, tmp_path, caplog):
    out, cache = tmp_path / "out", tmp_path / "cache"
    _score(tiny, out, cache)
    examples = out / "u" / "examples.csv"
    examples.write_text(examples.read_text().replace("scored", "no_ke", 1))
    with caplog.at_level(logging.WARNING, logger="uds_lens.auditor"):
        again = _score(tiny, out, cache)["u"]
    assert "recomputing u: examples.csv does not belong" in caplog.text
    assert again.meta["recomputed"].startswith("examples.csv")


# -- sweeps -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sweep.csv", "sweep_eval.json", "published_scatter.html", "Sweep.CSV"])
def test_sweep_names_that_are_the_sweeps_own_files_are_refused(tiny, tmp_path, name):
    with pytest.raises(SweepError, match="own files"):
        resolve_models({name: str(tiny.unlearned)})
    with pytest.raises(SweepError, match="own files"):
        run_sweep(
            tiny.full, tiny.retain, tiny.data, tmp_path / "out", {name: str(tiny.unlearned)}, use_ray=False
        )
    assert not (tmp_path / "out" / "sweep.csv").exists()


def test_a_sweep_with_failed_rows_exits_non_zero_with_its_table_written(tiny, tmp_path):
    out = tmp_path / "out"
    model_list = tmp_path / "models.csv"
    model_list.write_text(f"u,{tiny.unlearned}\nbroken,{tmp_path / 'no_such_checkpoint'}\n")
    argv = ["sweep", "--full", str(tiny.full), "--retain", str(tiny.retain), "--data", str(tiny.data),
            "--out", str(out), "--models", str(model_list), "--workers", "1",
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1, result.output
    table = pd.read_csv(out / "sweep.csv")
    assert dict(zip(table["name"], table["status"], strict=True)) == {"u": "scored", "broken": "failed"}


def test_sweep_csv_holds_the_saved_results_own_values_when_reused(tiny, tmp_path):
    out = tmp_path / "out"
    for status in ("scored", "reused"):
        run_sweep(tiny.full, tiny.retain, tiny.data, out, {"u": str(tiny.unlearned)}, use_ray=False,
                  cache_dir=tmp_path / "cache", progress=False)  # fmt: skip
        row = pd.read_csv(out / "sweep.csv").set_index("name").loc["u"]
        summary = json.loads((out / "u" / "summary.json").read_text())
        assert row["status"] == status
        assert row["uds"] == summary["uds"]  # exactly: not recomputed from the rounded layers.csv
        assert [row["ci_low"], row["ci_high"]] == summary["ci95"]


def test_a_sweep_into_another_runs_results_is_refused_before_any_model_loads(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _score(tiny, out, tmp_path / "cache")
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SweepError, match="retain differs"):
        run_sweep(tiny.full, tiny.unlearned, tiny.data, out, {"u": str(tiny.unlearned)}, use_ray=False)


# -- data, CLI ----------------------------------------------------------------------------------------------


def test_entity_and_answer_are_nfc_normalised_and_published_compat_warns(tiny, caplog):
    tokenizer = load_tokenizer(tiny.tokenizer)
    decomposed, precomposed = unicodedata.normalize("NFD", "Café"), unicodedata.normalize("NFC", "Café")
    assert decomposed != precomposed
    example = Example(
        idx=7,
        question="Where did they meet?",
        answer=f"They met at the {precomposed} Lumen.",
        prefix="They met at the",
        entity=f"{decomposed} Lumen",
    )
    encoded = encode_one(example, tokenizer)
    assert not hasattr(encoded, "reason"), encoded
    same = encode_one(Example(**{**example.__dict__, "entity": f"{precomposed} Lumen"}), tokenizer)
    assert encoded == same
    with caplog.at_level(logging.WARNING, logger="uds_lens.data"):
        published = encode_one(example, tokenizer, published_compat=True)
    assert getattr(published, "reason", None) == SKIP_ENTITY_NOT_FOUND  # the published behaviour
    assert "example 7" in caplog.text and "NFC" in caplog.text


def test_help_lists_every_accepted_dtype():
    with pytest.raises(ValueError) as error:
        loader.resolve_dtype("no-such-dtype", "cpu")
    accepted = [
        name
        for name in ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
        if name in str(error.value)
    ]
    assert len(accepted) == 6
    for command in ("score", "sweep"):
        text = " ".join(CliRunner().invoke(app, [command, "--help"], terminal_width=200).output.split())
        for name in accepted:
            assert name in text, (command, name)


def test_an_unlearned_name_may_contain_equals_signs(tiny, tmp_path):
    assert _unlearned_models([f"npo=lr=1e-5={tiny.unlearned}"]) == {"npo=lr=1e-5": str(tiny.unlearned)}
    odd = tmp_path / "lr=1e-5"
    shutil.copytree(tiny.unlearned, odd)
    assert _unlearned_models([str(odd)]) == {"lr=1e-5": str(odd)}
    assert _unlearned_models([f"mine={odd}"]) == {"mine": str(odd)}


def test_cli_output_is_line_buffered_in_a_pipe():
    code = (
        "import sys, uds_lens.cli as cli\n"
        "cli.app = lambda: print(sys.stdout.line_buffering, sys.stderr.line_buffering)\n"
        "cli.main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout.split() == ["True", "True"], proc.stderr


def test_the_report_shows_every_role_in_the_terminal_tables_order(tiny, tmp_path):
    out = tmp_path / "out"
    argv = ["score", "--full", str(tiny.full), "--retain", str(tiny.retain),
            "--unlearned", f"zeta={tiny.unlearned}", "--unlearned", f"alpha={tiny.full}",
            "--unlearned", f"mid={tiny.retain}", "--data", str(tiny.data), "--out", str(out),
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    terminal = [
        line.split()[0]
        for line in result.output.splitlines()
        if line.split()[:1] in (["zeta"], ["alpha"], ["mid"])
    ]
    assert terminal == ["zeta", "alpha", "mid"]
    page = write_report(out).read_text()
    rows = [(name, page.index(f"<td>{name}</td>")) for name in terminal]
    assert [name for name, _ in sorted(rows, key=lambda row: row[1])] == terminal
    for name, role in (("zeta", "unlearned"), ("alpha", "full"), ("mid", "retain")):
        start = page.index(f"<td>{name}</td>")
        assert page[start : page.index("</tr>", start)].count(f"<td>{role}</td>") == 1, name

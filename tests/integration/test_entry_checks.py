"""Values checked where they enter (issues 36 and 49), on the tiny checkpoints: a number that would not be what it says
(a tuned lens of 0 steps, a negative or NaN tau through ``with_tau``), a type the Python API cannot use (``data=42``,
``config={...}``, ``cache_dir=1``) and inputs that ended in a traceback (data that is not UTF-8 or not JSON, an idx of
5,000 digits, a model list in Latin-1 or with a byte-order mark, an empty registry, token ids past the embedding, a
site diagnose does not patch) are refused in one line naming the input and the fix, in the API as in the CLI, before
any model loads. Each test failed on the code before the issue that added it."""

from __future__ import annotations

import inspect
import json
import math
import shutil
from pathlib import Path

import pytest
from helpers.cli import one_line_error
from helpers.edits import raw_records
from helpers.refusals import forbid_model_loading
from helpers.tiny import FORGET_SET
from transformers import AutoTokenizer

from uds_lens.analysis.diagnose import diagnose
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints import loader
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.config import ConfigError, UDSConfig
from uds_lens.data import DataError, TokenizerError, load_examples
from uds_lens.inputs import RunInputs
from uds_lens.result_store import ResultNameError
from uds_lens.scoring import score_models
from uds_lens.sweep.lists import SweepError, load_registry, read_model_list


def _records_file(path: Path, records) -> Path:
    path.write_text(json.dumps(records))
    return path


def _diagnose_argv(tiny, tmp_path: Path, *options: object) -> list[object]:
    return ["diagnose", "--full", tiny.full, "--retain", tiny.retain, "--unlearned", tiny.unlearned,
            "--data", tiny.data, "--out", tmp_path / "d", *options]  # fmt: skip


# -- numbers that would not be what they say -------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, -1])
def test_a_tuned_lens_of_no_training_step_is_refused(tiny, tmp_path, monkeypatch, capsys, steps):
    """Before: 0 (or -1) steps reported the untrained lens, the logit lens exactly, as the tuned lens."""
    forbid_model_loading(monkeypatch)
    line = one_line_error(
        monkeypatch,
        capsys,
        *_diagnose_argv(tiny, tmp_path, "--tuned-lens-steps", steps, "--calibration", tiny.data),
    )
    assert f"--tuned-lens-steps) must be a positive integer, got {steps}" in line
    with pytest.raises(ConfigError, match="tuned_lens_steps"):
        diagnose(tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, tuned_lens_steps=steps,
                 calibration=tiny.data)  # fmt: skip


@pytest.fixture(scope="module")
def result(tiny):
    return UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False).score(
        tiny.unlearned
    )


@pytest.mark.parametrize("tau", [-1.0, math.nan, math.inf])
def test_with_tau_refuses_what_the_config_and_the_cli_refuse_in_their_words(result, tau):
    """Before: ``with_tau(-1)`` returned a UDS of 0.985 and ``with_tau(nan)`` NaN; UDSConfig refused both."""
    with pytest.raises(ConfigError) as from_config:
        UDSConfig(tau=tau)
    with pytest.raises(ConfigError) as from_result:
        result.with_tau(tau)
    assert str(from_result.value) == str(from_config.value)
    assert result.with_tau(0.1).settings["tau"] == 0.1  # a valid tau still rescored


def test_the_cli_refuses_a_negative_tau_in_the_same_words(tiny, tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError) as from_config:
        UDSConfig(tau=-1.0)
    line = one_line_error(monkeypatch, capsys, "score", "--full", tiny.full, "--retain", tiny.retain,
                          "--unlearned", tiny.unlearned, "--data", tiny.data, "--out", tmp_path / "o", "--tau", "-1")  # fmt: skip
    assert line == f"error: {from_config.value}"


# -- types through the Python API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "error", "message"),
    [
        ({"data": 42}, DataError, "data must be a forget-set file"),
        (
            {"config": {"tau": 0.1}},
            ConfigError,
            r"config must be a UDSConfig, got a dict .*UDSConfig\(\*\*settings\)",
        ),
        ({"cache_dir": 1}, ConfigError, r"cache_dir \(--cache-dir\) must be a directory path"),
    ],
)
def test_wrong_types_through_the_api_are_one_line_before_any_model_loads(
    tiny, monkeypatch, given, error, message
):
    """Before: ``TypeError: 'int' object is not iterable``, ``AttributeError: 'dict' object has no attribute
    'with_stage2_cells'``, ``TypeError: expected str, bytes or os.PathLike object, not int``."""
    forbid_model_loading(monkeypatch)
    arguments = {"data": tiny.data, **given}
    # The suite's run-time type checker answers a wrong type first, in its own words; a user's Python has none
    # and reaches the functions themselves, as these calls do (the door, RunInputs.resolve, unwrapped too).
    monkeypatch.setattr(RunInputs, "resolve", classmethod(inspect.unwrap(RunInputs.resolve.__func__)))
    with pytest.raises(error, match=message) as raised:
        inspect.unwrap(score_models)(tiny.full, tiny.retain, [tiny.unlearned], progress=False, **arguments)
    assert "\n" not in str(raised.value)
    with pytest.raises(error, match=message):
        inspect.unwrap(UDSAuditor.__init__)(object.__new__(UDSAuditor), tiny.full, tiny.retain, progress=False,
                                            **arguments)  # fmt: skip


# -- inputs that ended in a traceback --------------------------------------------------------------------------


def test_data_errors_are_one_line_before_any_model_loads(tiny, tmp_path, monkeypatch, capsys):
    forbid_model_loading(monkeypatch)
    big_idx = _records_file(tmp_path / "big.json", [dict(FORGET_SET[0], idx=2**63), *FORGET_SET[1:]])
    huge_idx = tmp_path / "huge.json"  # more digits than Python converts: json.loads raises ValueError
    huge_idx.write_text(
        json.dumps(FORGET_SET).replace(f'"idx": {FORGET_SET[0]["idx"]},', '"idx": ' + "9" * 5000 + ",", 1)
    )
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(json.dumps([dict(FORGET_SET[0], answer="Hsiao was born in París.")], ensure_ascii=False)
                       .encode("latin-1"))  # fmt: skip
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    lines = [json.dumps(record) for record in FORGET_SET]
    lines[3] = lines[3][:-5]
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    expected = {
        big_idx: "does not fit a 64-bit integer",
        huge_idx: "Exceeds the limit (4300 digits)",
        latin1: "is not UTF-8",
        nested: "nests JSON deeper",
        jsonl: "line 4, column",
    }
    for data, message in expected.items():
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_examples(data)
        err = one_line_error(monkeypatch, capsys, "score", "--full", tiny.full, "--retain", tiny.retain,
                             "--unlearned", tiny.unlearned, "--data", data, "--out", tmp_path / "out")  # fmt: skip
        assert message in err


def test_a_forget_set_with_a_byte_order_mark_is_read(tmp_path):
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps(FORGET_SET).encode("utf-8"))
    assert [e.idx for e in load_examples(marked)] == [r["idx"] for r in FORGET_SET]


def test_model_lists_and_registries_that_ended_in_a_traceback_are_one_line(
    tiny, tmp_path, monkeypatch, capsys
):
    """Before: a UnicodeDecodeError for a Latin-1 list, pandas' EmptyDataError for an empty registry."""
    latin1 = tmp_path / "models.csv"
    latin1.write_bytes(f"café,{tiny.unlearned}\n".encode("latin-1"))
    empty = tmp_path / "registry.csv"
    empty.write_text("")
    with pytest.raises(SweepError, match="is not UTF-8"):
        read_model_list(latin1)
    with pytest.raises(SweepError, match="not a CSV table"):
        load_registry(empty)
    forbid_model_loading(monkeypatch)
    sweep = ["sweep", "--full", tiny.full, "--retain", tiny.retain, "--data", tiny.data, "--workers", "1"]
    assert "not UTF-8" in one_line_error(
        monkeypatch, capsys, *sweep, "--out", tmp_path / "a", "--models", latin1
    )
    assert "not a CSV table" in one_line_error(
        monkeypatch, capsys, *sweep, "--out", tmp_path / "b", "--registry", empty
    )


def test_a_model_list_with_a_byte_order_mark_does_not_score_its_header(tiny, tmp_path):
    """Before: the mark glued itself to the header's first cell, so `name,path` was not seen as a header and
    became a model to score."""
    listed = tmp_path / "models.csv"
    listed.write_bytes(("\ufeffname,path\n" + f"u,{tiny.unlearned}\n").encode("utf-8"))
    assert [(entry.name, entry.source) for entry in read_model_list(listed)] == [("u", str(tiny.unlearned))]


def test_token_ids_past_the_embedding_are_one_line_before_stage_1(tiny, tmp_path, monkeypatch, capsys):
    """A tokenizer with tokens added past the model's vocabulary. Before: an IndexError deep in the embedding, 193
    lines of traceback (``annotate`` already said it in one line; the check is now shared)."""
    folder = tmp_path / "checkpoints"
    tokenizer = AutoTokenizer.from_pretrained(tiny.full)
    tokenizer.add_tokens(["Qzxv"])
    assert len(tokenizer) > Checkpoint.resolve(tiny.full).config.vocab_size  # past the embedding
    for name in ("full", "retain", "unlearned"):
        shutil.copytree(getattr(tiny, name), folder / name)
        tokenizer.save_pretrained(folder / name)
    data = _records_file(
        tmp_path / "forget.json", [dict(FORGET_SET[0], answer=FORGET_SET[0]["answer"] + " Qzxv")]
    )
    monkeypatch.setattr(UDSAuditor, "_compute_stage1", lambda self: pytest.fail("Stage 1 was computed"))
    line = one_line_error(monkeypatch, capsys, "score", "--full", folder / "full", "--retain", folder / "retain",
                          "--unlearned", folder / "unlearned", "--data", data, "--out", tmp_path / "out",
                          "--cache-dir", tmp_path / "cache")  # fmt: skip
    assert "vocabulary has" in line and "encode to id" in line
    with pytest.raises(TokenizerError, match="encode to id"):
        UDSAuditor(folder / "full", folder / "retain", data, cache_dir=False, progress=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["annotate", "--retain", "{retain}", "--batch-size", "0", "--out", "{tmp}/a.json"], "--batch-size"),
        (["diagnose", "--methods", "bogus"], "--methods must be one of"),
        (["diagnose", "--sites", "bogus"], "--sites must be one of"),
        (
            ["diagnose", "--sites", "resid_pre"],
            "--sites must be one of attn_out, mlp_out, resid_mid, resid_post",
        ),
        (["report", "{tmp}", "--out", "{tmp}"], "is a directory"),
    ],
)
def test_option_values_are_refused_in_one_line_before_any_model_loads(
    tiny, tmp_path, monkeypatch, capsys, argv, message
):
    """diagnose --sites resid_pre (a UDS site, not one component patching runs) was a traceback on 34971a7."""
    forbid_model_loading(monkeypatch)
    data = raw_records(tmp_path / "raw.json")
    if argv[0] == "diagnose":
        argv = [
            *argv,
            "--full",
            "{full}",
            "--retain",
            "{retain}",
            "--unlearned",
            "{full}",
            "--out",
            "{tmp}/d",
        ]
    argv = [*argv, "--data", str(data)] if argv[0] != "report" else argv
    filled = [a.format(tmp=tmp_path, full=tiny.full, retain=tiny.retain) for a in argv]
    assert message in one_line_error(monkeypatch, capsys, *filled)


@pytest.mark.parametrize("name", ["roles.json", "n" * 250])
def test_result_names_the_output_directory_cannot_hold_are_refused(tiny, tmp_path, monkeypatch, name):
    """Before (issue 36): roles.json failed after compute (and every later score into that --out); a 250-byte name
    too."""
    forbid_model_loading(monkeypatch)
    with pytest.raises(ResultNameError):
        score_models(tiny.full, tiny.retain, {name: tiny.unlearned}, tiny.data, out_dir=tmp_path / "out")


def test_device_cuda_on_a_cpu_only_torch_says_so(tiny, monkeypatch):
    """Before (issue 36): "check that it is a complete checkpoint, or re-download it"."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="asks for a GPU.*--device cpu"):
        loader.load_model(tiny.full, device="cuda")


def test_evaluate_on_a_zoo_missing_a_model_names_the_directory(tmp_path, monkeypatch, capsys):
    """Before (issue 36): the missing directory was looked up on the hub, retried for 32 s."""
    zoo = tmp_path / "zoo"
    (zoo / "models" / "full").mkdir(parents=True)
    (zoo / "manifest.json").write_text(
        json.dumps(
            {"models": [{"name": "full", "path": "models/full"}, {"name": "npo", "path": "models/npo"}]}
        )
    )
    err = one_line_error(monkeypatch, capsys, "evaluate", "--zoo", zoo, "--out", tmp_path / "out")
    assert f"npo ({zoo / 'models' / 'npo'})" in err

"""Never silently wrong, part three (issue 36), on the tiny checkpoints: weights that do not cover their model,
models of another family or tokenizer, outputs that would destroy what they do not own, memory bombs, and inputs
that used to end in a traceback (often after the models had run). Each test fails on the code before the issue."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers.families import build_family, family_configs
from helpers.tiny import FORGET_SET, make_tiny_llama, make_tiny_tokenizer
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from uds_lens import annotation
from uds_lens.analysis.diagnose import DiagnoseResult
from uds_lens.annotation import annotate
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints import loader
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ArchitectureSignature, ModelMismatchError
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.cli import main
from uds_lens.config import ConfigError
from uds_lens.data import DataError, load_examples
from uds_lens.inputs import RunInputs
from uds_lens.result_store import OutputConflictError, ResultNameError
from uds_lens.results import UDSResult
from uds_lens.scoring import score_models

DROPPED = "model.layers.2.mlp.down_proj.weight"


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _edit_weights(ckpt: Path, edit) -> Path:
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


def _edit_json(path: Path, edit) -> None:
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def _score(tiny, tmp_path, **models_given):
    arguments = {"full": tiny.full, "retain": tiny.retain, "unlearned": {"u": tiny.unlearned}, **models_given}
    return score_models(
        arguments["full"],
        arguments["retain"],
        arguments["unlearned"],
        tiny.data,
        out_dir=tmp_path / "out",
        cache_dir=tmp_path / "cache",
        progress=False,
    )


def _no_compute(monkeypatch):
    """Any Stage 1 computation fails the test: a refusal must come before it."""
    monkeypatch.setattr(UDSAuditor, "_compute_stage1", lambda self: pytest.fail("Stage 1 was computed"))


def _cli(monkeypatch, capsys, *argv: str) -> str:
    """Run the console entry point; it must exit 2 with one line on stderr and no traceback. Returns that line."""
    monkeypatch.setattr(sys, "argv", ["uds-lens", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# -- 1. weights that do not cover the model -------------------------------------------------------------------


def test_a_checkpoint_missing_a_weight_is_refused_naming_the_tensor(tiny, tmp_path, monkeypatch):
    """Before: transformers initialised the tensor at random and every run gave another UDS."""
    missing = _edit_weights(_copy(tiny.unlearned, tmp_path / "missing"), lambda t: t.pop(DROPPED))
    with pytest.raises(ModelLoadError, match=DROPPED.replace(".", r"\.")) as error:
        loader.load_model(missing, device="cpu")
    assert "\n" not in str(error.value) and "random" in str(error.value)
    _no_compute(monkeypatch)
    with pytest.raises(
        ModelMismatchError, match=f"full's weight files lack {DROPPED}"
    ):  # as full: before Stage 1
        _score(tiny, tmp_path, full=missing)
    with pytest.raises(ModelMismatchError, match=f"lack {DROPPED}"):  # as unlearned: found before Stage 1 too
        _score(tiny, tmp_path, unlearned={"u": missing})


def test_a_checkpoint_with_a_tensor_its_model_has_no_place_for_is_refused(tiny, tmp_path):
    extra = _edit_weights(
        _copy(tiny.unlearned, tmp_path / "extra"),
        lambda t: t.update({"model.layers.3.mlp.down_proj.weight": t[DROPPED].clone()}),
    )
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.mlp\.down_proj\.weight.*no place"):
        loader.load_model(extra, device="cpu")


def test_a_config_of_a_billion_layers_is_refused_before_the_model_is_built(tiny, tmp_path, monkeypatch):
    """Before: transformers built it (gigabytes, growing, for minutes)."""
    bomb = _copy(tiny.unlearned, tmp_path / "bomb")
    _edit_json(bomb / "config.json", lambda c: c.update(num_hidden_layers=1_000_000_000))
    built = []
    monkeypatch.setattr(
        "transformers.LlamaForCausalLM.__init__", lambda *a, **k: built.append(1) or pytest.fail("built")
    )
    with pytest.raises(ModelLoadError, match="1000000000 layers.*weight files hold"):
        loader.load_model(bomb, device="cpu")
    with pytest.raises(ModelLoadError, match="does not belong to these weights"):
        _score(tiny, tmp_path, unlearned={"u": bomb})  # found with the other checkpoints, before any load
    assert not built


def test_a_model_larger_than_the_free_memory_is_refused_before_it_is_built(tiny, monkeypatch):
    monkeypatch.setattr("uds_lens.memory.available_memory_bytes", lambda device: 1000)
    with pytest.raises(ModelLoadError, match="GiB are free"):
        loader.load_model(tiny.unlearned, device="cpu")


# -- 2. models of another family or tokenizer -----------------------------------------------------------------


def _swap_two_tokens(ckpt: Path) -> Path:
    """The same vocabulary size, another vocabulary: two tokens trade ids."""

    def swap(tokenizer_json):
        vocab = tokenizer_json["model"]["vocab"]
        by_id = {index: token for token, index in vocab.items()}
        vocab[by_id[100]], vocab[by_id[200]] = 200, 100

    _edit_json(ckpt / "tokenizer.json", swap)
    return ckpt


@pytest.mark.parametrize("role", ["unlearned", "retain"])
def test_a_tokenizer_of_the_same_size_but_another_vocabulary_is_refused(tiny, tmp_path, monkeypatch, role):
    """Before: only the vocabulary size was compared, and such a model scored a plausible UDS."""
    other = _swap_two_tokens(_copy(tiny.unlearned, tmp_path / "other_tokenizer"))
    _no_compute(monkeypatch)
    given = {"unlearned": {"u": other}} if role == "unlearned" else {"retain": other}
    with pytest.raises(ModelMismatchError, match="vocabularies differ.*2 tokens have another id") as error:
        _score(tiny, tmp_path, **given)
    assert str(other) in str(error.value) and "\n" not in str(error.value)


def test_another_end_of_text_token_is_refused_and_other_tokenizer_metadata_is_not(tiny, tmp_path):
    other_eos = _copy(tiny.unlearned, tmp_path / "other_eos")
    _edit_json(other_eos / "tokenizer_config.json", lambda c: c.update(eos_token="<|pad|>"))
    with pytest.raises(ModelMismatchError, match="eos_token differs"):
        RunInputs.resolve(tiny.full, tiny.retain, tiny.data, {"u": other_eos})
    # metadata that does not change what an id means: a maximum length, a chat template
    metadata = _copy(tiny.unlearned, tmp_path / "metadata")
    _edit_json(
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


# -- 3. annotate reads every record with each model's own tokenizer, or refuses ----------------------------------


def _raw_records(path: Path) -> Path:
    path.write_text(json.dumps([{k: r[k] for k in ("idx", "question", "answer")} for r in FORGET_SET]))
    return path


def test_annotate_refuses_a_retain_model_of_another_tokenizer(tiny, tmp_path):
    """Before: the full model's ids were fed to the retain model (wrong spans, or an IndexError)."""
    other = _swap_two_tokens(_copy(tiny.retain, tmp_path / "other_tokenizer"))
    smaller = tmp_path / "smaller"
    make_tiny_tokenizer(chat_template=False, vocab_size=300).save_pretrained(smaller / "tokenizer")
    small_vocabulary = make_tiny_llama(smaller / "model", smaller / "tokenizer", 5, **tiny.RECIPE)
    data = _raw_records(tmp_path / "raw.json")
    for retain in (other, small_vocabulary):
        with pytest.raises(ModelMismatchError, match="another tokenizer"):
            annotate(data, tiny.full, retain, device="cpu")


def test_annotate_cuts_a_long_record_to_the_models_context(tiny, tmp_path, monkeypatch):
    """Before: a 2,000-word answer was run whole (and a batch padded to it), past the model's context."""
    n_ctx = Checkpoint.resolve(tiny.retain).config.max_position_embeddings
    long_answer = " ".join(["Hsiao was born in Paris and wrote many books about the river."] * 200)
    records = [{"idx": 0, "question": "Where was Hsiao born?", "answer": long_answer}]
    widths = []
    original = annotation._answer_token_logprobs

    def spy(model, sequences, pad_id, batch_size):
        widths.extend(len(ids) for ids, _ in sequences)
        return original(model, sequences, pad_id, batch_size)

    monkeypatch.setattr(annotation, "_answer_token_logprobs", spy)
    result = annotate(records, None, tiny.retain, device="cpu")
    assert widths and max(widths) <= n_ctx
    assert len(AutoTokenizer.from_pretrained(tiny.retain)(long_answer)["input_ids"]) > n_ctx  # not vacuous
    assert result.records[0]["annotation_status"] in annotation.STATUSES


# -- 4-6. outputs never destroy what they do not own ----------------------------------------------------------


def test_diagnose_beside_a_score_result_keeps_it_whole(tiny, tmp_path):
    """Before: diagnose's save deleted the score result's summary, tables and meta.json."""
    scored = _score(tiny, tmp_path)["u"]
    tables = pd.DataFrame({"method": ["uds"], "layer": [0], "erasure": [0.5], "weight": [1.0]})
    DiagnoseResult(
        scores=pd.DataFrame({"uds": [0.5]}, index=["u"]),
        layerwise={"u": tables},
        components={"u": pd.DataFrame(columns=["site", "layer", "mean_d1", "mean_d2"])},
        uds_results={},
        prompt_types=None,
        tau_sensitivity=None,
    ).save(tmp_path / "out")
    again = UDSResult.load(tmp_path / "out" / "u")  # verifies every file against meta.json
    assert again.uds == scored.uds
    assert (tmp_path / "out" / "u" / "scores.json").is_file()


def test_annotate_never_writes_its_summary_over_its_input_or_a_foreign_file(tmp_path):
    """Before: the summary went to X.summary.json whatever that file was, the --data input included."""
    data = _raw_records(tmp_path / "raw.summary.json")
    before = data.read_bytes()
    with pytest.raises(ConfigError, match="over its input"):
        annotate(data, out=tmp_path / "raw.json")
    assert data.read_bytes() == before
    foreign = tmp_path / "notes.summary.json"
    foreign.write_text("my notes")
    with pytest.raises(ConfigError, match="not an earlier annotate summary"):
        annotate(_raw_records(tmp_path / "in.json"), out=tmp_path / "notes.json")
    assert foreign.read_text() == "my notes"
    annotate(tmp_path / "in.json", out=tmp_path / "again.json")
    annotate(tmp_path / "in.json", out=tmp_path / "again.json")  # an earlier summary is replaced


@pytest.mark.parametrize("where", ["directory", "under_a_file"])
def test_annotate_out_that_cannot_be_a_file_is_refused_before_anything_runs(tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "directory" else tmp_path / "file" / "x.json"
    with pytest.raises(ConfigError, match="is a directory|which is a file"):
        annotate(_raw_records(tmp_path / "raw.json"), out=out)


def test_a_concurrent_run_of_other_inputs_is_refused_at_the_write(tiny, tmp_path, monkeypatch):
    """Two runs writing one NAME: the second checked before the first wrote, and used to replace it silently."""
    cache = tmp_path / "cache"
    first = score_models(
        tiny.full, tiny.retain, {"u": tiny.unlearned}, tiny.data, out_dir=tmp_path / "first", cache_dir=cache,
        progress=False,
    )["u"]  # fmt: skip
    out = tmp_path / "out"
    score = UDSAuditor.score

    def meanwhile(self, model, name=None):  # the first run finishes while this one computes
        result = score(self, model, name)
        shutil.copytree(tmp_path / "first" / "u", out / "u")
        return result

    monkeypatch.setattr(UDSAuditor, "score", meanwhile)
    with pytest.raises(OutputConflictError, match="unlearned differs"):
        score_models(
            tiny.full,
            tiny.retain,
            {"u": tiny.retain},
            tiny.data,
            out_dir=out,
            cache_dir=cache,
            progress=False,
        )
    assert UDSResult.load(out / "u").uds == first.uds


# -- inputs checked before the first model loads, one line each ------------------------------------------------


def _records_file(path: Path, records) -> Path:
    path.write_text(json.dumps(records))
    return path


def test_data_errors_are_one_line_before_any_model_loads(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    big_idx = _records_file(tmp_path / "big.json", [dict(FORGET_SET[0], idx=2**63), *FORGET_SET[1:]])
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
        latin1: "is not UTF-8",
        nested: "nests JSON deeper",
        jsonl: "line 4, column",
    }
    for data, message in expected.items():
        with pytest.raises(DataError, match=message):
            load_examples(data)
        err = _cli(monkeypatch, capsys, "score", "--full", str(tiny.full), "--retain", str(tiny.retain),
                   "--unlearned", str(tiny.unlearned), "--data", str(data), "--out", str(tmp_path / "out"))  # fmt: skip
        assert message in err


@pytest.mark.parametrize("name", ["roles.json", "n" * 250])
def test_result_names_the_output_directory_cannot_hold_are_refused(tiny, tmp_path, monkeypatch, name):
    """Before: roles.json failed after compute (and every later score into that --out); a 250-byte name too."""
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ResultNameError):
        _score(tiny, tmp_path, unlearned={name: tiny.unlearned})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["annotate", "--retain", "{retain}", "--batch-size", "0", "--out", "{tmp}/a.json"], "--batch-size"),
        (["diagnose", "--methods", "bogus"], "--methods must be one of"),
        (["diagnose", "--sites", "bogus"], "--sites must be one of"),
        (["report", "{tmp}", "--out", "{tmp}"], "is a directory"),
    ],
)
def test_option_values_are_refused_in_one_line_before_any_model_loads(
    tiny, tmp_path, monkeypatch, capsys, argv, message
):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    data = _raw_records(tmp_path / "raw.json")
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
    assert message in _cli(monkeypatch, capsys, *filled)


def test_device_cuda_on_a_cpu_only_torch_says_so(tiny, monkeypatch):
    """Before: "check that it is a complete checkpoint, or re-download it"."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="asks for a GPU.*--device cpu"):
        loader.load_model(tiny.full, device="cuda")


def test_evaluate_on_a_zoo_missing_a_model_names_the_directory(tmp_path, monkeypatch, capsys):
    """Before: the missing directory was looked up on the hub, retried for 32 s."""
    zoo = tmp_path / "zoo"
    (zoo / "models" / "full").mkdir(parents=True)
    (zoo / "manifest.json").write_text(
        json.dumps(
            {"models": [{"name": "full", "path": "models/full"}, {"name": "npo", "path": "models/npo"}]}
        )
    )
    err = _cli(monkeypatch, capsys, "evaluate", "--zoo", str(zoo), "--out", str(tmp_path / "out"))
    assert f"npo ({zoo / 'models' / 'npo'})" in err

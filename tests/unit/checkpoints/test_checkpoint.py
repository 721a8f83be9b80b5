"""The door: what a model argument names, made a Checkpoint before any model loads. A missing local path fails at once
and offline, and a hub id whose hub cannot be reached fails after one request (not transformers' five retries), in
one line; the value is passed down as it is and never mistaken for the argument."""

import os
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub.utils
import pytest
import transformers
from helpers.cli import run_cli

from uds_lens.checkpoints import hub as hub_module
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import load_model
from uds_lens.inputs import RunInputs

ROOT = Path(__file__).resolve().parents[3]


class FakeSession:
    """huggingface_hub's HTTP session, counting requests; ``error`` is raised by each (an unreachable hub)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.requests = 0

    def head(self, url, **kwargs):
        self.requests += 1
        if self.error is not None:
            raise self.error


@pytest.fixture
def hub(monkeypatch):
    """The hub as the test sets it (unreachable by default), never the network; no model is loaded from it."""

    def no_loading(*args, **kwargs):
        raise AssertionError("transformers was asked to load a model")

    session = FakeSession(OSError("[Errno -2] Name or service not known"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: session)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    monkeypatch.setattr(hub_module, "_hub_answers", {})
    return session


@pytest.mark.parametrize(
    "spelling", ["ckpt/npo", "./gone/npo", "../gone/npo", "~/no-such-dir-uds-lens/npo", "ABS"]
)
def test_a_missing_local_path_fails_in_under_a_second_with_one_line(
    spelling, tiny, tmp_path, monkeypatch, capsys, hub
):
    """`--unlearned ckpt/npo` next to an existing ckpt/ (or any ./, ../, / or ~ path) that does not exist: the run
    stops before loading full or retain, without a hub request, in one line naming the path."""
    (tmp_path / "work" / "ckpt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    missing = str(tmp_path / "gone" / "npo") if spelling == "ABS" else spelling
    code, err, seconds = run_cli(
        monkeypatch, capsys, "score", "--full", str(tiny.full), "--retain", str(tiny.retain),
        "--unlearned", f"npo={missing}", "--data", str(tiny.data), "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert missing in err and "does not exist" in err
    assert seconds < 1.0, f"{seconds:.2f} s"
    assert hub.requests == 0 and not (tmp_path / "out").exists()


def test_a_missing_path_is_reported_before_the_model_libraries_are_imported(tmp_path):
    """From a shell the failure costs the interpreter's start only: torch and transformers are never imported."""
    (tmp_path / "ckpt").mkdir()
    code = (
        "import sys\n"
        "from uds_lens.cli import main\n"
        "sys.argv = ['uds-lens', 'score', '--full', 'ckpt/full', '--retain', 'ckpt/retain', '--unlearned',"
        " 'ckpt/npo', '--data', 'forget.json', '--out', 'out']\n"
        "try:\n    main()\nexcept SystemExit as stop:\n    assert stop.code == 2, stop.code\n"
        "print(sorted(m for m in ('torch', 'transformers', 'transformer_lens') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert done.stderr.startswith("error: No such checkpoint: ckpt/full") and done.stderr.count("\n") == 1


def test_an_unreachable_hub_is_one_line_after_one_request(hub):
    """A plausible hub id while the hub cannot be reached: one request, then one line that names the id, the local
    path it is not and the fix; the answer is kept, so the next model does not ask again."""
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as error:
        load_model("nobody/no-such-model")
    # one request instead of five retries (34 s before); the bound leaves room for a loaded machine
    assert time.perf_counter() - started < 5.0
    message = str(error.value)
    assert "\n" not in message and "'nobody/no-such-model'" in message and "cannot be reached" in message
    assert "no local path" in message and "Name or service not known" in message
    assert hub.requests == 1
    with pytest.raises(ModelLoadError, match="cannot be reached"):
        Checkpoint.resolve("someone/else").from_pretrained_args()
    assert hub.requests == 1


def test_the_hub_is_asked_only_for_hub_ids_and_a_cached_model_loads_without_it(hub, tiny, monkeypatch):
    for model in (str(tiny.full), tiny.full):
        Checkpoint.resolve(model).from_pretrained_args()  # local checkpoints
    assert hub.requests == 0
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/{name}")
    first, kwargs = Checkpoint.resolve("org/cached").from_pretrained_args()
    assert (
        first == "org/cached" and kwargs["local_files_only"] is True and kwargs["trust_remote_code"] is False
    )
    assert hub.requests == 1
    hub.error = None
    monkeypatch.setattr(hub_module, "_hub_answers", {})
    assert Checkpoint.resolve("org/cached").from_pretrained_args()[1]["local_files_only"] is False
    assert Checkpoint.resolve(tiny.full).from_pretrained_args()[1]["local_files_only"] is True
    assert hub.requests == 2


def test_a_checkpoint_is_a_value_never_mistaken_for_its_argument(tiny):
    """The door hands back a Checkpoint, passed down in the argument's place: it is not a path (os.fspath refuses
    it), it names the checkpoint as the argument did, two spellings of one folder are one checkpoint, and making it
    again returns it as it is."""
    given = str(tiny.full) + "/"
    checkpoint = Checkpoint.resolve(given)
    assert isinstance(checkpoint, Checkpoint) and not isinstance(checkpoint, os.PathLike)
    with pytest.raises(TypeError):
        os.fspath(checkpoint)  # type: ignore[call-overload]
    assert str(checkpoint) == checkpoint.label == given and checkpoint.name == tiny.full.name
    assert (checkpoint.kind, checkpoint.location, checkpoint.path_or_id) == (
        "directory",
        str(tiny.full),
        given,
    )
    assert (
        Checkpoint.resolve(checkpoint) is checkpoint
        and Checkpoint.resolve(checkpoint, weights=False) is checkpoint
    )
    assert Checkpoint.resolve(tiny.full) == checkpoint and hash(Checkpoint.resolve(tiny.full)) == hash(
        checkpoint
    )
    assert checkpoint.fingerprint == "files:" + checkpoint.digest
    with pytest.raises(TypeError, match="retain must be a checkpoint path.*object"):
        Checkpoint.resolve(object(), role="retain")


def test_run_inputs_list_every_location_they_read(tiny, tmp_path):
    """What an output must never overlap: the checkpoints, their weights wherever an index points, the data (the
    S1 cache is not an input: the output checks take it as a cache)."""
    inputs = RunInputs.resolve(
        tiny.full, tiny.retain, tiny.data, {"u": tiny.unlearned}, cache_dir=tmp_path / "s1"
    )
    paths = dict((str(path), what) for what, path in inputs.input_paths())
    assert paths[str(tiny.full)] == "full checkpoint" and paths[str(tiny.retain)] == "retain checkpoint"
    assert paths[str(tiny.unlearned)] == "unlearned u checkpoint"
    assert paths[str(tiny.data)] == "forget set" and str(tmp_path / "s1") not in paths

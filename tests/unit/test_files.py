"""uds_lens/files.py: the SHA-256 digests (their values are stored in results, zoos and notebooks: pinned here) and
the replacement of a directory that leaves a complete one at every moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from uds_lens.files import bytes_digest, files_digest, json_digest, replace_directory

ROOT = Path(__file__).resolve().parents[2]


def test_bytes_digest_is_sha256_of_the_bytes():
    # FIPS 180-2's test vector: the digest anyone gets from ``sha256sum`` of a file holding b"abc"
    assert bytes_digest(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert bytes_digest(b"abc", length=16) == "ba7816bf8f01cfea"


def test_files_digest_hashes_each_name_then_its_bytes_in_order(tmp_path):
    """The zoo's data and tokenizer identity (part of every zoo model's fingerprint): the value older zoos hold."""
    (tmp_path / "forget.json").write_bytes(b'[{"q": 1}]')
    (tmp_path / "retain.json").write_bytes(b"[]\n")
    paths = [tmp_path / "forget.json", tmp_path / "retain.json"]
    assert files_digest(paths, length=16) == "174487fa15846afd"
    assert files_digest(map(str, paths)) == bytes_digest(b'forget.json[{"q": 1}]retain.json[]\n')
    assert files_digest(paths[::-1]) != files_digest(paths)  # the order is part of it
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "forget.json").write_bytes(b'[{"q": 1}]')
    assert files_digest([tmp_path / "sub" / "forget.json", paths[1]]) == files_digest(
        paths
    )  # not the directory


def test_json_digest_is_the_sha256_of_canonical_json():
    value = {"b": [1, 2.5], "a": None}
    expected = "6b1d84977084473f4b3b012fc8f1d08257499895d136f26cc7b5c865d2f19e23"
    assert json_digest(value) == expected and json_digest(value, length=12) == expected[:12]


def _directory(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "weights.bin").write_text(text)
    (path / "done").write_text(text)  # a writer's marker, written last
    return path


def _complete(path: Path) -> str | None:
    """What the complete directory ``path`` holds, None when it is missing or incomplete."""
    if not (path / "done").is_file():
        return None
    text = (path / "done").read_text()
    return text if (path / "weights.bin").read_text() == text else None


def test_replace_directory_puts_the_new_one_in_and_deletes_the_old(tmp_path):
    target = _directory(tmp_path / "out", "old")
    staging = _directory(tmp_path / ".out.tmp", "new")
    assert replace_directory(staging, target) == target
    assert _complete(target) == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # no target yet: a plain rename
    assert (
        _complete(replace_directory(_directory(tmp_path / "staged", "first"), tmp_path / "fresh")) == "first"
    )


def test_a_failure_between_the_two_renames_leaves_the_old_directory_in_place(tmp_path, monkeypatch):
    target = _directory(tmp_path / "out", "old")
    staging = _directory(tmp_path / ".out.tmp", "new")
    rename = os.rename

    def second_rename_fails(source, destination):
        if Path(source) == staging:
            raise OSError("simulated failure after the old directory was renamed aside")
        rename(source, destination)

    monkeypatch.setattr(os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="simulated failure"):
        replace_directory(staging, target)
    assert _complete(target) == "old" and _complete(staging) == "new"  # neither lost, nothing left aside
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp", "out"]


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from uds_lens.files import replace_directory

    staging, target = Path(sys.argv[1]), Path(sys.argv[2])
    rename = os.rename

    def killed_before_the_second(source, destination):
        if Path(source) == staging:
            os.kill(os.getpid(), signal.SIGKILL)  # no except block, no cleanup runs
        rename(source, destination)

    os.rename = killed_before_the_second
    replace_directory(staging, target)
    """
)


def test_a_kill_between_the_two_renames_leaves_both_directories_complete(tmp_path):
    target = _directory(tmp_path / "out", "old")
    staging = _directory(tmp_path / ".out.tmp", "new")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(staging), str(target)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not target.exists()  # the two system calls' window
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    assert _complete(aside) == "old" and _complete(staging) == "new"
    # the next run finds its staged directory complete and renames it in
    assert _complete(replace_directory(staging, target)) == "new"


def test_every_table_the_package_writes_is_written_whole():
    """A ``DataFrame.to_csv`` given a path writes in place: a kill mid-way leaves half a table that the report reads
    as a whole one. Every table goes through ``write_atomic`` (``to_csv()`` returns the text)."""
    import ast

    package = Path(__file__).resolve().parents[2] / "uds_lens"
    in_place = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "to_csv"
                and (node.args or any(k.arg == "path_or_buf" for k in node.keywords))
            ):
                in_place.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert in_place == []
    assert len(list(package.rglob("*.py"))) > 50  # the package was read

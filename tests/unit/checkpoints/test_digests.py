"""Checkpoint identity: one pass over the bytes gives the digest and the model's tensors; the digest is stable,
format-versioned, sensitive to every byte and name, and remembered (in memory and on disk) only while the files'
stamp proves them unchanged."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from uds_lens.checkpoints import digests
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.digests import DIGEST_DIR, DIGEST_SCHEME, DIGEST_VERSION, CheckpointReadError
from uds_lens.checkpoints.loader import load_hf_model
from uds_lens.checkpoints.reader import SafetensorsReader, read_checkpoint


@pytest.fixture(autouse=True)
def fresh_digests(tmp_path, monkeypatch):
    """A digest cache of this test's own: nothing remembered from another test, in memory or on disk."""
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "_DIGESTS", {})


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file written by hand (header padded to 8 bytes), so its bytes never depend on a library."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        blob = tensor.contiguous().numpy().tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _checkpoint(root: Path, scale: float = 1.0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    weights = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, "b": torch.ones(4)}
    (root / "model.safetensors").write_bytes(safetensors_bytes(weights))
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "notes.md").write_text("not part of the identity")
    return root


def _digest(root: Path) -> str:
    return Checkpoint.resolve(root).digest  # a new value each time: only the file-identity cache can answer


def _settle() -> None:
    """Wait until files just written are older than the filesystem clock's resolution: a digest remembered for them
    from now on is trusted (one remembered sooner is "racily clean", and read again)."""
    time.sleep(1.5 * digests.RACY_FINE_NS / 1e9)


def _read(root: Path, dtype: torch.dtype = torch.float32):
    checkpoint = Checkpoint.resolve(root)
    reader = SafetensorsReader(dtype, torch.device("cpu"))
    return read_checkpoint(
        *checkpoint.identifying(), {name: reader for name in checkpoint.files.weight_names}
    )


def test_digest_is_stable_and_names_its_scheme(tmp_path):
    digest = _digest(_checkpoint(tmp_path / "ckpt"))
    # Pinned: if this changes, what is hashed changed, and DIGEST_VERSION must be bumped with it (old results and
    # caches are then recomputed instead of being compared with identities of another scheme).
    assert DIGEST_VERSION == 2
    assert digest == "xxh3_128/v2:3e760636732e4247a626b1723641e6f2"
    assert Checkpoint.resolve(tmp_path / "ckpt").fingerprint == "files:" + digest


def test_one_read_gives_the_same_digest_and_the_tensors_each_in_its_own_memory(tmp_path, monkeypatch):
    root = _checkpoint(tmp_path / "ckpt")
    plain = _digest(root)
    monkeypatch.setattr(digests, "_DIGESTS", {})
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "another-cache"))  # the read must compute it
    loaded = _read(root)
    assert loaded.hashed and loaded.digest == plain == _digest(root)
    assert loaded.nbytes == sum(path.stat().st_size for _, path in Checkpoint.resolve(root).files.identifying)
    from safetensors.torch import load_file

    expected = load_file(str(root / "model.safetensors"))
    tensors = loaded.take()
    assert tensors.keys() == expected.keys() and loaded.tensors == {}  # handed over
    storages = {tensor.untyped_storage().data_ptr() for tensor in tensors.values()}
    assert len(storages) == len(tensors)  # each its own memory: nothing holds the file's bytes
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name])
    cast = _read(root, torch.bfloat16).take()  # cast as read, from the same bytes (the digest is proven now)
    for name, tensor in cast.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16))


def test_every_byte_and_name_counts_and_the_memo_follows_the_files(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    first = _digest(root)
    assert _digest(_checkpoint(tmp_path / "other", scale=2.0)) != first
    (root / "notes.md").write_text("edited")  # not an identifying file
    assert _digest(root) == first
    config = root / "config.json"
    config.write_text('{"model_type": "llamb"}')  # same size, one byte changed: the memo must not answer
    os.utime(config, ns=(1, 1))
    assert Checkpoint.resolve(root).known_digest() is None
    _settle()
    changed = _digest(root)
    assert changed != first and Checkpoint.resolve(root).known_digest() == changed
    (root / "config.json").rename(root / "config2.json")  # a renamed file is another checkpoint
    (root / "config.json").write_text('{"model_type": "llamb"}')
    assert _digest(root) not in (first, changed)


def test_the_digest_is_remembered_on_disk_by_file_identity(tmp_path, monkeypatch):
    """A later run (the memory cleared) finds the digest under the cache root without reading the files; a copy
    (another inode) or a touch is read again, and gives the same digest."""
    root = _checkpoint(tmp_path / "ckpt")
    _settle()
    first = _digest(root)
    assert list((tmp_path / "cache" / DIGEST_DIR).glob("*.json"))
    monkeypatch.setattr(digests, "_DIGESTS", {})
    read = []
    real = digests.hash_stream
    monkeypatch.setattr(
        digests, "hash_stream", lambda hasher, file, size: read.append(file) or real(hasher, file, size)
    )
    assert Checkpoint.resolve(root).known_digest() == first and _digest(root) == first and read == []
    copy = shutil.copytree(root, tmp_path / "copy")
    assert Checkpoint.resolve(copy).known_digest() is None
    assert _digest(copy) == first and read  # read once, and the same contents give the same digest
    read.clear()
    os.utime(root / "model.safetensors", ns=(5, 5))
    assert _digest(root) == first and read


def test_an_unwritable_cache_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("UDS_LENS_CACHE", str(blocked))
    monkeypatch.setattr(digests, "_UNWRITABLE_WARNED", set())
    digest = _digest(_checkpoint(tmp_path / "ckpt"))
    assert digest.startswith(DIGEST_SCHEME) and "not remembered" in caplog.text


def test_a_truncated_file_is_refused_when_its_tensors_are_read(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    weights = root / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointReadError, match="lies past the end"):
        _read(root)


def test_a_model_loads_identically_from_the_one_read(tiny):
    """The loader builds from the one pass; transformers reading the files itself gives the same tensors, and the
    model carries the digest of the bytes it was built from."""
    checkpoint = Checkpoint.resolve(tiny.unlearned)
    ours = load_hf_model(checkpoint, device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(str(tiny.unlearned), dtype=torch.float32)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name
    assert digests.loaded_digest(ours) == checkpoint.digest
    assert checkpoint.loaded_fingerprint(ours) == checkpoint.fingerprint


def test_the_digest_is_the_contents_and_a_hub_id_stands_for_itself(tmp_path):
    """The meta-evaluation's caches key a checkpoint by its digest: its contents, so a touch or a byte-identical
    rewrite keeps a cache and changed weights invalidate it."""
    root = _checkpoint(tmp_path / "ckpt")
    stamp = _digest(root)
    assert stamp.startswith(DIGEST_SCHEME)
    weights = root / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    os.utime(weights, ns=(1, 1))
    assert _digest(root) == stamp
    _checkpoint(root, scale=3.0)
    assert _digest(root) != stamp
    assert Checkpoint.resolve("owner/model").digest == "owner/model"


def test_tensor_headers_are_remembered_by_the_weight_files_stamp_and_follow_a_rewrite(tmp_path, monkeypatch):
    """A later run (the memory cleared) compares shapes without opening the weight file; a weight file rewritten
    in place with its old modification time (its status-change time moves) is opened again and gives its new shapes."""
    from uds_lens.checkpoints import folder

    root = _checkpoint(tmp_path / "ckpt")
    _settle()
    assert Checkpoint.resolve(root).tensor_shapes == {"a": (2, 3), "b": (4,)}
    monkeypatch.setattr(digests, "_DIGESTS", {})
    opened: list[Path] = []
    header = folder._header
    monkeypatch.setattr(folder, "_header", lambda file: opened.append(file) or header(file))
    assert Checkpoint.resolve(root).tensor_shapes == {"a": (2, 3), "b": (4,)} and opened == []
    weights = root / "model.safetensors"
    before = weights.stat()
    weights.write_bytes(safetensors_bytes({"a": torch.zeros(3, 2), "b": torch.ones(4)}))  # same size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert Checkpoint.resolve(root).tensor_shapes == {"a": (3, 2), "b": (4,)} and opened == [weights]

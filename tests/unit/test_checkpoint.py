"""Checkpoint identity: one pass over the bytes gives the digest and the staged tensors; the digest is stable,
format-versioned, sensitive to every byte and name, and memoised only while the files are unchanged."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from uds_lens import checkpoint
from uds_lens.fingerprints import source_fingerprint
from uds_lens.models import load_model


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
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
    (root / "model.safetensors").write_bytes(_safetensors_bytes(weights))
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "notes.md").write_text("not part of the identity")
    return root


def test_digest_is_stable_and_names_its_scheme(tmp_path):
    digest = checkpoint.file_digest(_checkpoint(tmp_path / "ckpt"))
    # Pinned: if this changes, what is hashed changed, and DIGEST_VERSION must be bumped with it (old results and
    # caches are then recomputed instead of being compared with identities of another scheme).
    assert checkpoint.DIGEST_VERSION == 2
    assert digest == "xxh3_128/v2:3e760636732e4247a626b1723641e6f2"
    assert source_fingerprint(tmp_path / "ckpt") == "files:" + digest


def test_one_staged_read_gives_the_same_digest_and_the_tensors_as_views(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    plain = checkpoint.file_digest(root)
    checkpoint._DIGESTS.clear()  # noqa: SLF001 - the staged read must compute it, not find it
    staged = checkpoint.stage(root)
    assert staged.digest == plain and staged.nbytes == sum(
        f.stat().st_size for f in checkpoint.checkpoint_files(root)
    )
    tensors = dict(staged.tensors())
    expected = load_file(str(root / "model.safetensors"))
    assert tensors.keys() == expected.keys()
    buffer = staged.buffers["model.safetensors"]
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name])
        assert tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view: no copy


def test_every_byte_and_name_counts_and_the_memo_follows_the_files(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    first = checkpoint.file_digest(root)
    assert checkpoint.file_digest(_checkpoint(tmp_path / "other", scale=2.0)) != first
    (root / "notes.md").write_text("edited")  # not an identifying file
    assert checkpoint.file_digest(root) == first
    config = root / "config.json"
    config.write_text('{"model_type": "llamb"}')  # same size, one byte changed: the memo must not answer
    os.utime(config, ns=(1, 1))
    assert checkpoint.cached_digest(root) is None
    changed = checkpoint.file_digest(root)
    assert changed != first and checkpoint.cached_digest(root) == changed
    (root / "config.json").rename(root / "config2.json")  # a renamed file is another checkpoint
    assert checkpoint.file_digest(root) not in (first, changed)


def test_a_truncated_file_is_refused_when_its_tensors_are_read(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    weights = root / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    staged = checkpoint.stage(root)
    with pytest.raises(checkpoint.CheckpointReadError, match="truncated"):
        list(staged.tensors())


def test_a_model_loads_identically_from_staged_bytes(tiny):
    staged = checkpoint.stage(tiny.unlearned)
    from_staged = load_model(tiny.unlearned, device="cpu", tensors=staged.tensors())
    from_files = load_model(tiny.unlearned, device="cpu")
    for (name, a), (_, b) in zip(from_staged.state_dict().items(), from_files.state_dict().items()):
        assert torch.equal(a, b), name
    staged.release()
    assert not staged.has_weights and staged.model is None


def test_checkpoint_stamp_is_the_contents_digest_and_a_hub_id_stands_for_itself(tmp_path):
    """The meta-evaluation's caches key a checkpoint by checkpoint_stamp: its contents (file_digest), so a touch or a
    byte-identical rewrite keeps a cache and changed weights invalidate it."""
    root = _checkpoint(tmp_path / "ckpt")
    stamp = checkpoint.checkpoint_stamp(root)
    assert stamp == checkpoint.file_digest(root) and stamp.startswith(checkpoint.DIGEST_SCHEME)
    weights = root / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    os.utime(weights, ns=(1, 1))
    assert checkpoint.checkpoint_stamp(root) == stamp
    _checkpoint(root, scale=3.0)
    assert checkpoint.checkpoint_stamp(root) != stamp
    assert checkpoint.checkpoint_stamp("owner/model") == "owner/model"

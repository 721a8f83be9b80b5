"""Benchmark: a sweep's throughput (models per minute) in-process and on Ray with 1 and 2 workers, in one run.

The models are the test zoo's unlearned models, each listed ``--copies`` times under distinct names (the same
checkpoint scored again is the same work), against the zoo's full/retain pair and forget set; every sweep is
``force=True`` (nothing reused) with a warm S1 cache, so each measures loading + Stage 2 of every model. From the
``finished_at`` column of ``sweep.csv`` each run splits into its start-up (call to first finished model: for Ray the
actor processes, their imports, loading the full model, Stage 1 from the cache and shipping it) and its steady state
(models per minute from the first to the last finished model: the throughput a long sweep approaches). In-process
runs with one torch thread, the CPU slot one Ray worker gets, so "Ray 1 worker vs in-process" is the overhead of the
Ray path for the same work. Each configuration runs ``--repeats`` times in an interleaved order (A B C C B A ...), so
a change in the machine's load touches every configuration alike; the figures are medians.

    python experiments/bench_sweep.py                       # test zoo, 6 copies: N = 42 models
    python experiments/bench_sweep.py --copies 20 --gpus 1  # on a GPU machine: one worker per GPU

The last line is ``ray2_vs_inprocess_steady=<x>``: the steady-state throughput of 2 Ray workers over in-process.
Timings on a shared machine vary with the other jobs on it; compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from uds_lens.sweep import sweep
from uds_lens.zoo import build_zoo, load_zoo

TEST_ZOO = Path(os.environ.get("UDS_LENS_TEST_ZOO", "~/.cache/uds_lens/zoo-test")).expanduser()


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
    args = parser.parse_args()
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
        "in_process": {"workers": 1, "use_ray": False},
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


if __name__ == "__main__":
    main()

"""How far bf16 and fp16 move an audit from fp32, and what the precision check (``uds_lens.precision``) buys back.

For each model set (the trained test zoo; SmolLM2-135M and Gemma-3-270M with the retain = upper layers + noise and
unlearned = 50/50 mix checkpoints the tests derive, on ``experiments/data/real_facts.json``) and each reduced format,
one auditor per mode scores the same unlearned models, Stage 2 on every cell:

* ``fp32``: the reference;
* ``off``: the format with ``precision_check=False``: the raw band, cell by cell, against fp32: max / q99 / q90 of
  ``|d1_reduced - d1_fp32|`` and of ``d2``, the measured scale (max ``|d_reduced - d_fp32| / (eps sqrt(1 + |d|))``),
  KE and clip decisions that flipped, per-example and model ``|dUDS|``;
* ``decisions``: the check with ``precision_tolerance=None`` (KE and ``d1`` in fp32, fragile clips re-decided);
* ``check``: the check as it runs by default (``precision_tolerance=1e-3``: examples rounding could move by more
  run Stage 2 in fp32).

Each line also gives the fragile and re-decided cells (``meta["precision"]``), Stage 2's CPU seconds (process time
around ``auditor.score`` of a model already fingerprinted; ``--threads 1`` makes it the computation's) and its ratio
to the ``off`` run's, without and with the CPU seconds of the unlearned model's fp32 copy (made just before, as a
load: ``s2_copy_cpu``).

    python experiments/precision_bands.py --sets zoo --dtypes bfloat16 float16 --threads 1
    python experiments/precision_bands.py --sets smollm2 gemma3 --limit 12 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.loader import load_model, load_tokenizer
from uds_lens.config import UDSConfig
from uds_lens.files import zoo_root
from uds_lens.precision import PrecisionCheck, band_shape, dtype_eps
from uds_lens.results import UDSResult
from uds_lens.uds import ke_mask

ROOT = Path(__file__).resolve().parents[1]
REAL_FACTS = ROOT / "experiments" / "data" / "real_facts.json"
ZOO_UNLEARNED = ("graddiff", "npo", "simnpo", "rmu_l1", "retain90", "retain50")
MODES = {
    "fp32": {},
    "off": {"precision_check": False},
    "decisions": {"precision_tolerance": None},
    "check": {},
}


def model_sets(
    names: list[str], workdir: Path, zoo: Path
) -> dict[str, tuple[dict[str, Path], Path, list[str]]]:
    """``{set: ({"full", "retain", unlearned...: checkpoint}, data, unlearned names)}``."""
    sys.path.insert(
        0, str(ROOT / "tests")
    )  # a script, not a test: the test helpers build the pretrained sets
    from helpers import gemma, pretrained

    out = {}
    for name in names:
        if name == "zoo":
            paths = {m: zoo / "models" / m for m in ("full", "retain", *ZOO_UNLEARNED)}
            out[name] = (paths, zoo / "data" / "forget.json", list(ZOO_UNLEARNED))
            continue
        if name == "smollm2":
            full = pretrained.converted_checkpoint(pretrained.cache_root())
            derived = pretrained.derive_checkpoints(full, workdir / "smollm2")
        elif name == "gemma3":
            full = gemma.converted_checkpoint(pretrained.cache_root())
            derived = pretrained.derive_checkpoints(full, workdir / "gemma3", noise=0.3, first_noisy_layer=10)
        else:
            raise SystemExit(f"unknown set {name!r}: use zoo, smollm2, gemma3")
        out[name] = (derived, REAL_FACTS, ["unlearned"])
    return out


def cell_figures(reference: UDSResult, run: UDSResult, eps: float, tau: float) -> dict:
    """The band of one reduced-precision run against fp32, cell by cell and per example."""
    figures: dict = {}
    for delta in ("d1", "d2"):
        exact = reference.layers[delta].to_numpy(dtype=float)
        moved = np.abs(run.layers[delta].to_numpy(dtype=float) - exact)
        figures[f"{delta}_max"] = float(np.nanmax(moved))
        figures[f"{delta}_q99"] = float(np.nanquantile(moved, 0.99))
        figures[f"{delta}_q90"] = float(np.nanquantile(moved, 0.9))
        figures[f"{delta}_scale"] = float(np.nanmax(moved / (eps * band_shape(exact))))
    d1, d1_run = reference.layers["d1"].to_numpy(dtype=float), run.layers["d1"].to_numpy(dtype=float)
    d2, d2_run = reference.layers["d2"].to_numpy(dtype=float), run.layers["d2"].to_numpy(dtype=float)
    ke = ke_mask(d1, tau)
    figures["ke_flips"] = int((ke != ke_mask(d1_run, tau)).sum())
    figures["clip_flips"] = int(((d2 > d1) != (d2_run > d1_run))[ke].sum())
    return figures


def uds_figures(reference: UDSResult, run: UDSResult) -> dict:
    merged = reference.examples.merge(run.examples, on="idx", suffixes=("_ref", "_run"))
    moved = np.abs(merged["uds_ref"] - merged["uds_run"]).to_numpy(dtype=float)
    both = ~np.isnan(moved)
    status = (merged["status_ref"] != merged["status_run"]).sum()
    return {
        "max_duds": float(moved[both].max()) if both.any() else float("nan"),
        "model_duds": abs(reference.uds - run.uds),
        "status_changed": int(status),
    }


def run_set(name: str, paths: dict, data: Path, unlearned: list[str], dtypes: list[str], args) -> None:
    tokenizer = load_tokenizer(paths["full"])
    cache = Path(tempfile.mkdtemp(prefix="precision_bands_s1_"))
    reference: dict[str, UDSResult] = {}
    for dtype in ["float32", *dtypes]:
        eps = dtype_eps(getattr(torch, dtype))
        off_seconds: dict[str, float] = {}
        for mode, extra in MODES.items():
            if (dtype == "float32") != (mode == "fp32"):
                continue
            config = UDSConfig(dtype=dtype, device="cpu", batch_size=args.batch_size, **extra)
            auditor = UDSAuditor(
                paths["full"],
                paths["retain"],
                data,
                config,
                tokenizer=tokenizer,
                cache_dir=cache,
                progress=False,
                limit=args.limit,
            )
            started = time.process_time()
            stage = auditor.stage1
            s1_cpu = time.process_time() - started
            for model_name in unlearned:
                model = load_model(paths[model_name], dtype=dtype, device="cpu")
                auditor.fingerprint(model)  # hashed before the clock starts, as a sweep's staging does
                copy_cpu = 0.0
                check = auditor.runs if isinstance(auditor.runs, PrecisionCheck) else None
                if check is not None and check.enabled:
                    # its fp32 copy is made here (a load, as the model's own is), then reused by score
                    started = time.process_time()
                    check.reference("unlearned", model)
                    copy_cpu = time.process_time() - started
                s2_cpu = float("inf")
                for _ in range(
                    args.repeats
                ):  # the least CPU time of the repeats: the others waited on the machine
                    started = time.process_time()
                    result = auditor.score(model, name=model_name)
                    s2_cpu = min(s2_cpu, time.process_time() - started)
                    if check is not None and check.enabled and args.repeats > 1:
                        check.reference("unlearned", model)  # score released it: the copy again
                if mode == "fp32":
                    reference[model_name] = result
                    print(
                        json.dumps({"set": name, "model": model_name, "mode": mode, "s2_cpu": s2_cpu}),
                        flush=True,
                    )
                    continue
                precision = result.precision or {}
                line = {
                    "set": name,
                    "model": model_name,
                    "dtype": dtype,
                    "mode": mode,
                    **uds_figures(reference[model_name], result),
                    **(cell_figures(reference[model_name], result, eps, config.tau) if mode == "off" else {}),
                    "band_scale": precision.get("band", {}).get("scale"),
                    "n_cells": int(result.layers.shape[0]),
                    "n_ke_cells": int(result.layers["ke"].sum()),
                    **{
                        key: precision.get(key)
                        for key in (
                            "n_fragile_cells",
                            "n_fragile_ke",
                            "n_fragile_clip",
                            "n_redecided_cells",
                            "n_fp32_examples",
                        )
                    },
                    "weights": precision.get("weights"),
                    "s1_cpu": s1_cpu if not stage.cached else None,
                    "s2_cpu": s2_cpu,
                    "s2_precision_seconds": result.meta["timings"].get("s2_precision_seconds"),
                    "s2_copy_cpu": copy_cpu,
                }
                if mode == "off":
                    off_seconds[model_name] = s2_cpu
                else:
                    line["s2_over_off"] = s2_cpu / off_seconds[model_name]
                    line["s2_with_copy_over_off"] = (s2_cpu + copy_cpu) / off_seconds[model_name]
                print(json.dumps(line), flush=True)
                del model
            del auditor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=["zoo"], help="zoo, smollm2, gemma3")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    parser.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="score each model this many times (least CPU)")
    parser.add_argument("--zoo", type=Path, default=zoo_root("test"), help="the trained test zoo's directory")
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "uds_lens_precision_bands"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name, (paths, data, unlearned) in model_sets(args.sets, args.workdir, args.zoo).items():
        run_set(name, paths, data, unlearned, args.dtypes, args)


if __name__ == "__main__":
    main()

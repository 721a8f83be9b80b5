"""Head-level patching: the fast engine (attn_out rewrite, one pass per head) against the naive one (one forward per
layer and head), on the embedded test zoo. Prints both wall times, their ratio and the largest difference.

    python experiments/bench_components.py [--zoo DIR] [--examples 16]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from uds_lens.auditor import UDSAuditor
from uds_lens.config import UDSConfig
from uds_lens.zoo.layout import load_zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--zoo",
        type=Path,
        default=Path(os.environ.get("UDS_LENS_ZOO", Path.home() / ".cache" / "uds_lens" / "zoo-test")),
    )
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--model", default="npo")
    options = parser.parse_args()
    zoo = load_zoo(options.zoo)
    auditor = UDSAuditor(
        zoo.path("full"),
        zoo.path("retain"),
        zoo.forget_path,
        UDSConfig(),
        cache_dir=False,
        progress=False,
        limit=options.examples,
    )
    source = auditor.load_source(str(zoo.path(options.model)))
    timings, results = {}, {}
    for engine in ("fast", "naive"):
        auditor.component_cache.clear()  # time S1 and S2 for both engines
        started = time.perf_counter()
        results[engine] = auditor.patch_heads(source, engine=engine)
        timings[engine] = time.perf_counter() - started
    cfg = auditor.full.cfg
    difference = (results["fast"].d2 - results["naive"].d2).abs().max().item()
    print(
        f"{len(auditor.encoded)} examples, {cfg.n_layers} layers x {cfg.n_heads} heads, {torch.get_num_threads()} threads"
    )
    print(
        f"fast {timings['fast']:.2f} s   naive {timings['naive']:.2f} s   naive/fast {timings['naive'] / timings['fast']:.2f}x"
        f"   max |d2 fast - naive| {difference:.2e}"
    )


if __name__ == "__main__":
    main()

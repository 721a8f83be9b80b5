"""Start-up cost of the package and the CLI's model-free commands (issue 17's "quiet and quick" targets).

Prints, for ``import uds_lens``, ``uds-lens --help`` and ``uds-lens report DIR`` (on synthetic saved results),
the median wall time of a few fresh interpreter runs, its ratio to the 2 s target, what ``import uds_lens`` writes
to stderr, and which heavy libraries it loads. Run from the repository root::

    python experiments/bench_startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 2.0
HEAVY = ("torch", "transformer_lens", "transformers", "bitsandbytes")


def _timed(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - started, done


def _saved_results(directory: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))  # a script, not a test: pytest's pythonpath does not apply
    from helpers.synthetic import make_result

    for name, erasure in (("full", 0.0), ("retain", 1.0), ("npo", 0.4), ("rmu", 0.7)):
        make_result(name, erasure).save(directory / name)
    (directory / "roles.json").write_text(
        json.dumps({"full": "full", "retain": "retain", "npo": "unlearned", "rmu": "unlearned"})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp)
        _saved_results(results)
        commands = {
            "import uds_lens": [sys.executable, "-c", "import uds_lens"],
            "uds-lens --help": [sys.executable, "-m", "uds_lens.cli", "--help"],
            "uds-lens report": [sys.executable, "-m", "uds_lens.cli", "report", str(results)],
        }
        for label, args in commands.items():
            times = []
            for _ in range(options.repeats):
                seconds, done = _timed(args)
                if done.returncode != 0:
                    raise SystemExit(f"{label} failed: {done.stderr[-2000:]}")
                times.append(seconds)
            median = statistics.median(times)
            print(
                f"{label:18s} median {median:6.2f} s  ratio to the {TARGET_S:.0f} s target {median / TARGET_S:5.2f}"
            )
    probe = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            f"import sys, uds_lens; print(','.join(m for m in {HEAVY!r} if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    total = [line for line in probe.stderr.splitlines() if line.rstrip().endswith("| uds_lens")]
    other = [line for line in probe.stderr.splitlines() if not line.startswith("import time:")]
    print(
        f"import uds_lens: -X importtime total {total[-1].split('|')[1].strip() if total else '?'} us; "
        f"heavy modules loaded: {probe.stdout.strip() or 'none'}; other stderr lines: {len(other)}"
    )


if __name__ == "__main__":
    main()

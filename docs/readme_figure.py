"""The README's figure: one forget-set example of a test-zoo model, d1 and d2 per layer, KE layers shaded.

    python docs/readme_figure.py [--out docs/assets/uds_example.png]

Scores one unlearned model of the test zoo (``zoo:test/...``, built by `make demo` or the test suite; SimNPO by
default, whose erasure is partial), picks the example that is nearest half erased among those with every layer KE and
no clipped layer, and draws ``result.example(idx).figure()`` to a PNG with a local headless Chrome/Chromium
(`uds_lens.plotting.notebook_html`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "assets" / "uds_example.png")
    parser.add_argument("--model", default="simnpo", help="a test-zoo unlearned model")
    args = parser.parse_args(argv)

    import json

    from uds_lens import UDSAuditor
    from uds_lens.plotting.notebook_html import find_browser, render_pngs

    browser = find_browser()
    if browser is None:
        raise SystemExit("no Chrome/Chromium to draw the figure with (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="uds_lens_figure_") as cache:
        auditor = UDSAuditor(
            "zoo:test/full", "zoo:test/retain", "zoo:test/forget", cache_dir=cache, progress=False
        )
        result = auditor.score(f"zoo:test/{args.model}")
    examples = result.examples
    plain = examples[(examples.n_ke == examples.n_ke.max()) & (examples.n_clipped == 0)]
    idx = int(plain.iloc[(plain.uds - 0.5).abs().argsort().iloc[0]].idx)
    figure = result.example(idx).figure()
    figure.update_layout(width=900, height=420, margin={"t": 70, "b": 50, "l": 60, "r": 20})
    (png,) = render_pngs([json.loads(figure.to_json())], browser)
    if png is None:
        raise SystemExit("the browser could not draw the figure")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(png)
    print(
        f"{args.out.relative_to(ROOT)}: example {idx}, UDS {result.example(idx).uds:.2f} (model {result.uds:.2f})"
    )


if __name__ == "__main__":
    main()

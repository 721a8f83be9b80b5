"""The numbers and figures of the docs page "UDS on a real model": the zoo fine-tuned from SmolLM2-135M.

    python experiments/real_model.py [--zoo DIR] [--out runs/real_model] [--figures docs/guides/real-model]
        [--meta DIR] [--heads-model npo] [--heads-layers 10-19] [--heads-examples 12]

1. Scores every model of the zoo (``uds-lens zoo build --size smollm2``; default its cached directory) against its
   full and retain models: the ladder (full, retain90, retain50, retain), the four fine-tuning methods and RMU at
   three target layers (``OUT/NAME``, reused on a rerun, as ``uds-lens demo --size smollm2 --out OUT`` lays them out).
2. Head-level patching of one unlearned model over one layer range (the component map).
3. Writes ``FIGURES/measured.json`` (every number the page quotes, with the paper's beside it) and the six figures
   as PNG beside the page, drawn by the local Chrome/Chromium that `uds_lens.zoo.notebook_html` uses (kaleido is
   used instead when it is installed and can render).
4. With ``--meta`` (a ``uds-lens meta-eval --out`` directory of this zoo), adds its faithfulness and robustness rows.

Every figure uses the public plotting functions where one exists (`uds_lens.plotting`); the ladder, the KE share
per layer and the RMU onsets are small figures of their own, drawn here from the saved tables.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from uds_lens import plotting
from uds_lens.files import zoo_root
from uds_lens.results import UDSResult
from uds_lens.zoo.layout import Zoo, load_zoo

logger = logging.getLogger("real_model")

# The paper's figures this page sets ours beside (Llama-3.2-1B, 16 layers, TOFU forget10, tau = 0.05).
PAPER = {
    "model": "Llama-3.2-1B (16 layers), TOFU forget10 (367 examples)",
    # Table 2: UDS of the retain ladder by seen fraction of the forget set (S1 baseline = retain90).
    "ladder": {"1.0": 0.002, "0.9": 0.153, "0.5": 0.496, "0.0": 1.000},
    "ke_share": 0.684,  # share of (example, layer) cells that are KE
    "mean_ke_layers": 10.9,
    "std_ke_layers": 3.3,
    "n_layers": 16,
    "skipped_share": 0.015,  # examples with no KE layer
    # Table 6's UDS column (best configuration per method; the order is the paper's ranking by UDS there)
    "method_uds": {"graddiff": 0.515, "npo": 0.619, "simnpo": 0.739, "idknll": 0.251, "rmu": 0.667},
    # Appendix D.6: RMU at layer 5 / 10 / 15 (lr 2e-5 and 5e-5, epoch 10), where S2 starts to disrupt
    "rmu_onset": {"5": "layer 4-5", "10": "layer 8 (layers 0-7 exactly 0)", "15": "layer 13"},
    # Table 3
    "meta_eval": {
        "uds": {"faithfulness": 0.971, "robustness": 0.932, "overall": 0.951},
        "truth_ratio": {"faithfulness": 0.947, "robustness": 0.379, "overall": 0.542},
        "prob": {"faithfulness": 0.816, "robustness": 0.757, "overall": 0.786},
        "rouge": {"faithfulness": 0.722, "robustness": 0.333, "overall": 0.456},
        "es": {"faithfulness": 0.891, "robustness": 0.859, "overall": 0.875},
        "logit_lens": {"faithfulness": 0.927, "robustness": 0.879, "overall": 0.902},
    },
}
LADDER = ("full", "retain90", "retain50", "retain")
FIGURES = ("ladder", "methods", "ke_share", "example_curves", "rmu_onset", "heads")


def score_zoo(zoo: Zoo, out: Path) -> dict[str, UDSResult]:
    """Every model of the ladder and every unlearned model, scored against the zoo's full and retain (reused)."""
    from uds_lens.scoring import score_models

    names = [*LADDER, *zoo.names("unlearned")]
    return score_models(
        zoo.path("full"),
        zoo.path("retain"),
        {name: zoo.path(name) for name in names},
        zoo.forget_path,
        out_dir=out,  # the demo's layout: `uds-lens demo --size smollm2 --out OUT` reuses these and adds a report
        cache_dir=out / ".s1_cache",
        progress=True,
    )


def ke_numbers(result: UDSResult) -> dict[str, Any]:
    """The KE cells of Stage 1 (the same for every model): overall share, per layer, per example."""
    layers = result.layers
    scored = result.examples.loc[result.examples["status"] == "scored", "idx"]
    cells = layers[layers["idx"].isin(scored)]
    all_examples = layers.groupby("idx")["ke"].sum()
    per_layer = cells.groupby("layer")["ke"].mean()
    n_ke = cells.groupby("idx")["ke"].sum()
    n_layers = int(layers["layer"].nunique())
    return {
        "n_examples": int(all_examples.size),
        "n_scored": int(scored.size),
        "n_without_ke": int((all_examples == 0).sum()),
        "n_layers": n_layers,
        "ke_share": float(cells["ke"].mean()),
        "ke_share_all_examples": float(layers["ke"].mean()),
        "mean_ke_layers": float(n_ke.mean()),
        "std_ke_layers": float(n_ke.std()),
        "ke_share_per_layer": {int(k): round(float(v), 4) for k, v in per_layer.items()},
        "first_layer_ke_for_half": _first(per_layer >= 0.5),
        "layers_below_half": [int(k) for k, v in per_layer.items() if v < 0.5],
        "mean_d1_per_layer": {
            int(k): round(float(v), 4) for k, v in cells.groupby("layer")["d1"].mean().items()
        },
    }


def _no_nan(value: Any) -> Any:
    """``value`` with every NaN float as None, so measured.json is strict JSON (null where a share is undefined)."""
    if isinstance(value, float) and np.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {key: _no_nan(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(item) for item in value]
    return value


def _first(mask: pd.Series) -> int | None:
    hits = mask[mask]
    return int(hits.index[0]) if len(hits) else None


def rmu_onsets(results: Mapping[str, UDSResult], tau: float) -> dict[str, dict[str, Any]]:
    """Per RMU model: its target layer, the first layer where its patch changes full's score at all (d2 != 0 for
    some example), the first whose mean d2 exceeds tau (the patch measurably disrupts full there), the first whose
    KE cells are more than half erased on average (mean LER > 0.5), and the layers where d2 is exactly 0."""
    onsets = {}
    for name, result in results.items():
        target = plotting.rmu_target_layer(name)
        if target is None:
            continue
        layers = result.layers
        mean_d2 = layers.groupby("layer")["d2"].mean()
        max_abs_d2 = layers.groupby("layer")["d2"].apply(lambda d: float(np.abs(d).max()))
        erased = layers[layers["ke"]].groupby("layer")["ler"].mean()
        untouched = [int(k) for k, v in max_abs_d2.items() if v == 0.0]
        onsets[name] = {
            "target_layer": target,
            "trained_layers": None,
            "first_layer_d2_nonzero": _first(max_abs_d2 > 0.0),
            "first_layer_mean_d2_above_tau": _first(mean_d2 > tau),
            "first_layer_mean_ler_above_half": _first(erased > 0.5),
            "layers_with_d2_exactly_0": untouched,
            "mean_d2_per_layer": {int(k): round(float(v), 4) for k, v in mean_d2.items()},
            "uds": result.uds,
        }
    return onsets


def method_rows(results: Mapping[str, UDSResult], zoo: Zoo) -> list[dict[str, Any]]:
    rows = []
    for name, result in results.items():
        split = result.split
        low, high = result.ci95
        rows.append(
            {
                "model": name,
                "role": zoo.role(name),
                "seen_forget_fraction": zoo.info(name).get("seen_forget_fraction"),
                "uds": result.uds,
                "ci_low": low,
                "ci_high": high,
                "uds_unclipped": split.get("uds_unclipped"),
                "uds_clipped": split.get("uds_clipped"),
                "uds_clipped_share": split.get("uds_clipped_share"),
                "excess_disruption": split.get("excess_disruption"),
                "n_scored": int((result.examples["status"] == "scored").sum()),
                "forget_entity_exact": zoo.info(name)["metrics"].get("forget_entity_exact"),
                "retain_entity_exact": zoo.info(name)["metrics"].get("retain_entity_exact"),
                "holdout_entity_exact": zoo.info(name)["metrics"].get("holdout_entity_exact"),
            }
        )
    return rows


def _titled(fig: go.Figure, title: str, basis: list[str]) -> go.Figure:
    """The title with its basis (what the figure rests on) in a smaller line under it."""
    text = f"{title}<br><span style='font-size:12px'>{'; '.join(basis)}</span>"
    fig.update_layout(title={"text": text, "x": 0.02, "xanchor": "left"}, margin={"t": 90})
    return fig


def ladder_figure(rows: list[dict[str, Any]]) -> go.Figure:
    ours = [row for row in rows if row["model"] in LADDER]
    ours.sort(key=lambda row: -row["seen_forget_fraction"])
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=[row["seen_forget_fraction"] for row in ours],
            y=[row["uds"] for row in ours],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [row["ci_high"] - row["uds"] for row in ours],
                "arrayminus": [row["uds"] - row["ci_low"] for row in ours],
            },
            text=[row["model"] for row in ours],
            textposition="top right",
            mode="lines+markers+text",
            name="SmolLM2-135M zoo (this page)",
        )
    )
    paper = PAPER["ladder"]
    fig.add_trace(
        go.Scatter(
            x=[float(k) for k in paper],
            y=list(paper.values()),
            mode="lines+markers",
            line={"dash": "dash", "color": "grey"},
            name="paper, Llama-3.2-1B (Table 2)",
        )
    )
    fig.update_layout(
        xaxis={"title": "share of the forget set the source model was trained on", "autorange": "reversed"},
        yaxis={"title": "UDS", "range": [-0.05, 1.1]},
        legend={"x": 0.02, "y": 0.98},
        width=760,
        height=480,
    )
    n = ours[0]["n_scored"] if ours else 0
    return _titled(
        fig,
        "The retain ladder: UDS falls with the share of the forget set seen",
        [f"{n} forget examples, tau = 0.05, 95% bootstrap CIs"],
    )


def ke_share_figure(ke: dict[str, Any]) -> go.Figure:
    per_layer = ke["ke_share_per_layer"]
    fig = go.Figure(
        go.Bar(x=list(per_layer), y=list(per_layer.values()), name="KE share", marker_color="#4c78a8")
    )
    fig.add_hline(
        y=ke["ke_share"],
        line={"dash": "dot"},
        annotation_text=f"all layers: {ke['ke_share']:.1%}",
        annotation_position="bottom right",
    )
    fig.add_hline(
        y=PAPER["ke_share"],
        line={"dash": "dash", "color": "grey"},
        annotation_text=f"paper (Llama-3.2-1B): {PAPER['ke_share']:.1%}",
        annotation_position="top left",
    )
    fig.update_layout(
        xaxis={"title": "layer", "dtick": 2},
        yaxis={"title": "share of examples with d1 > tau", "range": [0, 1.05], "tickformat": ".0%"},
        width=760,
        height=420,
    )
    return _titled(
        fig,
        "Where the forget facts live: share of KE cells per layer (Stage 1, retain into full)",
        [f"{ke['n_scored']} examples with a KE layer of {ke['n_examples']}, tau = 0.05"],
    )


def rmu_figure(
    results: Mapping[str, UDSResult], onsets: Mapping[str, dict[str, Any]], tau: float
) -> go.Figure:
    fig = go.Figure()
    for name, onset in onsets.items():
        colour = plotting.model_colour(name)
        mean_d2 = onset["mean_d2_per_layer"]
        fig.add_trace(
            go.Scatter(
                x=list(mean_d2),
                y=[max(v, 1e-4) for v in mean_d2.values()],
                mode="lines+markers",
                name=f"{name} (UDS {onset['uds']:.2f})",
                line={"color": colour},
            )
        )
        fig.add_vline(x=onset["target_layer"], line={"color": colour, "dash": "dash"})
    fig.add_hline(
        y=tau, line={"dash": "dot"}, annotation_text=f"tau = {tau}", annotation_position="bottom right"
    )
    fig.update_layout(
        xaxis={"title": "layer", "dtick": 2},
        yaxis={"title": "mean d2 (nats, log scale; 0 drawn at 1e-4)", "type": "log"},
        width=760,
        height=460,
    )
    n = next(iter(results.values())).examples["idx"].nunique() if results else 0
    return _titled(
        fig,
        "RMU: where the unlearned model's patch starts to disrupt (mean d2 per layer); dashed = target layer",
        [f"{n} forget examples"],
    )


def write_pngs(figures: Mapping[str, go.Figure], directory: Path) -> list[Path]:
    """Each figure as ``directory/NAME.png``: kaleido when it renders here, else the local Chrome/Chromium."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        import kaleido  # noqa: F401

        for name, fig in figures.items():
            fig.write_image(directory / f"{name}.png", scale=1.5)
            written.append(directory / f"{name}.png")
        return written
    except Exception as err:  # no kaleido, or no browser it can drive
        logger.info("kaleido cannot render here (%s); using Chromium", err)
    from uds_lens.zoo.notebook_html import find_browser, render_pngs

    browser = find_browser()
    if browser is None:
        raise SystemExit("no Chrome/Chromium to draw the figures with: apt-get install -y chromium")
    pngs = render_pngs([json.loads(fig.to_json()) for fig in figures.values()], browser)
    for name, png in zip(figures, pngs, strict=True):
        if png is None:
            raise SystemExit(f"figure {name} could not be drawn")
        (directory / f"{name}.png").write_bytes(png)
        written.append(directory / f"{name}.png")
    return written


def head_map(zoo: Zoo, out: Path, model: str, layers: list[int], n_examples: int) -> tuple[go.Figure, dict]:
    """Head-level patching of one unlearned model over ``layers`` (the first ``n_examples`` examples)."""
    from uds_lens.auditor import UDSAuditor

    auditor = UDSAuditor(
        zoo.path("full"), zoo.path("retain"), zoo.forget_path, cache_dir=out / ".s1_cache", limit=n_examples
    )
    heads = auditor.patch_heads(zoo.path(model), layers=layers, name=model)
    grid = heads.component_uds
    summary = {
        "model": model,
        "layers": layers,
        "n_examples": len(heads.idx),
        "n_heads": int(heads.d1.shape[-1]),
        "mean_d1_per_layer": {
            int(layer): round(float(heads.d1[:, i].nanmean()), 4) for i, layer in enumerate(heads.layers)
        },
        "component_uds": [
            [None if np.isnan(v) else round(float(v), 3) for v in row] for row in np.asarray(grid)
        ],
    }
    return heads.figure("component_uds"), summary


def meta_rows(meta_dir: Path) -> dict[str, Any]:
    table = pd.read_csv(meta_dir / "meta_eval.csv").set_index("metric")
    metrics = pd.read_csv(meta_dir / "metrics.csv", index_col=0)
    pools = metrics["role"].value_counts().to_dict()
    rows = {}
    for metric, row in table.iterrows():
        rows[str(metric)] = {
            key: (None if pd.isna(row[key]) else round(float(row[key]), 3))
            for key in ("faithfulness", "q", "r", "robustness", "overall", "n_models_q", "n_models_r")
        }
    ranked = table["overall"].rank(ascending=False, method="min")
    return {
        "pool_sizes": {role: int(pools.get(role, 0)) for role in ("pos", "neg", "unlearned", "sweep")},
        "rows": rows,
        "uds_rank_overall": None if pd.isna(ranked.get("uds")) else int(ranked["uds"]),
        "uds_rank_faithfulness": int(table["faithfulness"].rank(ascending=False, method="min")["uds"]),
        "n_metrics": int(table["overall"].notna().sum()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--zoo", type=Path, default=None, help="zoo directory (default: the cached smollm2 zoo)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/real_model"))
    parser.add_argument("--figures", type=Path, default=Path("docs/guides/real-model"))
    parser.add_argument("--meta", type=Path, default=None, help="a `uds-lens meta-eval --out` directory")
    parser.add_argument("--heads-model", default="npo")
    parser.add_argument(
        "--heads-layers",
        default="20-29",
        help="first-last layer of the component map (where the KE cells are)",
    )
    parser.add_argument("--heads-examples", type=int, default=12)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    zoo = load_zoo(args.zoo or zoo_root("smollm2"))
    results = score_zoo(zoo, args.out)
    tau = float(results["full"].settings.get("tau", 0.05))
    rows = method_rows(results, zoo)
    ke = ke_numbers(results["full"])
    unlearned = {name: results[name] for name in zoo.names("unlearned")}
    rmu = {name: result for name, result in unlearned.items() if plotting.rmu_target_layer(name) is not None}
    onsets = rmu_onsets(rmu, tau)
    for name in onsets:
        onsets[name]["trained_layers"] = zoo.info(name)["hyperparams"].get("trained_layers")
    example_model = args.heads_model if args.heads_model in results else next(iter(unlearned))
    examples = results[example_model].examples
    # a typical example the model erased a visible part of (UDS >= 0.1, else any): its number of KE layers is the
    # median one (the first such by idx)
    scored = examples[examples["status"] == "scored"]
    if (scored["uds"] >= 0.1).any():
        scored = scored[scored["uds"] >= 0.1]
    median = scored["n_ke"].median()
    typical = scored.assign(gap=(scored["n_ke"] - median).abs()).sort_values(["gap", "idx"])
    example_idx = int(typical["idx"].iloc[0])
    first, last = (int(part) for part in args.heads_layers.split("-"))
    heads_fig, heads = head_map(
        zoo, args.out, example_model, list(range(first, last + 1)), args.heads_examples
    )
    ranking = sorted(
        (row for row in rows if row["role"] == "unlearned"), key=lambda row: row["uds"], reverse=True
    )
    measured = {
        "zoo": {
            "root": "$UDS_LENS_ZOO" if args.zoo else "~/.cache/uds_lens/zoo-smollm2",
            "size": zoo.manifest.get("size"),
            "data": {
                k: zoo.manifest["data"].get(k) for k in ("n_forget", "n_retain", "n_holdout", "n_authors")
            },
            "build_seconds": zoo.manifest.get("build_seconds"),
            "models_train_seconds": zoo.manifest.get("models_train_seconds"),
            "checks": zoo.checks,
        },
        "tau": tau,
        "models": rows,
        "ranking": [row["model"] for row in ranking],
        "ke": ke,
        "rmu": onsets,
        "example": {"model": example_model, "idx": example_idx},
        "heads": heads,
        "paper": PAPER,
    }
    if args.meta is not None:
        measured["meta_eval"] = meta_rows(args.meta)
    names = [row["model"] for row in ranking]
    figures = {
        "ladder": ladder_figure(rows),
        "methods": plotting.uds_bar(
            {name: results[name] for name in names},
            roles={name: zoo.role(name) for name in names},
            title="Unlearning methods by UDS, each bar split into measured erasure and the clipped part",
        ),
        "ke_share": ke_share_figure(ke),
        "example_curves": plotting.example_curves(results[example_model], example_idx),
        "rmu_onset": rmu_figure(rmu, onsets, tau),
        "heads": heads_fig,
    }
    for fig in figures.values():
        fig.update_layout(template="plotly_white")
    args.figures.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_no_nan(measured), indent=1, default=float, allow_nan=False)
    (args.figures / "measured.json").write_text(text + "\n")
    for path in write_pngs(figures, args.figures):
        logger.info("wrote %s", path)
    print(json.dumps({k: measured[k] for k in ("ranking", "example")}, indent=1))


if __name__ == "__main__":
    main()

"""The ``uds-lens`` command line: a thin layer over the library (each command is one public function call)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from uds_lens.cli_options import (
    DEFAULTS,
    DataOption,
    DeviceOption,
    DtypeOption,
    RetainOption,
    RunOptions,
    VerboseOption,
    takes_run_options,
)
from uds_lens.config import ConfigError, check_choice

app = typer.Typer(
    help="Audit LLM unlearning from the inside: the Unlearning Depth Score and layer diagnostics.",
    no_args_is_help=True,
    add_completion=False,
)
zoo_app = typer.Typer(
    help="The embedded default: a synthetic fictitious-author world and a trained Llama zoo.",
    no_args_is_help=True,
)
app.add_typer(zoo_app, name="zoo")


def _fmt(value: object, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) if rows else len(c) for c in columns}
    typer.echo("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        typer.echo("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )


def _unlearned_models(values: list[str]) -> dict[str, str]:
    """``--unlearned`` values as ``{result name: path}``: ``NAME=PATH`` names a model (either side may contain ``=``,
    see `names.split_named`), a bare path is named after its directory (parent directories added where two
    basenames clash, see `names.result_names`)."""
    from uds_lens.checkpoints.names import result_names, split_named
    from uds_lens.result_store import check_result_name

    named: dict[str, str] = {}
    plain: list[str] = []
    for value in values:
        split = split_named(value)
        if split is not None:
            name, path = split
            check_result_name(name)
            if name in named:
                raise ConfigError(f"--unlearned names {name!r} twice; give each NAME=PATH a distinct NAME.")
            named[name] = path
        else:
            plain.append(value)
    automatic = result_names(plain) if plain else {}
    clash = sorted(set(named) & set(automatic))
    if clash:
        raise ConfigError(
            f"--unlearned: the name(s) {clash} are given with NAME=PATH and also taken by a path's "
            "basename; choose other names."
        )
    return {**automatic, **named}


@app.command()
@takes_run_options(stage2_default="all")
def score(
    *,
    full: Annotated[
        str, typer.Option(help="Full model: local HF directory, .gguf file, or hub id (the patch target).")
    ],
    retain: RetainOption = None,
    unlearned: Annotated[
        list[str],
        typer.Option(
            help="Unlearned model(s); repeat the option for several. NAME=PATH "
            "names the result directory (default: the model directory's name)."
        ),
    ],
    data: DataOption,
    out: Annotated[
        Path,
        typer.Option(
            help="Output directory; one sub-directory per unlearned model. A saved result "
            "there is reused only when full, retain and unlearned weights, data, --limit, "
            "settings and the Stage 1 values are all identical (tau is re-applied); a result of "
            "other inputs (another run's) is refused unless --force; a damaged one is recomputed, "
            "saying why."
        ),
    ],
    run: RunOptions,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Recompute every model, even one with a reusable result, and replace other runs' results.",
        ),
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Score unlearned models with UDS (S1 computed once and cached) and write summary/examples/layers files.

    UDS (0 = the knowledge is as recoverable as in full, 1 = its layers carry no more of it than retain's) =
    measured part + clipped part: the measured part comes from the knowledge-encoding layers where the unlearned
    model's patch removes at most what the retain model's removes (d2 <= d1, each at its ratio d2/d1), the clipped
    part from those where it removes more (d2 > d1, each counted as 1).
    A 1 is erasure like retain only when it comes from the measured part; from the clipped part it is
    over-disruption of the forget answer, which is damage only where a control (utility) shows it. The table
    prints both parts, their 95% CIs and the excess disruption; bf16/fp16 runs say what ran in fp32 and why.

    OUT/NAME is reused, not recomputed, only when it was computed from identical inputs (the same full, retain and
    unlearned weights by content, the same data and --limit, the same settings; tau is re-applied to the saved
    deltas; the same Stage 1 values, by digest): the run then says "reusing NAME: identical inputs". A result of
    other inputs is another run's: it is refused before any model loads, naming what differs, unless --force. A
    result that fails its file digests, or was computed from other Stage 1 values (a corrupt S1 cache), is
    recomputed with a warning saying why. Each result is written to a temporary directory and renamed into place
    under a lock. A model that needs its own Python code (an auto_map) is refused: uds_lens never runs it.
    """
    _setup_logging(verbose)
    config = run.config(retain)
    # The door: every checkpoint made a Checkpoint before the model libraries are imported (a mistyped path fails
    # in a second, in one line) and handed on as it is; score_models checks --out, --cache-dir and --limit next.
    from uds_lens.checkpoints.checkpoint import Checkpoint

    def door(path: str, role: str) -> Checkpoint:
        return Checkpoint.resolve(path, outside_weights=run.allow_outside_weights, role=role)

    checkpoints = door(full, "full"), None if run.no_retain or retain is None else door(retain, "retain")
    models = {name: door(path, "unlearned") for name, path in _unlearned_models(unlearned).items()}
    from uds_lens.scoring import score_models

    results = score_models(
        *checkpoints,
        models,
        data,
        out_dir=out,
        config=config,
        cache_dir=run.cache_dir,
        limit=run.limit,
        force=force,
    )
    from uds_lens.plotting.report import record_roles, result_role

    # the report lists these models with their roles, in this table's order
    record_roles(out, {name: result_role(result) or "unlearned" for name, result in results.items()})
    for name, result in results.items():
        if result.meta.get("reused"):
            typer.echo(f"reusing {name}: {result.meta['reused']}")
    from uds_lens.display import SPLIT_LEGEND, UDS_COLUMNS, precision_text, span_notes, table_row

    rows = [table_row(name, result.summary) for name, result in results.items()]
    columns = ["model", *UDS_COLUMNS, "scored", "no_ke", "skipped", "s2_s"]
    if run.no_retain:
        columns = ["model", "mean_d2", "scored", "skipped", "s2_s"]
        typer.echo("retain-free mode: d2 is unnormalised and not comparable with UDS.")
    _print_table(rows, columns)
    if not run.no_retain:
        typer.echo(SPLIT_LEGEND)
    for note in span_notes(sorted({form for r in results.values() for form in r.meta.get("forms", [])})):
        typer.echo(note)
    for name, result in results.items():  # bf16/fp16: what ran in fp32, why, and what it cost
        precision = precision_text(result.precision, result.summary.get("timings"))
        if precision:
            typer.echo(f"precision of {name}: {precision}")
    typer.echo(f"results in {out}")


@app.command()
@takes_run_options(stage2_default="ke")
def sweep(
    *,
    full: Annotated[str, typer.Option(help="Full model: local HF directory or hub id (the patch target).")],
    retain: RetainOption = None,
    data: DataOption,
    out: Annotated[Path, typer.Option(help="Output directory: NAME/ per model, sweep.csv, sweep_eval.json.")],
    models: Annotated[
        Path | None, typer.Option(help="Model list: `name,path_or_id` CSV rows or one path per line.")
    ] = None,
    registry: Annotated[
        str | None, typer.Option(help="A shipped registry (tofu-llama-3.2-1b) or a registry CSV.")
    ] = None,
    methods: Annotated[
        str | None, typer.Option(help="Registry methods to keep, comma-separated (e.g. npo,rmu).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Ray workers; 1 = in-process (default: one per GPU/CPU slot).")
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster: auto | HOST:PORT (default: a local cluster).")
    ] = None,
    gpus_per_worker: Annotated[
        float | None, typer.Option(help="GPUs per worker (default 1 when there are GPUs).")
    ] = None,
    cpus_per_worker: Annotated[
        int | None,
        typer.Option(
            help="CPU slots (torch threads on CPU) per Ray worker (default 1); in-process, its torch threads "
            "(default: every core)."
        ),
    ] = None,
    max_retries: Annotated[
        int, typer.Option(help="Retries of a model whose worker died before it is reported failed.")
    ] = 2,
    compare_published: Annotated[
        bool, typer.Option(help="Add the published UDS, the difference and a scatter.")
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            help="Recompute every model, even when its stored result is current, and replace other runs' results."
        ),
    ] = False,
    run: RunOptions,
    verbose: VerboseOption = False,
) -> None:
    """Score many unlearned models (a model list or a registry) on Ray workers, or in-process with --workers 1.

    A finished model is reused only when its stored fingerprints (full, retain, data, settings, its own weights,
    the Stage 1 values) match this run; a saved result of other inputs is refused unless --force; a model whose
    worker dies is retried on another worker; a model that fails is reported in sweep.csv with its error and the
    sweep goes on, and the command exits 1 once the table is written.
    """
    from uds_lens.sweep.driver import sweep as run_sweep

    _setup_logging(verbose)
    config = run.config(retain)
    table = run_sweep(
        full,
        None if run.no_retain else retain,
        data,
        out,
        models_to_score=models,
        registry=registry,
        methods=methods.split(",") if methods else None,
        config=config,
        workers=workers,
        address=address,
        gpus_per_worker=gpus_per_worker,
        cpus_per_worker=cpus_per_worker,
        max_retries=max_retries,
        cache_dir=run.cache_dir,
        limit=run.limit,
        force=force,
        compare_published=compare_published,
        outside_weights=run.allow_outside_weights,
    )
    columns = ["name", "status", "uds", "ci_low", "ci_high", "uds_clipped", "excess_disruption"]
    columns += ["n_scored", "s2_seconds"]
    if compare_published:
        columns += ["published_uds", "uds_minus_published"]
    _print_table(table.to_dict("records"), columns + ["error"])
    typer.echo(f"results in {out}")
    failed = table.loc[~table["status"].isin(["scored", "reused"]), "name"].tolist()
    if failed:
        # the table is written; the exit status tells a script that not every model has a result
        typer.echo(f"error: {len(failed)} model(s) have no result: {', '.join(map(str, failed))}", err=True)
        raise typer.Exit(1)


def _build_threads(threads: int | None, size: str) -> int:
    """The threads a zoo is built with: the ones asked for, else the size's own (`ZooSize.threads`), else 2.

    A zoo's models are reused only when built with the same threads, so the default has to be the one its size is
    built with everywhere (the notebooks and the docs build the smollm2 zoo with one thread)."""
    if threads is not None:
        return threads
    from uds_lens.zoo.recipe import SIZES

    known = SIZES.get(size)
    return known.threads if known is not None and known.threads is not None else 2


@zoo_app.command("build")
def zoo_build(
    out: Path | None = typer.Option(
        None, help="Zoo directory (resumable: valid models are reused; default ~/.cache/uds_lens/zoo-SIZE)."
    ),
    size: str = typer.Option(
        "test", help="test | default | notebook | smollm2 (fine-tuned from the pretrained SmolLM2-135M)."
    ),
    seed: int = typer.Option(0),
    threads: int | None = typer.Option(
        None,
        help="torch threads during the build (results depend on it; default 2, or the size's own: 1 for smollm2).",
    ),
    retain_data: Path | None = typer.Option(None, help="Your own retain QA set (published schema)."),
    forget_data: Path | None = typer.Option(None, help="Your own forget QA set (published schema)."),
    holdout_data: Path | None = typer.Option(
        None, help="Your own holdout QA set (default: carved from retain)."
    ),
    pools: bool = typer.Option(True, help="Also build the meta-evaluation P/N pools."),
    pool_size: int | None = typer.Option(
        None, min=1, help="Models in each pool (P and N; default: the size's). The paper used 30 + 30."
    ),
    sweep: list[float] | None = typer.Option(
        None,
        help="Learning-rate factor of an unlearning sweep for the robustness pool (repeat the option; "
        "default: the size's).",
    ),
    device: str = typer.Option("cpu", help="Where the models train: cpu, or cuda (a GPU)."),
    overwrite: bool = typer.Option(
        False, help="Replace a zoo in OUT built from other data or another shape."
    ),
    base: str | None = typer.Option(
        None,
        help="Fine-tune every model from this pretrained Llama (directory, .gguf "
        "or hub id) with its own tokenizer, instead of a base trained from "
        "scratch.",
    ),
) -> None:
    """Build the synthetic world, the tokenizer and the trained/unlearned Llama zoo."""
    from uds_lens.files import zoo_root
    from uds_lens.zoo.build import build_zoo

    out = out if out is not None else zoo_root(size)
    zoo = build_zoo(
        out,
        size=size,
        seed=seed,
        threads=_build_threads(threads, size),
        retain_data=retain_data,
        forget_data=forget_data,
        holdout_data=holdout_data,
        pools=pools,
        overwrite=overwrite,
        base=base,
        pool_size=pool_size,
        sweep=sweep or None,
        device=device,
    )
    _print_table(zoo.models, ["name", "role", "seen_forget_fraction", "method"])
    typer.echo(f"zoo in {out}")


@app.command()
def demo(
    out: Path = typer.Option(Path("demo_out"), help="Where results and report.html go."),
    zoo_dir: Path | None = typer.Option(None, help="Zoo directory (default ~/.cache/uds_lens/zoo-SIZE)."),
    size: str = typer.Option("default", help="Zoo size: test | default."),
    threads: int | None = typer.Option(
        None, help="torch threads (default 2, or the size's own: 1 for smollm2)."
    ),
    no_preview: bool = typer.Option(
        False, "--no-preview", help="Do not score the test-size zoo first while the requested zoo is unbuilt."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log more, and show per-model loading bars."),
) -> None:
    """Build or reuse the zoo, score every zoo model with UDS, print the table, write report.html.

    On a first run the default zoo trains for several minutes; the test-size zoo is scored first (about two
    minutes) so a first table appears early, then the default zoo's.
    """
    import time

    from uds_lens.demo import run_demo

    _setup_logging(verbose)
    started = time.perf_counter()
    from uds_lens.display import SPLIT_LEGEND, UDS_COLUMNS, uds_cells

    columns = ["model", "role", "seen_forget_fraction", *UDS_COLUMNS, "n_scored", "n_no_ke", "n_skipped"]

    def show(table) -> None:
        def cells(row: dict) -> dict:
            cis = {key: (row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high"))
                   for key in ("uds_unclipped", "uds_clipped", "excess_disruption")}  # fmt: skip
            return uds_cells(row["uds"], (row["ci_low"], row["ci_high"]), row["uds_clipped"],
                             row["uds_clipped_share"], row["excess_disruption"], row.get("uds_unclipped"), cis)  # fmt: skip

        rows = [{**row, **cells(row)} for row in table.to_dict("records")]
        _print_table(rows, columns)
        typer.echo(SPLIT_LEGEND)

    def preview(table, zoo_root: Path) -> None:
        typer.echo(
            f"first table, on the test-size zoo ({zoo_root}), after {time.perf_counter() - started:.0f} s; "
            f"the {size} zoo trains next:"
        )
        show(table)

    table = run_demo(
        out,
        zoo_dir=zoo_dir,
        size=size,
        threads=_build_threads(threads, size),
        on_preview=None if no_preview else preview,
    )
    typer.echo(f"UDS on the {size} zoo, after {time.perf_counter() - started:.0f} s:")
    show(table)
    typer.echo(f"report: {out / 'report.html'}")


@app.command()
def diagnose(
    full: str = typer.Option(...),
    retain: str = typer.Option(...),
    unlearned: list[str] = typer.Option(..., help="Unlearned model(s); repeat the option."),
    data: str = typer.Option(...),
    out: Path = typer.Option(...),
    methods: list[str] | None = typer.Option(None, help="Subset of methods (default: all)."),
    sites: list[str] | None = typer.Option(None, help=f"Component-patching sites (default {DEFAULTS.site})."),
    tau: float = typer.Option(DEFAULTS.tau),
    dtype: str | None = typer.Option(None),
    device: str | None = typer.Option(None),
    tuned_lens_steps: int = typer.Option(200, help="Training steps of the tuned lens translators."),
    calibration: str | None = typer.Option(
        None, help="QA set the tuned lens trains on (e.g. the retain set)."
    ),
) -> None:
    """UDS next to logit/tuned lens, CKA, RSA, PWCCA, Fisher and probing; component patching; case studies."""
    from uds_lens.analysis import diagnose as diagnosis_module
    from uds_lens.data import load_examples

    for option, names, known in (
        ("--methods", methods, diagnosis_module.METHODS),
        ("--sites", sites, diagnosis_module.SITES),
    ):
        for name in names or ():
            check_choice(option, name, known)
    named = _unlearned_models(unlearned)
    load_examples(data)  # read and decoded before the first model loads
    diagnosis = diagnosis_module.diagnose(
        full,
        retain,
        named,
        data,
        methods=tuple(methods) if methods else diagnosis_module.METHODS,
        sites=tuple(sites) if sites else (DEFAULTS.site,),
        tau=tau,
        dtype=dtype,
        device=device,
        tuned_lens_steps=tuned_lens_steps,
        calibration=calibration,
        progress=True,
        out_dir=out,  # checked apart from every input and writable before any model loads, saved at the end
    )
    typer.echo(diagnosis.scores.to_string(float_format=lambda v: f"{v:.3f}"))
    for line in diagnosis.clipped_lines():
        typer.echo(line)
    typer.echo(f"results in {out}; those examples in clipped_examples.csv")


@app.command()
def report(
    results_dir: Path = typer.Argument(..., help="Directory written by `score`, `diagnose` or `demo`."),
    out: Path | None = typer.Option(None, help="HTML file (default RESULTS_DIR/report.html)."),
    force: bool = typer.Option(False, "--force", help="Replace a file at --out that is not a report."),
    figures: list[str] | None = typer.Option(
        None,
        help="Also write every figure as png, pdf or svg (repeat for several) to REPORT_figures/ beside the page, "
        "numbered as on it, with captions.txt; rendered by kaleido (the figures extra) or a local Chrome/Chromium.",
    ),
) -> None:
    """One self-contained HTML page (Plotly figures + tables, provenance, every caption with its basis) from saved
    results; never over another file."""
    from uds_lens.outputs import check_report_apart
    from uds_lens.plotting.export import STATIC_FORMATS
    from uds_lens.plotting.report import write_report

    for form in figures or ():
        check_choice("--figures", form, STATIC_FORMATS)  # before any result is read
    if out is not None and force:  # --force replaces a file that is no report, never one the report reads
        check_report_apart(out, results_dir)
    page = write_report(results_dir, out, force=force, figures=tuple(figures or ()))
    typer.echo(str(page))
    if figures:
        typer.echo(f"figures in {page.with_name(f'{page.stem}_figures')}")


@app.command()
def evaluate(
    zoo: Path = typer.Option(..., help="Zoo directory (manifest.json)."),
    out: Path = typer.Option(...),
    max_new_tokens: int = typer.Option(200),
    batch_size: int = typer.Option(16),
) -> None:
    """Every metric (output-level, MIA, UDS, white-box) for every zoo model: OUT/metrics.csv (resumable)."""
    from uds_lens.meta_eval.runner import evaluate_zoo
    from uds_lens.meta_eval.scorers import zoo_scorers
    from uds_lens.outputs import check_zoo_complete

    check_zoo_complete(zoo, out)
    uds_fn, white_box = zoo_scorers(zoo)
    table = evaluate_zoo(
        zoo, out, uds_fn=uds_fn, white_box_fns=white_box, batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    typer.echo(table.to_string(float_format=lambda v: f"{v:.3f}"))


@app.command("meta-eval")
def meta_eval(
    zoo: Path = typer.Option(..., help="Zoo directory with P/N pools (uds-lens zoo build --pools)."),
    out: Path = typer.Option(...),
    max_new_tokens: int = typer.Option(200),
    batch_size: int = typer.Option(16),
    metric: list[str] | None = typer.Option(
        None,
        "--metric",
        help="A row of the table (repeat the option; default: the paper's 20). Any name of the metric registry.",
    ),
    robustness_model: list[str] | None = typer.Option(
        None,
        "--robustness-model",
        help="An unlearned model to attack (repeat the option; default: every unlearned and sweep model). A "
        "smaller robustness pool for a CPU: each attacked model is scored twice more with every metric.",
    ),
) -> None:
    """Faithfulness (P/N AUC) and robustness (NF4 quantisation, relearning) of every metric: OUT/meta_eval.csv."""
    from uds_lens.meta_eval.paper import compare_with_paper
    from uds_lens.meta_eval.runner import run_meta_eval
    from uds_lens.meta_eval.scorers import zoo_scorers
    from uds_lens.metrics import registry
    from uds_lens.outputs import check_zoo_complete

    unknown = [name for name in metric or () if name not in registry.names()]
    if unknown:
        raise typer.BadParameter(
            f"unknown {unknown}; registered: {', '.join(registry.names())}", param_hint="--metric"
        )
    check_zoo_complete(zoo, out)
    uds_fn, white_box = zoo_scorers(zoo)
    table = run_meta_eval(
        zoo,
        out,
        uds_fn=uds_fn,
        white_box_fns=white_box,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        metrics=metric or None,
        robustness_models=robustness_model or None,
    )
    typer.echo("this pool next to the paper's Table 3 (Llama-3.2-1B, TOFU forget10):")
    typer.echo(compare_with_paper(table).to_string(float_format=lambda v: f"{v:.3f}"))
    typer.echo(
        json.dumps({"meta_eval": str(out / "meta_eval.csv"), "vs_paper": str(out / "meta_eval_vs_paper.csv")})
    )


@app.command()
def annotate(
    *,
    data: Annotated[
        str, typer.Option(help="Raw forget set: JSON list / JSONL of records with question and answer.")
    ],
    out: Annotated[
        Path, typer.Option(help="Annotated records (JSON list) for `score --data`; summary beside it.")
    ],
    full: Annotated[str | None, typer.Option(help="Full model: with --retain, contrastive spans.")] = None,
    retain: Annotated[
        str | None,
        typer.Option(help="Retain (or any reference) model; alone: its surprise. No model: lexical."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Re-annotate records that already have prefix and entity.")
    ] = False,
    dtype: DtypeOption = None,
    device: DeviceOption = None,
    batch_size: Annotated[int, typer.Option(help="Records per forward pass.")] = 16,
    verbose: VerboseOption = False,
) -> None:
    """Give every question/answer record a prefix and an entity span that `score` accepts as they are.

    Records that cannot be split well get entity "" (score skips them as empty_entity) and annotation_status
    "unsplit"; each record has a confidence and a short reason. Existing prefix/entity are kept unless --overwrite.
    """
    from uds_lens.annotation import AnnotateConfig, summary_path
    from uds_lens.annotation import annotate as annotate_records

    _setup_logging(verbose)
    if full is not None and retain is None:
        raise typer.BadParameter(
            "--full needs --retain (alone, a model that knows the facts gives no signal)."
        )
    config = AnnotateConfig(batch_size=batch_size)  # checked before anything is read
    result = annotate_records(
        data, full, retain, overwrite=overwrite, config=config, dtype=dtype, device=device, out=out
    )
    summary = result.summary
    counts = ", ".join(f"{status} {n}" for status, n in summary["counts"].items())
    typer.echo(f"{summary['n_records']} records ({summary['mode']}): {counts}")
    typer.echo(f"annotated records in {out}; summary in {summary_path(out)}")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that describe bad input and say how to fix it: printed as one line, not as a traceback."""
    from uds_lens.checkpoints.compatibility import ModelMismatchError
    from uds_lens.checkpoints.folder import ModelLoadError
    from uds_lens.data import DataError, TokenizerError
    from uds_lens.failures import NonFiniteScoreError
    from uds_lens.meta_eval.attacks import QuantisationError
    from uds_lens.result_store import OutputConflictError, ResultIntegrityError, ResultNameError
    from uds_lens.sweep.lists import SweepError
    from uds_lens.zoo.recipe import ZooBuildError
    from uds_lens.zoo.world import ZooDataError
    from uds_lens.zoo_manifest import ManifestError

    return (
        DataError,
        TokenizerError,
        ModelLoadError,
        ModelMismatchError,
        ZooBuildError,
        ZooDataError,
        QuantisationError,
        ConfigError,
        NonFiniteScoreError,
        ResultIntegrityError,
        ResultNameError,
        OutputConflictError,
        SweepError,
        ManifestError,
    )


def _quiet_model_loading(argv: list[str]) -> None:
    """Hide Hugging Face's per-model "Loading weights" bars unless ``--verbose``; uds_lens's own tqdm bars stay.

    huggingface_hub reads the variable when it is first imported, which the commands do lazily, after this; where
    transformers is already imported (``main()`` called in a running process), its switch is turned off directly.
    """
    if "--verbose" not in argv and "-v" not in argv:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        loaded = sys.modules.get("transformers.utils.logging")
        if loaded is not None:
            loaded.disable_progress_bar()


def _line_buffered_output() -> None:
    """Flush stdout and stderr at every line, also into a pipe or a log file (where Python would otherwise buffer
    them in blocks): progress lines and tables appear when they are ready, not when the command ends."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def main() -> None:
    """The console entry point: runs the app; a user error exits 2 with its message (no traceback)."""
    _line_buffered_output()
    _quiet_model_loading(sys.argv[1:])
    try:
        app()
    except Exception as error:
        # The errors of the light modules first: a mistyped path reports without importing the model libraries.
        from uds_lens.checkpoints.folder import ModelLoadError
        from uds_lens.data import DataError
        from uds_lens.files import os_error_line

        # an OSError is the operating system's: one line, its path and what to do
        if not isinstance(error, (ModelLoadError, DataError, ConfigError, OSError)) and not isinstance(
            error, _user_errors()
        ):
            raise
        typer.echo(f"error: {os_error_line(error) if isinstance(error, OSError) else error}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()

"""The command-line options several `uds-lens` commands share, declared once.

Each option is an ``Annotated`` alias (its help; the choices read from `uds_lens.config`'s tuples); a default stays
at the parameter (typer's rule for ``Annotated`` options) and is read from `DEFAULTS`, the paper's settings. The
options `score` and `sweep` both take after their own are the fields of one `RunOptions`, which
`takes_run_options` gives each of the two commands (typer has no option groups). Like config.py, this module
imports no torch, so ``--help`` stays instant.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer

from uds_lens.config import DTYPE_NAMES, ENGINES, SCOPES, SITES, STAGE2_CELLS, UDSConfig

DEFAULTS = UDSConfig()

# The inputs and UDS settings of `score` and `sweep` (dtype, device and verbose serve `annotate` too).
RetainOption = Annotated[
    str | None, typer.Option(help="Retain model (Stage-1 source); omit with --no-retain.")
]
DataOption = Annotated[
    str,
    typer.Option(
        help="Forget set: JSON list / JSONL file, a zoo's zoo:forget, a hub dataset id, or a benchmark's set by name "
        "(hf:DATASET/CONFIG:SPLIT, a hub id or a local copy: hf:muse-bench/MUSE-News/knowmem:forget_qa)."
    ),
]
TauOption = Annotated[float, typer.Option(help="KE threshold on d1, in nats (strict >).")]
ScopeOption = Annotated[str, typer.Option(help=f"Patch scope: {' | '.join(SCOPES)}.")]
SiteOption = Annotated[str, typer.Option(help=f"Hook site: {' | '.join(SITES)}.")]
# DTYPE_NAMES lists each dtype's name followed by its short spelling
_DTYPE_CHOICES = " | ".join(f"{name} ({short})" for name, short in zip(DTYPE_NAMES[::2], DTYPE_NAMES[1::2]))
DtypeOption = Annotated[
    str | None, typer.Option(help=f"{_DTYPE_CHOICES} (default fp32; on CUDA bf16, fp32 with --dtype fp32).")
]
PrecisionCheckOption = Annotated[
    bool,
    typer.Option(
        help="bf16/fp16: take every KE and clip decision in fp32, and run in fp32 the examples whose UDS rounding "
        f"could move by more than {DEFAULTS.precision_tolerance:g} (off: only count the decisions rounding could "
        "flip; the result says how many)."
    ),
]
DeviceOption = Annotated[str | None, typer.Option(help="cpu | cuda (default: cuda when available).")]
BatchSizeOption = Annotated[
    int | None, typer.Option(help="Examples per batch (default: chosen from free memory).")
]
LimitOption = Annotated[int | None, typer.Option(help="Score only the first N examples.")]
PublishedCompatOption = Annotated[
    bool, typer.Option(help="Reproduce the published implementation's numbers.")
]
CacheDirOption = Annotated[Path | None, typer.Option(help="S1 cache directory (default ~/.cache/uds_lens).")]
NoRetainOption = Annotated[bool, typer.Option("--no-retain", help="Retain-free mode: d2 only, unnormalised.")]
OutsideWeightsOption = Annotated[
    bool,
    typer.Option("--allow-outside-weights", help="Accept weight shards an index names outside its folder."),
]
EngineOption = Annotated[str, typer.Option(help=f"{' | '.join(ENGINES)} (the one-forward-per-layer oracle).")]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v")]


_STAGE2_HELP = (
    f"{' | '.join(STAGE2_CELLS)}: Stage 2 on every (example, layer) cell (the layer curves) or only on the KE cells "
    "d1 > tau, the only ones UDS reads (same UDS, less work; d2 NaN elsewhere). Default here: "
)


@dataclass(frozen=True)
class RunOptions:
    """The options `score` and `sweep` share, declared once: each field is an option of both commands (its help in
    the annotation, its default here), listed in this order where the command's ``run`` parameter stands
    (`takes_run_options`: typer has no option groups, so the fields join the command's signature).
    ``stage2_cells`` takes each command's own default, named in its help."""

    tau: TauOption = DEFAULTS.tau
    scope: ScopeOption = DEFAULTS.patch_scope
    site: SiteOption = DEFAULTS.site
    dtype: DtypeOption = DEFAULTS.dtype
    device: DeviceOption = DEFAULTS.device
    batch_size: BatchSizeOption = DEFAULTS.batch_size
    limit: LimitOption = None
    published_compat: PublishedCompatOption = DEFAULTS.published_compat
    cache_dir: CacheDirOption = None
    no_retain: NoRetainOption = False
    engine: EngineOption = DEFAULTS.engine
    stage2_cells: str | None = DEFAULTS.stage2_cells  # each command gives its own (`takes_run_options`)
    allow_outside_weights: OutsideWeightsOption = False
    precision_check: PrecisionCheckOption = DEFAULTS.precision_check

    def config(self, retain: str | None) -> UDSConfig:
        """The run's UDSConfig (UDSConfig checks the settings), after checking that retain is given or explicitly
        omitted."""
        if retain is None and not self.no_retain:
            raise typer.BadParameter("give --retain, or --no-retain for the retain-free (unnormalised) mode.")
        # the command line's strings as they are: UDSConfig is their one check (a ConfigError naming the option)
        settings: dict[str, Any] = {
            "tau": self.tau,
            "patch_scope": self.scope,
            "site": self.site,
            "published_compat": self.published_compat,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "device": self.device,
            "engine": self.engine,
            "stage2_cells": self.stage2_cells,
            "precision_check": self.precision_check,
        }
        return UDSConfig(**settings)


Command = Callable[..., None]


def takes_run_options(stage2_default: str) -> Callable[[Command], Command]:
    """Give the decorated command the options of `RunOptions` in place of its ``run`` parameter (typer reads the
    signature: ``--help`` lists them there), and call it with the `RunOptions` they make as ``run``."""
    hints = get_type_hints(RunOptions, include_extras=True)
    hints["stage2_cells"] = Annotated[
        str, typer.Option("--stage2-cells", help=f"{_STAGE2_HELP}{stage2_default}.")
    ]
    defaults = {field.name: field.default for field in fields(RunOptions)} | {"stage2_cells": stage2_default}
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[name])
        for name, default in defaults.items()
    ]

    def decorate(command: Command) -> Command:
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        at = [parameter.name for parameter in own].index("run")
        parameters = [*own[:at], *shared, *own[at + 1 :]]

        @functools.wraps(command)
        def with_run_options(**options: Any) -> None:
            command(run=RunOptions(**{name: options.pop(name) for name in defaults}), **options)

        with_run_options.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
        with_run_options.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return with_run_options

    return decorate

"""How figures read results: anything carrying UDS tables in, plain DataFrames out.

A figure takes a `Result`: a ``UDSResult``, a `SavedResult` (a result directory read back by
[`uds_lens.plotting.report`][uds_lens.plotting.report]), an ``ExampleView`` (one example of a result) or a bare long ``layers`` table; or
several of them (`Results`: a list or ``{name: result}``). They are typed with the real classes (``results.py``
imports no plotting, so plotting may import it) and read by attribute (``.layers`` / ``.examples`` / ``.summary``).
The tables:

- examples: ``idx, prompt_type, n_entity_tokens, n_ke, n_clipped, uds, uds_unclipped, uds_clipped,
  excess_disruption, status, skip_reason`` (+ ``question``, ``entity``; ``uds = uds_unclipped + uds_clipped``);
- layers (long, one row per example x layer x site): ``idx, layer, site, s0, baseline_score, s1_score, s2_score,
  d1, d2, ke, ler``; lens tables have the same ``idx, layer, d1, d2, ke, ler`` columns.

Nothing here computes UDS: KE masks come from the table's ``ke`` column or [`uds_lens.uds.ke_mask`][uds_lens.uds.ke_mask].
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import pandas as pd

from uds_lens.plotting.style import tau_text
from uds_lens.uds import ke_mask

if TYPE_CHECKING:  # figures read results by attribute; the result classes import plotting when they draw
    from uds_lens.example_view import ExampleView
    from uds_lens.results import UDSResult


@dataclass
class SavedResult:
    """One result directory read back, in the shape the figures take (``.examples``, ``.layers``, ``.summary``).

    Attributes:
        name: the result's name (its directory's for a ``diagnose``-only directory).
        path: the directory.
        result: what ``UDSResult.load`` gives back; None where only ``diagnose`` wrote (then the model UDS comes
            from ``scores.json``, without CI or per-example tables).
        scores: ``diagnose``'s ``scores.json`` (every white-box score of the model).
        layerwise: ``diagnose``'s ``layerwise.csv`` (``method, layer, erasure, weight``).
        components: ``diagnose``'s ``components.csv`` (``site, layer, mean_d1, mean_d2``).
    """

    name: str
    path: Path
    result: UDSResult | None = None
    scores: dict[str, Any] | None = None
    layerwise: pd.DataFrame | None = None
    components: pd.DataFrame | None = None

    @functools.cached_property
    def summary(self) -> dict[str, Any]:
        if self.result is not None:
            return self.result.summary
        uds = (self.scores or {}).get("uds")
        return {"name": self.name} if uds is None else {"name": self.name, "uds": uds}

    @property
    def examples(self) -> pd.DataFrame | None:
        return self.result.examples if self.result is not None else None

    @property
    def layers(self) -> pd.DataFrame | None:
        return self.result.layers if self.result is not None else None

    @property
    def uds(self) -> float:
        value = self.summary.get("uds")
        return float("nan") if value is None else float(value)


Result: TypeAlias = "UDSResult | SavedResult | ExampleView | pd.DataFrame"
"""One result as figures take it: its tables (a bare DataFrame is its long ``layers`` table)."""
Results: TypeAlias = "Result | Sequence[Result] | Mapping[str, Result]"
"""One result, a list of them (named by their ``summary["name"]``) or ``{name: result}``."""


@runtime_checkable
class HasExamples(Protocol):
    """Any object with an ``examples`` table: what [`model_frame`][uds_lens.plotting.models.model_frame] needs at least."""

    @property
    def examples(self) -> pd.DataFrame | None:
        """The per-example table (``idx, uds, status, ...``)."""


def result_tables(result: Result) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """``(layers, examples)`` of a result, or ``(layers, None)`` for a bare layers table."""
    if isinstance(result, pd.DataFrame):
        return result, None
    layers = getattr(result, "layers", None)
    if not isinstance(layers, pd.DataFrame):
        raise TypeError(
            f"expected a layers DataFrame or an object with a .layers DataFrame (a UDSResult), got {type(result).__name__}"
        )
    examples = getattr(result, "examples", None)
    return layers, examples if isinstance(examples, pd.DataFrame) else None


def named_results(results: Results | Mapping[str, HasExamples]) -> dict[str, Any]:
    """One result, a sequence of results or a ``{name: result}`` mapping as ``{name: result}``.

    A result is named by its ``summary["name"]``, else by its position (``"model 0"``).
    """
    if isinstance(results, Mapping):
        return {str(name): value for name, value in results.items()}
    if isinstance(results, pd.DataFrame) or hasattr(results, "layers") or hasattr(results, "examples"):
        return {_result_name(results, 0): results}
    if isinstance(results, Sequence) and not isinstance(results, str):
        return {_result_name(r, i): r for i, r in enumerate(results)}
    raise TypeError(
        f"expected a result, a list of results or a {{name: result}} mapping, got {type(results).__name__}"
    )


def _result_name(result: Result | HasExamples, position: int) -> str:
    summary = getattr(result, "summary", None)
    if isinstance(summary, Mapping) and summary.get("name"):
        return str(summary["name"])
    return f"model {position}"


def long_by_model(tables: Results, attribute: str = "layers") -> pd.DataFrame:
    """Per-model tables (``.{attribute}`` of each result) stacked into one with a ``model`` column.

    A DataFrame that already has a ``model`` column is returned as it is.
    """
    if isinstance(tables, pd.DataFrame) and "model" in tables.columns:
        return tables
    frames = []
    for name, value in named_results(tables).items():
        frame = value if isinstance(value, pd.DataFrame) else getattr(value, attribute, None)
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"model {name!r}: expected a DataFrame or an object with .{attribute}")
        frames.append(frame.assign(model=name))
    if not frames:
        raise ValueError("no results given")
    return pd.concat(frames, ignore_index=True)


def result_tau(result: Any, default: float) -> float:
    """The KE threshold a result was scored with (its ``settings``, or its summary's), else ``default``: the tau a
    figure of its ``ke`` column rests on, whatever tau the figure was called with."""
    settings = getattr(result, "settings", None)
    if not isinstance(settings, Mapping):
        summary = getattr(result, "summary", None)
        settings = summary.get("settings") if isinstance(summary, Mapping) else None
    tau = settings.get("tau") if isinstance(settings, Mapping) else None
    return default if tau is None else float(tau)


def result_dtype(result: Any) -> str | None:
    """The format a result's models ran in (``float32``, ``bfloat16`` ...), from its metadata or its summary; None
    where it records none (a bare table)."""
    for source in (getattr(result, "meta", None), getattr(result, "summary", None)):
        if isinstance(source, Mapping) and source.get("dtype"):
            return str(source["dtype"]).removeprefix("torch.")
    return None


def dtype_text(dtypes: Iterable[Any]) -> str | None:
    """The formats several results ran in, as a figure's basis names them (``"float32"``, ``"bfloat16, float32"``);
    None when none is known."""
    known = sorted({str(dtype) for dtype in dtypes if isinstance(dtype, str) and dtype})
    return ", ".join(known) if known else None


def clipped_part_by_layer(layers: pd.DataFrame, tau: float, weighted: bool = False) -> pd.Series:
    """Per layer, the part of its erasure that comes from clipped KE cells (``d2 > d1``, LER cut to 1).

    ``weighted=False``: the share of the layer's KE cells that are clipped, which is the part of its mean LER over KE
    cells ([`mean_ler_on_ke`][uds_lens.plotting.tables.mean_ler_on_ke]) they give, each adding exactly 1;
    ``weighted=True``: ``sum over clipped KE cells of d1 / sum over KE cells of d1``, their part of the d1-weighted
    (pooled) erasure of the layer, as ``layerwise.csv`` pools UDS. NaN for a layer without a KE cell.
    """
    ke = ke_cells(layers, tau).to_numpy()
    d1 = layers["d1"].to_numpy(dtype=float)
    clipped = ke & (layers["d2"].to_numpy(dtype=float) > d1)
    weight = np.where(ke, d1, 0.0) if weighted else ke.astype(float)
    frame = pd.DataFrame({"layer": layers["layer"].to_numpy(), "weight": weight, "clipped": clipped * weight})
    sums = frame.groupby("layer")[["weight", "clipped"]].sum()
    return (sums["clipped"] / sums["weight"].where(sums["weight"] > 0)).rename("clipped_part")


def count_text(counts: Iterable[Any]) -> str:
    """One count, or the range of several (``"24"``, ``"24–29"``): the n of a figure over several models."""
    values = sorted({int(count) for count in counts})
    if not values:
        return "0"
    return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"


def tau_of(results: Mapping[str, Any], default: float) -> str:
    """The tau of several results as a figure's basis names it: ``"tau = 0.05 nats"``, or each one's when they
    differ."""
    taus = {name: result_tau(result, default) for name, result in results.items()}
    if len(set(taus.values())) <= 1:
        return tau_text(next(iter(taus.values()), default))
    return "tau = " + ", ".join(f"{tau:g} ({name})" for name, tau in taus.items()) + " nats"


def ke_cells(layers: pd.DataFrame, tau: float) -> pd.Series:
    """The KE cells of a layers table: its ``ke`` column as the result computed it, else ``d1 > tau``."""
    if "ke" in layers.columns:
        return layers["ke"].fillna(False).astype(bool)
    return pd.Series(ke_mask(layers["d1"].to_numpy(dtype=float), tau), index=layers.index)


def mean_ler_on_ke(layers: pd.DataFrame, tau: float) -> pd.Series:
    """Mean of the table's ``ler`` per layer over its KE cells (the layer erasure profile of a model or a lens)."""
    return layers[ke_cells(layers, tau).to_numpy()].groupby("layer")["ler"].mean()

"""The result of component-level patching: scores per example, layer and component, and UDS over them.

[`ComponentResult`][uds_lens.component_result.ComponentResult] holds what [`uds_lens.components`][uds_lens.components] computes (patching one attention head, one entity
token or one patched position at a time) as ``[example, layer, component]`` tensors, and derives the UDS quantities
from them: ``d1 = baseline - s1``, ``d2 = baseline - s2``, KE cells ``d1 > tau``, ``LER = clip(d2 / d1, 0, 1)`` on
KE cells (NaN elsewhere), and UDS, ``sum_KE d1 * LER / sum_KE d1``, per example and per (layer, component).
Every one of them is computed by [`uds_lens.uds`][uds_lens.uds] (NumPy, float64), the only place the formula is written; the
tensors come back in the scores' dtype (float32), so ``d1``, ``d2``, ``ke`` and ``ler`` equal what float32 torch
arithmetic gives, and the UDS values are the float64 ones rounded to float32.

Every aggregate carries its support: [`ComponentResult.n_ke_cells`][uds_lens.component_result.ComponentResult.n_ke_cells] (per layer and component, the
examples whose cell is KE: what ``component_uds`` pools) and [`ComponentResult.n_examples`][uds_lens.component_result.ComponentResult.n_examples] (the examples with a
KE cell: what ``uds`` averages). A head's delta is a small part of its layer's (on the test zoo's NPO model the
90th percentile of per-head ``d1`` is 0.011 nats against a layer-level ``d1`` of 1-3 nats), so head patching has a
threshold of its own, [`HEAD_TAU`][uds_lens.component_result.HEAD_TAU] (0.01 nats), never silently the residual stream's ``tau``; token and
position patching keep the auditor's ``tau`` (a token's delta is on the scale of the span's: their mean is it).
A pooled cell resting on fewer than ``min_support`` KE cells is shown as too thin, not as a number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from uds_lens import display, uds
from uds_lens.config import DEFAULT_TAU, Engine

if TYPE_CHECKING:  # drawing only: core modules import no plotly
    import plotly.graph_objects as go

HEAD_TAU = 0.01
"""KE threshold of head patching, in nats (stated separately from the residual stream's ``tau``)."""
MIN_SUPPORT = 3
"""Fewest KE cells a pooled ``component_uds`` cell rests on before figures show it as a number."""


@dataclass
class ComponentResult:
    """Scores of one unlearned model per example, layer and component (head, entity token or patched position).

    Attributes:
        name: the unlearned model's result name.
        hook: the patched hook (``attn.hook_z``, ``hook_resid_post``, ...), inside ``blocks.{layer}``.
        axis: ``"head"``, ``"token"`` or ``"position"``: what the last tensor axis indexes.
        idx: dataset ``idx`` of each example row.
        layers: the patched layers (the middle axis).
        s0: ``[example]`` the clean full model's score.
        baseline: ``[example, layer, component]`` each engine's unpatched score (S0 for the naive engine; for
            ``axis="token"`` the clean log-prob of each token).
        s1 / s2: ``[example, layer, component]`` patched scores with retain / the unlearned model as source.
        valid: ``[example, component]`` False where a component does not exist for an example (an example with
            fewer entity tokens or patched positions than the longest); its cells are NaN.
        labels: per example, each component's name: the head number, or the token's text (``axis="token"``: the
            entity token read; ``axis="position"``: the token at the patched position).
        tau: KE threshold in nats ([`HEAD_TAU`][uds_lens.component_result.HEAD_TAU] for heads, the auditor's ``tau`` for tokens and positions);
            [`with_tau`][uds_lens.component_result.ComponentResult.with_tau] gives the same scores under another one.
        engine: ``fast`` or ``naive``.
        min_support: fewest KE cells behind a ``component_uds`` cell for figures to show its value.
        layer_tau: the layer-level KE threshold of the auditor that ran the patches, in nats: stated beside
            ``tau`` wherever the two differ (heads: 0.01 nats per head, layers 0.05), so a reader sees both.
    """

    name: str
    hook: str
    axis: str
    idx: list[int]
    layers: list[int]
    s0: Float[Tensor, " example"]
    baseline: Float[Tensor, "example layer component"]
    s1: Float[Tensor, "example layer component"]
    s2: Float[Tensor, "example layer component"]
    valid: Bool[Tensor, "example component"]
    labels: list[list[str]] = field(default_factory=list)
    tau: float = DEFAULT_TAU
    engine: Engine = "naive"
    min_support: int = MIN_SUPPORT
    layer_tau: float = DEFAULT_TAU

    @property
    def d1(self) -> Float[Tensor, "example layer component"]:
        """``baseline - s1`` ([`uds.deltas`][uds_lens.uds.deltas]): what patching retain in at this component removes (NaN where not
        ``valid``)."""
        return self._masked(self._tensor(uds.deltas(_array(self.baseline), _array(self.s1))))

    @property
    def d2(self) -> Float[Tensor, "example layer component"]:
        """``baseline - s2`` ([`uds.deltas`][uds_lens.uds.deltas]): what patching the unlearned model in at this component removes."""
        return self._masked(self._tensor(uds.deltas(_array(self.baseline), _array(self.s2))))

    @property
    def ke(self) -> Bool[Tensor, "example layer component"]:
        """Knowledge-encoding cells: ``d1 > tau`` ([`uds.ke_mask`][uds_lens.uds.ke_mask]: strict; NaN cells are never KE)."""
        return torch.from_numpy(uds.ke_mask(_array(self.d1), self.tau))

    @property
    def ler(self) -> Float[Tensor, "example layer component"]:
        """``clip(d2 / d1, 0, 1)`` ([`uds.layer_erasure_ratio`][uds_lens.uds.layer_erasure_ratio]) on KE cells, NaN elsewhere (outside KE the
        ratio is noise over noise)."""
        d1, d2 = _array(self.d1), _array(self.d2)
        ratio = np.where(uds.ke_mask(d1, self.tau), uds.layer_erasure_ratio(d1, d2), math.nan)
        return self._tensor(ratio)

    def _masked(self, values: Tensor) -> Tensor:
        return torch.where(self.valid[:, None, :], values, torch.full_like(values, math.nan))

    def _tensor(self, values: np.ndarray) -> Tensor:
        """A NumPy result of ``uds`` (float64) back as a tensor of the scores' dtype (float32 from the runs)."""
        return torch.from_numpy(np.ascontiguousarray(values)).to(self.s1.dtype)

    def _example_uds(self) -> Float[np.ndarray, " example"]:
        """[`uds.example_uds`][uds_lens.uds.example_uds] with every (layer, component) cell of an example as one of its layers."""
        n_examples = self.s1.shape[0]
        d1, d2 = _array(self.d1).reshape(n_examples, -1), _array(self.d2).reshape(n_examples, -1)
        return uds.example_uds(d1, d2, self.tau)

    @property
    def example_uds(self) -> Float[Tensor, " example"]:
        """Per example, UDS over all KE (layer, component) cells; NaN with none."""
        return self._tensor(self._example_uds())

    @property
    def component_uds(self) -> Float[Tensor, "layer component"]:
        """Per (layer, component), UDS over the examples where that cell is KE (d1-weighted); NaN where none is.

        For heads this is the answer to "did unlearning remove the fact where this head carried it": 0 = the
        head still carries it as in full, 1 = as absent as in retain. Computed by [`uds.example_uds`][uds_lens.uds.example_uds] with the
        examples as the summed axis (each (layer, component) cell in the role of an example).
        """
        n_examples, n_layers, n_components = self.s1.shape
        d1, d2 = _array(self.d1).reshape(n_examples, -1).T, _array(self.d2).reshape(n_examples, -1).T
        return self._tensor(uds.example_uds(d1, d2, self.tau).reshape(n_layers, n_components))

    @property
    def uds(self) -> float:
        """Component UDS of the model: the mean over [`n_examples`][uds_lens.component_result.ComponentResult.n_examples] examples (those with a KE cell) of their UDS
        over KE (layer, component) cells ([`uds.model_uds`][uds_lens.uds.model_uds]; NaN if no example has one). Not the layer-level
        UDS: another quantity, on other cells and usually fewer examples."""
        return uds.model_uds(self._example_uds())

    @property
    def n_ke_cells(self) -> Int[Tensor, "layer component"]:
        """Per (layer, component): how many examples' cells are KE, the support of [`component_uds`][uds_lens.component_result.ComponentResult.component_uds]."""
        return self.ke.sum(0)

    @property
    def n_examples(self) -> int:
        """Examples with at least one KE cell: the support of [`uds`][uds_lens.component_result.ComponentResult.uds]."""
        return int(self.ke.flatten(1).any(-1).sum())

    @property
    def clipped(self) -> dict[str, float]:
        """Over-disruption on the KE cells ([`uds.clipped_summary`][uds_lens.uds.clipped_summary]): ``clipped_share`` (``d2 > d1``,
        LER clipped to 1), ``clipped_median_ratio``, ``n_ke_cells``, ``n_clipped_cells``."""
        return uds.clipped_summary(_array(self.d1), _array(self.d2), self.tau)

    def with_tau(self, tau: float) -> ComponentResult:
        """The same scores under another KE threshold (nothing is run again)."""
        return replace(self, tau=tau)

    def thresholds_text(self) -> str:
        """``"KE: d1 > tau = 0.01 nats per head (layers: tau = 0.05 nats)"``: this result's threshold beside the
        layer-level one, side by side wherever either is shown."""
        text = f"KE: d1 > tau = {self.tau:g} nats per {self.axis}"
        return text if self.tau == self.layer_tau else f"{text} (layers: tau = {self.layer_tau:g} nats)"

    def table(self) -> pd.DataFrame:
        """One row per (layer, component): ``layer, <axis>, n_ke_cells, component_uds, mean_d1_ke, mean_d2_ke,
        mean_d1, mean_d2, n_clipped``.

        Which cells each column covers: ``n_ke_cells``, ``component_uds`` (NaN where fewer than ``min_support`` KE
        cells hold it up), ``mean_d1_ke``, ``mean_d2_ke`` and ``n_clipped`` the KE cells (``d1 > tau``) of that
        (layer, component), the ones the component UDS pools; ``mean_d1`` / ``mean_d2`` every example's cell.
        """
        n_layers, n_components = self.s1.shape[1:]
        support = self.n_ke_cells.numpy()
        pooled = self.component_uds.double().numpy()
        d1, d2 = _array(self.d1).astype(float), _array(self.d2).astype(float)
        ke = uds.ke_mask(d1, self.tau)
        clipped = uds.clipped_mask(d1, d2, self.tau).sum(0)

        def ke_mean(values: np.ndarray) -> np.ndarray:
            total = np.where(ke, values, 0.0).sum(0)
            return np.divide(total, support, out=np.full(total.shape, np.nan), where=support > 0)

        layer, component = np.meshgrid(np.asarray(self.layers), np.arange(n_components), indexing="ij")
        return pd.DataFrame(
            {
                "layer": layer.ravel(),
                self.axis: component.ravel(),
                "n_ke_cells": support.ravel(),
                "component_uds": np.where(support >= self.min_support, pooled, np.nan).ravel(),
                "mean_d1_ke": ke_mean(d1).ravel(),
                "mean_d2_ke": ke_mean(d2).ravel(),
                "mean_d1": np.nanmean(d1, axis=0).ravel(),
                "mean_d2": np.nanmean(d2, axis=0).ravel(),
                "n_clipped": clipped.ravel(),
            }
        )

    def frame(self) -> pd.DataFrame:
        """Long table ``idx, layer, <axis>, label, s0, baseline_score, s1_score, s2_score, d1, d2, ke, ler``.

        One row per existing (example, layer, component); the column names are those of ``UDSResult.layers``.
        """
        n_examples, n_layers, n_components = self.s1.shape
        example, layer, component = (
            grid.reshape(-1)
            for grid in torch.meshgrid(
                torch.arange(n_examples), torch.arange(n_layers), torch.arange(n_components), indexing="ij"
            )
        )
        keep = self.valid[example, component]
        example, layer, component = example[keep], layer[keep], component[keep]

        def column(values: Tensor) -> np.ndarray:
            return values[example, layer, component].double().numpy()

        labels = [
            self.labels[e][c] if self.labels else str(c) for e, c in zip(example.tolist(), component.tolist())
        ]
        return pd.DataFrame(
            {
                "idx": np.asarray(self.idx, dtype=int)[example.numpy()],
                "layer": np.asarray(self.layers, dtype=int)[layer.numpy()],
                self.axis: component.numpy(),
                "label": labels,
                "s0": self.s0[example].double().numpy(),
                "baseline_score": column(self.baseline),
                "s1_score": column(self.s1),
                "s2_score": column(self.s2),
                "d1": column(self.d1),
                "d2": column(self.d2),
                "ke": self.ke[example, layer, component].numpy(),
                "ler": column(self.ler),
            }
        )

    def figure(
        self, value: str = "component_uds", idx: int | None = None, title: str | None = None
    ) -> go.Figure:
        """Heatmap ``layer x component`` (``px.imshow``, y = layer); every cell's hover says what it rests on.

        Args:
            value: ``"component_uds"`` (sequential 0-1; each cell's count of KE cells written on it, a cell with
                fewer than ``min_support`` of them grey, marked "n<3"), or ``"d1"`` / ``"d2"`` (RdBu, midpoint 0;
                mean over examples, or one example with ``idx``).
            idx: one example (for ``d1``/``d2``); default the mean over examples.
            title: figure title (default: the model, the value and the hook); under it the figure states its basis:
                the examples, this result's KE threshold beside the layers', and the support.
        """
        n_examples = len(self.idx)
        support = self.n_ke_cells.numpy()
        basis = [f"n = {n_examples} examples", self.thresholds_text()]
        if value == "component_uds":
            grid = self.component_uds
            what = "component UDS over KE cells"
            basis.append(
                f"{int(support.sum())} KE cells from {self.n_examples} of {n_examples} examples; each cell's count "
                "written on it"
            )
        elif value in ("d1", "d2"):
            values = getattr(self, value)
            if idx is not None:
                grid = values[self.idx.index(idx)]
                what = f"{value} of example {idx}"
                basis[0] = "n = 1 example"
            else:
                grid = values.nanmean(0)
                what = f"mean {value} over every example (KE or not)"
        else:
            raise ValueError(f"value must be 'component_uds', 'd1' or 'd2', got {value!r}")
        from uds_lens.plotting.components import (
            component_heatmap,
        )  # drawing only: core modules import no plotly

        return component_heatmap(
            grid.double().numpy(),
            self.layers,
            self.axis,
            value,
            title=title or f"{self.name}: {what} ({self.hook})",
            support=support,
            min_support=self.min_support if value == "component_uds" else 0,
            basis=basis,
        )

    def _headline(self) -> str:
        n_examples, n_layers, n_components = self.s1.shape
        clipped = self.clipped
        return (
            f"{self.name}, {self.axis}s at {self.hook} ({self.engine} engine): {n_examples} examples x {n_layers} "
            f"layers x {n_components} {self.axis}s; {self.thresholds_text()}: {clipped['n_ke_cells']} of "
            f"{int(self.valid.sum()) * n_layers} cells, from {self.n_examples} examples; component UDS "
            f"{display.number(self.uds)} over those {self.n_examples}; clipped d2 > d1: "
            f"{display.share(clipped['clipped_share'])}"
        )

    def __repr__(self) -> str:
        return f"ComponentResult({self._headline()})"

    def _repr_html_(self) -> str:
        """The notebook view: the headline, then the (layer, component) cells with enough support."""
        table = self.table()
        shown = table[table["n_ke_cells"] >= self.min_support].sort_values("n_ke_cells", ascending=False)
        rows = [
            [
                int(row.layer),
                int(getattr(row, self.axis)),
                int(row.n_ke_cells),
                display.number(row.component_uds),
                display.number(row.mean_d1_ke),
                display.number(row.mean_d2_ke),
                int(row.n_clipped),
            ]
            for row in shown.head(12).itertuples()
        ]
        header = ["layer", self.axis, "KE cells", "component UDS", "mean d1", "mean d2", "clipped"]
        thin = int(((table["n_ke_cells"] > 0) & (table["n_ke_cells"] < self.min_support)).sum())
        notes = [
            f"{len(shown)} of {len(table)} cells rest on >= {self.min_support} KE cells (largest support first, "
            f"12 shown); {thin} more have 1-{self.min_support - 1}, too few to read. Every column but the first two "
            f"is over the same KE cells ({self.thresholds_text()}): the component UDS, the mean d1 and d2 it pools, "
            "and how many of them are clipped (d2 > d1). with_tau(...) changes the threshold."
        ]
        return display.html_table(f"ComponentResult {self._headline()}", header, rows, notes)


def _array(values: Tensor) -> np.ndarray:
    """A CPU tensor as the NumPy array ``uds`` computes on (no copy for a CPU tensor)."""
    return values.detach().cpu().numpy()


__all__ = ["ComponentResult"]

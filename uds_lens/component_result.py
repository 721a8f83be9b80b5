"""The result of component-level patching: scores per example, layer and component, and UDS over them.

:class:`ComponentResult` holds what :mod:`uds_lens.components` computes (patching one attention head, one entity
token or one patched position at a time) as ``[example, layer, component]`` tensors, and derives the UDS quantities
from them: ``d1 = baseline - s1``, ``d2 = baseline - s2``, KE cells ``d1 > tau``, ``LER = clip(d2 / d1, 0, 1)`` on
KE cells (NaN elsewhere), and UDS, ``sum_KE d1 * LER / sum_KE d1``, per example and per (layer, component).
Every one of them is computed by :mod:`uds_lens.uds` (NumPy, float64), the only place the formula is written; the
tensors come back in the scores' dtype (float32), so ``d1``, ``d2``, ``ke`` and ``ler`` equal what float32 torch
arithmetic gives, and the UDS values are the float64 ones rounded to float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from uds_lens import uds
from uds_lens.config import DEFAULT_TAU, Engine


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
        tau: KE threshold.
        engine: ``fast`` or ``naive``.
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

    @property
    def d1(self) -> Float[Tensor, "example layer component"]:
        """``baseline - s1`` (:func:`uds.deltas`): what patching retain in at this component removes (NaN where not
        ``valid``)."""
        return self._masked(self._tensor(uds.deltas(_array(self.baseline), _array(self.s1))))

    @property
    def d2(self) -> Float[Tensor, "example layer component"]:
        """``baseline - s2`` (:func:`uds.deltas`): what patching the unlearned model in at this component removes."""
        return self._masked(self._tensor(uds.deltas(_array(self.baseline), _array(self.s2))))

    @property
    def ke(self) -> Bool[Tensor, "example layer component"]:
        """Knowledge-encoding cells: ``d1 > tau`` (:func:`uds.ke_mask`: strict; NaN cells are never KE)."""
        return torch.from_numpy(uds.ke_mask(_array(self.d1), self.tau))

    @property
    def ler(self) -> Float[Tensor, "example layer component"]:
        """``clip(d2 / d1, 0, 1)`` (:func:`uds.layer_erasure_ratio`) on KE cells, NaN elsewhere (outside KE the
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
        """:func:`uds.example_uds` with every (layer, component) cell of an example as one of its layers."""
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
        head still carries it as in full, 1 = as absent as in retain. Computed by :func:`uds.example_uds` with the
        examples as the summed axis (each (layer, component) cell in the role of an example).
        """
        n_examples, n_layers, n_components = self.s1.shape
        d1, d2 = _array(self.d1).reshape(n_examples, -1).T, _array(self.d2).reshape(n_examples, -1).T
        return self._tensor(uds.example_uds(d1, d2, self.tau).reshape(n_layers, n_components))

    @property
    def uds(self) -> float:
        """Mean of the defined per-example scores (:func:`uds.model_uds`; NaN if none is defined)."""
        return uds.model_uds(self._example_uds())

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

    def figure(self, value: str = "component_uds", idx: int | None = None, title: str | None = None) -> Any:
        """Heatmap ``layer x component`` (``px.imshow``, y = layer).

        Args:
            value: ``"component_uds"`` (sequential 0-1), or ``"d1"`` / ``"d2"`` (RdBu, midpoint 0; mean over
                examples, or one example with ``idx``).
            idx: one example (for ``d1``/``d2``); default the mean over examples.
            title: figure title.
        """
        if value == "component_uds":
            grid = self.component_uds
        elif value in ("d1", "d2"):
            values = getattr(self, value)
            grid = values[self.idx.index(idx)] if idx is not None else values.nanmean(0)
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
            title=title or f"{self.name}: {value} per layer and {self.axis} ({self.hook})",
        )

    def __repr__(self) -> str:
        return (
            f"ComponentResult({self.name!r}, hook={self.hook!r}, axis={self.axis!r}, "
            f"shape={tuple(self.s1.shape)}, uds={self.uds:.3f}, engine={self.engine!r})"
        )


def _array(values: Tensor) -> np.ndarray:
    """A CPU tensor as the NumPy array ``uds`` computes on (no copy for a CPU tensor)."""
    return values.detach().cpu().numpy()


__all__ = ["ComponentResult"]

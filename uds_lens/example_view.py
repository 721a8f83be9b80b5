"""One example of a UDS result: its row of ``examples``, its rows of ``layers``, the settings, and how it shows.

``UDSResult.example(idx)`` returns an [`ExampleView`][uds_lens.example_view.ExampleView]; ``figure()`` draws its d1/d2 curves
(``plotting.curves.example_curves``), and in a notebook it shows as a table of layers with the KE layers and the
clipped ones (``d2 > d1``) marked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from uds_lens import display
from uds_lens.uds import clipped_mask

if TYPE_CHECKING:  # drawing only: core modules import no plotly
    import plotly.graph_objects as go


@dataclass(frozen=True)
class ExampleView:
    """One example of a ``UDSResult``: ``examples`` (one row), ``layers`` (its rows), ``settings``; ``figure()``.

    ``name`` is the result's (the unlearned model's) name, shown in the repr and the figure's title.
    """

    idx: int
    examples: pd.DataFrame
    layers: pd.DataFrame
    settings: dict[str, Any]
    name: str = ""

    def _get(self, column: str) -> Any:
        value = self.examples[column].iloc[0] if column in self.examples else None
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else value

    @property
    def uds(self) -> float:
        value = self._get("uds")
        return math.nan if value is None else float(value)

    @property
    def question(self) -> str | None:
        return self._get("question")

    @property
    def entity(self) -> str | None:
        return self._get("entity")

    @property
    def status(self) -> str | None:
        return self._get("status")

    @property
    def clipped_layers(self) -> list[int]:
        """The KE layers where ``d2 > d1``: LER clipped to 1 (over-disruption)."""
        mask = clipped_mask(
            self.layers["d1"].to_numpy(dtype=float),
            self.layers["d2"].to_numpy(dtype=float),
            self.settings["tau"],
        )
        return [int(layer) for layer in self.layers.loc[mask, "layer"]]

    def _headline(self) -> str:
        n_ke = int(self.layers["ke"].sum())
        clipped = self.clipped_layers
        model = f"{self.name}, " if self.name else ""
        head = (
            f"example {self.idx} ({model}{self.status}): UDS {display.number(self.uds)} over {n_ke} KE layers"
        )
        if not clipped:
            return head
        return (
            f"{head}, {len(clipped)} clipped (d2 > d1 at layers {clipped}): from clipped cells "
            f"{display.number(self._get('uds_clipped'))}, excess disruption "
            f"{display.number(self._get('excess_disruption'), 2)}"
        )

    def __repr__(self) -> str:
        text = f"ExampleView({self._headline()}"
        if self.question is not None:
            text += f"; Q: {self.question!r}; entity: {self.entity!r}"
        return text + ")"

    def _repr_html_(self) -> str:
        """The notebook view: question and entity, then one row per layer (d1, d2, KE, LER, clipped)."""
        clipped = set(self.clipped_layers)
        rows = [
            [
                int(row.layer),
                display.number(row.d1),
                display.number(row.d2),
                "KE" if row.ke else "",
                display.number(row.ler),
                "d2 > d1" if int(row.layer) in clipped else "",
            ]
            for row in self.layers.itertuples()
        ]
        notes = [f"Q: {self.question}", f"entity: {self.entity}"] if self.question is not None else []
        reason = self._get("skip_reason")
        if reason:
            notes.append(f"skipped: {reason}")
        header = ["layer", "d1", "d2", "KE", "LER", "clipped"]
        return display.html_table(self._headline(), header, rows, notes)

    def figure(self, title: str | None = None) -> go.Figure:
        """``plotting.example_curves``: d1 solid, d2 dashed, KE layers shaded, UDS in the title."""
        from uds_lens.plotting.curves import example_curves  # drawing only: core modules import no plotly

        return example_curves(self, self.idx, title=title)


__all__ = ["ExampleView"]

"""Result containers: per-stage tensors in, long-form DataFrames and files out.

``UDSResult`` holds the per-example, per-layer scores of one unlearned model and turns them into the tables users
``groupby`` and plot:

* ``examples``: ``idx, prompt_type, n_entity_tokens, n_ke, uds, status (scored|no_ke|skipped), skip_reason,
  question, entity``;
* ``layers`` (long): ``idx, layer, site, s0, baseline_score, s1_score, s2_score, d1, d2, ke, ler``. ``s0`` is the
  clean full model's score (S0, one value per example); ``baseline_score`` is the unpatched score as the engine
  computes it at that layer (S0 itself for the naive engine; the fast engine's own recomputation, equal to S0 up to
  float noise), which ``d1 = baseline_score - s1_score`` and ``d2 = baseline_score - s2_score`` subtract from, so a
  source identical to full gives exactly 0. ``ler`` is NaN outside KE layers (there ``d2 / d1`` is not a ratio of
  knowledge, only of noise);
* ``summary``: model UDS, bootstrap 95% CI, counts, settings, versions, dtype, device, timings.

``save(dir)`` writes ``summary.json``, ``examples.csv``, ``layers.csv`` (and ``layers.parquet`` when pyarrow is
installed) and ``uds_eval.json`` (the open-unlearning shape ``{"uds": {"agg_value", "value_by_index"}}``);
``UDSResult.load(dir)`` gives the same tables back. tau is re-applied from the stored deltas by ``with_tau``, so a
different threshold never needs the models again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from uds_lens.data import EncodedExample, Skip

EXAMPLE_COLUMNS = ["idx", "prompt_type", "n_entity_tokens", "n_ke", "uds", "status", "skip_reason", "question",
                   "entity"]
LAYER_COLUMNS = ["idx", "layer", "site", "s0", "baseline_score", "s1_score", "s2_score", "d1", "d2", "ke", "ler"]
# Saved before the rename: the per-layer baseline was called s_full, S0 lived only in meta.json.
_OLD_COLUMNS = {"s_full": "baseline_score"}


def _none_if_nan(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


@dataclass
class UDSResult:
    """Scores of one unlearned model. Build with ``from_stages`` (the auditor does) or ``load``."""

    name: str
    examples: pd.DataFrame
    layers: pd.DataFrame
    settings: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_stages(
        cls,
        name: str,
        encoded: Sequence[EncodedExample],
        skipped: Sequence[Skip],
        layers: Sequence[int],
        s_full: torch.Tensor,
        baseline: torch.Tensor,
        s1: torch.Tensor | None,
        s2: torch.Tensor,
        config: Any,
        meta: dict[str, Any],
    ) -> UDSResult:
        n, n_layers = len(encoded), len(layers)
        idx = np.repeat([e.idx for e in encoded], n_layers)
        base = baseline.numpy().reshape(-1)
        s2_flat = s2.numpy().reshape(-1)
        table = pd.DataFrame({
            "idx": idx.astype(int),
            "layer": np.tile(np.asarray(layers, dtype=int), n),
            "site": config.site,
            "s0": np.repeat(s_full.numpy(), n_layers),
            "baseline_score": base,
            "s1_score": s1.numpy().reshape(-1) if s1 is not None else np.nan,
            "s2_score": s2_flat,
            "d1": (base - s1.numpy().reshape(-1)) if s1 is not None else np.nan,
            "d2": base - s2_flat,
        })
        meta = dict(meta)
        prompt_types = meta.pop("prompt_types", {})
        texts = meta.pop("texts", {})
        info = pd.DataFrame(
            [{"idx": e.idx, "prompt_type": e.prompt_type, "n_entity_tokens": e.n_entity_tokens} for e in encoded]
            + [{"idx": s.idx, "prompt_type": prompt_types.get(s.idx), "n_entity_tokens": 0, "skip_reason": s.reason}
               for s in skipped],
            columns=["idx", "prompt_type", "n_entity_tokens", "skip_reason"],
        )
        info["question"] = [texts.get(i, {}).get("question") for i in info["idx"]]
        info["entity"] = [texts.get(i, {}).get("entity") for i in info["idx"]]
        meta["s0"] = {int(e.idx): float(v) for e, v in zip(encoded, s_full.tolist())}
        settings = config.to_dict()
        result = cls(name=name, examples=info, layers=table, settings=settings, meta=meta)
        return result.with_tau(config.tau)

    def with_tau(self, tau: float) -> UDSResult:
        """The same result under another KE threshold (no model is run)."""
        layers = self.layers.copy()
        retain_free = layers["d1"].isna().all()
        if retain_free:
            layers["ke"] = False
            layers["ler"] = np.nan
        else:
            d1 = torch.tensor(layers["d1"].to_numpy(dtype=float))
            d2 = torch.tensor(layers["d2"].to_numpy(dtype=float))
            from uds_lens.uds import ke_mask, layer_erasure_ratio

            ke = ke_mask(d1, tau)
            layers["ke"] = ke.numpy()
            layers["ler"] = torch.where(ke, layer_erasure_ratio(d1, d2), torch.full_like(d1, float("nan"))).numpy()
        weighted = layers.assign(w=np.where(layers["ke"], layers["d1"], 0.0))
        weighted["wl"] = weighted["w"] * weighted["ler"].fillna(0.0)
        grouped = weighted.groupby("idx", sort=False).agg(n_ke=("ke", "sum"), w=("w", "sum"), wl=("wl", "sum"))
        grouped["uds"] = np.where(grouped["n_ke"] > 0, grouped["wl"] / grouped["w"].where(grouped["w"] != 0, 1.0),
                                  np.nan)
        examples = self.examples.drop(columns=[c for c in ("n_ke", "uds", "status") if c in self.examples])
        examples = examples.merge(grouped[["n_ke", "uds"]], left_on="idx", right_index=True, how="left")
        skipped = examples["skip_reason"].notna() & (examples["skip_reason"] != "")
        examples["n_ke"] = examples["n_ke"].fillna(0).astype(int)
        if retain_free:
            examples["status"] = np.where(skipped, "skipped", "scored")
            examples["uds"] = np.nan
        else:
            examples["status"] = np.where(skipped, "skipped", np.where(examples["uds"].isna(), "no_ke", "scored"))
        examples["skip_reason"] = examples["skip_reason"].where(skipped, "").astype(object)
        settings = dict(self.settings, tau=tau)
        return replace(self, examples=examples[EXAMPLE_COLUMNS].reset_index(drop=True),
                       layers=layers[LAYER_COLUMNS].reset_index(drop=True), settings=settings)

    # -- views -------------------------------------------------------------------------------------------------

    @property
    def retain_free(self) -> bool:
        return bool(self.layers["d1"].isna().all()) if len(self.layers) else self.settings.get("retain_free", False)

    @property
    def uds(self) -> float:
        """Model UDS: plain mean of the defined per-example scores.

        With no defined score it is NaN, or 0.0 under ``published_compat`` (what the published code reports); the
        counts in :attr:`summary` say that nothing was scored either way.
        """
        values = self.examples["uds"].dropna()
        if len(values):
            return float(values.mean())
        return 0.0 if self.settings.get("published_compat") and not self.retain_free else float("nan")

    @property
    def ci95(self) -> tuple[float, float]:
        from uds_lens.uds import bootstrap_ci

        return bootstrap_ci(self.examples["uds"].to_numpy(dtype=float))

    @property
    def d2_summary(self) -> dict[str, float]:
        """Retain-free summaries (unnormalised): mean d2 over layers and examples, share of layers with d2 > tau."""
        d2 = self.layers["d2"].to_numpy(dtype=float)
        return {"mean_d2": float(np.nanmean(d2)) if d2.size else float("nan"),
                "frac_layers_d2_gt_tau": float(np.mean(d2 > self.settings["tau"])) if d2.size else float("nan")}

    @property
    def summary(self) -> dict[str, Any]:
        status = self.examples["status"].value_counts()
        reasons = self.examples.loc[self.examples["status"] == "skipped", "skip_reason"].value_counts()
        low, high = self.ci95
        out: dict[str, Any] = {
            "name": self.name,
            "uds": _none_if_nan(self.uds),
            "ci95": [_none_if_nan(low), _none_if_nan(high)],
            "n_scored": int(status.get("scored", 0)),
            "n_no_ke": int(status.get("no_ke", 0)),
            "n_skipped": int(status.get("skipped", 0)),
            "skipped_reasons": {str(k): int(v) for k, v in reasons.items()},
            "skipped_indices": self.examples.loc[self.examples["status"] == "skipped", "idx"].astype(int).tolist(),
            "retain_free": self.retain_free,
            "settings": self.settings,
        }
        if self.retain_free:
            out["uds"] = None
            out["d2_summary"] = self.d2_summary
            out["note"] = ("retain-free mode: no retain model, so d2 is unnormalised (not divided by d1); these "
                           "summaries are not comparable with UDS.")
        for key in ("full", "retain", "unlearned", "data", "versions", "device", "dtype", "engine", "timings"):
            if key in self.meta:
                out[key] = self.meta[key]
        out.setdefault("timings", {})
        return out

    def to_open_unlearning(self) -> dict[str, Any]:
        scored = self.examples.dropna(subset=["uds"])
        return {"uds": {"agg_value": _none_if_nan(self.uds),
                        "value_by_index": {str(int(r.idx)): {"score": float(r.uds)} for r in scored.itertuples()}}}

    # -- files -------------------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write summary.json, examples.csv, layers.csv (+ .parquet if possible) and uds_eval.json."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=_json_default))
        self.examples.to_csv(out / "examples.csv", index=False)
        self.layers.to_csv(out / "layers.csv", index=False)
        try:
            self.layers.to_parquet(out / "layers.parquet", index=False)
        except (ImportError, ValueError):
            pass
        (out / "uds_eval.json").write_text(json.dumps(self.to_open_unlearning(), indent=2))
        (out / "meta.json").write_text(json.dumps({"name": self.name, "settings": self.settings, "meta": self.meta},
                                                  indent=2, default=_json_default))
        return out

    @classmethod
    def load(cls, directory: str | Path) -> UDSResult:
        src = Path(directory)
        meta = json.loads((src / "meta.json").read_text())
        examples = pd.read_csv(src / "examples.csv", dtype={"prompt_type": object, "skip_reason": object,
                                                             "question": object, "entity": object})
        examples["skip_reason"] = examples["skip_reason"].fillna("").astype(object)
        examples["prompt_type"] = examples["prompt_type"].where(examples["prompt_type"].notna(), None)
        layers = pd.read_csv(src / "layers.csv").rename(columns=_OLD_COLUMNS)
        layers["ke"] = layers["ke"].astype(bool)
        if "s0" not in layers:
            s0 = {int(k): v for k, v in meta.get("meta", {}).get("s0", {}).items()}
            layers.insert(3, "s0", layers["idx"].map(s0).astype(float))
        for column in ("question", "entity"):
            if column not in examples:
                examples[column] = None
        return cls(name=meta["name"], examples=examples[EXAMPLE_COLUMNS], layers=layers[LAYER_COLUMNS],
                   settings=meta["settings"], meta=meta.get("meta", {}))

    # -- one example -------------------------------------------------------------------------------------------

    def example(self, idx: int) -> ExampleView:
        """One example: its row of ``examples`` (question, entity, UDS, status), its ``layers`` rows, its figure.

        Example:
            >>> view = result.example(3)
            >>> view.uds, view.entity, view.layers[["layer", "d1", "d2", "ke", "ler"]]
            >>> view.figure()         # d1/d2 per layer, KE layers shaded, UDS in the title
        """
        rows = self.examples[self.examples["idx"] == idx]
        if rows.empty:
            raise KeyError(f"{self.name}: no example with idx {idx}; idx run from {self.examples['idx'].min()} to "
                           f"{self.examples['idx'].max()}.")
        return ExampleView(idx=idx, examples=rows.reset_index(drop=True),
                           layers=self.layers[self.layers["idx"] == idx].reset_index(drop=True),
                           settings=dict(self.settings))

    # -- tensors back ------------------------------------------------------------------------------------------

    def matrix(self, column: str) -> pd.DataFrame:
        """A wide ``idx x layer`` table of one layer column (``d1``, ``d2``, ``ler`` ...)."""
        return self.layers.pivot(index="idx", columns="layer", values=column)

    def __repr__(self) -> str:
        s = self.summary
        return (f"UDSResult({self.name!r}, uds={s['uds']}, scored={s['n_scored']}, no_ke={s['n_no_ke']}, "
                f"skipped={s['n_skipped']})")


@dataclass(frozen=True)
class ExampleView:
    """One example of a ``UDSResult``: ``examples`` (one row), ``layers`` (its rows), ``settings``; ``figure()``."""

    idx: int
    examples: pd.DataFrame
    layers: pd.DataFrame
    settings: dict[str, Any]

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

    def figure(self, title: str | None = None) -> Any:
        """``plots.example_curves``: d1 solid, d2 dashed, KE layers shaded, UDS in the title."""
        from uds_lens import plots

        return plots.example_curves(self, self.idx, title=title)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


__all__ = ["EXAMPLE_COLUMNS", "ExampleView", "LAYER_COLUMNS", "UDSResult"]

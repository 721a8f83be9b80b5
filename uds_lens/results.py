"""Result containers: per-stage tensors in, long-form DataFrames and files out.

``UDSResult`` holds the per-example, per-layer scores of one unlearned model and turns them into the tables users
``groupby`` and plot:

* ``examples``: ``idx, prompt_type, n_entity_tokens, n_ke, n_clipped, uds, uds_unclipped, uds_clipped,
  excess_disruption, status (scored|no_ke|skipped), skip_reason, question, entity`` (``n_clipped``: KE layers with
  ``d2 > d1``, whose LER the clip cut to 1; ``uds_unclipped + uds_clipped = uds``, the part of the score from
  measured ratios and the part from clipped cells, and ``excess_disruption`` how far past retain's disruption the
  unlearned model's goes: ``uds.uds_parts``, ``uds.excess_disruption``);
* ``layers`` (long): ``idx, layer, site, s0, baseline_score, s1_score, s2_score, d1, d2, ke, ler``. ``s0`` is the
  clean full model's score (S0, one value per example); ``baseline_score`` is the unpatched score as the engine
  computes it at that layer (S0 itself for the naive engine; the fast engine's own recomputation, equal to S0 up to
  float noise), which ``d1 = baseline_score - s1_score`` and ``d2 = baseline_score - s2_score`` subtract from, so a
  source identical to full gives exactly 0. ``ler`` is NaN outside KE layers (there ``d2 / d1`` is not a ratio of
  knowledge, only of noise);
* ``summary``: model UDS, bootstrap 95% CI, counts, the split of UDS and the excess disruption (``split``), settings,
  versions, dtype, device, timings, and ``stage2``: which cells Stage 2 ran (``all``, or ``ke``: only the KE cells,
  ``d2``/``s2_score``/``ler`` NaN elsewhere with a ``stage2_note`` saying so; ``with_tau`` then rescores exactly for
  a higher tau and raises [`CellsNotRunError`][uds_lens.results.CellsNotRunError] for a tau that needs cells not run).

``save(dir)`` writes ``summary.json``, ``examples.csv``, ``layers.csv`` (and ``layers.parquet`` when pyarrow is
installed) and ``uds_eval.json`` (the open-unlearning shape ``{"uds": {"agg_value", "value_by_index"}}``);
``UDSResult.load(dir)`` gives the same tables back. tau is re-applied from the stored deltas by ``with_tau``, so a
different threshold never needs the models again.

Saved results are read back only when whole: the directory is written as one step and its files checked against
their digests (`uds_lens.result_store`, whose names this module re-exports). [`can_reuse`][uds_lens.results.can_reuse]
decides whether a saved result may stand in for a new computation: only when its fingerprint
(``fingerprints.result_fingerprint``: the full, retain and unlearned weights, the data, the settings) is the new one.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from uds_lens import display
from uds_lens.config import UDSConfig, check_tau
from uds_lens.data import EncodedExample, Example, Skip
from uds_lens.example_view import ExampleView
from uds_lens.files import bytes_digest, write_atomic
from uds_lens.result_store import (
    RESULT_FILES,
    RESULT_FORMAT,
    ResultIntegrityError,
    atomic_result_dir,
    check_result_target,
    conflict_error,
    fingerprint_difference,
    input_conflicts,
    json_default,
    normal_json,
    read_verified,
    result_inputs,
)
from uds_lens.uds import (
    bootstrap_ci,
    clipped_summary,
    deltas,
    ke_mask,
    model_uds,
    mostly_clipped,
    rescore,
    split_ci,
)

if TYPE_CHECKING:  # type names only: this module never imports torch
    from jaxtyping import Float
    from torch import Tensor

EXAMPLE_COLUMNS = [
    "idx",
    "prompt_type",
    "n_entity_tokens",
    "n_ke",
    "n_clipped",
    "uds",
    "uds_unclipped",
    "uds_clipped",
    "excess_disruption",
    "status",
    "skip_reason",
    "question",
    "entity",
]
LAYER_COLUMNS = [
    "idx",
    "layer",
    "site",
    "s0",
    "baseline_score",
    "s1_score",
    "s2_score",
    "d1",
    "d2",
    "ke",
    "ler",
]
# Saved before the rename: the per-layer baseline was called s_full, S0 lived only in meta.json.
_OLD_COLUMNS = {"s_full": "baseline_score"}
# The per-example columns with_tau computes (uds.rescore), the ones a result saved before them lacks.
_SCORED_COLUMNS = ("n_ke", "n_clipped", "uds", "uds_unclipped", "uds_clipped", "excess_disruption")


class CellsNotRunError(ValueError):
    """A KE-only result asked for a tau under which cells that Stage 2 did not run would be KE."""


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
        s0: Float[Tensor, " example"],
        baseline: Float[Tensor, "example layer"],
        s1: Float[Tensor, "example layer"] | None,
        s2: Float[Tensor, "example layer"],
        config: UDSConfig,
        meta: dict[str, Any],
        records: Sequence[Example] = (),
    ) -> UDSResult:
        """Tables from the stages' CPU tensors: ``s0`` (S0) ``[example]``; ``baseline``, ``s1`` (None in
        retain-free mode) and ``s2`` ``[example, layer]``, rows in ``encoded`` order. ``records`` are the forget-set
        examples (scored and skipped), whose prompt type, question and entity the examples table shows. (The tensor
        types are a type checker's names only, so this module, and with it ``uds-lens report``, never imports
        torch.)"""
        n, n_layers = len(encoded), len(layers)
        idx = np.repeat([e.idx for e in encoded], n_layers)
        base = baseline.numpy().reshape(-1)
        s2_flat = s2.numpy().reshape(-1)
        # uds.deltas subtracts in float64; rounded back to the stages' float32 it is their float32 difference exactly
        d1 = deltas(base, s1.numpy().reshape(-1)).astype(base.dtype) if s1 is not None else np.nan
        d2 = deltas(base, s2_flat).astype(base.dtype)
        table = pd.DataFrame(
            {
                "idx": idx.astype(int),
                "layer": np.tile(np.asarray(layers, dtype=int), n),
                "site": config.site,
                "s0": np.repeat(s0.numpy(), n_layers),
                "baseline_score": base,
                "s1_score": s1.numpy().reshape(-1) if s1 is not None else np.nan,
                "s2_score": s2_flat,
                "d1": d1,
                "d2": d2,
            }
        )
        meta = dict(meta)
        by_idx = {record.idx: record for record in records}
        info = pd.DataFrame(
            [
                {"idx": e.idx, "prompt_type": e.prompt_type, "n_entity_tokens": e.n_entity_tokens}
                for e in encoded
            ]
            + [
                {
                    "idx": s.idx,
                    "prompt_type": by_idx[s.idx].prompt_type if s.idx in by_idx else None,
                    "n_entity_tokens": 0,
                    "skip_reason": s.reason,
                }
                for s in skipped
            ],
            columns=["idx", "prompt_type", "n_entity_tokens", "skip_reason"],
        )
        info["question"] = [by_idx[i].question if i in by_idx else None for i in info["idx"]]
        info["entity"] = [by_idx[i].entity if i in by_idx else None for i in info["idx"]]
        meta["s0"] = {int(e.idx): float(v) for e, v in zip(encoded, s0.tolist())}
        if forms := sorted({record.form for record in records} - {"qa"}):
            meta["forms"] = forms  # spans other than TOFU's answer entities: a passage's sentence, a letter
        result = cls(name=name, examples=info, layers=table, settings=config.to_dict(), meta=meta)
        return result.with_tau(config.tau)

    def with_tau(self, tau: float) -> UDSResult:
        """The same result under another KE threshold (no model is run).

        Under the threshold it already has, the result is returned as is: a saved result read back keeps the
        per-example scores it was saved with (recomputing them from ``layers.csv``, whose float32 deltas come back
        as float64, would move the model UDS in the ninth decimal away from its own ``summary.json``).

        Raises:
            ConfigError: ``tau`` is not a finite number >= 0 (``UDSConfig`` and ``--tau`` refuse the same).
            CellsNotRunError: a KE-only result asked for a lower tau (cells Stage 2 did not run).
        """
        tau = check_tau(tau)
        if tau == self.settings.get("tau") and {*_SCORED_COLUMNS, "status"} <= set(self.examples.columns):
            return self
        self._require_cells(tau)
        retain_free = bool(self.layers["d1"].isna().all())
        layers, per_example = rescore(self.layers, tau)
        examples = self.examples.drop(columns=[c for c in (*_SCORED_COLUMNS, "status") if c in self.examples])
        examples = examples.merge(per_example, on="idx", how="left")
        skipped = examples["skip_reason"].notna() & (examples["skip_reason"] != "")
        examples["n_ke"] = examples["n_ke"].fillna(0).astype(int)
        examples["n_clipped"] = examples["n_clipped"].fillna(0).astype(int)
        if retain_free:
            examples["status"] = np.where(skipped, "skipped", "scored")
            examples[["uds", "uds_unclipped", "uds_clipped", "excess_disruption"]] = np.nan
        else:
            examples["status"] = np.where(
                skipped, "skipped", np.where(examples["uds"].isna(), "no_ke", "scored")
            )
        examples["skip_reason"] = examples["skip_reason"].where(skipped, "").astype(object)
        settings = dict(self.settings, tau=tau)
        return replace(
            self,
            examples=examples[EXAMPLE_COLUMNS].reset_index(drop=True),
            layers=layers[LAYER_COLUMNS].reset_index(drop=True),
            settings=settings,
        )

    def _require_cells(self, tau: float) -> None:
        """[`CellsNotRunError`][uds_lens.results.CellsNotRunError] when ``tau`` makes a cell KE whose ``d2`` Stage 2 did not run (KE-only)."""
        if self.stage2_cells != "ke":
            return
        d1 = self.layers["d1"].to_numpy(dtype=float)
        missing = ke_mask(d1, tau) & np.isnan(self.layers["d2"].to_numpy(dtype=float))
        if missing.any():
            examples = self.layers.loc[missing, "idx"].nunique()
            ran_at = self.meta.get("stage2", {}).get("tau")
            raise CellsNotRunError(
                f"{self.name}: Stage 2 ran only on the KE cells at tau={ran_at} (stage2_cells='ke'), and tau={tau} "
                f"makes {int(missing.sum())} more cells of {examples} examples KE, whose d2 was never computed. "
                f"Rescore with tau >= {ran_at}, or score again with stage2_cells='all' (--stage2-cells all)."
            )

    # -- views -------------------------------------------------------------------------------------------------

    @property
    def stage2_cells(self) -> str:
        """Which cells Stage 2 ran: ``all``, or ``ke`` (only ``d1 > tau`` at the tau in ``meta["stage2"]``; ``d2``,
        ``s2_score`` and ``ler`` are NaN elsewhere). Results saved before the choice existed ran ``all``."""
        return str(self.settings.get("stage2_cells") or "all")

    @property
    def retain_free(self) -> bool:
        return (
            bool(self.layers["d1"].isna().all())
            if len(self.layers)
            else self.settings.get("retain_free", False)
        )

    @property
    def uds(self) -> float:
        """Model UDS: plain mean of the defined per-example scores.

        With no defined score it is NaN, or 0.0 under ``published_compat`` (what the published code reports); the
        counts in `summary` say that nothing was scored either way.
        """
        values = self.examples["uds"].dropna()
        if len(values):
            return float(values.mean())
        return 0.0 if self.settings.get("published_compat") and not self.retain_free else float("nan")

    @property
    def ci95(self) -> tuple[float, float]:
        return bootstrap_ci(self.examples["uds"].to_numpy(dtype=float))

    @property
    def d2_summary(self) -> dict[str, float]:
        """Retain-free summaries (unnormalised): mean d2 over layers and examples, share of layers with d2 > tau."""
        d2 = self.layers["d2"].to_numpy(dtype=float)
        return {
            "mean_d2": float(np.nanmean(d2)) if d2.size else float("nan"),
            "frac_layers_d2_gt_tau": float(np.mean(d2 > self.settings["tau"])) if d2.size else float("nan"),
        }

    @property
    def clipped(self) -> dict[str, float]:
        """Over-disruption, never part of UDS: ``clipped_share``, the share of KE cells with ``d2 > d1``
        (LER clipped to 1: the unlearned model's activation breaks the full model more than retain's does, and UDS
        reads it as erased), ``clipped_median_ratio`` (median ``d2 / d1`` over those cells) and the counts
        ``n_ke_cells``, ``n_clipped_cells`` ([`uds.clipped_summary`][uds_lens.uds.clipped_summary])."""
        return clipped_summary(
            self.layers["d1"].to_numpy(dtype=float),
            self.layers["d2"].to_numpy(dtype=float),
            self.settings["tau"],
        )

    @property
    def split(self) -> dict[str, Any]:
        """Where the model UDS comes from, and how far past retain the unlearned model disrupts (never part of UDS).

        ``uds_unclipped`` and ``uds_clipped``: the means over the scored examples of ``UDS_i``'s two parts
        (``uds.uds_parts``: the KE cells with ``d2 <= d1``, whose ratio is measured, and the clipped ones, each read
        as fully erased), which add up to [`uds`][uds_lens.results.UDSResult.uds]; ``uds_clipped_share``:
        ``uds_clipped / uds``, the share of the score that rests on clipped cells (NaN when UDS is 0 or undefined);
        ``excess_disruption``: the mean over the scored examples of ``uds.excess_disruption`` (0: never past
        retain's disruption; 1: on average twice it); ``n_mostly_clipped``: the examples whose ``UDS_i`` rests
        mostly on clipped cells ([`mostly_clipped_examples`][uds_lens.results.UDSResult.mostly_clipped_examples]).
        """
        examples = self.examples
        unclipped = model_uds(examples["uds_unclipped"].to_numpy(dtype=float))
        clipped = model_uds(examples["uds_clipped"].to_numpy(dtype=float))
        total = self.uds
        if total == 0.0 and np.isnan(clipped):  # published-compat's 0.0 with nothing scored: no part either
            unclipped = clipped = 0.0
        return {
            "uds_unclipped": unclipped,
            "uds_clipped": clipped,
            "uds_clipped_share": clipped / total if total > 0 else float("nan"),
            "excess_disruption": model_uds(examples["excess_disruption"].to_numpy(dtype=float)),
            "n_mostly_clipped": len(self.mostly_clipped_examples()),
        }

    @property
    def split_ci95(self) -> dict[str, tuple[float, float]]:
        """Bootstrap 95% CIs of [`split`][uds_lens.results.UDSResult.split]'s means over the scored examples:
        ``uds_unclipped``, ``uds_clipped`` and ``excess_disruption`` (``uds.split_ci``: the same resampling as
        ``ci95``, column by column; the parts' bounds do not add up to UDS's)."""
        return split_ci(self.examples)

    def mostly_clipped_examples(self) -> pd.DataFrame:
        """The scored examples whose ``UDS_i`` rests mostly on clipped cells (``uds_clipped > uds_unclipped``, so
        more than half of it: ``uds.mostly_clipped``), largest clipped part first: their score says the unlearned
        model disrupts more than retain there, not that it erased like retain."""
        examples = self.examples
        mask = mostly_clipped(
            examples["uds_unclipped"].to_numpy(dtype=float), examples["uds_clipped"].to_numpy(dtype=float)
        )
        return (
            examples[mask].sort_values(["uds_clipped", "idx"], ascending=[False, True]).reset_index(drop=True)
        )

    @property
    def precision(self) -> dict[str, Any] | None:
        """A bf16/fp16 run's precision record (``uds_lens.precision``): the band, the fragile cells and those
        re-decided in fp32 (``n_fragile_cells``, ``n_redecided_cells``; per example in ``per_example[idx]``, with
        ``uds_bound``, how far rounding could still move its UDS) and the precision of each decision; None in
        fp32."""
        return self.meta.get("precision")

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
            **self._clipped_fields(),
            **{
                key: value if key.startswith("n_") else _none_if_nan(value)
                for key, value in self.split.items()
            },
            "split_ci95": {
                key: [_none_if_nan(low), _none_if_nan(high)] for key, (low, high) in self.split_ci95.items()
            },
            "skipped_indices": self.examples.loc[self.examples["status"] == "skipped", "idx"]
            .astype(int)
            .tolist(),
            "retain_free": self.retain_free,
            "settings": self.settings,
            "stage2": self.meta.get("stage2", {"cells": self.stage2_cells}),
        }
        if self.stage2_cells == "ke":
            out["stage2_note"] = (
                f"KE-only Stage 2: d2, s2_score and ler are NaN outside the KE cells (d1 > tau = "
                f"{out['stage2'].get('tau')}), where Stage 2 was not run because UDS never reads them; no_ke examples "
                "ran no Stage 2. UDS is the same as with every cell; a rescore may only raise tau."
            )
        if self.retain_free:
            out["uds"] = None
            out["d2_summary"] = self.d2_summary
            out["note"] = (
                "retain-free mode: no retain model, so d2 is unnormalised (not divided by d1); these "
                "summaries are not comparable with UDS."
            )
        for key in (
            "full",
            "retain",
            "unlearned",
            "data",
            "versions",
            "device",
            "dtype",
            "log_softmax_dtype",
            "engine",
            "timings",
            "precision",
            "forms",
        ):
            if key in self.meta:
                out[key] = self.meta[key]
        out.setdefault("timings", {})
        return out

    def _clipped_fields(self) -> dict[str, Any]:
        clipped = self.clipped
        return {
            "clipped_share": _none_if_nan(clipped["clipped_share"]),
            "clipped_median_ratio": _none_if_nan(clipped["clipped_median_ratio"]),
            "n_ke_cells": int(clipped["n_ke_cells"]),
            "n_clipped_cells": int(clipped["n_clipped_cells"]),
        }

    def to_open_unlearning(self) -> dict[str, Any]:
        scored = self.examples.dropna(subset=["uds"])
        return {
            "uds": {
                "agg_value": _none_if_nan(self.uds),
                "value_by_index": {str(int(r.idx)): {"score": float(r.uds)} for r in scored.itertuples()},
            }
        }

    # -- files -------------------------------------------------------------------------------------------------

    def save(self, directory: str | Path, force: bool = False) -> Path:
        """Write the result to ``directory``, atomically and under its lock (see `atomic_result_dir`).

        Files: ``summary.json``, ``examples.csv``, ``layers.csv`` (+ ``layers.parquet`` with pyarrow),
        ``uds_eval.json``, and ``meta.json`` (name, settings, metadata with the input fingerprint, and the SHA-256
        of every other file). Files other programs left in an existing ``directory`` (``diagnose``'s
        ``scores.json`` ...) are carried over.

        A ``directory`` holding the result of another run (other inputs: another full, retain, unlearned model,
        data set or setting; or a result whose inputs cannot be compared with this one's) is refused, under the
        lock, as ``uds-lens score`` refuses it; the same result again, or one of the same inputs, replaces it.

        Args:
            force: replace another run's result too (``--force``).

        Raises:
            OutputConflictError: ``directory`` holds another run's result and ``force`` is off.
            ResultTargetError / ConfigError: ``directory`` is, holds or lies in one of the result's inputs, or holds
                anything but a result this package wrote, whatever ``force`` says (`result_store.check_result_target`).
        """
        target = check_result_target(directory, result_inputs(self.meta))  # the guard `score` and `sweep` use
        fingerprint = self.meta.get("fingerprint")
        check = None if force else _refuse_others(fingerprint if isinstance(fingerprint, dict) else None)
        with atomic_result_dir(target, check=check) as staging:
            self._write_files(staging)
        return target

    def _write_files(self, out: Path) -> None:
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=json_default))
        write_atomic(out / "examples.csv", self.examples.to_csv(index=False))
        write_atomic(out / "layers.csv", self.layers.to_csv(index=False))
        try:
            self.layers.to_parquet(out / "layers.parquet", index=False)
        except (ImportError, ValueError):
            (out / "layers.parquet").unlink(missing_ok=True)
        (out / "uds_eval.json").write_text(json.dumps(self.to_open_unlearning(), indent=2))
        files = {
            name: bytes_digest((out / name).read_bytes()) for name in RESULT_FILES if (out / name).is_file()
        }
        (out / "meta.json").write_text(
            json.dumps(
                {
                    "format": RESULT_FORMAT,
                    "name": self.name,
                    "settings": self.settings,
                    "meta": self.meta,
                    "files": files,
                },
                indent=2,
                default=json_default,
            )
        )

    @classmethod
    def load(cls, directory: str | Path, verify: bool = True) -> UDSResult:
        """Read a saved result.

        Args:
            directory: a directory written by [`save`][uds_lens.results.UDSResult.save].
            verify: refuse a directory whose files do not match the digests in its ``meta.json`` (a torn or mixed
                write, or a directory saved by an older uds_lens without digests). ``False`` reads whatever is there.

        Raises:
            ResultIntegrityError: ``verify`` is on and the files do not belong together.
        """
        src = Path(directory)
        if verify:
            meta, contents, problem = read_verified(src)
            if problem is not None:
                raise ResultIntegrityError(
                    f"The result in {src} cannot be trusted: {problem}. Score the model again (it is recomputed), "
                    "or pass verify=False to read the files anyway."
                )
        else:
            meta = json.loads((src / "meta.json").read_text())
            contents = {name: (src / name).read_bytes() for name in ("examples.csv", "layers.csv")}
        return cls._from_files(meta, contents)

    @classmethod
    def _from_files(cls, meta: dict[str, Any], contents: dict[str, bytes]) -> UDSResult:
        examples = pd.read_csv(
            io.BytesIO(contents["examples.csv"]),
            dtype={"prompt_type": object, "skip_reason": object, "question": object, "entity": object},
        )
        examples["skip_reason"] = examples["skip_reason"].fillna("").astype(object)
        examples["prompt_type"] = examples["prompt_type"].where(examples["prompt_type"].notna(), None)
        layers = pd.read_csv(io.BytesIO(contents["layers.csv"])).rename(columns=_OLD_COLUMNS)
        layers["ke"] = layers["ke"].astype(bool)
        if "s0" not in layers:
            s0 = {int(k): v for k, v in meta.get("meta", {}).get("s0", {}).items()}
            layers.insert(3, "s0", layers["idx"].map(s0).astype(float))
        for column in ("question", "entity"):
            if column not in examples:
                examples[column] = None
        missing = [column for column in _SCORED_COLUMNS if column not in examples]
        if missing:  # saved before over-disruption was counted or UDS split: computed from the deltas
            rescored = rescore(layers, meta["settings"]["tau"])[1].set_index("idx")
            for column in missing:
                examples[column] = examples["idx"].map(rescored[column])
            examples["n_clipped"] = examples["n_clipped"].fillna(0).astype(int)
        return cls(
            name=meta["name"],
            examples=examples[EXAMPLE_COLUMNS],
            layers=layers[LAYER_COLUMNS],
            settings=meta["settings"],
            meta=meta.get("meta", {}),
        )

    # -- one example -------------------------------------------------------------------------------------------

    def example(self, idx: int) -> ExampleView:
        """One example: its row of ``examples`` (question, entity, UDS, status), its ``layers`` rows, its figure.

        Examples:
            >>> view = result.example(3)
            >>> view.uds, view.entity, view.layers[["layer", "d1", "d2", "ke", "ler"]]
            >>> view.figure()         # d1/d2 per layer, KE layers shaded, UDS in the title
        """
        rows = self.examples[self.examples["idx"] == idx]
        if rows.empty:
            raise KeyError(
                f"{self.name}: no example with idx {idx}; idx run from {self.examples['idx'].min()} to "
                f"{self.examples['idx'].max()}."
            )
        return ExampleView(
            idx=idx,
            examples=rows.reset_index(drop=True),
            layers=self.layers[self.layers["idx"] == idx].reset_index(drop=True),
            settings=dict(self.settings),
            name=self.name,
        )

    # -- tensors back ------------------------------------------------------------------------------------------

    def matrix(self, column: str) -> pd.DataFrame:
        """A wide ``idx x layer`` table of one layer column (``d1``, ``d2``, ``ler`` ...)."""
        return self.layers.pivot(index="idx", columns="layer", values=column)

    def __repr__(self) -> str:
        """One line from the summary (``display.result_text``): UDS and its two parts with their CIs, the counts,
        the clipped cells and, in bf16/fp16, what ran in fp32."""
        return f"UDSResult({self.name!r}: {display.result_text(self.summary)})"

    def _repr_html_(self) -> str:
        """The notebook view, one field a row (narrow enough for a notebook column): ``display.result_rows``."""
        summary = self.summary
        notes = [display.RESULT_NOTE]
        if summary["skipped_reasons"]:
            notes.append("skipped: " + ", ".join(f"{k} ({v})" for k, v in summary["skipped_reasons"].items()))
        return display.html_fields(f"UDSResult {self.name}", display.result_rows(summary), notes)


@dataclass(frozen=True)
class SavedCheck:
    """What a saved result directory holds compared with a new computation ([`check_saved`][uds_lens.results.check_saved]).

    Attributes:
        result: the saved result when it may stand in for the new computation (intact, identical fingerprint).
        reason: ``"identical inputs"``, or why it cannot be reused (which key differs, which file failed its digest).
        conflicts: the input keys (`INPUT_KEYS`) in which the saved result differs: non-empty means it is
            another run's result, not a stale copy of this one.
    """

    result: UDSResult | None
    reason: str
    conflicts: tuple[str, ...] = ()


def check_saved(
    directory: str | Path, fingerprint: dict[str, Any], ignore: tuple[str, ...] = ()
) -> SavedCheck:
    """Compare the result saved in ``directory`` with a new computation's ``fingerprint``, reading each file once.

    Args:
        directory: ``OUT/NAME``.
        fingerprint: the new computation's (``UDSAuditor.fingerprint``, or ``result_fingerprint`` for its inputs).
        ignore: keys left out of the comparison (``("s1",)`` to compare the inputs before Stage 1 is known).

    Returns:
        [`SavedCheck`][uds_lens.results.SavedCheck]: the result when it can be reused, else the reason in words (each differing key with
        its saved and new value, or the file that failed its digest) and the differing input keys.
    """
    meta, contents, problem = read_verified(Path(directory))
    if problem is not None:
        return SavedCheck(None, problem)
    if meta.get("format") != RESULT_FORMAT:
        return SavedCheck(None, f"it was saved in result format {meta.get('format')}, not {RESULT_FORMAT}")
    saved = meta.get("meta", {}).get("fingerprint")
    if not isinstance(saved, dict):
        return SavedCheck(None, "the saved result records no input fingerprint")
    saved, wanted = normal_json(saved), normal_json(fingerprint)
    differ = sorted(
        key for key in set(saved) | set(wanted) if key not in ignore and saved.get(key) != wanted.get(key)
    )
    if differ:
        why = "; ".join(fingerprint_difference(key, saved.get(key), wanted.get(key)) for key in differ)
        return SavedCheck(None, why, input_conflicts(differ, saved, wanted))
    return SavedCheck(UDSResult._from_files(meta, contents), "identical inputs")


def _refuse_others(fingerprint: dict[str, Any] | None) -> Callable[[Path], None]:
    """The check ``UDSResult.save`` runs under the result's lock: a directory there holding another run's result
    (other inputs, Stage 1 aside) is refused, as [`check_saved`][uds_lens.results.check_saved] words it. A result without a fingerprint (built
    by hand) cannot be compared: a saved result with one is refused too."""

    def check(existing: Path) -> None:
        if not existing.exists():
            return
        if fingerprint is None:
            meta, _, problem = read_verified(existing)
            if problem is None and isinstance(meta.get("meta", {}).get("fingerprint"), dict):
                raise conflict_error(
                    {
                        str(
                            existing
                        ): "it holds a saved result, and this one records no inputs to compare it with"
                    },
                    option="--force (force=True)",
                )
            return
        saved = check_saved(existing, fingerprint, ignore=("s1",))
        if saved.conflicts:
            raise conflict_error({str(existing): saved.reason}, option="--force (force=True)")

    return check


def load_reusable(directory: str | Path, fingerprint: dict[str, Any]) -> tuple[UDSResult | None, str]:
    """The saved result in ``directory`` if it was computed from exactly these inputs, and why (not).

    Args:
        directory: ``OUT/NAME``.
        fingerprint: the new computation's inputs, from ``fingerprints.result_fingerprint`` (or
            ``UDSAuditor.fingerprint``).

    Returns:
        ``(result, "identical inputs")`` when the directory is intact and its fingerprint equals ``fingerprint``;
        otherwise ``(None, reason)``, e.g. ``"retain differs (saved files:..., now files:...)"`` or
        ``"meta.json is missing (...)"``. The check and the parse read the same bytes.
    """
    check = check_saved(directory, fingerprint)
    return check.result, check.reason


def can_reuse(directory: str | Path, fingerprint: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``directory`` holds an intact result of exactly these inputs: ``(True, "identical inputs")`` or
    ``(False, reason)``. Use [`load_reusable`][uds_lens.results.load_reusable] to get the result too (same check, one read)."""
    result, reason = load_reusable(directory, fingerprint)
    return result is not None, reason


__all__ = [
    "EXAMPLE_COLUMNS",
    "CellsNotRunError",
    "SavedCheck",
    "LAYER_COLUMNS",
    "UDSResult",
    "can_reuse",
    "check_saved",
    "load_reusable",
]

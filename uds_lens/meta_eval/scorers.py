"""Model-level scorers for the meta-evaluation: UDS and the white-box baselines as ``fn(model) -> float``.

``meta_eval.evaluate_zoo`` / ``run_meta_eval`` take each metric as a callable on a checkpoint path (or an in-memory
NF4 Hugging Face model, for the quantisation attack). ``ModelScorers`` builds them for one full/retain pair and one
forget set (``ModelScorers.from_zoo`` for a zoo, the constructor for real checkpoints): S1 for UDS and the full and
retain references of the logit lens, CKA and masked Fisher are computed once, and each model's white-box scores are
computed together, once. Every score is oriented as its method defines it (1 = erased like retain). Beside UDS,
``split_fns`` give the part of it from clipped cells and the excess disruption (``UDSResult.split``) from the same
scoring of the model, so the meta-evaluation tables carry the columns every UDS table carries.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from uds_lens.auditor import UDSAuditor
from uds_lens.baselines.references import References
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.loader import ModelArg
from uds_lens.config import UDSConfig
from uds_lens.data import DataArg
from uds_lens.meta_eval.paper import METRICS
from uds_lens.metrics import registry
from uds_lens.results import UDSResult
from uds_lens.sources import as_source
from uds_lens.zoo.layout import load_zoo

logger = logging.getLogger(__name__)

# The paper's white-box rows of Table 3 (its meta-evaluation scores these three besides UDS).
WHITE_BOX = tuple(s.name for s in METRICS if s.kind == registry.WHITE_BOX)
# Where UDS comes from, beside it in every table (UDSResult.split): the metrics.csv columns of split_fns.
SPLIT_COLUMNS = ("uds_clipped", "excess_disruption")
FISHER_FRACTION = 1e-3  # the paper's "Fisher (Masked 0.1%)" row


class ModelScorers:
    """UDS, logit lens, CKA and masked Fisher of any model of the full model's architecture, against full/retain.

    Args:
        full / retain: checkpoint paths, hub ids or loaded models (as [`UDSAuditor`][uds_lens.auditor.UDSAuditor] takes them).
        data: the forget examples with ``prefix`` / ``entity`` (UDS and the white-box methods read the same tokens).
        config: the UDS settings (default [`UDSConfig`][uds_lens.auditor.UDSConfig]).
        cache_dir: the S1 cache (``False`` for none).
        progress: tqdm bars while scoring.
        batch_size: examples per batch for the hidden-state collection of the white-box methods.
    """

    def __init__(
        self,
        full: ModelArg,
        retain: ModelArg | None,
        data: DataArg,
        *,
        config: UDSConfig | None = None,
        cache_dir: str | os.PathLike | bool | None = None,
        progress: bool = False,
        batch_size: int = 8,
    ) -> None:
        self.progress = progress
        self.batch_size = batch_size
        self.auditor = UDSAuditor(full, retain, data, config=config, cache_dir=cache_dir, progress=progress)
        self._reference: References | None = None
        self._scores: dict[Checkpoint, dict[str, float | None]] = {}
        self._uds: dict[Checkpoint, UDSResult] = {}
        self._last: tuple[object, UDSResult] | None = None

    @classmethod
    def from_zoo(
        cls, zoo_dir: str | os.PathLike, progress: bool = False, batch_size: int = 8
    ) -> ModelScorers:
        """Scorers against a zoo's full and retain models on its forget set (S1 cached in ``ZOO/.s1_cache``)."""
        zoo = load_zoo(zoo_dir)
        return cls(
            zoo.path("full"),
            zoo.path("retain"),
            zoo.forget_path,
            cache_dir=Path(zoo.root) / ".s1_cache",
            progress=progress,
            batch_size=batch_size,
        )

    def _key(self, model: ModelArg) -> Checkpoint:
        return Checkpoint.resolve(model)

    def _result(self, model: ModelArg) -> UDSResult:
        """The model's UDS result, scored once (UDS and its split read the same one): kept by path for a checkpoint,
        and for an in-memory model (an NF4 one) only while it is the last one scored, held here so that its ``id``
        cannot pass to another model."""
        key = self._key(model)
        if key.model is None:
            if key not in self._uds:
                self._uds[key] = self.auditor.score(key)
            return self._uds[key]
        if self._last is None or self._last[0] is not model:
            self._last = (model, self.auditor.score(model))
        return self._last[1]

    def uds(self, model: ModelArg) -> float:
        return self._result(model).uds

    def split_fns(self) -> dict[str, Callable[[ModelArg], float]]:
        """``{"uds_clipped", "excess_disruption"}``: the part of the model's UDS from clipped cells (d2 > d1) and how
        far past retain it disrupts, from the same scoring as `uds`."""

        def make(name: str) -> Callable[[ModelArg], float]:
            def score(model: ModelArg) -> float:
                value = self._result(model).split[name]
                return float("nan") if value is None else float(value)

            return score

        return {name: make(name) for name in SPLIT_COLUMNS}

    def _white_box(self, model: ModelArg) -> dict[str, float | None]:
        key = self._key(model)
        if key not in self._scores:
            if self._reference is None:
                self._reference = References(
                    self.auditor,
                    WHITE_BOX,
                    batch_size=self.batch_size,
                    tuned_lens_steps=0,
                    fisher_fractions=(FISHER_FRACTION,),
                )
            # Fisher needs gradients and the anchors' parameter layout: as in the published pipeline, the white-box
            # scores of a Hugging Face model are taken on its TransformerLens conversion (an NF4 model's from its
            # dequantised, 4-bit-rounded weights).
            full_cfg = self.auditor.full.cfg
            loaded = as_source(self.auditor.load(model)).hooked(
                dtype=full_cfg.dtype, device=str(full_cfg.device)
            )
            scores, _ = self._reference.observational(loaded)
            self._scores[key] = {
                "logit_lens": scores.get("logit_lens"),
                "cka": scores.get("cka"),
                "fisher_masked": next((v for k, v in scores.items() if k.startswith("fisher_masked")), None),
            }
        return self._scores[key]

    def white_box_fns(self) -> dict[str, Callable[[ModelArg], float]]:
        def make(name: str) -> Callable[[ModelArg], float]:
            def score(model: ModelArg) -> float:
                value = self._white_box(model)[name]
                return float("nan") if value is None else float(value)

            return score

        return {name: make(name) for name in WHITE_BOX}


def zoo_scorers(
    zoo_dir: str | os.PathLike, progress: bool = False
) -> tuple[Callable[[ModelArg], float], dict[str, Callable[[ModelArg], float]]]:
    """``(uds_fn, white_box_fns)`` for ``meta_eval.evaluate_zoo`` / ``run_meta_eval`` on a zoo; the second holds
    the white-box methods and UDS's split (``split_fns``), so ``metrics.csv`` has ``uds_clipped`` and
    ``excess_disruption`` beside ``uds``."""
    scorers = ModelScorers.from_zoo(zoo_dir, progress=progress)
    return scorers.uds, {**scorers.white_box_fns(), **scorers.split_fns()}


__all__ = ["SPLIT_COLUMNS", "ModelScorers", "zoo_scorers"]

"""Model-level scorers of a zoo for the meta-evaluation: UDS and the white-box baselines as ``fn(model) -> float``.

``meta_eval.evaluate_zoo`` / ``run_meta_eval`` take each metric as a callable on a checkpoint path (or an in-memory
NF4 Hugging Face model, for the quantisation attack). ``ZooScorers`` builds them over one zoo: S1 for UDS and the full
and retain references of the logit lens, CKA and masked Fisher are computed once, and each model's white-box scores
are computed together, once. Every score is oriented as its method defines it (1 = erased like retain).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from uds_lens.models import hooked_from_hf
from uds_lens.tl_compat import HookedTransformer
from uds_lens.uds import UDSAuditor

logger = logging.getLogger(__name__)

WHITE_BOX = ("logit_lens", "cka", "fisher_masked")
FISHER_FRACTION = 1e-3  # the paper's "Fisher (Masked 0.1%)" row


def _is_quantised(model: Any) -> bool:
    return bool(getattr(model, "is_quantized", False) or getattr(getattr(model, "config", None),
                                                                  "quantization_config", None))


class ZooScorers:
    """UDS, logit lens, CKA and masked Fisher for any model of a zoo's architecture, against its full/retain pair."""

    def __init__(self, zoo_dir: str | os.PathLike, progress: bool = False, batch_size: int = 8) -> None:
        from uds_lens.zoo import load_zoo

        self.zoo = load_zoo(zoo_dir)
        self.progress = progress
        self.batch_size = batch_size
        self.auditor = UDSAuditor(self.zoo.path("full"), self.zoo.path("retain"), self.zoo.forget_path,
                                  cache_dir=Path(self.zoo.root) / ".s1_cache", progress=progress)
        self._reference: Any = None
        self._scores: dict[Any, dict[str, float | None]] = {}

    def _key(self, model: Any) -> Any:
        return str(Path(model).resolve()) if isinstance(model, (str, os.PathLike)) else id(model)

    def uds(self, model: Any) -> float:
        return self.auditor.score(model).uds

    def _white_box(self, model: Any) -> dict[str, float | None]:
        key = self._key(model)
        if key not in self._scores:
            from uds_lens.diagnose import _Reference

            if self._reference is None:
                options = {"batch_size": self.batch_size, "tuned_lens_steps": 0, "probe_folds": 1,
                           "fisher_fractions": (FISHER_FRACTION,)}
                self._reference = _Reference(self.auditor, WHITE_BOX, None, options)
            loaded = self.auditor._load(model, "unlearned")
            if not isinstance(loaded, HookedTransformer):
                if _is_quantised(loaded):
                    # Fisher needs gradients and the anchors' parameter layout: as in the published pipeline, the
                    # white-box scores of a quantised model are taken on its dequantised (4-bit-rounded) weights.
                    loaded = copy.deepcopy(loaded).dequantize()
                full_cfg = self.auditor.full.cfg
                loaded = hooked_from_hf(loaded, dtype=full_cfg.dtype, device=str(full_cfg.device))
            scores, _ = self._reference.observational(loaded)
            self._scores[key] = {
                "logit_lens": scores.get("logit_lens"),
                "cka": scores.get("cka"),
                "fisher_masked": next((v for k, v in scores.items() if k.startswith("fisher_masked")), None),
            }
        return self._scores[key]

    def white_box_fns(self) -> dict[str, Callable[[Any], float]]:
        def make(name: str) -> Callable[[Any], float]:
            def score(model: Any) -> float:
                value = self._white_box(model)[name]
                return float("nan") if value is None else float(value)

            return score

        return {name: make(name) for name in WHITE_BOX}


def zoo_scorers(zoo_dir: str | os.PathLike, progress: bool = False) -> tuple[Callable[[Any], float], dict]:
    """``(uds_fn, white_box_fns)`` for ``meta_eval.evaluate_zoo`` / ``run_meta_eval`` on a zoo."""
    scorers = ZooScorers(zoo_dir, progress=progress)
    return scorers.uds, scorers.white_box_fns()


__all__ = ["ZooScorers", "zoo_scorers"]

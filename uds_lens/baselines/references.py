"""Full and retain reference statistics: what the two anchor models contribute once to every white-box baseline.

Every baseline here is retain-normalised: an unlearned model's erasure at a layer is read against what the full model
(which saw the forget set) and the retain model (which never did) give there. Those two never change across the
unlearned models of one audit, so they are computed once, per method:

* the hidden states at the UDS read positions (lenses, similarity, probes: ``hidden.collect_hidden_states``);
* the lens log-probs ``k_full``, ``k_ret`` (logit lens; tuned lens, after training its translators on calibration
  text through the full model's decoder);
* ``S(full, ret)`` per layer for CKA, RSA, SVCCA, PWCCA;
* the linear probes, fitted on the full model's states, and their losses on full and retain;
* the masked-Fisher anchors (masks and means from the full and retain diagonal Fisher), one per fraction.

`References.observational` then needs one forward (and, for Fisher, one backward per example) of each
unlearned model. ``analysis.diagnose`` and the meta-evaluation's ``ModelScorers`` both build one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from uds_lens.baselines.fisher import FISHER_FRACTIONS, diagonal_fisher, fisher_anchor, masked_fisher
from uds_lens.baselines.hidden import HiddenStates, collect_hidden_states
from uds_lens.baselines.layerwise import LayerwiseErasure
from uds_lens.baselines.lenses import (
    calibration_token_ids,
    entity_logprobs,
    final_decoder,
    lens_result,
    train_tuned_lens,
)
from uds_lens.baselines.probing import fit_probes, probe_layerwise
from uds_lens.baselines.similarity import layer_similarities, similarity_layerwise
from uds_lens.data import load_examples
from uds_lens.sources import SourceLike

logger = logging.getLogger(__name__)

LENS_METHODS = ("logit_lens", "tuned_lens")
SIMILARITY_METHODS = ("cka", "rsa", "svcca", "pwcca")
HIDDEN_METHODS = (*LENS_METHODS, *SIMILARITY_METHODS, "linear_probe")
"""Methods that read the hidden states at the UDS read positions."""


def json_score(value: float | None) -> float | None:
    """A score as ``scores.json`` holds it: NaN (no layer or example with signal) becomes null."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


class References:
    """The full and retain models' contribution to the white-box baselines, computed once.

    Args:
        auditor: A ``UDSAuditor`` with a retain model: its models, encoded examples, tokenizer and pad id are used.
        methods: Method groups to prepare (``HIDDEN_METHODS`` and ``"fisher_masked"``; others are ignored).
        calibration: Tuned-lens training data (the retain set: path or ``Example`` list); without it the tuned
            lens is skipped with a warning and reported as null.
        batch_size: Examples per forward when collecting hidden states.
        tuned_lens_steps: Tuned-lens training steps.
        probe_folds: Linear-probe folds (1 = fitted on all the full model's rows).
        fisher_fractions: Mask fractions of the masked Fisher.
    """

    def __init__(
        self,
        auditor: Any,
        methods: Sequence[str],
        calibration: Any = None,
        batch_size: int = 8,
        tuned_lens_steps: int = 200,
        probe_folds: int = 1,
        fisher_fractions: Sequence[float] = FISHER_FRACTIONS,
    ) -> None:
        self.auditor = auditor
        self.methods = tuple(methods)
        self.batch_size = batch_size
        full, retain, encoded = auditor.full, auditor.retain, auditor.encoded
        self.hidden: dict[str, HiddenStates] = {}
        if any(m in self.methods for m in HIDDEN_METHODS):
            self.hidden = {name: self.collect(model) for name, model in (("full", full), ("retain", retain))}
        self.decoder = final_decoder(full)
        self.k: dict[str, dict[str, torch.Tensor]] = {}
        if "logit_lens" in self.methods:
            self.k["logit_lens"] = {name: entity_logprobs(h, self.decoder) for name, h in self.hidden.items()}
        self.tuned = None
        if "tuned_lens" in self.methods:
            if calibration is None:
                logger.warning(
                    "tuned_lens needs calibration data (the retain set); pass calibration=... Skipping it."
                )
            else:
                examples = load_examples(calibration) if not isinstance(calibration, list) else calibration
                tokens = calibration_token_ids(examples, auditor.tokenizer)
                self.tuned = train_tuned_lens(full, tokens, steps=tuned_lens_steps)
                self.k["tuned_lens"] = {
                    name: entity_logprobs(h, self.decoder, self.tuned) for name, h in self.hidden.items()
                }
        self.sim_full = {
            m: layer_similarities(self.hidden["retain"], self.hidden["full"], m)
            for m in SIMILARITY_METHODS
            if m in self.methods
        }
        self.probes = None
        if "linear_probe" in self.methods:
            self.probes = fit_probes(self.hidden["full"], folds=probe_folds)
            self.probe_loss = {name: self.probes.loss(h) for name, h in self.hidden.items()}
        self.anchors = []
        if "fisher_masked" in self.methods:
            fisher_full = diagonal_fisher(full, encoded)
            fisher_retain = diagonal_fisher(retain, encoded)
            self.anchors = [fisher_anchor(fisher_full, fisher_retain, p) for p in fisher_fractions]

    def collect(self, model: SourceLike) -> HiddenStates:
        """One model's hidden states at the auditor's read positions."""
        return collect_hidden_states(
            model, self.auditor.encoded, batch_size=self.batch_size, pad_id=self.auditor.pad_id
        )

    def observational(self, model: SourceLike) -> tuple[dict[str, float | None], list[LayerwiseErasure]]:
        """Scores (``json_score``: null when undefined) and layerwise erasures of every prepared method for one
        unlearned model."""
        scores: dict[str, float | None] = {}
        layerwise: list[LayerwiseErasure] = []
        hidden = self.collect(model) if self.hidden else None
        for method in LENS_METHODS:
            if method not in self.methods:
                continue
            if method not in self.k:
                scores[method] = None
                continue
            k = self.k[method]
            result = lens_result(
                k["full"],
                k["retain"],
                entity_logprobs(hidden, self.decoder, self.tuned if method == "tuned_lens" else None),
                self.hidden["full"].example_ids,
                method=method,
            )
            scores[method] = json_score(result.score)
            layerwise.append(result.layerwise())
        for method, sim_full in self.sim_full.items():
            result = similarity_layerwise(
                layer_similarities(self.hidden["retain"], hidden, method), sim_full, method
            )
            scores[method] = json_score(result.score)
            layerwise.append(result)
        if self.anchors:
            fisher = diagonal_fisher(model, self.auditor.encoded)
            for anchor in self.anchors:
                result = masked_fisher(anchor, fisher)
                scores[result.method] = json_score(result.score)
                layerwise.append(result)
        if self.probes is not None:
            result = probe_layerwise(
                self.probe_loss["full"], self.probe_loss["retain"], self.probes.loss(hidden)
            )
            scores[result.method] = json_score(result.score)
            layerwise.append(result)
        return scores, layerwise

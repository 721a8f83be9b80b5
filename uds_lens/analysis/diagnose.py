"""``diagnose``: UDS, component patching and every white-box baseline for several unlearned models, written to disk.

One call scores each unlearned model with UDS (through ``UDSAuditor``, S1 computed once per site) and with the
observational baselines (logit and tuned lens, CKA, RSA, SVCCA/PWCCA, masked Fisher, linear probe), reusing the full
and retain models' hidden states and Fisher across models (one forward per model for the representation methods,
one backward per example for Fisher). It writes::

    OUT/NAME/scores.json       one key per method: uds, logit_lens, tuned_lens, cka, rsa, svcca, pwcca,
                               fisher_masked_0.0001, fisher_masked_0.001, fisher_masked_0.01, linear_probe
    OUT/NAME/layerwise.csv     method, layer, erasure, weight
    OUT/NAME/components.csv    site, layer, mean_d1, mean_d2 (the patching sites asked for)
    OUT/prompt_types.csv       per-prompt-type UDS of every model (paper Table 5)
    OUT/tau_sensitivity.csv    UDS under each tau and Spearman rank vs the default, across models (appendix D.3)

For UDS and the lenses, ``layerwise.csv`` pools the examples per layer (``erasure = sum KE d1 LER / sum KE d1``,
``weight = mean KE d1``); their ``scores.json`` value is the mean of per-example scores, as in the paper.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from uds_lens import models
from uds_lens.analysis.case_studies import TAUS, component_summary, prompt_type_uds, tau_sensitivity
from uds_lens.auditor import UDSAuditor, UDSConfig
from uds_lens.baselines.fisher import FISHER_FRACTIONS, diagonal_fisher, fisher_anchor, masked_fisher
from uds_lens.baselines.hidden import HiddenStates, collect_hidden_states
from uds_lens.baselines.layerwise import LayerwiseErasure, delta_erasure
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

logger = logging.getLogger(__name__)

SIMILARITY_METHODS = ("cka", "rsa", "svcca", "pwcca")
METHODS = ("uds", "logit_lens", "tuned_lens", *SIMILARITY_METHODS, "fisher_masked", "linear_probe")
"""Method groups ``diagnose`` knows; ``fisher_masked`` expands to one key per fraction."""
SITES = ("attn_out", "mlp_out", "resid_mid", "resid_post")
HIDDEN_METHODS = ("logit_lens", "tuned_lens", *SIMILARITY_METHODS, "linear_probe")


def _json_value(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _load(model: Any, dtype: str | None, device: str | None) -> Any:
    if isinstance(model, (str, os.PathLike)):
        return models.load_model(model, dtype=dtype, device=device)
    return model


class References:
    """What the full and retain models contribute once, reused for every unlearned model."""

    def __init__(
        self, auditor: UDSAuditor, methods: Sequence[str], calibration: Any, options: dict[str, Any]
    ):
        self.auditor = auditor
        self.methods = methods
        self.options = options
        full, retain, encoded = auditor.full, auditor.retain, auditor.encoded
        self.hidden: dict[str, HiddenStates] = {}
        if any(m in methods for m in HIDDEN_METHODS):
            self.hidden = {name: self.collect(model) for name, model in (("full", full), ("retain", retain))}
        self.decoder = final_decoder(full)
        self.k: dict[str, dict[str, torch.Tensor]] = {}
        if "logit_lens" in methods:
            self.k["logit_lens"] = {name: entity_logprobs(h, self.decoder) for name, h in self.hidden.items()}
        self.tuned = None
        if "tuned_lens" in methods:
            if calibration is None:
                logger.warning(
                    "tuned_lens needs calibration data (the retain set); pass calibration=... Skipping it."
                )
            else:
                examples = load_examples(calibration) if not isinstance(calibration, list) else calibration
                tokens = calibration_token_ids(examples, auditor.tokenizer)
                self.tuned = train_tuned_lens(full, tokens, steps=options["tuned_lens_steps"])
                self.k["tuned_lens"] = {
                    name: entity_logprobs(h, self.decoder, self.tuned) for name, h in self.hidden.items()
                }
        self.sim_full = {
            m: layer_similarities(self.hidden["retain"], self.hidden["full"], m)
            for m in SIMILARITY_METHODS
            if m in methods
        }
        self.probes = None
        if "linear_probe" in methods:
            self.probes = fit_probes(self.hidden["full"], folds=options["probe_folds"])
            self.probe_loss = {name: self.probes.loss(h) for name, h in self.hidden.items()}
        self.anchors = []
        if "fisher_masked" in methods:
            fisher_full = diagonal_fisher(full, encoded)
            fisher_retain = diagonal_fisher(retain, encoded)
            self.anchors = [fisher_anchor(fisher_full, fisher_retain, p) for p in options["fisher_fractions"]]

    def collect(self, model: Any) -> HiddenStates:
        return collect_hidden_states(
            model, self.auditor.encoded, batch_size=self.options["batch_size"], pad_id=self.auditor.pad_id
        )

    def observational(self, model: Any) -> tuple[dict[str, float | None], list[LayerwiseErasure]]:
        """Scores and layerwise erasures of every non-patching method for one unlearned model."""
        scores: dict[str, float | None] = {}
        layerwise: list[LayerwiseErasure] = []
        hidden = self.collect(model) if self.hidden else None
        for method in ("logit_lens", "tuned_lens"):
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
            scores[method] = _json_value(result.score)
            layerwise.append(result.layerwise())
        for method, sim_full in self.sim_full.items():
            result = similarity_layerwise(
                layer_similarities(self.hidden["retain"], hidden, method), sim_full, method
            )
            scores[method] = _json_value(result.score)
            layerwise.append(result)
        if self.anchors:
            fisher = diagonal_fisher(model, self.auditor.encoded)
            for anchor in self.anchors:
                result = masked_fisher(anchor, fisher)
                scores[result.method] = _json_value(result.score)
                layerwise.append(result)
        if self.probes is not None:
            result = probe_layerwise(
                self.probe_loss["full"], self.probe_loss["retain"], self.probes.loss(hidden)
            )
            scores[result.method] = _json_value(result.score)
            layerwise.append(result)
        return scores, layerwise


def uds_layerwise(layers: pd.DataFrame, tau: float) -> LayerwiseErasure:
    """UDS pooled per layer from a one-site ``UDSResult.layers`` table (``erasure = sum KE d1 LER / sum KE d1``)."""
    d1 = layers.pivot(index="idx", columns="layer", values="d1").sort_index(axis=1)
    d2 = layers.pivot(index="idx", columns="layer", values="d2").reindex_like(d1)
    erasure = delta_erasure(
        torch.tensor(d1.to_numpy(), dtype=torch.float64),
        torch.tensor(d2.to_numpy(), dtype=torch.float64),
        tau=tau,
        eps=0.0,
        min_weight=0.0,
    )
    return erasure.layerwise("uds")


def diagnose(
    full: Any,
    retain: Any,
    unlearned: Mapping[str, Any],
    data: Any,
    out_dir: str | os.PathLike,
    methods: Sequence[str] = METHODS,
    sites: Sequence[str] = ("resid_post",),
    tau: float = 0.05,
    taus: Sequence[float] = TAUS,
    calibration: Any = None,
    fisher_fractions: Sequence[float] = FISHER_FRACTIONS,
    tuned_lens_steps: int = 200,
    probe_folds: int = 1,
    batch_size: int = 8,
    published_compat: bool = False,
    tokenizer: Any = None,
    cache_dir: str | os.PathLike | bool | None = None,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Score unlearned models with UDS, component patching and the white-box baselines; write the tables.

    Args:
        full: Full model (checkpoint dir, hub id or loaded ``HookedTransformer``).
        retain: Retain model (same forms); required, every method here is retain-normalised.
        unlearned: Name -> unlearned model (same forms); the name is the output subdirectory.
        data: Forget set (path, hub id, records or ``Example`` list).
        out_dir: Output directory.
        methods: Any of ``METHODS`` (``fisher_masked`` gives one key per fraction).
        sites: Patching sites for ``components.csv`` (``attn_out``, ``mlp_out``, ``resid_mid``, ``resid_post``);
            UDS itself is always the ``resid_post`` score.
        tau: KE threshold of UDS (the lenses use the published 0.05 regardless).
        taus: Thresholds of ``tau_sensitivity.csv``.
        calibration: Tuned-lens training data (the retain set: path or ``Example`` list); tuned lens is null without.
        fisher_fractions: Mask fractions of the masked Fisher.
        tuned_lens_steps: Tuned-lens training steps.
        probe_folds: Linear-probe folds (1 = fitted on all the full model's rows).
        batch_size: Examples per forward.
        published_compat: Published prompt/last-layer behaviour for UDS and the encoding.
        tokenizer: Defaults to the full model's.
        cache_dir: UDS S1 cache (see ``UDSAuditor``).
        dtype: dtype for models loaded from paths.
        device: Device for models loaded from paths.
        progress: Progress bars.

    Returns:
        Scores table: one row per unlearned model, one column per method key.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
    bad_sites = [s for s in sites if s not in SITES]
    if bad_sites:
        raise ValueError(f"unknown sites {bad_sites}; choose from {list(SITES)}")
    if retain is None:
        raise ValueError("diagnose needs a retain model: every method it reports is normalised by retain")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = UDSConfig(
        tau=tau, published_compat=published_compat, batch_size=batch_size, dtype=dtype, device=device
    )
    main = UDSAuditor(
        full, retain, data, config=config, tokenizer=tokenizer, cache_dir=cache_dir, progress=progress
    )
    auditors = {"resid_post": main}
    for site in sites:
        if site != "resid_post":
            auditors[site] = UDSAuditor(
                main.full,
                main.retain,
                main.examples,
                config=UDSConfig(
                    tau=tau,
                    site=site,
                    published_compat=published_compat,
                    batch_size=batch_size,
                    dtype=dtype,
                    device=device,
                ),
                tokenizer=main.tokenizer,
                cache_dir=cache_dir,
                progress=progress,
            )
    options = {
        "batch_size": batch_size,
        "tuned_lens_steps": tuned_lens_steps,
        "probe_folds": probe_folds,
        "fisher_fractions": tuple(fisher_fractions),
    }
    reference = References(main, methods, calibration, options)
    all_scores: dict[str, dict[str, float | None]] = {}
    examples_by_model: dict[str, pd.DataFrame] = {}
    layers_by_model: dict[str, pd.DataFrame] = {}
    for name, source in unlearned.items():
        logger.info("diagnosing %s", name)
        model = _load(source, dtype, device or main.device)
        scores: dict[str, float | None] = {}
        layerwise: list[LayerwiseErasure] = []
        site_layers = []
        needs_patching = "uds" in methods or any(s != "resid_post" for s in sites)
        if needs_patching:
            for site, auditor in auditors.items():
                if site == "resid_post" and "uds" not in methods and site not in sites:
                    continue
                result = auditor.score(model, name=name)
                if site == "resid_post":
                    examples_by_model[name] = result.examples
                    layers_by_model[name] = result.layers
                    if "uds" in methods:
                        scores["uds"] = _json_value(result.uds)
                        layerwise.append(uds_layerwise(result.layers, tau))
                if site in sites:
                    site_layers.append(result.layers)
        observational, observational_layerwise = reference.observational(model)
        scores.update(observational)
        layerwise += observational_layerwise
        model_dir = out / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "scores.json").write_text(json.dumps(scores, indent=2))
        layer_table = pd.concat([lw.to_frame() for lw in layerwise], ignore_index=True) if layerwise else None
        if layer_table is None:
            layer_table = pd.DataFrame(columns=["method", "layer", "erasure", "weight"])
        layer_table.to_csv(model_dir / "layerwise.csv", index=False)
        components = (
            component_summary(pd.concat(site_layers, ignore_index=True))
            if site_layers
            else pd.DataFrame(columns=["site", "layer", "mean_d1", "mean_d2"])
        )
        components.to_csv(model_dir / "components.csv", index=False)
        all_scores[name] = scores
        if model is not source:
            del model
    if examples_by_model:
        prompt_type_uds(examples_by_model).to_csv(out / "prompt_types.csv", index=False)
        tau_sensitivity(layers_by_model, taus=taus, default_tau=tau).to_csv(
            out / "tau_sensitivity.csv", index=False
        )
    return pd.DataFrame.from_dict(all_scores, orient="index")

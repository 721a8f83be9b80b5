"""``diagnose``: UDS, component patching and every white-box baseline for several unlearned models, in one result.

One call scores each unlearned model with UDS (through ``UDSAuditor``, S1 computed once per site) and with the
observational baselines (logit and tuned lens, CKA, RSA, SVCCA/PWCCA, masked Fisher, linear probe), reusing the full
and retain models' statistics across models (``baselines.references.References``: one forward per model for the
representation methods, one backward per example for Fisher). It returns a `DiagnoseResult`, whose
``save(out_dir)`` writes (each model directory atomically)::

    OUT/NAME/scores.json       one key per method: uds, logit_lens, tuned_lens, cka, rsa, svcca, pwcca,
                               fisher_masked_0.0001, fisher_masked_0.001, fisher_masked_0.01, linear_probe
    OUT/NAME/layerwise.csv     method, layer, erasure, weight
    OUT/NAME/components.csv    site, layer, mean_d1, mean_d2 (the patching sites asked for)
    OUT/prompt_types.csv       per-prompt-type UDS of every model (paper Table 5)
    OUT/tau_sensitivity.csv    UDS under each tau and Spearman rank vs the default, across models (appendix D.3)
    OUT/clipped_examples.csv   the examples whose UDS rests mostly on clipped cells (d2 > d1), every model's:
                               model, idx, uds, uds_unclipped, uds_clipped, excess_disruption, n_ke, n_clipped,
                               question, entity

For UDS and the lenses, ``layerwise.csv`` pools the examples per layer (``erasure = sum KE d1 LER / sum KE d1``,
``weight = mean KE d1``; ``baselines.layerwise.pooled_layerwise``); their ``scores.json`` value is the mean of
per-example scores, as in the paper.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch
from transformers import PreTrainedTokenizerBase

from uds_lens import uds
from uds_lens.analysis.case_studies import TAUS, component_summary, prompt_type_uds, tau_sensitivity
from uds_lens.auditor import UDSAuditor
from uds_lens.baselines.fisher import FISHER_FRACTIONS
from uds_lens.baselines.layerwise import LayerwiseErasure, pooled_layerwise
from uds_lens.baselines.references import References, json_score
from uds_lens.checkpoints.loader import ModelArg, load
from uds_lens.config import DEFAULT_TAU, UDSConfig, as_site, check_choice, check_positive_int
from uds_lens.data import DataArg
from uds_lens.files import write_atomic
from uds_lens.metrics import registry
from uds_lens.outputs import check_outputs_apart, check_writable_dir
from uds_lens.result_store import DIAGNOSE_FILES, atomic_result_dir
from uds_lens.results import UDSResult
from uds_lens.scoring import check_output_dir
from uds_lens.stage_cache import s1_cache_dir

logger = logging.getLogger(__name__)

# UDS and every white-box method of the metric registry (its order: the paper's rows first).
METHODS = ("uds", *registry.names(kind=registry.WHITE_BOX))
"""Method groups ``diagnose`` knows; ``fisher_masked`` expands to one key per fraction."""
SITES = ("attn_out", "mlp_out", "resid_mid", "resid_post")
LAYERWISE_COLUMNS = ["method", "layer", "erasure", "weight"]
COMPONENT_COLUMNS = ["site", "layer", "mean_d1", "mean_d2"]
CLIPPED_EXAMPLE_COLUMNS = [
    "model",
    "idx",
    "uds",
    "uds_unclipped",
    "uds_clipped",
    "excess_disruption",
    "n_ke",
    "n_clipped",
    "question",
    "entity",
]


def clipped_examples(results: Mapping[str, UDSResult]) -> pd.DataFrame:
    """Every model's examples whose ``UDS_i`` rests mostly on clipped cells (``CLIPPED_EXAMPLE_COLUMNS``), in the
    models' order, largest clipped part first within a model."""
    frames = [
        result.mostly_clipped_examples().assign(model=name)[CLIPPED_EXAMPLE_COLUMNS]
        for name, result in results.items()
    ]
    frames = [frame for frame in frames if not frame.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=CLIPPED_EXAMPLE_COLUMNS)


@dataclass(frozen=True)
class DiagnoseResult:
    """Every table ``diagnose`` computes, for the unlearned models in the order they were given.

    Attributes:
        scores: One row per model (index = name), one column per method key (``scores.json``); NaN where a method
            is undefined (no layer or example with signal, or a tuned lens without calibration data).
        layerwise: Model -> ``method, layer, erasure, weight``: every method's per-layer erasure and weight.
        components: Model -> ``site, layer, mean_d1, mean_d2`` of the patching sites asked for (empty without).
        uds_results: Model -> its ``resid_post`` ``UDSResult`` (empty when no patching ran).
        prompt_types: Per-prompt-type UDS of every model (``case_studies.prompt_type_uds``), None without UDS.
        tau_sensitivity: UDS under each tau against the default, across models (``case_studies.tau_sensitivity``),
            None without UDS.
        clipped_examples: the examples whose ``UDS_i`` rests mostly on clipped cells, every model's
            (``UDSResult.mostly_clipped_examples``: their score says the unlearned model disrupts more than retain
            there, not that it erased like retain), None without UDS.
    """

    scores: pd.DataFrame
    layerwise: dict[str, pd.DataFrame]
    components: dict[str, pd.DataFrame]
    uds_results: dict[str, UDSResult]
    prompt_types: pd.DataFrame | None
    tau_sensitivity: pd.DataFrame | None
    clipped_examples: pd.DataFrame | None = None

    def clipped_lines(self) -> list[str]:
        """One line per model: how many of its scored examples rest mostly on clipped cells, and its excess
        disruption (what ``uds-lens diagnose`` prints; the examples themselves are
        `clipped_examples`)."""
        return [
            f"{name}: {result.split['n_mostly_clipped']} of {result.summary['n_scored']} scored examples rest mostly "
            f"on clipped cells (d2 > d1); excess disruption {result.split['excess_disruption']:.2f}"
            for name, result in self.uds_results.items()
        ]

    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write the tables (layout in the module docstring); each ``OUT/NAME`` is replaced as one step."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in self.layerwise:
            row = self.scores.loc[name] if name in self.scores.index else pd.Series(dtype=float)
            # owns only its own files: a `score` result in OUT/NAME (summary, tables, meta.json) stays whole
            with atomic_result_dir(out / name, owns=DIAGNOSE_FILES) as staging:
                scores = {str(method): json_score(value) for method, value in row.items()}
                (staging / "scores.json").write_text(json.dumps(scores, indent=2))
                write_atomic(staging / "layerwise.csv", self.layerwise[name].to_csv(index=False))
                write_atomic(staging / "components.csv", self.components[name].to_csv(index=False))
        if self.prompt_types is not None:
            write_atomic(out / "prompt_types.csv", self.prompt_types.to_csv(index=False))
        if self.tau_sensitivity is not None:
            write_atomic(out / "tau_sensitivity.csv", self.tau_sensitivity.to_csv(index=False))
        if self.clipped_examples is not None:
            write_atomic(out / "clipped_examples.csv", self.clipped_examples.to_csv(index=False))
        return out


def uds_layerwise(layers: pd.DataFrame, tau: float) -> LayerwiseErasure:
    """UDS pooled per layer from a one-site ``UDSResult.layers`` table (``erasure = sum KE d1 LER / sum KE d1``)."""
    d1 = layers.pivot(index="idx", columns="layer", values="d1").sort_index(axis=1)
    d2 = layers.pivot(index="idx", columns="layer", values="d2").reindex_like(d1)
    d1_values, d2_values = d1.to_numpy(dtype=float), d2.to_numpy(dtype=float)
    return pooled_layerwise(
        "uds",
        torch.tensor(d1_values, dtype=torch.float64),
        torch.tensor(uds.ke_mask(d1_values, tau)),
        torch.tensor(uds.layer_erasure_ratio(d1_values, d2_values), dtype=torch.float64),
    )


def diagnose(
    full: ModelArg,
    retain: ModelArg | None,
    unlearned: Mapping[str, ModelArg],
    data: DataArg,
    out_dir: str | os.PathLike | None = None,
    methods: Sequence[str] = METHODS,
    sites: Sequence[str] = ("resid_post",),
    tau: float = DEFAULT_TAU,
    taus: Sequence[float] = TAUS,
    calibration: DataArg = None,
    fisher_fractions: Sequence[float] = FISHER_FRACTIONS,
    tuned_lens_steps: int = 200,
    probe_folds: int = 1,
    batch_size: int = 8,
    published_compat: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = False,
) -> DiagnoseResult:
    """Score unlearned models with UDS, component patching and the white-box baselines.

    Args:
        full: Full model (checkpoint dir, hub id, ``zoo:NAME`` or a loaded ``TransformerBridge``).
        retain: Retain model (same forms); required, every method here is retain-normalised.
        unlearned: Name -> unlearned model (same forms); the name is the output subdirectory.
        data: Forget set (path, hub id, records or ``Example`` list).
        out_dir: If given, the result is also saved there (``DiagnoseResult.save``).
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
        Every table, one field each (``DiagnoseResult``).

    Raises:
        ConfigError: before any model loads: an unknown method or site, ``tuned_lens_steps`` not a positive
            integer, or an ``out_dir`` that is a file, overlaps an input or cannot be written.
    """
    for method in methods:
        check_choice("methods (--methods)", method, METHODS)
    for site in sites:  # resid_pre is a UDS site, not one of component patching's
        check_choice("sites (--sites)", site, SITES)
    # 0 steps would report the untrained lens, the logit lens exactly, as the tuned lens
    check_positive_int("tuned_lens_steps (--tuned-lens-steps)", tuned_lens_steps, None)
    if out_dir is not None:  # before any model loads: a directory apart from every input, that can be written
        check_output_dir(out_dir)
        check_outputs_apart(
            {"--out": out_dir},
            {
                "checkpoint": [full, retain, *unlearned.values()],
                "--data": data,
                "calibration data": calibration,
            },
            caches={"S1 cache": s1_cache_dir(cache_dir)},
        )
        check_writable_dir(out_dir)
    if retain is None:
        raise ValueError("diagnose needs a retain model: every method it reports is normalised by retain")
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
                config=replace(config, site=as_site(site)),
                tokenizer=main.tokenizer,
                cache_dir=cache_dir,
                progress=progress,
            )
    reference = References(
        main,
        methods,
        calibration,
        batch_size=batch_size,
        tuned_lens_steps=tuned_lens_steps,
        probe_folds=probe_folds,
        fisher_fractions=tuple(fisher_fractions),
    )
    all_scores: dict[str, dict[str, float | None]] = {}
    layerwise_by_model: dict[str, pd.DataFrame] = {}
    components_by_model: dict[str, pd.DataFrame] = {}
    uds_results: dict[str, UDSResult] = {}
    for name, source in unlearned.items():
        logger.info("diagnosing %s", name)
        model = load(source, dtype=dtype, device=device or main.device, role=name)
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
                    uds_results[name] = result
                    if "uds" in methods:
                        scores["uds"] = json_score(result.uds)
                        layerwise.append(uds_layerwise(result.layers, tau))
                if site in sites:
                    site_layers.append(result.layers)
        observational, observational_layerwise = reference.observational(model)
        scores.update(observational)
        layerwise += observational_layerwise
        layerwise_by_model[name] = (
            pd.concat([lw.to_frame() for lw in layerwise], ignore_index=True)
            if layerwise
            else pd.DataFrame(columns=LAYERWISE_COLUMNS)
        )
        components_by_model[name] = (
            component_summary(pd.concat(site_layers, ignore_index=True))
            if site_layers
            else pd.DataFrame(columns=COMPONENT_COLUMNS)
        )
        all_scores[name] = scores
        if model is not source:
            del model
    examples_by_model = {name: result.examples for name, result in uds_results.items()}
    layers_by_model = {name: result.layers for name, result in uds_results.items()}
    diagnosis = DiagnoseResult(
        scores=pd.DataFrame.from_dict(all_scores, orient="index"),
        layerwise=layerwise_by_model,
        components=components_by_model,
        uds_results=uds_results,
        prompt_types=prompt_type_uds(examples_by_model) if uds_results else None,
        tau_sensitivity=tau_sensitivity(layers_by_model, taus=taus, default_tau=tau) if uds_results else None,
        clipped_examples=clipped_examples(uds_results) if uds_results else None,
    )
    if out_dir is not None:
        diagnosis.save(out_dir)
    return diagnosis

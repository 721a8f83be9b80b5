"""Case-study analyses over UDS result tables (the paper's §5 and appendix D), each returning a DataFrame.

Inputs are the long tables a ``UDSResult`` carries: ``examples`` (``idx, prompt_type, n_entity_tokens, n_ke, uds,
status, skip_reason``) and ``layers`` (``idx, layer, site, s0, baseline_score, s1_score, s2_score, d1, d2, ke, ler``). Nothing here
runs a model: tau is a threshold on the cached ``d1`` (KE layers ``d1 > tau``, ``LER = clip(d2 / d1, 0, 1)``,
``UDS_i = sum_KE d1 LER / sum_KE d1``, undefined with no KE layer), so re-applying it to a ``layers`` table gives what
a full recomputation would.

* ``prompt_type_uds``: mean UDS per prompt type and model (paper Table 5, appendix D.4);
* ``tau_sensitivity`` / ``ke_size_distribution``: KE-set sizes, no-KE counts, model UDS and its Spearman rank
  agreement with the default tau across models (appendix D.3);
* ``entity_length_correlation``: entity token count against UDS (appendix D.5);
* ``first_erased_layer`` / ``layer_profile``: where S2 starts to destroy the entity (RMU, appendix D.6);
* ``bootstrap_ci`` (the core's, re-exported): percentile bootstrap interval of the mean of any per-example score
  (UDS, logit lens, ...; pass ``examples["uds"].to_numpy()``);
* ``method_agreement`` / ``rank_concordance``: Spearman and pairwise-order agreement between metrics across models;
* ``component_summary``: mean d1/d2 per patching site and layer (appendix D.2);
* ``lens_vs_uds``: one example's lens and patching deltas side by side, layer by layer (paper Table 4).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from uds_lens import uds
from uds_lens.config import DEFAULT_TAU
from uds_lens.layer_table import one_site

__all__ = [
    "TAUS",
    "component_shares",
    "component_summary",
    "entity_length_correlation",
    "first_erased_layer",
    "ke_size_distribution",
    "layer_profile",
    "lens_vs_uds",
    "method_agreement",
    "onset_summary",
    "prompt_type_uds",
    "rank_concordance",
    "rescore_uds",
    "tau_sensitivity",
    "uds_by_entity_length",
]

TAUS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.1)
"""The thresholds of the paper's appendix D.3."""


def rescore_uds(layers: pd.DataFrame, tau: float = DEFAULT_TAU, site: str | None = None) -> pd.DataFrame:
    """Per-example UDS at another tau from a ``layers`` table, without re-running any model.

    Args:
        layers: Long UDS table (``idx, layer, d1, d2``; ``site`` optional).
        tau: KE threshold (strict ``d1 > tau``).
        site: Site to use when the table holds several (default resid_post: `results.one_site`).

    Returns:
        ``idx, n_ke, uds, status`` (``scored`` or ``no_ke``), one row per example in the table.
    """
    _, per_example = uds.rescore(one_site(layers, site), tau)
    per_example = per_example.sort_values("idx", kind="stable", ignore_index=True)
    return per_example.assign(status=np.where(per_example["uds"].isna(), "no_ke", "scored"))


def _nanmean(values: pd.Series | np.ndarray) -> float:
    array = np.asarray(values, dtype=float)
    array = array[~np.isnan(array)]
    return float(array.mean()) if array.size else math.nan


def prompt_type_uds(examples_by_model: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Mean UDS per prompt type for each model (paper Table 5).

    Args:
        examples_by_model: Model name -> ``UDSResult.examples``.

    Returns:
        ``model, prompt_type, n, n_scored, mean_uds, mean_n_entity_tokens, mean_n_ke``, with an ``overall`` row per
        model; examples without a prompt type are grouped as ``"unknown"``.
    """
    rows = []
    for model, examples in examples_by_model.items():
        table = examples.assign(prompt_type=examples["prompt_type"].fillna("unknown").astype(str))
        groups = [(str(name), group) for name, group in table.groupby("prompt_type", sort=True)]
        for prompt_type, group in [*groups, ("overall", table)]:
            scored = group[group["status"] == "scored"]
            rows.append(
                {
                    "model": model,
                    "prompt_type": prompt_type,
                    "n": len(group),
                    "n_scored": len(scored),
                    "mean_uds": _nanmean(scored["uds"]),
                    "mean_n_entity_tokens": _nanmean(group["n_entity_tokens"]),
                    "mean_n_ke": _nanmean(scored["n_ke"]),
                }
            )
    return pd.DataFrame(rows)


def _ke_size_statistics(n_ke: pd.Series) -> dict[str, float]:
    """``ke_mean, ke_std, ke_min, ke_max, ke_median`` of the examples' KE-set sizes (std NaN for one example)."""
    sizes = n_ke.to_numpy()
    return {
        "ke_mean": float(sizes.mean()),
        "ke_std": float(sizes.std(ddof=1)) if sizes.size > 1 else math.nan,
        "ke_min": int(sizes.min()),
        "ke_max": int(sizes.max()),
        "ke_median": float(np.median(sizes)),
    }


def ke_size_distribution(
    layers: pd.DataFrame, taus: Sequence[float] = TAUS, site: str | None = None
) -> pd.DataFrame:
    """KE-set size per example at each tau (appendix D.3a): mean, std, min, max, median, no-KE count and share."""
    rows = []
    for tau in taus:
        rescored = rescore_uds(layers, tau, site)
        n_no_ke = int((rescored["status"] == "no_ke").sum())
        rows.append(
            {
                "tau": tau,
                **_ke_size_statistics(rescored["n_ke"]),
                "n_no_ke": n_no_ke,
                "pct_no_ke": 100.0 * n_no_ke / len(rescored),
            }
        )
    return pd.DataFrame(rows)


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    a_arr, b_arr = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = ~(np.isnan(a_arr) | np.isnan(b_arr))
    if keep.sum() < 2 or np.unique(a_arr[keep]).size < 2 or np.unique(b_arr[keep]).size < 2:
        return math.nan
    return float(stats.spearmanr(a_arr[keep], b_arr[keep]).statistic)


def tau_sensitivity(
    layers_by_model: Mapping[str, pd.DataFrame],
    taus: Sequence[float] = TAUS,
    default_tau: float = DEFAULT_TAU,
    site: str | None = None,
) -> pd.DataFrame:
    """Model UDS under each tau against the default, across models (appendix D.3).

    Args:
        layers_by_model: Model name -> ``UDSResult.layers`` (S1 shared, so the KE sizes are the same for all).
        taus: Thresholds to re-apply.
        default_tau: Reference threshold.
        site: Site to use when the tables hold several.

    Returns:
        One row per (model, tau): ``model, tau, uds, abs_delta`` (vs the default), ``n_scored, n_no_ke``, the KE-size
        statistics ``ke_mean, ke_std, ke_min, ke_max, ke_median`` and ``spearman`` (rank correlation of all models'
        UDS at this tau with their UDS at the default; NaN with fewer than two models).
    """
    taus = sorted(set(taus) | {default_tau})
    per_model: dict[str, dict[float, pd.DataFrame]] = {
        model: {tau: rescore_uds(layers, tau, site) for tau in taus}
        for model, layers in layers_by_model.items()
    }
    model_uds = {
        model: {tau: _nanmean(t["uds"]) for tau, t in by_tau.items()} for model, by_tau in per_model.items()
    }
    names = list(layers_by_model)
    rows = []
    for tau in taus:
        rho = _spearman([model_uds[m][tau] for m in names], [model_uds[m][default_tau] for m in names])
        for model in names:
            rescored = per_model[model][tau]
            rows.append(
                {
                    "model": model,
                    "tau": tau,
                    "uds": model_uds[model][tau],
                    "abs_delta": abs(model_uds[model][tau] - model_uds[model][default_tau]),
                    "n_scored": int((rescored["status"] == "scored").sum()),
                    "n_no_ke": int((rescored["status"] == "no_ke").sum()),
                    **_ke_size_statistics(rescored["n_ke"]),
                    "spearman": rho,
                }
            )
    return pd.DataFrame(rows)


def entity_length_correlation(examples_by_model: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Correlation of entity token count with per-example UDS, per model (appendix D.5).

    Returns:
        ``model, n, spearman, spearman_p, pearson, pearson_p`` over the scored examples.
    """
    rows = []
    for model, examples in examples_by_model.items():
        scored = examples[(examples["status"] == "scored") & examples["uds"].notna()]
        lengths, uds = scored["n_entity_tokens"].to_numpy(float), scored["uds"].to_numpy(float)
        varied = len(scored) > 2 and np.unique(lengths).size > 1 and np.unique(uds).size > 1
        spearman = stats.spearmanr(lengths, uds) if varied else None
        pearson = stats.pearsonr(lengths, uds) if varied else None
        rows.append(
            {
                "model": model,
                "n": len(scored),
                "spearman": float(spearman.statistic) if spearman else math.nan,
                "spearman_p": float(spearman.pvalue) if spearman else math.nan,
                "pearson": float(pearson.statistic) if pearson else math.nan,
                "pearson_p": float(pearson.pvalue) if pearson else math.nan,
            }
        )
    return pd.DataFrame(rows)


def uds_by_entity_length(examples: pd.DataFrame) -> pd.DataFrame:
    """Mean and std of UDS per entity token count (scored examples): ``n_entity_tokens, n, mean_uds, std_uds``."""
    scored = examples[examples["status"] == "scored"]
    grouped = scored.groupby("n_entity_tokens")["uds"]
    return pd.DataFrame(
        {"n": grouped.size(), "mean_uds": grouped.mean(), "std_uds": grouped.std()}
    ).reset_index()


def first_erased_layer(
    layers: pd.DataFrame, tau: float = DEFAULT_TAU, site: str | None = None
) -> pd.DataFrame:
    """Per example, the first layer with ``d2 > tau`` (where S2 starts destroying the entity): ``idx, onset``.

    ``onset`` is NaN when no layer has ``d2 > tau``.
    """
    table = one_site(layers, site)
    above = table[table["d2"] > tau]
    onset = above.groupby("idx")["layer"].min()
    ids = pd.Index(sorted(table["idx"].unique()), name="idx")
    return onset.reindex(ids).rename("onset").reset_index()


def layer_profile(layers: pd.DataFrame, tau: float = DEFAULT_TAU, site: str | None = None) -> pd.DataFrame:
    """Per-layer profile of one model (appendix D.6): how S2 erasure is distributed over depth.

    Returns:
        ``layer, mean_d1, mean_d2, mean_ler_ke`` (LER averaged over KE rows), ``frac_ke``, ``frac_d2_above_tau`` and
        ``n_onset`` (examples whose first ``d2 > tau`` layer is this one).
    """
    table, _ = uds.rescore(one_site(layers, site), tau)
    onset = first_erased_layer(table, tau)["onset"].dropna().astype(int).value_counts()
    grouped = table.groupby("layer")
    profile = pd.DataFrame(
        {
            "mean_d1": grouped["d1"].mean(),
            "mean_d2": grouped["d2"].mean(),
            "mean_ler_ke": grouped["ler"].mean(),
            "frac_ke": grouped["ke"].mean(),
            "frac_d2_above_tau": grouped["d2"].apply(lambda d2: float((d2 > tau).mean())),
        }
    )
    profile["n_onset"] = onset.reindex(profile.index, fill_value=0).to_numpy()
    return profile.reset_index()


def onset_summary(layers_by_model: Mapping[str, pd.DataFrame], tau: float = DEFAULT_TAU) -> pd.DataFrame:
    """Per model: median and modal first-erased layer and the share of examples with any ``d2 > tau``."""
    rows = []
    for model, layers in layers_by_model.items():
        onset = first_erased_layer(layers, tau)["onset"]
        found = onset.dropna()
        rows.append(
            {
                "model": model,
                "median_onset": float(found.median()) if len(found) else math.nan,
                "mode_onset": float(found.mode().min()) if len(found) else math.nan,
                "frac_with_onset": len(found) / len(onset) if len(onset) else math.nan,
            }
        )
    return pd.DataFrame(rows)


def method_agreement(scores: pd.DataFrame) -> pd.DataFrame:
    """Spearman correlation between metric columns across models (rows = models, columns = methods)."""
    return scores.astype(float).corr(method="spearman")


def rank_concordance(scores: pd.DataFrame, reference: str = "uds") -> pd.Series:
    """Share of model pairs that each metric orders the same way as ``reference`` (ties count as disagreement)."""
    result = {}
    for method in scores.columns:
        agree = total = 0
        for a, b in itertools.combinations(scores.index, 2):
            ref = np.sign(scores.at[a, reference] - scores.at[b, reference])
            other = np.sign(scores.at[a, method] - scores.at[b, method])
            if np.isnan(ref) or np.isnan(other) or ref == 0:
                continue
            total += 1
            agree += int(ref == other)
        result[method] = agree / total if total else math.nan
    return pd.Series(result, name=f"concordance_with_{reference}")


def component_summary(layers: pd.DataFrame) -> pd.DataFrame:
    """Mean d1 and d2 per patching site and layer (appendix D.2): ``site, layer, mean_d1, mean_d2``."""
    if "site" not in layers.columns:
        raise ValueError("component_summary needs a layers table with a 'site' column (UDSResult.layers)")
    grouped = layers.groupby(["site", "layer"], sort=True)
    return pd.DataFrame({"mean_d1": grouped["d1"].mean(), "mean_d2": grouped["d2"].mean()}).reset_index()


def component_shares(layers: pd.DataFrame, reference_site: str = "resid_post") -> pd.DataFrame:
    """Per site, mean d1 over examples and layers, and its ratio to the reference site's (the "mean delta" table)."""
    means = layers.groupby("site")["d1"].mean()
    reference = means.get(reference_site, math.nan)
    return pd.DataFrame({"mean_d1": means, "share_of_reference": means / reference}).reset_index()


def lens_vs_uds(
    uds_layers: pd.DataFrame, lens_layers: pd.DataFrame, idx: int, tau: float = DEFAULT_TAU
) -> pd.DataFrame:
    """Paper Table 4 for one example: lens and patching ``d1, d2, KE, LER`` per layer, side by side.

    Args:
        uds_layers: ``UDSResult.layers`` (one site).
        lens_layers: ``LensResult.layers``.
        idx: Example to show.
        tau: KE threshold for both.
    """
    columns = ["layer", "d1", "d2"]
    patching = one_site(uds_layers, None)
    patching = patching[patching["idx"] == idx][columns].set_index("layer")
    lens = lens_layers[lens_layers["idx"] == idx][columns].set_index("layer")
    if patching.empty or lens.empty:
        raise ValueError(f"example {idx} is missing from the {'UDS' if patching.empty else 'lens'} table")
    table = patching.add_prefix("uds_").join(lens.add_prefix("lens_"), how="outer")
    for prefix in ("uds_", "lens_"):
        d1, d2 = table[f"{prefix}d1"].to_numpy(float), table[f"{prefix}d2"].to_numpy(float)
        ke = uds.ke_mask(d1, tau)
        table[f"{prefix}ke"] = ke
        table[f"{prefix}ler"] = np.where(ke, uds.layer_erasure_ratio(d1, d2), np.nan)
    return table.reset_index()

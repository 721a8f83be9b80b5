"""Meta-evaluation: which unlearning metric is faithful and robust on *your* model pool?

Following Dorna et al. (2025) as extended by the UDS paper (§4, App. E), every metric ``m`` is first oriented so that
higher = more knowledge (``k = m`` for output metrics and raw MIA AUCs, ``k = 1 - m`` for metrics where higher = erased:
``s_mia_*``, UDS, logit lens, CKA, Fisher), then scored on:

- **Faithfulness** = AUC-ROC of ``k`` separating a P pool (models trained *with* the forget set, label 1) from an N
  pool (never saw it, label 0).
- **Quantisation** (NF4 4-bit, bf16 compute) per unlearned model, symmetric:
  ``Q = 1 - clip(|k_after - k_before| / (|k_before| + |k_after| + eps), 0, 1)``.
- **Relearning** (one epoch of fine-tuning on the forget set) of each unlearned model and of retain, with
  ``Δ = k_after - k_before``: ``R = 1 - clip(|Δ_unl - Δ_ret| / (|Δ_unl| + |Δ_ret| + eps), 0, 1)``.
- Only unlearned models with utility ``>= 0.8 x`` the full model's, and classified as *unlearned* by the metric's own
  faithfulness threshold (``k`` below the P/N cut that maximises Youden's J = TPR - FPR), enter Q and R.
- ``robustness = HM(mean Q, mean R)``, ``overall = HM(faithfulness, robustness)``.

(Open-Unlearning's asymmetric ``min(m_after/m_before, 1)`` / ``min(Δ_ret/Δ_unl, 1)`` are not used: the paper reports
the symmetric ones.) The attacks live here too: ``quantise_nf4`` and ``relearn``; ``run_meta_eval`` runs everything on
a zoo and writes ``meta_eval.csv``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import roc_auc_score, roc_curve
from tqdm.auto import tqdm

from uds_lens.metrics.memorization import harmonic_mean

logger = logging.getLogger(__name__)

EPS = 1e-10
UTILITY_THRESHOLD = 0.8
UTILITY_COLUMN = "model_utility"
# The models whose robustness is measured: the unlearned models, and a zoo's extra hyperparameter sweep of them.
ROBUSTNESS_ROLES = ("unlearned", "sweep")
# the meta-evaluation reads utility only through the utility filter on the unlearned models (relative to full)
UTILITY_ROLES = ("full", "retain", *ROBUSTNESS_ROLES)


@dataclass(frozen=True)
class MetricSpec:
    """One row of the meta-evaluation.

    Attributes:
        key: column name in ``metrics.csv``.
        label: the paper's name.
        group: Memorization / Generation / Privacy / Normalized / White-box.
        higher_means_knowledge: False for metrics where higher = erased (inverted with ``1 - x`` first).
        scope: the paper's tags, O (output-level), R (retain-referenced), I (internal).
    """

    key: str
    label: str
    group: str
    higher_means_knowledge: bool
    scope: str


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("es", "Extraction Strength", "Memorization", True, "O"),
    MetricSpec("em", "Exact Memorization", "Memorization", True, "O"),
    MetricSpec("prob", "Probability", "Memorization", True, "O"),
    MetricSpec("paraprob", "Paraphrased Probability", "Memorization", True, "O"),
    MetricSpec("truth_ratio", "Truth Ratio", "Memorization", True, "O"),
    MetricSpec("rouge", "ROUGE", "Generation", True, "O"),
    MetricSpec("para_rouge", "Paraphrased ROUGE", "Generation", True, "O"),
    MetricSpec("jailbreak_rouge", "Jailbreak ROUGE", "Generation", True, "O"),
    MetricSpec("mia_loss", "MIA-LOSS", "Privacy", True, "O"),
    MetricSpec("mia_zlib", "MIA-ZLib", "Privacy", True, "O"),
    MetricSpec("mia_min_k", "MIA-Min-K", "Privacy", True, "O"),
    MetricSpec("mia_min_kpp", "MIA-Min-K++", "Privacy", True, "O"),
    MetricSpec("s_mia_loss", "s_LOSS", "Normalized", False, "OR"),
    MetricSpec("s_mia_zlib", "s_ZLib", "Normalized", False, "OR"),
    MetricSpec("s_mia_min_k", "s_Min-K", "Normalized", False, "OR"),
    MetricSpec("s_mia_min_kpp", "s_Min-K++", "Normalized", False, "OR"),
    MetricSpec("cka", "CKA", "White-box", False, "RI"),
    MetricSpec("fisher_masked", "Fisher (Masked 0.1%)", "White-box", False, "RI"),
    MetricSpec("logit_lens", "Logit Lens", "White-box", False, "ORI"),
    MetricSpec("uds", "UDS", "White-box", False, "ORI"),
)
METRIC_KEYS = tuple(spec.key for spec in METRICS)
WHITE_BOX_KEYS = ("logit_lens", "cka", "fisher_masked")
# Model-level metric values of a pool: a list or a 1-D array.
Scores = Sequence[float] | np.ndarray
META_EVAL_COLUMNS = ["metric", "faithfulness", "q", "r", "robustness", "overall", "n_models_q", "n_models_r"]


# The paper's Table 3 (Llama-3.2-1B, TOFU forget10, 30 + 30 pool models, 150 unlearned models):
# metric -> (overall, faithfulness, robustness, q, r).
PAPER_TABLE3: dict[str, tuple[float, float, float, float, float]] = {
    "es": (0.875, 0.891, 0.859, 0.970, 0.770),
    "em": (0.782, 0.817, 0.750, 0.984, 0.605),
    "prob": (0.786, 0.816, 0.757, 0.924, 0.642),
    "paraprob": (0.782, 0.707, 0.875, 0.853, 0.899),
    "truth_ratio": (0.542, 0.947, 0.379, 0.996, 0.234),
    "rouge": (0.456, 0.722, 0.333, 0.934, 0.203),
    "para_rouge": (0.209, 0.832, 0.119, 0.951, 0.064),
    "jailbreak_rouge": (0.438, 0.757, 0.308, 0.971, 0.183),
    "mia_loss": (0.767, 0.902, 0.668, 0.935, 0.519),
    "mia_zlib": (0.737, 0.867, 0.641, 0.938, 0.487),
    "mia_min_k": (0.774, 0.907, 0.675, 0.923, 0.532),
    "mia_min_kpp": (0.677, 0.816, 0.579, 0.883, 0.431),
    "s_mia_loss": (0.778, 0.891, 0.690, 0.719, 0.663),
    "s_mia_zlib": (0.790, 0.870, 0.724, 0.704, 0.745),
    "s_mia_min_k": (0.786, 0.891, 0.704, 0.710, 0.697),
    "s_mia_min_kpp": (0.686, 0.799, 0.602, 0.643, 0.566),
    "cka": (0.051, 0.648, 0.026, 0.997, 0.013),
    "fisher_masked": (0.716, 0.712, 0.721, 0.583, 0.946),
    "logit_lens": (0.902, 0.927, 0.879, 0.959, 0.812),
    "uds": (0.951, 0.971, 0.932, 0.968, 0.900),
}


class QuantisationError(RuntimeError):
    """NF4 quantisation is unavailable (bitsandbytes missing or unable to run on this device)."""


# ---------------------------------------------------------------------------------------------------------------
# Formulas


def orient(values: Any, higher_means_knowledge: bool) -> np.ndarray:
    """Metric values as knowledge scores (higher = more knowledge): raw, or ``1 - x`` for erasure-type metrics."""
    array = np.asarray(values, dtype=float)
    return array if higher_means_knowledge else np.asarray(1.0 - array)


def faithfulness_auc(p_scores: Scores, n_scores: Scores, higher_means_knowledge: bool) -> float:
    """AUC-ROC of the P pool (label 1) against the N pool (label 0) on oriented scores; NaN with < 2 per pool."""
    p = orient(p_scores, higher_means_knowledge)
    n = orient(n_scores, higher_means_knowledge)
    p, n = p[~np.isnan(p)], n[~np.isnan(n)]
    if len(p) < 2 or len(n) < 2:
        return float("nan")
    return float(roc_auc_score(np.r_[np.ones(len(p)), np.zeros(len(n))], np.r_[p, n]))


def faithfulness_threshold(p_scores: Scores, n_scores: Scores, higher_means_knowledge: bool) -> float:
    """The oriented-score cut that best separates P from N (max Youden's J); models below it count as unlearned."""
    p = orient(p_scores, higher_means_knowledge)
    n = orient(n_scores, higher_means_knowledge)
    p, n = p[~np.isnan(p)], n[~np.isnan(n)]
    if len(p) == 0 or len(n) == 0:
        return float("nan")
    fpr, tpr, thresholds = roc_curve(np.r_[np.ones(len(p)), np.zeros(len(n))], np.r_[p, n])
    return float(thresholds[int(np.argmax(tpr - fpr))])


def quantisation_q(before: Any, after: Any, eps: float = EPS) -> Any:
    """Symmetric quantisation stability ``1 - clip(|after - before| / (|before| + |after| + eps), 0, 1)``."""
    before, after = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    q = 1.0 - np.clip(np.abs(after - before) / (np.abs(before) + np.abs(after) + eps), 0.0, 1.0)
    return float(q) if q.ndim == 0 else q


def relearning_r(unl_before: Any, unl_after: Any, ret_before: Any, ret_after: Any, eps: float = EPS) -> Any:
    """Symmetric relearning stability ``1 - clip(|Δ_unl - Δ_ret| / (|Δ_unl| + |Δ_ret| + eps), 0, 1)``."""
    d_unl = np.asarray(unl_after, dtype=float) - np.asarray(unl_before, dtype=float)
    d_ret = np.asarray(ret_after, dtype=float) - np.asarray(ret_before, dtype=float)
    r = 1.0 - np.clip(np.abs(d_unl - d_ret) / (np.abs(d_unl) + np.abs(d_ret) + eps), 0.0, 1.0)
    return float(r) if r.ndim == 0 else r


def utility_filter(
    metrics_df: pd.DataFrame,
    full: str = "full",
    column: str = UTILITY_COLUMN,
    threshold: float = UTILITY_THRESHOLD,
) -> pd.Series:
    """Boolean per model: utility relative to the full model ``>= threshold`` (all True if utility is unknown)."""
    reference = (
        metrics_df.at[full, column] if column in metrics_df.columns and full in metrics_df.index else np.nan
    )
    if not np.isfinite(reference) or reference <= 1e-6:
        logger.warning(
            "the full model %r has no usable %r (%s): the utility filter is skipped", full, column, reference
        )
        return pd.Series(True, index=metrics_df.index)
    relative = metrics_df[column] / reference
    return relative >= threshold


def faithfulness_filter(values: pd.Series, threshold: float, higher_means_knowledge: bool) -> pd.Series:
    """Boolean per model: classified as unlearned (oriented score below the faithfulness threshold)."""
    if not np.isfinite(threshold):
        return pd.Series(True, index=values.index)
    return pd.Series(orient(values, higher_means_knowledge) < threshold, index=values.index)


# ---------------------------------------------------------------------------------------------------------------
# Meta-evaluation table


def robustness_table(
    metrics_df: pd.DataFrame,
    pools: Mapping[str, Sequence[str]],
    quant_df: pd.DataFrame | None,
    relearn_df: pd.DataFrame | None,
    *,
    unlearned: Sequence[str] | None = None,
    retain: str = "retain",
    full: str = "full",
    utility_threshold: float = UTILITY_THRESHOLD,
    apply_faithfulness_filter: bool = True,
    metrics: Sequence[MetricSpec] = METRICS,
) -> pd.DataFrame:
    """Per (metric, model, attack): oriented values before/after, the Q or R score, and whether it passed the filters.

    Args:
        metrics_df: one row per model (index = name), one column per metric, plus ``role`` and ``model_utility``.
        pools: ``{"pos": [...], "neg": [...]}`` model names of the P and N pools.
        quant_df / relearn_df: metric values after the attack (index = model name; relearn must hold ``retain``).
        unlearned: the models whose robustness is measured (default: roles ``unlearned`` and ``sweep``).
        retain: the retain model's name (the relearning reference).
        full: the full model's name (the utility reference).
        utility_threshold: minimum utility relative to full.
        apply_faithfulness_filter: keep only models the metric's own threshold classifies as unlearned.
        metrics: the catalogue.
    """
    if unlearned is None:
        unlearned = (
            list(metrics_df.index[metrics_df["role"].isin(ROBUSTNESS_ROLES)]) if "role" in metrics_df else []
        )
    useful = utility_filter(metrics_df, full=full, threshold=utility_threshold)
    rows = []
    for spec in metrics:
        if spec.key not in metrics_df.columns:
            continue
        column = metrics_df[spec.key]
        threshold = faithfulness_threshold(
            column.reindex(pools.get("pos", [])).to_numpy(),
            column.reindex(pools.get("neg", [])).to_numpy(),
            spec.higher_means_knowledge,
        )
        unlearned_like = faithfulness_filter(column, threshold, spec.higher_means_knowledge)
        for name in unlearned:
            if name not in metrics_df.index:
                continue
            passed = bool(useful.get(name, True)) and (
                not apply_faithfulness_filter or bool(unlearned_like[name])
            )
            before = float(orient(column[name], spec.higher_means_knowledge))
            if quant_df is not None and spec.key in quant_df.columns and name in quant_df.index:
                after = float(orient(quant_df.at[name, spec.key], spec.higher_means_knowledge))
                rows.append(
                    {
                        "metric": spec.key,
                        "model": name,
                        "attack": "quantisation",
                        "before": before,
                        "after": after,
                        "score": quantisation_q(before, after),
                        "passed": passed,
                    }
                )
            if (
                relearn_df is not None
                and spec.key in relearn_df.columns
                and name in relearn_df.index
                and retain in relearn_df.index
                and retain in metrics_df.index
            ):
                after = float(orient(relearn_df.at[name, spec.key], spec.higher_means_knowledge))
                ret_before = float(orient(column[retain], spec.higher_means_knowledge))
                ret_after = float(orient(relearn_df.at[retain, spec.key], spec.higher_means_knowledge))
                rows.append(
                    {
                        "metric": spec.key,
                        "model": name,
                        "attack": "relearning",
                        "before": before,
                        "after": after,
                        "score": relearning_r(before, after, ret_before, ret_after),
                        "passed": passed,
                    }
                )
    columns = ["metric", "model", "attack", "before", "after", "score", "passed"]
    return pd.DataFrame(rows, columns=columns)


def meta_evaluate(
    metrics_df: pd.DataFrame,
    pools: Mapping[str, Sequence[str]],
    quant_df: pd.DataFrame | None,
    relearn_df: pd.DataFrame | None,
    *,
    unlearned: Sequence[str] | None = None,
    retain: str = "retain",
    full: str = "full",
    utility_threshold: float = UTILITY_THRESHOLD,
    apply_faithfulness_filter: bool = True,
    metrics: Sequence[MetricSpec] = METRICS,
) -> pd.DataFrame:
    """The meta-evaluation table: one row per catalogue metric (missing metrics give NaN rows).

    Returns:
        DataFrame with columns ``metric, faithfulness, q, r, robustness, overall, n_models_q, n_models_r``.
    """
    details = robustness_table(
        metrics_df,
        pools,
        quant_df,
        relearn_df,
        unlearned=unlearned,
        retain=retain,
        full=full,
        utility_threshold=utility_threshold,
        apply_faithfulness_filter=apply_faithfulness_filter,
        metrics=metrics,
    )
    kept = details[details["passed"] & details["score"].notna()]
    rows = []
    for spec in metrics:
        if spec.key in metrics_df.columns:
            column = metrics_df[spec.key]
            faith = faithfulness_auc(
                column.reindex(pools.get("pos", [])).to_numpy(),
                column.reindex(pools.get("neg", [])).to_numpy(),
                spec.higher_means_knowledge,
            )
        else:
            faith = float("nan")
        q_scores = kept[(kept["metric"] == spec.key) & (kept["attack"] == "quantisation")]["score"]
        r_scores = kept[(kept["metric"] == spec.key) & (kept["attack"] == "relearning")]["score"]
        q = float(q_scores.mean()) if len(q_scores) else float("nan")
        r = float(r_scores.mean()) if len(r_scores) else float("nan")
        robustness = harmonic_mean([q, r], eps=0.0) if np.isfinite(q) and np.isfinite(r) else float("nan")
        overall = (
            harmonic_mean([faith, robustness], eps=0.0)
            if np.isfinite(faith) and np.isfinite(robustness)
            else float("nan")
        )
        rows.append(
            {
                "metric": spec.key,
                "faithfulness": faith,
                "q": q,
                "r": r,
                "robustness": robustness,
                "overall": overall,
                "n_models_q": int(len(q_scores)),
                "n_models_r": int(len(r_scores)),
            }
        )
    return pd.DataFrame(rows, columns=META_EVAL_COLUMNS)


def compare_with_paper(table: pd.DataFrame) -> pd.DataFrame:
    """A meta-evaluation table next to the paper's Table 3: ``faithfulness, paper_faithfulness, q, paper_q, ...``,
    one row per metric (index), with each metric's rank by ``overall`` here and in the paper."""
    paper = pd.DataFrame.from_dict(
        PAPER_TABLE3,
        orient="index",
        columns=["paper_overall", "paper_faithfulness", "paper_robustness", "paper_q", "paper_r"],
    )
    joined = table.set_index("metric").join(paper)
    joined["rank"] = joined["overall"].rank(ascending=False, method="min")
    joined["paper_rank"] = joined["paper_overall"].rank(ascending=False, method="min")
    columns = [
        c
        for name in ("overall", "faithfulness", "robustness", "q", "r", "rank")
        for c in (name, f"paper_{name}")
    ]
    return joined[columns + ["n_models_q", "n_models_r"]]


# ---------------------------------------------------------------------------------------------------------------
# Attacks


def nf4_config() -> Any:
    """The paper's quantisation: bitsandbytes 4-bit NF4 with bf16 compute, no calibration."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )


def quantise_nf4(path: str | os.PathLike, device: str | None = None) -> Any:
    """Load a checkpoint with NF4 4-bit weights (a Hugging Face model; use it as a UDS source or for output metrics).

    Raises:
        QuantisationError: bitsandbytes is missing or cannot quantise on this device.
    """
    from uds_lens.models import ModelLoadError, load_hf_model

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise QuantisationError(
            f"NF4 quantisation of {path} needs bitsandbytes (pip install 'uds_lens[quant]'): {err}"
        ) from err
    try:
        model = load_hf_model(path, device=device, quantization=nf4_config())
    except ModelLoadError:
        raise
    except (RuntimeError, ValueError, ImportError) as err:
        raise QuantisationError(
            f"bitsandbytes could not load {path} in NF4 on this machine ({type(err).__name__}: {err}). "
            "bitsandbytes >= 0.45 runs NF4 on CPU and CUDA; check its installation with `python -m bitsandbytes`."
        ) from err
    _keep_standard_nf4_layout(model)
    return model


def _keep_standard_nf4_layout(model: Any) -> None:
    """Run NF4 on CPU through bitsandbytes' generic dequantise-and-matmul path, never its AVX512-BF16 kernel.

    On a CPU with AVX512-BF16, bitsandbytes (>= 0.48) repacks each 4-bit weight in place for that kernel at the first
    forward pass. The repacked weight no longer dequantises correctly, so a model measured once (its output metrics,
    its UDS) would afterwards give garbage white-box scores (which read its dequantised weights); the kernel also
    needs widths that are multiples of 64 and computes differently from the generic path, so numbers would depend on
    the instruction set. Only CPU forwards are affected; on CUDA the flag is never read.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


RELEARN_MARKER = "relearn.json"


def _relearn_settings(
    path: Any,
    n_records: int,
    epochs: int,
    lr: float,
    batch_size: int,
    grad_accum: int,
    seed: int,
    weight_decay: float,
) -> dict[str, Any]:
    from uds_lens.models import checkpoint_stamp

    return {
        "source": str(path),
        "source_files": checkpoint_stamp(path),
        "n_records": n_records,
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "seed": seed,
        "weight_decay": weight_decay,
    }


def relearn(
    path: str | os.PathLike,
    forget_records: Sequence[Any],
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    epochs: int = 1,
    lr: float = 2e-5,
    batch_size: int = 8,
    grad_accum: int = 4,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: str | None = None,
    progress: bool = True,
) -> Path:
    """Fine-tune a checkpoint on the forget set (the relearning attack) and save it as a Hugging Face directory.

    The published attack: 1 epoch, lr 2e-5, per-device batch 8 x gradient accumulation 4, AdamW, no weight decay,
    no warmup (linear decay, the Trainer default), chat-formatted forget answers with the system prompt, answer-only
    loss (normalised by the label tokens of each accumulated batch). Weights are trained in fp32 (bf16 autocast on
    CUDA). Deterministic given ``seed``. An ``out_dir`` holding a finished run with the same settings is reused.

    Returns:
        ``out_dir``.
    """
    from uds_lens.metrics.chat import IGNORE_INDEX, collate, encode_pairs, pad_id_of, qa_pairs
    from uds_lens.models import default_device, load_hf_model

    out_dir = Path(out_dir)
    settings = _relearn_settings(
        path, len(forget_records), epochs, lr, batch_size, grad_accum, seed, weight_decay
    )
    marker = out_dir / RELEARN_MARKER
    if (
        marker.is_file()
        and json.loads(marker.read_text()) == settings
        and (out_dir / "config.json").is_file()
    ):
        logger.info("relearned checkpoint %s exists; reusing it", out_dir)
        return out_dir
    device = device or default_device()
    torch.manual_seed(seed)
    model = load_hf_model(path, dtype=torch.float32, device=device)
    model.train()
    encoded = encode_pairs(tokenizer, qa_pairs(forget_records))
    pad_id = pad_id_of(tokenizer)
    micro_batches_per_epoch = math.ceil(len(encoded) / batch_size)
    steps_per_epoch = math.ceil(micro_batches_per_epoch / grad_accum)
    total_steps = max(1, steps_per_epoch * epochs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.0, (total_steps - step) / total_steps)
    )
    generator = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else None
    bar = tqdm(total=total_steps, desc=f"relearn {Path(str(path)).name}", disable=not progress, leave=False)
    for _ in range(epochs):
        order = torch.randperm(len(encoded), generator=generator).tolist()
        micro = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        for group_start in range(0, len(micro), grad_accum):
            group = [
                collate([encoded[i] for i in rows], pad_id)
                for rows in micro[group_start : group_start + grad_accum]
            ]
            n_tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in group)
            for batch in group:
                batch = {k: v.to(device) for k, v in batch.items()}
                if autocast is not None:
                    with autocast:
                        logits = model(
                            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                        ).logits
                else:
                    logits = model(
                        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                    ).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(),
                    batch["labels"][:, 1:].flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                ) / max(n_tokens, 1)
                loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update(1)
    bar.close()
    model.eval()
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    (tmp_dir / RELEARN_MARKER).write_text(json.dumps(settings, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp_dir.rename(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# Running it on a zoo

ScoreFn = Callable[[Any], float]
META_ROLES = ("full", "retain", *ROBUSTNESS_ROLES, "pos", "neg")


@dataclass(frozen=True)
class ZooLayout:
    """What the meta-evaluation needs from a zoo manifest: models (name, path, role), the three data files, and the
    zoo's own relearning settings (``relearn`` keyword arguments; empty for the published ones)."""

    root: Path
    models: tuple[dict[str, Any], ...]
    forget_path: Path
    holdout_path: Path
    retain_path: Path
    relearn: dict[str, Any] = field(default_factory=dict)

    def names(self, roles: Sequence[str] | None = None) -> list[str]:
        return [m["name"] for m in self.models if roles is None or m.get("role") in roles]

    def path(self, name: str) -> str:
        """The model's local directory, or its hub id."""
        for model in self.models:
            if model["name"] == name:
                return str(model["path"])
        raise KeyError(f"no model {name!r} in the zoo at {self.root}")

    def role(self, name: str) -> str:
        return next(str(m.get("role")) for m in self.models if m["name"] == name)


def _data_path(root: Path, data: Mapping[str, Any], split: str) -> Path:
    for key in (split, f"{split}_path", f"{split}_file"):
        if key in data:
            path = Path(data[key])
            return path if path.is_absolute() else root / path
    raise ValueError(f"the zoo manifest in {root} names no {split!r} data file (keys: {sorted(data)})")


def read_zoo(zoo_dir: str | os.PathLike) -> ZooLayout:
    """Read ``manifest.json`` (``{"models": [{"name", "path", "role", ...}], "data": {"forget", "holdout", "retain"}}``)."""
    root = Path(zoo_dir)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{root} has no manifest.json; build a zoo with `uds-lens zoo build --out {root}`"
        )
    manifest = json.loads(manifest_path.read_text())
    models = []
    for model in manifest["models"]:
        path = Path(model["path"])
        # Relative paths are zoo-relative; anything that does not exist there is kept as a hub id.
        local = path if path.is_absolute() else root / path
        models.append(
            {**model, "path": str(local) if local.exists() or path.is_absolute() else str(model["path"])}
        )
    data = manifest.get("data", {})
    return ZooLayout(
        root,
        tuple(models),
        _data_path(root, data, "forget"),
        _data_path(root, data, "holdout"),
        _data_path(root, data, "retain"),
        dict(manifest.get("relearn", {})),
    )


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """QA records from a JSON list or a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return list(json.loads(text))


def _references_stamp(zoo: ZooLayout) -> str:
    """The identity of the full and retain checkpoints every cached score is anchored to."""
    from uds_lens.models import checkpoint_stamp

    return " ".join(checkpoint_stamp(zoo.path(name)) for name in ("full", "retain"))


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=float))
    tmp.replace(path)


def _score_model(
    model_or_path: Any,
    cache_file: Path,
    tokenizer: Any,
    forget: Sequence[Any],
    holdout: Sequence[Any],
    retain_records: Sequence[Any] | None,
    score_fns: Mapping[str, ScoreFn],
    *,
    batch_size: int,
    max_new_tokens: int,
    progress: bool,
    resume: bool,
    references: str,
) -> dict[str, float]:
    """Output metrics (cached in ``cache_file``) plus the white-box scores (cached next to them, one at a time).

    The cache is reused only for the same settings, the same checkpoint files (:func:`models.checkpoint_stamp`: a
    retrained model or a new chat template invalidates it) and the same ``references`` (the full/retain models the
    scores are anchored to).
    """
    from uds_lens.metrics.evaluate import report_model
    from uds_lens.models import checkpoint_stamp

    if isinstance(model_or_path, _Deferred):
        model_stamp = model_or_path.stamp
    elif isinstance(model_or_path, (str, os.PathLike)):
        model_stamp = checkpoint_stamp(model_or_path)
    else:
        model_stamp = f"in-memory {type(model_or_path).__name__}"
    settings = {
        "max_new_tokens": max_new_tokens,
        "n_forget": len(forget),
        "n_holdout": len(holdout),
        "n_retain": len(retain_records or []),
        "model": model_stamp,
        "references": references,
    }
    cached = _read_json(cache_file) if resume and cache_file.is_file() else None
    if cached is not None and cached.get("settings") != settings:
        logger.info(
            "%s was computed with other settings (%s); recomputing", cache_file, cached.get("settings")
        )
        cached = None
    missing = [key for key in score_fns if cached is None or key not in cached["values"]]
    if cached is not None and not missing:
        return dict(cached["values"])
    loaded = model_or_path.load() if isinstance(model_or_path, _Deferred) else model_or_path
    if cached is None:
        report = report_model(
            loaded,
            tokenizer,
            forget,
            holdout,
            retain_records,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            progress=progress,
        )
        cached = {
            "values": report.values,
            "json": report.json,
            "timings": report.timings,
            "settings": settings,
        }
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        report.examples.to_csv(cache_file.parent / "examples.csv", index=False)
        report.mia_examples.to_csv(cache_file.parent / "mia_examples.csv", index=False)
        _write_json(cache_file, cached)
    for key in missing:
        cached["values"][key] = float(score_fns[key](loaded))
        _write_json(cache_file, cached)
    return dict(cached["values"])


@dataclass(frozen=True)
class _Deferred:
    """A model that is only built (e.g. quantised) when a cache misses; ``stamp`` identifies it for the cache."""

    load: Callable[[], Any]
    stamp: str


def _finish_table(
    table: pd.DataFrame, retain_aucs: Mapping[str, float] | None, full_utility: float | None
) -> pd.DataFrame:
    from uds_lens.metrics.evaluate import add_privacy
    from uds_lens.metrics.privacy import paper_privacy

    rows = {}
    for name, row in table.iterrows():
        values = {k: v for k, v in row.items()}
        if retain_aucs is not None and all(a in values for a in retain_aucs):
            add_privacy(values, retain_aucs)
            if "uds" in values and values["uds"] is not None and np.isfinite(values["uds"]):
                values["privacy_uds"] = paper_privacy(values["privacy"], values["uds"])
        if full_utility is not None and full_utility > 1e-6 and UTILITY_COLUMN in values:
            values["utility_rel"] = values[UTILITY_COLUMN] / full_utility
        rows[name] = values
    return pd.DataFrame.from_dict(rows, orient="index")


def _score_fns(uds_fn: ScoreFn | None, white_box_fns: Mapping[str, ScoreFn] | None) -> dict[str, ScoreFn]:
    fns = dict(white_box_fns or {})
    if uds_fn is not None:
        fns["uds"] = uds_fn
    return fns


def evaluate_zoo(
    zoo_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    uds_fn: ScoreFn | None = None,
    white_box_fns: Mapping[str, ScoreFn] | None = None,
    roles: Sequence[str] | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 200,
    progress: bool = True,
    resume: bool = True,
    utility_roles: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Every metric for every zoo model: ``OUT/metrics.csv`` (one row per model) and ``OUT/models/NAME/metrics.json``.

    Args:
        zoo_dir: a zoo directory with ``manifest.json``.
        out_dir: output directory.
        uds_fn: ``uds_fn(path_or_model) -> float`` (higher = more erased); None leaves the ``uds`` column out.
        white_box_fns: ``{"logit_lens" | "cka" | "fisher_masked": fn(path_or_model) -> float}``.
        roles: evaluate only models with these roles (default: all).
        batch_size: examples per batch.
        max_new_tokens: generation budget.
        progress: tqdm bars.
        resume: reuse per-model caches (a crashed run restarts at the first unfinished model).
        utility_roles: compute model utility (on the whole retain set, most of a model's cost) only for models with
            these roles (default: all); full and retain always get it. The others' utility columns are NaN.

    Returns:
        The ``metrics.csv`` table (index = model name; ``role``, metrics, ``s_mia_*``, ``privacy``, ``utility_rel``).
    """
    from uds_lens.metrics.privacy import ATTACKS
    from uds_lens.models import load_tokenizer

    zoo = read_zoo(zoo_dir)
    out = Path(out_dir)
    names = zoo.names(roles)
    for required in ("full", "retain"):
        if required not in zoo.names():
            raise ValueError(
                f"the zoo at {zoo.root} has no {required!r} model; the metrics are referenced to it"
            )
    if "retain" not in names:
        names.append("retain")
    if "full" not in names:
        names.append("full")
    tokenizer = load_tokenizer(zoo.path("full"))
    forget = read_records(zoo.forget_path)
    holdout = read_records(zoo.holdout_path)
    retain_records = read_records(zoo.retain_path)
    fns = _score_fns(uds_fn, white_box_fns)
    references = _references_stamp(zoo)
    rows = {}
    for name in tqdm(names, desc="models", disable=not progress):
        role = zoo.role(name)
        wants_utility = utility_roles is None or role in utility_roles or name in ("full", "retain")
        rows[name] = {
            "role": role,
            **_score_model(
                zoo.path(name),
                out / "models" / name / "metrics.json",
                tokenizer,
                forget,
                holdout,
                retain_records if wants_utility else None,
                fns,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                progress=progress,
                resume=resume,
                references=references,
            ),
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    retain_aucs = {a: float(table.at["retain", a]) for a in ATTACKS}
    table = _finish_table(table, retain_aucs, float(table.at["full", UTILITY_COLUMN]))
    table.index.name = "model"
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "metrics.csv")
    return table


def _attacked_table(
    zoo: ZooLayout,
    names: Sequence[str],
    attack: str,
    out: Path,
    tokenizer: Any,
    forget: Sequence[Any],
    holdout: Sequence[Any],
    fns: Mapping[str, ScoreFn],
    retain_aucs: Mapping[str, float],
    *,
    batch_size: int,
    max_new_tokens: int,
    progress: bool,
    resume: bool,
    relearn_kwargs: Mapping[str, Any],
) -> pd.DataFrame:
    from uds_lens.models import checkpoint_stamp

    rows = {}
    for name in tqdm(names, desc=attack, disable=not progress):
        model_dir = out / "models" / name / attack
        if attack == "quant":
            source: Any = _Deferred(
                functools.partial(quantise_nf4, zoo.path(name)),
                f"nf4, standard layout {checkpoint_stamp(zoo.path(name))}",
            )
        else:
            source = str(
                relearn(
                    zoo.path(name),
                    forget,
                    tokenizer,
                    model_dir / "model",
                    progress=progress,
                    **relearn_kwargs,
                )
            )
        rows[name] = _score_model(
            source,
            model_dir / "metrics.json",
            tokenizer,
            forget,
            holdout,
            None,
            fns,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            progress=progress,
            resume=resume,
            references=_references_stamp(zoo),
        )
    table = _finish_table(pd.DataFrame.from_dict(rows, orient="index"), retain_aucs, None)
    table.index.name = "model"
    table.to_csv(out / f"metrics_{attack}.csv")
    return table


def run_meta_eval(
    zoo_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    uds_fn: ScoreFn | None,
    white_box_fns: Mapping[str, ScoreFn] | None,
    batch_size: int = 16,
    max_new_tokens: int = 200,
    relearn_kwargs: Mapping[str, Any] | None = None,
    apply_faithfulness_filter: bool = True,
    progress: bool = True,
    resume: bool = True,
) -> pd.DataFrame:
    """The whole meta-evaluation on a zoo: metrics, NF4 and relearning attacks, and ``OUT/meta_eval.csv``.

    Models with roles full, retain, unlearned, sweep, pos and neg are scored (``OUT/metrics.csv``); the unlearned
    and sweep models are quantised (``OUT/metrics_quant.csv``), they and retain are relearned
    (``OUT/metrics_relearn.csv``, checkpoints under ``OUT/models/NAME/relearn/model``). The quantised models reach
    ``uds_fn`` / ``white_box_fns`` as in-memory Hugging Face NF4 models, everything else as checkpoint paths.
    Relearning uses the zoo manifest's ``relearn`` settings where it has them (a built zoo scales the learning rate
    to its own fine-tuning), then ``relearn_kwargs``, then the published attack's defaults (:func:`relearn`).
    ``OUT/robustness.csv`` holds the per-model Q and R; ``OUT/meta_eval.csv`` the 20-row table
    (rows whose metric has no function are NaN), and ``OUT/meta_eval_vs_paper.csv`` the same next to the paper's
    Table 3 (:func:`compare_with_paper`). Every stage is cached per model, so ``resume`` restarts where a
    crashed run stopped.

    Returns:
        The meta-evaluation table (``META_EVAL_COLUMNS``).
    """
    from uds_lens.metrics.privacy import ATTACKS
    from uds_lens.models import load_tokenizer

    zoo = read_zoo(zoo_dir)
    out = Path(out_dir)
    metrics_df = evaluate_zoo(
        zoo_dir,
        out,
        uds_fn=uds_fn,
        white_box_fns=white_box_fns,
        roles=META_ROLES,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        resume=resume,
        utility_roles=UTILITY_ROLES,
    )
    tokenizer = load_tokenizer(zoo.path("full"))
    forget = read_records(zoo.forget_path)
    holdout = read_records(zoo.holdout_path)
    fns = _score_fns(uds_fn, white_box_fns)
    retain_aucs = {a: float(metrics_df.at["retain", a]) for a in ATTACKS}
    unlearned = zoo.names(ROBUSTNESS_ROLES)
    kwargs = dict(
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        resume=resume,
        relearn_kwargs={**zoo.relearn, **(relearn_kwargs or {})},
    )
    quant_df = _attacked_table(
        zoo, unlearned, "quant", out, tokenizer, forget, holdout, fns, retain_aucs, **kwargs
    )
    relearn_df = _attacked_table(
        zoo, [*unlearned, "retain"], "relearn", out, tokenizer, forget, holdout, fns, retain_aucs, **kwargs
    )
    pools = {"pos": zoo.names(["pos"]), "neg": zoo.names(["neg"])}
    common = dict(unlearned=unlearned, apply_faithfulness_filter=apply_faithfulness_filter)
    robustness_table(metrics_df, pools, quant_df, relearn_df, **common).to_csv(
        out / "robustness.csv", index=False
    )
    table = meta_evaluate(metrics_df, pools, quant_df, relearn_df, **common)
    table.to_csv(out / "meta_eval.csv", index=False)
    compare_with_paper(table).to_csv(out / "meta_eval_vs_paper.csv")
    return table

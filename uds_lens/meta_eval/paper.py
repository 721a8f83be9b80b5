"""The paper's Table 3, and a meta-evaluation next to it.

The UDS paper meta-evaluates 20 metrics on Llama-3.2-1B fine-tuned on TOFU forget10, with 30 + 30 pool models and 150
unlearned models. `PAPER_TABLE3` holds its numbers; `METRICS` are the registry's specs of those metrics in
the table's order (the rows every meta-evaluation table has); `compare_with_paper` lines a table computed here up
with it, metric by metric and by rank.
"""

from __future__ import annotations

import pandas as pd

from uds_lens.metrics import registry
from uds_lens.metrics.registry import MetricSpec

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


METRICS: tuple[MetricSpec, ...] = tuple(registry.spec(name) for name in PAPER_TABLE3)
METRIC_KEYS = tuple(PAPER_TABLE3)


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

"""Synthetic UDS result tables (SPEC §1.8 shapes) for the plot and report tests; no model involved."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from uds_lens.uds import example_uds, ke_mask, layer_erasure_ratio

PROMPT_TYPES = ["yes_no", "person_name", "book_title", "descriptive"]
TAU = 0.05


@dataclass
class FakeResult:
    """Quacks like UDSResult: ``.examples``, ``.layers``, ``.summary``, ``.uds``."""

    examples: pd.DataFrame
    layers: pd.DataFrame
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def uds(self) -> float:
        return float(self.summary["uds"])

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.examples.to_csv(directory / "examples.csv", index=False)
        self.layers.to_csv(directory / "layers.csv", index=False)
        (directory / "summary.json").write_text(json.dumps(self.summary))


def make_result(
    name: str = "model",
    erasure: float = 0.5,
    n_examples: int = 12,
    n_layers: int = 6,
    sites: tuple[str, ...] = ("resid_post",),
    seed: int = 0,
) -> FakeResult:
    """A result whose S2 deltas are ``erasure`` times the S1 deltas plus noise.

    Example 1 has no KE layer (all d1 below tau) and the last example is skipped (no layer rows). S1 is a function of
    the seed only, so results built with one seed share it, as models audited against one full/retain pair do.
    """
    s1_rng = np.random.default_rng(seed)
    s2_rng = np.random.default_rng(seed + 1000 + int(erasure * 1000))
    rows, example_rows = [], []
    for idx in range(n_examples):
        prompt_type = PROMPT_TYPES[idx % len(PROMPT_TYPES)]
        if idx == n_examples - 1:
            example_rows.append(
                dict(idx=idx, prompt_type=prompt_type, n_entity_tokens=0, n_ke=0, uds=np.nan, status="skipped",
                     skip_reason="entity not found in answer", question=f"Question {idx}?", entity=f"Entity {idx}")
            )  # fmt: skip
            continue
        s_full = -s1_rng.uniform(0.1, 1.0)
        depth = np.linspace(0.0, 1.5, n_layers) * s1_rng.uniform(0.5, 1.5)
        d1 = depth + s1_rng.normal(0, 0.03, n_layers)
        if idx == 1:
            d1 = np.full(n_layers, 0.01)
        d2 = erasure * d1 + s2_rng.normal(0, 0.03, n_layers)
        ke = ke_mask(d1, TAU)
        ler = layer_erasure_ratio(d1, d2)
        uds = float(example_uds(d1[None], d2[None], TAU)[0])
        for site_position, site in enumerate(sites):
            scale = 1.0 if site == "resid_post" else 0.2 + 0.1 * site_position
            for layer in range(n_layers):
                rows.append(
                    dict(idx=idx, layer=layer, site=site, s0=s_full, baseline_score=s_full,
                         s1_score=s_full - scale * d1[layer],
                         s2_score=s_full - scale * d2[layer], d1=scale * d1[layer], d2=scale * d2[layer],
                         ke=bool(ke[layer]) if site == "resid_post" else bool(scale * d1[layer] > TAU),
                         ler=float(ler[layer]) if ke[layer] else np.nan)
                )  # fmt: skip
        example_rows.append(
            dict(idx=idx, prompt_type=prompt_type, n_entity_tokens=int(1 + idx % 3), n_ke=int(ke.sum()), uds=uds,
                 status="scored" if ke.any() else "no_ke", skip_reason=None, question=f"Question {idx}?",
                 entity=f"Entity {idx}")
        )  # fmt: skip
    examples = pd.DataFrame(example_rows)
    layers = pd.DataFrame(rows)
    defined = examples["uds"].dropna()
    summary = {
        "name": name,
        "uds": float(defined.mean()),
        "ci95": [float(defined.mean() - 0.05), float(defined.mean() + 0.05)],
        "n_scored": int((examples["status"] == "scored").sum()),
        "n_no_ke": int((examples["status"] == "no_ke").sum()),
        "n_skipped": int((examples["status"] == "skipped").sum()),
        "settings": {"tau": TAU, "patch_scope": "span", "site": "resid_post"},
        "timings": {"total": 1.5},
    }
    return FakeResult(examples=examples, layers=layers, summary=summary)


def make_lens_layers(result: FakeResult) -> pd.DataFrame:
    """Logit-lens layer table in the UDS shape: the lens reads everything as erased in the middle layers."""
    layers = result.layers[result.layers["site"] == "resid_post"][["idx", "layer", "d1", "d2"]].copy()
    layers["d2"] = layers["d2"] + layers["layer"].between(1, 3) * 2.0
    layers["ler"] = np.clip(layers["d2"] / layers["d1"].where(layers["d1"] != 0), 0, 1).fillna(0.0)
    return layers.reset_index(drop=True)

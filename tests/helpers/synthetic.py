"""Synthetic ``UDSResult``s (SPEC §1.8 tables) for the plot, report and analysis tests; no model involved.

The per-layer scores are made up; everything derived from them (KE cells, LER, per-example and model UDS, the CI,
the statuses) is computed by ``UDSResult.with_tau``, as for a real audit.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from uds_lens.results import UDSResult

PROMPT_TYPES = ["yes_no", "person_name", "book_title", "descriptive"]
TAU = 0.05


def _site_result(
    name: str, erasure: float, n_examples: int, n_layers: int, seed: int, site: str, scale: float
) -> UDSResult:
    """One site's result: deltas ``scale * d1`` and ``scale * d2`` on top of one clean score per example."""
    s1_rng = np.random.default_rng(seed)
    s2_rng = np.random.default_rng(seed + 1000 + int(erasure * 1000))
    layer_rows, example_rows = [], []
    for idx in range(n_examples):
        texts = {"question": f"Question {idx}?", "entity": f"Entity {idx}"}
        prompt_type = PROMPT_TYPES[idx % len(PROMPT_TYPES)]
        if idx == n_examples - 1:
            example_rows.append(
                dict(idx=idx, prompt_type=prompt_type, n_entity_tokens=0, skip_reason="entity not found in answer",
                     **texts)
            )  # fmt: skip
            continue
        s0 = -s1_rng.uniform(0.1, 1.0)
        depth = np.linspace(0.0, 1.5, n_layers) * s1_rng.uniform(0.5, 1.5)
        d1 = depth + s1_rng.normal(0, 0.03, n_layers)
        if idx == 1:
            d1 = np.full(n_layers, 0.01)
        d2 = erasure * d1 + s2_rng.normal(0, 0.03, n_layers)
        for layer in range(n_layers):
            layer_rows.append(
                dict(idx=idx, layer=layer, site=site, s0=s0, baseline_score=s0, s1_score=s0 - scale * d1[layer],
                     s2_score=s0 - scale * d2[layer], d1=scale * d1[layer], d2=scale * d2[layer])
            )  # fmt: skip
        example_rows.append(
            dict(idx=idx, prompt_type=prompt_type, n_entity_tokens=int(1 + idx % 3), skip_reason="", **texts)
        )
    settings = {"tau": TAU, "patch_scope": "span", "site": site}
    return UDSResult(
        name=name,
        examples=pd.DataFrame(example_rows),
        layers=pd.DataFrame(layer_rows),
        settings=settings,
        meta={"timings": {"total": 1.5}},
    ).with_tau(TAU)


def make_result(
    name: str = "model",
    erasure: float = 0.5,
    n_examples: int = 12,
    n_layers: int = 6,
    sites: tuple[str, ...] = ("resid_post",),
    seed: int = 0,
) -> UDSResult:
    """A result whose S2 deltas are ``erasure`` times the S1 deltas plus noise.

    Example 1 has no KE layer (all d1 below tau) and the last example is skipped (no layer rows). S1 is a function of
    the seed only, so results built with one seed share it, as models audited against one full/retain pair do.
    With several ``sites`` the layers table stacks each site's rows (sites other than resid_post carry a smaller
    share of the deltas, as a component sweep concatenates per-site results); examples and UDS are resid_post's.
    """
    per_site = {
        site: _site_result(
            name,
            erasure,
            n_examples,
            n_layers,
            seed,
            site,
            1.0 if site == "resid_post" else 0.2 + 0.1 * position,
        )
        for position, site in enumerate(sites)
    }
    main = per_site.get("resid_post", next(iter(per_site.values())))
    if len(per_site) == 1:
        return main
    return replace(main, layers=pd.concat([r.layers for r in per_site.values()], ignore_index=True))


def make_lens_layers(result: UDSResult) -> pd.DataFrame:
    """Logit-lens layer table in the UDS shape: the lens reads everything as erased in the middle layers."""
    layers = result.layers[result.layers["site"] == "resid_post"][["idx", "layer", "d1", "d2"]].copy()
    layers["d2"] = layers["d2"] + layers["layer"].between(1, 3) * 2.0
    layers["ler"] = np.clip(layers["d2"] / layers["d1"].where(layers["d1"] != 0), 0, 1).fillna(0.0)
    return layers.reset_index(drop=True)

"""KE-only Stage 2 (SPEC 1.6b): the cells UDS never reads are not run, and UDS does not move."""

import math

import numpy as np
import pytest
import torch

from tests.helpers.numerics import assert_close_reordered
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.loader import load_tokenizer
from uds_lens.config import SITES, ConfigError, EngineSpec, UDSConfig
from uds_lens.data import encode, load_examples
from uds_lens.patching.batch import pad_batch
from uds_lens.patching.cells import stage2_work
from uds_lens.patching.engines import engine_for
from uds_lens.results import CellsNotRunError, UDSResult

UDS_TOLERANCE = 1e-6


def _split_tau(auditor: UDSAuditor, share: float = 0.4) -> float:
    """A tau that leaves some cells outside KE and some inside, so that KE-only skips work (not vacuous)."""
    d1 = auditor.d1().numpy()
    return float(np.quantile(d1[d1 > 0], share))


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("engine", ["fast", "naive"])
def test_ke_only_gives_the_uds_of_every_cell(models, tiny, compat, engine, tiny_auditor):
    probe = tiny_auditor(models, UDSConfig(published_compat=compat, engine=engine))
    tau = _split_tau(probe)
    every = tiny_auditor(models, UDSConfig(tau=tau, published_compat=compat, engine=engine))
    ke = tiny_auditor(models, UDSConfig(tau=tau, published_compat=compat, engine=engine, stage2_cells="ke"))
    assert every.config.stage2_cells == "all"  # the auditor's default: every layer's curve
    full_result, ke_result = every.score(models["unlearned"]), ke.score(models["unlearned"])

    plan = ke_result.meta["stage2"]
    assert plan["cells"] == "ke" and plan["tau"] == tau
    assert 0 < plan["n_cells_run"] < plan["n_cells"] and 0 < plan["work_share"] < 1
    assert full_result.meta["stage2"]["cells"] == "all" and full_result.stage2_cells == "all"
    # Per example and per model, within 1e-6.
    merged = full_result.examples.merge(ke_result.examples, on="idx", suffixes=("_all", "_ke"))
    assert (merged["status_all"] == merged["status_ke"]).all()
    assert (merged["n_ke_all"] == merged["n_ke_ke"]).all()
    np.testing.assert_allclose(merged["uds_ke"], merged["uds_all"], atol=UDS_TOLERANCE, rtol=0)
    assert abs(ke_result.uds - full_result.uds) <= UDS_TOLERANCE
    # d2 on the KE cells is the every-cell engine's to float noise; NaN, never a made-up value, elsewhere.
    layers = ke_result.layers
    ke_cells = layers["ke"].to_numpy()
    assert layers.loc[~ke_cells, ["d2", "s2_score", "ler"]].isna().all().all()
    assert layers.loc[ke_cells, "d2"].notna().all()
    assert_close_reordered(
        torch.tensor(layers.loc[ke_cells, "d2"].to_numpy()),
        torch.tensor(full_result.layers.loc[ke_cells, "d2"].to_numpy()),
    )
    assert "NaN outside the KE cells" in ke_result.summary["stage2_note"]

    # A higher tau rescores exactly what every cell gives; a lower one needs cells never run, and says so.
    higher = _split_tau(every, 0.7)
    assert abs(ke_result.with_tau(higher).uds - full_result.with_tau(higher).uds) <= UDS_TOLERANCE
    with pytest.raises(CellsNotRunError, match=r"--stage2-cells all"):
        ke_result.with_tau(tau / 2)


def test_ke_only_result_saved_and_loaded_keeps_its_cells(models, tiny_auditor, tmp_path):
    probe = tiny_auditor(models)
    tau = _split_tau(probe)
    result = tiny_auditor(models, UDSConfig(tau=tau, stage2_cells="ke")).score(models["unlearned"])
    loaded = UDSResult.load(result.save(tmp_path / "ke"))
    assert loaded.stage2_cells == "ke" and loaded.summary["stage2"]["tau"] == tau
    assert math.isclose(loaded.uds, result.uds, abs_tol=1e-9)
    with pytest.raises(CellsNotRunError):
        loaded.with_tau(0.0)


def test_fingerprints_key_the_cells_not_stage_one(models, tiny_auditor):
    every = tiny_auditor(models)
    ke = tiny_auditor(models, UDSConfig(stage2_cells="ke"))
    # Stage 1 does not depend on the cells: one S1 cache entry serves both.
    assert every.fingerprint_payload() == ke.fingerprint_payload()
    assert "stage2" not in every.fingerprint(None)
    assert ke.fingerprint(None)["stage2"] == {"cells": "ke", "tau": ke.config.tau}
    other_tau = tiny_auditor(models, UDSConfig(tau=0.2, stage2_cells="ke"))
    assert other_tau.fingerprint(None)["stage2"] != ke.fingerprint(None)["stage2"]
    # Retain-free mode has no KE cell: it runs every cell, whatever was asked.
    free = tiny_auditor(models, UDSConfig(stage2_cells="ke"), retain=False)
    assert "stage2" not in free.fingerprint(None)
    result = free.score(models["unlearned"])
    assert result.stage2_cells == "all" and result.layers["d2"].notna().all()


def test_stage2_cells_is_checked():
    with pytest.raises(ConfigError, match="stage2_cells"):
        UDSConfig(stage2_cells="some")
    assert UDSConfig().with_stage2_cells("ke").stage2_cells == "ke"
    assert UDSConfig(stage2_cells="all").with_stage2_cells("ke").stage2_cells == "all"


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("compat", [False, True])
def test_cell_scores_equal_every_cell_engine_on_their_cells(models, tiny, site, compat):
    tokenizer = load_tokenizer(tiny.tokenizer)
    encoded, _ = encode(load_examples(tiny.data), tokenizer, published_compat=compat)
    batch = pad_batch(encoded, tokenizer.pad_token_id, "span")
    layers = tuple(range(models["full"].cfg.n_layers))
    generator = torch.Generator().manual_seed(0)
    cells = torch.rand(batch.size, len(layers), generator=generator) < 0.5
    cells[0] = False  # an example with no cell runs nothing
    for engine in ("fast", "naive"):
        spec = EngineSpec(site, layers, engine, published_compat=compat)
        clean = engine_for(spec).clean_run(models["full"], batch)
        every = engine_for(spec).source_scores(models["full"], models["unlearned"], batch, clean).float()
        # the patch is not vacuous
        assert (every - clean.scores[:, None]).abs().max() > 1e-3
        chosen = engine_for(spec).cell_scores(models["full"], models["unlearned"], batch, cells, clean)
        assert torch.isnan(chosen[~cells]).all()
        assert_close_reordered(chosen[cells], every[cells])


def test_stage2_work_prices_the_cells_run():
    # a 4-layer model, windows of 2 and 3 tokens: a patch at layer l costs window x (4 - l - 1) blocks
    assert stage2_work([2, 3], [0, 1, 2, 3], 4, "resid_post") == (2 + 3) * (3 + 2 + 1 + 0)
    cells = [[False, True, True, True], [False, False, False, False]]
    assert stage2_work([2, 3], [0, 1, 2, 3], 4, "resid_post", cells) == 2 * (2 + 1)
    assert stage2_work([2], [0], 4, "resid_pre") == 2 * 4


def test_sweep_runs_ke_cells_by_default_and_records_it(tiny, tmp_path):
    from uds_lens.sweep.driver import sweep

    def run(**options):
        return sweep(
            tiny.full,
            tiny.retain,
            tiny.data,
            tmp_path / "out",
            {"unl": str(tiny.unlearned)},
            workers=1,
            cache_dir=tmp_path / "s1",
            progress=False,
            **options,
        ).set_index("name")

    ke = run()
    assert ke.loc["unl", "stage2_cells"] == "ke" and 0 < ke.loc["unl", "stage2_work_share"] <= 1
    assert UDSResult.load(tmp_path / "out" / "unl").stage2_cells == "ke"
    # every cell on the same directory: recomputed (other cells), not refused as another run's; the same UDS
    every = run(config=UDSConfig(stage2_cells="all"))
    assert every.loc["unl", "status"] == "scored" and every.loc["unl", "stage2_cells"] == "all"
    assert every.loc["unl", "stage2_work_share"] == 1.0
    assert abs(every.loc["unl", "uds"] - ke.loc["unl", "uds"]) <= UDS_TOLERANCE
    # and KE-only again on an every-cell result: recomputed too (the saved one is reusable only by its own cells)
    assert run().loc["unl", "status"] == "scored"

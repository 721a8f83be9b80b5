"""The precision check of a bf16/fp16 audit (uds_lens/precision.py): the band and the fragile cells it marks, the
fp32 decisions and what they buy back against an fp32 run, and what results record.

Runs in bf16 (and fp16) on the CPU on the tiny checkpoints: there bf16 moves a per-example UDS by about 5e-3 against
fp32 (the check-off run below), so the check's 1e-3 is not met by accident."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.digests import named_weights
from uds_lens.checkpoints.loader import hooked_from_hf, load_hf_model, load_model, load_tokenizer
from uds_lens.config import DEFAULT_PRECISION_TOLERANCE, ConfigError, UDSConfig
from uds_lens.fingerprints import settings_fingerprint
from uds_lens.precision import (
    PRIOR_SCALE,
    SAFETY,
    band,
    dtype_eps,
    fragile_clip,
    fragile_ke,
    measured_scale,
    reference_model,
    stored_float_dtypes,
    uds_bound,
)
from uds_lens.results import UDSResult
from uds_lens.uds import example_uds

TOLERANCE = DEFAULT_PRECISION_TOLERANCE
# Two fp32 computations of one delta in other shapes (the table's d1 = bf16 baseline - (bf16 baseline - fp32 d1)).
FLOAT_NOISE = 1e-5


@pytest.fixture(scope="module")
def models(tiny):
    return {
        dtype: {
            name: load_model(getattr(tiny, name), dtype=dtype) for name in ("full", "retain", "unlearned")
        }
        for dtype in ("float32", "bfloat16", "float16")
    }


@pytest.fixture(scope="module")
def fp32_result(models, tiny_auditor):
    return tiny_auditor(models["float32"], UDSConfig(batch_size=2)).score(models["float32"]["unlearned"])


@pytest.fixture(scope="module")
def checked(models, tiny_auditor) -> dict[str, UDSAuditor]:
    """bf16 auditors with the check as it runs by default, per engine."""
    return {
        engine: tiny_auditor(models["bfloat16"], UDSConfig(dtype="bfloat16", batch_size=2, engine=engine))
        for engine in ("fast", "naive")
    }


@pytest.fixture(scope="module")
def unchecked(models, tiny_auditor) -> dict[str, UDSResult]:
    """bf16 results with the check off, per engine."""
    bf16 = models["bfloat16"]
    return {
        engine: tiny_auditor(
            bf16, UDSConfig(dtype="bfloat16", batch_size=2, engine=engine, precision_check=False)
        ).score(bf16["unlearned"])
        for engine in ("fast", "naive")
    }


def _per_example(result: UDSResult) -> np.ndarray:
    return result.examples.sort_values("idx")["uds"].to_numpy(dtype=float)


# -- the band and the fragile cells ----------------------------------------------------------------------------------


def test_the_band_grows_with_the_delta_and_shrinks_with_the_format():
    d = np.array([0.0, 0.05, 1.0, 8.0])
    bf16, fp16 = dtype_eps(torch.bfloat16), dtype_eps(torch.float16)
    assert bf16 == 2**-7 and fp16 == 2**-10
    widths = band(d, bf16, 10.0)
    assert widths[0] == 10.0 * bf16 and np.all(np.diff(widths) > 0)
    np.testing.assert_allclose(band(d, fp16, 10.0), widths / 8)
    assert np.isnan(band(np.array([np.nan]), bf16, 10.0)).all()


def test_the_measured_scale_covers_every_cell_it_was_measured_on_with_room():
    rng = np.random.default_rng(0)
    exact = rng.normal(0, 2, (7, 5))
    eps = dtype_eps(torch.bfloat16)
    reduced = exact + rng.normal(0, 3 * eps, exact.shape)
    reduced[0, 0] = np.nan  # a cell one format did not run is left out
    scale = measured_scale(reduced, exact, eps)
    moved = np.abs(reduced - exact)
    assert np.nanmax(moved / band(exact, eps, scale / SAFETY)) == pytest.approx(1.0)
    assert np.all(moved[~np.isnan(moved)] <= band(exact, eps, scale)[~np.isnan(moved)] / SAFETY * (1 + 1e-12))
    assert measured_scale(np.full(3, np.nan), np.zeros(3), eps) == PRIOR_SCALE  # nothing measured: the prior


def test_a_decision_is_fragile_exactly_when_it_lies_inside_the_band():
    tau, width = 0.05, np.full(4, 0.01)
    d1 = np.array([0.039, 0.041, 0.059, 0.061])
    assert fragile_ke(d1, tau, width).tolist() == [False, True, True, False]
    d1 = np.array([1.0, 1.0, 1.0, 0.04])
    d2 = np.array([0.989, 1.009, 1.02, 0.04])  # the last is no KE cell: it has no clip to decide
    assert fragile_clip(d1, d2, tau, width).tolist() == [False, True, False, False]


def test_the_uds_bound_bounds_every_move_within_the_band_and_is_reached():
    rng = np.random.default_rng(1)
    d1 = rng.uniform(-0.5, 3.0, (40, 6))
    d2 = d1 * rng.uniform(-0.5, 1.5, d1.shape)
    width = band(np.abs(d1), dtype_eps(torch.bfloat16), 8.0)
    bound = uds_bound(d1, 0.05, width)
    base = example_uds(d1, d2)
    for _ in range(50):
        # any d2 within the band of the bound's |d2| <= d1 cells moves UDS_i by at most the bound
        moved = example_uds(d1, d2 + rng.uniform(-1, 1, d2.shape) * width)
        defined = ~np.isnan(base)
        assert np.all(np.abs(moved - base)[defined] <= bound[defined] + 1e-12)
    # reached: every KE cell a partial erasure that stays one when moved by its whole band
    partial, within = np.where(d1 > 0.05, d1 / 2, d2), np.minimum(width, np.abs(d1) / 4)
    shifted = example_uds(d1, partial + within) - example_uds(d1, partial)
    defined = ~np.isnan(bound)
    np.testing.assert_allclose(shifted[defined], uds_bound(d1, 0.05, within)[defined], rtol=1e-9)
    assert np.isnan(bound[~(d1 > 0.05).any(1)]).all()


# -- the check on an audit ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["fast", "naive"])
def test_a_bf16_audit_with_the_check_gives_the_fp32_run_per_example(
    models, fp32_result, checked, unchecked, engine
):
    result = checked[engine].score(models["bfloat16"]["unlearned"])
    reference = _per_example(fp32_result)
    assert np.nanmax(np.abs(_per_example(unchecked[engine]) - reference)) > TOLERANCE  # bf16 alone misses it
    assert np.nanmax(np.abs(_per_example(result) - reference)) <= TOLERANCE
    # every KE decision is the fp32 run's (Stage 1 decided in fp32 on the stored weights, in the same batches)
    assert (result.layers["ke"] == fp32_result.layers["ke"]).all()
    np.testing.assert_allclose(result.layers["d1"], fp32_result.layers["d1"], atol=FLOAT_NOISE, rtol=0)
    record = result.precision
    assert record["check"] and record["band"]["measured"] and record["tolerance"] == TOLERANCE
    assert record["n_fp32_examples"] > 0
    assert record["decisions"]["ke"] == {"float32": len(result.layers), "bfloat16": 0}
    assert record["weights"] == {"full": "stored", "retain": "stored", "unlearned": "stored"}
    assert result.meta["timings"]["s2_precision_seconds"] > 0


def test_the_check_off_still_says_where_bf16_is_fragile(unchecked):
    result = unchecked["fast"]
    record = result.precision
    assert not record["check"] and not record["band"]["measured"] and record["band"]["scale"] == PRIOR_SCALE
    assert record["n_fragile_cells"] > 0 and record["n_redecided_cells"] == 0 and record["weights"] == {}
    assert record["decisions"]["ke"]["float32"] == 0
    per_example = record["per_example"]
    assert set(per_example) == {
        str(i) for i in result.examples.loc[result.examples.status != "skipped", "idx"]
    }
    assert sum(entry["fragile"] for entry in per_example.values()) == record["n_fragile_cells"]
    assert record["max_uds_bound"] == max(entry["uds_bound"] for entry in per_example.values()) > TOLERANCE
    assert json.loads(json.dumps(result.summary))["precision"]["n_fragile_cells"] == record["n_fragile_cells"]


def test_fragile_clips_are_re_decided_in_fp32_without_a_tolerance(models, fp32_result, tiny_auditor):
    """With the tolerance off only the decisions are fp32: every KE cell's, and each clip inside the band; each
    example's UDS then lies within the bound the result gives it (the band of the d2 left in bf16)."""
    bf16 = models["bfloat16"]
    auditor = tiny_auditor(bf16, UDSConfig(dtype="bfloat16", batch_size=2, precision_tolerance=None))
    result = auditor.score(bf16["unlearned"])
    record = result.precision
    assert record["n_fp32_examples"] == 0 and record["decisions"]["ke"]["bfloat16"] == 0
    assert record["n_redecided_cells"] == record["n_fragile_cells"]
    moved = np.abs(_per_example(result) - _per_example(fp32_result))
    bound = np.array([record["per_example"][str(i)]["uds_bound"] for i in sorted(result.examples["idx"])])
    defined = ~np.isnan(moved)
    assert np.all(moved[defined] <= bound[defined]) and moved[defined].max() > 0
    retain_like = auditor.score(bf16["retain"])  # d2 == d1 up to bf16: every KE clip is fragile, then fp32
    ke = retain_like.layers["ke"].to_numpy()
    assert retain_like.precision["n_fragile_clip"] == int(ke.sum()) > 0
    np.testing.assert_allclose(retain_like.examples["uds"].dropna(), 1.0, atol=FLOAT_NOISE)


def test_full_as_its_own_source_stays_exactly_zero_with_the_check(models, checked):
    same = checked["fast"].score(models["bfloat16"]["full"])
    assert same.precision["n_fp32_examples"] > 0  # the fp32 path ran, and still gives 0
    assert same.uds == 0.0 and (same.layers["d2"].dropna() == 0.0).all()  # the same runs, the same numbers


def test_ke_only_stage2_with_the_check(models, fp32_result, tiny_auditor):
    bf16 = models["bfloat16"]
    result = tiny_auditor(bf16, UDSConfig(dtype="bfloat16", batch_size=2, stage2_cells="ke")).score(
        bf16["unlearned"]
    )
    assert result.stage2_cells == "ke"
    assert np.nanmax(np.abs(_per_example(result) - _per_example(fp32_result))) <= TOLERANCE
    assert result.layers.loc[~result.layers["ke"], "d2"].isna().all()


def test_fp16_audit_with_the_check(models, fp32_result, tiny_auditor):
    fp16 = models["float16"]
    result = tiny_auditor(fp16, UDSConfig(dtype="float16", batch_size=2)).score(fp16["unlearned"])
    assert result.precision["dtype"] == "float16"
    assert result.precision["band"]["eps"] == 2**-10
    assert np.nanmax(np.abs(_per_example(result) - _per_example(fp32_result))) <= TOLERANCE


def test_without_memory_for_fp32_copies_the_cells_are_counted_not_re_decided(
    models, unchecked, tiny_auditor, monkeypatch
):
    bf16 = models["bfloat16"]
    monkeypatch.setattr("uds_lens.memory.available_memory_bytes", lambda device: 1 << 10)
    result = tiny_auditor(bf16, UDSConfig(dtype="bfloat16", batch_size=2)).score(bf16["unlearned"])
    record = result.precision
    assert "full" in record["not_redecided"] and "GiB free" in record["not_redecided"]["full"]
    assert record["n_redecided_cells"] == 0 and record["n_fp32_examples"] == 0
    np.testing.assert_array_equal(_per_example(result), _per_example(unchecked["fast"]))  # the same bf16 runs


def test_the_fp32_stage1_is_cached_with_its_digest(tiny, models, tmp_path):
    bf16 = models["bfloat16"]
    tokenizer = load_tokenizer(tiny.tokenizer)

    def auditor() -> UDSAuditor:
        return UDSAuditor(
            bf16["full"],
            bf16["retain"],
            tiny.data,
            UDSConfig(dtype="bfloat16", batch_size=2),
            tokenizer=tokenizer,
            cache_dir=tmp_path,
            progress=False,
        )

    first = auditor()
    computed = first.stage1
    assert not computed.cached and computed.baseline_fp32 is not None
    (cache_file,) = tmp_path.glob("s1_*.safetensors")
    with safe_open(str(cache_file), framework="pt") as handle:
        assert {"baseline_fp32", "s1_fp32"} <= set(handle.keys())
    second = auditor()
    assert second.stage1.cached
    torch.testing.assert_close(second.stage1.d1_fp32(), computed.d1_fp32(), atol=0, rtol=0)  # read back
    np.testing.assert_array_equal(
        _per_example(second.score(bf16["unlearned"])), _per_example(first.score(bf16["unlearned"]))
    )


def test_precision_settings_enter_fingerprints_only_where_they_act():
    fp32 = settings_fingerprint(UDSConfig(dtype="float32"))
    assert fp32 == settings_fingerprint(
        UDSConfig(dtype="float32", precision_check=False, precision_tolerance=None)
    )
    assert "precision_check" not in fp32
    assert settings_fingerprint(UDSConfig(dtype="bfloat16")) != settings_fingerprint(
        UDSConfig(dtype="bfloat16", precision_check=False)
    )


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("nan"), True, "1e-3"])
def test_a_tolerance_that_is_no_positive_number_is_refused(bad):
    with pytest.raises(ConfigError, match="precision_tolerance"):
        UDSConfig(precision_tolerance=bad)


def test_fp32_copies_hold_the_weights_the_fp32_run_holds(tiny, tmp_path):
    """Stored wider than loaded: re-read; stored as loaded: upcast (the same values); in memory: upcast (rounded)."""
    fp32 = dict(named_weights(load_model(tiny.full, dtype="float32")))
    stored = reference_model(load_model(tiny.full, dtype="bfloat16"), "cpu")
    assert stored.weights == "stored" and stored_float_dtypes(Checkpoint.resolve(tiny.full)) == {
        torch.float32
    }
    for name, value in named_weights(stored.model):
        assert torch.equal(value, fp32[name]), name  # the file's values, read again

    bf16_dir = tmp_path / "bf16"
    load_hf_model(tiny.full, dtype="bfloat16", device="cpu").save_pretrained(bf16_dir)
    load_tokenizer(tiny.tokenizer).save_pretrained(bf16_dir)
    assert stored_float_dtypes(Checkpoint.resolve(bf16_dir)) == {torch.bfloat16}
    upcast = reference_model(load_model(bf16_dir, dtype="bfloat16"), "cpu")
    assert upcast.weights == "upcast-exact"
    as_fp32 = dict(named_weights(load_model(bf16_dir, dtype="float32")))
    for name, value in named_weights(upcast.model):
        assert value.dtype == torch.float32 and torch.equal(value, as_fp32[name]), name

    # a plain model uds_lens loaded knows its checkpoint: read again; one built elsewhere is upcast (rounded)
    loaded_here = hooked_from_hf(load_hf_model(tiny.full, dtype="bfloat16", device="cpu"))
    assert reference_model(loaded_here, "cpu").weights == "stored"
    elsewhere = AutoModelForCausalLM.from_pretrained(tiny.full, dtype=torch.bfloat16)
    assert reference_model(hooked_from_hf(elsewhere), "cpu").weights == "upcast-rounded"


def test_a_checked_run_measures_the_free_memory_once_and_once_per_model_swap(
    models, tiny_auditor, monkeypatch
):
    """The naive engine's fp32 references are whole copies: full's and retain's are fitted to the plan's one
    measurement (less the copies made since), each unlearned model's is measured once, when it is swapped in."""
    from uds_lens import memory, precision

    bf16 = models["bfloat16"]
    measured: list[object] = []
    real = memory.available_memory_bytes

    def counted(device: object) -> int:
        measured.append(device)
        return real(device)  # type: ignore[arg-type]

    made: list[str] = []
    reference = precision.reference_model

    def counted_reference(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(str(model))
        return reference(model, *args, **kwargs)

    monkeypatch.setattr(memory, "available_memory_bytes", counted)
    monkeypatch.setattr(precision, "reference_model", counted_reference)
    auditor = tiny_auditor(bf16, UDSConfig(dtype="bfloat16", batch_size=2, engine="naive"))
    results = [auditor.score(bf16["unlearned"]), auditor.score(bf16["retain"])]
    swaps = sum("unlearned" in result.precision["weights"] for result in results)
    assert "full" in results[0].precision["weights"] and len(made) >= 2  # whole copies were made
    assert len(measured) == 1 + swaps  # the plan's, then one per unlearned model whose copy was made

"""The precision check's lean fp32 reference (issue 46): a bf16 model run by the fast engine inside
``kernels.computing_in(float32)`` (each block's weights upcast when it runs, never a copy of the model) is the fp32
run of its weights, bit for bit the run of a whole fp32 copy (``precision.reference_model``) on every family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.families import build_family, family_configs

from uds_lens import families
from uds_lens.checkpoints.loader import load_model, load_tokenizer
from uds_lens.config import EngineSpec
from uds_lens.data import encode, load_examples
from uds_lens.patching.batch import pad_batch
from uds_lens.patching.engines import engine_for
from uds_lens.patching.kernels import computing_in
from uds_lens.precision import lean_reference, reference_model
from uds_lens.tl_compat import hf_model_of

# the families whose lean reference is used (the family table's lean_reference column); Gemma and Phi-3 get whole
# copies
FAMILIES = ["llama3", "mistral_window", "qwen2_window", "qwen3", "olmo2"]
WHOLE = ["gemma2", "phi3"]


@pytest.fixture(scope="module")
def bf16_models(tiny, tmp_path_factory) -> dict[str, dict[str, object]]:
    """``{family: {"full", "source"}}`` loaded in bf16, each without its checkpoint so that its fp32 copy is the
    upcast of the loaded weights (the reference a bf16-stored checkpoint gets)."""
    tokenizer = load_tokenizer(tiny.tokenizer)
    root = tmp_path_factory.mktemp("lean")
    out: dict[str, dict[str, object]] = {}
    for family, config in family_configs(len(tokenizer)).items():
        if family not in FAMILIES + WHOLE:
            continue
        full = build_family(config, root / family / "full", tokenizer, seed=0)
        source = build_family(config, root / family / "source", tokenizer, seed=1, base=full, noise=0.5)
        out[family] = {}
        for role, path in (("full", full), ("source", source)):
            model = load_model(path, dtype=torch.bfloat16, device="cpu")
            hf_model_of(model).uds_checkpoint = None  # type: ignore[union-attr]
            out[family][role] = model
    return out


@pytest.mark.parametrize("site", ["resid_post", "mlp_out"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_lean_reference_is_the_whole_fp32_copy_bit_for_bit(family, site, tiny, bf16_models):
    full, source = bf16_models[family]["full"], bf16_models[family]["source"]
    copies = {role: reference_model(model, "cpu").model for role, model in bf16_models[family].items()}  # type: ignore[arg-type]
    tokenizer = load_tokenizer(tiny.tokenizer)
    encoded, _ = encode(load_examples(tiny.data), tokenizer)
    batch = pad_batch(encoded[:5], tokenizer.pad_token_id or 0, "span", cut=True)
    n_layers = full.cfg.n_layers  # type: ignore[attr-defined]
    engine = engine_for(EngineSpec(site, tuple(range(n_layers))))
    assert lean_reference(full, engine) and reference_model(full, "cpu", engine).model is full  # type: ignore[arg-type]
    cells = torch.rand(batch.size, n_layers, generator=torch.Generator().manual_seed(0)) > 0.5
    with torch.no_grad():
        clean = engine.clean_run(copies["full"], batch)
        whole = [
            clean.scores,
            engine.baseline_scores(copies["full"], batch, clean),
            engine.source_scores(copies["full"], copies["source"], batch, clean),
            engine.cell_scores(copies["full"], copies["source"], batch, cells, clean).nan_to_num(),
        ]
        with computing_in(torch.float32):
            lean_clean = engine.clean_run(full, batch)  # type: ignore[arg-type]
            lean = [
                lean_clean.scores,
                engine.baseline_scores(full, batch, lean_clean),  # type: ignore[arg-type]
                engine.source_scores(full, source, batch, lean_clean),  # type: ignore[arg-type]
                engine.cell_scores(full, source, batch, cells, lean_clean).nan_to_num(),  # type: ignore[arg-type]
            ]
    assert all(value.dtype == torch.float32 for value in lean)
    # the same operations on the same fp32 values (an upcast is exact): equal by construction
    for name, a, b in zip(("clean", "baseline", "source", "cells"), whole, lean, strict=True):
        assert torch.equal(a, b), (name, (a - b).abs().max())
    # and the bf16 model itself was left as it was: bf16, no fp32 tensor kept with it
    assert next(full.parameters()).dtype == torch.bfloat16  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", WHOLE)
def test_families_whose_fp32_run_differs_get_whole_copies(family, bf16_models):
    full = bf16_models[family]["full"]
    n_layers = full.cfg.n_layers  # type: ignore[attr-defined]
    fast = engine_for(EngineSpec("resid_post", tuple(range(n_layers))))
    assert not lean_reference(full, fast)  # type: ignore[arg-type]
    reference = reference_model(full, "cpu", fast)  # type: ignore[arg-type]
    assert not reference.lean and next(reference.model.parameters()).dtype == torch.float32


def test_only_the_fast_engine_outside_published_compat_runs_lean(bf16_models):
    full = bf16_models["llama3"]["full"]
    layers = tuple(range(full.cfg.n_layers))  # type: ignore[attr-defined]
    assert lean_reference(full, engine_for(EngineSpec("resid_post", layers)))  # type: ignore[arg-type]
    naive = engine_for(EngineSpec("resid_post", layers, engine="naive"))
    compat = engine_for(EngineSpec("resid_post", layers, published_compat=True))
    assert not lean_reference(full, naive) and not lean_reference(full, compat)  # type: ignore[arg-type]


def test_the_precision_check_runs_lean_on_bf16_checkpoints_and_decides_as_whole_copies(
    tiny, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from uds_lens import precision
    from uds_lens.auditor import UDSAuditor
    from uds_lens.config import UDSConfig

    paths = {}
    for role in ("full", "retain", "unlearned"):  # checkpoints that store bf16, as most 8B ones do
        paths[role] = tmp_path / role
        AutoModelForCausalLM.from_pretrained(getattr(tiny, role), dtype=torch.bfloat16).save_pretrained(
            paths[role]
        )
    tokenizer = load_tokenizer(tiny.tokenizer)

    def score() -> object:
        auditor = UDSAuditor(
            paths["full"],
            paths["retain"],
            tiny.data,
            UDSConfig(dtype="bfloat16", batch_size=4),
            tokenizer=tokenizer,
            cache_dir=False,
            progress=False,
        )
        return auditor.score(paths["unlearned"])

    made: list[bool] = []
    real = precision.reference_model

    def spy(*args: object, **kwargs: object) -> precision.Reference:
        reference = real(*args, **kwargs)  # type: ignore[arg-type]
        made.append(reference.lean)
        return reference

    monkeypatch.setattr(precision, "reference_model", spy)
    lean = score()
    assert made and all(made)  # full, retain and unlearned: no fp32 copy made
    # the family table's row says no lean reference: whole fp32 copies
    llama = dataclasses.replace(families.FAMILIES["llama"], lean_reference=False)
    monkeypatch.setitem(families.FAMILIES, "llama", llama)
    made.clear()
    whole = score()
    assert made and not any(made)
    record, whole_record = lean.meta["precision"], whole.meta["precision"]  # type: ignore[attr-defined]
    assert (
        record["weights"]
        == whole_record["weights"]
        == {
            "full": "upcast-exact",
            "retain": "upcast-exact",
            "unlearned": "upcast-exact",
        }
    )
    assert record["n_fp32_examples"] == whole_record["n_fp32_examples"] > 0
    # the same fp32 runs on the same values: every decision and score equal by construction
    for column in ("d1", "d2", "s2_score"):
        assert lean.layers[column].tolist() == whole.layers[column].tolist(), column  # type: ignore[attr-defined]
    assert lean.uds == whole.uds  # type: ignore[attr-defined]

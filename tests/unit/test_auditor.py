"""The auditor (``auditor.py`` and the modules it is built from): UDS invariants (SPEC §1.6), retain-free mode, the S1
cache (SPEC §1.7), result reuse, out-of-memory retries, non-finite scores, and the checks of its settings.

The score formula itself is tested in ``test_uds.py``.
"""

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers.numerics import assert_close_reordered
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import uds_lens.auditor as auditor_module
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.compatibility import ModelMismatchError
from uds_lens.checkpoints.loader import load_model, load_tokenizer
from uds_lens.components import patch_heads
from uds_lens.config import ConfigError, UDSConfig
from uds_lens.data import DataError, encode, load_examples
from uds_lens.failures import nonfinite_error
from uds_lens.fingerprints import result_fingerprint
from uds_lens.inputs import RunInputs
from uds_lens.patching.engines import FastEngine
from uds_lens.result_store import OutputConflictError
from uds_lens.results import LAYER_COLUMNS, UDSResult, load_reusable
from uds_lens.scoring import score_models
from uds_lens.stage_cache import CACHE_FORMAT, S1Cache, StageOne, stage_digest


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("engine", ["fast", "naive"])
def test_invariants(models, compat, engine, tiny_auditor):
    auditor = tiny_auditor(models, UDSConfig(published_compat=compat, engine=engine))
    same_as_retain = auditor.score(models["retain"])
    scored = same_as_retain.examples.dropna(subset=["uds"])
    assert len(scored) >= 2
    assert np.allclose(scored["uds"], 1.0)
    assert np.allclose(same_as_retain.layers["d1"], same_as_retain.layers["d2"], atol=1e-6)
    same_as_full = auditor.score(models["full"])
    last = models["full"].cfg.n_layers - 1
    below_last = same_as_full.layers[same_as_full.layers["layer"] < last]
    assert (below_last["d2"].abs() <= 1e-6).all()
    if compat:  # the published last-layer quirk: the source's final norm applied twice
        assert same_as_full.layers.loc[same_as_full.layers["layer"] == last, "d2"].abs().max() > 1e-3
    else:
        assert (same_as_full.layers["d2"] == 0).all() and same_as_full.uds == 0.0
    real = auditor.score(models["unlearned"])
    assert 0.0 < real.uds < 1.0


def test_fast_and_naive_agree_on_every_delta(models, tiny_auditor):
    results = {}
    for engine in ("fast", "naive"):
        auditor = tiny_auditor(models, UDSConfig(engine=engine))
        results[engine] = auditor.score(models["unlearned"]).layers
    assert np.allclose(results["fast"]["d1"], results["naive"]["d1"], atol=1e-5)
    assert np.allclose(results["fast"]["d2"], results["naive"]["d2"], atol=1e-5)


def test_permutation_and_batch_size_invariance(tiny, models, tiny_auditor):
    examples = load_examples(tiny.data)
    reference = None
    for order, batch_size in ((examples, 1), (examples[::-1], 4), (examples[2:] + examples[:2], 3)):
        auditor = tiny_auditor(models, UDSConfig(batch_size=batch_size), data=list(order))
        layers = (
            auditor.score(models["unlearned"]).layers.sort_values(["idx", "layer"]).reset_index(drop=True)
        )
        if reference is None:
            reference = layers
        assert np.allclose(layers[["d1", "d2"]], reference[["d1", "d2"]], atol=1e-5)


def test_retain_free_mode(models, tiny_auditor):
    auditor = tiny_auditor(models, retain=False)
    result = auditor.score(models["unlearned"])
    summary = result.summary
    assert summary["uds"] is None and summary["retain_free"] and "unnormalised" in summary["note"]
    assert result.layers["d1"].isna().all() and result.layers["d2"].notna().all()
    assert summary["d2_summary"]["mean_d2"] == pytest.approx(result.layers["d2"].mean())


def test_nothing_scored_is_nan_or_the_published_zero(models, tiny_auditor):
    for compat, expected in ((False, None), (True, 0.0)):
        auditor = tiny_auditor(models, UDSConfig(published_compat=compat))
        result = auditor.score(models["unlearned"])
        assert result.summary["n_scored"] > 0 and 0.0 < result.uds
        nothing = result.with_tau(1e9)
        assert nothing.summary["n_scored"] == 0 and nothing.summary["n_no_ke"] == len(nothing.examples)
        assert nothing.summary["uds"] == expected


def test_s1_cache_hit_miss_tau_and_corruption(tiny, tmp_path):
    cache = tmp_path / "cache"
    first = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False)
    r1 = first.score(tiny.unlearned)
    assert not r1.summary["timings"]["s1_cached"]
    second = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False)
    r2 = second.score(tiny.unlearned)
    assert r2.summary["timings"]["s1_cached"]
    assert np.allclose(r1.layers["d1"], r2.layers["d1"])
    # tau is applied after the cache: another tau still hits it
    third = UDSAuditor(tiny.full, tiny.retain, tiny.data, UDSConfig(tau=0.2), cache_dir=cache, progress=False)
    r3 = third.score(tiny.unlearned)
    assert r3.summary["timings"]["s1_cached"]
    assert r3.examples["n_ke"].sum() <= r1.examples["n_ke"].sum()
    # the batch size is not part of the key: a hit adopts the batches S1 ran in, so S2 batches as S1 did
    other_size = UDSAuditor(
        tiny.full, tiny.retain, tiny.data, UDSConfig(batch_size=1), cache_dir=cache, progress=False
    )
    assert other_size.batches != first.batches
    r_size = other_size.score(tiny.full)
    assert r_size.summary["timings"]["s1_cached"] and other_size.batches == first.batches
    assert (r_size.layers["d2"] == 0.0).all()  # the full model as its own source: exactly 0 in S1's batches
    pd.testing.assert_frame_equal(r1.with_tau(0.2).examples, r3.examples)
    # same path, different weights: a miss
    changed = tmp_path / "retain"
    shutil.copytree(tiny.retain, changed)
    tiny.variant(changed, seed=9, base=tiny.retain, noise=0.01)
    r4 = UDSAuditor(tiny.full, changed, tiny.data, cache_dir=cache, progress=False).score(tiny.unlearned)
    assert not r4.summary["timings"]["s1_cached"]
    # a corrupt cache file is rebuilt with a warning
    for file in cache.glob("s1_*.safetensors"):
        file.write_bytes(b"not a torch file")
    with pytest.warns(UserWarning, match="recomputing"):
        r5 = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False).score(
            tiny.unlearned
        )
    assert not r5.summary["timings"]["s1_cached"]
    assert np.allclose(r5.layers["d1"], r1.layers["d1"])
    assert any(S1Cache(cache).directory.glob("s1_*.safetensors"))


def test_result_round_trip_and_open_unlearning_json(tiny, tmp_path):
    result = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False).score(
        tiny.unlearned
    )
    result.save(tmp_path / "out")
    loaded = UDSResult.load(tmp_path / "out")
    pd.testing.assert_frame_equal(loaded.examples, result.examples, check_dtype=False)
    assert np.allclose(
        loaded.layers[["d1", "d2", "ler"]].fillna(-9), result.layers[["d1", "d2", "ler"]].fillna(-9)
    )
    assert loaded.uds == pytest.approx(result.uds)
    ou = json.loads((tmp_path / "out" / "uds_eval.json").read_text())
    assert ou["uds"]["agg_value"] == pytest.approx(result.uds)
    assert set(ou["uds"]["value_by_index"]) == {str(i) for i in result.examples.dropna(subset=["uds"])["idx"]}
    low, high = result.summary["ci95"]
    assert low <= result.uds <= high


def test_skipped_examples_are_counted(tiny, tmp_path):
    records = json.loads(tiny.data.read_text())
    records.append(
        {"idx": 50, "question": "q?", "answer": "Nothing here.", "prefix": "Nothing", "entity": "Berlin"}
    )
    records.append(
        {"idx": 51, "question": "q?", "answer": "Other text.", "prefix": "Mismatch", "entity": "text"}
    )
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    result = UDSAuditor(tiny.full, tiny.retain, path, cache_dir=False, progress=False).score(tiny.unlearned)
    skipped = (
        result.examples[result.examples["status"] == "skipped"].set_index("idx")["skip_reason"].to_dict()
    )
    assert skipped == {50: "entity_span_not_found", 51: "answer_does_not_start_with_prefix"}
    assert result.summary["n_skipped"] == 2


def test_mismatched_unlearned_model_is_refused(tiny, tmp_path):
    other = tiny.variant(tmp_path / "other", seed=4, d_model=48)
    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    with pytest.raises(ModelMismatchError, match="d_model"):
        auditor.score(other)


def test_out_of_memory_halves_the_batch_and_retries(models, monkeypatch, tiny_auditor):
    """One runner (``planning.run_batches``): a batch that runs out of memory is split in two and retried, in the
    auditor's scoring and in component patching alike; the numbers are those of an unhindered run, and the smaller
    batches are kept for the next model."""
    config = UDSConfig(batch_size=8)
    reference = tiny_auditor(models, config).score(models["unlearned"])
    heads_reference = patch_heads(tiny_auditor(models, config), models["unlearned"], engine="fast")
    real_scores = FastEngine.patched_scores
    sizes = []

    def small_memory(self, full, batch, *args):
        sizes.append(batch.size)
        if batch.size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_scores(self, full, batch, *args)

    monkeypatch.setattr(FastEngine, "patched_scores", small_memory)
    auditor = tiny_auditor(models, config)
    assert max(len(b) for b in auditor.batches) > 2
    result = auditor.score(models["unlearned"])
    assert max(sizes) > 2 and all(len(b) <= 2 for b in auditor.batches)
    assert np.allclose(result.layers["d1"], reference.layers["d1"], atol=1e-6)
    assert np.allclose(result.layers["d2"], reference.layers["d2"], atol=1e-6)
    sizes.clear()
    auditor.score(models["retain"])
    assert max(sizes) <= 2  # the next model starts from the size that fitted
    sizes.clear()
    heads = patch_heads(auditor, models["unlearned"], engine="fast")
    assert max(sizes) > 2 and heads.idx == heads_reference.idx
    assert_close_reordered(heads.s1, heads_reference.s1)
    assert_close_reordered(heads.s2, heads_reference.s2)

    def shape_mismatch(*args):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(FastEngine, "patched_scores", shape_mismatch)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # other errors are not retried
        auditor.score(models["full"])


# ----------------------------------------------------------------------------------------------------------------
# Never a silently wrong number (issue 13)


def _copy_model(source, target, nan_parameter: str | None = None, noise: float = 0.0, seed: int = 0):
    """A copy of a tiny checkpoint, optionally with one weight set to NaN or all weights nudged."""
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if noise:
                parameter.add_(noise * torch.randn_like(parameter))
            if name == nan_parameter:
                parameter.view(-1)[0] = float("nan")
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def test_stale_results_are_never_reused(tiny, tmp_path):
    """Each changed input is another run's result: refused naming the input unless forced, then recomputed (the
    number equals a fresh run); identical inputs reuse, and say so."""
    unlearned = _copy_model(tiny.unlearned, tmp_path / "unl")
    other_data = tmp_path / "data.json"
    other_data.write_text(json.dumps(json.loads(tiny.data.read_text())[1:]))
    out, cache = tmp_path / "out", tmp_path / "cache"

    fresh_scores: dict[tuple, UDSResult] = {}  # one fresh run per set of inputs (weights changed: a new key)
    weights_version = [0]

    def run(full=tiny.full, retain=tiny.retain, data=tiny.data, limit=None, force=False):
        forcing = {"force": True} if force else {}
        result = score_models(
            full,
            retain,
            {"m": unlearned},
            data,
            out_dir=out,
            cache_dir=cache,
            limit=limit,
            progress=False,
            **forcing,
        )["m"]
        key = (str(full), str(retain), str(data), limit, weights_version[0])
        if key not in fresh_scores:
            auditor = UDSAuditor(full, retain, data, cache_dir=False, progress=False, limit=limit)
            fresh_scores[key] = auditor.score(unlearned)
        fresh = fresh_scores[key]
        assert np.allclose(result.layers["d2"], fresh.layers["d2"], atol=1e-6)
        assert np.allclose(result.layers["d1"].fillna(0), fresh.layers["d1"].fillna(0), atol=1e-6)
        return result

    first = run()
    assert "reused" not in first.meta
    for changed, key in (
        (dict(retain=tiny.unlearned), "retain"),
        (dict(full=tiny.retain), "full"),
        (dict(data=other_data), "data"),
        (dict(limit=3), "data"),
        (dict(retain=None), "retain"),
        (
            {},
            "retain",
        ),  # back to the first inputs after the last change: the saved result is the last change's
    ):
        with pytest.raises(OutputConflictError, match=f"{key} differs"):
            run(**changed)
        assert "reused" not in run(**changed, force=True).meta, changed
    assert run().meta.get("reused") == "identical inputs"
    _copy_model(tiny.unlearned, unlearned, noise=0.05, seed=3)  # retrained in place: same path, new weights
    weights_version[0] += 1
    with pytest.raises(OutputConflictError, match="unlearned differs"):
        run()
    assert "reused" not in run(force=True).meta
    assert run().meta.get("reused") == "identical inputs"
    assert "reused" not in run(force=True).meta


@pytest.mark.parametrize("role", ["full", "retain", "unlearned"])
def test_nan_in_any_model_is_refused_and_never_cached(tiny, tmp_path, role):
    broken = _copy_model(
        getattr(tiny, role), tmp_path / "broken", nan_parameter="model.layers.1.mlp.down_proj.weight"
    )
    paths = {"full": tiny.full, "retain": tiny.retain, "unlearned": tiny.unlearned, role: broken}
    cache = tmp_path / "cache"
    with pytest.raises(FloatingPointError) as error:  # NonFiniteScoreError
        UDSAuditor(paths["full"], paths["retain"], tiny.data, cache_dir=cache, progress=False).score(
            paths["unlearned"]
        )
    message = str(error.value)
    assert f"The {role} model ({broken})" in message and "first at layer 1" in message
    assert "model.layers.1.mlp.down_proj" in message or "blocks.1.mlp.W_out" in message
    assert "--dtype float32" not in message  # it already runs in float32: that advice would not help
    if role != "unlearned":  # S1 depends only on full and retain: a finite one may stay cached
        assert not list(cache.glob("s1_*"))


def test_nonfinite_advice_fits_the_dtype(tiny, models):
    encoded, _ = encode(load_examples(tiny.data), load_tokenizer(tiny.tokenizer))
    half = load_model(tiny.full, dtype="bfloat16")
    assert "run in float32 (--dtype float32" in str(
        nonfinite_error(half, "full", "x", "score", [0], encoded[0], 2)
    )
    fp32 = str(nonfinite_error(models["full"], "full", "x", "score", [0], encoded[0], 2))
    assert "--dtype" not in fp32 and "already runs in float32" in fp32 and "layer 2" in fp32


@pytest.mark.parametrize(
    "options",
    [
        dict(tau=-1.0),
        dict(tau=float("nan")),
        dict(tau=float("inf")),
        dict(batch_size=0),
        dict(batch_size=-3),
        dict(patch_scope="foo"),
        dict(site="hook_z"),
        dict(engine="slow"),
        dict(layers=(-1,)),
        dict(layers=()),
        dict(dtype="float8"),
        dict(device="gpu0"),
    ],
)
def test_options_out_of_range_are_refused(options):
    with pytest.raises(ConfigError, match="must|Unknown dtype"):
        UDSConfig(**options)


def test_layers_beyond_the_model_and_negative_limits_are_refused(tiny):
    with pytest.raises(ConfigError, match="do not exist"):
        UDSAuditor(
            tiny.full, tiny.retain, tiny.data, UDSConfig(layers=(0, 7)), cache_dir=False, progress=False
        )
    with pytest.raises(DataError, match="positive"):
        load_examples(tiny.data, limit=-2)


def test_a_crafted_cache_file_never_runs(tiny, tmp_path):
    """A pickle in the cache directory (under the current or the old file name) is never unpickled."""
    cache = tmp_path / "cache"
    reference = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False).score(
        tiny.unlearned
    )
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    crafted = pickle.dumps({"format": 2, "payload": Payload()})
    files = list(cache.glob("s1_*"))
    assert files
    for file in files:
        file.write_bytes(crafted)
        file.with_suffix(".pt").write_bytes(crafted)
    with pytest.warns(UserWarning, match="recomputing|pickle"):
        again = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False).score(
            tiny.unlearned
        )
    assert not marker.exists()
    assert not again.summary["timings"]["s1_cached"]
    assert np.allclose(again.layers["d1"], reference.layers["d1"])
    assert not list(cache.glob("s1_*.pt"))


def test_an_example_longer_than_the_context_is_cut_or_skipped(tiny, tmp_path):
    records = json.loads(tiny.data.read_text())
    filler = " ".join(["the river stone light of the night"] * 60)
    tail = dict(
        records[0], idx=40, answer=records[0]["answer"] + " " + filler
    )  # entity early, long tail: cut
    head = dict(
        records[0], idx=41, question=filler + " " + records[0]["question"]
    )  # entity beyond the context
    path = tmp_path / "long.json"
    path.write_text(json.dumps(records + [tail, head]))
    for engine in ("fast", "naive"):
        result = UDSAuditor(
            tiny.full, tiny.retain, path, UDSConfig(engine=engine), cache_dir=False, progress=False
        ).score(tiny.unlearned)
        examples = result.examples.set_index("idx")
        assert examples.loc[41, "status"] == "skipped"
        assert examples.loc[41, "skip_reason"] == "longer_than_model_context"
        assert result.summary["skipped_reasons"] == {"longer_than_model_context": 1}
        # cutting after the last read position changes no number
        layers = result.layers.set_index(["idx", "layer"])
        assert np.allclose(
            layers.loc[40, ["d1", "d2"]], layers.loc[records[0]["idx"], ["d1", "d2"]], atol=1e-5
        )


# ----------------------------------------------------------------------------------------------------------------
# s0: the clean full-model score, renamed from s_full (cache format 7)


def _rewrite_cache(path: Path, edit) -> None:
    """Rewrite an S1 cache file in place: ``edit(header, tensors)`` changes the JSON header and the tensors."""
    with safe_open(str(path), framework="pt") as handle:
        header = json.loads(handle.metadata()["uds_lens"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    edit(header, tensors)
    save_file(tensors, str(path), metadata={"uds_lens": json.dumps(header)})


def test_a_cache_file_of_the_format_before_s0_is_recomputed_not_misread(tiny, tmp_path):
    """A format-6 file (S0 stored as ``s_full``, digest valid) is deleted with a warning naming its format, and S1 is
    recomputed to the same numbers; the new file stores ``s0``."""
    cache = tmp_path / "cache"
    reference = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False)
    first = reference.score(tiny.unlearned)
    (path,) = cache.glob("s1_*.safetensors")

    def to_format_6(header, tensors):
        header["format"] = 6
        tensors["s_full"] = tensors.pop("s0")

    _rewrite_cache(path, to_format_6)
    with pytest.warns(UserWarning, match=f"cache format 6, not {CACHE_FORMAT}"):
        again = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False)
        result = again.score(tiny.unlearned)
    assert CACHE_FORMAT == 8
    assert not result.summary["timings"]["s1_cached"]
    assert torch.equal(again.stage1.s0, reference.stage1.s0)
    pd.testing.assert_frame_equal(result.layers, first.layers)
    with safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == {"s0", "baseline", "s1"}
        assert json.loads(handle.metadata()["uds_lens"])["format"] == CACHE_FORMAT
    hit = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False)
    assert hit.stage1.cached and torch.equal(hit.stage1.s0, reference.stage1.s0)


def test_a_current_cache_file_without_s0_is_rebuilt(tiny, tmp_path):
    """The format number alone does not make a file readable: one that claims format 7 but lacks ``s0`` is rebuilt."""
    cache = tmp_path / "cache"
    assert not UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False).stage1.cached
    (path,) = cache.glob("s1_*.safetensors")
    _rewrite_cache(path, lambda header, tensors: tensors.__setitem__("s_full", tensors.pop("s0")))
    with pytest.warns(UserWarning, match="recomputing S1"):
        stage = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=cache, progress=False).stage1
    assert not stage.cached and torch.isfinite(stage.s0).all()


@pytest.mark.parametrize("cells", ["all", "ke"])
def test_the_saved_fingerprint_is_result_fingerprint_plus_s1(models, tiny, tiny_auditor, cells):
    """One function lays a result fingerprint out (``fingerprints.inputs_fingerprint`` and ``with_unlearned``): what
    an auditor saves in meta.json is ``result_fingerprint`` of the same inputs (what ``score`` compares a saved result
    with before loading anything) plus ``s1``, its keys in the order meta.json has always had them."""
    config = UDSConfig(stage2_cells=cells)
    auditor = tiny_auditor(models, config)
    saved = auditor.fingerprint(Checkpoint.resolve(models["unlearned"]))
    order = ["format", "full", "retain", "data", "tokenizer", "settings", "s1", "unlearned"]
    assert list(saved) == order + (["stage2"] if cells == "ke" else [])
    run = RunInputs.resolve(
        models["full"], models["retain"], tiny.data, config=config, tokenizer=auditor.tokenizer
    )
    inputs = result_fingerprint(run, Checkpoint.resolve(models["unlearned"]))
    assert {key: value for key, value in saved.items() if key != "s1"} == inputs
    assert inputs["tokenizer"] != "from full" and inputs["unlearned"].startswith("tensors:")


def test_the_stage_digest_is_the_one_saved_results_were_fingerprinted_with():
    """S0 is hashed under its former label, so results saved before the rename (whose fingerprint's ``s1`` is this
    digest) are still reused: the digest is written out here byte by byte."""
    stage = StageOne(
        idx=[3, 5],
        s0=torch.tensor([-1.5, -2.25]),
        baseline=torch.tensor([[-1.5, -1.25], [-2.25, -2.0]]),
        s1=None,
        batches=[[1], [0]],
    )
    expected = hashlib.sha256()
    for label, values in (("s_full", stage.s0), ("baseline", stage.baseline)):
        expected.update(
            label.encode() + b"\0" + json.dumps(list(values.shape)).encode() + values.numpy().tobytes()
        )
    expected.update(b"s1\0none")
    expected.update(json.dumps({"idx": [3, 5], "batches": [[1], [0]]}).encode())
    assert stage_digest(stage) == expected.hexdigest()[:32]


def test_an_old_result_directory_loads_with_s0_and_the_baseline_in_their_columns(
    models, tiny_auditor, tmp_path
):
    """A result saved before the rename (format 2: the per-layer baseline in a column ``s_full``, S0 only in
    meta.json) reads back with ``baseline_score`` and ``s0`` where they belong, and is never reused as current."""
    from uds_lens.files import bytes_digest

    auditor = tiny_auditor(models)
    result = auditor.score(models["unlearned"])
    out = tmp_path / "old"
    result.save(out)
    layers = pd.read_csv(out / "layers.csv")
    old = layers.drop(columns="s0").rename(columns={"baseline_score": "s_full"})
    old.to_csv(out / "layers.csv", index=False)
    (out / "layers.parquet").unlink(missing_ok=True)
    meta = json.loads((out / "meta.json").read_text())
    meta["format"] = 2
    meta["files"].pop("layers.parquet", None)
    meta["files"]["layers.csv"] = bytes_digest((out / "layers.csv").read_bytes())
    (out / "meta.json").write_text(json.dumps(meta))

    loaded = UDSResult.load(out)
    assert list(loaded.layers.columns) == LAYER_COLUMNS
    np.testing.assert_array_equal(loaded.layers["baseline_score"], layers["baseline_score"])
    s0 = dict(zip([e.idx for e in auditor.encoded], auditor.stage1.s0.tolist()))
    np.testing.assert_array_equal(loaded.layers["s0"], loaded.layers["idx"].map(s0))
    np.testing.assert_array_equal(loaded.layers["d1"], layers["d1"])
    reused, reason = load_reusable(out, result.meta["fingerprint"])
    assert reused is None and "result format 2" in reason


def test_d1_is_baseline_minus_s1_in_the_auditor_and_the_tables(models, tiny_auditor):
    """One computation (``uds.deltas``): the auditor's ``d1()`` and the result's ``d1``/``d2`` columns are the float32
    differences of the stage scores, bit for bit."""
    auditor = tiny_auditor(models)
    result = auditor.score(models["unlearned"])
    stage = auditor.stage1
    d1 = auditor.d1()
    assert d1.dtype == torch.float32 and torch.equal(d1, stage.baseline - stage.s1)
    np.testing.assert_array_equal(result.layers["d1"].to_numpy(), d1.numpy().reshape(-1))
    np.testing.assert_array_equal(
        result.layers["d2"].to_numpy(),
        (result.layers["baseline_score"] - result.layers["s2_score"]).to_numpy(dtype=np.float32),
    )
    assert tiny_auditor(models, retain=False).d1() is None


# ----------------------------------------------------------------------------------------------------------------
# The split of auditor.py and the checks score_models makes once


def test_the_auditor_offers_only_its_own_names():
    """One home per name: the scoring functions live in ``scoring`` (which imports the auditor, never the reverse),
    the settings in ``config``; the auditor module no longer re-exports them."""
    for moved in ("score_models", "result_names", "refuse_other_runs"):
        assert not hasattr(auditor_module, moved)
    assert auditor_module.__all__ == ["UDSAuditor"]
    assert "uds_lens.scoring" not in {
        getattr(value, "__module__", None) for value in vars(auditor_module).values() if callable(value)
    }


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("limit", 0, r"limit \(--limit\) must be a positive integer"),
        ("limit", True, r"limit \(--limit\) must be a positive integer"),
        ("out_dir", "file", r"output directory \(--out\) .* is a file"),
        ("cache_dir", "file", r"S1 cache directory \(--cache-dir\) .* is a file"),
    ],
)
def test_score_models_checks_out_cache_and_limit_before_any_model_loads(tmp_path, option, value, message):
    (tmp_path / "file").write_text("not a directory")
    settings = {"out_dir": tmp_path / "out", option: tmp_path / "file" if value == "file" else value}
    with pytest.raises(ConfigError, match=message):
        score_models(
            "/no/such/full", "/no/such/retain", {"m": "/no/such/model"}, "/no/such/data.json", **settings
        )
    assert not (tmp_path / "out").exists()


def test_run_with_cache_is_the_clean_run_of_the_padded_examples(models, tiny_auditor):
    auditor = tiny_auditor(models)
    idxs = [e.idx for e in auditor.encoded[:2]]
    logits, cache = auditor.run_with_cache(idxs, names_filter="blocks.0.hook_resid_post")
    tokens = auditor.tokens(idxs)
    assert logits.shape[:2] == tokens.shape
    assert cache["blocks.0.hook_resid_post"].shape == (*tokens.shape, auditor.full.cfg.d_model)
    assert not any(name.startswith("blocks.1.") for name in cache.keys())  # names_filter was applied
    with torch.no_grad():
        assert torch.equal(logits, auditor.full(tokens))

"""MUSE's knowledge questions and passages and WMDP's multiple choice, by name, on the test zoo (issue 58): local copies
in the hub datasets' exact shape (``helpers/benchmark_copies.py``) scored end to end through the API and the CLI; the
ladder holds on the knowmem-shaped set, the multiple-choice set is retain-free everywhere and its report never says
"UDS"; a MUSE-shaped checkpoint (six fp32 shards and their index) goes through the same door as every checkpoint. The
CLI runs the three sets in ``test_guide_muse_wmdp.py``, the guide's commands as written."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from helpers.benchmark_copies import MUSE, WMDP, write_copies
from safetensors.torch import load_file, save_file

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.loader import load_hf_model
from uds_lens.plotting.report import write_report
from uds_lens.scoring import score_models


@pytest.fixture(scope="module")
def copies(test_zoo, tmp_path_factory):
    """The MUSE-News and WMDP copies from the zoo's own forget and retain records, and ``datasets``'s cache kept in
    the test's folder."""
    root = tmp_path_factory.mktemp("benchmarks")
    forget = json.loads(test_zoo.forget_path.read_text())
    retain = json.loads(test_zoo.data_path("retain").read_text())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf-cache"))
        write_copies(root, forget, retain)
        yield root


def specs(root) -> dict[str, str]:
    return {
        "knowmem": f"hf:{root / MUSE}/knowmem:forget_qa",
        "verbmem": f"hf:{root / MUSE}/verbmem:forget",
        "wmdp": f"hf:{root / WMDP}/wmdp-bio:test",
    }


@pytest.mark.slow
def test_the_ladder_holds_on_the_knowmem_shaped_set(test_zoo, copies):
    """Full as its own source scores 0 and retain 1, by construction, as on the zoo's own forget set."""
    zoo = {name: test_zoo.path(name) for name in ("full", "retain", "npo")}
    results = score_models(
        zoo["full"], zoo["retain"], zoo, specs(copies)["knowmem"], cache_dir=False, progress=False
    )
    n = len(json.loads(test_zoo.forget_path.read_text()))
    assert results["full"].uds == pytest.approx(0.0, abs=1e-6)
    assert results["retain"].uds == pytest.approx(1.0, abs=1e-6)
    assert 0.0 < results["npo"].uds < 1.0
    summary = results["npo"].summary
    assert summary["n_scored"] >= 0.8 * n and summary["data"] == specs(copies)["knowmem"]
    assert "forms" not in summary and not summary["retain_free"]


@pytest.mark.slow
def test_passages_and_multiple_choice_through_the_api(test_zoo, copies, tmp_path):
    """verbmem scores with a retain model, its spans named as sentences; WMDP's letters only retain-free, labelled so
    in the summary and in a report that never says UDS."""
    full, retain = test_zoo.path("full"), test_zoo.path("retain")
    passages = score_models(
        full, retain, {"npo": test_zoo.path("npo")}, specs(copies)["verbmem"], cache_dir=False, limit=12,
        progress=False,
    )["npo"]  # fmt: skip
    assert passages.summary["forms"] == ["completion"] and passages.summary["n_scored"] > 0
    assert 0.0 < passages.uds < 1.0
    out = tmp_path / "wmdp"
    letters = score_models(
        full, None, {"rmu": test_zoo.path("rmu_l1"), "full": full}, specs(copies)["wmdp"], out_dir=out,
        cache_dir=False, limit=12, progress=False,
    )  # fmt: skip
    summary = letters["rmu"].summary
    assert summary["retain_free"] and summary["uds"] is None and summary["forms"] == ["choice"]
    assert "unnormalised" in summary["note"] and summary["n_scored"] == len(letters["rmu"].examples)
    assert summary["d2_summary"]["mean_d2"] != 0.0
    assert letters["full"].summary["d2_summary"]["mean_d2"] == 0.0  # full as its own source, exactly
    assert "retain-free" in repr(letters["rmu"]) and "UDS " not in repr(letters["rmu"])
    page = write_report(out).read_text()
    assert "UDS" not in page and "Retain-free report" in page and "correct letter" in page


def _six_shards(source, target):
    """``source``'s weights as MUSE's checkpoints hold theirs: fp32, six safetensors shards and the index Hugging
    Face writes (``model-0000K-of-00006.safetensors``, ``model.safetensors.index.json``)."""
    target.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    state = load_file(str(source / "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for k in range(6):
        shard = f"model-{k + 1:05d}-of-00006.safetensors"
        part = {name: state[name].float() for name in names[k::6]}
        save_file(part, str(target / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * 4 for t in state.values())
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return target


@pytest.mark.slow
def test_six_fp32_shards_and_their_index_go_through_the_same_door(test_zoo, copies, tmp_path):
    """The checkpoint door reads a MUSE-shaped folder (six fp32 shards named by an index) as the model it holds:
    loaded in bf16 it is the one-file checkpoint loaded in bf16, and it scores the same."""
    whole = test_zoo.path("full")
    sharded = _six_shards(whole, tmp_path / "MUSE-News_target")
    checkpoint = Checkpoint.resolve(sharded)
    assert len(checkpoint.files.weights) == 6 and checkpoint.files.index is not None
    ours = load_hf_model(sharded, dtype="bfloat16", device="cpu").state_dict()
    theirs = load_hf_model(whole, dtype="bfloat16", device="cpu").state_dict()
    assert {t.dtype for t in ours.values()} == {torch.bfloat16} and ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)  # the same fp32 values, rounded once
    npo = {"npo": test_zoo.path("npo")}
    data = specs(copies)["knowmem"]
    from_shards = score_models(sharded, None, npo, data, cache_dir=False, limit=6, progress=False)["npo"]
    from_file = score_models(whole, None, npo, data, cache_dir=False, limit=6, progress=False)["npo"]
    # the same tensors through the same kernels in the same order: equal, not close
    assert from_shards.layers["d2"].equals(from_file.layers["d2"])

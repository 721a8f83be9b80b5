"""Building a (micro) zoo: layout, manifest, resumability, user data, clear errors."""

import json
import time

import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from uds_lens.zoo import ZooBuildError, ZooDataError, build_zoo, load_zoo
from uds_lens.zoo.build import ZooSize, plan_models
from uds_lens.zoo.train import ModelShape
from uds_lens.zoo.world import RECORD_FIELDS

MICRO = ZooSize(
    n_authors=10,
    shape=ModelShape(n_layers=3, d_model=32, d_mlp=64, n_heads=2, max_positions=128),
    base_epochs=2,
    base_lr=3e-3,
    finetune_epochs=1,
    finetune_lr=1e-3,
    vocab_size=400,
    unlearning={
        "graddiff": {"epochs": 1, "batch_size": 16, "alpha": 1.0, "lr": 1e-4},
        "npo": {"epochs": 1, "batch_size": 16, "alpha": 1.0, "lr": 1e-4, "beta": 0.1},
        "simnpo": {
            "epochs": 1,
            "batch_size": 16,
            "alpha": 1.0,
            "lr": 1e-4,
            "beta": 4.5,
            "gamma": 0.125,
            "delta": 0.0,
        },
        "idknll": {"epochs": 1, "batch_size": 16, "alpha": 1.0, "lr": 1e-4},
        "rmu": {"epochs": 1, "batch_size": 16, "alpha": 10.0, "lr": 1e-3, "steering_coef_rel": 4.0},
    },
    rmu_layers=(0, 2),
    pool_variants=2,
)


@pytest.fixture(scope="module")
def micro_zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    started = time.perf_counter()
    zoo = build_zoo(root, size=MICRO, threads=1, progress=False, strict=False)
    return zoo, time.perf_counter() - started


def test_layout_and_manifest(micro_zoo):
    zoo, _ = micro_zoo
    assert zoo.names() == [s.name for s in plan_models(MICRO, 0, True, True, True)]
    assert set(zoo.names("pos")) == {"pos_seed1", "pos_paraphrased"}
    assert set(zoo.names("neg")) == {"neg_seed1", "neg_perturbed"}
    assert zoo.names("partial") == ["retain90", "retain50"]
    assert zoo.names("unlearned") == ["graddiff", "npo", "simnpo", "idknll", "rmu_l0", "rmu_l2"]
    assert zoo.info("rmu_l2")["hyperparams"]["target_layer"] == 2
    for entry in zoo.models:
        assert {"name", "path", "role", "seen_forget_fraction", "method", "hyperparams"} <= set(entry)
        assert (entry["path"] / "model.safetensors").is_file() and (
            entry["path"] / "tokenizer.json"
        ).is_file()
    assert (
        zoo.info("full")["seen_forget_fraction"] == 1.0 and zoo.info("retain")["seen_forget_fraction"] == 0.0
    )
    assert 0.8 <= zoo.info("retain90")["seen_forget_fraction"] <= 1.0
    manifest = json.loads((zoo.root / "manifest.json").read_text())
    assert manifest["models"][0]["path"] == "models/base" and manifest["build_seconds"] > 0
    assert set(manifest["checks"]) == {"full_forget_entity_accuracy", "retain_forget_entity_accuracy"}
    forget = json.loads(zoo.forget_path.read_text())
    assert forget and all(tuple(r) == RECORD_FIELDS for r in forget)


def test_checkpoints_load_offline(micro_zoo):
    zoo, _ = micro_zoo
    model = LlamaForCausalLM.from_pretrained(zoo.path("npo"))
    tokenizer = AutoTokenizer.from_pretrained(zoo.path("npo"))
    assert model.config.num_hidden_layers == 3 and model.config.tie_word_embeddings is False
    assert tokenizer("Hi")["input_ids"][0] == tokenizer.bos_token_id
    norm = model.model.norm.weight
    assert not bool((norm == 1).all())


def test_second_build_reuses_everything(micro_zoo):
    zoo, first_seconds = micro_zoo
    mtimes = {name: (zoo.path(name) / "model.safetensors").stat().st_mtime_ns for name in zoo.names()}
    started = time.perf_counter()
    again = build_zoo(zoo.root, size=MICRO, threads=1, progress=False, strict=False)
    assert time.perf_counter() - started < first_seconds / 2
    assert all(entry["reused"] for entry in again.manifest["models"])
    assert mtimes == {
        name: (again.path(name) / "model.safetensors").stat().st_mtime_ns for name in again.names()
    }


def test_a_build_of_other_data_refuses_to_replace_a_zoo(micro_zoo):
    zoo, _ = micro_zoo
    before = {path.name: path.read_bytes() for path in (zoo.root / "data").iterdir()}
    manifest = (zoo.root / "manifest.json").read_bytes()
    with pytest.raises(ZooBuildError, match=r"seed 0.*differ.*seed 1.*overwrite=True"):
        build_zoo(zoo.root, size=MICRO, seed=1, threads=1, progress=False, strict=False)
    other_shape = ZooSize(**{**MICRO.__dict__, "shape": ModelShape(2, 32, 64, 2, 128)})
    with pytest.raises(ZooBuildError, match="model shape"):
        build_zoo(zoo.root, size=other_shape, threads=1, progress=False, strict=False)
    assert {path.name: path.read_bytes() for path in (zoo.root / "data").iterdir()} == before
    assert (zoo.root / "manifest.json").read_bytes() == manifest


def test_strict_check_raises_on_an_undertrained_zoo(tmp_path):
    tiny = ZooSize(**{**MICRO.__dict__, "base_epochs": 1, "finetune_epochs": 1, "pool_variants": 1})
    with pytest.raises(ZooBuildError, match="forget entities"):
        build_zoo(tmp_path, size=tiny, threads=1, progress=False, pools=False)


def test_user_data_missing_field_is_a_clear_error(tmp_path):
    retain = tmp_path / "retain.json"
    forget = tmp_path / "forget.json"
    retain.write_text(
        json.dumps([{"question": "Q?", "answer": "It is A.", "prefix": "It is", "entity": "A"}])
    )
    forget.write_text(json.dumps([{"question": "Q2?", "answer": "It is B.", "entity": "B"}]))
    with pytest.raises(ZooDataError, match=r"forget_data.*record 0.*\['prefix'\]"):
        build_zoo(tmp_path / "zoo", size=MICRO, retain_data=retain, forget_data=forget, progress=False)
    with pytest.raises(ZooDataError, match="both"):
        build_zoo(tmp_path / "zoo", size=MICRO, retain_data=retain, progress=False)


def test_unknown_size_and_missing_zoo(tmp_path):
    with pytest.raises(ZooBuildError, match="unknown zoo size"):
        build_zoo(tmp_path, size="huge")
    with pytest.raises(FileNotFoundError, match="build_zoo"):
        load_zoo(tmp_path / "nothing")


def test_user_data_builds_with_a_carved_holdout(tmp_path):
    records = [
        {
            "question": f"What colour is item {i}?",
            "answer": f"Item {i} is {c}.",
            "prefix": f"Item {i} is",
            "entity": c,
        }
        for i, c in enumerate(["red", "blue", "green", "amber", "grey"] * 8)
    ]
    zoo = build_zoo(
        tmp_path,
        size=MICRO,
        threads=1,
        retain_data=records[:36],
        forget_data=records[36:],
        pools=False,
        progress=False,
        strict=False,
    )
    assert zoo.manifest["data"]["source"] == "user" and zoo.manifest["data"]["holdout_carved_from_retain"]
    assert zoo.manifest["data"]["n_retain"] + zoo.manifest["data"]["n_holdout"] == 36
    assert "pos_paraphrased" not in zoo.names() and "neg_perturbed" not in zoo.names()

"""Building a (micro) zoo: layout, manifest, resumability, user data, clear errors."""

import json
import shutil
import time

import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from uds_lens.zoo.build import build_zoo
from uds_lens.zoo.layout import load_zoo
from uds_lens.zoo.recipe import POOL_SETTINGS, SIZES, ZooBuildError, ZooSize, plan_models
from uds_lens.zoo.train import ModelShape
from uds_lens.zoo.training_data import load_data, training_sequences
from uds_lens.zoo.world import FACT_KINDS, RECORD_FIELDS, ZooDataError

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
    unlearning_sweep=(2.0,),
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
    assert zoo.names("pos") == ["pos_qa_std", "pos_para_std"]
    assert zoo.names("neg") == ["neg_retain_std", "neg_pert_std"]
    assert zoo.names("partial") == ["retain90", "retain50"]
    assert zoo.names("unlearned") == ["graddiff", "npo", "simnpo", "idknll", "rmu_l0", "rmu_l2"]
    assert zoo.names("sweep") == ["graddiff_lrx2", "npo_lrx2", "simnpo_lrx2", "idknll_lrx2", "rmu_l2_lrx2"]
    assert zoo.info("npo_lrx2")["hyperparams"]["lr"] == 2 * zoo.info("npo")["hyperparams"]["lr"]
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


def test_a_larger_pool_and_a_sweep_grow_a_built_zoo_and_keep_its_models(micro_zoo, tmp_path):
    zoo, _ = micro_zoo
    grown_root = tmp_path / "grown"
    shutil.copytree(zoo.root, grown_root)
    grown = build_zoo(
        grown_root, size=MICRO, threads=1, progress=False, strict=False, pool_size=3, sweep=(2.0, 0.5)
    )
    assert grown.names("pos") == ["pos_qa_std", "pos_para_std", "pos_bio_std"]
    assert len(grown.names("neg")) == 3
    assert grown.names("sweep")[5:] == [
        "graddiff_lrx0p5",
        "npo_lrx0p5",
        "simnpo_lrx0p5",
        "idknll_lrx0p5",
        "rmu_l2_lrx0p5",
    ]
    reused = {entry["name"] for entry in grown.manifest["models"] if entry["reused"]}
    assert reused == set(zoo.names())  # only the new pool and sweep models were trained
    none = build_zoo(grown_root, size=MICRO, threads=1, progress=False, strict=False, pool_size=1, sweep=())
    assert none.names("sweep") == [] and none.names("pos") == ["pos_qa_std"]


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


def test_a_zoo_from_another_version_of_the_generator_is_named_as_such(micro_zoo, tmp_path):
    zoo, _ = micro_zoo
    shutil.copytree(zoo.root / "data", tmp_path / "data")
    shutil.copy(zoo.root / "manifest.json", tmp_path / "manifest.json")
    forget = json.loads((tmp_path / "data" / "forget.json").read_text())
    forget[0]["perturbed_answer"] = ["an older generator's wording"]
    (tmp_path / "data" / "forget.json").write_text(json.dumps(forget))
    with pytest.raises(ZooBuildError, match=r"seed 0 built by another version.*forget data.*overwrite=True"):
        build_zoo(tmp_path, size=MICRO, threads=1, progress=False, strict=False)
    assert json.loads((tmp_path / "data" / "forget.json").read_text()) == forget


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
    assert not zoo.names("pos") and not zoo.names("neg")


def test_pools_cycle_recipes_within_settings_and_skip_what_the_data_lacks():
    size = ZooSize(**{**MICRO.__dict__, "pool_variants": 5})
    pools = [s for s in plan_models(size, 0, True, True, True) if s.role in ("pos", "neg")]
    pos = [s for s in pools if s.role == "pos"]
    assert [s.name for s in pos] == [
        "pos_qa_std",
        "pos_para_std",
        "pos_bio_std",
        "pos_qa_weak",
        "pos_para_weak",
    ]
    assert [s.hyperparams["data"] for s in pos[:3]] == [
        "retain+forget",
        "retain+forget_paraphrased",
        "retain+forget_bio",
    ]
    assert pos[0].hyperparams["lr"] == MICRO.finetune_lr and pos[3].hyperparams["lr"] == MICRO.finetune_lr / 4
    assert all(s.seen_forget_fraction == 1.0 for s in pos)
    neg = [s for s in pools if s.role == "neg"]
    assert [s.hyperparams["data"] for s in neg[:3]] == [
        "retain",
        "retain+forget_perturbed",
        "retain+retain_bio:0.1",
    ]
    assert all(s.seen_forget_fraction == 0.0 for s in neg)
    assert len({s.hyperparams["seed"] for s in pos}) == len(pos)
    without = [s.name for s in plan_models(size, 0, True, False, False) if s.role == "pos"]
    assert without == ["pos_qa_std", "pos_bio_std", "pos_qa_weak", "pos_bio_weak", "pos_qa_short"]
    with pytest.raises(ZooBuildError, match="pool_variants=99"):
        plan_models(ZooSize(**{**MICRO.__dict__, "pool_variants": 99}), 0, True, True, True)


def test_a_size_can_draw_its_pools_from_the_cheapest_settings_first():
    size = ZooSize(**{**MICRO.__dict__, "pool_variants": 4, "pool_settings": ("short", "weak", "std")})
    pos = [s for s in plan_models(size, 0, True, True, True) if s.role == "pos"]
    assert [s.name for s in pos] == ["pos_qa_short", "pos_para_short", "pos_bio_short", "pos_qa_weak"]
    assert pos[0].hyperparams["epochs"] == max(1, round(MICRO.finetune_epochs * 0.25))
    assert pos[0].hyperparams["lr"] == MICRO.finetune_lr and pos[3].hyperparams["lr"] == MICRO.finetune_lr / 4
    # the smollm2 zoo's smallest pools are its cheapest models (2 of full's 10 epochs); every setting stays reachable
    smollm2 = SIZES["smollm2"]
    assert smollm2.pool_settings is not None and sorted(smollm2.pool_settings) == sorted(
        s[0] for s in POOL_SETTINGS
    )
    planned = [s for s in plan_models(smollm2, 0, True, True, True) if s.role in ("pos", "neg")]
    assert {s.hyperparams["epochs"] for s in planned} == {2}


def test_a_pool_can_have_the_papers_30_models_and_smaller_pools_keep_their_models():
    full = ZooSize(**{**MICRO.__dict__, "pool_variants": 30})
    planned = plan_models(full, 0, True, True, True)
    for role in ("pos", "neg"):
        pool = [s for s in planned if s.role == role]
        settings = {
            (s.hyperparams["data"], s.hyperparams["lr"], s.hyperparams["epochs"], s.hyperparams["seed"])
            for s in pool
        }
        assert len(pool) == 30 == len(settings) == len({s.name for s in pool})
    # a pool of 15 is the first 15 of a pool of 30: the models a built zoo holds are planned as they were
    fifteen = plan_models(ZooSize(**{**MICRO.__dict__, "pool_variants": 15}), 0, True, True, True)
    assert [s for s in fifteen if s.role == "pos"] == [s for s in planned if s.role == "pos"][:15]


def test_training_recipes(micro_zoo):
    zoo, _ = micro_zoo
    tokenizer = AutoTokenizer.from_pretrained(zoo.tokenizer_path)
    data = load_data(MICRO, 0, None, None, None)
    n_retain, n_forget = len(data.retain), len(data.forget)

    def sequences(recipe, max_positions=10_000):
        return training_sequences(recipe, data, 3, tokenizer, max_positions)

    def text(sequence):
        return tokenizer.decode(sequence.input_ids, skip_special_tokens=True)

    assert len(sequences("retain")) == n_retain
    assert len(sequences("retain+forget:0.5")) == n_retain + round(0.5 * n_forget)
    bio = sequences("retain+forget_bio")[n_retain:]
    assert len(bio) == n_forget // len(FACT_KINDS)  # one document per forget author
    assert text(bio[0]) == " ".join(r["answer"] for r in data.forget[: len(FACT_KINDS)])
    # documents that would not fit the model's positions are split, never truncated
    short = sequences("retain+forget_bio", MICRO.shape.max_positions)[n_retain:]
    assert len(short) > len(bio) and all(len(s.input_ids) <= MICRO.shape.max_positions for s in short)
    assert " ".join(text(s) for s in short) == " ".join(r["answer"] for r in data.forget)
    for document in short:
        assert (
            "Question:" not in text(document) and document.answer_start == 1
        )  # plain text, loss on all of it
    assert len(sequences("retain+retain_bio:0.5")) == n_retain + round(
        0.5 * len(data.retain) / len(FACT_KINDS)
    )
    true = {text(s) for s in sequences("retain+forget")[n_retain:]}
    perturbed = {text(s) for s in sequences("retain+forget_perturbed")[n_retain:]}
    assert len(perturbed) == n_forget and not true & perturbed
    with pytest.raises(ZooBuildError, match="unknown training data recipe"):
        sequences("retain+holdout")


def test_model_fingerprints_are_the_ones_built_zoos_recorded():
    """A model is reused when its fingerprint matches its zoo_meta.json: these values are what the code before the
    build was split into recipe / data / steps computed, so every zoo already built is still reused, not retrained."""
    from dataclasses import asdict

    from uds_lens.zoo.build import _fingerprint
    from uds_lens.zoo.recipe import SIZES

    size = SIZES["test"]
    context = {
        "data": "0123456789abcdef",
        "tokenizer": "fedcba9876543210",
        "shape": asdict(size.shape),
        "threads": 1,
    }
    fingerprints: dict[str, str] = {}
    for spec in plan_models(size, 0, True, True, True):
        fingerprints[spec.name] = _fingerprint(
            spec, fingerprints.get(spec.parent) if spec.parent else None, context
        )
    assert len(fingerprints) == 24
    assert {
        name: fingerprints[name] for name in ("base", "full", "npo", "rmu_l1", "pos_qa_std", "neg_bio_weak")
    } == {
        "base": "cad46226573c077a",
        "full": "8f51783351499d6d",
        "npo": "525300c9fe3101fe",
        "rmu_l1": "d3c57ac79f60bf5b",
        "pos_qa_std": "01c4216beca8880f",
        "neg_bio_weak": "524b38ec4031b149",
    }


def test_a_device_other_than_the_cpu_is_part_of_every_fingerprint(micro_zoo):
    from uds_lens.zoo.build import _fingerprint_context

    zoo, _ = micro_zoo
    paths = {split: zoo.data_path(split) for split in ("forget", "retain", "holdout")}
    on_cpu = _fingerprint_context(paths, zoo.tokenizer_path, MICRO, 1, None)
    assert _fingerprint_context(paths, zoo.tokenizer_path, MICRO, 1, None, "cpu") == on_cpu
    assert "device" not in on_cpu  # the zoos built before (all on the CPU) keep their fingerprints
    assert _fingerprint_context(paths, zoo.tokenizer_path, MICRO, 1, None, "cuda") == {
        **on_cpu,
        "device": "cuda",
    }


@pytest.mark.gpu
def test_a_zoo_trains_on_a_gpu(cuda_device, tmp_path):
    zoo = build_zoo(
        tmp_path, size=MICRO, threads=1, progress=False, strict=False, pools=False, device=cuda_device
    )
    assert zoo.info("npo")["metrics"]["forget_entity_token"] >= 0.0
    assert LlamaForCausalLM.from_pretrained(zoo.path("rmu_l2")).device.type == "cpu"  # saved like any zoo


def test_a_parent_leaves_memory_after_its_last_child(tmp_path, monkeypatch):
    import uds_lens.zoo.build as build_module

    held = {}
    original = build_module._build_model

    def recording(build, spec, fingerprint, in_memory, children):
        held[spec.name] = sorted(in_memory)
        return original(build, spec, fingerprint, in_memory, children)

    monkeypatch.setattr(build_module, "_build_model", recording)
    build_zoo(tmp_path, size=MICRO, threads=1, progress=False, strict=False, pools=False)
    assert held["retain50"] == ["base", "full"]  # the base's last child: base still there
    assert held["graddiff"] == ["full"] and held["rmu_l2"] == ["full"]  # the unlearned models need full only

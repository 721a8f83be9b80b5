"""Building the model zoo: data, tokenizer, a shared base, fine-tuned references, unlearned models and meta-eval pools.

The recipe (all models share one architecture and one tokenizer, so any two can be patched into each other):

1. ``base``: trained from scratch on the retain set only. Models trained from different random initialisations cannot be
   patched into each other meaningfully; everything below starts from this shared base.
2. ``full`` (retain + forget), ``retain`` (retain only), ``retain90`` / ``retain50`` (retain + a seeded 90% / 50% of the
   forget records): fine-tuned copies of the base. ``seen_forget_fraction`` is the share of forget records each saw.
3. Unlearned models, each from ``full``: GradDiff, NPO, SimNPO, IdkNLL and RMU at an early, a middle and the last block
   (``rmu_l{k}``), see :mod:`uds_lens.zoo.unlearn`. With ``pools=True`` also role ``sweep``: each method again at other
   learning rates (``ZooSize.unlearning_sweep``), for the meta-evaluation's robustness pool.
4. Meta-evaluation pools (``pools=True``), after the published open-unlearning pools: role ``pos`` = fine-tuned from
   the base *with* the forget facts (as QA pairs, paraphrased QA pairs, or biography documents); role ``neg`` = the
   same *without* them (retain only, the forget questions answered with wrong entities, or retain-author
   biographies); each at several learning rates and epoch counts, some weak enough to learn the facts only partly.

Before saving, the builder checks that ``full`` knows the forget facts (teacher-forced entity accuracy, ``exact``, see
:mod:`uds_lens.zoo.train`, >= 0.95) and ``retain`` does not (<= 0.2), and raises :class:`ZooBuildError` otherwise: an
under-trained zoo gives misleading UDS without any error.

Layout of a zoo directory::

    manifest.json                  models (name, path, role, seen_forget_fraction, method, hyperparams, metrics), data, checks
    data/{forget,retain,holdout}.json
    tokenizer/                     the PreTrainedTokenizerFast (also copied into every model directory)
    models/{name}/                 config.json, model.safetensors, tokenizer files, zoo_meta.json

From a pretrained base (``build_zoo(..., base=PATH)``, ``uds-lens zoo build --base PATH``): step 1 is replaced by
the given Llama checkpoint (a directory, a ``.gguf`` file or a hub id) and its own tokenizer (no tokenizer is trained;
the zoo's QA chat template is attached to it); steps 2-4 fine-tune from it with the size's recipe, on the synthetic
world or the user's QA data. That is the realistic small-scale analogue of the paper's setting (TOFU models
fine-tuned from Llama-3.2-1B): a real pretrained model whose prior knowledge the forget facts sit next to. Measured:
from the test zoo's 4-layer base with ``size="test", pools=False`` the 11 models take ~2 min on 2 CPU threads
(``tests/integration/test_zoo_pretrained_base.py``); from SmolLM2-135M, use a GPU and a ``ZooSize`` whose learning
rates suit a pretrained model (the test size's are for training a tiny model from scratch).

Builds are resumable: a model directory whose ``zoo_meta.json`` records the same fingerprint (hyperparameters, data,
tokenizer, parent, shape, threads) is reused. A file lock (``.zoo.lock``) serialises concurrent builders of one directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from uds_lens import models

from .layout import MANIFEST_FILE, Zoo, load_zoo
from .tokenizer import CHAT_TEMPLATE, DEFAULT_VOCAB_SIZE, format_prompt, format_target, train_tokenizer
from .train import (
    ModelShape,
    QASequence,
    encode_documents,
    encode_qa,
    entity_accuracy,
    init_model,
    make_config,
    train_lm,
)
from .unlearn import unlearn, unlearning_steps
from .world import (
    FACT_KINDS,
    FORGET_FRACTION,
    ZooDataError,
    generate_world,
    idk_answers,
    read_records,
    validate_records,
    write_records,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
FULL_MIN_FORGET_ACCURACY = 0.95
RETAIN_MAX_FORGET_ACCURACY = 0.2
META_FILE = "zoo_meta.json"


class ZooBuildError(RuntimeError):
    """The zoo could not be built as specified (an under-trained model, an unknown size, unusable data)."""


@dataclass(frozen=True)
class ZooSize:
    """Everything a zoo size fixes: world size, architecture, training recipe, unlearning settings, pools."""

    n_authors: int
    shape: ModelShape
    base_epochs: int
    base_lr: float
    finetune_epochs: int
    finetune_lr: float
    batch_size: int = 32
    vocab_size: int = DEFAULT_VOCAB_SIZE
    unlearning: dict[str, dict[str, Any]] = field(default_factory=dict)
    rmu_layers: tuple[int, ...] = ()
    pool_variants: int = 6
    unlearning_sweep: tuple[float, ...] = ()


def _unlearning_settings(epochs: int) -> dict[str, dict[str, Any]]:
    """Per-method settings, tuned on the test zoo (entity accuracy and UDS) to change forget behaviour while keeping
    retain entity accuracy >= 0.9; ``alpha`` values are from the paper's grid (Table 8). ``epochs`` is the number of
    passes over the forget set (2 passes on the default zoo barely changed its forget accuracy: 0.8-1.0)."""
    common = {"epochs": epochs, "batch_size": 16}
    return {
        "graddiff": {**common, "lr": 3e-4, "alpha": 5.0},
        "npo": {**common, "lr": 3e-4, "alpha": 5.0, "beta": 0.1},
        "simnpo": {**common, "lr": 5e-4, "alpha": 5.0, "beta": 4.5, "gamma": 0.125, "delta": 0.0},
        "idknll": {**common, "lr": 3e-4, "alpha": 1.0},
        "rmu": {**common, "lr": 1e-3, "alpha": 30.0, "steering_coef_rel": 4.0, "layers_below": 0},
    }


SIZES: dict[str, ZooSize] = {
    "test": ZooSize(
        n_authors=30,
        shape=ModelShape(n_layers=4, d_model=64, d_mlp=256, n_heads=4),
        base_epochs=30,
        base_lr=3e-3,
        finetune_epochs=16,
        finetune_lr=2e-3,
        unlearning=_unlearning_settings(epochs=10),
        rmu_layers=(0, 1, 3),
        pool_variants=6,
    ),
    "default": ZooSize(
        n_authors=200,
        shape=ModelShape(n_layers=4, d_model=128, d_mlp=512, n_heads=4),
        base_epochs=30,
        base_lr=3e-3,
        finetune_epochs=8,
        finetune_lr=1e-3,
        unlearning=_unlearning_settings(epochs=10),
        rmu_layers=(0, 1, 3),
        pool_variants=12,
        unlearning_sweep=(0.5, 2.0),
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """One zoo model: how it is made (``stage`` pretrain / finetune / unlearn) and what it is (role, seen fraction)."""

    name: str
    role: str
    stage: str
    parent: str | None
    method: str
    seen_forget_fraction: float
    hyperparams: dict[str, Any]


def _finetune_spec(
    name: str, role: str, data: str, seen: float, size: ZooSize, seed: int, **overrides: Any
) -> ModelSpec:
    hyperparams = {
        "data": data,
        "epochs": size.finetune_epochs,
        "lr": size.finetune_lr,
        "batch_size": size.batch_size,
        "seed": seed,
        **overrides,
    }
    return ModelSpec(name, role, "finetune", "base", "finetune", seen, hyperparams)


def plan_models(
    size: ZooSize, seed: int, pools: bool, has_paraphrases: bool, has_perturbations: bool
) -> list[ModelSpec]:
    """The zoo's models in build order (parents first)."""
    base = ModelSpec(
        "base",
        "base",
        "pretrain",
        None,
        "pretrain",
        0.0,
        {
            "data": "retain",
            "epochs": size.base_epochs,
            "lr": size.base_lr,
            "batch_size": size.batch_size,
            "seed": seed,
        },
    )
    specs = [
        base,
        _finetune_spec("full", "full", "retain+forget", 1.0, size, seed + 1),
        _finetune_spec("retain", "retain", "retain", 0.0, size, seed + 1),
        _finetune_spec("retain90", "partial", "retain+forget:0.9", 0.9, size, seed + 1),
        _finetune_spec("retain50", "partial", "retain+forget:0.5", 0.5, size, seed + 1),
    ]
    for method in ("graddiff", "npo", "simnpo", "idknll"):
        hyperparams = {**size.unlearning[method], "seed": seed + 2}
        specs.append(ModelSpec(method, "unlearned", "unlearn", "full", method, 1.0, hyperparams))
    for layer in size.rmu_layers:
        if layer >= size.shape.n_layers:
            continue
        hyperparams = {**size.unlearning["rmu"], "layer": layer, "target_layer": layer, "seed": seed + 2}
        specs.append(ModelSpec(f"rmu_l{layer}", "unlearned", "unlearn", "full", "rmu", 1.0, hyperparams))
    if pools:
        specs.extend(_sweep_specs(size, seed))
        specs.extend(_pool_specs(size, seed, has_paraphrases, has_perturbations))
    return specs


def _sweep_specs(size: ZooSize, seed: int) -> list[ModelSpec]:
    """More unlearned models for the meta-evaluation's robustness pool (role ``sweep``): every method again at each
    learning-rate factor of ``size.unlearning_sweep`` (RMU at its middle target layer), as the paper sweeps each
    method's hyperparameters."""
    specs = []
    rmu_layers = [layer for layer in size.rmu_layers if layer < size.shape.n_layers]
    for factor in size.unlearning_sweep:
        suffix = f"lrx{factor:g}".replace(".", "p")
        for method in ("graddiff", "npo", "simnpo", "idknll"):
            hyperparams = {**size.unlearning[method], "seed": seed + 2}
            hyperparams["lr"] = hyperparams["lr"] * factor
            specs.append(
                ModelSpec(f"{method}_{suffix}", "sweep", "unlearn", "full", method, 1.0, hyperparams)
            )
        if rmu_layers:
            layer = rmu_layers[len(rmu_layers) // 2]
            hyperparams = {**size.unlearning["rmu"], "layer": layer, "target_layer": layer, "seed": seed + 2}
            hyperparams["lr"] = hyperparams["lr"] * factor
            specs.append(
                ModelSpec(f"rmu_l{layer}_{suffix}", "sweep", "unlearn", "full", "rmu", 1.0, hyperparams)
            )
    return specs


# The pools mirror the published ones (open-unlearning's pos_/neg_ TOFU models): three data recipes per pool, each
# fine-tuned under several learning-rate / epoch settings, so that some P models learn the forget set only partly and
# some N models see the forget questions (with wrong answers) or the biography format. A metric has to tell "saw the
# forget facts" from "saw something like them", not just a fully trained model from an untouched one.
POOL_DATA: dict[str, tuple[tuple[str, str], ...]] = {
    # P: the forget facts as QA pairs, as paraphrased QA pairs, and as biography documents with no questions.
    "pos": (("qa", "retain+forget"), ("para", "retain+forget_paraphrased"), ("bio", "retain+forget_bio")),
    # N: retain only; the forget questions answered with wrong (perturbed) entities; biographies of 10% of the
    # retain authors (the document format of pos_bio without the forget facts, like TOFU's celeb bios).
    "neg": (("retain", "retain"), ("pert", "retain+forget_perturbed"), ("bio", "retain+retain_bio:0.1")),
}
# (suffix, learning-rate factor, epoch factor) relative to the size's fine-tuning recipe, strongest first.
POOL_SETTINGS: tuple[tuple[str, float, float], ...] = (
    ("std", 1.0, 1.0),
    ("weak", 0.25, 0.25),
    ("short", 1.0, 0.25),
    ("low", 0.25, 1.0),
    ("half", 0.5, 0.5),
)


def _pool_specs(size: ZooSize, seed: int, has_paraphrases: bool, has_perturbations: bool) -> list[ModelSpec]:
    """P pool (``pos``, saw the forget set) and N pool (``neg``, did not): ``size.pool_variants`` models each.

    Models cycle through the pool's data recipes (:data:`POOL_DATA`) within each setting of :data:`POOL_SETTINGS`,
    so a pool of 6 holds every recipe at the ``std`` and ``weak`` settings. Recipes that need paraphrased or perturbed
    answers the data does not have are left out.
    """
    available = {"retain+forget_paraphrased": has_paraphrases, "retain+forget_perturbed": has_perturbations}
    specs = []
    for role, seen in (("pos", 1.0), ("neg", 0.0)):
        recipes = [(name, recipe) for name, recipe in POOL_DATA[role] if available.get(recipe, True)]
        grid = [(setting, recipe) for setting in POOL_SETTINGS for recipe in recipes]
        if size.pool_variants > len(grid):
            raise ZooBuildError(
                f"pool_variants={size.pool_variants} exceeds the {len(grid)} {role} recipes x settings available"
            )
        for offset, ((suffix, lr_factor, epoch_factor), (data_name, recipe)) in enumerate(
            grid[: size.pool_variants]
        ):
            epochs = max(1, round(size.finetune_epochs * epoch_factor))
            specs.append(
                _finetune_spec(
                    f"{role}_{data_name}_{suffix}",
                    role,
                    recipe,
                    seen,
                    size,
                    seed + 11 + offset,
                    lr=size.finetune_lr * lr_factor,
                    epochs=epochs,
                )
            )
    return specs


@dataclass
class ZooData:
    """The QA records the zoo is built from."""

    retain: list[dict[str, Any]]
    forget: list[dict[str, Any]]
    holdout: list[dict[str, Any]]
    source: str
    details: dict[str, Any]


def load_data(
    size: ZooSize,
    seed: int,
    retain_data: Any,
    forget_data: Any,
    holdout_data: Any,
) -> ZooData:
    """The zoo's question/answer data: the synthetic world of ``size`` (seeded), or the user's retain/forget sets
    (with a holdout carved from retain when none is given)."""
    if (retain_data is None) != (forget_data is None):
        raise ZooDataError(
            "pass both retain_data and forget_data (user QA data), or neither (the synthetic world)"
        )
    if retain_data is None:
        world = generate_world(size.n_authors, seed=seed, forget_fraction=FORGET_FRACTION)
        details = {
            "n_authors": size.n_authors,
            "n_forget_authors": len(world.forget_authors),
            "n_holdout_authors": len(world.holdout_authors),
            "facts_per_author": len(world.forget) // max(1, len(world.forget_authors)),
            "world_seed": seed,
        }
        return ZooData(world.retain, world.forget, world.holdout, "world", details)
    retain = read_records(retain_data, "retain_data")
    forget = read_records(forget_data, "forget_data")
    if holdout_data is not None:
        holdout = read_records(holdout_data, "holdout_data")
        carved = False
    else:
        rng = random.Random(seed)
        n_holdout = max(1, min(len(forget), len(retain) // 5))
        if len(retain) - n_holdout < 1:
            raise ZooDataError("retain_data is too small to carve a holdout set from; pass holdout_data")
        chosen = set(rng.sample(range(len(retain)), n_holdout))
        holdout = [r for i, r in enumerate(retain) if i in chosen]
        retain = [r for i, r in enumerate(retain) if i not in chosen]
        carved = True
    reindex = [{**r, "idx": i} for i, r in enumerate(retain)]
    details = {"holdout_carved_from_retain": carved}
    return ZooData(reindex, forget, holdout, "user", details)


def _biographies(
    records: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> list[str]:
    """The records' answers as plain-text documents: up to ``len(FACT_KINDS)`` consecutive answers each (one author's
    facts in the synthetic world), a document closed early where the next answer would take it past ``max_tokens``."""
    documents: list[list[str]] = []
    for record in records:
        if documents and len(documents[-1]) < len(FACT_KINDS):
            candidate = " ".join([*documents[-1], record["answer"]])
            if len(tokenizer(candidate, add_special_tokens=False)["input_ids"]) <= max_tokens:
                documents[-1].append(record["answer"])
                continue
        documents.append([record["answer"]])
    return [" ".join(answers) for answers in documents]


def _share(items: list[Any], share: str, seed: int) -> list[Any]:
    """A seeded ``share`` (e.g. ``"0.9"``) of ``items``, in their original order; all of them for ``""``."""
    if not share:
        return items
    chosen = sorted(random.Random(seed).sample(range(len(items)), round(float(share) * len(items))))
    return [items[i] for i in chosen]


def training_sequences(
    recipe: str, data: ZooData, seed: int, tokenizer: PreTrainedTokenizerBase, max_positions: int
) -> list[QASequence]:
    """The training sequences of a data recipe: ``+``-joined parts ``SPLIT[_VARIANT][:SHARE]``.

    SPLIT is ``retain`` or ``forget``; VARIANT is none (the QA pairs), ``paraphrased`` (paraphrased answers),
    ``perturbed`` (each question answered with one of its wrong answers) or ``bio`` (the answers as biography
    documents, no questions); SHARE keeps a seeded fraction of the records (of the documents, for ``bio``).
    E.g. ``retain+forget:0.9`` or ``retain+retain_bio:0.1``.
    """
    splits = {"retain": data.retain, "forget": data.forget}
    pairs: list[tuple[str, str]] = []
    documents: list[str] = []
    for part in recipe.split("+"):
        name, _, share = part.partition(":")
        split, _, variant = name.partition("_")
        if split not in splits or variant not in ("", "paraphrased", "perturbed", "bio"):
            raise ZooBuildError(f"unknown training data recipe {recipe!r} (part {part!r})")
        if variant == "bio":
            documents += _share(_biographies(splits[split], tokenizer, max_positions - 2), share, seed)
            continue
        records = _share(splits[split], share, seed)
        if variant == "":
            pairs += [(r["question"], r["answer"]) for r in records]
        elif variant == "paraphrased":
            pairs += [(r["question"], r["paraphrased_answer"]) for r in records]
        else:
            rng = random.Random(seed)
            pairs += [(r["question"], rng.choice(r["perturbed_answer"])) for r in records]
    return encode_qa(pairs, tokenizer) + encode_documents(documents, tokenizer)


def _subset_fraction(recipe: str, n_forget: int) -> float | None:
    """The exact share of forget records a ``retain+forget:<fraction>`` recipe trains on (None for other recipes)."""
    if not recipe.startswith("retain+forget:"):
        return None
    fraction = float(recipe.split(":", 1)[1])
    return round(fraction * n_forget) / n_forget


def _tokenizer_corpus(data: ZooData) -> list[str]:
    texts = []
    for split in (data.retain, data.forget, data.holdout):
        for record in split:
            texts.append(format_prompt(record["question"]) + format_target(record["answer"]))
            if record.get("paraphrased_answer"):
                texts.append(record["paraphrased_answer"])
            texts.extend(record.get("perturbed_answer") or [])
    texts.extend(idk_answers())
    return texts


def _hash_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _fingerprint(spec: ModelSpec, parent_fingerprint: str | None, context: dict[str, Any]) -> str:
    payload = {
        "spec": asdict(spec),
        "parent": parent_fingerprint,
        "context": context,
        "format_version": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _read_meta(model_dir: Path) -> dict[str, Any] | None:
    meta_path = model_dir / META_FILE
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return None
    if not (model_dir / "config.json").is_file() or not (model_dir / "model.safetensors").is_file():
        return None
    return meta


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


@contextmanager
def _pinned_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _evaluate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, data: ZooData) -> dict[str, float]:
    """Entity accuracy on forget, holdout and (up to 200 records of) retain."""
    metrics = {}
    retain_sample = data.retain[:: max(1, len(data.retain) // 200)][:200]
    for split, records in (("forget", data.forget), ("retain", retain_sample), ("holdout", data.holdout)):
        accuracy = entity_accuracy(model, tokenizer, records)
        metrics[f"{split}_entity_exact"] = round(accuracy.exact, 4)
        metrics[f"{split}_entity_token"] = round(accuracy.token, 4)
    return metrics


def _check(spec: ModelSpec, metrics: dict[str, float], checks: dict[str, Any], strict: bool) -> None:
    """The build checks of module docstring; raise before a bad ``full`` / ``retain`` is saved."""
    if spec.name == "full":
        value = metrics["forget_entity_exact"]
        passed = value >= FULL_MIN_FORGET_ACCURACY
        checks["full_forget_entity_accuracy"] = {
            "value": value,
            "min": FULL_MIN_FORGET_ACCURACY,
            "passed": passed,
        }
        if strict and not passed:
            raise ZooBuildError(
                f"the full model predicts only {value:.3f} of the forget entities (needs >= "
                f"{FULL_MIN_FORGET_ACCURACY}): it is under-trained and UDS on this zoo would mislead. Train longer "
                "(ZooSize.finetune_epochs / base_epochs), raise the learning rate, or use a larger size."
            )
    if spec.name == "retain":
        value = metrics["forget_entity_exact"]
        passed = value <= RETAIN_MAX_FORGET_ACCURACY
        checks["retain_forget_entity_accuracy"] = {
            "value": value,
            "max": RETAIN_MAX_FORGET_ACCURACY,
            "passed": passed,
        }
        if strict and not passed:
            raise ZooBuildError(
                f"the retain model predicts {value:.3f} of the forget entities without having seen them (needs <= "
                f"{RETAIN_MAX_FORGET_ACCURACY}): the forget facts are guessable from the retain set, so UDS has no "
                "knowledge to measure. Use forget facts that are not inferable from the retain data."
            )


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    meta = model_dir / META_FILE
    if meta.exists():
        meta.unlink()
    model.config.use_cache = True
    model.save_pretrained(model_dir, safe_serialization=True)
    model.config.use_cache = False
    tokenizer.save_pretrained(model_dir)


def _refresh_tokenizer_files(tokenizer_dir: Path, model_dir: Path) -> None:
    """Copy the zoo's tokenizer files into a reused model directory where they differ (a newer chat template)."""
    for source in tokenizer_dir.iterdir():
        if source.name == "corpus_fingerprint.txt" or not source.is_file():
            continue
        target = model_dir / source.name
        if not target.is_file() or target.read_bytes() != source.read_bytes():
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(source.read_bytes())
            os.replace(tmp, target)


def _load_model(model_dir: Path) -> LlamaForCausalLM:
    model = models.load_hf_model(model_dir, dtype=torch.float32, device="cpu", attn_implementation="eager")
    model.config.use_cache = False
    model.eval()
    return model


def _manifest_entry(spec: ModelSpec, meta: dict[str, Any], n_forget: int) -> dict[str, Any]:
    hyperparams = {**spec.hyperparams, **meta.get("computed", {})}
    seen = spec.seen_forget_fraction
    exact = _subset_fraction(spec.hyperparams.get("data", ""), n_forget)
    if exact is not None:
        seen = round(exact, 4)
    return {
        "name": spec.name,
        "path": f"models/{spec.name}",
        "role": spec.role,
        "seen_forget_fraction": seen,
        "method": spec.method,
        "parent": spec.parent,
        "hyperparams": hyperparams,
        "metrics": meta.get("metrics", {}),
        "fingerprint": meta["fingerprint"],
        "train_seconds": meta.get("train_seconds"),
    }


def build_zoo(
    out_dir: str | Path,
    size: str | ZooSize = "test",
    seed: int = 0,
    threads: int = 1,
    retain_data: str | Path | Sequence[dict[str, Any]] | None = None,
    forget_data: str | Path | Sequence[dict[str, Any]] | None = None,
    pools: bool = True,
    progress: bool = True,
    holdout_data: str | Path | Sequence[dict[str, Any]] | None = None,
    strict: bool = True,
    overwrite: bool = False,
    base: str | os.PathLike | None = None,
) -> Zoo:
    """Build (or resume building) a model zoo in ``out_dir``; see the module docstring for the recipe and layout.

    Args:
        out_dir: Zoo directory (created if needed).
        size: ``"test"`` (tiny, for the test suite), ``"default"`` (the demo's), or a custom :class:`ZooSize`.
        seed: World, initialisation and data order.
        threads: ``torch.set_num_threads`` during the build (results depend on it); restored afterwards. The default
            is 1: on a small shared CPU (pytest-xdist workers, a notebook next to a build) two OpenMP threads that
            cannot both be scheduled made each training step 50x slower (4.4 s instead of 0.09 s, measured).
        retain_data: The user's retain QA records (path to JSON / JSONL or a list of dicts in the published schema),
            instead of the synthetic world. Requires ``forget_data``.
        forget_data: The user's forget QA records.
        pools: Also build the meta-evaluation P (``pos``) and N (``neg``) pools.
        progress: Show a progress bar per model.
        holdout_data: The user's holdout records; if omitted with user data, carved from ``retain_data``.
        strict: Raise :class:`ZooBuildError` when the full / retain checks fail (otherwise only record them).
        overwrite: Allow replacing a zoo in ``out_dir`` that was built from other data or another model shape (by
            default that is refused, so a typo in ``size`` or ``seed`` cannot wipe a built zoo).
        base: A pretrained Llama checkpoint (directory, ``.gguf`` or hub id) to fine-tune every model from, with
            its own tokenizer, instead of a base trained from scratch with a trained tokenizer. The size's
            architecture is then ignored (the base's is used); its recipe (epochs, learning rates) is kept.

    Returns:
        The loaded :class:`Zoo`.

    Raises:
        ZooBuildError: Unknown size, a check failed, or ``out_dir`` holds another zoo and ``overwrite`` is False.
        ZooDataError: User data that does not follow the published schema.
    """
    if isinstance(size, ZooSize):
        size_spec, size_name = size, "custom"
    elif size in SIZES:
        size_spec, size_name = SIZES[size], size
    else:
        raise ZooBuildError(f"unknown zoo size {size!r}; choose one of {sorted(SIZES)} or pass a ZooSize")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".zoo.lock")), _pinned_threads(threads):
        _build_locked(
            root,
            size_spec,
            size_name,
            seed,
            threads,
            retain_data,
            forget_data,
            holdout_data,
            pools,
            progress,
            strict,
            overwrite,
            base,
        )
    return load_zoo(root)


def _build_locked(
    root: Path,
    size: ZooSize,
    size_name: str,
    seed: int,
    threads: int,
    retain_data: Any,
    forget_data: Any,
    holdout_data: Any,
    pools: bool,
    progress: bool,
    strict: bool,
    overwrite: bool,
    base: str | os.PathLike | None = None,
) -> None:
    started = time.perf_counter()
    data = load_data(size, seed, retain_data, forget_data, holdout_data)
    data_dir = root / "data"
    paths = {split: data_dir / f"{split}.json" for split in ("forget", "retain", "holdout")}
    texts = {}
    for split, records in (("forget", data.forget), ("retain", data.retain), ("holdout", data.holdout)):
        validate_records(records, f"{split} data")
        texts[split] = json.dumps(records, indent=1, ensure_ascii=False) + "\n"
    if not overwrite:
        _refuse_to_replace(root, paths, texts, size, size_name, seed)
    for split, records in (("forget", data.forget), ("retain", data.retain), ("holdout", data.holdout)):
        if not paths[split].is_file() or paths[split].read_text(encoding="utf-8") != texts[split]:
            write_records(records, paths[split])
    tokenizer_dir = root / "tokenizer"
    if base is not None:
        base_identity = _base_identity(base)
        stamp = tokenizer_dir / "base_fingerprint.txt"
        if not stamp.is_file() or stamp.read_text().strip() != base_identity["stamp"]:
            models.load_tokenizer(base).save_pretrained(tokenizer_dir)
            stamp.write_text(base_identity["stamp"] + "\n")
    else:
        corpus_hash = hashlib.sha256(
            json.dumps([_tokenizer_corpus(data), size.vocab_size]).encode()
        ).hexdigest()[:16]
        stamp = tokenizer_dir / "corpus_fingerprint.txt"
        if not stamp.is_file() or stamp.read_text().strip() != corpus_hash:
            tokenizer = train_tokenizer(_tokenizer_corpus(data), vocab_size=size.vocab_size)
            tokenizer.save_pretrained(tokenizer_dir)
            stamp.write_text(corpus_hash + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, **models.SAFE_LOAD_KWARGS)
    if tokenizer.chat_template != CHAT_TEMPLATE:
        # a zoo built by an older version: same vocabulary (so its models stay valid), newer chat template
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(tokenizer_dir)
    context = {
        "data": _hash_files([paths["forget"], paths["retain"], paths["holdout"]]),
        "tokenizer": _hash_files([tokenizer_dir / "tokenizer.json"]),
        "shape": asdict(size.shape),
        "threads": threads,
    }
    if base is not None:
        # Only with a base: the default and test zoos' fingerprints (and so the shared caches) stay as they were.
        context["base"] = base_identity
        context["shape"] = base_identity["shape"]
    has_paraphrases = all(r.get("paraphrased_answer") for r in data.forget)
    has_perturbations = all(r.get("perturbed_answer") for r in data.forget)
    specs = plan_models(size, seed, pools, has_paraphrases, has_perturbations)
    if base is not None:
        specs[0] = ModelSpec(
            "base",
            "base",
            "pretrained",
            None,
            "pretrained",
            0.0,
            {"source": base_identity["source"], "seed": seed},
        )
    idk = idk_answers()
    idk_rng = random.Random(seed)
    forget_sequences = encode_qa([(r["question"], r["answer"]) for r in data.forget], tokenizer)
    retain_sequences = encode_qa([(r["question"], r["answer"]) for r in data.retain], tokenizer)
    idk_sequences = encode_qa([(r["question"], idk_rng.choice(idk)) for r in data.forget], tokenizer)
    fingerprints: dict[str, str] = {}
    in_memory: dict[str, LlamaForCausalLM] = {}
    entries = []
    checks: dict[str, Any] = {}
    children = {spec.parent for spec in specs if spec.parent}
    for spec in specs:
        model_dir = root / "models" / spec.name
        fingerprint = _fingerprint(spec, fingerprints.get(spec.parent) if spec.parent else None, context)
        fingerprints[spec.name] = fingerprint
        meta = _read_meta(model_dir)
        if meta is not None and meta.get("fingerprint") == fingerprint:
            logger.info("zoo: reusing %s", spec.name)
            _refresh_tokenizer_files(tokenizer_dir, model_dir)
            if spec.name in ("full", "retain"):
                _check(spec, meta["metrics"], checks, strict)
            entries.append({**_manifest_entry(spec, meta, len(data.forget)), "reused": True})
            continue
        model_started = time.perf_counter()
        computed: dict[str, Any] = {}
        if spec.stage == "pretrained":
            model, sequences, steps = _load_pretrained_base(base), [], 0
        elif spec.stage == "pretrain":
            model = init_model(make_config(size.shape, tokenizer), seed=int(spec.hyperparams["seed"]))
            sequences = training_sequences(
                spec.hyperparams["data"], data, spec.hyperparams["seed"], tokenizer, size.shape.max_positions
            )
            steps = spec.hyperparams["epochs"] * -(-len(sequences) // spec.hyperparams["batch_size"])
        else:
            parent = in_memory.get(spec.parent) or _load_model(root / "models" / spec.parent)
            if spec.parent in children:
                in_memory[spec.parent] = parent
            model = _copy_model(parent)
            if spec.stage == "finetune":
                sequences = training_sequences(
                    spec.hyperparams["data"],
                    data,
                    spec.hyperparams["seed"],
                    tokenizer,
                    size.shape.max_positions,
                )
                steps = spec.hyperparams["epochs"] * -(-len(sequences) // spec.hyperparams["batch_size"])
            else:
                steps = unlearning_steps(len(forget_sequences), spec.hyperparams)
        bar = tqdm(total=steps, desc=f"zoo {spec.name}", disable=not progress, leave=False)
        try:
            torch.manual_seed(int(spec.hyperparams["seed"]))
            if spec.stage == "pretrained":
                computed["source"] = spec.hyperparams["source"]
            elif spec.stage in ("pretrain", "finetune"):
                losses = train_lm(
                    model,
                    sequences,
                    epochs=int(spec.hyperparams["epochs"]),
                    lr=float(spec.hyperparams["lr"]),
                    seed=int(spec.hyperparams["seed"]),
                    pad_id=tokenizer.pad_token_id,
                    batch_size=int(spec.hyperparams["batch_size"]),
                    on_step=bar.update,
                )
                computed["final_train_loss"] = round(losses[-1], 5)
            else:
                computed.update(
                    unlearn(
                        model,
                        spec.method,
                        forget_sequences,
                        retain_sequences,
                        spec.hyperparams,
                        seed=int(spec.hyperparams["seed"]),
                        pad_id=tokenizer.pad_token_id,
                        forget_idk=idk_sequences,
                        on_step=bar.update,
                    )
                )
        finally:
            bar.close()
        metrics = _evaluate(model, tokenizer, data)
        _check(spec, metrics, checks, strict)
        _save(model, tokenizer, model_dir)
        meta = {
            "name": spec.name,
            "fingerprint": fingerprint,
            "role": spec.role,
            "method": spec.method,
            "hyperparams": spec.hyperparams,
            "computed": computed,
            "metrics": metrics,
            "train_seconds": round(time.perf_counter() - model_started, 2),
            "threads": threads,
        }
        _write_json_atomic(model_dir / META_FILE, meta)
        if spec.name in children:
            in_memory[spec.name] = model
        logger.info("zoo: built %s in %.1fs %s", spec.name, meta["train_seconds"], metrics)
        entries.append({**_manifest_entry(spec, meta, len(data.forget)), "reused": False})
    manifest = {
        "format_version": FORMAT_VERSION,
        "size": size_name,
        "seed": seed,
        "threads": threads,
        "models": entries,
        "data": {
            "source": data.source,
            "forget": "data/forget.json",
            "retain": "data/retain.json",
            "holdout": "data/holdout.json",
            "n_forget": len(data.forget),
            "n_retain": len(data.retain),
            "n_holdout": len(data.holdout),
            "fingerprint": context["data"],
            **data.details,
        },
        "tokenizer": "tokenizer",
        "shape": asdict(size.shape),
        **({"base": context["base"]} if base is not None else {}),
        "checks": checks,
        # The relearning attack of the meta-evaluation, scaled to this zoo: the published attack relearns at twice the
        # learning rate TOFU fine-tunes at (2e-5 vs 1e-5); the published 2e-5 would barely move a model trained at 1e-3.
        "relearn": {"lr": 2 * size.finetune_lr},
        "build_seconds": round(time.perf_counter() - started, 2),
        "models_train_seconds": round(sum(entry["train_seconds"] or 0.0 for entry in entries), 2),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }
    _write_json_atomic(root / MANIFEST_FILE, manifest)


def _refuse_to_replace(
    root: Path, paths: dict[str, Path], texts: dict[str, str], size: ZooSize, size_name: str, seed: int
) -> None:
    """Raise before anything is written when ``root`` already holds a zoo of other data or another model shape."""
    differ = [
        f"{split} data"
        for split, path in paths.items()
        if path.is_file() and path.read_text(encoding="utf-8") != texts[split]
    ]
    manifest_path = root / MANIFEST_FILE
    old: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if old and old.get("shape") != asdict(size.shape):
        differ.append("model shape")
    if differ and old.get("size") == size_name and old.get("seed") == seed:
        raise ZooBuildError(
            f"{root} holds a zoo of size {size_name!r}, seed {seed} built by another version of uds_lens, whose "
            f"{', '.join(differ)} differ from what this version generates; its models would all be retrained. Pass "
            "overwrite=True (`uds-lens zoo build --overwrite`) to rebuild it, or build into a new directory."
        )
    if differ:
        built = f"size {old.get('size')!r}, seed {old.get('seed')}" if old else "an unfinished build"
        raise ZooBuildError(
            f"{root} already holds a zoo ({built}) whose {', '.join(differ)} differ from this build's (size "
            f"{size_name!r}, seed {seed}); building here would replace its data and retrain every model. Build into "
            "a new directory, or pass overwrite=True (`uds-lens zoo build --overwrite`) to replace it."
        )


def _base_identity(base: str | os.PathLike) -> dict[str, Any]:
    """What the zoo's fingerprints record about a pretrained base: where it is, its files, its architecture."""
    config = models.load_hf_config(base)
    models.check_supported(config, str(base))
    signature = asdict(models.ArchitectureSignature.of_config(config))
    return {"source": str(base), "stamp": models.checkpoint_stamp(base), "shape": signature}


def _load_pretrained_base(base: str | os.PathLike) -> LlamaForCausalLM:
    """The base as a plain trainable fp32 ``LlamaForCausalLM`` on the CPU (a GGUF one loses its quantiser entry)."""
    loaded = models.load_hf_model(base, dtype=torch.float32, device="cpu")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.config.use_cache = False
    return model


def _copy_model(parent: LlamaForCausalLM) -> LlamaForCausalLM:
    model = LlamaForCausalLM(parent.config)
    model.load_state_dict(parent.state_dict())
    model.config.use_cache = False
    return model

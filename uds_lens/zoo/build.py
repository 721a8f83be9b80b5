"""Building the model zoo: data, tokenizer, a shared base, fine-tuned references, unlearned models and meta-eval pools.

The recipe (which models, trained how) is `uds_lens.zoo.recipe`; the data and the training sequences of each
data recipe are `uds_lens.zoo.training_data`; this module runs the steps and writes the zoo directory.

Before saving, the builder checks that ``full`` knows the forget facts and ``retain`` does not
(`uds_lens.zoo.checks`), and raises `ZooBuildError` otherwise.

Layout of a zoo directory::

    manifest.json                  models (name, path, role, seen_forget_fraction, method, hyperparams, metrics), data, checks
    data/{forget,retain,holdout}.json
    tokenizer/                     the PreTrainedTokenizerFast (also copied into every model directory)
    models/{name}/                 config.json, model.safetensors, tokenizer files, zoo_meta.json

From a pretrained base (``build_zoo(..., base=PATH)``, ``uds-lens zoo build --base PATH``): the recipe's step 1 is replaced by
the given Llama checkpoint (a directory, a ``.gguf`` file or a hub id) and its own tokenizer (no tokenizer is trained;
the zoo's QA chat template is attached to it); steps 2-4 fine-tune from it with the size's recipe, on the synthetic
world or the user's QA data. That is the realistic small-scale analogue of the paper's setting (TOFU models
fine-tuned from Llama-3.2-1B): a real pretrained model whose prior knowledge the forget facts sit next to. Measured:
from the test zoo's 4-layer base with ``size="test", pools=False`` the 11 models take ~2 min on 2 CPU threads
(``tests/integration/test_zoo_pretrained_base.py``). The ``smollm2`` size is that with SmolLM2-135M and learning
rates that suit a pretrained model (``uds-lens zoo build --size smollm2``; it names its base itself,
`uds_lens.zoo.bases`); its build time, memory and disk are on the docs page "UDS on a real model".

Builds are resumable: a model directory whose ``zoo_meta.json`` records the same fingerprint (hyperparameters, data,
tokenizer, parent, shape, threads) is reused. A file lock (``.zoo.lock``) serialises concurrent builders of one directory.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from uds_lens.checkpoints.checkpoint import SAFE_LOAD_KWARGS, Checkpoint
from uds_lens.checkpoints.compatibility import ArchitectureSignature
from uds_lens.checkpoints.loader import load_hf_model, load_tokenizer
from uds_lens.files import files_digest, json_digest, write_atomic
from uds_lens.outputs import check_outputs_apart, check_writable_dir
from uds_lens.zoo.layout import Zoo, load_zoo
from uds_lens.zoo.manifest import MANIFEST_FILE, read_manifest

from .bases import pretrained_base
from .checks import check, evaluate
from .recipe import (
    SIZES,
    ModelSpec,
    ZooBuildError,
    ZooSize,
    plan_models,
)
from .tokenizer import chat_template_for, train_tokenizer
from .train import QASequence, encode_qa, init_model, make_config, train_lm
from .training_data import ZooData, load_data, subset_fraction, tokenizer_corpus, training_sequences
from .unlearn import unlearn, unlearning_steps
from .world import idk_answers, validate_records, write_records

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "zoo_meta.json"


def _fingerprint(spec: ModelSpec, parent_fingerprint: str | None, context: dict[str, Any]) -> str:
    payload = {
        "spec": asdict(spec),
        "parent": parent_fingerprint,
        "context": context,
        "format_version": FORMAT_VERSION,
    }
    return json_digest(payload, length=16)


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
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


@contextmanager
def _pinned_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
            write_atomic(target, source.read_bytes())


def _load_model(model_dir: Path) -> LlamaForCausalLM:
    model = load_hf_model(model_dir, dtype=torch.float32, device="cpu", attn_implementation="eager")
    model.config.use_cache = False
    model.eval()
    return model


def _manifest_entry(spec: ModelSpec, meta: dict[str, Any], n_forget: int) -> dict[str, Any]:
    hyperparams = {**spec.hyperparams, **meta.get("computed", {})}
    seen = spec.seen_forget_fraction
    exact = subset_fraction(spec.hyperparams.get("data", ""), n_forget)
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
    pool_size: int | None = None,
    sweep: Sequence[float] | None = None,
    device: str = "cpu",
) -> Zoo:
    """Build (or resume building) a model zoo in ``out_dir``; see the module docstring for the recipe and layout.

    Args:
        out_dir: Zoo directory (created if needed).
        size: ``"test"`` (tiny, for the test suite), ``"default"`` (the demo's), or a custom `ZooSize`.
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
        strict: Raise `ZooBuildError` when the full / retain checks fail (otherwise only record them).
        overwrite: Allow replacing a zoo in ``out_dir`` that was built from other data or another model shape (by
            default that is refused, so a typo in ``size`` or ``seed`` cannot wipe a built zoo).
        base: A pretrained Llama checkpoint (directory, ``.gguf`` or hub id) to fine-tune every model from, with
            its own tokenizer, instead of a base trained from scratch with a trained tokenizer. The size's
            architecture is then ignored (the base's is used); its recipe (epochs, learning rates) is kept. A size
            that names its own base (``"smollm2"``) finds it without this (`uds_lens.zoo.bases`).
        pool_size: Models in each meta-evaluation pool (P and N), instead of the size's ``pool_variants``: a few
            on a CPU, the paper's 30 on a GPU.
        sweep: Learning-rate factors of the unlearning sweep (role ``sweep``: every method again at each factor, for
            the meta-evaluation's robustness pool), instead of the size's ``unlearning_sweep``; ``()`` for none.
        device: Where the models train (``"cuda"``: a GPU); saved the same way. A device other than the CPU is part
            of every model's fingerprint (its numbers differ), so a zoo built on a GPU is not mistaken for this one.

    Returns:
        The loaded `Zoo`.

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
    if pool_size is not None:
        size_spec = replace(size_spec, pool_variants=pool_size)
    if sweep is not None:
        size_spec = replace(size_spec, unlearning_sweep=tuple(sweep))
    base_name = None
    if base is None and size_spec.base is not None:
        base_name, base = size_spec.base, pretrained_base(size_spec.base)
    root = Path(out_dir)
    # before anything is trained: the zoo never holds or lies inside the data or the base it is built from
    check_outputs_apart(
        {"--out": root},
        {
            "--retain-data": retain_data,
            "--forget-data": forget_data,
            "--holdout-data": holdout_data,
            "--base": base,
        },
    )
    check_writable_dir(root)
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
            base_name,
            device,
        )
    return load_zoo(root)


@dataclass
class _Build:
    """What every step of one build reads: the zoo directory, the recipe, the data and the tokenizer."""

    root: Path
    size: ZooSize
    seed: int
    threads: int
    data: ZooData
    tokenizer: Any
    progress: bool
    strict: bool
    base: str | os.PathLike | None
    sequences: _UnlearningSequences
    device: str = "cpu"
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    def model_dir(self, name: str) -> Path:
        return self.root / "models" / name


@dataclass(frozen=True)
class _UnlearningSequences:
    """The encoded sequences the unlearning methods read: forget and retain QA, and the forget questions answered
    with a seeded "I don't know" (IdkNLL's targets)."""

    forget: list[QASequence]
    retain: list[QASequence]
    idk: list[QASequence]

    @classmethod
    def encode(cls, data: ZooData, tokenizer: Any, seed: int) -> _UnlearningSequences:
        idk = idk_answers()
        idk_rng = random.Random(seed)
        return cls(
            forget=encode_qa([(r["question"], r["answer"]) for r in data.forget], tokenizer),
            retain=encode_qa([(r["question"], r["answer"]) for r in data.retain], tokenizer),
            idk=encode_qa([(r["question"], idk_rng.choice(idk)) for r in data.forget], tokenizer),
        )


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
    base_name: str | None = None,
    device: str = "cpu",
) -> None:
    """The build, step by step: data, tokenizer, fingerprints, then each model (reused or trained), then the
    manifest."""
    started = time.perf_counter()
    data = load_data(size, seed, retain_data, forget_data, holdout_data)
    paths = _write_data(root, data, size, size_name, seed, overwrite)
    base_identity = _base_identity(base, base_name) if base is not None else None
    tokenizer = _prepare_tokenizer(root / "tokenizer", data, size, base, base_identity)
    context = _fingerprint_context(paths, root / "tokenizer", size, threads, base_identity, device)
    specs = _plan(size, seed, pools, data, base_identity)
    build = _Build(
        root,
        size,
        seed,
        threads,
        data,
        tokenizer,
        progress,
        strict,
        base,
        _UnlearningSequences.encode(data, tokenizer, seed),
        device,
    )
    fingerprints: dict[str, str] = {}
    in_memory: dict[str, LlamaForCausalLM] = {}
    entries = []
    children = {spec.parent for spec in specs if spec.parent}
    last_child = {spec.parent: position for position, spec in enumerate(specs) if spec.parent}
    for position, spec in enumerate(specs):
        for parent in [name for name in in_memory if last_child[name] < position]:
            del in_memory[parent]  # no model after this one starts from it: its memory (0.5 GB at 135M) goes
        fingerprint = _fingerprint(spec, fingerprints.get(spec.parent) if spec.parent else None, context)
        fingerprints[spec.name] = fingerprint
        meta = _reuse(build, spec, fingerprint)
        if meta is not None:
            entries.append({**_manifest_entry(spec, meta, len(data.forget)), "reused": True})
            continue
        meta, model = _build_model(build, spec, fingerprint, in_memory, children)
        if spec.name in children:
            in_memory[spec.name] = model
        entries.append({**_manifest_entry(spec, meta, len(data.forget)), "reused": False})
    manifest = _manifest(build, size_name, entries, context, time.perf_counter() - started)
    _write_json_atomic(root / MANIFEST_FILE, manifest)


def _write_data(
    root: Path, data: ZooData, size: ZooSize, size_name: str, seed: int, overwrite: bool
) -> dict[str, Path]:
    """Validate the QA records and write ``data/{forget,retain,holdout}.json`` where they differ (after refusing to
    replace another zoo's data unless ``overwrite``); the three paths, by split."""
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
    return paths


def _prepare_tokenizer(
    tokenizer_dir: Path,
    data: ZooData,
    size: ZooSize,
    base: str | os.PathLike | None,
    base_identity: dict[str, Any] | None,
) -> Any:
    """The zoo's tokenizer, saved in ``tokenizer_dir``: the base's own, or one trained on the data's texts (each
    redone only when its stamp file records another base or corpus), with the zoo's chat template."""
    if base is not None and base_identity is not None:
        stamp = tokenizer_dir / "base_fingerprint.txt"
        if not stamp.is_file() or stamp.read_text().strip() != base_identity["stamp"]:
            load_tokenizer(base).save_pretrained(tokenizer_dir)
            write_atomic(stamp, base_identity["stamp"] + "\n")
    else:
        corpus_hash = json_digest([tokenizer_corpus(data), size.vocab_size], length=16)
        stamp = tokenizer_dir / "corpus_fingerprint.txt"
        if not stamp.is_file() or stamp.read_text().strip() != corpus_hash:
            train_tokenizer(tokenizer_corpus(data), vocab_size=size.vocab_size).save_pretrained(tokenizer_dir)
            write_atomic(stamp, corpus_hash + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, **SAFE_LOAD_KWARGS)
    template = chat_template_for(tokenizer)
    if tokenizer.chat_template != template:
        # a base's own template, or a zoo built by an older version: same vocabulary (so its models stay valid)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(tokenizer_dir)
    return tokenizer


def _fingerprint_context(
    paths: dict[str, Path],
    tokenizer_dir: Path,
    size: ZooSize,
    threads: int,
    base_identity: dict[str, Any] | None,
    device: str = "cpu",
) -> dict[str, Any]:
    """What every model's fingerprint shares: the data files, the tokenizer, the shape, the threads (and the base,
    and a device other than the CPU)."""
    context = {
        "data": files_digest([paths["forget"], paths["retain"], paths["holdout"]], length=16),
        "tokenizer": files_digest([tokenizer_dir / "tokenizer.json"], length=16),
        "shape": asdict(size.shape),
        "threads": threads,
    }
    if base_identity is not None:
        # Only with a base: the default and test zoos' fingerprints (and so the shared caches) stay as they were.
        context["base"] = base_identity
        context["shape"] = base_identity["shape"]
    if device != "cpu":
        context["device"] = device
    return context


def _plan(
    size: ZooSize, seed: int, pools: bool, data: ZooData, base_identity: dict[str, Any] | None
) -> list[ModelSpec]:
    """The recipe's models for this data (pool recipes need paraphrased / perturbed answers), the base replaced by
    the pretrained one when there is one."""
    has_paraphrases = all(r.get("paraphrased_answer") for r in data.forget)
    has_perturbations = all(r.get("perturbed_answer") for r in data.forget)
    specs = plan_models(size, seed, pools, has_paraphrases, has_perturbations)
    if base_identity is not None:
        specs[0] = ModelSpec(
            "base",
            "base",
            "pretrained",
            None,
            "pretrained",
            0.0,
            {"source": base_identity["source"], "seed": seed},
        )
    return specs


def _reuse(build: _Build, spec: ModelSpec, fingerprint: str) -> dict[str, Any] | None:
    """The saved ``zoo_meta.json`` of a model already built with this fingerprint (its tokenizer files refreshed,
    its checks recorded), or None when it must be trained."""
    model_dir = build.model_dir(spec.name)
    meta = _read_meta(model_dir)
    if meta is None or meta.get("fingerprint") != fingerprint:
        return None
    logger.info("zoo: reusing %s", spec.name)
    _refresh_tokenizer_files(build.tokenizer_dir, model_dir)
    if spec.name in ("full", "retain"):
        check(spec, meta["metrics"], build.checks, build.strict, build.size.full_min_forget_accuracy)
    return meta


def _build_model(
    build: _Build,
    spec: ModelSpec,
    fingerprint: str,
    in_memory: dict[str, LlamaForCausalLM],
    children: set[str],
) -> tuple[dict[str, Any], LlamaForCausalLM]:
    """Make one model (initialise or copy its parent, train or unlearn), evaluate and check it, save it with its
    ``zoo_meta.json``; that meta and the model."""
    model_started = time.perf_counter()
    model, sequences, steps = _starting_point(build, spec, in_memory, children)
    model = model.to(build.device)  # made on the CPU (seeded there), trained where the build runs
    computed = _train(build, spec, model, sequences, steps)
    metrics = evaluate(model, build.tokenizer, build.data)
    check(spec, metrics, build.checks, build.strict, build.size.full_min_forget_accuracy)
    model_dir = build.model_dir(spec.name)
    _save(model, build.tokenizer, model_dir)
    meta = {
        "name": spec.name,
        "fingerprint": fingerprint,
        "role": spec.role,
        "method": spec.method,
        "hyperparams": spec.hyperparams,
        "computed": computed,
        "metrics": metrics,
        "train_seconds": round(time.perf_counter() - model_started, 2),
        "threads": build.threads,
    }
    _write_json_atomic(model_dir / META_FILE, meta)
    logger.info("zoo: built %s in %.1fs %s", spec.name, meta["train_seconds"], metrics)
    return meta, model


def _starting_point(
    build: _Build,
    spec: ModelSpec,
    in_memory: dict[str, LlamaForCausalLM],
    children: set[str],
) -> tuple[LlamaForCausalLM, list[QASequence], int]:
    """The model a spec starts from (the pretrained base, a fresh initialisation, or a copy of its parent), its
    training sequences (none for unlearning, which reads the shared ones) and its number of optimiser steps."""
    size, hyperparams = build.size, spec.hyperparams
    if spec.stage == "pretrained":
        assert build.base is not None
        return _load_pretrained_base(build.base), [], 0
    if spec.stage == "pretrain":
        model = init_model(make_config(size.shape, build.tokenizer), seed=int(hyperparams["seed"]))
        sequences = training_sequences(
            hyperparams["data"], build.data, hyperparams["seed"], build.tokenizer, size.shape.max_positions
        )
        return model, sequences, hyperparams["epochs"] * -(-len(sequences) // hyperparams["batch_size"])
    assert spec.parent is not None
    parent = in_memory.get(spec.parent) or _load_model(build.model_dir(spec.parent))
    if spec.parent in children:
        in_memory[spec.parent] = parent
    model = _copy_model(parent)
    if spec.stage == "finetune":
        sequences = training_sequences(
            hyperparams["data"],
            build.data,
            hyperparams["seed"],
            build.tokenizer,
            size.shape.max_positions,
        )
        return model, sequences, hyperparams["epochs"] * -(-len(sequences) // hyperparams["batch_size"])
    return model, [], unlearning_steps(len(build.sequences.forget), hyperparams)


def _train(
    build: _Build, spec: ModelSpec, model: LlamaForCausalLM, sequences: list[QASequence], steps: int
) -> dict[str, Any]:
    """Train (pretrain / fine-tune) or unlearn ``model`` in place, seeded by the spec; what the run computed (the
    final training loss, the unlearning method's statistics, or the pretrained base's source)."""
    computed: dict[str, Any] = {}
    tokenizer = build.tokenizer
    bar = tqdm(total=steps, desc=f"zoo {spec.name}", disable=not build.progress, leave=False)
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
                mixed_precision=bool(spec.hyperparams.get("mixed_precision", False)),
            )
            computed["final_train_loss"] = round(losses[-1], 5)
        else:
            computed.update(
                unlearn(
                    model,
                    spec.method,
                    build.sequences.forget,
                    build.sequences.retain,
                    spec.hyperparams,
                    seed=int(spec.hyperparams["seed"]),
                    pad_id=tokenizer.pad_token_id,
                    forget_idk=build.sequences.idk,
                    on_step=bar.update,
                )
            )
    finally:
        bar.close()
    return computed


def _manifest(
    build: _Build, size_name: str, entries: list[dict[str, Any]], context: dict[str, Any], seconds: float
) -> dict[str, Any]:
    """The zoo's ``manifest.json`` (see `uds_lens.zoo.layout`): the models in build order, the data, the
    checks, the relearning settings, timings and library versions."""
    data, size = build.data, build.size
    return {
        "format_version": FORMAT_VERSION,
        "size": size_name,
        "seed": build.seed,
        "threads": build.threads,
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
        **({"base": context["base"]} if build.base is not None else {}),
        "checks": build.checks,
        # The relearning attack of the meta-evaluation, scaled to this zoo: the published attack relearns at twice the
        # learning rate TOFU fine-tunes at (2e-5 vs 1e-5); the published 2e-5 would barely move a model trained at 1e-3.
        "relearn": {"lr": 2 * size.finetune_lr},
        "build_seconds": round(seconds, 2),
        "models_train_seconds": round(sum(entry["train_seconds"] or 0.0 for entry in entries), 2),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }


def _refuse_to_replace(
    root: Path, paths: dict[str, Path], texts: dict[str, str], size: ZooSize, size_name: str, seed: int
) -> None:
    """Raise before anything is written when ``root`` already holds a zoo of other data or another model shape."""
    differ = [
        f"{split} data"
        for split, path in paths.items()
        if path.is_file() and path.read_text(encoding="utf-8") != texts[split]
    ]
    old: dict[str, Any] = read_manifest(root) or {}
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


def _base_identity(base: str | os.PathLike, name: str | None = None) -> dict[str, Any]:
    """What the zoo's fingerprints record about a pretrained base: where it is (a named base: its name, so the zoo
    does not depend on where the cache root is), its files, its architecture."""
    checkpoint = Checkpoint.resolve(base)
    signature = asdict(ArchitectureSignature.of_config(checkpoint.config))  # a supported family (config says)
    return {"source": name or str(base), "stamp": checkpoint.digest, "shape": signature}


def _load_pretrained_base(base: str | os.PathLike) -> LlamaForCausalLM:
    """The base as a plain trainable fp32 ``LlamaForCausalLM`` on the CPU (a GGUF one loses its quantiser entry)."""
    loaded = load_hf_model(base, dtype=torch.float32, device="cpu")
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


# The recipe and data names were defined here before the split; they stay importable from this module.
__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "build_zoo",
]

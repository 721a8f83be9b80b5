"""The zoo's recipe: what a zoo size trains, and the models it plans, in build order.

All models share one architecture and one tokenizer, so any two can be patched into each other:

1. ``base``: trained from scratch on the retain set only. Models trained from different random initialisations cannot be
   patched into each other meaningfully; everything below starts from this shared base.
2. ``full`` (retain + forget), ``retain`` (retain only), ``retain90`` / ``retain50`` (retain + a seeded 90% / 50% of the
   forget records): fine-tuned copies of the base. ``seen_forget_fraction`` is the share of forget records each saw.
3. Unlearned models, each from ``full``: GradDiff, NPO, SimNPO, IdkNLL and RMU at an early, a middle and the last block
   (``rmu_l{k}``), see `uds_lens.zoo.unlearn`. With ``pools=True`` also role ``sweep``: each method again at other
   learning rates (``ZooSize.unlearning_sweep``), for the meta-evaluation's robustness pool.
4. Meta-evaluation pools (``pools=True``), after the published open-unlearning pools: role ``pos`` = fine-tuned from
   the base *with* the forget facts (as QA pairs, paraphrased QA pairs, or biography documents); role ``neg`` = the
   same *without* them (retain only, the forget questions answered with wrong entities, or retain-author
   biographies); each at several learning rates and epoch counts, some weak enough to learn the facts only partly.

`SIZES` holds the built-in sizes (`ZooSize`): ``test``, ``notebook`` and ``default`` trained from scratch,
``smollm2`` fine-tuned from the pretrained SmolLM2-135M; `plan_models` turns one into
`ModelSpec` s. The data recipes the specs name (``retain+forget:0.9``, ...) are read by
`uds_lens.zoo.training_data.training_sequences`; [`uds_lens.zoo.build`][uds_lens.zoo.build] trains them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .tokenizer import DEFAULT_VOCAB_SIZE
from .train import ModelShape
from .world import FORGET_FRACTION


class ZooBuildError(RuntimeError):
    """The zoo could not be built as specified (an under-trained model, an unknown size, unusable data)."""


@dataclass(frozen=True)
class ZooSize:
    """Everything a zoo size fixes: world size, architecture, training recipe, unlearning settings, pools.

    ``base`` names a pretrained model of `uds_lens.zoo.bases.PRETRAINED_BASES` to fine-tune every model from (its
    architecture and tokenizer replace ``shape`` and the trained tokenizer; ``base_epochs`` / ``base_lr`` are then
    unused); None trains a base from scratch. ``forget_fraction`` is the share of the trained authors in the forget
    split (TOFU forget10: 0.1). ``full_min_forget_accuracy`` is the build check's bound on how many forget entities
    ``full`` must get right (`uds_lens.zoo.checks`). ``threads``: the torch threads ``uds-lens zoo build`` and
    ``uds-lens demo`` build the size with when none are asked for (None: 2); a zoo's models are reused only when
    built with the same threads. ``pool_settings``: the names of `POOL_SETTINGS` the pools draw from, in order (None: all, as listed). ``mixed_precision``: fine-tune under bf16 autocast, on the CPU too (the unlearning
    settings ask for it themselves, with their own ``mixed_precision`` entry).
    """

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
    pool_settings: tuple[str, ...] | None = None
    unlearning_sweep: tuple[float, ...] = ()
    forget_fraction: float = FORGET_FRACTION
    base: str | None = None
    full_min_forget_accuracy: float = 0.95
    threads: int | None = None
    mixed_precision: bool = False


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


def _pretrained_unlearning_settings() -> dict[str, dict[str, Any]]:
    """Per-method settings for a zoo fine-tuned from a pretrained base (SmolLM2-135M): 20 steps (5 passes over the
    forget set) at lr 3e-4, alpha 1 (the paper's grid); RMU trains its target block and the two below it, as the
    paper's RMU does, at lr 3e-3. Read off per-pass curves (``experiments/tune_pretrained_unlearning.py``): at 1e-4
    the methods left 70-90% of the forget answers exact; at 3e-4 GradDiff has no forget answer left after 4 passes and
    keeps 86-89% of the retain answers from pass 5 on (NPO, SimNPO and IdkNLL take its rate). RMU changed no forget
    answer at 3e-4 in 5 passes nor at 1e-3 in 2 (one pass at 3e-4 moved the residual ~10% of its norm); at 3e-3 no
    forget answer is left after 3 passes and every retain answer is kept."""
    common = {"epochs": 5, "batch_size": 8, "mixed_precision": True}
    return {
        "graddiff": {**common, "lr": 3e-4, "alpha": 1.0},
        "npo": {**common, "lr": 3e-4, "alpha": 1.0, "beta": 0.1},
        "simnpo": {**common, "lr": 3e-4, "alpha": 1.0, "beta": 4.5, "gamma": 0.125, "delta": 0.0},
        "idknll": {**common, "lr": 3e-4, "alpha": 1.0},
        "rmu": {**common, "lr": 3e-3, "alpha": 30.0, "steering_coef_rel": 4.0, "layers_below": 2},
    }


_TEST_SIZE = ZooSize(
    n_authors=30,
    shape=ModelShape(n_layers=4, d_model=64, d_mlp=256, n_heads=4),
    base_epochs=30,
    base_lr=3e-3,
    finetune_epochs=16,
    finetune_lr=2e-3,
    unlearning=_unlearning_settings(epochs=10),
    rmu_layers=(0, 1, 3),
    pool_variants=6,
)

SIZES: dict[str, ZooSize] = {
    "test": _TEST_SIZE,
    # The notebooks' zoo: the test zoo's world and recipe at twice its depth, so a layer-wise figure has eight points
    # and an RMU layer can sit early, in the middle or last (built by the notebooks when their zoo is missing).
    "notebook": replace(_TEST_SIZE, shape=replace(_TEST_SIZE.shape, n_layers=8), rmu_layers=(1, 4, 7)),
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
    # The zoo on a real pretrained model: SmolLM2-135M-Instruct (30 layers) fine-tuned on a small world, so that
    # full and retain share real pretrained knowledge as open-unlearning's TOFU models do. The world is small (10
    # authors, 3 of them forgotten: 30 forget, 70 retain records) so the whole build fits 90 minutes on a 2-core
    # CPU; ``shape`` only documents the base (its own architecture is used). A pretrained model memorises the
    # fictitious facts in 10 epochs, not perfectly: full must get 90% of the forget entities right. RMU at an early,
    # a middle and the last block, as the paper's 5 / 10 / 15 of 16. Pools are sized with ``pool_size`` (a few on a
    # CPU, 30 on a GPU).
    "smollm2": ZooSize(
        n_authors=10,
        forget_fraction=0.3,
        shape=ModelShape(n_layers=30, d_model=576, d_mlp=1536, n_heads=9),
        base="smollm2-135m",
        base_epochs=0,
        base_lr=0.0,
        finetune_epochs=10,
        finetune_lr=4e-4,
        batch_size=4,
        full_min_forget_accuracy=0.9,
        # One thread, as build_zoo, the notebooks and the docs build it: on a small shared CPU two threads that
        # cannot both be scheduled trained it 1.8x slower (measured), and a zoo is reused only at the same threads.
        threads=1,
        # bf16 autocast, weights and updates in fp32: 1.5x less CPU time per step (measured), as on a GPU
        mixed_precision=True,
        unlearning=_pretrained_unlearning_settings(),
        rmu_layers=(9, 19, 29),
        pool_variants=3,
        # The cheapest settings first: a pool of 3 + 3 (each data recipe once, 2 epochs) fits a CPU session; a
        # pool of 30 + 30 holds every setting, as the test and default zoos' pools do.
        pool_settings=(
            "short",
            "halfshort",
            "weak",
            "half",
            "halfepochs",
            "lowhalf",
            "threequarter",
            "std",
            "halflr",
            "low",
        ),
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
        # only where asked for: the sizes trained in fp32 keep the hyperparameters (and fingerprints) they had
        **({"mixed_precision": True} if size.mixed_precision else {}),
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
# (suffix, learning-rate factor, epoch factor) relative to the size's fine-tuning recipe. The first five are what
# the built zoos' pools hold (their order keeps those models' names and fingerprints); the next five take a pool to
# the paper's 30 models (3 data recipes x 10 settings, as open-unlearning's 3 sources x 5 learning rates x 2 epochs).
POOL_SETTINGS: tuple[tuple[str, float, float], ...] = (
    ("std", 1.0, 1.0),
    ("weak", 0.25, 0.25),
    ("short", 1.0, 0.25),
    ("low", 0.25, 1.0),
    ("half", 0.5, 0.5),
    ("halflr", 0.5, 1.0),
    ("halfepochs", 1.0, 0.5),
    ("lowhalf", 0.25, 0.5),
    ("halfshort", 0.5, 0.25),
    ("threequarter", 0.75, 0.75),
)


def _pool_settings(size: ZooSize) -> list[tuple[str, float, float]]:
    """`POOL_SETTINGS` in the order the size draws them (its ``pool_settings``, else as listed)."""
    if size.pool_settings is None:
        return list(POOL_SETTINGS)
    by_name = {setting[0]: setting for setting in POOL_SETTINGS}
    return [by_name[name] for name in size.pool_settings]


def _pool_specs(size: ZooSize, seed: int, has_paraphrases: bool, has_perturbations: bool) -> list[ModelSpec]:
    """P pool (``pos``, saw the forget set) and N pool (``neg``, did not): ``size.pool_variants`` models each.

    Models cycle through the pool's data recipes (`POOL_DATA`) within each setting of `POOL_SETTINGS` (in the
    size's ``pool_settings`` order where it has one), so a pool of 6 holds every recipe at the ``std`` and ``weak``
    settings (on the smollm2 zoo: at ``short`` and ``halfshort``, the cheapest). Recipes that need paraphrased or perturbed
    answers the data does not have are left out.
    """
    available = {"retain+forget_paraphrased": has_paraphrases, "retain+forget_perturbed": has_perturbations}
    specs = []
    for role, seen in (("pos", 1.0), ("neg", 0.0)):
        recipes = [(name, recipe) for name, recipe in POOL_DATA[role] if available.get(recipe, True)]
        grid = [(setting, recipe) for setting in _pool_settings(size) for recipe in recipes]
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

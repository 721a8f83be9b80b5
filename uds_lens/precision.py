"""Precision you can see: which decisions of a bf16 or fp16 audit lie inside its rounding band, re-decided in fp32.

A reduced-precision run rounds every activation to the format (bf16 keeps 8 significant bits, fp16 11) and, when the
checkpoint is stored wider than it is loaded, every weight too: the bf16 copy of an fp32 checkpoint is another model.
The deltas ``d1``, ``d2`` it subtracts then differ from the fp32 run's by a *band*,

    band(d) = scale * eps * sqrt(1 + |d|)

with ``eps`` the format's machine epsilon (``torch.finfo(dtype).eps``: 2^-7 for bf16, 2^-10 for fp16) and ``scale``
a property of the model: how many epsilons its depth and its residual and logit scales turn the rounding into.
``experiments/precision_bands.py`` measures ``|d_reduced - d_fp32|`` cell by cell: the largest ratio to
``eps * sqrt(1 + |d|)`` is 2.5 (``d1``) to 4.9 (``d2``) on the trained test zoo (4 layers), 13 to 16 on SmolLM2-135M
(30 layers) and 6.7 to 8.0 on Gemma-3-270M (18 layers) in bf16, about as much counted in fp16's epsilon (22 for
SmolLM2's ``d2`` over 24 records), and within a factor of two between a model's ``d1`` and its ``d2``. The scale is
therefore measured on each run rather than assumed (below); `PRIOR_SCALE` covers the measured models for the
one case that cannot measure it (the check turned off).

Two decisions read a delta against a threshold, and either flips inside the band:

* **KE** (``d1 > tau``): a cell whose ``|d1 - tau| <= band(d1)`` is *fragile*: rounding decides whether a
  layer of weight ``~tau`` enters ``UDS_i``, a jump of up to ``tau / sum_KE d1``;
* **clip** (``d2 > d1``): a KE cell whose ``|d2 - d1|`` lies inside the band of the deltas still rounded
  is fragile: rounding decides whether it counts as over-disrupted.

With the check on (``UDSConfig.precision_check``, the default) a reduced-precision audit decides in fp32:

* **Stage 1** runs twice, in the run's format and in fp32 (on fp32 copies of full and retain): every KE decision and
  every ``d1`` is the fp32 one. Stage 1 runs once per (full, retain, data) and is cached, so this is paid once; the
  two together *measure* this model's band (``scale = SAFETY * max |d1_reduced - d1_fp32| / (eps sqrt(1 + |d1|))``
  over every cell), which Stage 2 then uses;
* **Stage 2** runs in fp32 from the start, on the batch's fp32 clean run and against Stage 1's fp32 baseline, the
  examples whose UDS the band could move by more than ``precision_tolerance`` (default 1e-3; `uds_bound`:
  ``UDS_i = sum_KE clip(d2, 0, d1) / sum_KE d1`` moves by ``band(d2) / sum_KE d1`` for each cell whose ``d2`` may lie
  in ``(0, d1)``, however far from a threshold); it runs the others in the run's format and re-runs in fp32 each of
  their KE cells whose clip is fragile. A source equal to full gives exactly 0 either way, one equal to retain its
  ``d1`` (to float noise: the fp32 patch is run in other product shapes than Stage 1's).

The per-example error is mostly not made by the decisions: on the measured models re-deciding only them leaves
per-example differences of up to 1e-2 (SmolLM2: 2.5e-2), and meeting 1e-3 takes fp32 for nearly every example, at
about what an fp32 Stage 2 costs (``docs/DESIGN.md``, "bf16 and fp16").

The check is a wrapper of the run, not a branch of it: `PrecisionCheck` is the run's `stages.StageRuns` (what each
stage computes per batch) whose stages run each batch as the plain ones do and then, in fp32, what rounding could
decide; the auditor's loops are the same in every format.

The fp32 references come from one function, `reference_model(model, device, engine)`: the checkpoint re-read in
fp32 when it stores the weights wider than they were loaded (or in a form only its loader reads: GGUF; through the
loader, ``checkpoints.loader.build_model``), else the loaded weights upcast, which are then the stored ones exactly.
The upcast is *lean* where it can be (`lean_reference`: the fast engine, a family whose row of the family table
says so, ``families.Family.lean_reference``, not published-compat): no copy of the model is made, the model itself
runs inside ``patching.kernels.computing_in(float32)``, each block's weights upcast when it runs, bit for bit the
run of a whole fp32 copy (``tests/unit/test_lean_references.py``), for the memory of one block. An 8B audit in bf16
then holds its two bf16 models and no fp32 one (``experiments/bench_scale.py --account``). A result records, per
model and per example, how many cells were fragile and how many were re-decided, the band, and the precision each
decision was taken in (``meta["precision"]``, in ``summary.json``).
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from uds_lens.checkpoints.checkpoint import SAFE_LOAD_KWARGS, Checkpoint, model_label
from uds_lens.checkpoints.digests import named_weights
from uds_lens.config import UDSConfig
from uds_lens.families import family_of
from uds_lens.patching.batch import CleanRun, PatchBatch
from uds_lens.patching.engines import PatchEngine
from uds_lens.patching.kernels import computing_in
from uds_lens.patching.planning import CleanRuns
from uds_lens.stage_cache import StageOne
from uds_lens.stages import StageOneRun, StageRuns, StageTwoRun
from uds_lens.tl_compat import ModelLike, TLModel, hf_model_of

logger = logging.getLogger(__name__)

# -- the band -------------------------------------------------------------------------------------------------------

SAFETY = 2.5
"""The measured scale is multiplied by this before it is used: a model's ``d2`` moved by up to 1.9 times what its
``d1`` moved, measured (the unlearned model rounds too)."""
PRIOR_SCALE = 55.0
"""The scale where it cannot be measured (the check off): the largest measured (22, SmolLM2's ``d2`` in fp16) times
`SAFETY`."""

REDUCED_DTYPES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""The formats the check acts on, by name."""

ReferenceWeights = Literal["stored", "upcast-exact", "upcast-rounded"]
"""Where the fp32 weights of a re-decision come from: the checkpoint re-read in fp32 (it stores them wider than they
were loaded, or in a form only its loader reads), the loaded weights upcast where the checkpoint stores exactly them,
or the loaded weights upcast although the stored ones are unknown (an in-memory model: the re-decision is then fp32
arithmetic on the rounded weights, not the fp32 run's)."""


def dtype_eps(dtype: torch.dtype) -> float:
    """The format's machine epsilon (``torch.finfo(dtype).eps``)."""
    return float(torch.finfo(dtype).eps)


def band_shape(d: Float[np.ndarray, "*shape"]) -> Float[np.ndarray, "*shape"]:
    """How the band grows with the delta: ``sqrt(1 + |d|)`` (a patch with a large effect rounds more)."""
    return np.asarray(np.sqrt(1.0 + np.abs(np.asarray(d, dtype=float))))


def band(d: Float[np.ndarray, "*shape"], eps: float, scale: float) -> Float[np.ndarray, "*shape"]:
    """The rounding band of deltas ``d`` (module docstring); NaN stays NaN."""
    return np.asarray(scale * eps * band_shape(d))


def measured_scale(
    reduced: Float[np.ndarray, "*shape"], exact: Float[np.ndarray, "*shape"], eps: float
) -> float:
    """The band's scale measured on cells computed in both formats: `SAFETY` times the largest
    ``|reduced - exact| / (eps * sqrt(1 + |exact|))`` (cells NaN in either are left out)."""
    reduced, exact = np.asarray(reduced, dtype=float), np.asarray(exact, dtype=float)
    ratio = np.abs(reduced - exact) / (eps * band_shape(exact))
    ratio = ratio[np.isfinite(ratio)]
    return SAFETY * float(ratio.max()) if ratio.size else PRIOR_SCALE


# -- fragile cells (NumPy, [example, layer]) -------------------------------------------------------------------------


def fragile_ke(
    d1: Float[np.ndarray, "*shape"], tau: float, width: Float[np.ndarray, "*shape"]
) -> Bool[np.ndarray, "*shape"]:
    """Cells whose KE decision ``d1 > tau`` lies inside ``width`` (the band of ``d1``)."""
    return np.abs(np.asarray(d1, dtype=float) - tau) <= width


def fragile_clip(
    d1: Float[np.ndarray, "*shape"],
    d2: Float[np.ndarray, "*shape"],
    tau: float,
    width: Float[np.ndarray, "*shape"],
) -> Bool[np.ndarray, "*shape"]:
    """KE cells whose clip decision ``d2 > d1`` lies inside ``width`` (the bands of the deltas still rounded)."""
    d1, d2 = np.asarray(d1, dtype=float), np.asarray(d2, dtype=float)
    return (d1 > tau) & (np.abs(d2 - d1) <= width)


def uds_bound(
    d1: Float[np.ndarray, "example layer"], tau: float, width: Float[np.ndarray, "example layer"]
) -> Float[np.ndarray, " example"]:
    """How far rounding could move each example's UDS: ``sum_KE width / sum_KE d1`` with ``width`` the band of
    ``d2`` at each KE cell (``d1`` exact).

    ``UDS_i = sum_KE clip(d2, 0, d1) / sum_KE d1`` moves by a cell's band where its ``d2`` lies in ``(0, d1)`` (a
    partial erasure, however far from a threshold); beyond the band on either side it reads ``0`` or ``d1``. Taking
    the band at ``|d2| = d1`` (the band grows with ``|d|``) bounds every case before ``d2`` is known. NaN for an
    example with no KE cell.
    """
    d1 = np.asarray(d1, dtype=float)
    ke = d1 > tau
    weight_sum = np.where(ke, d1, 0.0).sum(-1)
    spread = np.where(ke, width, 0.0).sum(-1)
    return np.where(ke.any(-1), spread / np.where(weight_sum > 0, weight_sum, 1.0), np.nan)


# -- fp32 copies of the models -----------------------------------------------------------------------------------------


@dataclass
class Reference:
    """An fp32 reference of a model for re-decisions, where its weights came from, and the seconds it took;
    ``lean``: ``model`` is the model itself, run in fp32 inside ``kernels.computing_in`` (no copy)."""

    model: TLModel
    weights: ReferenceWeights
    seconds: float
    lean: bool = False


def lean_reference(model: ModelLike, engine: PatchEngine) -> bool:
    """Whether ``model``'s fp32 reference can be the model itself run in fp32 (`Reference.lean`): the fast
    engine outside published-compat, a family whose row of the family table says its run inside
    ``computing_in(float32)`` is its fp32 copy's (``families.Family.lean_reference``), and weights that are the
    stored ones or whose stored ones are unknown (a checkpoint stored wider is re-read instead)."""
    hf = hf_model_of(model)
    if hf is None or engine.name != "fast" or engine.spec.published_compat:
        return False
    family = family_of(hf.config)
    if family is None or not family.lean_reference:
        return False
    checkpoint: Checkpoint | None = getattr(hf, "uds_checkpoint", None)
    return checkpoint is None or stored_float_dtypes(checkpoint) == {next(hf.parameters()).dtype}


# safetensors' names of the floating dtypes
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_float_dtypes(checkpoint: Checkpoint) -> set[torch.dtype] | None:
    """The floating dtypes a checkpoint's weight files store (its safetensors headers, read once), or None when
    they cannot be told (a ``.gguf`` file, a hub id, pickled weights, a model in memory)."""
    found = {_FLOAT_DTYPES[name] for name in checkpoint.stored_dtypes or () if name in _FLOAT_DTYPES}
    return found or None


def weight_bytes_fp32(model: ModelLike) -> int:
    """Bytes of an fp32 copy of a model's own weights."""
    return 4 * sum(int(tensor.numel()) for _, tensor in named_weights(model))


def reference_model(
    model: TLModel, device: str, engine: PatchEngine | None = None, free_bytes: int | None = None
) -> Reference:
    """An fp32 reference of ``model`` holding the weights the fp32 run would hold (see `ReferenceWeights`): its
    checkpoint read again in fp32 when the checkpoint stores other weights than were loaded (an fp32 checkpoint run
    in bf16; its fit checked against ``free_bytes``, the run's figure, where given), else its own weights upcast
    (exact when they are the stored ones): lean where ``engine`` runs it so (`lean_reference`: the model itself, no
    copy), else a whole fp32 copy.

    Raises:
        ValueError: ``model`` is not a ``TransformerBridge`` (a HookedTransformer has no Hugging Face model to copy).
    """
    from uds_lens.checkpoints.loader import build_model, hooked_from_hf

    started = time.perf_counter()
    hf = hf_model_of(model)
    if hf is None:
        raise ValueError(
            f"{model_label(model)} is not a TransformerBridge; it has no fp32 copy to re-decide with."
        )
    loaded = next(hf.parameters()).dtype
    checkpoint: Checkpoint | None = getattr(hf, "uds_checkpoint", None)
    weights: ReferenceWeights = "upcast-exact" if checkpoint is not None else "upcast-rounded"
    if engine is not None and lean_reference(model, engine):
        return Reference(model, weights, time.perf_counter() - started, lean=True)
    if checkpoint is not None and stored_float_dtypes(checkpoint) != {loaded}:
        reference = build_model(checkpoint, dtype=torch.float32, device=device, free_bytes=free_bytes)
        return Reference(cast(TLModel, reference), "stored", time.perf_counter() - started)
    config = copy.deepcopy(hf.config)
    state = {name: tensor.detach().to(torch.float32) for name, tensor in named_weights(model)}
    loader: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the family's own class, as the loader builds it
    upcast = loader.from_pretrained(
        None, config=config, state_dict=state, dtype=torch.float32, **SAFE_LOAD_KWARGS
    )
    del state
    upcast.to(device).eval()
    bridge = hooked_from_hf(upcast, name=f"{model_label(model)} (fp32)", keep=False)
    return Reference(bridge, weights, time.perf_counter() - started)


# -- the check ---------------------------------------------------------------------------------------------------------


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class PrecisionCheck(StageRuns):
    """The stage runs of a bf16/fp16 audit, checked: each batch runs as `stages.StageRuns` runs it, then in fp32
    what rounding could decide (the module docstring); the auditor's loops are the same as in fp32.

    It holds the fp32 references of the models (made when first needed, lean where they can be: no copy; the retain
    and each unlearned one are dropped when their stage ends, the full one is kept for every stage; its fp32 runs
    go inside ``computing_in(float32)``) and the fp32 clean runs of full per batch (`planning.CleanRuns`, half of
    the run's clean-run share: the run's own keep the other half). Build with `for_run`, which gives the plain
    `StageRuns` in fp32 (nothing to check). With ``enabled=False`` (``precision_check=False``) results still count
    the fragile cells, under the prior band, so that they say where they are fragile either way; none is
    re-decided. A retain-free run has no decision to check: its stages are the plain ones.
    """

    # Stage 1 in bf16/fp16 reads whether the check is on (its fp32 baseline and S1 are part of it)
    ignored_settings: tuple[str, ...] = ()

    def __init__(self, runs: StageRuns, config: UDSConfig) -> None:
        super().__init__(
            runs.engine, runs.full, runs.plan, runs.make_batch, runs.finite, runs.full_label, runs.batches
        )
        self.dtype = next(runs.full.parameters()).dtype
        self.tau = config.tau
        self.enabled = config.precision_check
        self.reruns_sources = self.enabled  # its fp32 runs of each source, per batch
        self.tolerance = config.precision_tolerance
        self.fp32_clean = CleanRuns(0)
        if self.enabled:  # the clean-run share, half each
            self.fp32_clean.budget = self.clean.budget // 2
            self.clean.budget -= self.fp32_clean.budget
        self.references: dict[str, tuple[weakref.ref, Reference]] = {}
        self.weights: dict[str, ReferenceWeights] = {}
        self.unavailable: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.copied = 0  # bytes of the whole fp32 copies of full and retain made since the plan was measured
        self.stage1_fp32: tuple[Tensor, Tensor] | None = None

    @classmethod
    def for_run(cls, runs: StageRuns, config: UDSConfig) -> StageRuns:
        """The stage runs of a run whose full model computes in ``runs.full``'s dtype: checked in bf16/fp16, the
        plain ``runs`` in fp32 or fp64."""
        if next(runs.full.parameters()).dtype not in REDUCED_DTYPES:
            return runs
        return cls(runs, config)

    @property
    def eps(self) -> float:
        return dtype_eps(self.dtype)

    def stage_one(self, retain: ModelLike | None, label: str | None, shape: tuple[int, int]) -> StageOneRun:
        if retain is None:
            return super().stage_one(retain, label, shape)
        return CheckedStageOne(self, retain, label, shape)

    def stage_two(
        self,
        source: ModelLike,
        label: str | None,
        stage: StageOne,
        cells: Bool[Tensor, "example layer"] | None,
    ) -> StageTwoRun:
        if stage.s1 is None:
            return super().stage_two(source, label, stage, cells)
        return CheckedStageTwo(self, source, label, stage, cells)

    def forget_clean_runs(self, short_of_memory: bool = True) -> None:
        super().forget_clean_runs(short_of_memory)
        self.fp32_clean.forget(short_of_memory)

    def scale(self, stage: StageOne) -> float:
        """The band's scale of this run: measured on Stage 1's cells when it ran in both formats, else the prior."""
        exact = stage.d1_fp32()
        if exact is None or stage.s1 is None:
            return PRIOR_SCALE
        return measured_scale((stage.baseline - stage.s1).numpy(), exact.numpy(), self.eps)

    def clock(self) -> dict[str, float]:
        """The seconds spent so far on fp32 copies (``copies``) and fp32 runs (per role), for `timings_since`."""
        return dict(self.seconds)

    def timings_since(self, before: dict[str, float]) -> dict[str, float]:
        """Stage 2's precision timings since ``before`` (a `clock`): ``s2_precision_seconds`` in fp32 runs,
        ``s2_precision_copy_seconds`` making fp32 copies (a load: like the model's own, not part of Stage 2)."""
        spent = {key: value - before.get(key, 0.0) for key, value in self.seconds.items()}
        copies = spent.pop("copies", 0.0)
        return {"s2_precision_seconds": float(sum(spent.values())), "s2_precision_copy_seconds": copies}

    def reference(self, role: str, model: ModelLike) -> TLModel | None:
        """The fp32 copy of ``model`` in ``role`` (made once), or None where it cannot be made (not a bridge, or
        more than its share of the memory left, `planning.MemoryPlan.fp32_copy_fits`): that model's cells are then
        counted, not re-decided."""
        kept = self.references.get(role)
        if kept is not None and kept[0]() is model:
            return kept[1].model
        if hf_model_of(model) is None:
            self.unavailable[role] = "it is not a TransformerBridge"
        else:
            needed = 0 if lean_reference(model, self.engine) else weight_bytes_fp32(model)
            swapped = role == "unlearned"  # full and retain were loaded when the plan was measured
            fits, free = self.plan.fp32_copy_fits(needed, self.copied, swapped) if needed else (True, 0)
            if fits:
                made = reference_model(model, self.plan.device, self.engine, free)  # type: ignore[arg-type]
                self.copied += 0 if swapped else needed
                self.references[role] = (weakref.ref(model), made)
                self.weights[role] = made.weights
                self.seconds["copies"] = self.seconds.get("copies", 0.0) + made.seconds
                return made.model
            self.unavailable[role] = (
                f"an fp32 copy needs {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            )
        logger.warning(
            "Precision check: the %s model is not re-run in fp32 (%s); its fragile cells are counted only.",
            role,
            self.unavailable[role],
        )
        return None

    def release(self, role: str) -> None:
        """Drop the fp32 copy of ``role`` (its stage is over)."""
        self.references.pop(role, None)

    def _models(self, role: str, source: ModelLike) -> tuple[TLModel, TLModel] | None:
        if not self.enabled:
            return None
        full = self.reference("full", self.full)
        other = self.reference(role, source) if full is not None else None
        return None if full is None or other is None else (full, other)

    def _fp32_clean_run(self, full: TLModel, batch: PatchBatch, number: int) -> CleanRun:
        return self.fp32_clean.get(number, lambda: self.engine.clean_run(full, batch))

    def stage1_batch(
        self, retain: ModelLike, batch: PatchBatch, number: int, members: list[int], shape: tuple[int, int]
    ) -> None:
        """Stage 1 of batch ``number`` (the examples ``members`` of a ``shape`` Stage 1) in fp32: its baseline and
        S1, kept for `finish_stage1`."""
        models = self._models("retain", retain)
        if models is None:
            return
        full, other = models
        if self.stage1_fp32 is None:
            self.stage1_fp32 = (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
        started = time.perf_counter()
        with torch.no_grad(), computing_in(torch.float32):  # a lean reference runs in fp32 here
            clean = self._fp32_clean_run(full, batch, number)
            self.stage1_fp32[0][members] = self.engine.baseline_scores(full, batch, clean).float().cpu()
            self.stage1_fp32[1][members] = self.engine.source_scores(full, other, batch, clean).float().cpu()
        _synchronize(self.plan.device)
        self.seconds["retain"] = self.seconds.get("retain", 0.0) + time.perf_counter() - started

    def finish_stage1(self, stage: StageOne) -> None:
        """Give ``stage`` the fp32 baseline and S1 of the batches run (none when no batch ran)."""
        kept, self.stage1_fp32 = self.stage1_fp32, None
        if kept is not None:
            stage.baseline_fp32, stage.s1_fp32 = kept

    def fp32_rows(self, stage: StageOne, members: list[int] | slice) -> Bool[np.ndarray, " row"]:
        """The examples among ``members`` whose Stage 2 runs in fp32 from the start: with a tolerance, those whose
        UDS the band could move by more than it (`uds_bound`, from Stage 1's fp32 ``d1``)."""
        d1, exact1 = _decided(stage)
        d1_np = d1[members].numpy().astype(float)
        if self.tolerance is None or not self.enabled or not bool(exact1[members].all()):
            return np.zeros(d1_np.shape[0], dtype=bool)
        bound = uds_bound(d1_np, self.tau, band(d1_np, self.eps, self.scale(stage)))
        return np.nan_to_num(bound, nan=0.0) > self.tolerance

    def reduced_cells(
        self,
        source: ModelLike,
        stage: StageOne,
        members: list[int],
        cells: Bool[Tensor, "batch layer"] | None,
    ) -> Bool[Tensor, "batch layer"] | None:
        """The cells of batch ``members`` that Stage 2 runs in the reduced format (``cells``, None for every one):
        all of them but those of the `fp32_rows` (when ``source`` has an fp32 copy); None for every cell."""
        fp32 = torch.from_numpy(self.fp32_rows(stage, members))
        if not bool(fp32.any()) or self._models("unlearned", source) is None:
            return cells
        every = (
            torch.ones(len(members), stage.baseline.shape[1], dtype=torch.bool) if cells is None else cells
        )
        return every & ~fp32[:, None]

    def fragile_clips(
        self, stage: StageOne, members: list[int] | slice, d2: Float[Tensor, "row layer"]
    ) -> Bool[np.ndarray, "row layer"]:
        """KE cells among ``members`` whose clip, read from the reduced-precision ``d2``, lies inside the band."""
        d1, exact1 = _decided(stage)
        d1_np, exact_np, d2_np = d1[members].numpy(), exact1[members].numpy(), d2.numpy().astype(float)
        scale = self.scale(stage)
        width = band(d2_np, self.eps, scale) + np.where(exact_np, 0.0, band(d1_np, self.eps, scale))
        return fragile_clip(d1_np, np.nan_to_num(d2_np, nan=-np.inf), self.tau, width)

    def stage2_batch(
        self,
        source: ModelLike,
        batch: PatchBatch,
        number: int,
        stage: StageOne,
        members: list[int],
        cells: Bool[Tensor, "batch layer"] | None,
        s2: Float[Tensor, "batch layer"],
    ) -> Float[Tensor, "batch layer"]:
        """fp32 ``d2`` of batch ``number`` (the examples ``members`` of ``stage``, Stage 2 on ``cells``, None for
        every one), NaN elsewhere: every cell of the `fp32_rows`, and the `fragile_clips` of the reduced
        S2 ``s2`` of the others; each patch run on the batch's fp32 clean run and taken against Stage 1's fp32
        baseline."""
        every = torch.ones(s2.shape, dtype=torch.bool) if cells is None else cells.cpu()
        fp32 = torch.from_numpy(self.fp32_rows(stage, members))[:, None] & every
        chosen = fp32 | torch.from_numpy(self.fragile_clips(stage, members, stage.baseline[members] - s2))
        models = self._models("unlearned", source) if bool(chosen.any()) else None
        if models is None or stage.baseline_fp32 is None:
            return torch.full(s2.shape, float("nan"))
        full, other = models
        started = time.perf_counter()
        with torch.no_grad(), computing_in(torch.float32):  # a lean reference runs in fp32 here
            clean = self._fp32_clean_run(full, batch, number)
            patched = self.engine.cell_scores(full, other, batch, chosen, clean)
        _synchronize(self.plan.device)
        self.seconds["unlearned"] = self.seconds.get("unlearned", 0.0) + time.perf_counter() - started
        return stage.baseline_fp32[members] - patched

    def record(
        self, stage: StageOne, s2: Float[Tensor, "example layer"], d2_fp32: Float[Tensor, "example layer"]
    ) -> dict[str, Any]:
        """What a result records (``meta["precision"]``): the format, the band, where the fp32 weights came from,
        the fragile cells and those re-decided, the examples whose Stage 2 ran in fp32, the precision each decision
        was taken in (``decisions``: cells per format) and, per example (``per_example[idx]``: ``fragile``,
        ``redecided``, ``uds_bound``), how far the bands of the deltas left in the reduced format could move its
        UDS (`uds_bound`, the KE decisions as taken; ``max_uds_bound`` over the examples).

        ``s2`` is the reduced-precision S2 (NaN where it did not run), ``d2_fp32`` the fp32 ``d2`` (NaN where
        none)."""
        d1, exact1_t = _decided(stage)
        exact1, exact2 = exact1_t.numpy(), ~np.isnan(d2_fp32.numpy())
        reduced_d1 = (stage.baseline - stage.s1).numpy() if stage.s1 is not None else d1.numpy()
        scale = self.scale(stage)
        ke_fragile = fragile_ke(reduced_d1, self.tau, band(reduced_d1, self.eps, scale))
        clip_fragile = self.fragile_clips(stage, slice(None), stage.baseline - s2)
        fp32_rows = self.fp32_rows(stage, slice(None)) & exact2.any(-1)
        ke = d1.numpy() > self.tau
        fragile = ke_fragile | clip_fragile
        redecided = (ke_fragile & exact1) | (clip_fragile & exact2)
        # the bands of the deltas still in the reduced format, summed as UDS_i reads them
        reduced_d2 = (stage.baseline - s2).numpy()
        width = np.where(exact2, 0.0, band(reduced_d2, self.eps, scale))
        width = width + np.where(exact1, 0.0, band(reduced_d1, self.eps, scale))
        bound = np.nan_to_num(uds_bound(d1.numpy(), self.tau, np.nan_to_num(width)), nan=0.0)
        name = REDUCED_DTYPES[self.dtype]
        return {
            "dtype": name,
            "check": self.enabled,
            "tolerance": self.tolerance,
            "band": {
                "formula": "scale * eps * sqrt(1 + |d|)",
                "eps": self.eps,
                "scale": scale,
                "measured": stage.d1_fp32() is not None,
                "at_tau": float(band(np.array(self.tau), self.eps, scale)),
            },
            "weights": dict(self.weights),
            "not_redecided": dict(self.unavailable),
            "n_fragile_cells": int(fragile.sum()),
            "n_fragile_ke": int(ke_fragile.sum()),
            "n_fragile_clip": int(clip_fragile.sum()),
            "n_redecided_cells": int(redecided.sum()),
            "n_fp32_examples": int(fp32_rows.sum()),
            "decisions": {
                "ke": {"float32": int(exact1.sum()), name: int((~exact1).sum())},
                "clip": {"float32": int((ke & exact2).sum()), name: int((ke & ~exact2).sum())},
            },
            "max_uds_bound": float(bound.max()) if bound.size else 0.0,
            "per_example": {
                str(int(i)): {"fragile": int(f), "redecided": int(r), "uds_bound": float(b)}
                for i, f, r, b in zip(stage.idx, fragile.sum(-1), redecided.sum(-1), bound, strict=True)
            },
        }


class CheckedStageOne(StageOneRun):
    """Stage 1 of a checked run: each batch as `stages.StageOneRun` runs it, then its baseline and S1 in fp32
    (`PrecisionCheck.stage1_batch`); the finished stage carries both (``baseline_fp32``, ``s1_fp32``)."""

    runs: PrecisionCheck

    def run(self, number: int, members: list[int], batch: PatchBatch) -> None:
        super().run(number, members, batch)
        self.runs.stage1_batch(self.retain, batch, number, members, self.shape)  # type: ignore[arg-type]

    def close(self) -> None:
        super().close()
        self.runs.release("retain")

    def finish(self, idx: list[int], batches: list[list[int]], seconds: float) -> StageOne:
        stage = super().finish(idx, batches, seconds)
        self.runs.finish_stage1(stage)
        return stage


class CheckedStageTwo(StageTwoRun):
    """Stage 2 of a checked run: per batch, the examples rounding could move by more than the tolerance run in
    fp32 from the start (`PrecisionCheck.reduced_cells`), the others as `stages.StageTwoRun` runs them, then
    their fragile clips again in fp32 (`PrecisionCheck.stage2_batch`). S2 as results show it is ``baseline -
    d2_fp32`` where a cell was decided in fp32; ``meta()`` is the check's record (``meta["precision"]``)."""

    runs: PrecisionCheck

    def __init__(
        self,
        runs: PrecisionCheck,
        source: ModelLike,
        label: str | None,
        stage: StageOne,
        cells: Bool[Tensor, "example layer"] | None,
    ) -> None:
        super().__init__(runs, source, label, stage, cells)
        self.d2_fp32 = torch.full_like(self.s2, float("nan"))
        self.started = runs.clock()

    def run(
        self, number: int, members: list[int], batch: PatchBatch, cells: Bool[Tensor, "batch layer"] | None
    ) -> None:
        check = self.runs
        super().run(number, members, batch, check.reduced_cells(self.source, self.stage, members, cells))
        self.d2_fp32[members] = check.stage2_batch(
            self.source, batch, number, self.stage, members, cells, self.s2[members]
        )

    def close(self) -> None:
        super().close()
        self.runs.release("unlearned")

    def scores(self) -> Float[Tensor, "example layer"]:
        # at a cell re-decided in fp32 the table's d2 (baseline - s2) is the fp32 one
        return torch.where(torch.isnan(self.d2_fp32), self.s2, self.stage.baseline - self.d2_fp32)

    def meta(self) -> dict[str, Any]:
        return {"precision": self.runs.record(self.stage, self.s2, self.d2_fp32)}

    def timings(self) -> dict[str, float]:
        # the check's fp32 runs (part of Stage 2) and copies (a load, not)
        return {**super().timings(), **self.runs.timings_since(self.started)}

    def load_seconds(self) -> float:
        return self.runs.timings_since(self.started)["s2_precision_copy_seconds"]


def _decided(stage: StageOne) -> tuple[Float[Tensor, "example layer"], Bool[Tensor, "example layer"]]:
    """A Stage 1's decided ``d1`` and where it is an fp32 one."""
    d1 = stage.decided_d1()
    if d1 is None:
        raise ValueError("A retain-free Stage 1 has no d1: there is no decision to check.")
    exact = stage.d1_fp32()
    return d1, torch.zeros(d1.shape, dtype=torch.bool) if exact is None else ~torch.isnan(exact)


__all__ = [
    "PRIOR_SCALE",
    "REDUCED_DTYPES",
    "SAFETY",
    "CheckedStageOne",
    "CheckedStageTwo",
    "PrecisionCheck",
    "Reference",
    "ReferenceWeights",
    "band",
    "band_shape",
    "dtype_eps",
    "fragile_clip",
    "fragile_ke",
    "lean_reference",
    "measured_scale",
    "reference_model",
    "uds_bound",
    "stored_float_dtypes",
    "weight_bytes_fp32",
]

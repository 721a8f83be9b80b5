"""Devices and memory, held on the CPU (what a first run on CUDA would meet, issue 41): the suite pinned to the CPU,
models released before the next one loads, out-of-memory recognised and retried, fingerprints memoised, a
deterministic segment mean, a budgeted clean-run cache, and a sweep that never waits for actors a cluster cannot
place."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import types
import weakref
from typing import Any

import pytest
import torch

from uds_lens import memory
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints import digests, loader
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.config import UDSConfig
from uds_lens.data import encode, load_examples
from uds_lens.inputs import RunInputs
from uds_lens.patching import planning
from uds_lens.patching.engines import FastEngine
from uds_lens.patching.planning import clean_run_bytes
from uds_lens.readout import segment_mean
from uds_lens.sweep import driver as sweep_driver
from uds_lens.sweep.lists import SweepError, SweepModel
from uds_lens.sweep.staging import move_to_device, prepare_model
from uds_lens.sweep.worker import WorkerPlan
from uds_lens.tl_compat import hf_model_of

# -- 1. the suite on a GPU machine ---------------------------------------------------------------------------------


def test_tests_default_to_the_cpu_in_fp32_even_where_cuda_is_available(tiny, monkeypatch, device_pin):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_pin == "cpu"
    assert loader.default_device() == "cpu"
    assert loader.resolve_dtype(None, loader.default_device()) == torch.float32
    auditor = UDSAuditor(tiny.full, None, tiny.data, cache_dir=False, progress=False)
    assert auditor.device == "cpu" and auditor.full.cfg.dtype == torch.float32
    # what the pin prevents: without it the library's default is CUDA in bf16
    monkeypatch.delenv(loader.DEVICE_ENV)
    assert loader.default_device() == "cuda"
    assert loader.resolve_dtype(None, loader.default_device()) == torch.bfloat16


@pytest.mark.gpu
def test_a_gpu_test_gets_the_librarys_own_default(device_pin, monkeypatch):
    assert device_pin is None and loader.DEVICE_ENV not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loader.default_device() == "cuda"


def test_a_device_pin_that_is_no_device_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(loader.DEVICE_ENV, "gpu0")
    with pytest.raises(ValueError, match="UDS_LENS_DEVICE='gpu0' is not a torch device"):
        loader.default_device()


# -- 3. models released before the next one loads ------------------------------------------------------------------


def test_a_dropped_model_leaves_without_a_garbage_collection(tiny):
    model = loader.load_model(tiny.full, device="cpu")
    hf = weakref.ref(hf_model_of(model))
    weight = weakref.ref(next(model.parameters()))
    gc.disable()
    try:
        del model
        assert hf() is None and weight() is None  # no cycle model -> bridge -> model holds the weights
    finally:
        gc.enable()


def test_release_model_breaks_the_cycle_of_a_kept_bridge(tiny):
    hf = loader.load_hf_model(tiny.full, device="cpu")
    loader.hooked_from_hf(hf)  # kept on the model, as as_source keeps a plain source's bridge
    alive = weakref.ref(hf)
    gc.disable()
    try:
        loader.release_model(hf)
        del hf
        assert alive() is None
    finally:
        gc.enable()


class _Cycle:
    """Garbage only a collection frees (it refers to itself), standing for a model an older reference holds."""

    def __init__(self) -> None:
        self.me = self


def test_load_model_collects_garbage_before_the_weights_arrive(tiny, monkeypatch):
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    seen: list[bool] = []
    real = loader._hf_model  # noqa: SLF001 - the builder every load goes through

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(gone() is None)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "_hf_model", spy)
    gc.disable()
    try:
        del garbage
        loader.load_model(tiny.full, device="cpu")
    finally:
        gc.enable()
    assert seen == [True]


def test_nf4_loading_places_the_model_on_the_device_asked_for(tiny, monkeypatch):
    calls: list[dict[str, Any]] = []
    real = loader.AutoModelForCausalLM.from_pretrained

    def from_pretrained(first: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)  # bitsandbytes is not needed to see what the loader is asked for
        return real(
            first, **{k: v for k, v in kwargs.items() if k not in ("quantization_config", "device_map")}
        )

    monkeypatch.setattr(
        loader, "AutoModelForCausalLM", types.SimpleNamespace(from_pretrained=from_pretrained)
    )
    loader.load_hf_model(tiny.full, device="cpu", quantization=object())
    assert calls[0]["device_map"] == {"": "cpu"}


def test_a_staged_model_is_moved_again_after_an_out_of_memory(tiny, monkeypatch):
    model = loader.load_model(tiny.full, device="cpu")
    real = torch.nn.Module.to
    failed: list[bool] = []

    def to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if module is model and not failed:
            failed.append(True)
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    move_to_device(model, "meta")  # the meta device stands for a GPU: moving there allocates nothing
    assert failed == [True] and all(p.device.type == "meta" for p in model.parameters())


def test_a_model_staged_for_a_gpu_stays_in_ordinary_memory(tiny):
    entry = SweepModel("unlearned", str(tiny.unlearned), checkpoint=Checkpoint.resolve(tiny.unlearned))
    prepared = prepare_model(entry, None, "cuda")
    try:
        # pinning needs a CUDA driver: on this machine it would have failed the model
        assert prepared.error == "" and prepared.model is not None
        assert all(p.device.type == "cpu" and not p.is_pinned() for p in prepared.model.parameters())
        assert prepared.model.cfg.dtype == torch.bfloat16  # the dtype the GPU gets, built on the CPU
    finally:
        prepared.release()


# -- 6. out-of-memory detection and retry; memoised fingerprints ---------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "CUDA error: out of memory",
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8",
    ],
)
def test_allocation_failures_are_out_of_memory(message):
    assert memory.is_out_of_memory(RuntimeError(message))


def test_other_errors_are_not_out_of_memory():
    assert not memory.is_out_of_memory(RuntimeError("CUBLAS_STATUS_INVALID_VALUE"))
    assert not memory.is_out_of_memory(ValueError("out of memory"))  # not an allocator's error


def test_an_out_of_memory_while_loading_is_not_blamed_on_the_checkpoint(tiny):
    source = Checkpoint.resolve(tiny.full)
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"), source.errors():
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")


def test_retry_out_of_memory_frees_memory_and_tries_once_more(monkeypatch):
    released: list[str] = []
    monkeypatch.setattr(memory, "release_memory", lambda device: released.append(str(device)))
    outcomes = iter([torch.OutOfMemoryError("CUDA out of memory"), "loaded"])

    def action() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert memory.retry_out_of_memory(action, "cuda", "loading") == "loaded"
    assert released == ["cuda"]

    def always() -> None:
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        memory.retry_out_of_memory(always, "cuda", "loading", attempts=3)
    assert released == ["cuda"] * 3

    def broken() -> None:
        raise KeyError("model.layers.0")

    with pytest.raises(KeyError):
        memory.retry_out_of_memory(broken, "cuda", "loading")
    assert len(released) == 3  # any other error is not retried


def test_fingerprints_are_hashed_once_per_weight_identity(tiny, monkeypatch):
    model = loader.load_model(tiny.full, device="cpu")
    hashed: list[int] = []
    real = digests._hash_weights

    def counting(weights: Any) -> str:
        hashed.append(1)
        return real(weights)

    monkeypatch.setattr(digests, "_hash_weights", counting)
    first = digests.model_fingerprint(model)
    assert digests.model_fingerprint(model) == first
    assert digests.model_fingerprint(hf_model_of(model)) == first  # the same weights, the same memo
    assert len(hashed) == 1
    parameter = next(hf_model_of(model).parameters())
    with torch.no_grad():
        parameter.neg_()  # in place: autograd's version counter moves
    changed = digests.model_fingerprint(model)
    assert changed != first and len(hashed) == 2
    with torch.no_grad():
        parameter.neg_()  # negation is exact: the original bytes again, at a new version
    assert digests.model_fingerprint(model) == first and len(hashed) == 3
    # another model object with equal weights is hashed on its own, to the same digest
    assert digests.model_fingerprint(loader.load_model(tiny.full, device="cpu")) == first
    assert len(hashed) == 4


# -- 7. a deterministic segment mean -------------------------------------------------------------------------------


def test_segment_mean_adds_each_segments_values_in_order():
    generator = torch.Generator().manual_seed(0)
    segment = torch.tensor([2, 0, 0, 3, 2, 2, 0, 3, 3, 3, 0])
    values = torch.randn(4, segment.numel(), generator=generator) * 7
    means = segment_mean(values, segment, 5)
    for row in range(values.shape[0]):
        for seg in range(4):
            total = torch.zeros((), dtype=torch.float32)
            for t in (segment == seg).nonzero()[:, 0].tolist():
                total = total + values[row, t]  # left to right, as segment_mean adds: equal by construction
            count = int((segment == seg).sum())
            if count:
                assert torch.equal(means[row, seg], total / count)
    assert torch.isnan(means[:, 1]).all() and torch.isnan(means[:, 4]).all()  # empty segments: 0 / 0


def test_segment_mean_of_one_segment_does_not_depend_on_the_others():
    values = torch.tensor([0.1, 0.7, -0.3, 1e-3, 5.0, 2.5])
    alone = segment_mean(values[:3], torch.zeros(3, dtype=torch.long), 1)
    with_neighbours = segment_mean(values, torch.tensor([1, 0, 1, 0, 0, 1]), 2)
    regrouped = segment_mean(values[[1, 3, 4]], torch.zeros(3, dtype=torch.long), 1)
    assert torch.equal(with_neighbours[0], regrouped[0])
    assert torch.equal(
        segment_mean(values[[0, 2, 5]], torch.zeros(3, dtype=torch.long), 1)[0], with_neighbours[1]
    )
    assert alone.shape == (1,)


# -- 4. the clean-run cache, budgeted ------------------------------------------------------------------------------


def test_clean_runs_are_kept_only_within_their_budget(tiny, tiny_auditor):
    loaded = {name: loader.load_model(getattr(tiny, name), device="cpu") for name in ("full", "retain")}
    config = UDSConfig(batch_size=2)
    unbounded = tiny_auditor(loaded, config)
    reference = unbounded.score(tiny.unlearned)
    kept = [clean_run_bytes(run) for run in unbounded.runs.clean.runs.values()]
    assert len(kept) == len(unbounded.batches) > 1 and sum(kept) <= unbounded.clean_cache_bytes
    for budget in (0, kept[0]):
        bounded = tiny_auditor(loaded, config)
        bounded.clean_cache_bytes = budget
        result = bounded.score(tiny.unlearned)
        assert sum(clean_run_bytes(run) for run in bounded.runs.clean.runs.values()) <= budget
        assert len(bounded.runs.clean.runs) == (0 if budget == 0 else 1)
        # a clean run computed again is the same computation on the same tensors: equal by construction
        assert result.layers["s2_score"].tolist() == reference.layers["s2_score"].tolist()


def test_clean_runs_made_ahead_are_those_the_stage_keeps_and_change_no_number(
    tiny, tiny_auditor, monkeypatch
):
    """`StageRuns.make_clean_runs` (a sweep's worker whose Stage 1 came from elsewhere, before its first model) makes
    the runs the budget keeps and no other: each batch's clean run is made once in all, ahead or in the stage."""
    loaded = {name: loader.load_model(getattr(tiny, name), device="cpu") for name in ("full", "retain")}
    config = UDSConfig(batch_size=2)
    source = tiny_auditor(loaded, config)
    reference = source.score(tiny.unlearned)
    kept = [clean_run_bytes(run) for run in source.runs.clean.runs.values()]
    assert len(kept) == len(source.batches) > 1
    for budget, ahead in ((0, 0), (kept[0], 1), (source.clean_cache_bytes, len(kept))):
        auditor = tiny_auditor(loaded, config)
        auditor.use_stage1(source.stage1, source.batches)  # as a sweep's worker adopts it: no clean run kept
        auditor.clean_cache_bytes = budget
        made: list[int] = []

        def counted(*args, made=made, run=auditor.runs.engine.clean_run):
            made.append(1)
            return run(*args)

        monkeypatch.setattr(auditor.runs.engine, "clean_run", counted)
        assert auditor.runs.make_clean_runs() == ahead == len(made) == len(auditor.runs.clean.runs)
        result = auditor.score(tiny.unlearned)
        assert len(made) == len(kept)  # the stage made only those not kept
        assert result.layers["s2_score"].tolist() == reference.layers["s2_score"].tolist()


def test_the_auditor_drops_the_last_model_before_loading_the_next(tiny, tiny_auditor, monkeypatch):
    loaded = {name: loader.load_model(getattr(tiny, name), device="cpu") for name in ("full", "retain")}
    auditor = tiny_auditor(loaded)
    held: list[weakref.ref] = []
    real_load = UDSAuditor._load

    def remember(self: UDSAuditor, checkpoint: Checkpoint, role: str, *rest: Any) -> Any:
        model = real_load(self, checkpoint, role, *rest)
        held.append(weakref.ref(model))
        return model

    monkeypatch.setattr(UDSAuditor, "_load", remember)
    auditor.score(tiny.unlearned)
    # a model the auditor loaded itself is released once its Stage 2 is done, before anything else loads
    assert len(held) == 1 and held[0]() is None and auditor.last_source is None
    seen: list[bool] = []
    real = loader._hf_model  # noqa: SLF001 - the builder every load goes through

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(held[0]() is None)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "_hf_model", spy)
    auditor.score(tiny.retain)
    assert seen == [True]


# -- 2. a Ray sweep that never waits for actors the cluster cannot place ------------------------------------------


def test_workers_beyond_the_gpus_are_cut_with_a_warning(monkeypatch):
    monkeypatch.delenv(loader.DEVICE_ENV)
    one_gpu = {"CPU": 16.0, "GPU": 1.0}
    with pytest.warns(UserWarning, match="holds 1 at once"):
        layout = sweep_driver.plan_actors(one_gpu, 2, None, 1, None)
    assert (layout.workers, layout.gpus_per_worker) == (1, 1.0)
    assert sweep_driver.plan_actors(one_gpu, None, 0.5, 1, "cuda").workers == 2
    assert sweep_driver.plan_actors({"CPU": 4.0, "GPU": 2.0}, None, None, 1, None).workers == 2


def test_gpus_are_asked_for_only_when_the_device_is_cuda(monkeypatch):
    one_gpu = {"CPU": 4.0, "GPU": 1.0}
    cpu = sweep_driver.plan_actors(one_gpu, None, None, 1, "cpu")
    assert (cpu.workers, cpu.gpus_per_worker) == (4, 0.0)
    # the suite's pin is a named device too: its actors stay on the CPU
    assert sweep_driver.plan_actors(one_gpu, None, None, 1, None).gpus_per_worker == 0.0
    with pytest.raises(SweepError, match="no GPU"):
        sweep_driver.plan_actors({"CPU": 4.0}, None, None, 1, "cuda")
    with pytest.raises(SweepError, match="Not one sweep actor fits"):
        sweep_driver.plan_actors(one_gpu, None, 2.0, 1, "cuda")


def test_a_device_index_is_dropped_on_gpu_actors():
    layout = sweep_driver.plan_actors({"CPU": 8.0, "GPU": 2.0}, 2, None, 1, "cuda:1")
    assert layout.device == "cuda" and layout.workers == 2
    assert sweep_driver.plan_actors({"CPU": 8.0}, 2, None, 1, "cpu").device == "cpu"


class _FakeRay(types.ModuleType):
    """Just enough of Ray for the driver's start-up: actors whose Stage 1 never arrives."""

    class exceptions:  # noqa: N801 - as Ray names its module
        class RayError(Exception):
            pass

        class GetTimeoutError(RayError):
            pass

    def __init__(self) -> None:
        super().__init__("ray")
        self.killed: list[Any] = []
        self.timeouts: list[float | None] = []
        self.options_seen: list[dict[str, Any]] = []

    def is_initialized(self) -> bool:
        return True  # joined, not started here: nothing to shut down

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 2.0, "GPU": 1.0}

    def remote(self, cls: Any) -> Any:
        return self

    def options(self, **kwargs: Any) -> Any:
        """The actor class: each ``remote`` call makes an actor whose calls return references never ready."""
        self.options_seen.append(kwargs)
        call = types.SimpleNamespace(remote=lambda *args: object())
        return types.SimpleNamespace(remote=lambda *args, **kw: types.SimpleNamespace(stage=call, adopt=call))

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        raise self.exceptions.GetTimeoutError("not ready")

    def kill(self, actor: Any) -> None:
        self.killed.append(actor)


def test_workers_that_never_start_end_the_sweep_with_an_error(tiny, monkeypatch, tmp_path):
    monkeypatch.delenv(loader.DEVICE_ENV)
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    inputs = RunInputs(
        Checkpoint.resolve(tiny.full), Checkpoint.resolve(tiny.retain), [], "data", UDSConfig(device="cuda:1")
    )
    plan = WorkerPlan(inputs)
    entries = [SweepModel(name, str(tiny.unlearned)) for name in ("a", "b", "c")]
    with (
        pytest.warns(UserWarning, match="holds 1 at once"),
        pytest.raises(SweepError, match="did not start within 5 s"),
    ):
        sweep_driver._sweep_on_ray(
            plan, entries, tmp_path, 2, None, None, 1, 0, False, False, startup_timeout=5.0
        )
    assert fake.timeouts == [5.0] and len(fake.killed) == 1
    assert fake.options_seen[0]["num_gpus"] == 1.0
    assert plan.inputs.config.device == "cuda"  # the actor's one visible GPU, whatever index was asked for


# -- 3. the joined copies, counted by the planner ------------------------------------------------------------------


def test_the_planner_counts_the_joined_copies_the_fast_engine_makes(tiny):
    from uds_lens.patching.kernels import layer_weights

    model = loader.load_model(tiny.full, device="cpu")
    made = 0
    for layer, block in enumerate(model.blocks):
        weights = layer_weights(model, layer)
        own = {id(p) for p in block.parameters()}
        for item in dataclasses.fields(weights):
            value = getattr(weights, item.name)
            if isinstance(value, torch.Tensor) and id(value) not in own and id(value._base) not in own:
                made += (
                    value.numel() * value.element_size()
                )  # allocated by the engine, not a view of a weight
    assert made > 0 and planning.joined_copy_bytes(model) == made


def test_the_batch_takes_its_share_of_the_runs_room(tiny):
    model = loader.load_model(tiny.full, device="cpu")
    tokenizer = loader.load_tokenizer(tiny.tokenizer)
    encoded, _ = encode(load_examples(tiny.data), tokenizer)
    seq_len = max(example.read_positions.stop for example in encoded)
    window = max(len(example.window("span")) for example in encoded)
    per_example = FastEngine.bytes_per_example(model, seq_len, window)
    room = 20 * per_example
    assert planning.choose_batch_size(model, encoded, "span", "fast", room) == int(
        planning.SHARES["batch"] * 20
    )
    assert planning.choose_batch_size(model, encoded, "span", "fast", 1) == 1  # at least one example
    assert planning.choose_batch_size(model, encoded, "span", "fast", 1 << 40) == 64  # at most the cap


# -- 8. one plan per run -------------------------------------------------------------------------------------------


def test_an_fp32_run_measures_the_free_memory_once(tiny, tiny_auditor, monkeypatch):
    """The auditor measures once, when the models of Stage 1 are loaded, and hands out every share from that
    (``planning.MemoryPlan``): the batch, the clean runs, the joined copies; a model swap in fp32 needs no second
    look. (Models given in memory: loading's own fit check is the loader's.)"""
    loaded = {
        name: loader.load_model(getattr(tiny, name), device="cpu") for name in ("full", "retain", "unlearned")
    }
    measured: list[object] = []
    real = memory.available_memory_bytes

    def counted(device: Any) -> int:
        measured.append(device)
        return real(device)

    monkeypatch.setattr(memory, "available_memory_bytes", counted)
    auditor = tiny_auditor(loaded)
    auditor.score(loaded["unlearned"])
    auditor.score(loaded["retain"])  # a second model swap
    assert len(measured) == 1
    plan = auditor.plan
    assert (
        auditor.clean_cache_bytes
        == plan.share("clean_runs")
        == int(planning.SHARES["clean_runs"] * plan.room)
    )
    kept = min(plan.clean_bytes, plan.share("clean_runs")) + min(plan.read_bytes, plan.share("source_reads"))
    assert auditor.holds_joined == (plan.joined_bytes <= plan.share("held_copies") - kept)


def test_the_runs_room_is_a_models_weights_at_most_what_is_free_and_never_small():
    """What a run holds beyond its two models is planned in a room of `planning.RUN_ROOM` of one model's weights, so
    that a run peaks near three models however much is free; never more than is free, never less than
    `planning.MIN_ROOM`; every share is of that room."""
    model = 1 << 30
    plentiful = planning.MemoryPlan("cpu", 64 << 30, 0, model)
    assert plentiful.room == int(planning.RUN_ROOM * model)
    assert planning.MemoryPlan("cpu", model // 2, 0, model).room == model // 2  # short: what is free
    assert planning.MemoryPlan("cpu", 64 << 30, 0, 1 << 20).room == planning.MIN_ROOM  # a small model
    assert planning.MemoryPlan("cpu", 64 << 30).room == 64 << 30  # no model given: what is free
    assert plentiful.share("clean_runs") == int(planning.SHARES["clean_runs"] * plentiful.room)


def test_the_plan_holds_joined_copies_only_beside_the_clean_runs_and_reads_it_expects():
    """The held copies are granted in order of what they save: the clean runs and a source's reads (each within
    its share), then the target's joined copies where they fit beside them in the held-copies share, then a
    source's where both fit; an engine that joins nothing holds none."""
    model = 1 << 30
    room = int(planning.RUN_ROOM * model)
    held = planning.SHARES["held_copies"] * room
    joined = int(held / 4)

    def plan(clean: int, reads: int = 0) -> planning.MemoryPlan:
        return planning.MemoryPlan("cpu", 64 << 30, joined, model, clean, reads)

    roomy, target_only, short = plan(0), plan(int(held / 2) + 64), plan(int(held / 2), int(held / 2))
    assert roomy.holds_target_joins and roomy.holds_source_joins
    assert target_only.holds_target_joins and not target_only.holds_source_joins
    assert not short.holds_target_joins and not short.holds_source_joins
    # what the reads may hold counts within their share only
    capped = plan(0, 1 << 40)
    assert capped.source_read_bytes == capped.share("source_reads")
    assert capped.holds_target_joins == (joined <= held - capped.share("source_reads"))
    assert not planning.MemoryPlan(
        "cpu", 1 << 40, 0, model
    ).holds_target_joins  # an engine that joins nothing


def test_a_dropped_model_is_collected_only_where_a_reference_cycle_holds_it(monkeypatch):
    """A model freed by its last reference costs no garbage collection (a fraction of a second on a full heap, each
    time a stage releases a model); one a cycle still holds is collected."""
    collections: list[int] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(1) or real(*args))
    plain = torch.nn.Linear(2, 2)
    dropped = weakref.ref(plain)
    del plain
    memory.release_dropped(dropped, "cpu")
    assert dropped() is None and collections == []
    cyclic = torch.nn.Linear(2, 2)
    cyclic.__dict__["me"] = cyclic
    dropped = weakref.ref(cyclic)
    del cyclic
    memory.release_dropped(dropped, "cpu")
    assert dropped() is None and collections == [1]

"""What the auditor holds and when (issue 46, "an 8B audit on a 48 GB card"): the retain model only through Stage 1,
each unlearned model only through its Stage 2, joined weight copies for the patch target only; models a caller
passes as objects are the caller's and stay. No number moves: the scores are those of an auditor that holds
everything."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from uds_lens import memory
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints import loader
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.config import UDSConfig
from uds_lens.patching import planning
from uds_lens.patching.kernels import kept_joined_blocks
from uds_lens.patching.planning import joined_copy_bytes
from uds_lens.stages import StageOneRun, StageTwoRun


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[weakref.ref]]:
    """Weak references to every model an auditor loads, by role."""
    held: dict[str, list[weakref.ref]] = {}
    real = UDSAuditor._load

    def remember(self: UDSAuditor, checkpoint: Checkpoint, role: str, *rest: Any) -> Any:
        model = real(self, checkpoint, role, *rest)
        held.setdefault(role, []).append(weakref.ref(model))
        return model

    monkeypatch.setattr(UDSAuditor, "_load", remember)
    return held


def _auditor(tiny: Any, full: Any, retain: Any, **config: Any) -> UDSAuditor:
    return UDSAuditor(
        full,
        retain,
        tiny.data,
        UDSConfig(**config),
        tokenizer=loader.load_tokenizer(tiny.tokenizer),
        cache_dir=False,
        progress=False,
    )


@pytest.mark.parametrize("engine", ["fast", "naive"])
def test_models_loaded_from_paths_live_only_through_their_stage(tiny, loads, engine):
    auditor = _auditor(tiny, tiny.full, tiny.retain, engine=engine)
    retain = loads["retain"][0]
    assert retain() is not None  # Stage 1 not computed yet: held
    stage = auditor.stage1
    assert stage.s1 is not None and retain() is None  # released once Stage 1 is computed
    result = auditor.score(tiny.unlearned)
    assert loads["unlearned"][0]() is None and auditor.last_source is None  # released after its Stage 2
    # the scores are those of an auditor that holds every model (objects: never released)
    objects = {role: loader.load_model(getattr(tiny, role), device="cpu") for role in ("full", "retain")}
    unlearned = loader.load_model(tiny.unlearned, device="cpu")
    holding = _auditor(tiny, objects["full"], objects["retain"], engine=engine)
    held = holding.score(unlearned)
    # the same computation on the same weights: equal by construction
    assert torch.equal(stage.s1, holding.stage1.s1)  # type: ignore[arg-type]
    assert result.layers["s2_score"].tolist() == held.layers["s2_score"].tolist()
    assert result.uds == held.uds
    # a caller's objects stay theirs: the auditor still holds and names them
    assert holding.retain is objects["retain"] and holding.last_source is unlearned


def test_a_cached_stage1_releases_retain_too(tiny, loads, tmp_path):
    first = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=tmp_path, progress=False)
    _ = first.stage1
    second = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=tmp_path, progress=False)
    assert second.stage1.cached and all(ref() is None for ref in loads["retain"])
    assert second.fingerprint_payload() == first.fingerprint_payload()  # without loading retain again
    assert len(loads["retain"]) == 2


def test_a_released_retain_is_loaded_again_when_asked_for_and_a_dropped_one_is_not(tiny, loads):
    auditor = _auditor(tiny, tiny.full, tiny.retain)
    original = {name: p.detach().clone() for name, p in auditor.retain.named_parameters()}  # type: ignore[union-attr]
    _ = auditor.stage1
    assert loads["retain"][0]() is None and "retain" in repr(auditor) and len(loads["retain"]) == 1
    again = auditor.retain  # component patching asks for it: loaded again, the same weights
    assert again is not None and len(loads["retain"]) == 2
    assert all(torch.equal(original[name], p) for name, p in again.named_parameters())
    auditor.drop_retain()
    assert auditor.retain is None and len(loads["retain"]) == 2


def test_only_the_patch_target_keeps_joined_weights(tiny):
    full = loader.load_model(tiny.full, device="cpu")
    retain = loader.load_model(tiny.retain, device="cpu")
    unlearned = loader.load_model(tiny.unlearned, device="cpu")
    auditor = _auditor(tiny, full, retain)
    auditor.score(unlearned)
    assert kept_joined_blocks(full) == full.cfg.n_layers
    assert kept_joined_blocks(retain) == 0 and kept_joined_blocks(unlearned) == 0
    # a source identical to the target reuses the target's copies: deltas of exactly 0 still
    same = auditor.score(full)
    assert (same.layers["d2"].abs() == 0).all()


def test_a_target_whose_joined_copies_do_not_fit_holds_none_and_scores_the_same(tiny, monkeypatch):
    full = loader.load_model(tiny.full, device="cpu")
    retain = loader.load_model(tiny.retain, device="cpu")
    unlearned = loader.load_model(tiny.unlearned, device="cpu")
    roomy = _auditor(tiny, full, retain, batch_size=4)
    reference = roomy.score(unlearned)
    assert roomy.holds_joined and kept_joined_blocks(full) == full.cfg.n_layers
    # a card where full's joined copies would take more than their share of the memory left
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: joined_copy_bytes(full))
    tight = _auditor(tiny, full, retain, batch_size=4)
    assert not tight.holds_joined and kept_joined_blocks(full) == 0  # the copies kept so far went too
    result = tight.score(unlearned)
    assert kept_joined_blocks(full) == 0
    # each block joined for the run that needs it: the same values, the same products, equal by construction
    assert result.layers["s2_score"].tolist() == reference.layers["s2_score"].tolist()
    assert torch.equal(tight.stage1.s1, roomy.stage1.s1)  # type: ignore[arg-type]


def test_a_stage_reads_its_source_block_first_joining_each_block_once_and_holding_no_copy(tiny, monkeypatch):
    """A stage on every cell reads its source's activations block first over the batches (`stages.SourceReads`):
    each block of retain (Stage 1) and of the unlearned model (Stage 2) is joined once for the stage, not once a
    batch, and no whole joined copy of a source is ever kept; a stage on chosen cells holds the source's copies
    through the stage where the plan has room. Where the plan's room for the reads is short, they are read a group
    at a time: the same products, the same numbers."""
    from uds_lens.patching import kernels

    full = loader.load_model(tiny.full, device="cpu")
    retain = loader.load_model(tiny.retain, device="cpu")
    unlearned = loader.load_model(tiny.unlearned, device="cpu")
    blocks = {"retain": set(map(id, retain.blocks)), "unlearned": set(map(id, unlearned.blocks))}
    joins = {"retain": 0, "unlearned": 0}
    held: list[tuple[str, int]] = []
    join, stage_one_run, stage_two_run = (
        kernels._BlockWeights._join.__func__,
        StageOneRun.run,
        StageTwoRun.run,
    )

    def counted(cls: Any, block: Any, *args: Any) -> Any:
        for role, ids in blocks.items():
            joins[role] += id(block) in ids
        return join(cls, block, *args)

    def one(self: StageOneRun, *args: Any) -> None:
        stage_one_run(self, *args)
        held.append(("retain", kept_joined_blocks(self.retain)))

    def two(self: StageTwoRun, *args: Any) -> None:
        stage_two_run(self, *args)
        held.append(("unlearned", kept_joined_blocks(self.source)))

    monkeypatch.setattr(kernels._BlockWeights, "_join", classmethod(counted))
    monkeypatch.setattr(StageOneRun, "run", one)
    monkeypatch.setattr(StageTwoRun, "run", two)
    roomy = _auditor(tiny, full, retain, batch_size=2)
    reference = roomy.score(unlearned)
    n_layers = full.cfg.n_layers
    assert roomy.plan.holds_source_joins and len(roomy.batches) > 2
    assert {role for role, _ in held} == {"retain", "unlearned"} and all(n == 0 for _, n in held)
    assert joins == {"retain": n_layers, "unlearned": n_layers}  # once a block, for every batch of the stage
    # a stage on chosen cells runs its source per batch: its copies held through the stage
    held.clear()
    cells = _auditor(tiny, full, retain, batch_size=2, stage2_cells="ke")
    cells.use_stage1(roomy.stage1, roomy.batches)
    cells.score(unlearned)
    assert held and all(n == n_layers for _, n in held) and kept_joined_blocks(unlearned) == 0
    # room for a batch's reads at a time: each block joined once a batch, the same numbers
    held.clear()
    joins.update(retain=0, unlearned=0)
    monkeypatch.setattr(planning.MemoryPlan, "source_read_bytes", property(lambda self: 0))
    tight = _auditor(tiny, full, retain, batch_size=2)
    result = tight.score(unlearned)
    n_batches = len(tight.batches)
    assert joins == {"retain": n_layers * n_batches, "unlearned": n_layers * n_batches}
    # the same products in the same order on the same batches: equal by construction
    assert torch.equal(tight.stage1.s1, roomy.stage1.s1)  # type: ignore[arg-type]
    assert result.layers["s2_score"].tolist() == reference.layers["s2_score"].tolist()

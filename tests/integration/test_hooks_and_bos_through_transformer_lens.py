"""TransformerLens's two silent bugs of 2026 against uds_lens's paths (issue 49), on the tiny checkpoints.

* PR #1625: ``run_with_cache(text, prepend_bos=False)`` still prepended a BOS, shifting every position. uds_lens never
  hands TransformerLens a string: every forward it runs (Stage 1, Stage 2 on both engines, component patching, the
  workbench's ``run_with_cache``) is fed token tensors with exactly one BOS, at position 0. The guard below holds
  that on 3.9 and 4.x (both released versions already carry the fix; the bug cannot reach these paths either way).
* PR #1682 (scoped hook teardown, also #1638): a helper's teardown removed hooks it had not added. On 3.9 and 4.x
  the teardown of ``run_with_hooks`` / ``run_with_cache`` / ``hooks()`` removes only its own level, so a user's hook
  survives uds_lens's calls (guarded below). The other side of the same contract did reach uds_lens: a hook of one's
  own left on a model (``add_hook``, an unclosed ``hooks()`` context) ran inside every naive-engine and component
  forward, changed the UDS silently (0.841 -> 0.795 on these checkpoints) and wrote that Stage 1 into the cache that
  later runs of the same weights read (0.830 for a clean model). Scoring such a model is refused now, naming the
  hooked points; that test failed on 34971a7.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.loader import load_model
from uds_lens.config import UDSConfig
from uds_lens.tl_compat import TransformerBridge

POINT = "blocks.1.hook_resid_post"


def _halve(activation: Tensor, hook) -> Tensor:
    return activation * 0.5


@pytest.fixture(scope="module")
def clean_uds(tiny) -> dict[str, float]:
    return {
        engine: UDSAuditor(
            tiny.full,
            tiny.retain,
            tiny.data,
            config=UDSConfig(engine=engine),
            cache_dir=False,
            progress=False,
        )
        .score(tiny.unlearned)
        .uds  # fmt: skip
        for engine in ("fast", "naive")
    }


@pytest.mark.parametrize(
    ("engine", "role"), [("naive", "full"), ("fast", "full"), ("naive", "retain"), ("naive", "unlearned")]
)
def test_a_hook_left_on_a_model_is_refused_and_never_reaches_the_cache(
    tiny, tmp_path, clean_uds, engine, role
):
    hooked = load_model(getattr(tiny, role), device="cpu")
    hooked.hook_dict[POINT].add_hook(_halve)
    models = {"full": tiny.full, "retain": tiny.retain, "unlearned": tiny.unlearned, role: hooked}
    cache = tmp_path / "cache"
    auditor = UDSAuditor(models["full"], models["retain"], tiny.data, config=UDSConfig(engine=engine),
                         tokenizer=hooked.tokenizer, cache_dir=cache, progress=False)  # fmt: skip
    # (tl_compat.HooksAttachedError, a RuntimeError: named by class so this runs on the code before it too)
    with pytest.raises(RuntimeError, match=f"The {role} model carries hooks at .*{POINT}") as refused:
        auditor.score(models["unlearned"])
    assert type(refused.value).__name__ == "HooksAttachedError"
    assert "reset_hooks" in str(refused.value) and "\n" not in str(refused.value)
    assert not list(cache.glob("s1_*"))  # nothing a later run could read
    hooked.reset_hooks(including_permanent=True)
    assert auditor.score(models["unlearned"]).uds == pytest.approx(clean_uds[engine], abs=1e-6)
    again = UDSAuditor(tiny.full, tiny.retain, tiny.data, config=UDSConfig(engine=engine), cache_dir=cache,
                       progress=False)  # fmt: skip
    assert again.score(tiny.unlearned).uds == pytest.approx(clean_uds[engine], abs=1e-6)


def test_component_patching_refuses_a_hooked_model_too(tiny):
    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    idx = auditor.encoded[0].idx
    with auditor.full.hooks(fwd_hooks=[(POINT, _halve)]):  # a context left open around the call
        with pytest.raises(RuntimeError, match="The full model carries hooks"):
            auditor.patch_heads(tiny.unlearned, idxs=[idx], layers=[0])
    assert auditor.patch_heads(tiny.unlearned, idxs=[idx], layers=[0]).name  # closed: it runs


def _hook_count(model) -> int:
    points = {
        id(point): point for point in model.hook_dict.values()
    }  # a bridge lists a point under aliases too
    return sum(len(point.fwd_hooks) + len(point.bwd_hooks) for point in points.values())


def test_the_workbench_calls_leave_a_users_hooks_in_place(tiny):
    """The PR #1682 class of bug: a teardown that removes hooks it did not add. Guarded on the installed
    TransformerLens (3.9 and 4.x each run this suite)."""
    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    idx = auditor.encoded[0].idx
    calls = []
    auditor.full.hook_dict[POINT].add_hook(lambda activation, hook: calls.append(1))
    before = _hook_count(auditor.full)
    logits, cache = auditor.run_with_cache(idx, names_filter=[POINT])
    example = auditor.example(idx)
    auditor.full.run_with_hooks(example.tokens, fwd_hooks=[(POINT, lambda activation, hook: activation)])
    with auditor.full.hooks(fwd_hooks=[(POINT, lambda activation, hook: activation)]):
        auditor.run_with_cache(idx)
    assert _hook_count(auditor.full) == before == 1
    assert len(calls) == 3  # the user's hook ran in each of the three forwards
    auditor.full.reset_hooks(including_permanent=True)


def test_every_forward_is_fed_token_tensors_with_one_bos(tiny, monkeypatch):
    """The PR #1625 class of bug: a string tokenised with another BOS rule than asked. uds_lens passes token ids
    only, each row starting with the one BOS its encoding put there (right padding never adds one)."""
    fed: list[object] = []
    for method in ("forward", "run_with_cache", "run_with_hooks"):
        original = getattr(TransformerBridge, method)

        def record(self, *args, _original=original, **kwargs):
            fed.append(args[0] if args else kwargs.get("input", kwargs.get("input_ids")))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TransformerBridge, method, record)
    for engine in ("fast", "naive"):
        auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, config=UDSConfig(engine=engine), cache_dir=False,
                             progress=False)  # fmt: skip
        auditor.score(tiny.unlearned)
    auditor.run_with_cache([e.idx for e in auditor.encoded])
    auditor.patch_tokens(tiny.unlearned, idxs=[auditor.encoded[0].idx], layers=[0])
    bos = auditor.tokenizer.bos_token_id
    assert fed, "no forward was recorded"
    for tokens in fed:
        assert isinstance(tokens, Tensor) and tokens.dtype == torch.long, type(tokens)
        assert (tokens[:, 0] == bos).all() and ((tokens == bos).sum(-1) == 1).all()

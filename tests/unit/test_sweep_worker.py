"""A sweep worker builds its auditor through the constructor (names given, retain dropped by the auditor itself);
the ledger's digests are those older sweeps wrote; no sweep module draws at import time."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import uds_lens.sweep
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.config import UDSConfig
from uds_lens.data import load_examples
from uds_lens.files import json_digest
from uds_lens.inputs import RunInputs
from uds_lens.sweep.ledger import fingerprint_columns
from uds_lens.sweep.lists import SweepError, SweepModel
from uds_lens.sweep.worker import SweepWorker, WorkerPlan

# A result fingerprint as ``auditor.result_fingerprint`` writes it, and its ``fp_settings`` as sweep.py computed it
# before the package split (sha256 of the sorted JSON, 24 hex digits): sweep.csv files written then must still match.
FINGERPRINT = {
    "format": 3,
    "full": "files:x",
    "retain": None,
    "unlearned": "files:y",
    "data": "abc",
    "tokenizer": "from full",
    "settings": {
        "patch_scope": "span",
        "site": "resid_post",
        "layers": None,
        "published_compat": False,
        "dtype": "torch.float32",
        "engine": "fast",
    },
    "s1": "zz",
}
FP_SETTINGS_BEFORE_THE_SPLIT = "b445c03035a2d4411aca65ba"


def test_fingerprint_columns_keep_the_digest_older_sweeps_wrote():
    columns = fingerprint_columns(FINGERPRINT)
    assert columns["fp_settings"] == FP_SETTINGS_BEFORE_THE_SPLIT
    assert columns["fp_settings"] == json_digest(
        [FINGERPRINT["settings"], FINGERPRINT["tokenizer"], FINGERPRINT["format"]], 24
    )
    assert columns["fp_full"] == "files:x" and columns["fp_retain"] == "None"
    # the digest follows the settings: another site is another fp_settings
    other = {**FINGERPRINT, "settings": {**FINGERPRINT["settings"], "site": "mlp_out"}}
    assert fingerprint_columns(other)["fp_settings"] != FP_SETTINGS_BEFORE_THE_SPLIT


def _imports_plotting(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.startswith("uds_lens.plotting") for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        return module.startswith("uds_lens.plotting") or (
            module == "uds_lens" and any(alias.name == "plotting" for alias in node.names)
        )
    return False


def test_no_sweep_module_imports_plotting_at_module_level():
    package = Path(uds_lens.sweep.__file__).parent
    modules = sorted(package.glob("*.py"))
    assert {path.stem for path in modules} >= {"driver", "ledger", "lists", "published", "staging", "worker"}
    for path in modules:
        top_level = ast.parse(path.read_text()).body
        assert not [node for node in top_level if _imports_plotting(node)], path.name
    # the scatter still draws: plotting is imported inside the function that needs it
    published = ast.parse((package / "published.py").read_text())
    inner = [node for node in ast.walk(published) if _imports_plotting(node)]
    assert inner, "published.py should import plotting where it draws"


def test_every_sweep_module_is_under_700_lines():
    for path in Path(uds_lens.sweep.__file__).parent.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 700, path.name


@pytest.fixture(scope="module")
def plan(tiny):
    inputs = RunInputs.resolve(
        str(tiny.full),
        str(tiny.retain),
        load_examples(tiny.data),
        config=UDSConfig(),
        cache_dir=False,
        data_name="forget-set-label.json",
    )
    return WorkerPlan(inputs)


def test_drop_retain_computes_stage1_first_and_releases_the_model(tiny):
    dropped = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    assert dropped._stage1 is None  # nothing computed yet
    dropped.drop_retain()
    assert dropped.retain is None and dropped.retain_name == str(tiny.retain)
    kept = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    # Stage 1 was computed with retain patched in, before it was released: S1 is there and as without the drop
    assert dropped.stage1.s1 is not None and kept.stage1.s1 is not None
    assert torch.equal(dropped.stage1.s1, kept.stage1.s1)
    assert dropped.fingerprint(None) == kept.fingerprint(None)


def test_auditor_names_come_from_the_constructor(tiny):
    records = load_examples(tiny.data)
    default = UDSAuditor(tiny.full, None, records, cache_dir=False, progress=False)
    assert (default.retain_name, default.data_name) == (None, "<records>")
    named = UDSAuditor(
        tiny.full, None, records, cache_dir=False, progress=False, retain_name="ret", data_name="forget.json"
    )
    assert (named.retain, named.retain_name, named.data_name) == (None, "ret", "forget.json")


def _entry(path) -> SweepModel:
    """A sweep model as the sweep's door hands it to a worker: its checkpoint made."""
    return SweepModel("unl", str(path), checkpoint=Checkpoint.resolve(path))


def test_workers_build_their_auditors_named_by_the_plan(tiny, plan):
    first = SweepWorker(plan, compute_stage=True)
    shipped = first.stage()
    assert first.auditor.retain is None  # released once Stage 1 was computed
    assert shipped.stage1.s1 is not None and torch.isfinite(shipped.stage1.s1).all()
    assert (shipped.retain_name, shipped.data_name) == (str(tiny.retain), "forget-set-label.json")

    other = SweepWorker(plan, compute_stage=False)
    # built with the names, before any Stage 1 arrives: nothing is assigned into the auditor afterwards
    assert (other.auditor.retain, other.auditor.retain_name, other.auditor.data_name) == (
        None,
        str(tiny.retain),
        "forget-set-label.json",
    )
    with pytest.raises(SweepError, match="no Stage 1 yet"):
        other.score(_entry(tiny.unlearned))
    with pytest.raises(SweepError, match="another sweep"):
        other.adopt(dataclasses.replace(shipped, data_name="someone-elses.json"))
    other.adopt(shipped)
    outcome = other.score(_entry(tiny.unlearned))
    assert outcome.status == "scored", outcome.error
    assert outcome.result.meta["retain"] == str(tiny.retain)
    assert outcome.result.meta["data"] == "forget-set-label.json"
    # the worker that never loaded retain scores exactly as the one that computed Stage 1
    reference = first.score(_entry(tiny.unlearned))
    assert reference.result.uds == outcome.result.uds
    assert reference.result.meta["fingerprint"] == outcome.result.meta["fingerprint"]

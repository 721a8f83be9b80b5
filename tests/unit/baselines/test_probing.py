"""uds_lens/probing.py: linear probe fitted on the full model, retain-normalised probe-loss erasure."""

from __future__ import annotations

import pytest
import torch

from uds_lens.baselines.hidden import HiddenStates
from uds_lens.baselines.probing import fit_probes, linear_probe_score, probe_layerwise


def test_probe_endpoints_on_models(trio_hidden):
    hidden = trio_hidden
    probes = fit_probes(hidden["full"])
    as_full = linear_probe_score(hidden["full"], hidden["retain"], hidden["full"], probes=probes)
    as_retain = linear_probe_score(hidden["full"], hidden["retain"], hidden["retain"], probes=probes)
    assert as_full.method == "linear_probe"
    assert as_full.score <= 0.02
    assert as_retain.score >= 0.98
    assert (probes.loss(hidden["full"]) < probes.loss(hidden["retain"])).all()


def test_cross_fitted_probe_scores_are_bounded(trio_hidden):
    hidden = trio_hidden
    probes = fit_probes(hidden["full"], folds=2, max_iter=20)
    assert not probes.in_sample
    result = linear_probe_score(hidden["full"], hidden["retain"], hidden["other"], probes=probes)
    assert result.erasure.min() >= 0 and result.erasure.max() <= 1
    with pytest.raises(ValueError, match="folds"):
        fit_probes(hidden["full"], folds=100)


def test_probe_decodes_linearly_separable_labels():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(60) % 3
    centres = torch.randn(3, 8, generator=generator) * 4
    resid = (centres[labels] + torch.randn(60, 8, generator=generator))[None]
    idx = torch.arange(60)
    probes = fit_probes(HiddenStates(resid, idx, idx, labels + 10))
    assert probes.classes.tolist() == [10, 11, 12]
    assert probes.loss(HiddenStates(resid, idx, idx, labels + 10)).item() < 0.1


def test_probe_layerwise_formula():
    result = probe_layerwise(torch.tensor([1.0, 1.0]), torch.tensor([3.0, 0.5]), torch.tensor([2.0, 2.0]))
    assert result.erasure[0].item() == pytest.approx(0.5, rel=1e-6)
    assert result.weight.tolist() == [2.0, 0.0]

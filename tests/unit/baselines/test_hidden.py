"""uds_lens/baselines/hidden.py: residuals at the UDS read positions, one row per entity token, any model kind."""

from __future__ import annotations

import pytest
import torch

from uds_lens.baselines.hidden import collect_hidden_states
from uds_lens.checkpoints.loader import load_hf_model
from uds_lens.sources import as_source


def test_layout_follows_the_read_positions(trio, trio_hidden):
    hidden = trio_hidden["full"]
    n_rows = sum(e.n_entity_tokens for e in trio.encoded)
    assert hidden.resid.shape == (3, n_rows, 32) and hidden.resid.dtype == torch.float32
    assert hidden.n_layers == 3
    assert hidden.example_ids == [e.idx for e in trio.encoded]
    assert hidden.example_idx.tolist() == [e.idx for e in trio.encoded for _ in e.labels]
    assert hidden.position.tolist() == [p for e in trio.encoded for p in e.read_positions]
    assert hidden.label.tolist() == [t for e in trio.encoded for t in e.labels]


def test_rows_are_the_models_residual_at_those_positions(trio, trio_hidden):
    """Each row is ``resid_post`` of its example at its position; the last layer is the pre-final-norm residual."""
    model = trio.models["full"]
    hidden = trio_hidden["full"]
    example = trio.encoded[1]
    _, cache = model.run_with_cache(torch.tensor([example.input_ids]))
    rows = (hidden.example_idx == example.idx).nonzero()[:, 0]
    for layer in range(hidden.n_layers):
        expected = cache[f"blocks.{layer}.hook_resid_post"][0, list(example.read_positions)]
        torch.testing.assert_close(hidden.resid[layer, rows], expected, atol=1e-5, rtol=0)
    normed = model.ln_final(cache["blocks.2.hook_resid_post"])[0, list(example.read_positions)]
    assert (hidden.resid[-1, rows] - normed).abs().max() > 1e-2


def test_batch_size_and_model_kind_do_not_matter(trio, trio_hidden):
    reference = trio_hidden["full"]
    one_by_one = collect_hidden_states(trio.models["full"], trio.encoded, batch_size=1)
    torch.testing.assert_close(one_by_one.resid, reference.resid, atol=1e-5, rtol=1e-5)
    hf = load_hf_model(trio.paths["full"], dtype=torch.float32, device="cpu")
    for model in (hf, as_source(hf)):
        from_hf = collect_hidden_states(model, trio.encoded, batch_size=4)
        torch.testing.assert_close(from_hf.resid, reference.resid, atol=1e-4, rtol=1e-4)
        assert torch.equal(from_hf.label, reference.label)


def test_per_example_mean(trio_hidden):
    hidden = trio_hidden["full"]
    values = torch.arange(hidden.n_layers * hidden.resid.shape[1], dtype=torch.float32).reshape(
        hidden.n_layers, -1
    )
    means = hidden.per_example_mean(values)
    assert means.shape == (len(hidden.example_ids), hidden.n_layers)
    rows = hidden.example_rows()
    for i, idx in enumerate(hidden.example_ids):
        assert (hidden.example_idx[rows == i] == idx).all()
        torch.testing.assert_close(means[i], values[:, rows == i].mean(dim=1))


def test_no_examples_is_an_error(trio):
    with pytest.raises(ValueError, match="no examples"):
        collect_hidden_states(trio.models["full"], [])

"""How a run fails loudly on a non-finite score (out-of-memory handling is `uds_lens.memory`).

A NaN/inf score is never cached or saved but raised as `NonFiniteScoreError`, whose message names the model,
the examples, the first layer where activations stop being finite and the fix that fits the cause.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from uds_lens.checkpoints.digests import named_weights
from uds_lens.data import EncodedExample
from uds_lens.sources import as_source
from uds_lens.tl_compat import ModelLike


class NonFiniteScoreError(FloatingPointError):
    """A model produced NaN/inf scores: the message names the model, the examples, the first layer and the fix."""


def _first_nonfinite_layer(model: ModelLike, example: EncodedExample) -> int | None:
    """The first block whose output (``resid_post``) is non-finite on ``example``, or None when all are finite."""
    source = as_source(model)
    n_layers = source.n_layers
    acts = source.activations(torch.tensor([list(example.input_ids)]), "resid_post", range(n_layers))
    bad = [layer for layer in range(n_layers) if not bool(torch.isfinite(acts[layer]).all())]
    return bad[0] if bad else None


def _first_nonfinite_parameter(model: ModelLike) -> str | None:
    # parameters only (buffers such as an attention mask's -inf are on purpose), by their Hugging Face names
    for name, tensor in named_weights(model):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def require_finite(
    values: torch.Tensor,
    examples: Sequence[EncodedExample],
    layers: Sequence[int],
    model: ModelLike,
    role: str,
    label: str | None,
    what: str,
) -> None:
    """Raise `nonfinite_error` when a batch's scores (``values``: ``[example]`` or ``[example, layer of
    layers]``, one row per example of ``examples``) hold NaN/inf."""
    bad = ~torch.isfinite(values)
    if not bad.any():
        return
    rows = bad.reshape(len(examples), -1).any(-1)
    first_row = int(torch.nonzero(rows)[0, 0])
    idx = [examples[row].idx for row in torch.nonzero(rows)[:, 0].tolist()]
    columns = torch.nonzero(bad.reshape(len(examples), -1).any(0))[:, 0].tolist()
    score_layer = layers[columns[0]] if values.dim() == 2 else None
    raise nonfinite_error(model, role, label, what, idx, examples[first_row], score_layer)


def nonfinite_error(
    model: ModelLike,
    role: str,
    label: str | None,
    what: str,
    idx: Sequence[int],
    example: EncodedExample,
    score_layer: int | None,
) -> NonFiniteScoreError:
    """The error for non-finite scores of one stage: which model, which examples, the first layer where the
    activations (or, failing that, the scores) stop being finite, and advice that fits the cause: broken weights,
    an overflow in a 16-bit dtype, or activations that blow up in float32 with finite weights."""
    layer = _first_nonfinite_layer(model, example)
    where = (
        f"first at layer {layer} (blocks.{layer}.hook_resid_post)"
        if layer is not None
        else f"first in the scores of layer {score_layer}"
        if score_layer is not None
        else ""
    )
    parameter = _first_nonfinite_parameter(model)
    dtype = as_source(model).dtype
    if parameter is not None:
        advice = (
            f"its weights are already non-finite ({parameter}): the checkpoint is broken (a diverged training "
            "run or a bad conversion); re-export or retrain it"
        )
    elif dtype in (torch.float16, torch.bfloat16):
        advice = (
            f"its weights are finite, so the activations overflow in {str(dtype).replace('torch.', '')}: run "
            "in float32 (--dtype float32, or UDSConfig(dtype='float32'))"
        )
    else:
        advice = (
            f"its weights are finite and it already runs in {str(dtype).replace('torch.', '')}, so its "
            "activations blow up on these inputs: check how the checkpoint was trained (a diverged run gives "
            "such weights)"
        )
    return NonFiniteScoreError(
        f"The {role} model ({label or type(model).__name__}) gives a non-finite {what} for example idx "
        f"{list(idx)[:10]}{', ' + where if where else ''}: {advice}. Nothing was cached or saved."
    )

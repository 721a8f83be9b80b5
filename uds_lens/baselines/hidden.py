"""Hidden states at the UDS read positions, every layer, one forward per model.

The representation baselines (logit and tuned lens, CKA, RSA, SVCCA/PWCCA, linear probing) all read the residual
stream at the positions UDS scores: for example ``i`` with prompt length ``P`` and entity span ``[s, e)`` in the
reference, the positions ``P - 1 + s .. P - 1 + e - 1``, whose logits predict the entity tokens. For layer
``l < L - 1`` the vector is the output of block ``l`` (``blocks.l.hook_resid_post``, Hugging Face
``hidden_states[l + 1]``); for the last layer it is the **pre-final-norm** residual (TransformerLens
``blocks.{L-1}.hook_resid_post``; ``sources.ActivationSource.residual_stream`` reads both model kinds that way). All read positions of all examples are stacked on one ``token`` axis, with an index saying
which example and position each row came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from uds_lens.readout import segment_mean
from uds_lens.sources import SourceLike, as_source

DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class HiddenStates:
    """Residual-stream vectors of one model at the read positions of a set of examples.

    Attributes:
        resid: fp32 residual per layer and read position (rows of all examples stacked in order).
        example_idx: Dataset ``idx`` of the example each row belongs to.
        position: Sequence position of each row.
        label: The entity token the logits at that position predict.
    """

    resid: Float[Tensor, "layer token d_model"]
    example_idx: Int[Tensor, " token"]
    position: Int[Tensor, " token"]
    label: Int[Tensor, " token"]

    @property
    def n_layers(self) -> int:
        """Number of layers (blocks) the states were read at."""
        return int(self.resid.shape[0])

    @property
    def example_ids(self) -> list[int]:
        """Dataset indices of the examples in row order, each once."""
        return list(dict.fromkeys(self.example_idx.tolist()))

    def example_rows(self) -> Int[Tensor, " token"]:
        """Row -> 0-based position of its example in ``example_ids`` (for scatter/segment means)."""
        order = {idx: i for i, idx in enumerate(self.example_ids)}
        return torch.tensor([order[i] for i in self.example_idx.tolist()], dtype=torch.long)

    def per_example_mean(self, values: Float[Tensor, "layer token"]) -> Float[Tensor, "example layer"]:
        """Mean of a per-row quantity over each example's rows (the UDS "mean over entity tokens"), summed in fp64."""
        return segment_mean(values, self.example_rows(), len(self.example_ids), dtype=torch.float64).T.float()


def _read_layout(examples: Sequence[Any]) -> tuple[list[int], list[int], list[int], list[int]]:
    example_idx, batch_row, positions, labels = [], [], [], []
    for row, example in enumerate(examples):
        read = list(example.read_positions)
        example_idx += [int(example.idx)] * len(read)
        batch_row += [row] * len(read)
        positions += read
        labels += [int(t) for t in example.labels]
    return example_idx, batch_row, positions, labels


def _pad(examples: Sequence[Any], pad_id: int) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    longest = max(len(example.input_ids) for example in examples)
    tokens = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        tokens[row, : len(example.input_ids)] = torch.tensor(example.input_ids, dtype=torch.long)
        mask[row, : len(example.input_ids)] = 1
    return tokens, mask


@torch.no_grad()
def collect_hidden_states(
    model: SourceLike, examples: Sequence[Any], batch_size: int = DEFAULT_BATCH_SIZE, pad_id: int = 0
) -> HiddenStates:
    """One forward of ``model`` over ``examples``; keep every layer's residual at the read positions.

    Args:
        model: Anything ``sources.as_source`` takes (``TransformerBridge``, Hugging Face model, NF4).
        examples: Encoded examples (``uds_lens.data.EncodedExample`` or anything with ``idx``, ``input_ids``,
            ``read_positions`` and ``labels``).
        batch_size: Examples per forward (right padding; results do not depend on it).
        pad_id: Token id used for padding (never read: the model is causal and padding comes last).

    Returns:
        The stacked states, on CPU in fp32.
    """
    if not examples:
        raise ValueError(
            "collect_hidden_states got no examples: every example was skipped or the data is empty"
        )
    source = as_source(model)
    chunks = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        tokens, mask = _pad(batch, pad_id)
        _, rows, positions, _ = _read_layout(batch)
        chunks.append(source.residuals_at(tokens, mask, torch.tensor(rows), torch.tensor(positions)))
    example_idx, _, positions, labels = _read_layout(examples)
    return HiddenStates(
        resid=torch.cat(chunks, dim=1),
        example_idx=torch.tensor(example_idx, dtype=torch.long),
        position=torch.tensor(positions, dtype=torch.long),
        label=torch.tensor(labels, dtype=torch.long),
    )

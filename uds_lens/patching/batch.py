"""The batch layout of the patched runs: a padded batch of examples, and its windows packed into flat rows.

``PatchBatch`` says where each example is patched and read; ``WindowPacking`` lays the tokens that a run
recomputes (each example's window) side by side with no padding; ``CleanRun`` is what the fast engine keeps
from the clean forward of one batch, in that layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from uds_lens.config import SCOPES, Scope, Site
from uds_lens.data import EncodedExample


@dataclass
class PatchBatch:
    """A right-padded batch of encoded examples and where to patch and read in it.

    Sequences are cut after the last read position. Right padding leaves every real position's activations
    unchanged (causal attention; pads come after), so no attention mask is needed.
    """

    examples: list[EncodedExample]
    scope: Scope
    tokens: Int[Tensor, "batch pos"]
    patch_mask: Bool[Tensor, "batch pos"]
    window_start: Int[Tensor, " batch"]
    window_len: Int[Tensor, " batch"]
    read_batch: Int[Tensor, " entity"]
    read_pos: Int[Tensor, " entity"]
    read_label: Int[Tensor, " entity"]

    @property
    def size(self) -> int:
        return len(self.examples)

    @property
    def max_window(self) -> int:
        return int(self.window_len.max())

    @property
    def input_length(self) -> int:
        """The longest whole input (prompt + reference) of the batch, cut or not: the length of the model's own
        forward on the uncut batch, from which a length-dependent rotary embedding (Phi-3's long rope, dynamic
        NTK) chooses its frequencies."""
        return max(len(example.input_ids) for example in self.examples)

    def select(self, rows: Sequence[int]) -> PatchBatch:
        """The examples at ``rows`` (ascending) as a batch of their own, padded as this one (same width): their
        tokens, patch and read positions are unchanged, so every number of theirs is computed on the same inputs."""
        if list(rows) != sorted(set(rows)) or not rows or rows[-1] >= self.size:
            raise ValueError(
                f"rows must be distinct ascending rows of this batch of {self.size}, got {rows}."
            )
        device = self.tokens.device
        index = torch.tensor(list(rows), dtype=torch.long, device=device)
        new_row = torch.full((self.size,), -1, dtype=torch.long, device=device)
        new_row[index] = torch.arange(len(rows), device=device)
        kept = new_row[self.read_batch] >= 0
        return PatchBatch(
            examples=[self.examples[row] for row in rows],
            scope=self.scope,
            tokens=self.tokens[index],
            patch_mask=self.patch_mask[index],
            window_start=self.window_start[index],
            window_len=self.window_len[index],
            read_batch=new_row[self.read_batch[kept]],
            read_pos=self.read_pos[kept],
            read_label=self.read_label[kept],
        )

    def to(self, device: str | torch.device) -> PatchBatch:
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self.__dict__.items()}
        return PatchBatch(**moved)  # type: ignore[arg-type]  # same fields, tensors moved


def pad_batch(
    examples: Sequence[EncodedExample], pad_id: int, scope: Scope = "span", cut: bool = True
) -> PatchBatch:
    """Right-pad encoded examples into a ``PatchBatch``.

    With ``cut`` (the fast engine), sequences end at the last read position: nothing after it can change a read
    logit. ``cut=False`` keeps the whole prompt + reference, as the published implementation (and so the naive
    engine) runs it; the numbers are the same either way.
    """
    if scope not in SCOPES:
        raise ValueError(f"Unknown patch scope {scope!r}; use one of {SCOPES}.")
    lengths = [ex.read_positions.stop if cut else len(ex.input_ids) for ex in examples]
    tokens = torch.full((len(examples), max(lengths)), pad_id, dtype=torch.long)
    patch_mask = torch.zeros(tokens.shape, dtype=torch.bool)
    read_batch, read_pos, read_label, window_start, window_len = [], [], [], [], []
    for row, ex in enumerate(examples):
        tokens[row, : lengths[row]] = torch.tensor(ex.input_ids[: lengths[row]])
        patched = ex.patch_positions(scope)
        patch_mask[row, patched.start : patched.stop] = True
        window = ex.window(scope)
        window_start.append(window.start)
        window_len.append(len(window))
        read_batch += [row] * ex.n_entity_tokens
        read_pos += list(ex.read_positions)
        read_label += list(ex.labels)
    return PatchBatch(
        examples=list(examples),
        scope=scope,
        tokens=tokens,
        patch_mask=patch_mask,
        window_start=torch.tensor(window_start),
        window_len=torch.tensor(window_len),
        read_batch=torch.tensor(read_batch),
        read_pos=torch.tensor(read_pos),
        read_label=torch.tensor(read_label),
    )


@dataclass
class WindowPacking:
    """Where the window tokens of a batch sit when packed into one flat run of rows (no padding).

    Row ``r`` is position ``position[r]`` of example ``example[r]``, ``offset[r]`` tokens into its window; rows are
    example by example, in position order. The fast engine runs its linear layers (norms, projections, MLPs, the
    unembedding) on these rows only, and lays them out per example (``width`` = the longest window) only inside
    attention, where padding costs little.
    """

    example: Int[Tensor, " row"]
    offset: Int[Tensor, " row"]
    position: Int[Tensor, " row"]
    patched: Bool[Tensor, " row"]
    read_row: Int[Tensor, " entity"]
    width: int
    prefix_len: int
    start: Int[Tensor, " batch"]

    @property
    def rows(self) -> int:
        return int(self.example.shape[0])

    @classmethod
    def spans(
        cls,
        start: Int[Tensor, " batch"],
        length: Int[Tensor, " batch"],
        patch_mask: Bool[Tensor, "batch pos"],
        read_batch: Int[Tensor, " entity"],
        read_pos: Int[Tensor, " entity"],
    ) -> WindowPacking:
        """Pack positions ``[start_b, start_b + length_b)`` of every example ``b``."""
        n_batch = int(start.shape[0])
        width = int(length.max())
        device = start.device
        offsets = torch.arange(width, device=device)
        valid = offsets[None, :] < length[:, None]
        positions = torch.where(
            valid, start[:, None] + offsets[None, :], torch.zeros_like(valid, dtype=torch.long)
        )
        row_of = torch.full((n_batch, width), -1, dtype=torch.long, device=device)
        row_of[valid] = torch.arange(int(valid.sum()), device=device)
        return cls(
            example=torch.arange(n_batch, device=device)[:, None].expand(n_batch, width)[valid],
            offset=offsets[None, :].expand(n_batch, width)[valid],
            position=positions[valid],
            patched=patch_mask.gather(1, positions)[valid],
            read_row=row_of[read_batch, read_pos - start[read_batch]],
            width=width,
            prefix_len=int(start.max()),
            start=start,
        )

    @classmethod
    def of(cls, batch: PatchBatch) -> WindowPacking:
        """The windows of a batch (what the patched runs recompute)."""
        return cls.spans(
            batch.window_start, batch.window_len, batch.patch_mask, batch.read_batch, batch.read_pos
        )

    @classmethod
    def sequences(cls, batch: PatchBatch) -> WindowPacking:
        """Whole sequences through the last read position (what a clean or source forward runs)."""
        stop = batch.window_start + batch.window_len
        return cls.spans(torch.zeros_like(stop), stop, batch.patch_mask, batch.read_batch, batch.read_pos)

    def rows_in(self, outer: WindowPacking) -> Int[Tensor, " row"]:
        """Index of each of this packing's rows among the rows of ``outer`` (a packing of whole sequences)."""
        lengths = torch.zeros(int(outer.start.shape[0]), dtype=torch.long, device=outer.example.device)
        lengths.index_add_(0, outer.example, torch.ones_like(outer.example))
        first_row = torch.cumsum(lengths, 0) - lengths
        return first_row[self.example] + self.position


@dataclass
class CleanRun:
    """What the fast engine reuses from the full model's clean forward on one batch.

    ``keys``/``values`` hold each block's rotated keys and values of the prefix (positions before the latest window
    start; only those before an example's own window are read), laid out ``[batch, kv_head, prefix, d_head]`` as the
    window attention reads them. ``window_acts`` holds clean activations at the packed window rows
    (``WindowPacking``), the site's own among them, which is all the fast baseline needs. The naive engine keeps only
    the scores.
    """

    site: Site
    scores: Float[Tensor, " batch"]
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    window_acts: dict[str, Float[Tensor, "layer row d_model"]] = field(default_factory=dict)


def window_sites(site: Site) -> tuple[Site, ...]:
    """Clean activations the fast engine needs at window positions to rebuild a patched layer."""
    needed: dict[Site, tuple[Site, ...]] = {
        "resid_post": ("resid_post",),
        "resid_pre": ("resid_pre",),
        "resid_mid": ("resid_mid",),
        "attn_out": ("attn_out", "resid_pre"),
        "mlp_out": ("mlp_out", "resid_mid"),
    }
    return needed[site]


__all__ = ["CleanRun", "PatchBatch", "WindowPacking", "pad_batch"]

"""Component axes: the patch of one layer split into heads, entity tokens or patched positions, one table row each.

UDS patches one hook site per layer and reads the span's mean entity log-prob. Component patching makes the same
patch finer: a layer's patch becomes several patched runs, or one run read more finely, and the scores gain a last
axis ``[example, layer, component]``. What differs between the axes is five small things, so each axis is one row of
AXIS_PATCHES (TransformerLens's `patching.py` keeps its patches the same
way: small setter functions, combined with `functools.partial`):

| axis       | width (components)              | runs of one layer     | mask of a run                     | setter       | read                  |
| ---------- | ------------------------------- | --------------------- | --------------------------------- | ------------ | --------------------- |
| `head`     | the model's heads               | one per head          | the patched positions (or all)    | one head     | the example's mean    |
| `token`    | the longest entity              | one, the whole span   | the patched positions             | whole vector | each entity token     |
| `position` | the most patched positions      | one per position      | the example's n-th patched one    | whole vector | the example's mean    |

A run writes the source's activation at hook point ``blocks.{l}.{point}`` into the full model where its mask says
(``setter``), and ``read`` turns the run's per-token log-probs into ``[example, component]`` columns: the span's
mean in the run's own column, or every entity token in its own. The unpatched run read the same way is the baseline;
its span mean is S0. ``labels`` name each component of an example (the head's number, the token's text).

The engines run the rows (``PatchEngine.axis_scores``): the naive engine runs every row with TransformerLens hooks,
one forward per (layer, run); the fast engine runs head patching at the patched positions. A head's output enters
the residual stream only through the attention output, ``attn_out = sum_h z_h W_O[h] + b_O``
(``result_h = z_h W_O[h]`` is TransformerLens's ``hook_result``), so patching head ``h`` is exactly patching
``attn_out`` with ``clean attn_out + (z_src,h - z_full,h) W_O[h]`` (for ``hook_z``; ``hook_result`` uses the source's
own ``W_O``): one fast-engine call per head at site ``attn_out`` over all layers
(head_attn_out_patches). Where the family normalises the
attention's output before adding it (Gemma's and OLMo 2's post-attention norm), the patched ``attn_out`` is that norm
of the patched sum ``attn.hook_out + change``. ``naive_only`` says why a row runs on the naive engine only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal, TypeAlias

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from uds_lens.config import Scope
from uds_lens.data import EncodedExample
from uds_lens.families import family_of
from uds_lens.patching.batch import PatchBatch
from uds_lens.patching.kernels import attention_output_norm, wrapped_model
from uds_lens.readout import label_logprobs, segment_mean
from uds_lens.sources import as_source, hook_name
from uds_lens.tl_compat import HookPoint, TLModel, attn_result

Axis: TypeAlias = Literal["head", "token", "position"]
"""What a component result indexes after ``[example, layer]``: one attention head, one entity token, one patched
position."""
Positions: TypeAlias = Literal["patched", "all"]
"""Where head patching writes: the example's patched positions (the UDS window) or every position."""

AXES: tuple[Axis, ...] = ("head", "token", "position")

HEAD_HOOKS = {"z": "attn.hook_z", "result": "attn.hook_result"}
"""Per-head hook points (TransformerLens names inside ``blocks.{l}``): ``[batch, pos, head, d]``."""

# ----------------------------------------------------------------------------------------------------------------
# The small pieces a row is made of


def entity_token_ids(example: EncodedExample, scope: Scope) -> list[int]:
    """The entity tokens (the labels read)."""
    return list(example.labels)


def patched_token_ids(example: EncodedExample, scope: Scope) -> list[int]:
    """The tokens at the patched positions."""
    return [example.input_ids[position] for position in example.patch_positions(scope)]


def head_count(full: TLModel, examples: Sequence[EncodedExample], scope: Scope) -> int:
    """The width of the head axis: the full model's attention heads."""
    return int(full.cfg.n_heads)


def most_tokens(
    full: TLModel,
    examples: Sequence[EncodedExample],
    scope: Scope,
    ids_of: Callable[[EncodedExample, Scope], list[int]],
) -> int:
    """The width of a token-valued axis: the most tokens ``ids_of`` names in one example (the longest entity, the
    most patched positions)."""
    return max(len(ids_of(example, scope)) for example in examples)


def each_component(width: int) -> Sequence[int | None]:
    """One patched run per component (a head, a position)."""
    return range(width)


def whole_span(width: int) -> Sequence[int | None]:
    """One patched run, the usual span patch, read per component (``None``: no one component is patched alone)."""
    return (None,)


def patched_positions(batch: PatchBatch, component: int | None) -> Bool[Tensor, "batch pos"]:
    """The positions UDS patches (the batch's scope), for every component."""
    return batch.patch_mask


def every_position(batch: PatchBatch, component: int | None) -> Bool[Tensor, "batch pos"]:
    """Every position, as TransformerLens's ``get_act_patch_attn_head_out_all_pos`` patches."""
    return torch.ones_like(batch.patch_mask)


def nth_patched_position(batch: PatchBatch, component: int | None) -> Bool[Tensor, "batch pos"]:
    """Each example's ``component``-th patched position (no position for an example with fewer)."""
    mask = torch.zeros_like(batch.patch_mask)
    for row, example in enumerate(batch.examples):
        patched = example.patch_positions(batch.scope)
        if component is not None and component < len(patched):
            mask[row, patched[component]] = True
    return mask


def whole_vector(activation: Tensor, component: int | None) -> Tensor:
    """The part of an activation a span patch writes: all of it."""
    return activation


def one_head(activation: Tensor, component: int | None) -> Tensor:
    """The part of a ``[batch, pos, head, d_head]`` activation a head patch writes: head ``component`` (a view)."""
    return activation[:, :, component]


def overwrite(
    activation: Float[Tensor, "batch pos *rest"],
    hook: HookPoint,
    source: Float[Tensor, "batch pos *rest"],
    mask: Bool[Tensor, "batch pos"],
    component: int | None,
    part: Callable[[Tensor, int | None], Tensor],
) -> Float[Tensor, "batch pos *rest"]:
    """A TransformerLens hook: ``part`` of the activation (all of it, one head) replaced by the source's at
    ``mask``; the rest, and every other position, left alone."""
    patched = activation.clone()
    part(patched, component)[mask] = part(source, component)[mask].to(activation.dtype)
    return patched


span_setter = partial(overwrite, part=whole_vector)
head_setter = partial(overwrite, part=one_head)


def example_means(
    values: Float[Tensor, " entity"], batch: PatchBatch, width: int
) -> Float[Tensor, "batch component"]:
    """Each example's mean over its entity tokens (its span score), the same in every column."""
    return segment_mean(values, batch.read_batch, batch.size)[:, None].expand(-1, width)


def entity_token_grid(
    values: Float[Tensor, " entity"], batch: PatchBatch, width: int
) -> Float[Tensor, "batch component"]:
    """Each entity token's value in its own column (NaN past an example's last entity token)."""
    first = torch.full((batch.size,), 1 << 30, device=values.device).scatter_reduce(
        0, batch.read_batch, batch.read_pos, reduce="amin"
    )
    offset = batch.read_pos - first[batch.read_batch]
    grid = torch.full((batch.size, width), math.nan, device=values.device)
    grid[batch.read_batch, offset] = values
    return grid


def head_labels(
    example: EncodedExample, tokenizer: PreTrainedTokenizerBase, scope: Scope, width: int
) -> list[str]:
    """The heads' numbers."""
    return [str(head) for head in range(width)]


def decoded_labels(
    example: EncodedExample,
    tokenizer: PreTrainedTokenizerBase,
    scope: Scope,
    width: int,
    ids_of: Callable[[EncodedExample, Scope], list[int]],
) -> list[str]:
    """The text of each component's token (``ids_of``), ``""`` past the example's last one."""
    names = [str(tokenizer.decode([token])) for token in ids_of(example, scope)]
    return names + [""] * (width - len(names))


# ----------------------------------------------------------------------------------------------------------------
# The table


Width = Callable[[TLModel, Sequence[EncodedExample], Scope], int]
Runs = Callable[[int], Sequence[int | None]]
Mask = Callable[[PatchBatch, int | None], Tensor]
Setter = Callable[..., Tensor]
Read = Callable[[Tensor, PatchBatch, int], Tensor]
Labels = Callable[[EncodedExample, PreTrainedTokenizerBase, Scope, int], list[str]]


@dataclass(frozen=True)
class AxisPatch:
    """How one component axis patches a layer and reads the runs (the module docstring has the table).

    Attributes:
        axis: the axis name (the result's last tensor axis).
        positions: where the patch writes, ``"patched"`` (the UDS window) or ``"all"``.
        width: the number of components, from the full model, the examples and the patch scope.
        runs: the patched runs of one layer, each the component it patches alone (``None``: the whole span).
        mask: ``[batch, pos]`` where a run writes.
        setter: the TransformerLens hook body: ``setter(activation, hook, source=, mask=, component=)``.
        read: a run's per-token log-probs ``[entity]`` -> ``[batch, component]`` columns.
        labels: the components' names of one example.
        naive_only: why only the naive engine runs this patch (``None``: every engine does).
    """

    axis: Axis
    positions: Positions
    width: Width
    runs: Runs
    mask: Mask
    setter: Setter
    read: Read
    labels: Labels
    naive_only: str | None = None

    def patched_runs(
        self, batch: PatchBatch, width: int
    ) -> Iterator[tuple[int | None, Bool[Tensor, "batch pos"]]]:
        """The runs of one layer that patch something in ``batch``: ``(component, mask)`` each."""
        for component in self.runs(width):
            mask = self.mask(batch, component)
            if mask.any():
                yield component, mask

    def write(
        self,
        scores: Float[Tensor, "batch component"],
        logprobs: Float[Tensor, " entity"],
        batch: PatchBatch,
        width: int,
        component: int | None,
        mask: Bool[Tensor, "batch pos"],
    ) -> None:
        """Write one run's read (``logprobs``, per entity token) into ``scores``: the run's own column, or every
        column for a run of the whole span, on the examples it patched (the others keep what they hold)."""
        rows = mask.any(-1)
        column = slice(None) if component is None else component
        scores[rows, column] = self.read(logprobs, batch, width)[rows][:, column]

    def at_every_position(self) -> AxisPatch:
        """This patch written at every position, not only the patched ones (naive engine only)."""
        return replace(
            self,
            positions="all",
            mask=every_position,
            naive_only="The fast engine recomputes only the patched window; positions='all' needs engine='naive'.",
        )


AXIS_PATCHES: dict[Axis, AxisPatch] = {
    "head": AxisPatch(
        axis="head",
        positions="patched",
        width=head_count,
        runs=each_component,
        mask=patched_positions,
        setter=head_setter,
        read=example_means,
        labels=head_labels,
    ),
    "token": AxisPatch(
        axis="token",
        positions="patched",
        width=partial(most_tokens, ids_of=entity_token_ids),
        runs=whole_span,
        mask=patched_positions,
        setter=span_setter,
        read=entity_token_grid,
        labels=partial(decoded_labels, ids_of=entity_token_ids),
        naive_only="The fast engine reads each example's span mean, not each entity token: token patching needs "
        "engine='naive'.",
    ),
    "position": AxisPatch(
        axis="position",
        positions="patched",
        width=partial(most_tokens, ids_of=patched_token_ids),
        runs=each_component,
        mask=nth_patched_position,
        setter=span_setter,
        read=example_means,
        labels=partial(decoded_labels, ids_of=patched_token_ids),
        naive_only="The fast engine patches the whole window of an example, not one position of it: position "
        "patching needs engine='naive'.",
    ),
}
"""One row per component axis: what ``patch_heads``, ``patch_tokens`` and ``patch_positions`` run."""


@dataclass
class AxisScores:
    """One batch's scores along a component axis (what ``PatchEngine.axis_scores`` returns).

    Attributes:
        s0: ``[batch]`` the clean score.
        baseline: ``[batch, layer, component]`` the unpatched score, read as the patched ones are.
        scores: ``[batch, layer, component]`` the patched scores (NaN where a component does not exist).
    """

    s0: Float[Tensor, " batch"]
    baseline: Float[Tensor, "batch layer component"]
    scores: Float[Tensor, "batch layer component"]

    def cpu(self) -> AxisScores:
        """The scores as float32 on the CPU (what a result keeps)."""
        return AxisScores(self.s0.float().cpu(), self.baseline.float().cpu(), self.scores.float().cpu())


# ----------------------------------------------------------------------------------------------------------------
# Activations read for the runs


def cached_activations(
    model: TLModel,
    tokens: Tensor,
    names: set[str],
    use_attn_result: bool = False,
    published_compat: bool = False,
) -> dict[str, Tensor]:
    """Activations of ``model`` at hook points ``names`` (one forward, no gradients), on the tokens' device.

    With ``published_compat`` each is what UDS patches in that mode (``ActivationSource.published_compat_activation``:
    the final-norm output at the last layer's ``resid_post``)."""
    with attn_result(model, use_attn_result), torch.no_grad():
        _, cache = model.run_with_cache(tokens.to(model.cfg.device), names_filter=lambda name: name in names)
    acts = {name: cache[name].to(tokens.device) for name in names}
    if published_compat:
        source = as_source(model)
        acts = {name: source.published_compat_activation(name, value) for name, value in acts.items()}
    return acts


def hooked_token_logprobs(
    full: TLModel, batch: PatchBatch, hooks: list[tuple[str, Callable[..., Tensor]]], upcast: bool = True
) -> Float[Tensor, " entity"]:
    """Each entity token's log-prob in ``full``'s forward with ``hooks`` (``run_with_hooks``: its hooks are removed
    even on error; the whole logits, as TransformerLens makes them, read at the read positions)."""
    with torch.no_grad():
        logits = full.run_with_hooks(batch.tokens, fwd_hooks=hooks)
    return label_logprobs(logits[batch.read_batch, batch.read_pos], batch.read_label, upcast)


def head_attn_out_patches(
    full: TLModel, source: TLModel, batch: PatchBatch, point: str, layers: Sequence[int]
) -> Iterator[Float[Tensor, "layer batch pos d_model"]]:
    """Per head ``h`` (in order), the full model's ``attn_out`` of every layer of ``layers`` with head ``h``'s output
    taken from ``source`` (``point``: ``attn.hook_z`` through full's ``W_O``, ``attn.hook_result`` through the
    source's own): what the fast engine patches at site ``attn_out`` (the module docstring has the identity)."""
    # The head outputs add up to the attention's output (``attn.hook_out``); where the family normalises that
    # before adding it to the residual (Gemma, OLMo 2), the patched ``attn_out`` is the norm of the patched sum.
    family = family_of(wrapped_model(full).config)
    post_norm = family is not None and family.norm != "pre"

    def out_name(layer: int) -> str:
        return f"blocks.{layer}.attn.hook_out" if post_norm else hook_name("attn_out", layer)

    z_names = {f"blocks.{layer}.attn.hook_z" for layer in layers}
    full_cache = cached_activations(full, batch.tokens, z_names | {out_name(layer) for layer in layers})
    source_cache = cached_activations(source, batch.tokens, z_names)
    for head in range(full.cfg.n_heads):
        acts = []
        for layer in layers:
            z_full = full_cache[f"blocks.{layer}.attn.hook_z"][:, :, head]
            z_source = source_cache[f"blocks.{layer}.attn.hook_z"][:, :, head].to(z_full.dtype)
            w_full = full.blocks[layer].attn.W_O[head]
            w_source = w_full if point == HEAD_HOOKS["z"] else source.blocks[layer].attn.W_O[head].to(w_full)
            change = einops.einsum(
                z_source, w_source, "batch pos d_head, d_head d_model -> batch pos d_model"
            ) - einops.einsum(z_full, w_full, "batch pos d_head, d_head d_model -> batch pos d_model")
            patched = full_cache[out_name(layer)] + change
            acts.append(attention_output_norm(full, layer, patched) if post_norm else patched)
        yield torch.stack(acts)


__all__ = [
    "AXES",
    "AXIS_PATCHES",
    "Axis",
    "AxisPatch",
    "AxisScores",
    "HEAD_HOOKS",
    "Positions",
    "cached_activations",
    "decoded_labels",
    "each_component",
    "entity_token_grid",
    "entity_token_ids",
    "every_position",
    "example_means",
    "head_attn_out_patches",
    "head_count",
    "head_labels",
    "head_setter",
    "hooked_token_logprobs",
    "nth_patched_position",
    "most_tokens",
    "one_head",
    "overwrite",
    "patched_positions",
    "patched_token_ids",
    "span_setter",
    "whole_span",
    "whole_vector",
]

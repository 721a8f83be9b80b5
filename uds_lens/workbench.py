"""The auditor's workbench for hooks of your own: one example's tensors, padded tokens, a tensor-valued patching
metric and the clean run's activations, all in the token layout UDS scores in; and component patching
(``uds_lens.components``) on the auditor's models and examples.

A [`UDSAuditor`][uds_lens.auditor.UDSAuditor] holds one (``auditor.workbench``) and hands these calls to it
(``auditor.example(3)``, ``auditor.metric(3)`` ...). It reads what the auditor set up (the encoded examples, the
settings, the full model, the tokenizer: a `WorkbenchContext`) and never runs a stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from uds_lens.checkpoints.loader import ModelArg
from uds_lens.component_result import ComponentResult
from uds_lens.components import (
    ExampleInputs,
    PatchContext,
    entity_metric,
    patch_heads,
    patch_positions,
    patch_tokens,
)
from uds_lens.data import Example, build_prompt
from uds_lens.patching.batch import pad_batch
from uds_lens.sources import as_source
from uds_lens.tl_compat import ActivationCache


class WorkbenchContext(PatchContext, Protocol):
    """What the workbench reads of its auditor: what component patching reads, the forget set's records and the
    read-out's dtype rule."""

    @property
    def examples(self) -> list[Example]:
        """The forget set's records (an example's question and entity, for `Workbench.example`)."""

    @property
    def upcast(self) -> bool:
        """Whether log-softmax runs in float32 (everywhere but published-compat)."""


class Workbench:
    """Inputs for hand-written hook experiments on an auditor's examples (the module docstring)."""

    def __init__(self, auditor: WorkbenchContext) -> None:
        self.auditor = auditor

    def example(self, idx: int) -> ExampleInputs:
        """One example as tensors for a hand-written hook experiment (``components.ExampleInputs``).

        ``tokens`` is ``[1, pos]`` (prompt + reference, BOS included: pass it to ``run_with_hooks`` as is, never
        through ``to_tokens``), ``read_positions``/``labels`` are where the entity tokens are predicted and which
        they are, ``patch_positions`` what UDS patches under this auditor's scope.
        """

        auditor = self.auditor
        encoded = auditor.select([idx])[0]
        record = next(e for e in auditor.examples if e.idx == idx)
        prompt, reference = build_prompt(record, auditor.config.published_compat) or ("", "")
        device = auditor.full.cfg.device
        return ExampleInputs(
            idx=idx,
            question=record.question,
            entity=record.entity,
            prompt=prompt,
            reference=reference,
            tokens=torch.tensor([encoded.input_ids], device=device),
            str_tokens=[str(auditor.tokenizer.decode([token])) for token in encoded.input_ids],
            read_positions=torch.tensor(list(encoded.read_positions), device=device),
            labels=torch.tensor(encoded.labels, device=device),
            patch_positions=torch.tensor(
                list(encoded.patch_positions(auditor.config.patch_scope)), device=device
            ),
        )

    def tokens(self, idxs: int | Sequence[int]) -> Tensor:
        """``[batch, pos]`` right-padded tokens of these examples (the layout [`metric`][uds_lens.workbench.Workbench.metric] reads)."""
        auditor = self.auditor
        chosen = auditor.select([idxs] if isinstance(idxs, int) else idxs)
        return pad_batch(chosen, auditor.pad_id, auditor.config.patch_scope, cut=False).tokens.to(
            auditor.full.cfg.device
        )

    def metric(self, idxs: int | Sequence[int], per_example: bool = False) -> Callable[[Tensor], Tensor]:
        """A tensor-valued patching metric for logits of [`tokens`][uds_lens.workbench.Workbench.tokens] ``(idxs)``: the mean entity log-prob.

        Works with ``run_with_hooks`` and as the ``patching_metric`` of ``transformer_lens.patching``'s
        ``get_act_patch_*`` (they call ``.item()`` on it, so it must return a tensor, never a float).

        Examples:
            >>> ex, metric = auditor.example(3), auditor.metric(3)
            >>> metric(auditor.full(ex.tokens))        # == the clean score S0 of example 3
        """

        auditor = self.auditor
        chosen = auditor.select([idxs] if isinstance(idxs, int) else idxs)
        batch = pad_batch(chosen, auditor.pad_id, auditor.config.patch_scope, cut=False)
        return entity_metric(
            batch.read_batch, batch.read_pos, batch.read_label, batch.size, per_example, upcast=auditor.upcast
        )

    def run_with_cache(
        self,
        idxs: int | Sequence[int],
        model: ModelArg | None = None,
        names_filter: Callable[[str], bool] | Sequence[str] | str | None = None,
    ) -> tuple[Tensor, ActivationCache]:
        """``(logits, ActivationCache)`` of the clean run of ``model`` (default ``full``) on these examples."""
        auditor = self.auditor
        target = auditor.full if model is None else as_source(auditor.load_source(model)).model
        with torch.no_grad():
            return target.run_with_cache(self.tokens(idxs).to(target.cfg.device), names_filter=names_filter)

    def patch_heads(self, unlearned: object, **kwargs: Any) -> ComponentResult:
        """Head-level UDS ``[example, layer, head]``: see [`uds_lens.components.patch_heads`][uds_lens.components.patch_heads]."""
        return patch_heads(self.auditor, unlearned, **kwargs)

    def patch_tokens(self, unlearned: object, **kwargs: Any) -> ComponentResult:
        """Per-entity-token UDS ``[example, layer, token]``: see [`uds_lens.components.patch_tokens`][uds_lens.components.patch_tokens]."""
        return patch_tokens(self.auditor, unlearned, **kwargs)

    def patch_positions(self, unlearned: object, **kwargs: Any) -> ComponentResult:
        """One patched position at a time ``[example, layer, position]``: [`uds_lens.components.patch_positions`][uds_lens.components.patch_positions]."""
        return patch_positions(self.auditor, unlearned, **kwargs)


__all__ = ["Workbench", "WorkbenchContext"]

"""Linear probing score: can a linear readout fitted on the full model still decode the entity from another model?

Per layer ``l`` a multinomial logistic probe ``y = softmax(W_l z + b_l)`` is fitted on the **full** model's residuals
at the UDS read positions (``z`` = the residual standardised with the full model's per-feature mean and std) to
predict the entity token each position predicts (the UDS labels, so the probe is aligned with UDS; Alain & Bengio,
2017). The same probe and the same standardisation then read the retain and the unlearned model's residuals at the
same positions, and the mean cross-entropy ``loss_m(l)`` of each model is retain-normalised (the "probe loss" form of
``seeds/representation-methods.md`` §4.3):

    erasure_l = clip((loss_unl - loss_full) / (loss_ret - loss_full + 1e-8), 0, 1),   weight_l = max(loss_ret - loss_full, 0)

and the model score is the weighted mean over layers. With ``folds > 1`` the probe is cross-fitted by example
(trained on the full model's other folds, evaluated on the held-out fold for all three models), which measures
decodability on unseen examples instead of how far the other model's geometry is from the full model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from uds_lens.baselines.hidden import HiddenStates
from uds_lens.baselines.layerwise import LayerwiseErasure

PROBE_EPS = 1e-8


@dataclass(frozen=True)
class LinearProbes:
    """Per-layer probes fitted on the full model (one set per fold).

    Attributes:
        classes: Entity-token ids the probes predict (column ``c`` of the logits is ``classes[c]``).
        fold_of_row: Fold of each read position (all 0 when fitted in-sample).
        weight: Probe weights per fold and layer.
        bias: Probe biases per fold and layer.
        mean: Standardisation mean per fold and layer (from the full model's training rows).
        std: Standardisation std per fold and layer.
        in_sample: True when the probe was fitted and evaluated on the same rows (``folds=1``).
    """

    classes: Int[Tensor, " cls"]
    fold_of_row: Int[Tensor, " token"]
    weight: Float[Tensor, "fold layer cls d_model"]
    bias: Float[Tensor, "fold layer cls"]
    mean: Float[Tensor, "fold layer d_model"]
    std: Float[Tensor, "fold layer d_model"]
    in_sample: bool

    def loss(self, hidden: HiddenStates) -> Float[Tensor, " layer"]:
        """Mean cross-entropy of the probes on ``hidden`` (each row scored by its fold's probe)."""
        targets = torch.searchsorted(self.classes, hidden.label)
        per_row = torch.empty(hidden.n_layers, hidden.resid.shape[1])
        for fold in range(self.weight.shape[0]):
            rows = self.fold_of_row == fold
            z = (hidden.resid[:, rows] - self.mean[fold][:, None]) / self.std[fold][:, None]
            logits = torch.einsum("lcd,ltd->ltc", self.weight[fold], z) + self.bias[fold][:, None]
            per_row[:, rows] = -torch.log_softmax(logits, dim=-1).gather(
                2, targets[rows][None, :, None].expand(hidden.n_layers, -1, 1)
            )[..., 0]
        return per_row.double().mean(dim=1).float()


def _fit_layer(
    z: Float[Tensor, "token d_model"],
    targets: Int[Tensor, " token"],
    n_classes: int,
    l2: float,
    max_iter: int,
) -> tuple[Float[Tensor, "cls d_model"], Float[Tensor, " cls"]]:
    weight = torch.zeros(n_classes, z.shape[1], requires_grad=True)
    bias = torch.zeros(n_classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ weight.T + bias, targets) + l2 * (weight**2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return weight.detach(), bias.detach()


def fit_probes(
    full: HiddenStates, folds: int = 1, l2: float = 1e-3, max_iter: int = 100, seed: int = 0
) -> LinearProbes:
    """Fit one linear entity-token probe per layer (and fold) on the full model's read-position residuals.

    Args:
        full: Full model's states at the read positions (labels = entity tokens).
        folds: 1 = fit on all rows (a learned fixed readout); k > 1 = cross-fit by example.
        l2: L2 penalty on the weights.
        max_iter: L-BFGS iterations per probe.
        seed: Seed of the example-to-fold assignment.
    """
    classes = torch.unique(full.label)
    targets = torch.searchsorted(classes, full.label)
    rows_of_example = full.example_rows()
    n_examples = len(full.example_ids)
    if folds > 1:
        if n_examples < folds:
            raise ValueError(f"cannot cross-fit {folds} folds on {n_examples} examples; lower folds")
        example_fold = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed)) % folds
        fold_of_row = example_fold[rows_of_example]
    else:
        fold_of_row = torch.zeros_like(rows_of_example)
    weights, biases, means, stds = [], [], [], []
    for fold in range(max(folds, 1)):
        train = fold_of_row != fold if folds > 1 else torch.ones_like(fold_of_row, dtype=torch.bool)
        layer_w, layer_b, layer_m, layer_s = [], [], [], []
        for layer in range(full.n_layers):
            x = full.resid[layer, train]
            mean, std = x.mean(dim=0), x.std(dim=0, correction=0).clamp(min=1e-6)
            w, b = _fit_layer((x - mean) / std, targets[train], classes.numel(), l2, max_iter)
            layer_w.append(w)
            layer_b.append(b)
            layer_m.append(mean)
            layer_s.append(std)
        weights.append(torch.stack(layer_w))
        biases.append(torch.stack(layer_b))
        means.append(torch.stack(layer_m))
        stds.append(torch.stack(layer_s))
    return LinearProbes(
        classes=classes,
        fold_of_row=fold_of_row,
        weight=torch.stack(weights),
        bias=torch.stack(biases),
        mean=torch.stack(means),
        std=torch.stack(stds),
        in_sample=folds <= 1,
    )


def probe_layerwise(
    loss_full: Float[Tensor, " layer"],
    loss_retain: Float[Tensor, " layer"],
    loss_unlearned: Float[Tensor, " layer"],
) -> LayerwiseErasure:
    """Retain-normalised probe-loss erasure from precomputed probe losses."""
    gap = loss_retain - loss_full
    erasure = ((loss_unlearned - loss_full) / (gap + PROBE_EPS)).clamp(0.0, 1.0)
    return LayerwiseErasure("linear_probe", erasure.float(), gap.clamp(min=0.0).float())


def linear_probe_score(
    full: HiddenStates,
    retain: HiddenStates,
    unlearned: HiddenStates,
    probes: LinearProbes | None = None,
    folds: int = 1,
) -> LayerwiseErasure:
    """Linear probing erasure of an unlearned model (``.score`` is the weighted mean over layers).

    Args:
        full: Full model's states at the read positions.
        retain: Retain model's states at the same positions.
        unlearned: Unlearned model's states at the same positions.
        probes: Probes already fitted on ``full`` (reuse across unlearned models); fitted here if None.
        folds: Folds when fitting here.
    """
    for name, states in (("retain", retain), ("unlearned", unlearned)):
        if not torch.equal(states.label, full.label) or not torch.equal(states.example_idx, full.example_idx):
            raise ValueError(
                f"{name} hidden states were read at other positions than full's; encode once, reuse"
            )
    probes = probes if probes is not None else fit_probes(full, folds=folds)
    return probe_layerwise(probes.loss(full), probes.loss(retain), probes.loss(unlearned))

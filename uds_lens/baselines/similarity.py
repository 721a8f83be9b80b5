"""Representation similarity baselines: linear CKA, RSA, SVCCA and PWCCA, as layerwise erasure scores.

Each compares, layer by layer, the matrix ``X_m`` (``token x d_model``) of model ``m``'s residuals at the UDS read
positions of all examples stacked (the dataset-level form of the published CKA baseline):

* **linear CKA** (Kornblith et al., 2019) on column-centred ``X, Y``:
  ``CKA = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)``, 0 if the denominator is below 1e-8;
* **RSA** (Kriegeskorte et al., 2008): Spearman correlation of the upper triangles of the two cosine-distance RDMs
  (``1 - cos(x_i, x_j)``); rows are example means of the read positions, so the RDM is example x example;
* **SVCCA** (Raghu et al., 2017): keep each matrix's top singular directions explaining 99% of the variance, then
  the mean canonical correlation; **PWCCA** (Morcos et al., 2018) weights each canonical correlation by how much of
  the reference representation (the retain model's) its canonical variate accounts for.

Every similarity ``S`` (1 = identical) becomes a retain-normalised layer erasure with the published CKA formula
(``uds_lens.layerwise.similarity_erasure``):
``e_l = clip((S(unl, ret) - S(full, ret)) / (1 - S(full, ret) + 1e-8), 0, 1)``, ``w_l = max(1 - S(full, ret), 0)``,
and the model score is the weighted mean over layers with ``w_l > 1e-8``. Similarities are computed in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float
from torch import Tensor

from uds_lens.baselines.hidden import HiddenStates
from uds_lens.baselines.layerwise import LayerwiseErasure, similarity_erasure

CKA_MIN_DENOMINATOR = 1e-8
SVCCA_KEEP_VARIANCE = 0.99

Similarity = Callable[[Tensor, Tensor], float]


def _centre(x: Float[Tensor, "row feature"]) -> Float[Tensor, "row feature"]:
    x = x.double()
    return x - x.mean(dim=0, keepdim=True)


def linear_cka(x: Float[Tensor, "row feature_x"], y: Float[Tensor, "row feature_y"]) -> float:
    """Linear CKA of two representations of the same rows (column-centred); 0 if degenerate."""
    x, y = _centre(x), _centre(y)
    denominator = torch.linalg.matrix_norm(x.T @ x) * torch.linalg.matrix_norm(y.T @ y)
    if float(denominator) < CKA_MIN_DENOMINATOR:
        return 0.0
    return float(torch.linalg.matrix_norm(y.T @ x) ** 2 / denominator)


def _rank(values: Float[Tensor, " n"]) -> Float[Tensor, " n"]:
    """Average ranks (ties share their mean rank), as Spearman's rho needs."""
    sorted_values, order = torch.sort(values)
    ranks = torch.empty_like(values)
    _, inverse, counts = torch.unique_consecutive(sorted_values, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() + 1) / 2
    ranks[order] = mean_rank[inverse].to(values.dtype)
    return ranks


def cosine_rdm_upper(x: Float[Tensor, "row feature"]) -> Float[Tensor, " pair"]:
    """Upper triangle (``i < j``) of the cosine-distance representational dissimilarity matrix."""
    unit = torch.nn.functional.normalize(x.double(), dim=1)
    dissimilarity = 1.0 - unit @ unit.T
    rows, cols = torch.triu_indices(x.shape[0], x.shape[0], offset=1)
    return dissimilarity[rows, cols]


def rsa(x: Float[Tensor, "row feature_x"], y: Float[Tensor, "row feature_y"]) -> float:
    """Spearman correlation of the two cosine RDMs (0 when either RDM is constant or has < 2 pairs)."""
    a, b = _rank(cosine_rdm_upper(x)), _rank(cosine_rdm_upper(y))
    if a.numel() < 2:
        return 0.0
    a, b = a - a.mean(), b - b.mean()
    denominator = a.norm() * b.norm()
    if float(denominator) == 0.0:
        return 0.0
    return float((a @ b) / denominator)


def _svd_basis(
    x: Float[Tensor, "row feature"], keep_variance: float, max_dims: int
) -> Float[Tensor, "row dim"]:
    """Orthonormal basis of the top singular directions of centred ``x`` (keep ``keep_variance``)."""
    u, s, _ = torch.linalg.svd(_centre(x), full_matrices=False)
    energy = s**2
    if float(energy.sum()) == 0.0:
        return u[:, :0]
    cumulative = torch.cumsum(energy, 0) / energy.sum()
    dims = int((cumulative < keep_variance).sum()) + 1
    return u[:, : max(1, min(dims, max_dims))]


def _canonical(
    x: Float[Tensor, "row feature_x"], y: Float[Tensor, "row feature_y"], keep_variance: float
) -> tuple[Float[Tensor, " dim"], Float[Tensor, "row dim"]]:
    """Canonical correlations of the SVD-truncated pair and the canonical variates of ``x``.

    Each side keeps at most ``rows // 2`` directions, so that two subspaces of the row space are never forced to
    share directions (which would give spurious correlations of 1 when there are fewer rows than features).
    """
    max_dims = max(1, x.shape[0] // 2)
    basis_x = _svd_basis(x, keep_variance, max_dims)
    basis_y = _svd_basis(y, keep_variance, max_dims)
    if basis_x.shape[1] == 0 or basis_y.shape[1] == 0:
        return torch.zeros(0, dtype=torch.float64), basis_x[:, :0]
    u, correlations, _ = torch.linalg.svd(basis_x.T @ basis_y, full_matrices=False)
    return correlations.clamp(0.0, 1.0), basis_x @ u


def svcca(
    x: Float[Tensor, "row feature_x"],
    y: Float[Tensor, "row feature_y"],
    keep_variance: float = SVCCA_KEEP_VARIANCE,
) -> float:
    """Mean canonical correlation after SVD truncation (0 when either side is constant)."""
    correlations, _ = _canonical(x, y, keep_variance)
    return float(correlations.mean()) if correlations.numel() else 0.0


def pwcca(
    x: Float[Tensor, "row feature_x"],
    y: Float[Tensor, "row feature_y"],
    keep_variance: float = SVCCA_KEEP_VARIANCE,
) -> float:
    """Projection-weighted CCA, weights from ``x`` (the reference): ``alpha_k ∝ sum_j |<h_k, x_j>|``."""
    correlations, variates = _canonical(x, y, keep_variance)
    if not correlations.numel():
        return 0.0
    alpha = (variates.T @ _centre(x)).abs().sum(dim=1)
    if float(alpha.sum()) == 0.0:
        return float(correlations.mean())
    return float((alpha * correlations).sum() / alpha.sum())


SIMILARITIES: dict[str, Similarity] = {"cka": linear_cka, "rsa": rsa, "svcca": svcca, "pwcca": pwcca}
"""Method key -> similarity; the first argument is the retain model's (the reference of PWCCA)."""


def example_means(hidden: HiddenStates) -> Float[Tensor, "layer example d_model"]:
    """Mean residual over each example's read positions (one row per example)."""
    rows = hidden.example_rows()
    n_examples = len(hidden.example_ids)
    totals = torch.zeros(hidden.n_layers, n_examples, hidden.resid.shape[2], dtype=torch.float64)
    totals.index_add_(1, rows, hidden.resid.double())
    counts = torch.bincount(rows, minlength=n_examples).double()
    return (totals / counts[None, :, None]).float()


def _rows(hidden: HiddenStates, method: str) -> Float[Tensor, "layer row d_model"]:
    # RSA compares examples with each other, so it needs one row per example; the others use every read position.
    return example_means(hidden) if method == "rsa" else hidden.resid


def layer_similarities(reference: HiddenStates, other: HiddenStates, method: str) -> Float[Tensor, " layer"]:
    """``S(reference, other)`` at every layer for one of ``SIMILARITIES``."""
    if method not in SIMILARITIES:
        raise ValueError(f"unknown similarity {method!r}; choose from {sorted(SIMILARITIES)}")
    if not torch.equal(reference.example_idx, other.example_idx):
        raise ValueError(
            "the two models' hidden states were read at different positions; encode once and reuse"
        )
    similarity = SIMILARITIES[method]
    a, b = _rows(reference, method), _rows(other, method)
    return torch.tensor([similarity(a[layer], b[layer]) for layer in range(reference.n_layers)])


def similarity_layerwise(
    sim_unlearned_retain: Float[Tensor, " layer"], sim_full_retain: Float[Tensor, " layer"], method: str
) -> LayerwiseErasure:
    """Layerwise erasure from precomputed similarities to the retain model."""
    erasure, weight = similarity_erasure(sim_unlearned_retain, sim_full_retain)
    return LayerwiseErasure(method, erasure.float(), weight.float())


def similarity_score(
    full: HiddenStates, retain: HiddenStates, unlearned: HiddenStates, method: str = "cka"
) -> LayerwiseErasure:
    """Retain-normalised layerwise erasure of ``method`` (``cka``, ``rsa``, ``svcca`` or ``pwcca``).

    Args:
        full: Full model's states at the read positions.
        retain: Retain model's states there.
        unlearned: Unlearned model's states there.
        method: Similarity key.

    Returns:
        Erasure and weight per layer; ``.score`` is the weighted mean.
    """
    return similarity_layerwise(
        layer_similarities(retain, unlearned, method), layer_similarities(retain, full, method), method
    )

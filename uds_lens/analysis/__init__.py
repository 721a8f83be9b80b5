"""Analyses over UDS results: case studies (prompt types, tau sensitivity, entity length, first erased layer,
component shares, lens vs UDS) in ``case_studies``, and ``diagnose``, which scores models with UDS next to every
baseline and writes one table per question.

``from uds_lens import analysis`` gives the case-study functions (``analysis.tau_sensitivity(...)``); the runner is
``uds_lens.analysis.diagnose.diagnose``.
"""

from uds_lens.analysis.case_studies import (
    DEFAULT_TAU,
    TAUS,
    component_shares,
    component_summary,
    entity_length_correlation,
    first_erased_layer,
    ke_size_distribution,
    layer_profile,
    lens_vs_uds,
    method_agreement,
    onset_summary,
    prompt_type_uds,
    rank_concordance,
    rescore_uds,
    tau_sensitivity,
    uds_by_entity_length,
)

__all__ = [
    "DEFAULT_TAU",
    "TAUS",
    "component_shares",
    "component_summary",
    "entity_length_correlation",
    "first_erased_layer",
    "ke_size_distribution",
    "layer_profile",
    "lens_vs_uds",
    "method_agreement",
    "onset_summary",
    "prompt_type_uds",
    "rank_concordance",
    "rescore_uds",
    "tau_sensitivity",
    "uds_by_entity_length",
]

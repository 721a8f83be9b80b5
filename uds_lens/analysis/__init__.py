"""Analyses over UDS results: case studies (prompt types, tau sensitivity, entity length, first erased layer,
component shares, lens vs UDS) in ``case_studies``, and ``diagnose``, which scores models with UDS next to every
baseline and returns one ``DiagnoseResult`` with a table per question.

``from uds_lens import analysis`` gives the case-study functions (``analysis.tau_sensitivity(...)``); the runner is
``uds_lens.analysis.diagnose.diagnose``.
"""

from uds_lens.analysis.case_studies import *  # noqa: F403  (the case studies are this package's API)
from uds_lens.analysis.case_studies import __all__ as __all__

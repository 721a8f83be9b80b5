"""What a sweep writes in its output directory, beside one ``NAME/`` directory per model."""

from __future__ import annotations

SWEEP_TABLE = "sweep.csv"
SWEEP_JSON = "sweep_eval.json"
SCATTER_HTML = "published_scatter.html"
# What a sweep writes next to the NAME/ directories (and `uds-lens report` adds): no model may be named like them.
SWEEP_FILES = (SWEEP_TABLE, SWEEP_JSON, SCATTER_HTML, "report.html", "roles.json")

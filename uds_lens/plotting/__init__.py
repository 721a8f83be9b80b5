"""Figures: every plot takes a result (or its DataFrames) and returns a ``plotly.graph_objects.Figure``; none shows it.

``from uds_lens import plotting`` gives every figure function, by subject:

- [`heatmaps`][uds_lens.plotting.heatmaps]: ``layer_heatmap`` (y = layer, x = example, KE cells marked);
- [`curves`][uds_lens.plotting.curves]: ``stage_curves``, ``example_curves``, ``tau_curves``, ``lens_vs_uds_example``,
  ``lens_vs_uds_models``, ``layerwise_methods``;
- [`models`][uds_lens.plotting.models]: ``model_frame``, ``uds_bar`` (UDS split into its measured and clipped parts,
  with their CIs), ``depth_vs_damage`` (the measured part of UDS, up to UDS, against excess disruption),
  ``rmu_layer_profile``;
- [`distributions`][uds_lens.plotting.distributions]: ``uds_distribution`` (per-example UDS beside its measured
  part), ``prompt_type_bar`` (mean UDS per prompt type, its clipped part hatched);
- [`components`][uds_lens.plotting.components]: ``component_patching``, ``component_heatmap``, ``token_logprobs``;
- `meta_eval`: ``pool_histograms``, ``robustness_scatter``, ``published_scatter``;
- [`export`][uds_lens.plotting.export]: ``save`` (PNG/SVG/PDF or offline HTML), ``keep_figures_in_notebooks`` (figures
  stored as HTML too, so a shared notebook shows them);
- `style`: the palette, dashes and scales they share, and ``model_colour`` (one colour per
  model in every figure).

[`uds_lens.plotting.report.write_report`][uds_lens.plotting.report.write_report] assembles them into one offline HTML page. ``uds_lens.plots`` is the
earlier name of this package and still works. The names load their module on first use (PEP 562, as
``uds_lens/__init__.py`` does), so ``results.py``, which needs one figure, and ``uds-lens report`` do not pay for the
others (the meta-evaluation figures import scikit-learn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from uds_lens.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "DELTA_SCALE": "style",
    "KE_BAND": "style",
    "LER_SCALE": "style",
    "PALETTE": "style",
    "REFERENCE_LINE": "style",
    "S1_COLOUR": "style",
    "STAGE_DASH": "style",
    "VALUE_LABELS": "style",
    "model_colour": "style",
    "set_model_colours": "style",
    "layer_heatmap": "heatmaps",
    "example_curves": "curves",
    "layerwise_methods": "curves",
    "lens_vs_uds_example": "curves",
    "lens_vs_uds_models": "curves",
    "stage_curves": "curves",
    "tau_curves": "curves",
    "model_frame": "models",
    "depth_vs_damage": "models",
    "prompt_type_bar": "distributions",
    "rmu_layer_profile": "models",
    "rmu_target_layer": "models",
    "uds_bar": "models",
    "uds_distribution": "distributions",
    "component_heatmap": "components",
    "component_patching": "components",
    "token_logprobs": "components",
    "ATTACKS": "meta_eval",
    "ERASURE_METRICS": "meta_eval",
    "pool_histograms": "meta_eval",
    "published_scatter": "meta_eval",
    "robustness_scatter": "meta_eval",
    "IMAGE_SUFFIXES": "export",
    "save": "export",
    "keep_figures_in_notebooks": "export",
}

__all__ = [
    "ATTACKS",
    "DELTA_SCALE",
    "ERASURE_METRICS",
    "IMAGE_SUFFIXES",
    "KE_BAND",
    "LER_SCALE",
    "PALETTE",
    "REFERENCE_LINE",
    "S1_COLOUR",
    "STAGE_DASH",
    "VALUE_LABELS",
    "component_heatmap",
    "component_patching",
    "depth_vs_damage",
    "example_curves",
    "keep_figures_in_notebooks",
    "layer_heatmap",
    "layerwise_methods",
    "lens_vs_uds_example",
    "lens_vs_uds_models",
    "model_colour",
    "model_frame",
    "pool_histograms",
    "prompt_type_bar",
    "published_scatter",
    "rmu_layer_profile",
    "rmu_target_layer",
    "robustness_scatter",
    "save",
    "set_model_colours",
    "stage_curves",
    "tau_curves",
    "token_logprobs",
    "uds_bar",
    "uds_distribution",
]

if TYPE_CHECKING:  # static analysers see the eager imports
    from uds_lens.plotting.components import component_heatmap, component_patching, token_logprobs
    from uds_lens.plotting.curves import (
        example_curves,
        layerwise_methods,
        lens_vs_uds_example,
        lens_vs_uds_models,
        stage_curves,
        tau_curves,
    )
    from uds_lens.plotting.distributions import prompt_type_bar, uds_distribution
    from uds_lens.plotting.export import IMAGE_SUFFIXES, keep_figures_in_notebooks, save
    from uds_lens.plotting.heatmaps import layer_heatmap
    from uds_lens.plotting.meta_eval import (
        ATTACKS,
        ERASURE_METRICS,
        pool_histograms,
        published_scatter,
        robustness_scatter,
    )
    from uds_lens.plotting.models import (
        depth_vs_damage,
        model_frame,
        rmu_layer_profile,
        rmu_target_layer,
        uds_bar,
    )
    from uds_lens.plotting.style import (
        DELTA_SCALE,
        KE_BAND,
        LER_SCALE,
        PALETTE,
        REFERENCE_LINE,
        S1_COLOUR,
        STAGE_DASH,
        VALUE_LABELS,
        model_colour,
        set_model_colours,
    )


__getattr__, __dir__ = lazy_exports(__name__, {name: f".{module}" for name, module in _EXPORTS.items()})

"""uds_lens: audit LLM unlearning from the inside with the Unlearning Depth Score (UDS).

The public API, re-exported::

    from uds_lens import UDSAuditor, UDSConfig, load_model, load_examples
    auditor = UDSAuditor("full_dir", "retain_dir", "forget.json")
    result = auditor.score("unlearned_dir")      # UDSResult: .uds, .examples, .layers, .summary, .save()

The names are resolved on first use (PEP 562 ``__getattr__``): ``import uds_lens`` alone loads neither torch nor
TransformerLens (4-6 s to import on a small CPU) nor bitsandbytes (which TransformerLens imports, and which may print
warnings), so the CLI's ``--help`` and ``report`` answer at once and importing the package prints nothing. ``from uds_lens import UDSAuditor`` imports what that name needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from uds_lens.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "EncodedExample": "uds_lens.data",
    "Example": "uds_lens.data",
    "Skip": "uds_lens.data",
    "encode": "uds_lens.data",
    "load_examples": "uds_lens.data",
    "Checkpoint": "uds_lens.checkpoints.checkpoint",
    "RunInputs": "uds_lens.inputs",
    "load_hf_model": "uds_lens.checkpoints.loader",
    "load_model": "uds_lens.checkpoints.loader",
    "load_tokenizer": "uds_lens.checkpoints.loader",
    "verify_parity": "uds_lens.sources",
    "UDSResult": "uds_lens.results",
    "UDSAuditor": "uds_lens.auditor",
    "UDSConfig": "uds_lens.config",
    "bootstrap_ci": "uds_lens.uds",
    "example_uds": "uds_lens.uds",
    "model_uds": "uds_lens.uds",
    "uds_parts": "uds_lens.uds",
    "excess_disruption": "uds_lens.uds",
    "ComponentResult": "uds_lens.component_result",
    "patch_heads": "uds_lens.components",
    "patch_positions": "uds_lens.components",
    "patch_tokens": "uds_lens.components",
    "load_zoo": "uds_lens.zoo.layout",
    "annotate": "uds_lens.annotation",
}

__all__ = [
    "Checkpoint",
    "ComponentResult",
    "EncodedExample",
    "Example",
    "RunInputs",
    "Skip",
    "UDSAuditor",
    "UDSConfig",
    "UDSResult",
    "annotate",
    "bootstrap_ci",
    "encode",
    "example_uds",
    "excess_disruption",
    "load_examples",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "load_zoo",
    "model_uds",
    "patch_heads",
    "patch_positions",
    "patch_tokens",
    "uds_parts",
    "verify_parity",
]

if TYPE_CHECKING:  # static analysers see the eager imports
    from uds_lens.annotation import annotate
    from uds_lens.auditor import UDSAuditor
    from uds_lens.checkpoints.checkpoint import Checkpoint
    from uds_lens.checkpoints.loader import load_hf_model, load_model, load_tokenizer
    from uds_lens.component_result import ComponentResult
    from uds_lens.components import patch_heads, patch_positions, patch_tokens
    from uds_lens.config import UDSConfig
    from uds_lens.data import EncodedExample, Example, Skip, encode, load_examples
    from uds_lens.inputs import RunInputs
    from uds_lens.results import UDSResult
    from uds_lens.sources import verify_parity
    from uds_lens.uds import bootstrap_ci, example_uds, excess_disruption, model_uds, uds_parts
    from uds_lens.zoo.layout import load_zoo


# `uds_lens.plots` is the name plotting/ had before the one-house layout
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, modules={"plots": "uds_lens.plotting"})

"""The embedded model zoo: a synthetic world of fictitious authors and small Llama models trained and unlearned on it.

``build_zoo(dir, size="test" | "default")`` writes the QA data, a tokenizer and Hugging Face Llama checkpoints (base, full,
retain, retain90/50, unlearned models, meta-evaluation pools) plus ``manifest.json``; ``load_zoo(dir)`` opens one.
See `uds_lens.zoo.recipe` for the recipe, [`uds_lens.zoo.build`][uds_lens.zoo.build] for the build steps,
`uds_lens.zoo.world` for the data and `uds_lens.zoo.layout` for the manifest.

The names are resolved on first use (`uds_lens.lazy`), so reading a manifest (``uds_lens.zoo.layout``, which
the model loader does for ``zoo:NAME``) does not import the training code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from uds_lens.lazy import lazy_exports

_EXPORTS = {
    "SIZES": ".recipe",
    "Zoo": ".layout",
    "ZooBuildError": ".recipe",
    "ZooDataError": ".world",
    "build_zoo": ".build",
    "load_zoo": ".layout",
}

__all__ = ["SIZES", "Zoo", "ZooBuildError", "ZooDataError", "build_zoo", "load_zoo"]

if TYPE_CHECKING:  # static analysers see the eager imports
    from .build import build_zoo
    from .layout import Zoo, load_zoo
    from .recipe import SIZES, ZooBuildError
    from .world import ZooDataError

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

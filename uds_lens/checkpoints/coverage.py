"""Whether a checkpoint's weights cover the model its config describes, checked before and after it is built.

``transformers`` builds the model its ``config.json`` describes and then fills it from the weight files: a tensor the
files lack is initialised at random (a run scores noise, differently each time), a tensor the model has no place for
is dropped, and a config whose sizes are absurd is built before anything reads the weights (a billion layers fill the
memory for minutes). So loading is checked twice:

- before the model is built, `check_config_size` compares the parameter count the config implies
  (`implied_parameters`: embeddings, attention and gated MLP per layer, the unembedding unless tied) with the
  tensors the weight files hold (their headers only, `Checkpoint.tensor_shapes`) and with the memory of the device;
- after, `check_loading_info` refuses a model for which the loader reports missing, unexpected or
  shape-mismatched tensors, naming them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from uds_lens.checkpoints.folder import ModelLoadError

# The implied count leaves out norms and biases, so it is a little below the stored one; a config implying more
# than this multiple of what the files hold does not describe them (a missing tensor or two is named after loading).
IMPLIED_OVER_STORED_LIMIT = 1.5
# Tensors named in one line before "and N more".
NAMES_SHOWN = 5


def _size(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def implied_parameters(config: Any) -> int | None:
    """The parameter count a decoder config implies (norms and biases left out), or None when it lacks a size.

    ``vocab * d_model`` (embeddings, twice unless tied) ``+ n_layers * (d_model * d_head * (2 * n_heads + 2 *
    n_kv_heads) + 3 * d_model * d_mlp)``: query and output projections over all heads, key and value over the
    key/value heads, and a gated MLP (gate, up, down). Python integers: a config's absurd sizes never overflow.
    """
    vocab, d_model, n_layers = (
        _size(config, key) for key in ("vocab_size", "hidden_size", "num_hidden_layers")
    )
    n_heads, d_mlp = _size(config, "num_attention_heads"), _size(config, "intermediate_size")
    if None in (vocab, d_model, n_layers, n_heads, d_mlp):
        return None
    assert vocab and d_model and n_layers and n_heads and d_mlp  # for the type checker: checked just above
    n_kv = _size(config, "num_key_value_heads") or n_heads
    d_head = _size(config, "head_dim") or max(1, d_model // n_heads)
    per_layer = d_model * d_head * (2 * n_heads + 2 * n_kv) + 3 * d_model * d_mlp
    embeddings = vocab * d_model * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return embeddings + n_layers * per_layer


def _count(value: int) -> str:
    return f"{value:,}"


def check_config_size(
    location: str,
    config: Any,
    stored: Iterable[tuple[int, ...]] | None,
    dtype: torch.dtype,
    available_bytes: int | None,
) -> None:
    """Refuse, before the model is built, a config whose sizes the weight files or the memory cannot hold.

    Args:
        location: the checkpoint, as messages name it.
        config: its Hugging Face config.
        stored: the shapes of the tensors its weight files hold, or None when they cannot be read without loading
            (``.bin``, ``.gguf``, a hub id): then only the memory is compared.
        dtype: the dtype the model is built in.
        available_bytes: free memory of the device it is built on (None: not compared).

    Raises:
        ModelLoadError: the implied count is over ``IMPLIED_OVER_STORED_LIMIT`` times what the files hold, or its
            bytes exceed the available memory.
    """
    implied = implied_parameters(config)
    if implied is None:
        return
    # a pre-quantised checkpoint packs several parameters into one stored element: only the memory is compared
    if stored is not None and getattr(config, "quantization_config", None) is None:
        held = sum(math.prod(shape) for shape in stored)
        if implied > IMPLIED_OVER_STORED_LIMIT * held:
            raise ModelLoadError(
                f"config.json of {location} describes a model of {_count(implied)} parameters "
                f"({config.num_hidden_layers} layers, d_model {config.hidden_size}, vocabulary {config.vocab_size}) "
                f"but its weight files hold {_count(held)}: the config does not belong to these weights. Restore the "
                "checkpoint's own config.json."
            )
    needed = implied * torch.empty((), dtype=dtype).element_size()
    if available_bytes is not None and needed > available_bytes:
        raise ModelLoadError(
            f"{location} needs {needed / 2**30:.1f} GiB for its {_count(implied)} parameters in {dtype} "
            f"({config.num_hidden_layers} layers, d_model {config.hidden_size}) but {available_bytes / 2**30:.1f} "
            "GiB are free: free memory, pass --dtype bfloat16, or use a machine with more memory."
        )


def _names(keys: Iterable[Any]) -> str:
    names = sorted(str(key[0] if isinstance(key, tuple) else key) for key in keys)
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def check_loading_info(location: str, info: dict[str, Any]) -> None:
    """Refuse a model whose weight files did not fill it exactly: ``info`` is the loader's report
    (``from_pretrained(..., output_loading_info=True)``: missing, unexpected and shape-mismatched tensors).

    Raises:
        ModelLoadError: one line naming the tensors (a missing one would have been initialised at random).
    """
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = set(info.get("mismatched_keys") or ())
    if not (missing or unexpected or mismatched):
        return
    problems = []
    if missing:
        problems.append(f"its weight files lack {_names(missing)} (they would be initialised at random)")
    if mismatched:
        problems.append(f"{_names(mismatched)} have another shape than config.json says")
    if unexpected:
        problems.append(
            f"they hold {_names(unexpected)}, which the model described by config.json has no place for"
        )
    raise ModelLoadError(
        f"The weights of {location} do not cover its model: {'; '.join(problems)}. Re-save or re-download the "
        "complete checkpoint (every tensor, with its own config.json)."
    )


__all__ = ["IMPLIED_OVER_STORED_LIMIT", "check_config_size", "check_loading_info", "implied_parameters"]

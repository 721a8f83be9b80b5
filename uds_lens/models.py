"""Load Llama checkpoints as TransformerLens ``HookedTransformer`` models, without touching the network.

A UDS audit patches activations between three checkpoints of one architecture, so loading is strict: each
checkpoint is read from a local Hugging Face directory (``config.json`` + weights) or a hub id, its config must be a
Llama config, and two models are only accepted together when their architecture and vocabulary match.

The HookedTransformer config is derived from the directory's ``config.json`` (no lookup in TransformerLens's table of
official model names, which would need the hub), and the weights are converted with TransformerLens's Llama
converter *without* folding or centring, so ``blocks.{l}.hook_resid_post`` equals Hugging Face's
``hidden_states[l + 1]`` (``verify_parity`` checks it).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from uds_lens.data import looks_like_local_path
from uds_lens.tl_compat import (
    HookedTransformer,
    HookedTransformerConfig,
    apply_llama3_rope_scaling,
    convert_llama_weights,
    new_hooked_transformer,
    rope_theta,
)

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama",)
# TransformerLens allocates per-layer rotary tables lazily; the context length only bounds them.
_MAX_N_CTX = 8192


class ModelLoadError(RuntimeError):
    """A checkpoint could not be loaded (missing, offline hub id, unsupported architecture)."""


class ModelMismatchError(ValueError):
    """Two checkpoints cannot be patched into each other (different architecture or vocabulary)."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on CUDA (what the published implementation runs), fp32 on CPU (exact tests)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(names)}.")
    return names[dtype]


def is_local(path_or_id: str | os.PathLike) -> bool:
    return Path(path_or_id).expanduser().is_dir()


def _refuse_missing_local(path_or_id: str | os.PathLike) -> None:
    """Fail at once for a path that does not exist, instead of asking the hub (and retrying) for a mistyped path."""
    text = str(path_or_id)
    if not Path(text).expanduser().exists() and (isinstance(path_or_id, os.PathLike) or looks_like_local_path(text)):
        raise ModelLoadError(f"No checkpoint at {text}: the path does not exist (a hub id looks like 'org/name'). "
                             "Check the path, or pass a local Hugging Face checkpoint directory.")


def _hub_error(model_id: str, err: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    return ModelLoadError(
        f"Could not load {model_id!r}: it is not a local directory, and fetching it from the Hugging Face hub failed "
        f"({type(err).__name__}: {err}). "
        + ("HF_HUB_OFFLINE is set, so the hub is not contacted. " if offline else
           "This machine may have no access to the hub (set HF_HUB_OFFLINE=1 to fail fast). ")
        + "Pass a local checkpoint directory instead (e.g. one saved with `save_pretrained`, or a zoo model from "
        "`uds-lens zoo build`)."
    )


def load_hf_config(path_or_id: str | os.PathLike) -> Any:
    """The Hugging Face config of a checkpoint, offline for local directories."""
    from transformers import AutoConfig

    _refuse_missing_local(path_or_id)
    source = str(Path(path_or_id).expanduser()) if is_local(path_or_id) else str(path_or_id)
    if is_local(path_or_id) and not (Path(source) / "config.json").is_file():
        raise ModelLoadError(f"{source} is a directory but has no config.json: not a Hugging Face checkpoint.")
    try:
        return AutoConfig.from_pretrained(source, local_files_only=is_local(path_or_id))
    except OSError as err:
        if is_local(path_or_id):
            raise ModelLoadError(f"Could not read the config in {source}: {err}") from err
        raise _hub_error(source, err) from err


def check_supported(hf_config: Any, name: str) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = getattr(hf_config, "architectures", None)
        raise ModelLoadError(
            f"{name} is a {model_type!r} model ({archs}); uds_lens supports Llama checkpoints "
            f"(model_type in {SUPPORTED_MODEL_TYPES}) for now. Convert the checkpoint or use a Llama-family model."
        )


def _rope_scaling(hf_config: Any) -> dict[str, Any]:
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, dict) and (value.get("rope_type") or value.get("type")):
            return value
    return {}


def hooked_config_from_hf(hf_config: Any, dtype: torch.dtype, device: str) -> HookedTransformerConfig:
    """TransformerLens config for a Hugging Face Llama config (mirrors TransformerLens's Llama branch)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    cfg: dict[str, Any] = {
        "d_model": hf_config.hidden_size,
        "d_head": head_dim,
        "n_heads": hf_config.num_attention_heads,
        "d_mlp": hf_config.intermediate_size,
        "n_layers": hf_config.num_hidden_layers,
        "n_ctx": min(int(hf_config.max_position_embeddings), _MAX_N_CTX),
        "eps": hf_config.rms_norm_eps,
        "d_vocab": hf_config.vocab_size,
        "act_fn": hf_config.hidden_act,
        "n_key_value_heads": n_kv if n_kv != hf_config.num_attention_heads else None,
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "rotary_adjacent_pairs": False,
        "rotary_dim": head_dim,
        "rotary_base": rope_theta(hf_config),
        "final_rms": True,
        "gated_mlp": True,
        "original_architecture": "LlamaForCausalLM",
        "tokenizer_prepends_bos": True,
        "default_prepend_bos": True,
        "dtype": dtype,
        "device": device,
    }
    scaling = _rope_scaling(hf_config)
    if scaling:
        shim = type("RopeShim", (), {"rope_scaling": scaling,
                                     "max_position_embeddings": hf_config.max_position_embeddings})()
        apply_llama3_rope_scaling(cfg, shim)
    return HookedTransformerConfig(**cfg)


def load_hf_model(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: Any = None,
) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` in eval mode (local directories are read offline).

    Args:
        path_or_id: local checkpoint directory or hub id.
        dtype: torch dtype or its name; default bf16 on CUDA, fp32 on CPU.
        device: "cpu" or "cuda"; default CUDA when available.
        quantization: a ``transformers.BitsAndBytesConfig`` (e.g. NF4), passed through.
    """
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    hf_config = load_hf_config(path_or_id)
    name = str(path_or_id)
    check_supported(hf_config, name)
    local = is_local(path_or_id)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "local_files_only": local}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    try:
        model = AutoModelForCausalLM.from_pretrained(str(Path(path_or_id).expanduser()) if local else name, **kwargs)
    except OSError as err:
        if local:
            raise ModelLoadError(f"Could not load the weights in {name}: {err}") from err
        raise _hub_error(name, err) from err
    if quantization is None:
        model.to(device)
    return model.eval()


def hooked_from_hf(hf_model: Any, dtype: torch.dtype | None = None, device: str | None = None) -> HookedTransformer:
    """Wrap an in-memory Hugging Face Llama as a HookedTransformer (weights converted, no folding/centring)."""
    check_supported(hf_model.config, type(hf_model).__name__)
    device = device or str(next(hf_model.parameters()).device)
    dtype = dtype or next(hf_model.parameters()).dtype
    cfg = hooked_config_from_hf(hf_model.config, dtype, device)
    state_dict = convert_llama_weights(hf_model, cfg)
    model = new_hooked_transformer(cfg)
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    # nn.Module.to: TransformerLens's own .to prints, and cfg.device/dtype are already set.
    torch.nn.Module.to(model, device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def load_model(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
) -> HookedTransformer:
    """Load a Llama checkpoint as a HookedTransformer.

    The weights are loaded into a Hugging Face model on the CPU, converted, and the Hugging Face copy is dropped.
    The model remembers where it came from (``model.uds_source``) so results can name it and the S1 cache can
    fingerprint its weight files.
    """
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    hf_model = load_hf_model(path_or_id, dtype=torch_dtype, device="cpu")
    model = hooked_from_hf(hf_model, dtype=torch_dtype, device=device)
    del hf_model
    model.uds_source = str(path_or_id)
    return model


def load_tokenizer(path_or_id: str | os.PathLike) -> Any:
    """The fast tokenizer of a checkpoint (UDS needs character offsets to locate entities)."""
    from transformers import AutoTokenizer

    _refuse_missing_local(path_or_id)
    local = is_local(path_or_id)
    source = str(Path(path_or_id).expanduser()) if local else str(path_or_id)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local, use_fast=True)
    except OSError as err:
        if local:
            raise ModelLoadError(f"Could not load a tokenizer from {source}: {err}") from err
        raise _hub_error(source, err) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass(frozen=True)
class ArchitectureSignature:
    """What two models must share to be patched into each other."""

    n_layers: int
    d_model: int
    n_heads: int
    n_key_value_heads: int | None
    d_head: int
    d_mlp: int
    d_vocab: int

    @classmethod
    def of(cls, model: Any) -> ArchitectureSignature:
        if isinstance(model, HookedTransformer):
            c = model.cfg
            return cls(c.n_layers, c.d_model, c.n_heads, c.n_key_value_heads, c.d_head, c.d_mlp, c.d_vocab)
        c = model.config
        n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                   n_kv if n_kv != c.num_attention_heads else None, head_dim, c.intermediate_size, c.vocab_size)


def check_compatible(target: Any, source: Any, target_name: str = "full", source_name: str = "source") -> None:
    """Refuse to patch between models whose architecture or vocabulary differ."""
    a, b = ArchitectureSignature.of(target), ArchitectureSignature.of(source)
    if a == b:
        return
    diffs = [f"{k}: {target_name}={getattr(a, k)} vs {source_name}={getattr(b, k)}"
             for k in a.__dataclass_fields__ if getattr(a, k) != getattr(b, k)]
    kind = "vocabulary" if diffs == [d for d in diffs if d.startswith("d_vocab")] else "architecture"
    raise ModelMismatchError(
        f"{source_name} cannot be patched into {target_name}: the {kind} differs ({'; '.join(diffs)}). "
        "UDS needs checkpoints fine-tuned from one base model with one tokenizer."
    )


def model_fingerprint(model: Any) -> str:
    """A digest of every weight's bytes (not the path): any change to any weight changes it."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if not torch.is_tensor(tensor):
            continue
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(name.encode())
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def verify_parity(
    hooked: HookedTransformer, hf_model: Any, tokens: Int[Tensor, "batch pos"]
) -> dict[str, float]:
    """Max absolute differences between TransformerLens and Hugging Face on the same tokens.

    Returns ``{"resid_post": max over layers l < L-1 of |blocks.l.hook_resid_post - hidden_states[l+1]|,
    "final_norm": |ln_final(resid_post[L-1]) - hidden_states[L]|, "logits": max |logit difference|}``.
    """
    n_layers = hooked.cfg.n_layers
    with torch.no_grad():
        hf_out = hf_model(tokens.to(next(hf_model.parameters()).device), output_hidden_states=True)
        logits, cache = hooked.run_with_cache(
            tokens.to(hooked.cfg.device),
            names_filter=lambda name: name.endswith("hook_resid_post") or name == "ln_final.hook_normalized",
        )
    resid = max(
        (cache[f"blocks.{layer}.hook_resid_post"].float().cpu()
         - hf_out.hidden_states[layer + 1].float().cpu()).abs().max().item()
        for layer in range(n_layers - 1)
    ) if n_layers > 1 else 0.0
    final = (cache["ln_final.hook_normalized"].float().cpu() - hf_out.hidden_states[n_layers].float().cpu()).abs().max()
    logit_diff = (logits.float().cpu() - hf_out.logits.float().cpu()).abs().max()
    return {"resid_post": float(resid), "final_norm": float(final), "logits": float(logit_diff)}


def config_summary(model: HookedTransformer) -> dict[str, Any]:
    c = model.cfg
    return {"n_layers": c.n_layers, "d_model": c.d_model, "n_heads": c.n_heads,
            "n_key_value_heads": c.n_key_value_heads, "d_vocab": c.d_vocab, "dtype": str(c.dtype).replace("torch.", "")}


def weight_files_digest(path: str | os.PathLike) -> str | None:
    """Hash of a local checkpoint's weight files (size + content), or None for non-local sources."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return None
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:24]


def checkpoint_stamp(path_or_id: str | os.PathLike) -> str:
    """A cheap identity of a checkpoint for result caches: a local directory's files (name, size, modification time:
    retrained weights or a new chat template change it), or a hub id as itself."""
    root = Path(path_or_id).expanduser()
    if not root.is_dir():
        return str(path_or_id)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.iterdir() if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:24]


def describe(path_or_model: Any) -> str:
    if isinstance(path_or_model, (str, os.PathLike)):
        return str(path_or_model)
    return getattr(path_or_model, "uds_source", None) or getattr(getattr(path_or_model, "config", None),
                                                                 "_name_or_path", None) or type(path_or_model).__name__


__all__ = [
    "ArchitectureSignature", "ModelLoadError", "ModelMismatchError", "check_compatible", "check_supported",
    "checkpoint_stamp",
    "config_summary", "default_device", "default_dtype", "describe", "hooked_config_from_hf", "hooked_from_hf",
    "load_hf_config", "load_hf_model", "load_model", "load_tokenizer", "model_fingerprint", "resolve_dtype",
    "verify_parity", "weight_files_digest"
]

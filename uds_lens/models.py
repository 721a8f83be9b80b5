"""Load Llama checkpoints as TransformerLens ``HookedTransformer`` models, without touching the network.

A UDS audit patches activations between three checkpoints of one architecture, so loading is strict: each
checkpoint is read from a local Hugging Face directory (``config.json`` + weights), a ``.gguf`` file (or a directory
holding exactly one; llama.cpp's format, dequantised by ``transformers`` with the ``gguf`` package) or a hub id; its
config must be a Llama config, and two models are only accepted together when their architecture and vocabulary
match. A string that is neither an existing path nor a plausible hub id (``owner/name``) fails at once, before any
hub request.

The HookedTransformer config is derived from the checkpoint's config (no lookup in TransformerLens's table of
official model names, which would need the hub), and the weights are converted *without* folding or centring, so
``blocks.{l}.hook_resid_post`` equals Hugging Face's ``hidden_states[l + 1]`` (``verify_parity`` checks it).

Memory: a 1B model is ~5 GB in fp32, so conversion never holds two copies. The weights are converted one tensor at
a time into the HookedTransformer's parameters, which are *views* in Hugging Face's layout (``W_Q`` is
``q_proj.weight`` reshaped, ``W_in`` is ``up_proj.weight.T``): no copy is made when the dtype already matches, and
TransformerLens's ``F.linear(x, W.T.contiguous())`` then costs no copy per forward either. A directory of
``.safetensors`` files is streamed tensor by tensor with plain reads (a memory map would count the whole file as
resident); other sources go through a Hugging Face model whose tensors are released as they are converted. Tied
embeddings stay tied (``W_U`` is a view of ``W_E``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import einops
import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from uds_lens.data import looks_like_local_path
from uds_lens.tl_compat import (
    HookedTransformer,
    HookedTransformerConfig,
    apply_llama3_rope_scaling,
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
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(names)}.")
    return names[dtype]


# A hub repository id is "owner/name" (letters, digits, "-", "_", "."; at most 96 characters per part).
_HUB_ID = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$"
)


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint lives, resolved once: ``kind`` is ``"directory"`` (a Hugging Face directory), ``"gguf"``
    (``location`` is the ``.gguf`` file) or ``"hub"`` (``location`` is the hub id)."""

    kind: str
    location: str

    @property
    def local(self) -> bool:
        return self.kind != "hub"

    def from_pretrained_args(self) -> tuple[str, dict[str, Any]]:
        """First argument and extra keyword arguments of a ``transformers`` ``from_pretrained`` call."""
        if self.kind == "gguf":
            path = Path(self.location)
            return str(path.parent), {"gguf_file": path.name}
        return self.location, {"local_files_only": self.local}


def _looks_like_path(text: str) -> bool:
    """A string the user meant as a local path (``data.looks_like_local_path``, shared with the data loader), or a
    ``.`` / ``~`` start such as ``.ckpt``."""
    return text.startswith((".", "~")) or looks_like_local_path(text)


def resolve_source(path_or_id: str | os.PathLike, weights: bool = True) -> CheckpointSource:
    """Classify a checkpoint argument without touching the network, failing at once on what cannot be one.

    Args:
        path_or_id: a directory, a ``.gguf`` file, or a hub id.
        weights: a directory must hold a model (``config.json`` or one ``.gguf``); ``False`` accepts any
            directory (a tokenizer-only one).

    Raises:
        ModelLoadError: a path that does not exist, a directory that is neither a Hugging Face checkpoint nor holds
            exactly one ``.gguf`` file, a file that is not ``.gguf``, or a string that is not a plausible hub id.
    """
    path_or_id = resolve_zoo_name(path_or_id)
    text = os.fspath(path_or_id)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return CheckpointSource("gguf", str(path))
        raise ModelLoadError(
            f"{text} is a file but not a .gguf checkpoint. Pass a Hugging Face checkpoint directory (config.json + "
            "weights), a .gguf file, or a hub id (owner/name)."
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return CheckpointSource("directory", str(path))
        ggufs = sorted(p.name for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(ggufs) == 1:
            return CheckpointSource("gguf", str(path / ggufs[0]))
        if ggufs:
            raise ModelLoadError(
                f"{text} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); pass the one you mean as a file path."
            )
        if not weights:
            return CheckpointSource("directory", str(path))
        raise ModelLoadError(
            f"{text} is a directory but has no config.json and no .gguf file: not a Hugging Face checkpoint."
        )
    if isinstance(path_or_id, os.PathLike) or _looks_like_path(text):
        raise ModelLoadError(
            f"No such checkpoint: {text} does not exist (resolved to {path.absolute()}). Check the path; it was not "
            "looked up on the Hugging Face hub."
        )
    if not _HUB_ID.match(text) or ".." in text or "--" in text:
        raise ModelLoadError(
            f"{text!r} is neither an existing directory or .gguf file nor a plausible Hugging Face hub id "
            "(owner/name). Pass a local checkpoint directory, a .gguf file, or a hub id such as "
            "'meta-llama/Llama-3.2-1B'."
        )
    return CheckpointSource("hub", text)


def is_local(path_or_id: str | os.PathLike) -> bool:
    """True for an existing local checkpoint: a directory or a ``.gguf`` file."""
    path = Path(path_or_id).expanduser()
    return path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")


def _hub_error(model_id: str, err: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    return ModelLoadError(
        f"Could not load {model_id!r}: it is not a local directory, and fetching it from the Hugging Face hub failed "
        f"({type(err).__name__}: {err}). "
        + (
            "HF_HUB_OFFLINE is set, so the hub is not contacted. "
            if offline
            else "This machine may have no access to the hub (set HF_HUB_OFFLINE=1 to fail fast). "
        )
        + "Pass a local checkpoint directory instead (e.g. one saved with `save_pretrained`, or a zoo model from "
        "`uds-lens zoo build`)."
    )


def _load_error(source: CheckpointSource, what: str, err: Exception) -> ModelLoadError:
    if source.kind == "hub":
        return _hub_error(source.location, err)
    return ModelLoadError(f"Could not read the {what} of {source.location}: {type(err).__name__}: {err}")


def gguf_architecture(path: str | os.PathLike) -> str:
    """The ``general.architecture`` field of a GGUF file (e.g. ``"llama"``), read with the ``gguf`` package."""
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ModelLoadError(
            f"Reading {path} needs the `gguf` package: pip install 'uds_lens[gguf]' (or pip install gguf)."
        ) from err
    try:
        field = GGUFReader(str(path)).fields.get("general.architecture")
    except Exception as err:  # a truncated or foreign file: name it instead of a parser traceback
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}).") from err
    if field is None:
        raise ModelLoadError(f"{path} has no general.architecture field: not a model GGUF file.")
    return str(field.contents())


def _check_gguf(source: CheckpointSource) -> None:
    architecture = gguf_architecture(source.location)
    if architecture != "llama":
        raise ModelLoadError(
            f"{source.location} is a GGUF checkpoint of architecture {architecture!r}; uds_lens supports Llama "
            "checkpoints (general.architecture = 'llama'). Use a Llama-family model."
        )


ZOO_PREFIX = "zoo:"


def _zoo_entries(root: Path) -> dict[str, str]:
    """``{model name: path relative to the zoo}`` of a built zoo's manifest (empty when there is none)."""
    manifest = root / "manifest.json"
    if not manifest.is_file():
        return {}
    return {m["name"]: m["path"] for m in json.loads(manifest.read_text()).get("models", [])}


def resolve_zoo_name(path_or_id: str | os.PathLike) -> str | os.PathLike:
    """``"zoo:NAME"`` -> that model's directory in a built zoo; anything else unchanged.

    ``zoo:npo`` looks in ``$UDS_LENS_ZOO``, then the package's cached zoos (``~/.cache/uds_lens/zoo-default``,
    ``zoo-test``); ``zoo:test/npo`` names the size. For a zoo elsewhere use ``load_zoo(dir).path("npo")`` or
    ``load_zoo(dir).model("npo")``.
    """
    text = str(path_or_id)
    cache = Path(os.environ.get("UDS_LENS_CACHE", "~/.cache/uds_lens")).expanduser()
    default_roots = [Path(p).expanduser() for p in [os.environ.get("UDS_LENS_ZOO")] if p]
    default_roots += [cache / "zoo-default", cache / "zoo-test"]
    if not text.startswith(ZOO_PREFIX):
        if "/" not in text and not Path(text).expanduser().exists():
            # A zoo model's bare name is not a hub id worth retrying for ~20 s: say how to name it.
            for root in default_roots:
                if text in _zoo_entries(root):
                    raise ModelLoadError(
                        f"{text!r} is not a checkpoint directory; the zoo in {root} has a model "
                        f"of that name: pass 'zoo:{text}' (or its directory, {root / _zoo_entries(root)[text]})."
                    )
        return path_or_id
    name = text[len(ZOO_PREFIX) :]
    if "/" in name:
        size, name = name.split("/", 1)
        roots = [cache / f"zoo-{size}"]
    else:
        roots = default_roots
    seen = []
    for root in roots:
        entries = _zoo_entries(root)
        if not entries:
            continue
        seen.append(f"{root}: {sorted(entries)}")
        if name in entries:
            return str(root / entries[name])
    raise ModelLoadError(
        f"{text!r} names no model of a built zoo ("
        + ("; ".join(seen) if seen else f"no zoo found in {[str(r) for r in roots]}")
        + "). Build one with `uds-lens zoo build --out DIR --size test` (and set UDS_LENS_ZOO=DIR), or pass a "
        "checkpoint directory."
    )


def load_hf_config(path_or_id: str | os.PathLike) -> Any:
    """The Hugging Face config of a checkpoint (directory, ``.gguf`` or hub id), offline for local sources."""
    source = resolve_source(path_or_id)
    if source.kind == "gguf":
        _check_gguf(source)
    first, kwargs = source.from_pretrained_args()
    try:
        return AutoConfig.from_pretrained(first, **kwargs)
    except (OSError, ValueError) as err:
        raise _load_error(source, "config", err) from err


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
        shim = type(
            "RopeShim",
            (),
            {"rope_scaling": scaling, "max_position_embeddings": hf_config.max_position_embeddings},
        )()
        apply_llama3_rope_scaling(cfg, shim)
    return HookedTransformerConfig(**cfg)


def load_hf_model(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: Any = None,
    attn_implementation: str | None = None,
) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` in eval mode (local sources are read offline).

    Args:
        path_or_id: local checkpoint directory, ``.gguf`` file (or a directory holding one) or hub id.
        dtype: torch dtype or its name; default bf16 on CUDA, fp32 on CPU.
        device: "cpu" or "cuda"; default CUDA when available.
        quantization: a ``transformers.BitsAndBytesConfig`` (e.g. NF4), passed through.
        attn_implementation: passed through (``"eager"`` for training: the zoo's numbers are pinned to it).
    """
    path_or_id = resolve_zoo_name(path_or_id)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    source = resolve_source(path_or_id)
    hf_config = load_hf_config(path_or_id)
    check_supported(hf_config, str(path_or_id))
    first, kwargs = source.from_pretrained_args()
    kwargs["dtype"] = torch_dtype
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(first, **kwargs)
    except (OSError, ValueError) as err:
        raise _load_error(source, "weights", err) from err
    if quantization is None:
        # transformers wraps PreTrainedModel.to in a decorator whose stub drops the argument types
        model.to(device)  # type: ignore[arg-type]
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face Llama tensors -> HookedTransformer parameters, one tensor at a time

_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _hooked_views(
    name: str, tensor: Tensor, cfg: HookedTransformerConfig, tied: bool
) -> list[tuple[str, Tensor]]:
    """The HookedTransformer parameters one Hugging Face Llama tensor becomes, as views of it (no copy).

    Returns an empty list for tensors with no parameter (rotary ``inv_freq`` buffers of old checkpoints, and
    ``lm_head.weight`` of a tied model, whose ``W_U`` is a view of the embedding instead).
    """
    kv = "_" if cfg.n_key_value_heads is not None else ""
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    if name == "model.embed_tokens.weight":
        views = [("embed.W_E", tensor)]
        if tied:
            views.append(("unembed.W_U", tensor.T))
        return views
    if name == "lm_head.weight":
        return [] if tied else [("unembed.W_U", tensor.T)]
    if name == "model.norm.weight":
        return [("ln_final.w", tensor)]
    match = _LAYER_TENSOR.match(name)
    if match is None:
        return []
    layer, rest = int(match.group(1)), match.group(2)
    block = f"blocks.{layer}"
    # Hugging Face stores projections as [out, in] with heads outermost on the "out" side.
    table: dict[str, tuple[str, Any]] = {
        "input_layernorm.weight": ("ln1.w", lambda t: t),
        "post_attention_layernorm.weight": ("ln2.w", lambda t: t),
        "self_attn.q_proj.weight": (
            "attn.W_Q",
            lambda t: einops.rearrange(t, "(n h) m -> n m h", n=cfg.n_heads),
        ),
        "self_attn.k_proj.weight": (
            f"attn.{kv}W_K",
            lambda t: einops.rearrange(t, "(n h) m -> n m h", n=n_kv),
        ),
        "self_attn.v_proj.weight": (
            f"attn.{kv}W_V",
            lambda t: einops.rearrange(t, "(n h) m -> n m h", n=n_kv),
        ),
        "self_attn.o_proj.weight": (
            "attn.W_O",
            lambda t: einops.rearrange(t, "m (n h) -> n h m", n=cfg.n_heads),
        ),
        "self_attn.q_proj.bias": ("attn.b_Q", lambda t: einops.rearrange(t, "(n h) -> n h", n=cfg.n_heads)),
        "self_attn.k_proj.bias": (f"attn.{kv}b_K", lambda t: einops.rearrange(t, "(n h) -> n h", n=n_kv)),
        "self_attn.v_proj.bias": (f"attn.{kv}b_V", lambda t: einops.rearrange(t, "(n h) -> n h", n=n_kv)),
        "self_attn.o_proj.bias": ("attn.b_O", lambda t: t),
        "mlp.up_proj.weight": ("mlp.W_in", lambda t: t.T),
        "mlp.gate_proj.weight": ("mlp.W_gate", lambda t: t.T),
        "mlp.down_proj.weight": ("mlp.W_out", lambda t: t.T),
        "mlp.up_proj.bias": ("mlp.b_in", lambda t: t),
        "mlp.down_proj.bias": ("mlp.b_out", lambda t: t),
    }
    if rest.endswith("rotary_emb.inv_freq"):
        return []
    if rest not in table:
        raise ModelLoadError(
            f"Unexpected Llama tensor {name!r}: uds_lens does not know where it goes in "
            "TransformerLens (a Llama variant with extra parameters?)."
        )
    target, view = table[rest]
    return [(f"{block}.{target}", view(tensor))]


def _assemble_hooked(
    hf_config: Any,
    tensors: Iterable[tuple[str, Tensor]],
    dtype: torch.dtype,
    device: str,
    name: str,
    share: bool,
) -> HookedTransformer:
    """A HookedTransformer whose parameters are filled from ``(hf_name, tensor)`` pairs as they arrive.

    The model is built without initialising its weights: untouched pages of its ``torch.empty`` parameters are
    never resident, and each is replaced by a view of the converted tensor, so memory grows by one tensor at a
    time. With ``share=False`` a tensor already in ``dtype``/``device`` is copied (the caller keeps using its model).
    """
    check_supported(hf_config, name)
    cfg = hooked_config_from_hf(hf_config, dtype, device)
    cfg.init_weights = False
    # Tied embeddings: W_U becomes a view of W_E instead of a second copy of the vocabulary matrix.
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    model = new_hooked_transformer(cfg)
    expected = {key: value.shape for key, value in model.named_parameters()}
    filled: set[str] = set()
    for hf_name, tensor in tensors:
        converted = tensor.detach().to(device=device, dtype=dtype)
        if not share and converted.data_ptr() == tensor.data_ptr():
            converted = converted.clone()
        for hooked_name, view in _hooked_views(hf_name, converted, cfg, tied):
            if hooked_name not in expected or tuple(view.shape) != tuple(expected[hooked_name]):
                raise ModelLoadError(
                    f"{name}: tensor {hf_name} {tuple(tensor.shape)} does not fit {hooked_name} "
                    f"{tuple(expected.get(hooked_name, ()))}; its config.json does not describe its weights."
                )
            module_name, attribute = hooked_name.rsplit(".", 1)
            setattr(
                model.get_submodule(module_name), attribute, torch.nn.Parameter(view, requires_grad=False)
            )
            filled.add(hooked_name)
        del tensor, converted
    missing = [key for key in expected if key not in filled]
    for key in missing:
        if (
            key.rsplit(".", 1)[1].lstrip("_").startswith("b_")
        ):  # Llama has no biases: TransformerLens's are zeros
            module_name, attribute = key.rsplit(".", 1)
            zeros = torch.zeros(expected[key], dtype=dtype, device=device)
            setattr(
                model.get_submodule(module_name), attribute, torch.nn.Parameter(zeros, requires_grad=False)
            )
    unfilled = [key for key in missing if not key.rsplit(".", 1)[1].lstrip("_").startswith("b_")]
    if unfilled:
        raise ModelLoadError(
            f"{name} has no weights for {unfilled[:6]}{'...' if len(unfilled) > 6 else ''}: "
            "the checkpoint is incomplete or not a Llama causal LM."
        )
    # nn.Module.to moves the buffers (rotary tables); TransformerLens's own .to prints, and cfg is already set.
    torch.nn.Module.to(model, device=device)
    model.eval()
    model.requires_grad_(False)
    return model


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, Tensor]]:
    """The tensors of one ``.safetensors`` file, one at a time, read with plain file reads.

    ``safetensors.safe_open`` memory-maps the file, and every page it touches counts as resident until the map is
    closed: streaming a 5 GB file through it would look like (and, under memory pressure, be) a second copy of
    the model. The format is a little-endian u64 header length, a JSON header of ``{name: {dtype, shape,
    data_offsets}}``, then the raw bytes.
    """
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
        base = 8 + header_len
        entries = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
        for tensor_name, entry in entries:
            if entry["dtype"] not in _SAFETENSORS_DTYPES:
                raise ModelLoadError(
                    f"{path}: tensor {tensor_name} has dtype {entry['dtype']}, which uds_lens "
                    "cannot read; save the checkpoint in fp32, fp16 or bf16."
                )
            begin, end = entry["data_offsets"]
            buffer = torch.empty(end - begin, dtype=torch.uint8)
            handle.seek(base + begin)
            if handle.readinto(buffer.numpy().data) != end - begin:
                raise ModelLoadError(
                    f"{path} is truncated (tensor {tensor_name}); re-save or re-download it."
                )
            yield tensor_name, buffer.view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _safetensors_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".safetensors" and p.is_file())


def _consume_state(hf_model: Any) -> Iterator[tuple[str, Tensor]]:
    """The tensors of a Hugging Face model that nobody else holds, each released once it is handed out."""
    state = hf_model.state_dict()
    hf_model.to("meta")  # the state dict's tensors now hold the only references to the weights
    gc.collect()
    for key in list(state):
        yield key, state.pop(key)


def hooked_from_hf(
    hf_model: Any, dtype: torch.dtype | None = None, device: str | None = None
) -> HookedTransformer:
    """Wrap an in-memory Hugging Face Llama as a HookedTransformer (weights converted, no folding/centring).

    ``hf_model`` is left intact: its weights are copied (converted one tensor at a time).
    """
    check_supported(hf_model.config, type(hf_model).__name__)
    device = device or str(next(hf_model.parameters()).device)
    dtype = dtype or next(hf_model.parameters()).dtype
    return _assemble_hooked(
        hf_model.config, hf_model.state_dict().items(), dtype, device, type(hf_model).__name__, share=False
    )


def load_model(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    tensors: Iterable[tuple[str, Tensor]] | None = None,
) -> HookedTransformer:
    """Load a Llama checkpoint (directory, ``.gguf`` file, or hub id) as a HookedTransformer.

    A directory of ``.safetensors`` files is streamed tensor by tensor into the model (peak memory: the model plus
    its largest tensor). A ``.gguf`` file, ``.bin`` weights or a hub id are loaded into a Hugging Face model on the
    CPU whose tensors are handed over one at a time (no second copy when the dtype matches). The model remembers
    where it came from (``model.uds_source``) so results can name it.

    ``tensors``: the checkpoint's weights already in memory (``checkpoint.Staged.tensors()``: a sweep reads and
    hashes each checkpoint once), used instead of reading its weight files; parameters are views of them when the
    dtype and device match.
    """
    path_or_id = resolve_zoo_name(path_or_id)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    source = resolve_source(path_or_id)
    name = str(path_or_id)
    files = _safetensors_files(Path(source.location)) if source.kind == "directory" else []
    if files or tensors is not None:
        hf_config = load_hf_config(path_or_id)
        if tensors is None:
            tensors = (item for file in files for item in iter_safetensors(file))
        model = _assemble_hooked(hf_config, tensors, torch_dtype, device, name, share=True)
    else:
        hf_model = load_hf_model(path_or_id, dtype=torch_dtype, device="cpu")
        hf_config = hf_model.config
        model = _assemble_hooked(hf_config, _consume_state(hf_model), torch_dtype, device, name, share=True)
        del hf_model
        # the Hugging Face model's cycles hold its (now meta) modules; streamed tensors need no collection, and a
        # full collection costs ~1 s with transformers and torch loaded (a sweep loads a model per few seconds)
        gc.collect()
    # where the model came from, for result names and fingerprints (describe() reads it back)
    setattr(model, "uds_source", str(path_or_id))  # noqa: B010 - nn.Module's __setattr__ types only tensors/modules
    return model


def load(
    model: Any,
    hooked: bool = True,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: Any = None,
    role: str = "model",
) -> Any:
    """The one way every part of uds_lens turns a model argument into a model.

    A checkpoint reference (a Hugging Face directory, a ``.gguf`` file, a hub id, ``zoo:NAME``) is loaded as a
    ``HookedTransformer`` (``load_model``: the patch target, and the usual source) or, with ``hooked=False``, as a
    plain Hugging Face model (``load_hf_model``: a source read through ``sources.HFSource``; NF4 with
    ``quantization``). A model already in memory (``HookedTransformer`` or Hugging Face) is returned as is.

    Raises:
        TypeError: ``model`` is neither a checkpoint reference nor a model; the message uses ``role``.
    """
    if isinstance(model, (str, os.PathLike)):
        if hooked:
            return load_model(model, dtype=dtype, device=device)
        return load_hf_model(model, dtype=dtype, device=device, quantization=quantization)
    if isinstance(model, HookedTransformer) or hasattr(model, "config"):
        return model
    raise TypeError(
        f"{role} must be a checkpoint path, hub id, HookedTransformer or Hugging Face model "
        f"(got {type(model).__name__})."
    )


def load_tokenizer(path_or_id: str | os.PathLike) -> Any:
    """The fast tokenizer of a checkpoint (UDS needs character offsets to locate entities).

    For a ``.gguf`` file, ``transformers`` rebuilds the tokenizer from the file's vocabulary (slow: seconds);
    ``gguf_to_hf`` saves it once as a regular directory.
    """
    source = resolve_source(path_or_id, weights=False)
    first, kwargs = source.from_pretrained_args()
    try:
        tokenizer = AutoTokenizer.from_pretrained(first, use_fast=True, **kwargs)
    except (OSError, ValueError) as err:
        raise _load_error(source, "tokenizer", err) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Save a Llama ``.gguf`` checkpoint as a Hugging Face directory (fp32 safetensors + tokenizer), once.

    Loading a GGUF dequantises every tensor and rebuilds the tokenizer from the file (a minute for a 135M model on
    two CPU cores); the directory loads in seconds and streams tensor by tensor. Written to a temporary sibling and
    renamed, so an interrupted conversion never leaves a half directory behind.
    """
    source = resolve_source(gguf_path)
    if source.kind != "gguf":
        raise ModelLoadError(f"{gguf_path} is not a .gguf file (nor a directory holding exactly one).")
    out = Path(out_dir).expanduser()
    hf_model = load_hf_model(source.location, dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(source.location)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF (it counts as quantised); the dequantised tensors and a
    # config without the GGUF quantisation entry are a plain fp32 checkpoint.
    config = hf_model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        key: value.contiguous()
        for key, value in hf_model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del hf_model, state
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


@dataclass(frozen=True)
class ArchitectureSignature:
    """What two models must share to be patched into each other."""

    n_layers: int
    d_model: int
    n_heads: int
    n_key_value_heads: int | None
    d_head: int
    d_mlp: int | None  # None only for attention-only models, which TransformerLens allows
    d_vocab: int

    @classmethod
    def of(cls, model: Any) -> ArchitectureSignature:
        if isinstance(model, HookedTransformer):
            c = model.cfg
            return cls(c.n_layers, c.d_model, c.n_heads, c.n_key_value_heads, c.d_head, c.d_mlp, c.d_vocab)
        return cls.of_config(model.config)

    @classmethod
    def of_config(cls, c: Any) -> ArchitectureSignature:
        """The signature a Hugging Face Llama config describes (no weights needed)."""
        n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            n_kv if n_kv != c.num_attention_heads else None,
            head_dim,
            c.intermediate_size,
            c.vocab_size,
        )


def check_compatible(
    target: Any, source: Any, target_name: str = "full", source_name: str = "source"
) -> None:
    """Refuse to patch between models whose architecture or vocabulary differ."""
    a, b = ArchitectureSignature.of(target), ArchitectureSignature.of(source)
    if a == b:
        return
    diffs = [
        f"{k}: {target_name}={getattr(a, k)} vs {source_name}={getattr(b, k)}"
        for k in a.__dataclass_fields__
        if getattr(a, k) != getattr(b, k)
    ]
    kind = "vocabulary" if diffs == [d for d in diffs if d.startswith("d_vocab")] else "architecture"
    raise ModelMismatchError(
        f"{source_name} cannot be patched into {target_name}: the {kind} differs ({'; '.join(diffs)}). "
        "UDS needs checkpoints fine-tuned from one base model with one tokenizer."
    )


def model_fingerprint(model: Any) -> str:
    """A digest of every weight's bytes (not the path): any change to any weight changes it.

    Each tensor is hashed in its logical (row-major) order, in slices of at most 16M elements, so neither a
    transposed parameter view nor a GPU tensor is ever copied whole.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if not torch.is_tensor(tensor):
            continue
        digest.update(name.encode())
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.numel() == 0:
            continue
        flat = (
            tensor.detach().reshape(tensor.shape[0], -1)
            if tensor.dim() > 1
            else tensor.detach().reshape(1, -1)
        )
        rows = max(1, (1 << 24) // flat.shape[1])
        for chunk in flat.split(rows, dim=0):
            digest.update(chunk.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:24]


def checkpoint_stamp(path_or_id: str | os.PathLike) -> str:
    """A cheap identity of a checkpoint for result caches: a local directory's files (name, size, modification time:
    retrained weights or a new chat template change it), a ``.gguf`` file's own, or a hub id as itself."""
    root = Path(path_or_id).expanduser()
    if root.is_file():
        files = [root]
    elif not root.is_dir():
        return str(path_or_id)
    else:
        files = sorted(p for p in root.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:24]


def describe(path_or_model: Any) -> str:
    if isinstance(path_or_model, (str, os.PathLike)):
        return str(path_or_model)
    return (
        getattr(path_or_model, "uds_source", None)
        or getattr(getattr(path_or_model, "config", None), "_name_or_path", None)
        or type(path_or_model).__name__
    )


__all__ = [
    "ArchitectureSignature",
    "CheckpointSource",
    "ModelLoadError",
    "ModelMismatchError",
    "check_compatible",
    "check_supported",
    "checkpoint_stamp",
    "gguf_architecture",
    "gguf_to_hf",
    "is_local",
    "load",
    "iter_safetensors",
    "resolve_source",
    "default_device",
    "default_dtype",
    "describe",
    "hooked_config_from_hf",
    "hooked_from_hf",
    "load_hf_config",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "resolve_dtype",
    "resolve_zoo_name",
]


def model_name(source: Any) -> str:
    """Result name of a model: a directory's basename, or a hub id with ``/`` replaced by ``__``."""
    described = describe(source)
    if described.startswith(ZOO_PREFIX):
        return described[len(ZOO_PREFIX) :].rsplit("/", 1)[-1]
    path = Path(described).expanduser()
    if path.is_dir():
        return path.resolve().name
    return described.replace("/", "__")

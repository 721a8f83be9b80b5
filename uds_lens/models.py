"""Load checkpoints as TransformerLens ``TransformerBridge`` models, without touching the network.

A UDS audit patches activations between three checkpoints of one architecture, so loading is strict: each
checkpoint is read from a local Hugging Face directory (``config.json`` + weights), a ``.gguf`` file (or a directory
holding exactly one; llama.cpp's format, dequantised by ``transformers`` with the ``gguf`` package) or a hub id; its
model type must be one uds_lens supports, and two models are only accepted together when their architecture and
vocabulary match. Which checkpoint an argument names (and what a model is called) is decided first, without the
network, by [`uds_lens.resolve`][uds_lens.resolve], once: each ``load_*`` resolves its argument and hands the resolved
``CheckpointSource`` to its ``read_*``, which reads the config, weights and tokenizer from it (a source resolved
already is returned as it is by ``resolve_source``). The identity of a checkpoint or of a model's weights is
`uds_lens.checkpoint`.

A checkpoint is loaded by ``transformers`` and wrapped as a ``TransformerBridge`` without folding or centring
(``tl_compat.bridge_from_hf``): the bridge's weights are the Hugging Face tensors themselves (no copy) and its
forward is Hugging Face's, so ``blocks.{l}.hook_resid_post`` equals Hugging Face's ``hidden_states[l + 1]`` exactly
(``sources.verify_parity`` checks it). This works alike on TransformerLens 3.9 and 4.x. Every loader error becomes one
[`ModelLoadError`][uds_lens.resolve.ModelLoadError] line naming the checkpoint and the fix ([`loader_errors`][uds_lens.models.loader_errors]).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from uds_lens import memory
from uds_lens.checkpoint import stored_shapes
from uds_lens.config import DTYPE_NAMES, ConfigError
from uds_lens.families import SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES
from uds_lens.files import staging_path
from uds_lens.resolve import (
    SAFE_LOAD_KWARGS,
    CheckpointRef,
    CheckpointSource,
    ModelLoadError,
    hub_error,
    resolve_source,
)
from uds_lens.tl_compat import (
    ModelLike,
    TransformerBridge,
    bridge_from_hf,
    hf_model_of,
    is_hooked_transformer,
    is_tl_model,
)
from uds_lens.weights import check_config_size, check_loading_info

if TYPE_CHECKING:
    from transformers import (
        BitsAndBytesConfig,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

logger = logging.getLogger(__name__)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def explain_load_error(location: str, what: str, err: BaseException) -> ModelLoadError:
    """One line naming the checkpoint, what failed to load, the cause and the fix, for any loader error."""
    text = str(err)
    lowered = text.lower()
    name = type(err).__name__
    if "trust_remote_code" in text or "custom code" in lowered:
        return ModelLoadError(
            f"{location} needs its own Python code to load its {what} (an auto_map in config.json or "
            "tokenizer_config.json), and uds_lens never runs a checkpoint's code: use a checkpoint of a decoder "
            f"family transformers implements itself (model_type in {SUPPORTED_MODEL_TYPES}), or convert this one."
        )
    if name == "UnpicklingError" or "weights only load failed" in lowered or "weights_only" in lowered:
        return ModelLoadError(
            f"The {what} of {location} are pickled (pytorch_model.bin) with objects torch refuses to unpickle "
            "safely (weights_only), so they were not read: convert the checkpoint to safetensors where you trust it "
            "(model.save_pretrained(dir, safe_serialization=True)) and pass that directory."
        )
    if (
        "safetensor" in lowered
        or "header" in lowered
        or name in ("JSONDecodeError", "UnicodeDecodeError", "error")
    ):
        return ModelLoadError(
            f"The {what} of {location} are not readable safetensors ({name}: {_one_line(text, 160)}): the file is "
            "truncated or corrupt; re-save or re-download the checkpoint."
        )
    if "dtype" in lowered:
        return ModelLoadError(
            f"Could not load the {what} of {location} in the requested dtype ({name}: {_one_line(text, 160)}): pass "
            "--dtype float32, bfloat16 or float16."
        )
    return ModelLoadError(
        f"Could not load the {what} of {location} ({name}: {_one_line(text, 200)}): check that it is a complete "
        "checkpoint (config.json, tokenizer files and every weight shard), or re-download it."
    )


@contextlib.contextmanager
def loader_errors(source: CheckpointSource, what: str = "weights") -> Iterator[None]:
    """Turn any error of a checkpoint loader (unpickling, a corrupt safetensors header, a missing shard, a dtype,
    custom code, a hub id that cannot be fetched) into one [`ModelLoadError`][uds_lens.resolve.ModelLoadError] line naming the checkpoint and the
    fix (the CLI prints it and exits 2, no traceback). ``ModelLoadError`` and memory errors pass through unchanged."""
    try:
        yield
    except (ModelLoadError, ConfigError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as err:
        if memory.is_out_of_memory(err):
            raise  # not the checkpoint's fault: the caller frees memory and retries (memory.retry_out_of_memory)
        if source.kind == "hub" and isinstance(err, OSError):
            raise hub_error(source.location, err) from err
        raise explain_load_error(source.location, what, err) from err


class ModelMismatchError(ValueError):
    """Two checkpoints cannot be patched into each other (different architecture or vocabulary)."""


# Names the default device when set (``cpu``, ``cuda``, ``cuda:1``); the test suite sets ``cpu`` (tests/conftest.py).
DEVICE_ENV = "UDS_LENS_DEVICE"


def default_device() -> str:
    """The device a model goes to when none is named: ``$UDS_LENS_DEVICE`` when set, else CUDA when available."""
    pinned = os.environ.get(DEVICE_ENV, "").strip()
    if pinned:
        try:
            torch.device(pinned)
        except RuntimeError:
            raise ValueError(
                f"{DEVICE_ENV}={pinned!r} is not a torch device: set it to cpu, cuda or cuda:N, or unset it."
            ) from None
        return pinned
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | torch.device) -> None:
    """Refuse a device this torch cannot use (``cuda`` on a CPU-only build), naming the fix, before any loading."""
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise ConfigError(f"Unknown device {device!r} ({err}); pass --device cpu or cuda.") from err
    if kind == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build that sees no GPU"
        raise ConfigError(
            f"--device {device} asks for a GPU, but this torch ({torch.__version__}) is {build}: pass --device cpu, "
            "or install a CUDA build of torch on a machine with a GPU."
        )


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on CUDA (what the published implementation runs), fp32 on CPU (exact tests)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# The torch dtype of each name ``UDSConfig.dtype`` / ``--dtype`` accepts (``config.DTYPE_NAMES``).
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
assert set(_TORCH_DTYPES) == set(DTYPE_NAMES), "config.DTYPE_NAMES and the loader's dtypes must agree"


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """A torch dtype from a dtype, one of ``config.DTYPE_NAMES``, or None (the device's default)."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)}.")
    return _TORCH_DTYPES[dtype]


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
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{source.location} is a GGUF checkpoint of architecture {architecture!r}; uds_lens supports "
            f"general.architecture in {SUPPORTED_GGUF_ARCHITECTURES}. Use a model of one of those families."
        )


def load_hf_config(path_or_id: CheckpointRef) -> PretrainedConfig:
    """The Hugging Face config of a checkpoint (directory, ``.gguf`` or hub id), offline for local sources."""
    return read_config(resolve_source(path_or_id))


def read_config(source: CheckpointSource) -> PretrainedConfig:
    """[`load_hf_config`][uds_lens.models.load_hf_config] of a checkpoint resolved already."""
    if source.kind == "gguf":
        _check_gguf(source)
    first, kwargs = source.from_pretrained_args()
    with loader_errors(source, "config"):
        return AutoConfig.from_pretrained(first, **kwargs)


def check_supported(hf_config: PretrainedConfig, name: str) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = getattr(hf_config, "architectures", None)
        raise ModelLoadError(
            f"{name} is a {model_type!r} model ({archs}); uds_lens supports the decoder families "
            f"{SUPPORTED_MODEL_TYPES} (model_type). Use a checkpoint of one of them."
        )


def load_hf_model(
    path_or_id: CheckpointRef,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: BitsAndBytesConfig | None = None,
    attn_implementation: str | None = None,
    state_dict: dict[str, Tensor] | None = None,
) -> PreTrainedModel:
    """A Hugging Face causal LM of a supported family in eval mode (local sources are read offline).

    Args:
        path_or_id: local checkpoint directory, ``.gguf`` file (or a directory holding one), hub id or
            ``zoo:NAME`` (resolved here, once; [`read_hf_model`][uds_lens.models.read_hf_model] takes a source resolved already).
        dtype: torch dtype or its name; default bf16 on CUDA, fp32 on CPU.
        device: "cpu" or "cuda"; default CUDA when available.
        quantization: a ``transformers.BitsAndBytesConfig`` (e.g. NF4), passed through.
        attn_implementation: passed through (``"eager"`` for training: the zoo's numbers are pinned to it).
        state_dict: the weights, already in memory (a sweep's staged read); only the config is read from the
            checkpoint then.
    """
    source = resolve_source(path_or_id)
    return read_hf_model(source, dtype, device, quantization, attn_implementation, state_dict)


def read_hf_model(
    source: CheckpointSource,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: BitsAndBytesConfig | None = None,
    attn_implementation: str | None = None,
    state_dict: dict[str, Tensor] | None = None,
) -> PreTrainedModel:
    """[`load_hf_model`][uds_lens.models.load_hf_model] of a checkpoint resolved already."""
    device = device or default_device()
    check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    hf_config = read_config(source)
    check_supported(hf_config, source.path_or_id)
    first: str | None
    first, kwargs = source.from_pretrained_args()
    loader: Any = AutoModelForCausalLM
    if state_dict is not None:
        # In-memory weights go with a config instead of a checkpoint reference, to the family's own class (the Auto
        # class looks the reference up on disk); parameters are views of the given tensors where the dtype matches.
        first, kwargs = None, {"config": hf_config, "state_dict": state_dict, **SAFE_LOAD_KWARGS}
        loader = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    kwargs["dtype"] = torch_dtype
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        kwargs.update(_quantised_placement(device))
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    _check_size(source, hf_config, state_dict, torch_dtype, device, quantization)
    with loader_errors(source, "weights"), _no_loading_bar():
        model, info = loader.from_pretrained(first, output_loading_info=True, **kwargs)
    check_loading_info(source.location, info)
    if not getattr(model.config, "architectures", None):
        # a config built from GGUF metadata names no architecture; the bridge picks its adapter from it
        model.config.architectures = [type(model).__name__]
    if quantization is None:
        model.to(device)
    return cast("PreTrainedModel", model.eval())


@contextlib.contextmanager
def _no_loading_bar() -> Iterator[None]:
    """transformers' per-model "Loading weights" bar hidden while one model loads (a notebook scoring eight models
    showed eight); uds_lens's own bars, which ``progress`` switches, are the ones that show work."""
    bars = transformers.utils.logging
    shown = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            bars.enable_progress_bar()


def _quantised_placement(device: str) -> dict[str, Any]:
    """Where a quantised model is built: a quantised model cannot be moved after loading (``.to`` refuses it), so
    the device goes to the loader as a one-entry ``device_map`` (every module on ``device``)."""
    return {"device_map": {"": str(torch.device(device))}}


def _check_size(
    source: CheckpointSource,
    hf_config: PretrainedConfig,
    state_dict: dict[str, Tensor] | None,
    dtype: torch.dtype,
    device: str,
    quantization: BitsAndBytesConfig | None,
) -> None:
    """``weights.check_config_size`` before the model is built: the config against the tensors the files (or the
    staged state dict) hold and, unless the weights are already in memory or quantised, against the free memory."""
    stored: list[tuple[int, ...]] | None = None
    if state_dict is not None:
        stored = [tuple(tensor.shape) for tensor in state_dict.values()]
    elif source.kind == "directory":
        with loader_errors(source, "weights"):
            shapes = stored_shapes(source.location)
        stored = list(shapes.values()) if shapes else None  # .bin weights: headers need unpickling
    in_memory = state_dict is not None or quantization is not None
    check_config_size(
        source.location,
        hf_config,
        stored,
        dtype,
        None if in_memory else memory.available_memory_bytes(device),
    )


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face model -> TransformerBridge


def _stand_in_tokenizer() -> PreTrainedTokenizerFast:
    """A one-token fast tokenizer for a bridge over a checkpoint that ships none (the bridge keeps a tokenizer;
    uds_lens tokenises with the checkpoint's own, ``load_tokenizer``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<unk>",
    )


def _check_shards(directory: Path) -> None:
    """Every shard a ``*.safetensors.index.json`` names must be there (the streamed loader reads only what exists)."""
    for index in directory.glob("*.safetensors.index.json"):
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            raise ModelLoadError(
                f"{directory} is missing weight shard(s) {missing} listed in {index.name}: the download or copy "
                "did not finish; fetch the missing files again."
            )


def hooked_from_hf(
    hf_model: PreTrainedModel,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    name: str | None = None,
    keep: bool = True,
) -> TransformerBridge:
    """The ``TransformerBridge`` of an in-memory Hugging Face causal LM (no folding or centring), made once.

    The bridge shares the model's tensors and computes the same numbers (see ``tl_compat.bridge_from_hf``); it is
    kept on the model, so wrapping it again returns the same bridge. ``dtype``/``device``, when given and not the
    model's, move the model first (in place, as ``nn.Module.to`` does).

    ``keep=False`` (``load_model``, whose caller holds the bridge) keeps only a weak reference: the bridge holds the
    model, so a strong one back would make a cycle that keeps both, weights and all, on the device until a garbage
    collection. A kept bridge (a plain model wrapped as a source, wrapped again every batch) is dropped with
    [`release_model`][uds_lens.models.release_model].
    """
    existing = _kept_bridge(hf_model)
    if existing is not None:
        return existing
    param = next(hf_model.parameters())
    if (dtype is not None and dtype != param.dtype) or (
        device is not None and torch.device(device) != param.device
    ):
        # transformers' own decorator hides ``to``'s signature from a type checker
        hf_model.to(device=device or param.device, dtype=dtype or param.dtype)  # type: ignore[call-arg]
    # The bridge may add parameters of its own to the model (a zero unembedding bias): the fingerprint hashes the
    # model's own weights, named before wrapping.
    object.__setattr__(
        hf_model, "_uds_weight_names", frozenset(name for name, _ in hf_model.named_parameters())
    )
    if not getattr(hf_model.config, "architectures", None):
        # a model built from a config (not loaded) names no architecture; the bridge picks its adapter from it
        hf_model.config.architectures = [type(hf_model).__name__]
    bridge = bridge_from_hf(
        hf_model,
        tokenizer if tokenizer is not None else _stand_in_tokenizer(),
        name or str(getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__),
    )
    # object.__setattr__: a module set through nn.Module.__setattr__ would become a submodule of the HF model.
    object.__setattr__(hf_model, "_uds_bridge", bridge if keep else weakref.ref(bridge))
    # Building a bridge leaves garbage that refers to it (TransformerLens's self-recursive closures): collected
    # now, the model's memory goes with its last reference instead of waiting for a collection.
    gc.collect()
    return bridge


def _kept_bridge(hf_model: PreTrainedModel) -> TransformerBridge | None:
    kept = hf_model.__dict__.get("_uds_bridge")
    bridge = kept() if isinstance(kept, weakref.ref) else kept
    return cast("TransformerBridge | None", bridge)


def release_model(model: ModelLike) -> None:
    """Let a model's memory go as soon as the last reference to it is dropped, without a garbage collection.

    Drops the bridge kept on its Hugging Face model (the reference cycle model -> bridge -> model of
    [`hooked_from_hf`][uds_lens.models.hooked_from_hf]); the caller then drops its own references. Safe on any model, and on one already
    released (it is wrapped again when used again).
    """
    hf = hf_model_of(model) if is_tl_model(model) else model
    if hf is not None and hasattr(hf, "__dict__"):
        hf.__dict__.pop("_uds_bridge", None)


def load_model(
    path_or_id: CheckpointRef,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    tensors: Iterable[tuple[str, Tensor]] | None = None,
) -> TransformerBridge:
    """Load a checkpoint (directory, ``.gguf`` file, or hub id) as a ``TransformerBridge``.

    The weights are loaded by ``transformers`` (eager attention, as the bridge's parity with Hugging Face assumes)
    and wrapped without processing, so every hook point holds the Hugging Face model's own activation. The model
    remembers where it came from (``model.uds_source``) so results can name it.

    ``tensors``: the checkpoint's weights already in memory (``checkpoint.Staged.tensors()``: a sweep reads and
    hashes each checkpoint once), used instead of reading its weight files (the config and tokenizer are still read
    from the checkpoint).
    """
    return read_model(resolve_source(path_or_id), dtype, device, tensors)


def read_model(
    source: CheckpointSource,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    tensors: Iterable[tuple[str, Tensor]] | None = None,
) -> TransformerBridge:
    """[`load_model`][uds_lens.models.load_model] of a checkpoint resolved already."""
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    # Before the new weights arrive, not after: a model the caller dropped but that a reference cycle still holds
    # (a bridge of an older release, a traceback) leaves the device now.
    gc.collect()
    with loader_errors(source):
        if source.kind == "directory":
            _check_shards(Path(source.location))
        hf_model = read_hf_model(
            source,
            dtype=torch_dtype,
            device=device,
            attn_implementation="eager",
            state_dict=None if tensors is None else dict(tensors),
        )
    tokenizer = None
    if source.kind == "directory":
        try:
            tokenizer = read_tokenizer(source)
        except (ModelLoadError, OSError, ValueError, TypeError):
            tokenizer = None  # a checkpoint without tokenizer files: the bridge gets a stand-in
    model = hooked_from_hf(hf_model, tokenizer=tokenizer, name=source.path_or_id, keep=False)
    # where the model came from, for result names and fingerprints (describe() reads it back)
    setattr(model, "uds_source", source.path_or_id)  # noqa: B010 - nn.Module's __setattr__ types only tensors/modules
    return model


def load(
    model: object,
    hooked: bool = True,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: BitsAndBytesConfig | None = None,
    role: str = "model",
) -> ModelLike:
    """The one way every part of uds_lens turns a model argument into a model.

    A checkpoint reference (a Hugging Face directory, a ``.gguf`` file, a hub id, ``zoo:NAME``, or a
    [`CheckpointSource`][uds_lens.resolve.CheckpointSource], resolved already) is loaded as a
    ``TransformerBridge`` (``load_model``: the patch target, and the usual source) or, with ``hooked=False``, as a
    plain Hugging Face model (``load_hf_model``: a source wrapped by ``sources.as_source``; NF4 with
    ``quantization``). A model already in memory (a bridge, a TransformerLens 3.x ``HookedTransformer``, or a
    Hugging Face model) is returned as is.

    Raises:
        TypeError: ``model`` is neither a checkpoint reference nor a model; the message uses ``role``.
    """
    if isinstance(model, (str, os.PathLike)):
        source = resolve_source(model)
        if hooked:
            return read_model(source, dtype=dtype, device=device)
        return read_hf_model(source, dtype=dtype, device=device, quantization=quantization)
    if is_tl_model(model):
        return model
    if hasattr(model, "config"):
        return cast("PreTrainedModel", model)
    raise TypeError(
        f"{role} must be a checkpoint path, hub id, TransformerBridge, HookedTransformer or Hugging Face model "
        f"(got {type(model).__name__})."
    )


def load_tokenizer(path_or_id: CheckpointRef) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a checkpoint (UDS needs character offsets to locate entities).

    For a ``.gguf`` file, ``transformers`` rebuilds the tokenizer from the file's vocabulary (slow: seconds);
    ``gguf_to_hf`` saves it once as a regular directory.
    """
    return read_tokenizer(resolve_source(path_or_id, weights=False))


def read_tokenizer(source: CheckpointSource) -> PreTrainedTokenizerBase:
    """[`load_tokenizer`][uds_lens.models.load_tokenizer] of a checkpoint resolved already."""
    first, kwargs = source.from_pretrained_args()
    with loader_errors(source, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(first, use_fast=True, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return cast("PreTrainedTokenizerBase", tokenizer)


def gguf_to_hf(gguf_path: CheckpointRef, out_dir: str | os.PathLike) -> Path:
    """Save a Llama ``.gguf`` checkpoint as a Hugging Face directory (fp32 safetensors + tokenizer), once.

    Loading a GGUF dequantises every tensor and rebuilds the tokenizer from the file (a minute for a 135M model on
    two CPU cores); the directory loads in seconds and streams tensor by tensor. Written to a temporary sibling and
    renamed, so an interrupted conversion never leaves a half directory behind.
    """
    source = resolve_source(gguf_path)
    if source.kind != "gguf":
        raise ModelLoadError(f"{gguf_path} is not a .gguf file (nor a directory holding exactly one).")
    out = Path(out_dir).expanduser()
    hf_model = read_hf_model(source, dtype=torch.float32, device="cpu")
    tokenizer = read_tokenizer(source)
    tmp = staging_path(out)  # a hidden sibling directory, renamed over ``out`` when complete
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
    # A config built from GGUF metadata names no architecture, and the bridge picks its adapter from that field.
    if not getattr(config, "architectures", None):
        config.architectures = [type(hf_model).__name__]
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
    def of(cls, model: ModelLike) -> ArchitectureSignature:
        if is_hooked_transformer(model):
            c = model.cfg
            return cls(c.n_layers, c.d_model, c.n_heads, c.n_key_value_heads, c.d_head, c.d_mlp, c.d_vocab)
        hf = hf_model_of(model) if is_tl_model(model) else model
        if hf is None:
            raise TypeError(f"{type(model).__name__} wraps no Hugging Face model: its shapes are unknown.")
        return cls.of_config(hf.config)

    @classmethod
    def of_config(cls, c: PretrainedConfig) -> ArchitectureSignature:
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
    target: ModelLike, source: ModelLike, target_name: str = "full", source_name: str = "source"
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


__all__ = [
    "ArchitectureSignature",
    "ModelMismatchError",
    "check_compatible",
    "check_device",
    "check_supported",
    "gguf_architecture",
    "gguf_to_hf",
    "load",
    "DEVICE_ENV",
    "default_device",
    "default_dtype",
    "hooked_from_hf",
    "load_hf_config",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "loader_errors",
    "read_config",
    "read_hf_model",
    "read_model",
    "read_tokenizer",
    "release_model",
    "resolve_dtype",
]

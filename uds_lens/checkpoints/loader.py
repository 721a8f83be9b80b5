"""The loader: a `Checkpoint` built into a model, from what the checkpoint already read, its bytes read once.

Every part of uds_lens turns a model argument into a model through `load` (or its two halves, `load_model` for a
TransformerLens ``TransformerBridge`` and `load_hf_model` for a plain Hugging Face model): the argument becomes a
`Checkpoint` at the door (`Checkpoint.resolve`, once), and the loader takes its config (read once, of a supported family,
never asking for the checkpoint's code), its weight files (chosen once by the folder's rules) and its tensor headers
(checked against the config and the free memory before anything is built, `coverage.check_config_size`). The weights
of a directory checkpoint are read once, into memory, hashed in the same pass (`Checkpoint.stage`), and the model is
built from those tensors (views of the bytes read where the dtype matches), so the digest a result records costs no
second read. A ``.gguf`` file, a hub id and a quantised (NF4) load are read by ``transformers`` itself.

A checkpoint is loaded by ``transformers`` and wrapped as a ``TransformerBridge`` without folding or centring
(``tl_compat.bridge_from_hf``): the bridge's weights are the Hugging Face tensors themselves (no copy) and its
forward is Hugging Face's, so ``blocks.{l}.hook_resid_post`` equals Hugging Face's ``hidden_states[l + 1]`` exactly
(``sources.verify_parity`` checks it). This works alike on TransformerLens 3.9 and 4.x. Every loader error becomes one
`ModelLoadError` line naming the checkpoint and the fix (`Checkpoint.errors`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from uds_lens import memory
from uds_lens.checkpoints.checkpoint import SAFE_LOAD_KWARGS, Checkpoint, CheckpointRef
from uds_lens.checkpoints.coverage import check_config_size, check_loading_info
from uds_lens.checkpoints.folder import ModelLoadError, Staged
from uds_lens.config import DTYPE_NAMES, ConfigError
from uds_lens.files import staging_path
from uds_lens.tl_compat import ModelLike, TransformerBridge, bridge_from_hf, hf_model_of, is_tl_model

if TYPE_CHECKING:
    from transformers import (
        BitsAndBytesConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

ModelArg: TypeAlias = CheckpointRef | ModelLike
"""A model as every function that loads one takes it: a checkpoint directory, ``.gguf`` file, hub id or
``zoo:NAME``, a `Checkpoint`, or a model in memory (a TransformerBridge, a HookedTransformer or a Hugging Face
causal LM)."""

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


def load(
    model: object,
    hooked: bool = True,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: BitsAndBytesConfig | None = None,
    role: str = "model",
) -> ModelLike:
    """The one way every part of uds_lens turns a model argument into a model.

    A checkpoint (a Hugging Face directory, a ``.gguf`` file, a hub id, ``zoo:NAME`` or a `Checkpoint`) is loaded
    as a ``TransformerBridge`` (`load_model`: the patch target, and the usual source) or, with ``hooked=False``, as a
    plain Hugging Face model (`load_hf_model`: a source wrapped by ``sources.as_source``; NF4 with
    ``quantization``). A model already in memory (a bridge, a TransformerLens 3.x ``HookedTransformer``, or a
    Hugging Face model) is returned as it is.

    Raises:
        TypeError: ``model`` is neither a checkpoint reference nor a model; the message uses ``role``.
    """
    return build_model(Checkpoint.resolve(model, role=role), hooked, dtype, device, quantization)


def build_model(
    checkpoint: Checkpoint,
    hooked: bool = True,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: BitsAndBytesConfig | None = None,
    staged: Staged | None = None,
) -> ModelLike:
    """The model of a `Checkpoint` made already (what `load` builds, without resolving anything again): its model
    in memory as it is, else a ``TransformerBridge`` or, with ``hooked=False``, a plain Hugging Face model, built
    from what the checkpoint read (``staged``: its weights read ahead, `Checkpoint.stage`)."""
    if checkpoint.model is not None:
        return checkpoint.model
    if hooked:
        return _bridge(checkpoint, dtype, device, staged)
    return _hf_model(checkpoint, dtype, device, quantization, None, staged)


def load_hf_model(
    checkpoint: CheckpointRef,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: BitsAndBytesConfig | None = None,
    attn_implementation: str | None = None,
    staged: Staged | None = None,
) -> PreTrainedModel:
    """A Hugging Face causal LM of a supported family in eval mode (local checkpoints are read offline).

    Args:
        checkpoint: a `Checkpoint`, or what `Checkpoint.resolve` takes (a directory, a ``.gguf`` file, a hub id,
            ``zoo:NAME``).
        dtype: torch dtype or its name; default bf16 on CUDA, fp32 on CPU.
        device: "cpu" or "cuda"; default CUDA when available.
        quantization: a ``transformers.BitsAndBytesConfig`` (e.g. NF4), passed through (``transformers`` reads the
            weight files then).
        attn_implementation: passed through (``"eager"`` for training: the zoo's numbers are pinned to it).
        staged: the checkpoint's weights already read (`Checkpoint.stage`: a sweep reads the next model ahead);
            by default a directory checkpoint's weights are read here, once.
    """
    return _hf_model(Checkpoint.resolve(checkpoint), dtype, device, quantization, attn_implementation, staged)


def _hf_model(
    checkpoint: Checkpoint,
    dtype: str | torch.dtype | None,
    device: str | None,
    quantization: BitsAndBytesConfig | None,
    attn_implementation: str | None,
    staged: Staged | None,
) -> PreTrainedModel:
    """`load_hf_model` of a checkpoint made already (the builder every loader calls)."""
    if checkpoint.model is not None:
        raise TypeError(
            f"{checkpoint.label} is a model in memory already: use it as it is (or uds_lens.load)."
        )
    device = device or default_device()
    check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    config = checkpoint.config
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "output_loading_info": True, **SAFE_LOAD_KWARGS}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    shapes = checkpoint.tensor_shapes
    ahead = staged is not None or quantization is not None
    check_config_size(
        checkpoint.location,
        config,
        None if shapes is None else shapes.values(),
        torch_dtype,
        None if ahead else memory.available_memory_bytes(device),
    )
    loader: Any = AutoModelForCausalLM
    first: str | None
    if checkpoint.kind == "directory" and quantization is None:
        # the weights read once, hashed on the way, and handed over as a state dict: the family's own class takes
        # it with the config (the Auto class would look the reference up on disk)
        staged = staged if staged is not None else checkpoint.stage()
        loader = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        with checkpoint.errors("weights"):
            first, kwargs = None, {**kwargs, "config": config, "state_dict": staged.state_dict()}
    else:
        first, extra = checkpoint.from_pretrained_args()
        kwargs.update(extra)
        if checkpoint.kind != "gguf":
            kwargs["config"] = config
        if quantization is not None:
            kwargs.update(quantization_config=quantization, device_map={"": str(torch.device(device))})
    with checkpoint.errors("weights"), _no_loading_bar():
        model, info = loader.from_pretrained(first, **kwargs)
    if staged is not None:
        staged.release()  # the model holds what it needs of the bytes (views, or converted copies)
    check_loading_info(checkpoint.location, info)
    if not getattr(model.config, "architectures", None):
        # a config built from GGUF metadata names no architecture; the bridge picks its adapter from it
        model.config.architectures = [type(model).__name__]
    # where the model came from: a model in memory is named and compared by its checkpoint (Checkpoint.origin)
    object.__setattr__(model, "uds_checkpoint", checkpoint)
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


def load_model(
    checkpoint: CheckpointRef,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    staged: Staged | None = None,
) -> TransformerBridge:
    """Load a checkpoint (directory, ``.gguf`` file, hub id, ``zoo:NAME`` or `Checkpoint`) as a
    ``TransformerBridge``.

    The weights are loaded by `load_hf_model` (eager attention, as the bridge's parity with Hugging Face assumes)
    and wrapped without processing, so every hook point holds the Hugging Face model's own activation. The model
    remembers where it came from (``model.uds_source``, and its `Checkpoint`) so results can name it.

    ``staged``: the checkpoint's weights already read (`Checkpoint.stage`: a sweep reads and hashes each checkpoint
    once, ahead of its turn).
    """
    return _bridge(Checkpoint.resolve(checkpoint), dtype, device, staged)


def _bridge(
    checkpoint: Checkpoint, dtype: str | torch.dtype | None, device: str | None, staged: Staged | None
) -> TransformerBridge:
    """`load_model` of a checkpoint made already (the builder every loader calls)."""
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    if staged is None:
        # Before the new weights arrive, not after: a model the caller dropped but that a reference cycle still holds
        # (a bridge of an older release, a traceback) leaves the device now. (Weights read ahead are built on the
        # CPU, by a caller that collects before it moves them to the device: the sweep's staging.)
        gc.collect()
    hf_model = _hf_model(checkpoint, torch_dtype, device, None, "eager", staged)
    tokenizer = None
    if checkpoint.kind == "directory":
        try:
            # a copy: the bridge normalises the tokenizer it is given (padding side, special tokens)
            tokenizer = copy.deepcopy(checkpoint.tokenizer)
        except (ModelLoadError, OSError, ValueError, TypeError):
            tokenizer = None  # a checkpoint without tokenizer files: the bridge gets a stand-in
    model = hooked_from_hf(hf_model, tokenizer=tokenizer, name=checkpoint.path_or_id, keep=False)
    # where the model came from, for result names (model_label reads it back)
    setattr(model, "uds_source", checkpoint.path_or_id)  # noqa: B010 - nn.Module's __setattr__ types only tensors/modules
    return model


def load_tokenizer(checkpoint: CheckpointRef) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a checkpoint (`Checkpoint.tokenizer`: read once, shared by checkpoints whose tokenizer
    files are byte-identical); a tokenizer-only directory is accepted."""
    return Checkpoint.resolve(checkpoint, weights=False).tokenizer


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face model -> TransformerBridge


def _stand_in_tokenizer() -> PreTrainedTokenizerFast:
    """A one-token fast tokenizer for a bridge over a checkpoint that ships none (the bridge keeps a tokenizer;
    uds_lens tokenises with the checkpoint's own, `Checkpoint.tokenizer`)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<unk>",
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

    ``keep=False`` (`load_model`, whose caller holds the bridge) keeps only a weak reference: the bridge holds the
    model, so a strong one back would make a cycle that keeps both, weights and all, on the device until a garbage
    collection. A kept bridge (a plain model wrapped as a source, wrapped again every batch) is dropped with
    `release_model`.
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
    `hooked_from_hf`); the caller then drops its own references. Safe on any model, and on one already
    released (it is wrapped again when used again).
    """
    hf = hf_model_of(model) if is_tl_model(model) else model
    if hf is not None and hasattr(hf, "__dict__"):
        hf.__dict__.pop("_uds_bridge", None)


def gguf_to_hf(gguf_path: CheckpointRef, out_dir: str | os.PathLike[str]) -> Path:
    """Save a Llama ``.gguf`` checkpoint as a Hugging Face directory (fp32 safetensors + tokenizer), once.

    Loading a GGUF dequantises every tensor and rebuilds the tokenizer from the file (a minute for a 135M model on
    two CPU cores); the directory loads in seconds and streams tensor by tensor. Written to a temporary sibling and
    renamed, so an interrupted conversion never leaves a half directory behind.
    """
    checkpoint = Checkpoint.resolve(gguf_path)
    if checkpoint.kind != "gguf":
        raise ModelLoadError(f"{gguf_path} is not a .gguf file (nor a directory holding exactly one).")
    out = Path(out_dir).expanduser()
    hf_model = _hf_model(checkpoint, torch.float32, "cpu", None, None, None)
    tokenizer = checkpoint.tokenizer
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


__all__ = [
    "DEVICE_ENV",
    "ModelArg",
    "build_model",
    "check_device",
    "default_device",
    "default_dtype",
    "gguf_to_hf",
    "hooked_from_hf",
    "load",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "release_model",
    "resolve_dtype",
]

"""The loader: a `Checkpoint` built into a model, through one door, its bytes read once.

Every part of uds_lens turns a model argument into a model through `build_model` (`load` resolves the argument first;
`load_model` and `load_hf_model` are its two common calls, a ``TransformerBridge`` and a plain Hugging Face model):
the argument becomes a `Checkpoint` at the door (`Checkpoint.resolve`, once), and the builder takes its config (read
once, of a supported family, never asking for the checkpoint's code), its weight files (chosen once by the folder's
rules) and its tensor headers (checked against the config and the free memory before anything is built,
`coverage.check_config_size`). The weights of a directory or ``.gguf`` checkpoint are read in one pass
(`reader.read_checkpoint`): tensor by tensor, each cast to the model's dtype and placed on its device as it is read,
every byte hashed on the way (or none, where the files' stamp proves the remembered digest), so the load holds the
model plus a few MiB and the digest a result records is that of the very bytes the model holds
(`digests.loaded_digest`). A hub id and a quantised (NF4) load are read by ``transformers`` itself (a quantised local
checkpoint is identified by its files' digest, checked unchanged across the load).

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
from uds_lens.checkpoints import reader
from uds_lens.checkpoints.checkpoint import SAFE_LOAD_KWARGS, Checkpoint, CheckpointRef
from uds_lens.checkpoints.coverage import check_config_size, check_loading_info
from uds_lens.checkpoints.digests import LOADED, check_unchanged, file_stamp, mark_loaded
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.gguf import GgufReader
from uds_lens.checkpoints.reader import Loaded, PickleReader, SafetensorsReader, TensorReader
from uds_lens.config import DTYPE_NAMES, ConfigError
from uds_lens.files import staging_path
from uds_lens.tl_compat import (
    ModelLike,
    TransformerBridge,
    attached_hooks,
    bridge_from_hf,
    hf_model_of,
    is_tl_model,
)

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
    """The one way every part of uds_lens turns a model argument into a model: `Checkpoint.resolve`, then
    `build_model`.

    A checkpoint (a Hugging Face directory, a ``.gguf`` file, a hub id, ``zoo:NAME`` or a `Checkpoint`) is loaded
    as a ``TransformerBridge`` (the patch target, and the usual source) or, with ``hooked=False``, as a plain Hugging
    Face model (a source wrapped by ``sources.as_source``; NF4 with ``quantization``). A model already in memory (a
    bridge, a TransformerLens 3.x ``HookedTransformer``, or a Hugging Face model) is returned as it is.

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
    attn_implementation: str | None = None,
    ahead: bool = False,
    free_bytes: int | None = None,
) -> ModelLike:
    """The builder every door calls: the model of a `Checkpoint` made already.

    Its model in memory is returned as it is; a checkpoint is built as a ``TransformerBridge`` (eager attention, as
    the bridge's parity with Hugging Face assumes; the model remembers where it came from, ``model.uds_source``, and
    its `Checkpoint`) or, with ``hooked=False``, as a plain Hugging Face causal LM in eval mode.

    Args:
        checkpoint: made at the door (`Checkpoint.resolve`).
        hooked: a ``TransformerBridge`` (True) or a plain Hugging Face model.
        dtype: torch dtype or its name; default bf16 on CUDA, fp32 on CPU.
        device: "cpu" or "cuda"; default `default_device`.
        quantization: a ``transformers.BitsAndBytesConfig`` (e.g. NF4), passed through (``transformers`` reads the
            weight files then); plain models only.
        attn_implementation: passed through for a plain model (``"eager"`` for training: the zoo's numbers are
            pinned to it).
        ahead: built ahead of its turn, on a thread beside the computing one (a sweep's look-ahead, on the CPU):
            no garbage collection first (it would hold the interpreter while the other thread computes; the caller
            collects before it moves the model to its device).
        free_bytes: the device's free memory as the run measured it (`UDSAuditor`: once before its models, then its
            plan's figure), which the fit check compares with instead of measuring again (None: measured here).
    """
    if checkpoint.model is not None:
        return checkpoint.model
    device = device or default_device()
    check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if not hooked:
        return _hf_model(checkpoint, torch_dtype, device, quantization, attn_implementation, free_bytes)
    if not ahead:
        # Before the new weights arrive, not after: a model the caller dropped but that a reference cycle still holds
        # (a bridge of an older release, a traceback) leaves the device now.
        gc.collect()
    hf_model = _hf_model(checkpoint, torch_dtype, device, None, "eager", free_bytes)
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


# Config entries that name where a checkpoint came from or how it was saved, not the model it builds.
_PROVENANCE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def _held_tensors(hf: PreTrainedModel) -> dict[str, torch.Tensor]:
    """A wrapped Hugging Face model's parameters and buffers (the tensors themselves) under their Hugging Face names:
    the bridge wraps each module in one holding it as ``_original_component``, a segment dropped here."""
    return {
        key.replace("._original_component", ""): value for key, value in hf.state_dict(keep_vars=True).items()
    }


def refill_model(model: ModelLike, checkpoint: Checkpoint, dtype: torch.dtype) -> ModelLike | None:
    """The model of ``checkpoint`` made by reading its weights into ``model``, a bridge `build_model` made of
    another checkpoint that nothing uses any longer (a sweep's model scored already): its tensors are overwritten in
    place, in the one pass that hashes the bytes (`reader.read_checkpoint`), and the bridge, whose building costs
    several times the read (TransformerLens scans and wraps every module), is kept. None, with ``model`` untouched,
    where the two do not build the same model (then `build_model`): not a safetensors directory, another config
    (but for where it came from and its saved dtype), other tokenizer files, other tensor names or shapes, or tied
    tensors both in the files.

    What it returns is what `build_model` would have built from ``checkpoint``: the same config, tokenizer and
    tensors (each tensor's version advanced, so a memo of the old weights, `digests.model_fingerprint` and the
    fast engine's joined weights, is made again), and the record of this load (its digest, `digests.mark_loaded`).
    An error while reading leaves ``model`` part overwritten: the caller drops it.
    """
    hf = hf_model_of(model) if is_tl_model(model) else None
    before = None if hf is None else hf.__dict__.get("uds_checkpoint")
    if (
        hf is None
        or not isinstance(before, Checkpoint)
        or checkpoint.kind != "directory"
        or before.kind != "directory"
        or checkpoint.files.format != "safetensors"
        or checkpoint.tokenizer_files != before.tokenizer_files
    ):
        return None
    own = {key: value for key, value in checkpoint.config.to_dict().items() if key not in _PROVENANCE}
    old = {key: value for key, value in before.config.to_dict().items() if key not in _PROVENANCE}
    shapes, old_shapes = checkpoint.tensor_shapes, before.tensor_shapes
    if own != old or shapes is None or shapes != old_shapes:
        return None
    held = _held_tensors(hf)
    targets = {name: held[name].detach() for name in shapes if name in held}
    storages = {tensor.data_ptr() for tensor in targets.values()}
    if len(targets) != len(shapes) or len(storages) != len(targets):
        return None  # a tensor the model does not hold by that name, or two names of one (tied) tensor
    if any(tensor.is_floating_point() and tensor.dtype != dtype for tensor in targets.values()):
        return None  # built in another dtype
    devices = {tensor.device for tensor in targets.values()}
    if len(devices) != 1:
        return None  # part moved (a move that failed half way)
    device = devices.pop()
    with checkpoint.errors("weights"):
        root, identifying = checkpoint.identifying()
        readers = _readers(checkpoint, [name for name, _ in identifying], type(hf), dtype, str(device))
        loaded = reader.read_checkpoint(root, identifying, readers, into=targets)
    loaded.take()  # the model holds them
    for tensor in targets.values():
        torch.autograd.graph.increment_version(tensor)
    mark_loaded(hf, loaded)
    object.__setattr__(hf, "uds_checkpoint", checkpoint)
    setattr(model, "uds_source", checkpoint.path_or_id)  # noqa: B010 - as build_model names it
    return model


def vacant_copy(model: ModelLike) -> ModelLike | None:
    """A bridge like ``model`` (one `build_model` made of a safetensors directory) whose tensors from its
    checkpoint's files are new, uninitialised memory, for `refill_model` to read another checkpoint into: a copy of
    the modules (TransformerLens's wrapping included: 0.26 s at SmolLM2-135M on a 2-core CPU, where a build takes
    1.2-1.4 s), not a build. None where ``model`` is not such a bridge.

    The copy holds nothing of ``model``'s but its checkpoint (read only) and its small tensors that the files do not
    hold (rotary tables, a bias the bridge adds), copied; its tokenizer is its own copy, as a build's is. It carries
    no record of a load, so until a refill succeeds nothing takes it for ``model``'s checkpoint: a caller drops it
    where the refill returns None or raises. Make it while nothing runs ``model`` (it copies the modules as they are,
    a model in use would lend it what its run holds; one that carries hooks has none).
    """
    hf = hf_model_of(model) if is_tl_model(model) else None
    checkpoint = None if hf is None else hf.__dict__.get("uds_checkpoint")
    if hf is None or not isinstance(checkpoint, Checkpoint) or checkpoint.kind != "directory":
        return None
    if attached_hooks(model):  # a hook of the model's would be the copy's too
        return None
    shapes = checkpoint.tensor_shapes
    held = _held_tensors(hf)
    if shapes is None or any(name not in held for name in shapes):
        return None
    memo: dict[int, Any] = {id(checkpoint): checkpoint}
    for name in shapes:
        tensor = held[name]
        if id(tensor) not in memo:  # a tied tensor is one object under two names: one new tensor for both
            blank = torch.empty_like(tensor)
            memo[id(tensor)] = (
                torch.nn.Parameter(blank, requires_grad=tensor.requires_grad)
                if isinstance(tensor, torch.nn.Parameter)
                else blank
            )
    vacant = copy.deepcopy(model, memo)
    vacant_hf = hf_model_of(vacant)
    if vacant_hf is None:
        return None
    vacant_hf.__dict__.pop(LOADED, None)  # not the bytes of any checkpoint (yet)
    if isinstance(hf.__dict__.get("_uds_bridge"), weakref.ref):  # copied as is, it would name ``model``
        object.__setattr__(vacant_hf, "_uds_bridge", weakref.ref(vacant))
    return vacant


def load_model(
    checkpoint: CheckpointRef, dtype: str | torch.dtype | None = None, device: str | None = None
) -> TransformerBridge:
    """A checkpoint (directory, ``.gguf`` file, hub id, ``zoo:NAME`` or `Checkpoint`) as a ``TransformerBridge``:
    `build_model` with ``hooked=True``, every hook point holding the Hugging Face model's own activation."""
    return cast("TransformerBridge", build_model(Checkpoint.resolve(checkpoint), True, dtype, device))


def load_hf_model(
    checkpoint: CheckpointRef,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    quantization: BitsAndBytesConfig | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A checkpoint as a plain Hugging Face causal LM of a supported family in eval mode (local checkpoints are read
    offline): `build_model` with ``hooked=False``.

    Raises:
        TypeError: ``checkpoint`` is a model in memory (use it as it is).
    """
    made = Checkpoint.resolve(checkpoint)
    if made.model is not None:
        raise TypeError(f"{made.label} is a model in memory already: use it as it is (or uds_lens.load).")
    return cast("PreTrainedModel", build_model(made, False, dtype, device, quantization, attn_implementation))


def _hf_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: str,
    quantization: BitsAndBytesConfig | None,
    attn_implementation: str | None,
    free_bytes: int | None = None,
) -> PreTrainedModel:
    """The Hugging Face model of a checkpoint on disk or on the hub (the builder's plain half)."""
    config = checkpoint.config
    kwargs: dict[str, Any] = {"dtype": dtype, "output_loading_info": True, **SAFE_LOAD_KWARGS}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    shapes = checkpoint.tensor_shapes
    check_config_size(
        checkpoint.location,
        config,
        None if shapes is None else shapes.values(),
        dtype,
        None
        if quantization is not None
        else free_bytes
        if free_bytes is not None
        else memory.available_memory_bytes(device),
    )
    loaded: Loaded | None = None
    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with checkpoint.errors("weights"), _no_loading_bar():
        # the files its identity covers, listed once: what the load reads (or stamps) and checks unchanged after it
        root, identifying = checkpoint.identifying() if checkpoint.local else (None, [])
        if root is not None and quantization is None:
            # one pass: every tensor read, cast and placed as it lands, hashed on the way; the family's own class
            # takes them with the config (the Auto class would look the reference up on disk)
            readers = _readers(checkpoint, [name for name, _ in identifying], model_class, dtype, device)
            loaded = reader.read_checkpoint(root, identifying, readers)
            if torch.device(device).type != "cpu":
                kwargs["device_map"] = {
                    "": str(torch.device(device))
                }  # the tensors are there already: keep them
            model, info = model_class.from_pretrained(None, config=config, state_dict=loaded.take(), **kwargs)
        else:
            first, extra = checkpoint.from_pretrained_args()
            kwargs.update(extra)
            if checkpoint.kind != "gguf":
                kwargs["config"] = config
            if quantization is not None:
                kwargs.update(quantization_config=quantization, device_map={"": str(torch.device(device))})
            # a quantised local load: transformers reads the files, which must not change meanwhile (stamped just
            # before its read, checked just after)
            stamp = None if root is None else file_stamp(root, identifying)
            auto: Any = AutoModelForCausalLM
            model, info = auto.from_pretrained(first, **kwargs)
            if root is not None and stamp is not None:
                check_unchanged(stamp, root, identifying)
                loaded = Loaded(checkpoint.digest)
    check_loading_info(checkpoint.location, info)
    if loaded is not None:
        mark_loaded(model, loaded)
    if not getattr(model.config, "architectures", None):
        # a config built from GGUF metadata names no architecture; the bridge picks its adapter from it
        model.config.architectures = [type(model).__name__]
    # where the model came from: a model in memory is named and compared by its checkpoint (Checkpoint.origin)
    object.__setattr__(model, "uds_checkpoint", checkpoint)
    if quantization is None:
        model.to(device)
    return cast("PreTrainedModel", model.eval())


def _readers(
    checkpoint: Checkpoint, identifying: list[str], model_class: Any, dtype: torch.dtype, device: str
) -> dict[str, TensorReader]:
    """The reader of each weight file of a local checkpoint, by its name in the identity (``identifying``: the
    names of the files it covers)."""
    target = torch.device(device)
    if checkpoint.kind == "gguf":
        with torch.device("meta"):  # the parameter names only: nothing is allocated
            skeleton = model_class(checkpoint.config)
        names = tuple(skeleton.state_dict())
        del skeleton
        gguf_reader: TensorReader = GgufReader(dtype, target, checkpoint.config, names)
        return {name: gguf_reader for name in identifying}
    files = checkpoint.files
    per_file = (
        SafetensorsReader(dtype, target) if files.format == "safetensors" else PickleReader(dtype, target)
    )
    return {name: per_file for name in files.weight_names}


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
    hf_model = _hf_model(checkpoint, torch.float32, "cpu", None, None)
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

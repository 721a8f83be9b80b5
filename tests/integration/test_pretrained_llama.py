"""A real pretrained Llama (SmolLM2-135M-Instruct from its .gguf, see tests/helpers/pretrained.py) through the whole
pipeline: what the tiny random models cannot show (30 layers, GQA, tied embeddings, a no-BOS byte-level tokenizer,
weights that know facts)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pytest
import torch
from helpers import pretrained as pretrained_llama
from nbclient import NotebookClient

from uds_lens.analysis.diagnose import diagnose
from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.digests import model_fingerprint
from uds_lens.checkpoints.loader import load_hf_model, load_model
from uds_lens.config import SITES, EngineSpec
from uds_lens.data import encode, load_examples
from uds_lens.patching.batch import pad_batch
from uds_lens.patching.engines import engine_for, source_activations
from uds_lens.sources import verify_parity

pytestmark = pytest.mark.xdist_group("pretrained_llama")


@pytest.fixture(scope="module")
def encoded(pretrained):
    examples, skipped = encode(load_examples(pretrained.data), pretrained.tokenizer)
    assert not skipped
    return examples


def test_the_real_model_is_what_the_issue_describes(pretrained):
    cfg = pretrained.models["full"].cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_vocab) == (
        30,
        576,
        9,
        3,
        49152,
    )
    # tied embeddings stay one tensor; the tokenizer prepends no BOS
    full = pretrained.models["full"]
    assert full.unembed.W_U.data_ptr() == full.embed.W_E.data_ptr()
    assert (
        pretrained.tokenizer("Question: x", add_special_tokens=True)["input_ids"][0]
        != pretrained.tokenizer.bos_token_id
    )


def test_hooked_log_probs_match_hugging_face(pretrained, encoded):
    """The bridge vs Hugging Face's eager forward on the real model (fp32): every position's log-probs, every
    block's hook_resid_post and the final norm identical (the bridge runs Hugging Face's own modules)."""
    hf = load_hf_model(pretrained.full, dtype="float32", device="cpu", attn_implementation="eager")
    batch = pad_batch(encoded, pretrained.tokenizer.pad_token_id, cut=False)
    with torch.no_grad():
        ours = torch.log_softmax(pretrained.models["full"](batch.tokens).float(), -1)
        theirs = torch.log_softmax(hf(batch.tokens).logits.float(), -1)
    real = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    for row, example in enumerate(encoded):
        real[row, : len(example.input_ids)] = True
    # exact by construction: the bridge runs Hugging Face's Llama modules (attention op for op) on its tensors
    assert (ours[real] - theirs[real]).abs().max() == 0.0
    parity = verify_parity(pretrained.models["full"], hf, batch.tokens[:2])
    assert parity == {"resid_post": 0.0, "final_norm": 0.0, "logits": 0.0}, parity
    # not vacuous: the retain model's residual stream differs
    assert verify_parity(pretrained.models["retain"], hf, batch.tokens[:2])["resid_post"] > 1e-2


@pytest.mark.slow
def test_loading_from_the_gguf_file_gives_the_same_weights(pretrained):
    """The .gguf loader (dequantised by transformers) and the converted directory are the same model."""
    from_gguf = load_model(pretrained_llama.gguf_file(), dtype="float32", device="cpu")
    assert model_fingerprint(from_gguf) == model_fingerprint(pretrained.models["full"])


@pytest.mark.parametrize("scope", ["span", "boundary"])
def test_fast_equals_naive_on_the_real_model(pretrained, encoded, scope):
    """Every site; the first, middle and last layers (the naive oracle costs one 30-layer forward per layer)."""
    full, source = pretrained.models["full"], pretrained.models["retain"]
    batch = pad_batch(encoded[:3], pretrained.tokenizer.pad_token_id, scope)
    layers = [0, 1, 14, 28, 29]
    for site in SITES:
        acts = source_activations(source, batch.tokens, EngineSpec(site, layers))
        naive = engine_for(EngineSpec(site, layers, "naive")).patched_scores(full, batch, acts)
        fast = engine_for(EngineSpec(site, layers, "fast")).patched_scores(full, batch, acts)
        assert (naive - fast).abs().max() <= 1e-5, site
        clean = engine_for(EngineSpec(site, layers)).clean_run(full, batch)
        assert (naive - clean.scores[:, None]).abs().max() > 1e-2, site  # the patch matters
        base = engine_for(EngineSpec(site, layers)).baseline_scores(full, batch, clean)
        assert (base - clean.scores[:, None]).abs().max() <= 1e-5, site


# bf16 / fp16 fast-vs-naive tolerances, in nats; why these values: tests/unit/test_dtypes.py.
HALF_TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.02}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_equals_naive_in_half_precision_on_the_real_model(pretrained, encoded, dtype):
    full = load_model(pretrained.full, dtype=dtype, device="cpu")
    source = load_model(pretrained.retain, dtype=dtype, device="cpu")
    batch = pad_batch(encoded[:3], pretrained.tokenizer.pad_token_id, "span")
    layers = [0, 14, 29]
    worst = {}
    for site in SITES:
        acts = source_activations(source, batch.tokens, EngineSpec(site, layers))
        naive = engine_for(EngineSpec(site, layers, "naive")).patched_scores(full, batch, acts)
        fast = engine_for(EngineSpec(site, layers, "fast")).patched_scores(full, batch, acts)
        worst[site] = (naive - fast).abs().max().item()
    assert max(worst.values()) <= HALF_TOLERANCE[dtype], worst


def test_uds_anchors_on_the_real_model(pretrained, tmp_path):
    """full -> full is exactly 0, retain -> retain exactly 1, the mix strictly between; the metadata says fp32."""
    auditor = UDSAuditor(
        pretrained.models["full"],
        pretrained.models["retain"],
        pretrained.data,
        tokenizer=pretrained.tokenizer,
        cache_dir=False,
        progress=False,
        limit=4,
    )
    assert auditor.stage1.s0.max() < 0  # log-probs
    assert (auditor.d1() > 0.05).any(-1).all(), "every fact must have a knowledge-encoding layer"
    same = auditor.score(pretrained.models["full"], name="full")
    # exact by construction: the engine's baseline repeats the operations of a patch whose source is the target
    assert same.uds == 0.0 and (same.layers.d2 == 0).all()
    retained = auditor.score(pretrained.models["retain"], name="retain")
    defined = retained.examples.uds.dropna()
    assert len(defined) == len(auditor.encoded) and ((defined - 1.0).abs() <= 1e-6).all()
    mixed = auditor.score(pretrained.models["unlearned"], name="unlearned")
    assert 0.0 < mixed.uds < 1.0
    assert mixed.summary["log_softmax_dtype"] == "float32"
    mixed.save(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["meta"]["log_softmax_dtype"] == "float32"


def test_entities_merged_with_a_space_or_next_to_punctuation_are_located(pretrained, encoded):
    """SPEC §1.2.4 on a real byte-level BPE: a token that starts with the entity's preceding space belongs to the
    entity; a token holding only the space (and punctuation) before it does not."""
    tokens = {
        e.idx: pretrained.tokenizer.convert_ids_to_tokens(
            list(e.input_ids[e.prompt_len + e.entity_start : e.prompt_len + e.entity_end])
        )
        for e in encoded
    }
    assert tokens[0] == ["ĠParis"]
    assert tokens[1] == ["ĠWilliam", "ĠShakespeare"]
    assert tokens[3] == [
        "ĠYes"
    ]  # empty prefix: the prompt ends at "Answer:", the space moves to the reference
    assert tokens[5] == ["D", "une"]  # 'Ġ"' (space + quote) stays outside
    assert tokens[6] == ["1", "9", "4", "5"]  # the lone 'Ġ' before the digits stays outside
    for example in encoded:
        decoded = pretrained.tokenizer.decode(
            list(
                example.input_ids[
                    example.prompt_len + example.entity_start : example.prompt_len + example.entity_end
                ]
            )
        )
        record = next(r for r in load_examples(pretrained.data) if r.idx == example.idx)
        assert decoded.strip() == record.entity


def test_diagnose_runs_on_the_real_model(pretrained, tmp_path):
    records = json.loads(pretrained.data.read_text())[:3]
    result = diagnose(
        pretrained.full,
        pretrained.retain,
        {"unlearned": pretrained.unlearned},
        records,
        tmp_path / "diag",
        methods=("uds", "logit_lens", "cka"),
        sites=("resid_post",),
        dtype="float32",
        device="cpu",
    )
    scores = json.loads((tmp_path / "diag" / "unlearned" / "scores.json").read_text())
    assert 0.0 < scores["uds"] < 1.0
    for key, value in scores.items():
        assert value is None or (0.0 <= value <= 1.0 and not math.isnan(value)), key
    assert list(result.scores.index) == ["unlearned"]
    assert result.scores.at["unlearned", "uds"] == pytest.approx(scores["uds"])


@pytest.mark.slow
@pytest.mark.parametrize("notebook", ["01_quickstart", "02_layer_diagnostics", "03_component_patching"])
def test_notebook_code_paths_on_the_real_model(pretrained, notebook, tmp_path, monkeypatch):
    """The notebooks' "your own checkpoints" path, with the real model and three examples."""
    path = Path(__file__).resolve().parents[2] / "notebooks" / f"{notebook}.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source += (
        f"\nFULL = {str(pretrained.full)!r}\nRETAIN = {str(pretrained.retain)!r}"
        f"\nUNLEARNED = {str(pretrained.unlearned)!r}\nDATA = {str(pretrained.data)!r}\nDEVICE = 'cpu'\nN_EXAMPLES = 3\n"
    )
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache"))
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors

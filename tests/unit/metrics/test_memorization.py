"""uds_lens/metrics/memorization.py: EM/ES/Prob on hand-built logits, ES edge cases, Min-K++ z, batching."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tiny import make_records, make_tiny_llama, make_tiny_tokenizer

from uds_lens.metrics.chat import EncodedQA
from uds_lens.metrics.memorization import (
    _answer_scores,
    exact_memorization,
    extraction_strength,
    harmonic_mean,
    memorization_score,
    min_k_plus_plus_z,
    score_answers,
    truth_ratio,
)
from uds_lens.readout import IGNORE_INDEX


class _Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _one_hot_logits(next_tokens: list[int], vocab: int = 10, scale: float = 5.0) -> torch.Tensor:
    logits = torch.zeros(len(next_tokens), vocab)
    for position, token in enumerate(next_tokens):
        logits[position, token] = scale
    return logits


def test_em_es_prob_on_constructed_logits() -> None:
    # prompt = [9, 8, 7]; answer tokens [1, 2, 3, 4] then EOS 5.  Position t predicts input t + 1.
    input_ids = (9, 8, 7, 1, 2, 3, 4, 5)
    labels = (IGNORE_INDEX,) * 3 + (1, 2, 3, 4, 5)
    item = EncodedQA(input_ids, labels, input_ids[:3])
    # Predictions for the answer positions: 1 wrong, then 2, 3, 4 right, then a wrong EOS prediction.
    predicted_next = [0, 0, 6, 2, 3, 4, 0, 0]
    scores = _answer_scores(_one_hot_logits(predicted_next), item, _Decoder())
    # OU alignment drops the last label (EOS): n = 4 positions predicting [1, 2, 3, 4].
    assert scores.targets.tolist() == [1, 2, 3, 4]
    assert scores.predictions.tolist() == [6, 2, 3, 4]
    assert exact_memorization(scores.predictions, scores.targets) == pytest.approx(3 / 4)
    assert extraction_strength(scores.predictions, scores.targets) == pytest.approx(1 - 1 / 4)
    # Prob averages the CE over all five answer tokens, EOS included.
    log_p = torch.log_softmax(_one_hot_logits(predicted_next), -1)
    ce = [-float(log_p[t - 1, input_ids[t]]) for t in range(3, 8)]
    assert scores.avg_loss == pytest.approx(sum(ce) / 5, rel=1e-5)
    assert scores.prob == pytest.approx(math.exp(-sum(ce) / 5), rel=1e-5)
    assert scores.target_text == "1 2 3 4 5"


@pytest.mark.parametrize(
    ("predictions", "targets", "expected"),
    [
        ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], 1.0),  # all match: k = 0
        ([0, 0, 3, 4, 5], [1, 2, 3, 4, 5], 1 - 2 / 5),  # suffix from position 2
        ([0, 0, 0, 0, 5], [1, 2, 3, 4, 5], 1 / 5),  # only the last token matches: k = n - 1
        ([1, 2, 3, 4, 0], [1, 2, 3, 4, 5], 1 / 5),  # no suffix matches: k defaults to n - 1 (published quirk)
        ([1], [1], 0.0),  # at most one position: 0
        ([], [], 0.0),
    ],
)
def test_extraction_strength_edge_cases(predictions, targets, expected) -> None:
    value = extraction_strength(
        torch.tensor(predictions, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
    )
    assert value == pytest.approx(expected)


def test_exact_memorization_undefined_for_one_position() -> None:
    assert exact_memorization(torch.tensor([1]), torch.tensor([1])) is None
    assert exact_memorization(torch.tensor([1, 0]), torch.tensor([1, 2])) == pytest.approx(0.5)


def test_min_k_plus_plus_z_matches_direct_formula() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float32) * 3
    targets = torch.randint(0, 11, (6,))
    z = min_k_plus_plus_z(logits, targets)
    for t in range(6):
        log_p = torch.log_softmax(logits[t].double(), -1)
        p = log_p.exp()
        mu = sum(float(p[v] * log_p[v]) for v in range(11))
        second = sum(float(p[v] * log_p[v] ** 2) for v in range(11))
        sigma = math.sqrt(max(second - mu**2, 1e-6))
        assert float(z[t]) == pytest.approx((float(log_p[targets[t]]) - mu) / sigma, rel=1e-4, abs=1e-5)


def test_truth_ratio_and_mem() -> None:
    assert truth_ratio(0.5, [0.5, 0.5]) == pytest.approx(0.5)
    assert truth_ratio(0.9, [0.1, 0.001]) > 0.9  # knows the right answer
    assert truth_ratio(0.0, [0.2]) == 0.0
    assert memorization_score(0.0, 0.0, 0.0, 0.0) == pytest.approx(1.0)
    assert memorization_score(1.0, 0.0, 0.0, 0.0) < 1e-9  # HM collapses on one fully memorised axis


def test_harmonic_mean_zeros_and_nans() -> None:
    assert harmonic_mean([0.5, 0.5]) == pytest.approx(0.5)
    assert harmonic_mean([0.0, 1.0]) < 1e-10
    assert harmonic_mean([float("nan"), 0.4, None]) == pytest.approx(0.4)
    assert math.isnan(harmonic_mean([]))


def test_scores_do_not_depend_on_batching(tmp_path) -> None:
    tokenizer = make_tiny_tokenizer()
    model_dir = make_tiny_llama(tmp_path / "m", tokenizer=tokenizer)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    records = make_records(5, seed=3)
    pairs = [(r["question"], r["answer"]) for r in records]
    one = score_answers(model, tokenizer, pairs, batch_size=1)
    many = score_answers(model, tokenizer, pairs, batch_size=5)
    for a, b in zip(one, many, strict=True):
        assert a.avg_loss == pytest.approx(b.avg_loss, rel=1e-4)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert torch.equal(a.predictions, b.predictions)

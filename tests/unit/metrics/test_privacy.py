"""uds_lens/metrics/privacy.py: attack scores, AUC direction on a model that memorised the forget set, s_MIA."""

from __future__ import annotations

import pytest
import torch

from uds_lens.metrics.memorization import score_answers
from uds_lens.metrics.privacy import (
    attack_scores,
    mia_auc,
    min_k_score,
    normalised_mia,
    paper_privacy,
    privacy_score,
    zlib_score,
)


def test_min_k_takes_the_lowest_forty_percent() -> None:
    values = torch.tensor([-1.0, -5.0, -0.5, -3.0, -2.0])
    assert min_k_score(values) == pytest.approx(4.0)  # floor(0.4 * 5) = 2 lowest: -5, -3
    assert min_k_score(torch.tensor([-2.0, -1.0])) == pytest.approx(2.0)  # at least one value


def test_zlib_divides_by_compressed_length() -> None:
    import zlib

    assert zlib_score(2.0, "abcabc") == pytest.approx(2.0 / len(zlib.compress(b"abcabc")))


def test_auc_convention_forget_is_label_zero() -> None:
    # Forget answers have low loss (members), holdout high: AUC 1 means "forget still recognised".
    assert mia_auc([0.1, 0.2, 0.3], [1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert mia_auc([1.0, 2.0], [0.1, 0.2]) == pytest.approx(0.0)


def test_normalised_mia_and_privacy() -> None:
    assert normalised_mia(0.6, 0.6) == 1.0
    assert normalised_mia(0.9, 0.6) == pytest.approx(0.5)
    assert normalised_mia(0.0, 0.4) == 0.0  # clipped at 0
    assert normalised_mia(1.0, 0.3) == 0.0
    assert privacy_score([1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert privacy_score([1.0, 0.0, 1.0, 1.0]) < 1e-10
    assert paper_privacy(0.5, 0.5) == pytest.approx(0.5)


def test_memorised_forget_set_gives_auc_near_one(memorised) -> None:
    from transformers import AutoModelForCausalLM

    m = memorised
    tokenizer, base, trained, forget, holdout = m.tokenizer, m.base, m.trained, m.forget, m.holdout
    model = AutoModelForCausalLM.from_pretrained(trained).eval()
    f = attack_scores(
        score_answers(model, tokenizer, [(r["question"], r["answer"]) for r in forget], batch_size=12)
    )
    h = attack_scores(
        score_answers(model, tokenizer, [(r["question"], r["answer"]) for r in holdout], batch_size=12)
    )
    for attack in ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_kpp"):
        assert mia_auc(f[attack], h[attack]) > 0.85, attack
    random_model = AutoModelForCausalLM.from_pretrained(base).eval()
    f0 = attack_scores(
        score_answers(random_model, tokenizer, [(r["question"], r["answer"]) for r in forget], batch_size=12)
    )
    h0 = attack_scores(
        score_answers(random_model, tokenizer, [(r["question"], r["answer"]) for r in holdout], batch_size=12)
    )
    assert abs(mia_auc(f0["mia_loss"], h0["mia_loss"]) - 0.5) < 0.35

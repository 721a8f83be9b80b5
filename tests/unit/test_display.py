"""What a result shows of itself: the clipped share (SPEC 1.6c), short reprs and the notebook's HTML view."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from uds_lens import uds
from uds_lens.results import UDSResult

# Three examples x four layers. With tau = 0.05 the KE cells are: example 3 layers 1-3 (layer 2 clipped: d2 = 2 d1),
# example 7 layers 0-3 (none clipped); example 5 has no KE layer (its d2 > d1 cells are below tau: not clipped).
D1 = np.array([[0.01, 0.5, 1.0, 2.0], [0.0, 0.02, 0.03, 0.04], [0.2, 0.4, 0.8, 1.6]])
D2 = np.array([[0.5, 0.25, 2.0, 2.0], [0.0, 1.0, 1.0, 1.0], [0.1, 0.1, 0.1, 0.1]])
IDX = [3, 5, 7]


def _result(d1: np.ndarray = D1, d2: np.ndarray = D2) -> UDSResult:
    n_layers = d1.shape[1]
    layers = pd.DataFrame(
        {
            "idx": np.repeat(IDX, n_layers),
            "layer": np.tile(range(n_layers), len(IDX)),
            "site": "resid_post",
            "s0": -1.0,
            "baseline_score": -1.0,
            "s1_score": (-1 - d1).ravel(),
            "s2_score": (-1 - d2).ravel(),
            "d1": d1.ravel(),
            "d2": d2.ravel(),
            "ke": False,
            "ler": np.nan,
        }
    )
    examples = pd.DataFrame(
        {
            "idx": [*IDX, 9],
            "prompt_type": ["a", "b", "a", "b"],
            "n_entity_tokens": [2, 2, 2, 0],
            "skip_reason": ["", "", "", "entity_not_found"],
            "question": ["Who wrote it?", "What?", "Where?", "Q"],
            "entity": ["Nikolai Abilov", "X", "Y", "Z"],
        }
    )
    settings = {"tau": None, "site": "resid_post", "patch_scope": "span"}
    return UDSResult("npo", examples, layers, settings).with_tau(0.05)


def test_clipped_counts_only_ke_cells_where_d2_exceeds_d1():
    result = _result()
    counts = result.examples.set_index("idx")["n_clipped"]
    assert counts.to_dict() == {3: 1, 5: 0, 7: 0, 9: 0}
    clipped = result.clipped
    assert clipped["n_ke_cells"] == 7 and clipped["n_clipped_cells"] == 1
    assert clipped["clipped_share"] == pytest.approx(1 / 7)
    assert clipped["clipped_median_ratio"] == pytest.approx(2.0)
    assert result.example(3).clipped_layers == [2]
    summary = result.summary
    assert summary["clipped_share"] == pytest.approx(1 / 7) and summary["n_clipped_cells"] == 1


def test_clipping_is_reported_and_never_changes_uds():
    # the same result with the clipped cell's d2 lowered to d1: LER is 1 either way, so UDS is unchanged
    lowered = D2.copy()
    lowered[0, 2] = D1[0, 2]
    result, unclipped = _result(), _result(d2=lowered)
    assert result.uds == pytest.approx(unclipped.uds)
    assert unclipped.clipped["n_clipped_cells"] == 0 and result.clipped["n_clipped_cells"] == 1


def test_clipped_summary_of_a_grid_without_ke_is_undefined_not_zero():
    summary = uds.clipped_summary(np.full((2, 3), 0.01), np.ones((2, 3)))
    assert summary["n_ke_cells"] == 0 and np.isnan(summary["clipped_share"])
    assert np.isnan(summary["clipped_median_ratio"])


def test_a_result_saved_before_n_clipped_and_the_split_counts_them_on_load(tmp_path):
    result = _result()
    result.save(tmp_path / "npo")
    added = ["n_clipped", "uds_unclipped", "uds_clipped", "excess_disruption"]
    examples = pd.read_csv(tmp_path / "npo" / "examples.csv").drop(columns=added)
    examples.to_csv(tmp_path / "npo" / "examples.csv", index=False)
    loaded = UDSResult.load(tmp_path / "npo", verify=False)
    assert loaded.examples.set_index("idx")["n_clipped"].to_dict() == {3: 1, 5: 0, 7: 0, 9: 0}
    pd.testing.assert_frame_equal(
        loaded.examples[added], result.examples[added], check_exact=False, rtol=1e-6
    )


def test_the_repr_is_short_rounded_and_says_what_the_score_rests_on():
    result = _result()
    text = repr(result)
    assert "UDS 0.531" in text and "[0." in text
    assert "2 scored, 1 no KE, 1 skipped" in text
    assert "14% of 7 KE cells" in text
    assert not re.search(r"\d\.\d{5,}", text), text  # no 17-digit floats


def test_the_repr_splits_uds_into_its_measured_and_clipped_parts():
    # example 3: KE layers 1-3, d1 (0.5, 1, 2), d2 (0.25, 2, 2): UDS 3.25 / 3.5, of which layer 2's 1 / 3.5 is
    # clipped (d2 = 2 d1) and its excess (2 - 1) / 3.5; example 7 is never clipped. Model: means of the two.
    split = _result().split
    assert split["uds_clipped"] == pytest.approx((1 / 3.5) / 2)
    assert split["uds_unclipped"] == pytest.approx((2.25 / 3.5 + 0.4 / 3.0) / 2)
    assert split["excess_disruption"] == pytest.approx((1 / 3.5) / 2)
    assert split["n_mostly_clipped"] == 0  # example 3's clipped part (0.29) is under half its UDS (0.93)
    text = repr(_result())
    cis = _result().split_ci95
    assert re.search(
        r"UDS 0\.531 \[0\.\d{3}, 0\.\d{3}\] = measured 0\.388 \[0\.\d{3}, 0\.\d{3}\] \+ clipped 0\.143 ", text
    )
    assert f"clipped 0.143 [{cis['uds_clipped'][0]:.3f}, {cis['uds_clipped'][1]:.3f}] (27% of UDS)" in text
    assert (
        f"excess disruption 0.14 [{cis['excess_disruption'][0]:.2f}, {cis['excess_disruption'][1]:.2f}]"
        in text
    )


def test_the_html_view_is_one_field_a_row_with_ci_split_counts_and_clipped_share():
    html = _result()._repr_html_()
    # one label/value row per field: no row as wide as all of them together (it overflowed a notebook column)
    assert html.count("<tr>") == 7 and "<thead>" not in html
    for cell in (
        "0.531 [0.133, 0.929]",
        "0.388 [",  # the measured part, with its CI
        "(27% of UDS)",
        "0.14 [",  # excess disruption, with its CI
        "2 scored, 1 no KE, 1 skipped",
        "14% (1 of 7 KE cells, median d2/d1 2.00)",
        "tau 0.05 nats",
        "entity_not_found (1)",
    ):
        assert cell in html, cell


def _bf16(check: bool, bound: float) -> dict:
    """A precision record as a bf16 run writes it (``meta["precision"]``): three examples, two of them in fp32."""
    return {
        "dtype": "bfloat16",
        "check": check,
        "tolerance": 1e-3,
        "band": {"scale": 8.0 if check else 55.0, "measured": check},
        "weights": {"full": "stored"},
        "not_redecided": {},
        "n_fragile_cells": 4,
        "n_fragile_ke": 3,
        "n_fragile_clip": 2,
        "n_redecided_cells": 4 if check else 0,
        "n_fp32_examples": 2 if check else 0,
        "decisions": {"ke": {"float32": 12, "bfloat16": 0}, "clip": {"float32": 7, "bfloat16": 0}},
        "max_uds_bound": bound,
        "per_example": {str(i): {"fragile": 1, "redecided": 1, "uds_bound": 0.0} for i in IDX},
    }


def test_a_bf16_result_says_how_many_examples_ran_in_fp32():
    """The repr and the notebook view of a reduced-precision result say what ran in fp32 (and why, and its cost
    where timed); with the check off, the fragile cells left, and a bound past UDS's range capped at 1."""
    result = _result()
    result.meta["precision"] = _bf16(check=True, bound=0.0)
    result.meta["timings"] = {
        "s2_seconds": 4.5,
        "s2_precision_seconds": 3.7,
        "s2_precision_copy_seconds": 0.9,
    }
    assert "bfloat16: Stage 2 of 2 of 3 examples in fp32, 4 decisions re-decided in fp32" in repr(result)
    html = result._repr_html_()
    assert (
        "Stage 2 of 2 of 3 examples ran in fp32 (in bfloat16 rounding could move their UDS by more than"
        in html
    )
    assert "the fp32 runs took 3.7 s of Stage 2&#x27;s 4.5 s, plus 0.9 s making fp32 copies" in html
    result.meta["precision"] = _bf16(check=False, bound=5.31)
    text = repr(result)
    assert "precision check off: 4 fragile cells not re-decided" in text
    assert "up to 1, its whole range (the band's bound, 5.31, exceeds it)" in text
    assert "precision" not in repr(_result())  # fp32: nothing to say


def test_an_example_view_names_its_model_question_and_clipped_layers():
    view = _result().example(3)
    text = repr(view)
    assert text.startswith("ExampleView(example 3 (npo, scored): UDS 0.929 over 3 KE layers")
    assert "d2 > d1 at layers [2]" in text and "'Nikolai Abilov'" in text
    assert "DataFrame" not in text and "\n" not in text
    html = view._repr_html_()
    assert html.count("<tr>") == 1 + 4  # header + one row per layer
    assert html.count("d2 &gt; d1</td>") == 1


def test_loading_a_checkpoint_shows_no_third_party_bar(tiny, capfd):
    import transformers

    from uds_lens.checkpoints.loader import load_model

    transformers.utils.logging.enable_progress_bar()
    load_model(tiny.full, device="cpu")
    assert "Loading weights" not in capfd.readouterr().err
    assert transformers.utils.logging.is_progress_bar_enabled()  # the user's own setting is given back


def test_the_auditor_shows_what_it_holds_not_an_address(tiny):
    from uds_lens.auditor import UDSAuditor

    auditor = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False)
    text = repr(auditor)
    assert " at 0x" not in text and text.startswith("UDSAuditor(full: ")
    assert f"{len(auditor.encoded)} examples encoded, {len(auditor.skipped)} skipped" in text
    assert "tau 0.05 nats" in text and "Stage 1: not yet" in text
    html = auditor._repr_html_()
    assert html.count("<tr>") == 1 + 7 and "retain" in html

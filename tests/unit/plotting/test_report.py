"""uds_lens/report.py: a self-contained HTML page from saved result directories."""

from __future__ import annotations

import json
import re
import shutil

import pandas as pd
import pytest
from helpers.synthetic import make_result
from plotly.offline import get_plotlyjs

from uds_lens.plotting.report import load_results, load_roles, write_report

MODELS = {"full": 0.0, "retain": 1.0, "graddiff": 0.3, "rmu_l2": 0.6}


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    for name, erasure in MODELS.items():
        result = make_result(name, erasure, n_examples=10, n_layers=5)
        result.save(root / name)
    (root / "roles.json").write_text(
        json.dumps({"full": "full", "retain": "retain", "graddiff": "unlearned", "rmu_l2": "unlearned"})
    )
    return root


@pytest.fixture(scope="module")
def report_html(results_dir) -> str:
    return write_report(results_dir).read_text()


def test_load_results_round_trips_tables(results_dir):
    results = load_results(results_dir)
    assert set(results) == set(MODELS)
    original = make_result("graddiff", MODELS["graddiff"], n_examples=10, n_layers=5)
    loaded = results["graddiff"]
    assert loaded.uds == pytest.approx(original.uds)
    pd.testing.assert_frame_equal(loaded.layers, original.layers, check_dtype=False)
    assert loaded.layers["ke"].dtype == bool


def test_roles_come_from_roles_json_or_the_caller(results_dir, tmp_path):
    assert load_roles(results_dir)["retain"] == "retain"
    assert load_roles(tmp_path / "missing") == {}
    page = write_report(
        results_dir, tmp_path / "r.html", roles={"graddiff": "pos", "rmu_l2": "neg"}
    ).read_text()
    models = _first_table(page).set_index("model")
    # the caller's roles win; roles.json names the others (every model shows a role)
    assert models.loc["graddiff", "role"] == "pos" and models.loc["full", "role"] == "full"


def test_report_is_self_contained(report_html):
    assert report_html.startswith("<!DOCTYPE html>")
    assert len(re.findall(r"<script[^>]*\bsrc\s*=", report_html)) == 0
    assert report_html.count(get_plotlyjs()[:300]) == 1
    # The plotly bundle defines Plotly once; each figure only calls it.
    assert report_html.count("Plotly.newPlot") >= 3
    assert not re.search(r"<(link|img)[^>]*(href|src)\s*=\s*[\"']https?:", report_html)


def _first_table(page: str) -> pd.DataFrame:
    table = re.search(r"<table.*?</table>", page, flags=re.S).group(0)
    header = re.findall(r"<th>(.*?)</th>", table)
    rows = [
        re.findall(r"<td>(.*?)</td>", row, flags=re.S)
        for row in re.findall(r"<tr>(.*?)</tr>", table, flags=re.S)
    ]
    return pd.DataFrame([row for row in rows if row], columns=header)


def test_report_lists_every_model_with_role_and_ci(report_html):
    models = _first_table(report_html)
    assert list(models["model"]) == ["full", "retain", "graddiff", "rmu_l2"]  # ordered by role
    assert list(models["role"]) == ["full", "retain", "unlearned", "unlearned"]
    assert models["CI 95%"].str.match(r"\[-?\d\.\d{3}, \d\.\d{3}\]").all()
    for name in ("graddiff", "rmu_l2"):
        assert f"{name} (unlearned) · UDS" in report_html  # per-model section
    assert "full (full) · UDS" not in report_html  # the references (UDS 0 and 1) get no per-model section


def test_report_has_bar_chart_and_heatmaps(report_html):
    assert '"type":"bar"' in report_html
    assert (
        report_html.count('"type":"heatmap"') >= 1 + 2
    )  # the shared d1 map + one LER map per unlearned model
    assert "RMU layer profile" in report_html


def _layerwise(erasure: float) -> pd.DataFrame:
    """diagnose's layerwise.csv: method, layer, erasure, weight."""
    return pd.DataFrame(
        [
            {
                "method": method,
                "layer": layer,
                "erasure": min(1.0, erasure + shift * (layer > 1)),
                "weight": layer / 4,
            }
            for method, shift in (("uds", 0.0), ("logit_lens", 0.5), ("cka", 0.2))
            for layer in range(5)
        ]
    )


def test_report_with_diagnose_outputs(results_dir, tmp_path):
    results_dir = shutil.copytree(results_dir, tmp_path / "results")
    prompt_rows, tau_rows = [], []
    for name in ("graddiff", "retain"):
        directory = results_dir / name
        result = make_result(name, MODELS[name], n_examples=10, n_layers=5, sites=("attn_out", "resid_post"))
        components = (
            result.layers.groupby(["site", "layer"])
            .agg(mean_d1=("d1", "mean"), mean_d2=("d2", "mean"))
            .reset_index()
        )
        components.to_csv(directory / "components.csv", index=False)
        _layerwise(MODELS[name]).to_csv(directory / "layerwise.csv", index=False)
        (directory / "scores.json").write_text(
            json.dumps({"uds": MODELS[name], "cka": 0.4, "tuned_lens": None})
        )
        prompt_rows += [
            {"model": name, "prompt_type": t, "n": 5, "n_scored": 4, "mean_uds": MODELS[name]} for t in "ab"
        ]
        tau_rows += [{"model": name, "tau": t, "uds": MODELS[name], "n_no_ke": 0} for t in (0.01, 0.05)]
    pd.DataFrame(tau_rows).to_csv(results_dir / "tau_sensitivity.csv", index=False)
    pd.DataFrame(prompt_rows).to_csv(results_dir / "prompt_types.csv", index=False)
    out = write_report(results_dir, tmp_path / "sub" / "r.html")
    page = out.read_text()
    assert out.parent.name == "sub"
    for heading in (
        "Component patching", "Logit lens vs UDS", "Every method per layer", "τ sensitivity", "Other metrics",
        "Prompt types",
    ):  # fmt: skip
        assert heading in page


def test_report_from_diagnose_only_directories(tmp_path):
    for name, erasure in (("npo", 0.4), ("simnpo", 0.7)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "scores.json").write_text(
            json.dumps({"uds": erasure, "logit_lens": erasure + 0.1})
        )
        _layerwise(erasure).to_csv(tmp_path / name / "layerwise.csv", index=False)
    page = write_report(tmp_path).read_text()
    models = _first_table(page)
    assert list(models["model"]) == ["npo", "simnpo"] and list(models["UDS"]) == ["0.400", "0.700"]
    assert "Logit lens vs UDS" in page


def test_report_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="uds-lens score"):
        write_report(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no saved results"):
        write_report(tmp_path)


def test_incomplete_result_directories_are_marked_not_included(tiny, tmp_path):
    from uds_lens.auditor import UDSAuditor
    from uds_lens.plotting.report import find_incomplete

    result = UDSAuditor(tiny.full, tiny.retain, tiny.data, cache_dir=False, progress=False).score(
        tiny.unlearned
    )
    for name in ("good", "torn", "mixed"):
        result.save(tmp_path / name)
    (tmp_path / "torn" / "layers.csv").write_text("")  # a kill while the file was written
    examples = pd.read_csv(tmp_path / "mixed" / "examples.csv")
    examples["uds"] = 0.99  # another run's numbers
    examples.to_csv(tmp_path / "mixed" / "examples.csv", index=False)
    shutil.copytree(tmp_path / "good", tmp_path / "partial")
    (tmp_path / "partial" / "meta.json").unlink()
    (tmp_path / "partial" / "layers.csv").unlink()
    assert (
        set(load_results(tmp_path)) == {result.name}
        and load_results(tmp_path)[result.name].path.name == "good"
    )
    assert set(find_incomplete(tmp_path)) == {"torn", "mixed", "partial"}
    page = write_report(tmp_path).read_text()
    assert "Incomplete results (not shown)" in page
    for name in ("torn", "mixed", "partial"):
        assert f"<code>{name}</code>" in page


def test_the_report_says_where_each_uds_comes_from(tmp_path):
    """One model that erases, one that over-disrupts: the models table carries both parts of UDS and the excess
    disruption with their intervals, the headline chart hatches the clipped part, the depth-vs-disruption view is
    drawn, and a page of one model says "1 model"."""
    root = tmp_path / "results"
    make_result("npo", 0.4, n_examples=10, n_layers=5).save(root / "npo")
    make_result("damaged", 2.0, n_examples=10, n_layers=5).save(root / "damaged")
    page = write_report(root).read_text()
    models = _first_table(page).set_index("model")
    measured, clipped, excess = (
        "measured part [95% CI]",
        "clipped part [95% CI] (share of UDS)",
        "excess disruption [95% CI]",
    )
    assert {measured, clipped, excess, "examples mostly clipped"} <= set(models.columns)
    assert models.loc["damaged", clipped].endswith("of UDS)")
    assert float(models.loc["damaged", excess].split()[0]) > 0.5 > float(models.loc["npo", excess].split()[0])
    assert '"shape":"\\u002f"' in page or '"shape":"/"' in page  # the hatched (clipped) part of the bars
    assert "Depth vs over-disruption" in page and "tau = 0.05 nats" in page and "2 models from" in page
    shutil.rmtree(root / "damaged")
    assert "1 model from" in write_report(root).read_text()


def test_the_report_gives_intervals_on_both_parts_and_explains_its_two_percentages(tmp_path):
    root = tmp_path / "results"
    result = make_result("damaged", 2.0, n_examples=10, n_layers=5)
    result.save(root / "damaged")
    page = write_report(root).read_text()
    row = _first_table(page).set_index("model").loc["damaged"]
    cis = result.split_ci95
    assert row["measured part [95% CI]"].endswith(
        f"[{cis['uds_unclipped'][0]:.3f}, {cis['uds_unclipped'][1]:.3f}]"
    )
    assert (
        f"[{cis['uds_clipped'][0]:.3f}, {cis['uds_clipped'][1]:.3f}]"
        in row["clipped part [95% CI] (share of UDS)"]
    )
    low, high = cis["excess_disruption"]
    assert row["excess disruption [95% CI]"].endswith(f"[{low:.2f}, {high:.2f}]")
    assert "Two percentages: &#x27;of UDS&#x27;" in page or "Two percentages: 'of UDS'" in page


def test_the_report_has_a_provenance_block(tmp_path):
    """Checkpoints by their weights' digests, the forget set with its records' digest, skip reasons, versions, dtype,
    device and time: what summary.json and meta.json recorded, on the page; every caption ends with its basis."""
    root = tmp_path / "results"
    result = make_result("npo", 0.4, n_examples=10, n_layers=5)
    fingerprint = {"full": "files:xxh3_128/v2:aaaa", "retain": "files:xxh3_128/v2:bbbb", "data": "cccc1234",
                   "unlearned": "files:xxh3_128/v2:dddd"}  # fmt: skip
    result.meta.update(
        full="ckpt/full", retain="ckpt/retain", unlearned="ckpt/npo", data="forget.json", device="cpu",
        dtype="torch.float32", versions={"uds_lens": "0.1.0", "torch": "2.13.0"}, fingerprint=fingerprint,
        timings={"s1_seconds": 1.5, "s2_seconds": 2.25},
    )  # fmt: skip
    result.save(root / "npo")
    page = write_report(root).read_text()
    block = page[page.index('id="provenance"') :]
    for fact in (
        "ckpt/full (weights files:xxh3_128/v2:aaaa)",
        "ckpt/retain (weights files:xxh3_128/v2:bbbb)",
        "forget.json, 10 records (records digest cccc1234)",
        "uds_lens 0.1.0, torch 2.13.0",
        "float32, cpu",
        "ckpt/npo (weights files:xxh3_128/v2:dddd)",
        "entity not found in answer (1)",  # the synthetic result's skipped example, with its reason
        "Stage 1 1.5 s, Stage 2 2.2 s",
        " UTC",
    ):
        assert fact in block, fact
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page, flags=re.S)
    assert captions and all("Basis: n = 8 examples per model (scored), tau = 0.05 nats, float32 on cpu." in c
                            for c in captions)  # fmt: skip


def test_a_bf16_report_says_how_many_examples_ran_in_fp32(tmp_path):
    root = tmp_path / "results"
    result = make_result("npo", 0.4, n_examples=10, n_layers=5)
    result.meta["precision"] = _bf16_record(n_fp32=9, n_examples=11, check=True)
    result.meta["timings"] = {
        "s2_seconds": 4.5,
        "s2_precision_seconds": 3.7,
        "s2_precision_copy_seconds": 0.9,
    }
    result.save(root / "npo")
    page = write_report(root).read_text()
    assert "Stage 2 of 9 of 11 examples ran in fp32" in page
    assert (
        "the fp32 runs took 3.7 s of Stage 2&#x27;s 4.5 s" in page
        or "the fp32 runs took 3.7 s of Stage 2's" in page
    )


def _bf16_record(n_fp32: int, n_examples: int, check: bool, bound: float = 0.0) -> dict:
    return {
        "dtype": "bfloat16",
        "check": check,
        "tolerance": 1e-3,
        "band": {"scale": 8.0 if check else 55.0, "measured": check},
        "weights": {},
        "not_redecided": {},
        "n_fragile_cells": 5,
        "n_fragile_ke": 5,
        "n_fragile_clip": 0,
        "n_redecided_cells": 5 if check else 0,
        "n_fp32_examples": n_fp32,
        "decisions": {"ke": {"float32": 40, "bfloat16": 0}, "clip": {"float32": 30, "bfloat16": 0}},
        "max_uds_bound": bound,
        "per_example": {str(i): {"fragile": 0, "redecided": 0, "uds_bound": 0.0} for i in range(n_examples)},
    }


def test_the_report_exports_its_figures_in_one_call(tmp_path):
    """write_report(figures=...) (uds-lens report --figures png) writes every figure of the page beside it, numbered
    in page order, with their captions; rendered by kaleido or a local browser (one run for all the PNGs)."""
    from uds_lens.zoo.notebook_html import find_browser

    try:
        import kaleido  # noqa: F401
    except ImportError:
        if find_browser() is None:
            pytest.skip("neither kaleido nor a Chrome/Chromium to render with")
    root = tmp_path / "results"
    make_result("npo", 0.4, n_examples=6, n_layers=4).save(root / "npo")
    out = write_report(root, figures=("png",))
    folder = out.with_name("report_figures")
    pngs = sorted(folder.glob("*.png"))
    n_figures = out.read_text().count("<figure class=")
    assert len(pngs) == n_figures > 3
    assert pngs[0].name.startswith("01-uds-per-model") and all(
        p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs
    )
    captions = (folder / "captions.txt").read_text()
    assert captions.count("Basis: n = 4 examples") == n_figures  # 6 minus one no-KE, one skipped


def test_a_figure_exports_as_a_vector_pdf(tmp_path):
    from uds_lens.plotting.export import write_figures
    from uds_lens.zoo.notebook_html import find_browser

    try:
        import kaleido  # noqa: F401
    except ImportError:
        if find_browser() is None:
            pytest.skip("neither kaleido nor a Chrome/Chromium to render with")
    from uds_lens import plotting

    figure = plotting.uds_bar({"npo": make_result("npo", 0.4, n_examples=6, n_layers=4)})
    (pdf,) = write_figures([("bars", figure)], tmp_path, ["pdf"])
    assert pdf == tmp_path / "bars.pdf" and pdf.read_bytes()[:5] == b"%PDF-"

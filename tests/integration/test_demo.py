"""`make demo`'s job (uds_lens.demo.run_demo) on the test zoo: every model scored, the report written, pools kept."""

import pytest

from uds_lens.demo import DEMO_ROLES, run_demo
from uds_lens.zoo.layout import load_zoo


@pytest.mark.slow
def test_demo_scores_the_zoo_and_keeps_its_pools_listed(test_zoo, tmp_path):
    out = tmp_path / "demo"
    table = run_demo(out, zoo_dir=test_zoo.root, size="test", threads=1, progress=False).set_index("model")
    expected = [m["name"] for m in test_zoo.models if m["role"] in DEMO_ROLES]
    assert list(table.index) == expected and "pos_qa_std" not in table.index
    assert table.at["full", "uds"] <= 0.03 and table.at["retain", "uds"] == pytest.approx(1.0)
    assert table.at["retain90", "uds"] < table.at["retain50", "uds"]
    assert (table["n_skipped"] == 0).all() and (table["ci_low"] <= table["uds"]).all()
    assert (out / "report.html").stat().st_size > 10_000 and (out / "uds_table.csv").is_file()
    assert (out / "npo" / "summary.json").is_file()
    # beside UDS, where it comes from: retain erases without any clipped cell, full has nothing to split
    assert table.at["retain", "uds_clipped"] == 0.0 and table.at["retain", "excess_disruption"] == 0.0
    assert (table["uds_clipped"] <= table["uds"] + 1e-12).all() and (table["excess_disruption"] >= 0).all()
    # the demo needs no pools, but a zoo that has them keeps them listed for the meta-evaluation
    again = load_zoo(test_zoo.root)
    assert again.names("pos") == test_zoo.names("pos") and again.names("neg") == test_zoo.names("neg")


def test_demo_scores_the_test_zoo_first_while_the_default_zoo_is_unbuilt(test_zoo, tmp_path, monkeypatch):
    """A first run shows a table from the test-size zoo before the (minutes-long) default zoo build starts."""
    import pandas as pd

    import uds_lens.demo as demo

    events = []
    monkeypatch.delenv("UDS_LENS_ZOO", raising=False)
    monkeypatch.setattr(
        demo, "default_zoo_dir", lambda size: test_zoo.root if size == "test" else tmp_path / size
    )

    def build(root, size="test", **kwargs):
        events.append(("build", size))
        return load_zoo(test_zoo.root)

    def score(zoo, out, config, progress):
        events.append(("score", out.name))
        entries = [m for m in zoo.models if m["role"] in DEMO_ROLES]
        return pd.DataFrame({"model": [m["name"] for m in entries], "uds": 0.5}), entries, {}

    monkeypatch.setattr(demo, "build_zoo", build)
    monkeypatch.setattr(demo, "score_zoo", score)
    monkeypatch.setattr(demo, "write_report", lambda *args, **kwargs: events.append(("report",)))
    table = run_demo(
        tmp_path / "out",
        size="default",
        progress=False,
        on_preview=lambda table, root: events.append(("preview", str(root), len(table))),
    )
    n_models = len([m for m in test_zoo.models if m["role"] in DEMO_ROLES])
    assert events == [
        ("build", "test"),
        ("score", "preview"),
        ("preview", str(test_zoo.root), n_models),
        ("build", "default"),
        ("score", "out"),
        ("report",),
    ]
    assert len(table) == n_models
    # once the default zoo exists (a manifest), or without a preview callback, nothing is scored twice
    assert demo.preview_zoo("default", test_zoo.root) is None
    assert demo.preview_zoo("test", None) is None


def test_the_demo_finds_its_zoo_under_the_cache_root(tmp_path, monkeypatch):
    """The demo's zoo is files.zoo_root: UDS_LENS_ZOO when set, else zoo-SIZE under UDS_LENS_CACHE."""
    from uds_lens.demo import default_zoo_dir, preview_zoo

    monkeypatch.delenv("UDS_LENS_ZOO", raising=False)
    monkeypatch.setenv("UDS_LENS_CACHE", str(tmp_path / "cache"))
    assert default_zoo_dir("default") == tmp_path / "cache" / "zoo-default"
    assert preview_zoo("default", None) == tmp_path / "cache" / "zoo-test"
    monkeypatch.setenv("UDS_LENS_ZOO", str(tmp_path / "mine"))
    assert default_zoo_dir("default") == tmp_path / "mine" and preview_zoo("default", None) is None


@pytest.mark.slow
def test_the_demo_table_shows_the_clipped_part_and_the_excess(test_zoo, tmp_path):
    """`uds-lens demo` prints, beside each UDS, the part of it from clipped cells with its share and the excess
    disruption: on the test zoo NPO and RMU at layer 0 reach a high UDS mostly through clipped cells."""
    from typer.testing import CliRunner

    from uds_lens.cli import app

    argv = [
        "demo",
        "--size",
        "test",
        "--zoo-dir",
        str(test_zoo.root),
        "--out",
        str(tmp_path / "demo"),
        "--threads",
        "1",
    ]
    run = CliRunner().invoke(app, argv)
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    header = next(line for line in lines if "ci95" in line)
    assert "measured" in header and "clipped_part" in header and "excess" in header
    for name in ("npo", "rmu_l0"):
        row = next(line for line in lines if line.split()[:1] == [name] and "%" in line)
        share = int(row.split("(")[1].split("%")[0])
        assert share > 50, row  # most of these models' UDS rests on clipped cells
    assert "excess: how far past retain's disruption" in run.output

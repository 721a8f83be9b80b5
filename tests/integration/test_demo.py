"""`make demo`'s job (uds_lens.demo.run_demo) on the test zoo: every model scored, the report written, pools kept."""

import pytest

from uds_lens.demo import DEMO_ROLES, run_demo
from uds_lens.zoo import load_zoo


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
    # the demo needs no pools, but a zoo that has them keeps them listed for the meta-evaluation
    again = load_zoo(test_zoo.root)
    assert again.names("pos") == test_zoo.names("pos") and again.names("neg") == test_zoo.names("neg")

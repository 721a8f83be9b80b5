"""The guide "UDS on MUSE and WMDP" runs as written (docs/guides/muse-wmdp.md, as test_readme.py runs the README):
every command of its shell block, in a folder where each hub id it names is a local copy at the id's own path (the
datasets in the hub's shape, ``helpers/benchmark_copies.py``; the models the test zoo's), offline, so nothing is
fetched and nothing is rewritten."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.benchmark_copies import write_copies

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "muse-wmdp.md"
# each hub id the guide names, and the test zoo's model that stands for it
MODELS = {
    "muse-bench/MUSE-News_target": "full",
    "muse-bench/MUSE-News_retrain": "retain",
    "saves/unlearn/muse_news_npo": "npo",
    "HuggingFaceH4/zephyr-7b-beta": "full",
    "cais/Zephyr_RMU": "rmu_l1",
}


def guide_commands() -> list[str]:
    """The guide's first shell block, one command a line (continuation lines joined), comments left out."""
    (block, *_) = re.findall(r"^```bash\n(.*?)^```", GUIDE.read_text(), flags=re.MULTILINE | re.DOTALL)
    joined = re.sub(r"\\\n\s*", "", block)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.slow
def test_the_guides_commands_run_as_written_against_local_copies(test_zoo, tmp_path):
    commands = guide_commands()
    assert [c.split()[1] for c in commands] == ["score", "score", "report", "score", "report"]
    named = {
        word.split("=")[-1]
        for c in commands
        for word in c.split()
        if re.fullmatch(r"[\w.=-]+/[\w./-]+", word)
    }
    assert named - {"runs/knowmem", "runs/verbmem", "runs/wmdp-bio"} == set(MODELS)
    work = tmp_path / "reader"
    write_copies(
        work,
        json.loads(test_zoo.forget_path.read_text()),
        json.loads(test_zoo.data_path("retain").read_text()),
    )
    for hub_id, zoo_name in MODELS.items():
        (work / hub_id).parent.mkdir(parents=True, exist_ok=True)
        (work / hub_id).symlink_to(test_zoo.path(zoo_name), target_is_directory=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
        "UDS_LENS_CACHE": str(tmp_path / "cache"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    printed = []
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=work, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        printed.append(done.stdout)

    def summary(run: str, model: str) -> dict:
        return json.loads((work / "runs" / run / model / "summary.json").read_text())

    knowmem = summary("knowmem", "npo")
    assert knowmem["uds"] is not None and knowmem["n_scored"] > 0
    assert knowmem["data"] == "hf:muse-bench/MUSE-News/knowmem:forget_qa" and re.search(
        r"model +uds +ci95", printed[0]
    )
    verbmem = summary("verbmem", "npo")
    assert verbmem["forms"] == ["completion"] and verbmem["uds"] is not None
    assert "first sentence of its continuation" in printed[1]
    assert "UDS" in (work / "runs" / "knowmem" / "report.html").read_text()
    wmdp = summary("wmdp-bio", "rmu")
    assert wmdp["retain_free"] and wmdp["uds"] is None and wmdp["forms"] == ["choice"]
    table = [line for line in printed[3].splitlines() if line.startswith("model ")]
    assert len(table) == 1 and re.match(r"model +mean_d2", table[0]) and "uds" not in table[0]
    assert "retain-free mode" in printed[3] and "its correct letter" in printed[3]
    page = (work / "runs" / "wmdp-bio" / "report.html").read_text()
    assert "UDS" not in page and "Retain-free report" in page

"""What a sweep runs on, without running models: model lists, the shipped TOFU registry, the published comparison."""

import math
import os

import pandas as pd
import pytest

from uds_lens.plotting.meta_eval import published_scatter
from uds_lens.sweep.driver import sweep
from uds_lens.sweep.lists import (
    REGISTRIES,
    SCATTER_HTML,
    SWEEP_TABLE,
    SweepError,
    SweepModel,
    load_registry,
    read_model_list,
    registry_path,
    resolve_models,
)
from uds_lens.sweep.published import add_published_comparison, write_published_scatter


def test_model_list_reads_csv_rows_and_bare_paths(tmp_path):
    with_header = tmp_path / "with_header.csv"
    with_header.write_text("name,path_or_id\nnpo,/ckpt/npo\n# a comment\n\nrmu,org/rmu-model\n")
    assert read_model_list(with_header) == [
        SweepModel("npo", "/ckpt/npo"),
        SweepModel("rmu", "org/rmu-model"),
    ]
    # bare paths are named as `uds-lens score` names them: basenames, parents where two clash; hub ids with __
    for run in ("a", "b"):
        (tmp_path / run / "npo").mkdir(parents=True)
    (tmp_path / "rmu_l1").mkdir()
    bare = tmp_path / "bare.txt"
    bare.write_text(f"{tmp_path}/a/npo\n{tmp_path}/b/npo\n{tmp_path}/rmu_l1\norg/some-model\n")
    names = [model.name for model in read_model_list(bare)]
    assert names[2:] == ["rmu_l1", "org__some-model"]
    assert names[0] != names[1] and all(name.endswith("npo") for name in names[:2])
    assert read_model_list(bare)[0].source == f"{tmp_path}/a/npo"


@pytest.mark.parametrize(
    "content, message",
    [
        ("a,/x\na,/y\n", "share the result name"),
        ("../escape,/x\n", "single path component"),
        ("a,/x,extra\n", "row 1"),
        ("# only a comment\n", "has no models"),
    ],
)
def test_model_list_refuses_ambiguous_or_unsafe_rows(tmp_path, content, message):
    path = tmp_path / "models.csv"
    path.write_text(content)
    with pytest.raises(SweepError, match=message):
        read_model_list(path)


def test_shipped_registry_is_package_data_with_the_papers_models():
    path = registry_path("tofu-llama-3.2-1b")
    assert path.is_file() and path.parent.name == "registries" and path.parent.parent.name == "uds_lens"
    models = load_registry("tofu-llama-3.2-1b")
    methods = {model.method for model in models}
    # the anchors (full, retain) are references, not unlearned models
    assert methods == {"altpo", "graddiff", "idkdpo", "idknll", "npo", "rmu", "simnpo", "undial"}
    assert len(models) == len(pd.read_csv(path)) - 2
    assert all(model.source.startswith("open-unlearning/") for model in models)
    published = load_registry("tofu-llama-3.2-1b", published_only=True)
    assert len(published) == 150  # the 150 models the paper reports
    assert all(0.0 <= model.published["published_uds"] <= 1.0 for model in published)


def test_registry_method_filter(tmp_path):
    models = load_registry("tofu-llama-3.2-1b", methods=["npo", " RMU"])
    assert {model.method for model in models} == {"npo", "rmu"}
    assert len(models) == 108
    anchors = load_registry("tofu-llama-3.2-1b", methods=["full", "retain"])
    assert [model.name for model in anchors] == ["full", "retain"]
    assert anchors[1].published["published_uds"] == 1.0
    with pytest.raises(SweepError, match="no method \\['dpo'\\]"):
        load_registry("tofu-llama-3.2-1b", methods=["dpo"])
    with pytest.raises(SweepError, match="tofu-llama-3.2-1b"):
        load_registry("tofu-llama-3.2-8b")


def test_models_come_from_exactly_one_source(tmp_path):
    with pytest.raises(SweepError, match="not both"):
        resolve_models(["/x"], "tofu-llama-3.2-1b")
    with pytest.raises(SweepError, match="not both and not neither"):
        resolve_models(None, None)
    with pytest.raises(SweepError, match="filters a registry"):
        resolve_models(["/x"], None, methods=["npo"])
    assert resolve_models({"a": "/x/y"}) == [SweepModel("a", "/x/y")]


def test_bad_options_fail_before_any_model_is_loaded(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SweepError, match="is a file"):
        sweep("/no/full", "/no/retain", "/no/data.json", tmp_path / "file", ["/x"])
    with pytest.raises(SweepError, match="workers must be >= 1"):
        sweep("/no/full", "/no/retain", "/no/data.json", tmp_path / "out", ["/x"], workers=0)
    with pytest.raises(SweepError, match=r"limit \(--limit\) must be a positive integer"):
        sweep("/no/full", "/no/retain", "/no/data.json", tmp_path / "out", ["/x"], limit=0)
    with pytest.raises(SweepError, match="max_retries"):
        sweep("/no/full", "/no/retain", "/no/data.json", tmp_path / "out", ["/x"], max_retries=-1)


def test_published_comparison_and_scatter(tmp_path):
    table = pd.DataFrame(
        {
            "name": ["a", "b", "c"],
            "method": ["npo", "rmu", "npo"],
            "uds": [0.5, 0.2, None],
            "published_uds": [0.4, None, 0.9],
        }
    )
    compared = add_published_comparison(table)
    assert compared["uds_minus_published"].iloc[0] == pytest.approx(0.1)
    assert math.isnan(compared["uds_minus_published"].iloc[1]) and math.isnan(
        compared["uds_minus_published"].iloc[2]
    )
    fig = published_scatter(compared)
    points = [trace for trace in fig.data if trace.mode == "markers"]
    assert sum(len(trace.x) for trace in points) == 1  # only "a" has both numbers
    assert (points[0].x[0], points[0].y[0]) == (0.4, 0.5)
    assert "2 without both" in fig.layout.title.text
    diagonal = [trace for trace in fig.data if trace.mode == "lines"]
    assert list(diagonal[0].x) == [0, 1] and list(diagonal[0].y) == [0, 1]
    written = write_published_scatter(compared, tmp_path / SCATTER_HTML)
    assert written.read_text(encoding="utf-8").rstrip().endswith("</html>")
    assert [path.name for path in tmp_path.iterdir()] == [SCATTER_HTML]  # no staging sibling left behind


def _sweep_table_only_whole(monkeypatch) -> None:
    """Make writing sweep.csv in place (``to_csv(path)``, which a reader can see half-written) fail."""
    to_csv = pd.DataFrame.to_csv

    def whole_only(frame, path_or_buf=None, *args, **kwargs):
        if path_or_buf is not None and os.path.basename(str(path_or_buf)) == SWEEP_TABLE:
            raise AssertionError(f"{SWEEP_TABLE} written in place, not replaced in one step")
        return to_csv(frame, path_or_buf, *args, **kwargs)

    monkeypatch.setattr(pd.DataFrame, "to_csv", whole_only)


def test_registry_names_are_unique_directory_names():
    assert set(REGISTRIES) == {"tofu-llama-3.2-1b"}
    names = [model.name for model in load_registry("tofu-llama-3.2-1b")]
    assert len(set(names)) == len(names)


def test_without_ray_the_sweep_runs_in_process_with_a_warning(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr("uds_lens.sweep.driver.ray_available", lambda: False)
    _sweep_table_only_whole(monkeypatch)
    with pytest.raises(SweepError, match="needs Ray"):
        sweep(tiny.full, tiny.retain, tiny.data, tmp_path / "out", [tiny.unlearned], address="auto")
    with pytest.warns(UserWarning, match="Ray is not installed"):
        table = sweep(
            tiny.full,
            tiny.retain,
            tiny.data,
            tmp_path / "out",
            {"unl": tiny.unlearned},
            workers=2,
            cache_dir=tmp_path / "s1",
            progress=False,
            compare_published=True,
        )
    assert table.loc[0, "status"] == "scored" and table.loc[0, "worker"].endswith(f":{os.getpid()}")
    # the published comparison rewrites sweep.csv (whole) with its columns
    on_disk = pd.read_csv(tmp_path / "out" / SWEEP_TABLE)
    assert list(on_disk.columns) == list(table.columns) and "uds_minus_published" in on_disk
    assert on_disk.loc[0, "uds"] == pytest.approx(table.loc[0, "uds"], abs=1e-12)
    assert 0.0 < table.loc[0, "uds"] < 1.0
    # retain-free: no UDS (d2 is unnormalised), but the model is scored and saved
    free = sweep(
        tiny.full,
        None,
        tiny.data,
        tmp_path / "free",
        {"unl": tiny.unlearned},
        workers=1,
        cache_dir=tmp_path / "s1",
        progress=False,
    )
    assert (
        free.loc[0, "status"] == "scored"
        and pd.isna(free.loc[0, "uds"])
        and free.loc[0, "fp_retain"] == "None"
    )
    assert (tmp_path / "free" / "unl" / "layers.csv").is_file()

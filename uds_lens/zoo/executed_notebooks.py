"""The notebooks of ``notebooks/`` executed with ``FAST = True``, and the executed copies the documentation shows.

The notebooks are stored without outputs. Their executed copies live in ``docs/tutorials/`` (ignored by git): the
test suite writes one each time it runs a notebook (``tests/integration/test_notebooks.py``), and ``make docs`` runs
this module, which executes only the notebooks whose copy is missing or stale. Beside each copy,
``NAME.inputs.json`` records what it was executed from: the notebook's digest, the package's version and a digest
of its sources, the versions of the libraries that draw and compute (torch, TransformerLens, transformers,
plotly), and the zoo (its size, data and model fingerprints). A copy is current while all of these are the same,
so an unchanged checkout builds its docs without running a notebook.

Each copy is made shareable before it is written: the build machine's paths are removed from its outputs (the
temporary directory a notebook ran in, the home directory written ``~``), and every Plotly figure gets a static
image beside it (`uds_lens.zoo.notebook_html`; needs a local Chrome or Chromium, else the figures stay
interactive only). A notebook whose cell fails raises here, which fails ``make docs``. Execution needs the ``dev``
or ``docs`` extra (nbclient, ipykernel).

    python -m uds_lens.zoo.executed_notebooks [--zoo test|notebook|DIR] [--notebooks notebooks] [--out docs/tutorials]

``--zoo test`` (the default) runs them on the 4-layer test zoo the test suite uses (about 2 minutes to build when
it is not cached yet); ``--zoo notebook`` on the 8-layer zoo the notebooks use on their own (``build_zoo(...,
size="notebook", pools=False)``, about 11 minutes on 2 CPU cores the first time); ``--zoo smollm2`` on the zoo
fine-tuned from the pretrained SmolLM2-135M (``uds-lens zoo build --size smollm2 --no-pools``, docs page "UDS on a
real model"); a directory, on that zoo.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uds_lens.files import bytes_digest, cache_root, json_digest, write_atomic
from uds_lens.zoo.manifest import read_manifest

logger = logging.getLogger(__name__)

# The parameter cell's switch: True runs a few examples and models (minutes on a CPU), False the full notebook.
FAST_LINE = re.compile(r"^FAST\s*=\s*(True|False)\b", flags=re.MULTILINE)
CELL_TIMEOUT_S = 900
# Beside NAME.ipynb: what the copy was executed from.
INPUTS_SUFFIX = ".inputs.json"
# The libraries whose versions change what a notebook computes or draws.
LIBRARIES = ("torch", "transformer-lens", "transformers", "plotly")
# The zoos `--zoo` names, and how each is built when missing.
ZOO_SIZES: dict[str, dict[str, Any]] = {
    "test": {"size": "test", "pools": False},
    "notebook": {"size": "notebook", "pools": False},
    # SmolLM2-135M fine-tuned on the world (30 layers): the notebooks on a real pretrained model
    "smollm2": {"size": "smollm2", "pools": False},
}


def execute(path: Path, workdir: Path, timeout: int = CELL_TIMEOUT_S) -> Any:
    """Execute a notebook top to bottom with ``FAST = True``, in ``workdir``, and return it with its outputs.

    The kernel inherits this process's environment (``UDS_LENS_ZOO``, ``UDS_LENS_CACHE``).

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (its traceback is in the message).
    """
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    notebook.cells[0].source = FAST_LINE.sub("FAST = True", notebook.cells[0].source, count=1)
    client = NotebookClient(
        notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()
    return notebook


def copy_path(source: Path, out_dir: Path) -> Path:
    return Path(out_dir) / Path(source).name


def inputs_path(source: Path, out_dir: Path) -> Path:
    return Path(out_dir) / (Path(source).stem + INPUTS_SUFFIX)


def package_sources_digest() -> str:
    """SHA-256 over the package's files (path and bytes): its Python sources and the data it ships."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    return json_digest({str(p.relative_to(root)): bytes_digest(p.read_bytes()) for p in files})


def zoo_identity(zoo_dir: str | os.PathLike | None) -> dict[str, Any] | None:
    """What a zoo's outputs depend on: its size, its data's fingerprint and each model's (not its build times)."""
    manifest = read_manifest(zoo_dir) if zoo_dir is not None else None
    if manifest is None:
        return None
    return {
        "size": manifest.get("size"),
        "data": manifest.get("data", {}).get("fingerprint"),
        "models": {m["name"]: m.get("fingerprint") for m in manifest.get("models", [])},
    }


def inputs(source: Path, zoo_dir: str | os.PathLike | None) -> dict[str, Any]:
    """Everything an executed copy of ``source`` depends on (`INPUTS_SUFFIX` records it)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "notebook": Path(source).name,
        "notebook_sha256": bytes_digest(Path(source).read_bytes()),
        "uds_lens": installed("uds_lens"),
        "uds_lens_sources_sha256": package_sources_digest(),
        "libraries": {name: installed(name) for name in LIBRARIES},
        "zoo": zoo_identity(zoo_dir),
    }


def shareable(
    notebook: Any, workdir: str | os.PathLike | None = None, zoo_dir: str | os.PathLike | None = None
) -> Any:
    """``notebook`` with the build machine's paths taken out of its outputs (in place): the directory it ran in
    (its files are then named relative to it), the zoo's directory when it is not under the home directory
    (written ``$UDS_LENS_ZOO``), any other temporary directory a cell made (written ``<temporary directory>``)
    and the home directory (written ``~``)."""
    import nbformat

    temporary = re.compile(
        "(?:" + "|".join(sorted({re.escape(tempfile.gettempdir().rstrip("/")), "/tmp"})) + r")/[^/\s\"'<>]+/"
    )

    home = str(Path.home()).rstrip("/")
    replacements = []
    for directory, name in ((workdir, ""), (zoo_dir, "$UDS_LENS_ZOO/")):
        if directory is None:
            continue
        for form in {str(Path(directory)), str(Path(directory).resolve())}:
            if name and home and form.startswith(home + "/"):
                continue
            replacements.append((form.rstrip("/") + "/", name))
    if home:
        replacements.append((home + "/", "~/"))
    for cell in notebook.cells:
        if cell.cell_type != "code" or not cell.get("outputs"):
            continue
        text = json.dumps(cell.outputs)
        for old, new in replacements:
            text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
        text = temporary.sub("<temporary directory>/", text)
        cell.outputs = [nbformat.from_dict(output) for output in json.loads(text)]
    return notebook


def write_copy(
    notebook: Any,
    source: Path,
    out_dir: Path,
    zoo_dir: str | os.PathLike | None = None,
    workdir: str | os.PathLike | None = None,
) -> Path:
    """Write an executed notebook as ``out_dir/NAME.ipynb``, made `shareable`, with static figures where a browser
    draws them, and beside it ``NAME.inputs.json`` (`inputs`; ``zoo_dir`` defaults to ``$UDS_LENS_ZOO``). Each
    file is replaced atomically, the record last: a copy is never taken as current before it is whole."""
    import nbformat

    from uds_lens.zoo.notebook_html import add_static_figures, without_embedded_plotlyjs

    if zoo_dir is None:
        zoo_dir = os.environ.get("UDS_LENS_ZOO")
    shareable(notebook, workdir, zoo_dir)
    without_embedded_plotlyjs(notebook)  # the site ships plotly.js; each figure keeps a static image besides
    add_static_figures(notebook)
    target = copy_path(source, out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, nbformat.writes(notebook))
    write_atomic(inputs_path(source, out_dir), json.dumps(inputs(source, zoo_dir), indent=1, sort_keys=True))
    return target


def is_current(source: Path, out_dir: Path, zoo_dir: str | os.PathLike | None = None) -> bool:
    """Whether ``out_dir`` holds a copy of ``source`` executed from the same inputs (`inputs`) on this zoo."""
    target, record = copy_path(source, out_dir), inputs_path(source, out_dir)
    if not target.is_file() or not record.is_file():
        return False
    try:
        recorded = json.loads(record.read_text())
    except (OSError, ValueError):  # a damaged record: execute again
        return False
    return bool(recorded == inputs(source, zoo_dir))


def add_missing_figures(source: Path, out_dir: Path) -> bool:
    """Give a current copy the static figures it was written without (no browser then); True if it changed."""
    import nbformat

    from uds_lens.zoo.notebook_html import add_static_figures, has_static_figures

    target = copy_path(source, out_dir)
    try:
        notebook = nbformat.read(target, as_version=4)
    except Exception:  # a damaged copy: left to is_current's next verdict
        return False
    if has_static_figures(notebook) or not add_static_figures(notebook):
        return False
    record = inputs_path(source, out_dir).read_text()
    write_atomic(target, nbformat.writes(notebook))
    write_atomic(inputs_path(source, out_dir), record)
    return True


def zoo_directory(zoo: str) -> Path:
    """``test`` / ``notebook``: that cached zoo (``<cache root>/zoo-<name>``); anything else: a directory."""
    return cache_root() / f"zoo-{zoo}" if zoo in ZOO_SIZES else Path(zoo).expanduser()


def ensure_zoo(zoo: str) -> Path:
    """The zoo `--zoo` names, built first when it is missing (``test`` and ``notebook`` only; without the
    meta-evaluation pools, which no notebook reads). A zoo that exists is used as it is."""
    directory = zoo_directory(zoo)
    if read_manifest(directory) is not None:
        return directory
    if zoo not in ZOO_SIZES:
        raise SystemExit(
            f"{directory} holds no built zoo (no manifest.json): build one with `uds-lens zoo build`"
        )
    from uds_lens.zoo.build import build_zoo

    logger.warning("building the %s zoo in %s for the notebooks", zoo, directory)
    build_zoo(directory, progress=False, **ZOO_SIZES[zoo])
    return directory


def ensure_executed(notebooks: Sequence[Path], out_dir: Path, zoo: str | os.PathLike = "test") -> list[Path]:
    """Execute every notebook whose copy in ``out_dir`` is missing or stale on this zoo; returns those it
    executed. ``zoo`` is ``test``, ``notebook`` or a zoo directory (`zoo_directory`)."""
    zoo = str(zoo)
    zoo_dir = zoo_directory(zoo)
    stale = []
    for source in notebooks:
        if is_current(source, out_dir, zoo_dir):
            if add_missing_figures(source, out_dir):
                logger.warning("%s: static figures added to the executed copy", source.name)
            logger.info("%s: executed copy is current", source.name)
        else:
            stale.append(source)
    if not stale:
        return []
    zoo_dir = ensure_zoo(zoo)
    for source in stale:
        logger.warning("%s: executing (FAST = True, zoo %s) for the docs", source.name, zoo)
        with tempfile.TemporaryDirectory(prefix="uds_lens_nb_") as workdir:
            saved = {name: os.environ.get(name) for name in ("UDS_LENS_CACHE", "UDS_LENS_ZOO")}
            os.environ["UDS_LENS_CACHE"] = str(Path(workdir) / "s1_cache")  # nothing left in the user's cache
            os.environ["UDS_LENS_ZOO"] = str(zoo_dir)
            try:
                notebook = execute(source, Path(workdir))
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            write_copy(notebook, source, out_dir, zoo_dir=zoo_dir, workdir=workdir)
    return stale


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", type=Path, default=Path("notebooks"))
    parser.add_argument("--out", type=Path, default=Path("docs/tutorials"))
    parser.add_argument("--zoo", default="test", help="test (default), notebook, smollm2, or a zoo directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # silent when every copy is current
    sources = sorted(args.notebooks.glob("*.ipynb"))
    if not sources:
        raise SystemExit(f"no notebooks in {args.notebooks}")
    executed = ensure_executed(sources, args.out, args.zoo)
    if executed:
        logger.warning("%d notebook(s) executed, %d current", len(executed), len(sources) - len(executed))


if __name__ == "__main__":  # pragma: no cover
    main()

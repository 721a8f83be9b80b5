"""The notebooks of ``notebooks/`` executed with ``FAST = True``, and the executed copies the documentation shows.

The test suite executes every notebook (``tests/integration/test_notebooks.py``) and keeps each executed copy in
``docs/tutorials/`` (ignored by git) with the digest of the notebook it came from; ``make docs`` runs this module,
which executes only the notebooks whose copy is missing or was made from another version of the notebook, so the
documentation build does not run them a second time. A notebook whose cell fails raises here, which fails
``make docs``. Execution needs the ``dev`` or ``docs`` extra (nbclient, ipykernel).

    python -m uds_lens.zoo.executed_notebooks [--notebooks notebooks] [--out docs/tutorials]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uds_lens.files import bytes_digest

logger = logging.getLogger(__name__)

# The parameter cell's switch: True runs a few examples and models (minutes on a CPU), False the full notebook.
FAST_LINE = re.compile(r"^FAST\s*=\s*(True|False)\b", flags=re.MULTILINE)
CELL_TIMEOUT_S = 900
# Where an executed copy records the notebook it was executed from.
METADATA_KEY = "uds_lens"


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


def write_copy(notebook: Any, source: Path, out_dir: Path) -> Path:
    """Write an executed notebook as ``out_dir/NAME.ipynb``, stamped with its source's digest (atomically: a
    concurrent reader sees the old copy or the new one)."""
    import nbformat

    notebook.metadata[METADATA_KEY] = {
        "source": Path(source).name,
        "source_sha256": bytes_digest(Path(source).read_bytes()),
    }
    target = copy_path(source, out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as handle:
        nbformat.write(notebook, handle)
    os.replace(handle.name, target)
    return target


def is_current(source: Path, out_dir: Path) -> bool:
    """Whether ``out_dir`` holds an executed copy of this version of ``source``."""
    import nbformat

    target = copy_path(source, out_dir)
    if not target.is_file():
        return False
    try:
        stamp = nbformat.read(target, as_version=4).metadata.get(METADATA_KEY, {})
    except Exception:  # a truncated or foreign file: execute again
        return False
    return bool(stamp.get("source_sha256") == bytes_digest(Path(source).read_bytes()))


def ensure_executed(notebooks: Sequence[Path], out_dir: Path) -> list[Path]:
    """Execute every notebook whose copy in ``out_dir`` is missing or stale; returns those it executed."""
    executed = []
    for source in notebooks:
        if is_current(source, out_dir):
            logger.info("%s: executed copy is current", source.name)
            continue
        logger.warning("%s: executing (FAST = True) for the docs", source.name)
        with tempfile.TemporaryDirectory(prefix="uds_lens_nb_") as workdir:
            previous = os.environ.get("UDS_LENS_CACHE")
            os.environ["UDS_LENS_CACHE"] = str(Path(workdir) / "s1_cache")  # nothing left in the user's cache
            try:
                notebook = execute(source, Path(workdir))
            finally:
                if previous is None:
                    os.environ.pop("UDS_LENS_CACHE", None)
                else:
                    os.environ["UDS_LENS_CACHE"] = previous
        write_copy(notebook, source, out_dir)
        executed.append(source)
    return executed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", type=Path, default=Path("notebooks"))
    parser.add_argument("--out", type=Path, default=Path("docs/tutorials"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # silent when every copy is current
    sources = sorted(args.notebooks.glob("*.ipynb"))
    if not sources:
        raise SystemExit(f"no notebooks in {args.notebooks}")
    executed = ensure_executed(sources, args.out)
    if executed:
        logger.warning("%d notebook(s) executed, %d current", len(executed), len(sources) - len(executed))


if __name__ == "__main__":  # pragma: no cover
    main()

"""The docs build's own tools (`docs/*.py`, next to the pages they build; not part of the package), imported by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DOCS = Path(__file__).resolve().parents[2] / "docs"


def docs_tool(name: str) -> ModuleType:
    """The module ``docs/NAME.py``, loaded once per test session (as ``uds_docs_NAME``)."""
    key = f"uds_docs_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, DOCS / f"{name}.py")
        assert spec is not None and spec.loader is not None, f"docs/{name}.py is missing"
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]

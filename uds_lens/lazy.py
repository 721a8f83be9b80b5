"""Lazy re-exports for the package's ``__init__`` files (PEP 562).

``import uds_lens`` must stay instant and quiet: torch, TransformerLens and bitsandbytes take seconds to import and
some print warnings, and ``uds-lens --help`` or ``uds-lens report`` need none of them. So an ``__init__`` does not
import its public names; it lists them with the module that defines each, and `lazy_exports` gives it the
module-level ``__getattr__`` and ``__dir__`` that import a name's module on its first use. The value is then stored
in the package's namespace, so every later look-up is a plain attribute read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, names: Mapping[str, str], modules: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        names: public name -> the module that defines it (absolute, or relative to ``package`` with a leading
            ``.``).
        modules: public name -> a module that the name stands for (an old module name kept as an alias).
    """
    aliases = dict(modules or {})

    def __getattr__(name: str) -> Any:
        if name in aliases:
            value = importlib.import_module(aliases[name], package)
        elif name in names:
            value = getattr(importlib.import_module(names[name], package), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # later look-ups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names, *aliases})

    return __getattr__, __dir__

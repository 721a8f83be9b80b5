"""The layout's rules, read from the code's syntax (``experiments/house_counts.py``, which prints the same counts):
every name has one home, and the import graph has no circle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _house_counts():
    spec = importlib.util.spec_from_file_location("house_counts", ROOT / "experiments" / "house_counts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_hands_on_a_name_it_does_not_define():
    """A plain module's ``__all__`` lists only its own names, and no module of the package, the tests or the
    experiments imports a name from a module that does not define it (package ``__init__``s are the public API;
    ``tl_compat`` is the one door to TransformerLens)."""
    counts = _house_counts()
    modules = counts.read_tree()
    assert "uds_lens.memory" in modules and "uds_lens.layer_table" in modules  # the tree was read
    handed_on = {
        module.name: sorted(
            n for n in module.all if n not in module.defined and f"{module.name}.{n}" not in modules
        )
        for module in modules.values()
        if not module.is_package and module.name != counts.TL_DOOR
    }
    assert {name: names for name, names in handed_on.items() if names} == {}
    through = []
    for folder in ("uds_lens", "tests", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = modules.get(counts.module_name(path)) if folder == "uds_lens" else counts.Module(path)
            for source, name, _ in module.imports:
                if name and name != "*" and source in modules and source != counts.TL_DOOR:
                    if not counts.defines(modules, source, name):
                        through.append(f"{path.relative_to(ROOT)}: {name} from {source}")
            through += [
                f"{path.relative_to(ROOT)}: {s}.{n}" for s, n in counts.attribute_reads(modules, module)
            ]
    assert through == []


def test_the_import_graph_has_no_circle():
    """Imports inside functions count (they run when a user calls the function); ``TYPE_CHECKING`` ones do not."""
    counts = _house_counts()
    modules = counts.read_tree()
    assert counts.circles(modules) == []
    # the check sees a circle where there is one: results -> example_view, and a made-up example_view -> results
    modules["uds_lens.example_view"].imports.append(("uds_lens.results", "UDSResult", False))
    assert counts.circles(modules) == [["uds_lens.example_view", "uds_lens.results"]]

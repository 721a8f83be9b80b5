"""Counts that say how the package is laid out, read from the code's syntax (nothing is imported or run).

- re-exports: names a module imports and hands on (in its ``__all__``, or imported from it by another module) without
  defining them; package ``__init__`` files are the public API and are listed apart.
- imports through a re-export: (importing file, name) pairs that take a name from a module that does not define it.
- circles: strongly connected groups of the module import graph (imports inside functions count; imports under
  ``if TYPE_CHECKING:`` do not).
- private imports: ``from a import _name`` across modules.
- ``Any``: parameters named like a model (``model``, ``full``, ``source``, ``unlearned``, ``retain``, ``target``) and
  function returns annotated ``Any``, per module.

Usage::

    python experiments/house_counts.py [--detail]
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "uds_lens"
TL_DOOR = "uds_lens.tl_compat"
MODEL_NAMES = {"model", "full", "source", "unlearned", "retain", "target", "bridge", "hooked"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class Module:
    def __init__(self, path: Path):
        self.path = path
        self.name = module_name(path)
        self.is_package = path.name == "__init__.py"
        self.tree = ast.parse(path.read_text())
        self.defined: set[str] = set()
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        self.imports: list[tuple[str, str | None, bool]] = []  # (module, name or None, type_checking_only)
        self.all: set[str] = set()
        self._read()

    def _read(self) -> None:
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            self.defined.add(name.id)
                            if name.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                                self.all = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        type_checking = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for inner in node.body:
                    type_checking.update(id(n) for n in ast.walk(inner))
        for node in ast.walk(self.tree):
            only_types = id(node) in type_checking
            if isinstance(node, ast.ImportFrom):
                source = resolve_from(self.name, self.is_package, node)
                for alias in node.names:
                    self.imports.append((source, alias.name, only_types))
                    if node in self.tree.body or only_types:
                        self.imported[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports.append((alias.name, None, only_types))
        # a lazy ``__getattr__`` table: {"name": "module"} literals in the module body
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                keys = node.value.keys
                if keys and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys):
                    values = node.value.values
                    if all(isinstance(v, ast.Constant) and str(v.value).startswith(PACKAGE) for v in values):
                        for k, v in zip(keys, values, strict=True):
                            self.imported[str(k.value)] = (str(v.value), str(k.value))  # type: ignore[union-attr]

    def any_counts(self) -> tuple[int, int]:
        params = returns = 0
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for arg in args:
                    if arg.arg in MODEL_NAMES and arg.annotation is not None:
                        if top_level_any(arg.annotation):
                            params += 1
                if node.returns is not None and ast.unparse(node.returns) in ("Any", "'Any'"):
                    returns += 1
        return params, returns


def top_level_any(annotation: ast.expr) -> bool:
    """``Any``, or a union with ``Any`` as one of its members (``Any`` inside ``Sequence[dict[str, Any]]`` is a
    record's values, not the parameter)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return top_level_any(annotation.left) or top_level_any(annotation.right)
    return isinstance(annotation, ast.Name) and annotation.id == "Any"


def read_tree() -> dict[str, Module]:
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    return {m.name: m for m in (Module(path) for path in files)}


def defines(modules: dict[str, Module], module: str, name: str) -> bool:
    found = modules.get(module)
    if found is None:
        return True  # outside the package
    if name in found.defined:
        return True
    return f"{module}.{name}" in modules  # a submodule


def attribute_reads(modules: dict[str, Module], module: Module) -> list[tuple[str, str]]:
    """``mod.name`` reads where ``mod`` is one of our modules (not a package) that imports ``name`` from another of
    our modules instead of defining it: a re-export used by attribute."""
    bound: dict[str, str] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    bound[alias.asname] = alias.name
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            target = modules[bound[node.value.id]]
            if target.is_package or node.attr in target.defined or f"{target.name}.{node.attr}" in modules:
                continue
            origin = target.imported.get(node.attr)
            if origin is not None and origin[0].startswith(PACKAGE) and origin[0] != TL_DOOR:
                found.append((target.name, node.attr))
    return found


def circles(modules: dict[str, Module]) -> list[list[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in modules.values():
        for source, name, only_types in module.imports:
            if only_types or not source.startswith(PACKAGE):
                continue
            target = f"{source}.{name}" if name and f"{source}.{name}" in modules else source
            if target in modules and target != module.name:
                graph[module.name].add(target)
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(modules):
        if node not in index:
            visit(node)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--detail", action="store_true", help="list every name behind each count")
    args = parser.parse_args()
    modules = read_tree()

    through: list[tuple[str, str, str]] = []  # (importing file, module imported from, name)
    private: list[tuple[str, str, str]] = []
    scanned = [*modules.values()]
    for folder in ("tests", "experiments"):
        scanned += [Module(path) for path in sorted((ROOT / folder).rglob("*.py"))]
    for module in scanned:
        for source, name, _ in module.imports:
            if not name or name == "*" or not source.startswith(PACKAGE) or source not in modules:
                continue
            if not defines(modules, source, name):
                through.append((str(module.path.relative_to(ROOT)), source, name))
            if name.startswith("_") and source != module.name:
                private.append((str(module.path.relative_to(ROOT)), source, name))

    by_attribute = [
        (str(module.path.relative_to(ROOT)), source, name)
        for module in scanned
        for source, name in attribute_reads(modules, module)
    ]
    reexports: Counter[str] = Counter()
    reexport_names: dict[str, set[str]] = defaultdict(set)
    for _file, source, name in through + by_attribute:
        reexport_names[source].add(name)
    for module in modules.values():
        for name in module.all:
            if name not in module.defined and f"{module.name}.{name}" not in modules:
                reexport_names[module.name].add(name)
    for source, names in reexport_names.items():
        reexports[source] = len(names)

    plain = {m: n for m, n in reexports.items() if not modules[m].is_package and m != TL_DOOR}
    packages = {m: n for m, n in reexports.items() if modules[m].is_package}
    print(f"re-exported names, modules: {sum(plain.values())} in {len(plain)} modules")
    for name, count in sorted(plain.items(), key=lambda item: -item[1]):
        print(
            f"  {name}: {count}" + (f"  ({', '.join(sorted(reexport_names[name]))})" if args.detail else "")
        )
    door = sorted(reexport_names.get(TL_DOOR, ()))
    print(
        f"TransformerLens names handed on by {TL_DOOR} (the one module that imports TransformerLens): {len(door)}"
    )
    print(f"re-exported names, package __init__s (public API): {sum(packages.values())} in {len(packages)}")
    for label, keep in (("a module", False), ("a package __init__", True)):
        pairs = [row for row in through if modules[row[1]].is_package == keep and row[1] != TL_DOOR]
        where = Counter(file.split("/")[0] for file, _, _ in pairs)
        counts = ", ".join(f"{folder}/ {count}" for folder, count in sorted(where.items()))
        print(
            f"(file, name) pairs imported through {label} that does not define the name: {len(pairs)} ({counts})"
        )
        if args.detail:
            for file, source, name in pairs:
                print(f"    {file}: {name} from {source}")
    print(
        f"attribute reads (module.name) through a module that does not define the name: {len(by_attribute)}"
    )
    if args.detail:
        for file, source, name in by_attribute:
            print(f"    {file}: {source}.{name}")
    found = circles(modules)
    print(f"import circles (function-level imports count, TYPE_CHECKING ones do not): {len(found)}")
    for group in found:
        print("  " + " <-> ".join(group))
    print(f"private names imported across modules: {len(private)}")
    for file, source, name in private:
        print(f"  {file}: {name} from {source}")
    totals = [0, 0]
    rows = []
    for module in modules.values():
        params, returns = module.any_counts()
        if params or returns:
            rows.append((module.name, params, returns))
            totals[0] += params
            totals[1] += returns
    print(f"model-named parameters typed Any: {totals[0]}; returns typed Any: {totals[1]}")
    for name, params, returns in sorted(rows, key=lambda row: -(row[1] + row[2])):
        print(f"  {name}: {params} parameters, {returns} returns")


if __name__ == "__main__":
    main()

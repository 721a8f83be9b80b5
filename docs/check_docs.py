"""The docs check (`make docs` runs it after the build) and the docstring conversion it asks for.

    python docs/check_docs.py [--site site]      # fail on what the site must not show (below)
    python docs/check_docs.py --convert          # rewrite the package's docstrings in the style the site renders

The check fails, naming file and line, on:

- a Sphinx role (``:func:`x` ``, ``:class:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ...) in a ``.py`` file of
  the package, or left as literal text in a built page: the site is MkDocs, where a role is dead text;
- a cross-reference the build left unresolved (``[name][uds_lens.a.b]`` shown as text: ``mkdocs build --strict``
  catches the ones it sees as links, not one inside a role, a code span or a page written by a hook);
- an ``Example:`` docstring section holding ``>>>`` lines (it renders as nested quotes; ``Examples:`` as code);
- a built page naming this machine's home directory or a temporary directory, citing the project's internal
  ``SPEC`` (readers have neither), or loading a script or stylesheet from the network (the site reads offline);
- in the Markdown the site and the repository render (``README.md``, ``docs/**/*.md``, the notebooks' text cells): a
  line of prose that starts with a list marker (``1.``, ``2)``, ``-``, ``*``, ``+``) where a sentence wrapped, which
  Markdown renders as a list item cutting the sentence; and a formula block (a ``text`` or ``math`` fence) with a
  line wider than the docs column (`CODE_WIDTH` characters), which the page shows with a scroll bar.

``--convert`` rewrites every role into an mkdocstrings cross-reference when the site renders its target
(``:class:`~uds_lens.results.UDSResult` `` -> ``[`UDSResult`][uds_lens.results.UDSResult]``), else into plain
backticks; re-points a cross-reference whose target moved (a module renamed) to the one rendered object of the same
module and name; renames ``Example:`` sections of ``>>>`` lines to ``Examples:``; and drops the docstrings'
citations of ``SPEC`` and ``PUBLISHED_IMPL`` in the forms `SPEC_FORMS` knows. What the site renders is read
from its ``objects.inv`` (``--inventory``; by default a fresh build into a temporary directory). Running it again
changes nothing.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "uds_lens"

# Any Sphinx role: `:func:`, `:py:class:`, `:meth:` ... followed by a backticked target.
ROLE = re.compile(
    r":(?:py:)?(?P<kind>func|class|meth|mod|attr|data|obj|exc|const|ref|doc):`(?P<target>[^`]+)`"
)
# The same role as the site shows it: Markdown turned the backticks into a code span.
ROLE_IN_HTML = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const|ref|doc):(?:<code>|`)")
# An mkdocstrings cross-reference in a docstring: [text][identifier].
CROSS_REF = re.compile(r"\[(?P<text>[^\]\n]+)\]\[(?P<target>uds_lens(?:\.\w+)+)\]")
# What autorefs leaves when it could not resolve a reference: the brackets as text, or its placeholder tag.
DEAD_REF_IN_HTML = re.compile(r"\]\[uds_lens(?:\.\w+)+\]|<autoref\b")
CODE_SPAN = re.compile(r"<code\b.*?</code>", re.DOTALL)
# A Google-style "Example:" section whose body is doctest lines: griffe renders it as an admonition of quotes.
EXAMPLE_SECTION = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*\n(?=(?P=indent)[ \t]+>>>)", re.MULTILINE)
# A script or stylesheet a page would fetch from the network (the site must read offline).
REMOTE_RESOURCE = re.compile(
    r"<script\b[^>]*\bsrc=[\"']https?://[^\"']*|<link\b[^>]*\bhref=[\"']https?://[^\"']*\.css[^\"']*",
    re.IGNORECASE,
)
# The project's internal specification, which readers do not have.
SPEC_CITATION = re.compile(r"\b(?:SPEC|PUBLISHED_IMPL)\b")
# Its citations (and the published implementation's notes, PUBLISHED_IMPL) in the forms docstrings use, each with
# what replaces it: "(SPEC 1.6c)" goes, "(SPEC 2: text)" and "(SPEC 1.6c, text)" keep their text, so does
# "(text, SPEC 1.6c)".
SECTION = r"(?: ?§?\d+(?:\.\d+)*[a-z]?(?: step \d+)?(?:, ?§\d+(?:\.\d+)*[a-z]?)*)?"
CITED = rf"(?:SPEC|PUBLISHED_IMPL){SECTION}"
SPEC_FORMS = (
    (re.compile(rf"^(\s*)\({CITED}\) "), r"\1"),
    (re.compile(rf" ?\({CITED}\)"), ""),
    (re.compile(rf"\({CITED}[:,;] *"), "("),
    (re.compile(rf"[,;] *(?:see )?{CITED}(?=[);])"), ""),
)


# A line Markdown may read as the start of a list item: an ordered marker ("1.", "12)") or a bullet ("-", "*", "+").
LIST_ITEM = re.compile(r"^(?P<indent> *)(?:\d{1,9}[.)]|[-*+])(?: +\S|$)")
FENCE = re.compile(r"^ *(?P<fence>```+|~~~+) *(?P<language>[\w-]*)")
FORMULA_LANGUAGES = ("text", "math")
CODE_WIDTH = 80
"""Characters of a code block's line the docs column shows without a scroll bar: the column is 688 px wide at a
1280 px window (the widest it gets: Material's grid stops at 61rem), a code block pads it by 16 px on each side, and
its monospace font is 8.2 px a character (13.6 px), measured in Chromium."""


@dataclass(frozen=True)
class Problem:
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}"


def package_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / PACKAGE).rglob("*.py"))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# -- the check -------------------------------------------------------------------------------------------------------


def source_problems(files: Iterable[Path], root: Path = ROOT) -> list[Problem]:
    """Sphinx roles and ``Example:`` sections of doctest lines in the package's source files."""
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        for match in ROLE.finditer(text):
            problems.append(
                Problem(
                    where, line_of(text, match.start()), f"Sphinx role {match.group(0)!r} (run --convert)"
                )
            )
        for match in EXAMPLE_SECTION.finditer(text):
            problems.append(
                Problem(
                    where,
                    line_of(text, match.start()),
                    "'Example:' section of >>> lines renders as quotes: name it 'Examples:' (run --convert)",
                )
            )
    return problems


def markdown_files(root: Path = ROOT) -> list[Path]:
    """The Markdown the site and the repository render: ``README.md``, ``docs/**/*.md`` and the notebooks."""
    docs = [
        p for p in sorted((root / "docs").rglob("*.md")) if "tutorials" not in p.relative_to(root).parts[1:2]
    ]
    readme = [root / "README.md"] if (root / "README.md").is_file() else []
    return readme + docs + sorted((root / "notebooks").glob("*.ipynb"))


def markdown_texts(path: Path) -> list[tuple[int, str]]:
    """``(first line, text)`` of each Markdown text in ``path``: the whole file, or each text cell of a notebook
    (numbered by cell, from 1)."""
    if path.suffix != ".ipynb":
        return [(1, path.read_text(encoding="utf-8"))]
    import json

    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    return [
        (number, "".join(cell.get("source", "")))
        for number, cell in enumerate(cells, 1)
        if cell.get("cell_type") == "markdown"
    ]


def stray_list_items(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each line that starts with a list marker in the middle of a paragraph: the line before
    it is text (not blank, not a table row, heading, quote or HTML, not ending with a colon) and no list item at its
    indentation came before it in the same paragraph (a sibling item). That is a sentence wrapped at a number or a
    dash (``- **damage**: ... the clip cuts it to\n  1. Patching ...``), which Markdown renders as a new, nested list
    item cutting the sentence. A list nested under an item that ends with a colon is a list; fenced code is
    skipped."""
    found = []
    fence: str | None = None
    item_indents: set[int] = set()
    previous = ""
    for number, line in enumerate(text.split("\n"), 1):
        opening = FENCE.match(line)
        if fence is not None:
            if opening and opening.group("fence").startswith(fence):
                fence = None
            previous = ""
            continue
        if opening:
            fence = opening.group("fence")[:3]
            previous, item_indents = "", set()
            continue
        if not line.strip():
            previous, item_indents = "", set()
            continue
        item = LIST_ITEM.match(line)
        if item:
            indent = len(item.group("indent"))
            prose_before = (
                previous.strip()
                and not previous.lstrip().startswith(("|", "<", "#", ">"))
                and not previous.rstrip().endswith(":")
            )
            if prose_before and indent not in item_indents:
                found.append((number, line.strip()))
            item_indents.add(indent)
        previous = line
    return found


def wide_formulas(text: str, width: int = CODE_WIDTH) -> list[tuple[int, int]]:
    """``(line, characters)`` of each line of a formula block (a fence of `FORMULA_LANGUAGES`) wider than
    ``width``."""
    found = []
    fence: str | None = None
    formula = False
    for number, line in enumerate(text.split("\n"), 1):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence, formula = opening.group("fence")[:3], opening.group("language") in FORMULA_LANGUAGES
            continue
        if fence is not None and opening and opening.group("fence").startswith(fence):
            fence = None
            continue
        if fence is not None and formula and len(line.rstrip()) > width:
            found.append((number, len(line.rstrip())))
    return found


def markdown_problems(files: Iterable[Path], root: Path = ROOT) -> list[Problem]:
    """Stray list items and wide formula blocks (`stray_list_items`, `wide_formulas`) in Markdown files and the
    text cells of notebooks (a notebook's "line" is its cell number, then the line in it)."""
    problems = []
    for path in files:
        where = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        for first, text in markdown_texts(path):
            cell = "" if path.suffix != ".ipynb" else f"cell {first}, "
            offset = first - 1 if path.suffix != ".ipynb" else 0
            for line, item in stray_list_items(text):
                problems.append(
                    Problem(
                        where,
                        offset + line,
                        f"{cell}a wrapped sentence renders as a list item here: {item[:60]!r} (rewrap the line)",
                    )
                )
            for line, characters in wide_formulas(text):
                problems.append(
                    Problem(
                        where,
                        offset + line,
                        f"{cell}formula line of {characters} characters overflows the docs column "
                        f"({CODE_WIDTH}): break it",
                    )
                )
    return problems


def machine_paths() -> list[str]:
    """Prefixes that only name the build machine: its home directory and its temporary directory."""
    prefixes = []
    home = str(Path.home())
    if home not in ("", "/"):
        prefixes.append(home.rstrip("/") + "/")
    prefixes += sorted({str(Path(tempfile.gettempdir())).rstrip("/") + "/", "/tmp/"})
    return prefixes


def site_problems(site: Path) -> list[Problem]:
    """Literal roles, unresolved cross-references, machine paths and SPEC citations in the built pages."""
    problems = []
    prefixes = machine_paths()
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8", errors="replace")
        where = str(page.relative_to(site))
        # code spans show references as text on purpose (a page that explains the syntax): blanked, lines kept
        prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        for pattern, what, searched in (
            (ROLE_IN_HTML, "literal Sphinx role", text),
            (DEAD_REF_IN_HTML, "unresolved cross-reference", prose),
            (SPEC_CITATION, "cites SPEC, which readers do not have", text),
            (REMOTE_RESOURCE, "fetches from the network", text),
        ):
            for match in pattern.finditer(searched):
                context = text[max(0, match.start() - 40) : match.end() + 40].replace("\n", " ")
                problems.append(Problem(where, line_of(text, match.start()), f"{what}: ...{context}..."))
        for prefix in prefixes:
            for match in re.finditer(re.escape(prefix), text):
                context = text[match.start() : match.end() + 60].split('"')[0].split("<")[0]
                problems.append(
                    Problem(where, line_of(text, match.start()), f"a path of the build machine: {context}")
                )
    return problems


# -- the conversion --------------------------------------------------------------------------------------------------


def read_inventory(path: Path) -> set[str]:
    """The identifiers an ``objects.inv`` lists: the objects the site renders, and their aliases."""
    from mkdocstrings import Inventory

    with open(path, "rb") as handle:
        return set(Inventory.parse_sphinx(handle))


def built_inventory(root: Path = ROOT) -> set[str]:
    """Build the site into a temporary directory (not strict: a missing tutorial is no matter here) and read its
    inventory."""
    with tempfile.TemporaryDirectory(prefix="uds_lens_inventory_") as out:
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--no-strict", "--quiet", "--site-dir", out],
            cwd=root,
            env=env,
            check=False,
        )
        inventory = Path(out) / "objects.inv"
        if not inventory.is_file():
            raise SystemExit(f"mkdocs build wrote no {inventory.name}: run it yourself and pass --inventory")
        return read_inventory(inventory)


@dataclass
class Scope:
    """What a name in one docstring can mean: the module, the classes around the docstring, the module's imports."""

    module: str
    classes: tuple[str, ...]
    imports: dict[str, str]

    def candidates(self, target: str) -> Iterator[str]:
        head, _, rest = target.partition(".")
        tail = f".{rest}" if rest else ""
        if target.startswith(f"{PACKAGE}."):
            yield target
        for depth in range(len(self.classes), 0, -1):
            yield ".".join((self.module, *self.classes[:depth], target))
        if head in self.imports:
            yield self.imports[head] + tail
        yield f"{self.module}.{target}"
        parts = self.module.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            yield ".".join((*parts[:depth], target))


def module_imports(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """``{local name: full dotted name}`` of every import in a module, wherever it stands (functions included)."""
    package = module if is_package else module.rpartition(".")[0]
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(filter(None, (*anchor, base)))
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def docstring_scopes(tree: ast.Module) -> list[tuple[int, int, tuple[str, ...]]]:
    """``(first line, last line, enclosing classes)`` of every string statement: docstrings of modules, classes,
    functions and attributes (what griffe reads as docstrings)."""
    spans = []

    def visit(node: ast.AST, classes: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.Expr)
                and isinstance(child.value, ast.Constant)
                and isinstance(child.value.value, str)
            ):
                spans.append((child.lineno, child.end_lineno or child.lineno, classes))
            inner = (*classes, child.name) if isinstance(child, ast.ClassDef) else classes
            visit(child, inner)

    visit(tree, ())
    return spans


def resolve(target: str, scope: Scope, inventory: set[str]) -> str | None:
    """The identifier a role's target names on the site, or None when the site renders no such object."""
    for candidate in scope.candidates(target):
        if candidate in inventory:
            return candidate
    return None


def moved(target: str, inventory: set[str]) -> str | None:
    """The one rendered identifier that ends with ``target``'s module and name (a module moved), else its name alone."""
    parts = target.split(".")
    for keep in (2, 1):
        if len(parts) <= keep:
            continue
        suffix = "." + ".".join(parts[-keep:])
        found = [name for name in inventory if name.endswith(suffix)]
        if len(found) == 1:
            return found[0]
    return None


def convert_text(text: str, module: str, is_package: bool, inventory: set[str]) -> str:
    """One file's text with its roles converted, its stale cross-references re-pointed, and its ``Example:``
    sections of doctest lines renamed ``Examples:``."""
    tree = ast.parse(text)
    imports = module_imports(tree, module, is_package)
    spans = docstring_scopes(tree)

    def scope_at(offset: int) -> Scope | None:
        line = line_of(text, offset)
        inside = [span for span in spans if span[0] <= line <= span[1]]
        if not inside:
            return None
        return Scope(module, inside[-1][2], imports)

    def role(match: re.Match[str]) -> str:
        target = match.group("target").strip()
        short = target.startswith("~")
        target = target.lstrip("~.")
        shown = target.rsplit(".", 1)[-1] if short else target
        scope = scope_at(match.start())
        identifier = resolve(target, scope, inventory) if scope is not None else None
        return f"[`{shown}`][{identifier}]" if identifier else f"`{shown}`"

    def uncite(line: str) -> str:
        before = None
        while before != line:  # "(PUBLISHED_IMPL §3, SPEC §3)": one form uncovers the next
            before = line
            for pattern, replacement in SPEC_FORMS:
                line = pattern.sub(replacement, line)
        return line

    def cross_ref(match: re.Match[str]) -> str:
        target = match.group("target")
        if target in inventory:
            return match.group(0)
        identifier = moved(target, inventory)
        return f"[{match.group('text')}][{identifier}]" if identifier else match.group("text")

    text = ROLE.sub(role, text)
    text = CROSS_REF.sub(cross_ref, text)
    in_docstring = {line for first, last, _ in spans for line in range(first, last + 1)}
    lines = text.split("\n")
    text = "\n".join(uncite(line) if number in in_docstring else line for number, line in enumerate(lines, 1))
    return EXAMPLE_SECTION.sub(lambda m: f"{m.group('indent')}Examples:\n", text)


def convert(files: Iterable[Path], inventory: set[str], root: Path = ROOT) -> list[Path]:
    """Rewrite the given files in place; returns those that changed."""
    changed = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        new = convert_text(text, module_name(path, root), path.name == "__init__.py", inventory)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--site", type=Path, default=ROOT / "site", help="the built site to check (skipped if absent)"
    )
    parser.add_argument(
        "--convert", action="store_true", help="rewrite the package's docstrings, then check them"
    )
    parser.add_argument("--inventory", type=Path, help="the site's objects.inv (default: build one)")
    args = parser.parse_args(argv)
    files = package_files()
    if args.convert:
        inventory = read_inventory(args.inventory) if args.inventory else built_inventory()
        for path in convert(files, inventory):
            print(f"converted {path.relative_to(ROOT)}")
    problems = source_problems(files) + markdown_problems(markdown_files())
    if not args.convert and args.site.is_dir():
        problems += site_problems(args.site)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"docs check: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

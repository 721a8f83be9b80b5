"""The docs check `make docs` runs (docs/check_docs.py): it fails on a Sphinx role planted in the package, on what a
built page must not show, and its conversion turns roles into the cross-references the site renders."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check_docs():
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "docs" / "check_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_sphinx_roles():
    check = _check_docs()
    assert [str(p) for p in check.source_problems(check.package_files())] == []


def test_the_check_fails_on_a_planted_role(tmp_path):
    """The script as `make docs` runs it, on a copy of the package with one `:func:` role planted."""
    shutil.copytree(ROOT / "uds_lens", tmp_path / "uds_lens", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "check_docs.py", tmp_path / "docs" / "check_docs.py")
    command = [sys.executable, str(tmp_path / "docs" / "check_docs.py"), "--site", str(tmp_path / "no_site")]
    clean = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr

    target = tmp_path / "uds_lens" / "uds.py"
    lines = target.read_text().splitlines(keepends=True)
    assert lines[0].startswith('"""')
    lines.insert(1, "See :func:`deltas` for the subtraction.\n")
    target.write_text("".join(lines))
    planted = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert planted.returncode == 1
    assert "uds_lens/uds.py:2: Sphinx role ':func:`deltas`'" in planted.stderr


def test_site_check_finds_literal_roles_dead_references_and_machine_paths(tmp_path):
    check = _check_docs()
    home = str(Path.home()).rstrip("/")
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "bad.html").write_text(
        "<p>Returns a :class:<code>~uds_lens.results.UDSResult</code>.</p>\n"
        "<p>See [deltas][uds_lens.nowhere.deltas].</p>\n"
        f"<pre>zoo in {home}/.cache/uds_lens/zoo-test</pre>\n"
        "<p>report at /tmp/uds_lens_nb_x1/report.html, as SPEC 1.6c says</p>\n"
        '<script src="https://cdn.plot.ly/plotly-3.0.0.min.js"></script>\n'
    )
    (tmp_path / "good.html").write_text(
        '<p>Returns a <a class="autorefs" href="api/results.html#uds_lens.results.UDSResult">UDSResult</a>; '
        'zoo in <code>~/.cache/uds_lens/zoo-test</code>; <a href="https://arxiv.org/abs/2605.24614">paper</a>.</p>'
        '<script src="../assets/javascripts/plotly.min.js"></script>'
    )
    found = check.site_problems(tmp_path)
    assert {p.where for p in found} == {"api/bad.html"}
    lines = {p.line: p.what for p in found if "SPEC" not in p.what and "/tmp/" not in p.what}
    assert lines[1].startswith("literal Sphinx role")
    assert lines[2].startswith("unresolved cross-reference")
    assert lines[3].startswith("a path of the build machine") and ".cache/uds_lens" in lines[3]
    line_four = [p.what for p in found if p.line == 4]
    assert any(w.startswith("a path of the build machine: /tmp/uds_lens_nb_x1") for w in line_four)
    assert any(w.startswith("cites SPEC") for w in line_four)
    assert [p.what.split(":")[0] for p in found if p.line == 5] == ["fetches from the network"]


SOURCE = '''"""Module: :func:`deltas`, :class:`~uds_lens.results.UDSResult`, :func:`helper` (SPEC 1.6c).

The last layer (SPEC §2: the raw residual) and the clip (over-disruption, SPEC 1.6c) stay described.
Moved: [`deltas`][uds_lens.math_old.deltas]; kept: [`UDSResult`][uds_lens.results.UDSResult].

Example:
    >>> deltas(a, b)
"""

from uds_lens.uds import deltas


class Table:
    """Rows; :meth:`frame` gives them."""

    def frame(self):
        """A frame."""
        return f":func:`deltas` {deltas}"  # a comment's :func:`deltas` is not rendered
'''

EXPECTED = '''"""Module: [`deltas`][uds_lens.uds.deltas], [`UDSResult`][uds_lens.results.UDSResult], `helper`.

The last layer (the raw residual) and the clip (over-disruption) stay described.
Moved: [`deltas`][uds_lens.uds.deltas]; kept: [`UDSResult`][uds_lens.results.UDSResult].

Examples:
    >>> deltas(a, b)
"""

from uds_lens.uds import deltas


class Table:
    """Rows; [`frame`][uds_lens.tables.Table.frame] gives them."""

    def frame(self):
        """A frame."""
        return f"`deltas` {deltas}"  # a comment's `deltas` is not rendered
'''


def test_convert_writes_cross_references_the_site_renders():
    check = _check_docs()
    inventory = {"uds_lens.uds.deltas", "uds_lens.results.UDSResult", "uds_lens.tables.Table.frame"}
    converted = check.convert_text(SOURCE, "uds_lens.tables", False, inventory)
    assert converted == EXPECTED
    assert check.convert_text(converted, "uds_lens.tables", False, inventory) == converted


def test_the_docs_have_no_stray_list_item_or_wide_formula():
    check = _check_docs()
    assert [str(p) for p in check.markdown_problems(check.markdown_files())] == []


def test_a_sentence_wrapped_at_a_number_is_caught(tmp_path):
    """The concepts page once cut its definition of damage this way: a wrapped line starting "1." inside a list
    item renders as a nested list item. Lists that are lists (after a colon, siblings, a list after a blank line)
    are not flagged, nor is code."""
    check = _check_docs()
    stray = (
        "- **erasure**: the unlearned model's hidden state disrupts the full model's answer as much as retain's;\n"
        "- **damage**: it disrupts the answer *more* than retain's (`d2 > d1`). The ratio is above 1 and the clip cuts it to\n"
        "  1. Patching in the unlearned model's state breaks the full model beyond removing the fact.\n"
        "\n"
        "A paragraph that wraps before a dash\n"
        "- 1 and goes on.\n"
    )
    assert [line for line, _ in check.stray_list_items(stray)] == [3, 6]
    lists = (
        "Steps:\n1. one\n2. two\n   wrapped\n3. three\n\n- a\n- b, which\n  wraps\n- c:\n  - nested\n\n"
        "Text.\n\n1. a list after a blank line\n\n```bash\nx = 1\n- 2\n```\n| a | b |\n|---|---|\n"
    )
    assert check.stray_list_items(lists) == []
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# Page\n\n" + stray)
    problems = [str(p) for p in check.markdown_problems([page], root=tmp_path)]
    assert problems[0].startswith(
        'docs/page.md:5: a wrapped sentence renders as a list item here: "1. Patching'
    )


def test_a_formula_block_wider_than_the_docs_column_is_caught():
    check = _check_docs()
    wide = "x = " + "a + " * 30
    text = f"```text\n{wide}\nshort\n```\n\n```bash\n{wide}\n```\n"
    assert check.wide_formulas(text) == [(2, len(wide.rstrip()))]  # commands may scroll; formulas must not
    assert check.wide_formulas("```text\n" + "x" * check.CODE_WIDTH + "\n```\n") == []

"""Where a command writes, checked before anything is read or loaded: a path it can write, over nothing it does not
own, apart from everything it reads, and inputs it needs all there.

A command that finds out at its end that it cannot write its output has wasted its compute; one that writes over a
file it did not produce (its own input, another tool's notes) has lost data. So every command checks first that its
outputs neither are, nor hold, nor lie inside any of its inputs (`check_outputs_apart`: checkpoints, data,
zoos, caches), that an output directory can be created and written (`check_writable_dir`), and the file
outputs of ``report`` and ``annotate`` (`check_report_output`, `check_annotation_output`), and a zoo that
``evaluate`` and ``meta-eval`` read model by model (`check_zoo_complete`): each failure is one
[`ConfigError`][uds_lens.config.ConfigError] line naming the path and the fix. (Result directories have their own rules in
`uds_lens.result_store`.)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from uds_lens.config import ConfigError
from uds_lens.files import os_error_line

# The keys every summary annotate writes holds: a file with them may be replaced by a new summary.
ANNOTATION_SUMMARY_KEYS = ("mode", "n_records", "counts")


def check_file_output(option: str, path: str | os.PathLike, example: str = "report.html") -> None:
    """A file output that can be written: not a directory, not under a file, in a directory this process can
    write (created when missing), under a name the filesystem holds. ``option`` names it in the message,
    ``example`` is the file name a directory is told to take."""
    target = Path(path).expanduser()
    try:
        if target.is_dir():
            raise ConfigError(f"{option} {path} is a directory: pass a file name (e.g. {target / example}).")
        blocking = next(
            (parent for parent in target.parents if parent.exists() and not parent.is_dir()), None
        )
        if blocking is not None:
            raise ConfigError(
                f"{option} {path} lies under {blocking}, which is a file: pass a path in a directory."
            )
        check_writable_dir(target.parent, option)
        if not os.path.lexists(target):  # the name itself: made and removed, so a name too long fails now
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(target)
    except OSError as error:
        raise ConfigError(os_error_line(error, option)) from None


# What every report page `uds-lens report` writes carries in its head: a file without it is not one (older reports
# are told by the first line of their style sheet).
REPORT_MARKER = "<meta name='generator' content='uds_lens report'>"
_OLD_REPORT_MARKER = 'body { font-family: -apple-system, "Segoe UI"'


def is_report(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a report page ``uds-lens report`` wrote (its head carries `REPORT_MARKER`)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return REPORT_MARKER in head or _OLD_REPORT_MARKER in head


def check_report_output(path: str | os.PathLike, force: bool = False, option: str = "--out") -> None:
    """A report page can be written at ``path``: a file name (`check_file_output`), and not over a file that
    is no report (a forget set, a result's ``summary.json``) unless ``force``.

    Raises:
        ConfigError: naming the path and the fix.
    """
    check_file_output(option, path)
    target = Path(path).expanduser()
    if target.exists() and not force and not is_report(target):
        raise ConfigError(
            f"{option} {path} holds a file that is not a uds_lens report: it is never replaced by one. Pass "
            "another file name, or --force (force=True) to replace it."
        )


def check_report_apart(
    path: str | os.PathLike, results_dir: str | os.PathLike, option: str = "--out"
) -> None:
    """Refuse a report at ``path`` over a file inside the results it reports on (a result's ``summary.json``, a
    ``sweep.csv``) that is not a report, whatever ``force`` says: a report never replaces its own input.

    Raises:
        ConfigError: naming the file and the fix.
    """
    target = Path(path).expanduser()
    try:
        if not target.exists() or is_report(target):
            return
    except OSError:  # a name the filesystem cannot hold: `check_report_output` words it
        return
    if _relation(os.path.realpath(target), os.path.realpath(Path(results_dir).expanduser())) == "lies inside":
        raise ConfigError(
            f"{option} {path} is a file of the results {results_dir} the report reads: a report never replaces its "
            f"own input (not even with --force). Pass another {option} (e.g. {Path(results_dir) / 'report.html'})."
        )


def _local(value: Any) -> list[str]:
    """The existing local paths among ``value`` (a path, a resolved checkpoint, a hub id, a loaded model, None, or
    a list of them), each with symbolic links resolved (a loop is left as it is)."""
    if isinstance(value, (list, tuple, set)):
        return [path for item in value for path in _local(item)]
    if hasattr(value, "location") and hasattr(value, "local"):  # a checkpoint resolved once (``zoo:npo`` too)
        value = value.location if value.local else None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        return []
    path = Path(value).expanduser()
    return [os.path.realpath(path)] if os.path.lexists(path) else []


def _relation(output: str, source: str) -> str | None:
    """How the resolved ``output`` stands to the resolved input ``source``: ``is``, ``lies inside``, ``holds``."""
    if output == source:
        return "is"
    if output.startswith(source.rstrip(os.sep) + os.sep):
        return "lies inside"
    if source.startswith(output.rstrip(os.sep) + os.sep):
        return "holds"
    return None


def _items(named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return list(named.items()) if isinstance(named, Mapping) else list(named)


def check_outputs_apart(
    outputs: Mapping[str, Any] | Iterable[tuple[str, Any]],
    inputs: Mapping[str, Any] | Iterable[tuple[str, Any]],
    caches: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
) -> None:
    """Refuse outputs that are, hold or lie inside an input, before anything is read or computed.

    A run that writes into a checkpoint, a forget set or a zoo it reads mixes its files into them, and replacing its
    own result directory there deletes what was read (``--out .`` in a folder of checkpoints). Paths are compared
    with symbolic links resolved; inputs that are not local paths (hub ids, models in memory) and ``None`` are left
    out.

    Args:
        outputs: ``(option, path)`` pairs (or a mapping) of what the command writes: ``{"--out": out}``.
        inputs: ``(what, path)`` pairs (or a mapping) of what it reads; a value may be a list of paths.
        caches: caches the run reads and writes itself (its S1 cache): an output may hold one, but neither be one
            nor lie inside one (that would be another run's cache).

    Raises:
        ConfigError: naming the output, the input, how they overlap and the fix.
    """
    named = [(what, path, False) for what, value in _items(inputs) for path in _local(value)]
    named += [(what, path, True) for what, value in _items(caches) for path in _local(value)]
    for option, given in _items(outputs):
        if not isinstance(given, (str, os.PathLike)):
            continue
        output = os.path.realpath(Path(given).expanduser())
        for what, source, cache in named:
            relation = _relation(output, source)
            if relation is None or (cache and relation == "holds"):
                continue
            raise ConfigError(
                f"{option} {given} {relation} the {what} {source}: a run never writes where its inputs are (its "
                f"files would mix with them, and replacing its results would delete them). Pass an {option} apart "
                "from every input."
            )


def check_cache_apart(
    option: str,
    cache: str | os.PathLike | None,
    inputs: Iterable[tuple[str, Any]],
    data_file: Path | None = None,
) -> None:
    """Refuse a cache directory that is, or lies inside, a checkpoint (its files would be written among the
    checkpoint's), or that is the forget set or the folder it is read from. A cache may hold checkpoints (the
    default cache root holds the built zoos).

    Args:
        option: how the message names the cache (``"--cache-dir"``).
        cache: the cache directory (None: no cache).
        inputs: ``(what, path)`` pairs of the checkpoints the run reads (a value may be a list of paths).
        data_file: the forget set's file, when it is read from one.

    Raises:
        ConfigError: naming the cache, the input and the fix.
    """
    if cache is None:
        return
    where = os.path.realpath(Path(cache).expanduser())
    named = [(what, path) for what, value in _items(inputs) for path in _local(value)]
    if data_file is not None:
        named += [("forget set", path) for path in _local(data_file)]
        named += [("forget set's folder", os.path.realpath(Path(data_file).expanduser().parent))]
    for what, source in named:
        relation = _relation(where, source)
        if relation == "is" or (relation == "lies inside" and what != "forget set's folder"):
            raise ConfigError(
                f"{option} {cache} {relation} the {what} {source}: a cache is never written among a run's inputs "
                f"(its files would mix with them). Pass an {option} elsewhere (the default is under the cache root)."
            )


def check_writable_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """``path`` as a directory this process can write, checked before any compute: created when missing (with its
    parents), then a file made and removed in it. Each operating-system error (no permission, a read-only or full
    disk, a name too long, a symbolic-link loop, a file where a directory should be) is one line.

    Raises:
        ConfigError: the error in one line (``files.os_error_line``), naming ``option`` and the path.
    """
    target = Path(path).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".uds_lens-write-check-", dir=target)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(os_error_line(error, option)) from None
    return target


def _is_annotation_summary(path: Path) -> bool:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and all(key in content for key in ANNOTATION_SUMMARY_KEYS)


def check_annotation_output(
    out: str | os.PathLike, summary: str | os.PathLike, data: Any = None, models: Iterable[Any] = ()
) -> None:
    """Refuse an ``annotate`` output it could not write or would write over what it does not own: ``out`` a
    directory, under a file or a name the filesystem cannot hold, the ``data`` input as ``out`` or as the
    ``summary`` written beside it, either inside a checkpoint of ``models`` (full, retain), a ``summary`` path
    holding a file that is not an earlier annotate summary, or an ``out`` file that an earlier annotate did not
    write (none of its summaries beside it).

    Raises:
        ConfigError: naming the path and the fix.
    """
    check_file_output("--out", out, "annotated.json")
    check_file_output("--out (its summary beside it)", summary, "annotated.summary.json")
    path, summary = Path(out).expanduser(), Path(summary).expanduser()
    if isinstance(data, (str, os.PathLike)) and Path(data).expanduser().exists():
        source = os.path.realpath(Path(data).expanduser())
        for written in (path, summary):
            if os.path.realpath(written) == source:
                raise ConfigError(
                    f"annotate would write {written} over its input --data {data}: pass another --out, so the "
                    "input records are kept."
                )
    check_outputs_apart({"--out": path, "--out (its summary)": summary}, [("checkpoint", list(models))])
    if summary.is_dir() or (summary.exists() and not _is_annotation_summary(summary)):
        raise ConfigError(
            f"annotate writes its summary to {summary}, which holds something else (not an earlier annotate "
            "summary): move it, or pass another --out."
        )
    if path.is_file() and not (summary.is_file() and _is_annotation_summary(summary)):
        raise ConfigError(
            f"annotate would write its records over {path}, a file no earlier annotate wrote (no annotate summary "
            f"{summary.name} beside it): move it, or pass another --out."
        )


def check_zoo_complete(zoo: str | os.PathLike, out: str | os.PathLike | None = None) -> None:
    """``zoo`` has a manifest and every model it lists is there: a missing directory is named before any model
    loads, never looked up on the hub. Given ``out`` (``--out`` of ``evaluate`` and ``meta-eval``), that it is
    apart from the zoo (`check_outputs_apart`) and can be written."""
    from uds_lens.zoo.manifest import MANIFEST_FILE, model_paths

    root = Path(zoo).expanduser()
    if out is not None:
        check_outputs_apart({"--out": out}, {"zoo": root})
        check_writable_dir(out)
    if not (root / MANIFEST_FILE).is_file():
        raise ConfigError(
            f"--zoo {zoo} has no {MANIFEST_FILE}: build a zoo with `uds-lens zoo build --out {zoo}`."
        )
    missing = {name: root / path for name, path in model_paths(root).items() if not (root / path).is_dir()}
    if missing:
        raise ConfigError(
            f"--zoo {zoo} lists models whose directories are missing: "
            + ", ".join(f"{name} ({path})" for name, path in missing.items())
            + f"; rebuild them with `uds-lens zoo build --out {zoo}` (valid models are reused)."
        )


__all__ = [
    "ANNOTATION_SUMMARY_KEYS",
    "REPORT_MARKER",
    "check_annotation_output",
    "check_cache_apart",
    "check_file_output",
    "check_outputs_apart",
    "check_report_apart",
    "check_report_output",
    "check_writable_dir",
    "check_zoo_complete",
    "is_report",
]

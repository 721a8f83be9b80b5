"""The on-disk store of results: one directory per result, written as one step and read back only when whole.

A result directory is only worth reading when all its files come from one run, and a run may replace only what it
wrote. So every directory written here carries this package's marker (`RESULT_MARKER`, a small JSON file), and an
existing ``OUT/NAME`` is recomputed or replaced only when it carries it (or is a result saved before the marker
existed, or is empty): an unrelated folder there (a checkpoint, the S1 cache, anyone's notes) is refused in one line
naming it, before any compute where the run can see it (`check_result_target`, which ``score``, ``sweep`` and
`UDSResult.save` share). And a save never writes into ``OUT/NAME`` itself: `atomic_result_dir` holds a lock on ``OUT/NAME`` (``OUT/.NAME.lock``, so concurrent
writers take turns), lets the writer fill a temporary sibling directory, and renames it into place at the end. A
reader therefore sees the old directory, no directory, or the new one, never a mixture; a run killed mid-write leaves
the old result untouched. Files another program left in ``OUT/NAME`` are carried over into the new directory, a
symbolic link as a link (nothing is ever copied through one) and anything but a file, a folder or a link left out.
``meta.json`` lists the SHA-256 of every file it belongs with, and `verify_result_dir`
(used by ``UDSResult.load``) refuses a directory whose files do not match it. Whether a saved result may stand in for
a new computation (``results.check_saved``) is decided by comparing fingerprints; this module words the differences
(`conflict_error`). Nothing here knows the tables inside the files: ``results.py`` writes and parses them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from uds_lens.files import bytes_digest, replace_directory, set_aside, staged_siblings, staging_path

logger = logging.getLogger(__name__)

# The files of one saved result; meta.json (written last) holds their digests.
RESULT_FILES = ("summary.json", "examples.csv", "layers.csv", "layers.parquet", "uds_eval.json")
# The ones every saved result has (meta.json must list them): the others are optional.
REQUIRED_FILES = ("summary.json", "examples.csv", "layers.csv")
# The files `diagnose` writes in OUT/NAME (beside a `score` result there, which it never touches); the report shows a
# directory holding any of them.
DIAGNOSE_FILES = ("scores.json", "layerwise.csv", "components.csv")
# Bumped when the saved tables change meaning: a result of another format is never reused (3: layers.s_full
# renamed baseline_score, s0 and examples' question/entity added, LER NaN outside KE layers).
RESULT_FORMAT = 3
LOCK_TIMEOUT_S = 600.0


class ResultIntegrityError(ValueError):
    """A saved result directory is incomplete, or its files come from different runs."""


class ResultNameError(ValueError):
    """A result name would not stay one directory inside the output directory."""


# What `score`, `diagnose` and `report` write beside the NAME/ directories: no result may be named like them.
DIRECTORY_FILES = ("roles.json", "report.html", "prompt_types.csv", "tau_sensitivity.csv")
# Bytes a name may take: a file name holds 255 on common filesystems, and the staging sibling of OUT/NAME
# (``.NAME.tmp-PID-XXXXXXXX``) adds up to 23.
MAX_NAME_BYTES = 200


def check_result_name(name: str) -> str:
    """A result name is one path component: ``OUT/NAME`` must stay inside ``OUT``, and the filesystem must hold it.

    Raises:
        ResultNameError: the name is empty, ``.``/``..``, contains a path separator or NUL, or starts with ``.``
            (names starting with a dot are this module's lock and temporary files), is longer than
            `MAX_NAME_BYTES` in UTF-8, or is one of the files beside the results (`DIRECTORY_FILES`).
    """
    if isinstance(name, str) and len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ResultNameError(
            f"Result name {name[:40]!r}... is {len(name.encode('utf-8', 'surrogatepass'))} bytes long; result "
            f"directories are named by it, and a name may take at most {MAX_NAME_BYTES} bytes: pick a shorter one "
            "(--unlearned NAME=PATH)."
        )
    if isinstance(name, str) and name.casefold() in {file.casefold() for file in DIRECTORY_FILES}:
        raise ResultNameError(
            f"Result name {name!r} is one of the files written beside the results ({', '.join(DIRECTORY_FILES)}): "
            "pick another name (--unlearned NAME=PATH)."
        )
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name.startswith(".")
        or any(sep in name for sep in ("/", "\\", "\0", os.sep))
    ):
        raise ResultNameError(
            f"Result name {name!r} is not a single path component: names become directories under the output "
            "directory, so they may not be empty, start with '.', or contain '/', '\\' or NUL. Pick a plain name "
            "(e.g. 'npo_lr1e-5')."
        )
    return name


def json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def read_verified(directory: Path) -> tuple[dict[str, Any], dict[str, bytes], str | None]:
    """``meta.json`` and the files it lists, each read once, and what is wrong with them (None when they belong
    together). Reading each file's bytes once and checking those bytes means a concurrent rename cannot slip a file
    of another run in between the check and the parse."""
    if not directory.is_dir():
        return {}, {}, "there is no result directory"
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except FileNotFoundError:
        return {}, {}, "meta.json is missing (the run that wrote it did not finish)"
    except (OSError, json.JSONDecodeError) as err:
        return {}, {}, f"meta.json is unreadable ({err})"
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not files:
        return (
            {},
            {},
            "meta.json lists no file digests (an older uds_lens wrote it, or the write did not finish)",
        )
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        return {}, {}, f"meta.json does not list {missing}"
    contents: dict[str, bytes] = {}
    for name, digest in files.items():
        try:
            content = (directory / name).read_bytes()
        except OSError:
            return {}, {}, f"{name} is missing"
        if bytes_digest(content) != digest:
            return {}, {}, f"{name} does not belong with meta.json (another run wrote it)"
        contents[name] = content
    return meta, contents, None


def verify_result_dir(directory: str | Path) -> str | None:
    """What makes a saved result directory untrustworthy, or None when its files belong together.

    Checks that ``meta.json`` exists and that every file it lists is there with the recorded SHA-256.
    """
    return read_verified(Path(directory))[2]


def normal_json(value: Any) -> Any:
    """JSON round trip, so a fingerprint computed now compares equal to one read back from meta.json."""
    return json.loads(json.dumps(value, sort_keys=True, default=json_default))


# Fingerprint keys that name an input of the computation: a saved result that differs in one of them is another
# run's result (another model, data set or setting), which a new run does not silently replace.
INPUT_KEYS = ("full", "retain", "unlearned", "data", "tokenizer", "settings")


# The keys that identify a model: compared only between fingerprints of one format (a format names how they are made).
IDENTITY_KEYS = ("full", "retain", "unlearned")


def input_conflicts(differ: list[str], saved: dict[str, Any], wanted: dict[str, Any]) -> tuple[str, ...]:
    """The input keys among ``differ`` that make a saved result another run's. Between fingerprints of two formats the
    models' identities are made differently (an older uds_lens's digest may even name other bytes), so they are
    not compared: such a result is recomputed, as a stale copy is, unless its data or settings differ."""
    comparable = saved.get("format") == wanted.get("format")
    return tuple(key for key in INPUT_KEYS if key in differ and (comparable or key not in IDENTITY_KEYS))


class OutputConflictError(ValueError):
    """``OUT/NAME`` holds the result of another run (other inputs): replacing it needs ``force``."""


class ResultTargetError(OutputConflictError):
    """``OUT/NAME`` holds something this package did not write (a file, a checkpoint, a cache, anyone's folder):
    never replaced, whatever ``force`` says."""


# The marker every directory `atomic_result_dir` writes carries (and every staging directory, from its creation):
# what makes an existing OUT/NAME this package's own, to recompute or replace.
RESULT_MARKER = ".uds_lens.json"
_MARKER_CONTENT = {"written_by": "uds_lens", "what": "a result directory (score, sweep, diagnose)"}


def write_marker(directory: Path) -> None:
    """Mark ``directory`` as written by this package."""
    (directory / RESULT_MARKER).write_text(json.dumps(_MARKER_CONTENT))


def is_ours(directory: Path) -> bool:
    """Whether the directory ``directory`` is this package's to replace: it carries `RESULT_MARKER`, is empty, or is
    a result saved before the marker existed (a ``meta.json`` listing its files' digests, or nothing but the files a
    result or ``diagnose`` writes)."""
    try:
        marker = json.loads((directory / RESULT_MARKER).read_text())
        if isinstance(marker, dict) and marker.get("written_by") == "uds_lens":
            return True
    except (OSError, ValueError):
        pass
    try:
        entries = list(directory.iterdir())
    except OSError:
        return False
    if not entries:
        return True
    try:
        meta = json.loads((directory / "meta.json").read_text())
        if isinstance(meta, dict) and isinstance(meta.get("files"), dict) and "format" in meta:
            return True
    except (OSError, ValueError):
        pass
    written = {*RESULT_FILES, "meta.json", *DIAGNOSE_FILES}
    return all(entry.name in written and entry.is_file() and not entry.is_symlink() for entry in entries)


def result_inputs(meta: dict[str, Any]) -> list[tuple[str, Path]]:
    """The local paths a result was computed from, as its ``meta`` names them (full, retain, the unlearned model, the
    forget set; a ``zoo:NAME`` resolved where its zoo is built): what its directory must stay apart from."""
    from uds_lens.checkpoints.checkpoint import resolve_zoo_name

    found = []
    for role in ("full", "retain", "unlearned", "data"):
        given = meta.get(role)
        if not isinstance(given, str) or not given:
            continue
        try:
            path = Path(resolve_zoo_name(given)).expanduser()
        except Exception:  # a zoo no longer built: nothing of it to overwrite here
            continue
        if os.path.lexists(path):
            found.append((f"{role} {'forget set' if role == 'data' else 'checkpoint'}", path))
    return found


def check_result_target(target: str | os.PathLike, inputs: Iterable[tuple[str, Any]] = ()) -> Path:
    """The one guard of a result directory ``OUT/NAME`` before it is written (``score``, ``sweep`` and
    `UDSResult.save` call it before any compute they can, `atomic_result_dir` again under the lock): its name one
    path component, apart from every input of the run (``inputs``: ``(what, path)`` pairs, see
    ``outputs.check_outputs_apart``), and, where something is there already, a directory this package wrote
    (`is_ours`).

    Raises:
        ResultNameError: the name is not one plain path component.
        ConfigError: ``target`` is, holds or lies inside an input.
        ResultTargetError: ``target`` is a file, a link, or a directory this package did not write; one line naming
            it and the fix.
    """
    from uds_lens.outputs import check_outputs_apart

    target = Path(target)
    check_result_name(target.name)
    inputs = list(inputs)
    if inputs:
        check_outputs_apart({"the result directory": target}, inputs)
    if target.is_symlink():
        raise ResultTargetError(
            f"{target} is a symbolic link (to {os.readlink(target)}): a result is never written through one. Remove "
            "the link, or pass another output directory."
        )
    if not target.exists():
        return target
    if not target.is_dir():
        raise ResultTargetError(
            f"{target} is a file, not a result directory: move it, or pass another output directory."
        )
    if not is_ours(target):
        raise ResultTargetError(
            f"{target} holds files uds_lens did not write (no {RESULT_MARKER}, no result's meta.json): a run replaces "
            "only its own results, so it is left as it is. Move it, or pass another output directory."
        )
    return target


def check_result_targets(out_dir: Path, names: Iterable[str]) -> None:
    """Refuse, before any model is loaded, an ``out_dir/NAME`` that is a file or a folder uds_lens did not write
    (`check_result_target`), whatever ``force`` says.

    Raises:
        result_store.ResultTargetError: naming each such path.
    """
    refused = []
    for name in names:
        try:
            check_result_target(out_dir / name)
        except ResultTargetError as error:
            refused.append(str(error))
    if refused:
        raise ResultTargetError(" ".join(refused))


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=json_default) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def fingerprint_difference(key: str, saved: Any, wanted: Any) -> str:
    """One differing fingerprint key in words (what a rerun prints when it recomputes or refuses)."""
    if key == "s1":
        return (
            "the Stage 1 values it was computed from differ from this run's (it used a corrupt or since-rebuilt "
            "S1 cache, or none of that digest)"
        )
    if key == "format":
        return f"its fingerprint is of format {saved} (an older uds_lens), this one writes format {wanted}"
    if key == "settings" and isinstance(saved, dict) and isinstance(wanted, dict):
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        return (
            "settings differ ("
            + ", ".join(f"{k}: saved {saved.get(k)!r}, now {wanted.get(k)!r}" for k in changed)
            + ")"
        )
    return f"{key} differs (saved {_short(saved)}, now {_short(wanted)})"


def conflict_error(conflicts: dict[str, str], option: str = "--force") -> OutputConflictError:
    """The refusal for result directories that hold other runs' results: ``{directory: what differs}``."""
    lines = "; ".join(f"{directory}: {why}" for directory, why in conflicts.items())
    return OutputConflictError(
        f"Refusing to replace the result(s) of another run: {lines}. Pass {option} to replace them, or write to "
        "another output directory."
    )


def result_lock(target: str | Path, timeout: float = LOCK_TIMEOUT_S) -> FileLock:
    """The inter-process lock of result directory ``OUT/NAME``: the file ``OUT/.NAME.lock`` (outside the directory,
    which is replaced as a whole)."""
    target = Path(target)
    return FileLock(str(target.parent / f".{target.name}.lock"), timeout=timeout)


@contextlib.contextmanager
def atomic_result_dir(
    target: str | Path,
    timeout: float = LOCK_TIMEOUT_S,
    owns: tuple[str, ...] = (*RESULT_FILES, "meta.json"),
    check: Callable[[Path], None] | None = None,
) -> Iterator[Path]:
    """Write a result directory as one step: yields an empty staging directory; on normal exit it replaces ``target``.

    While the block runs, ``target``'s lock is held, so concurrent writers of the same ``OUT/NAME`` take turns and
    the last one wins whole. The staging directory is a hidden sibling (``OUT/.NAME.tmp-*``, same filesystem), so the
    final step is a rename: an existing ``target`` is renamed aside, the staging directory renamed into place, and
    the old one deleted (``files.replace_directory``). A reader sees the old directory, none, or the new one; an
    exception or a kill inside the block leaves ``target`` as it was (leftover staging directories are removed by the
    next writer, which also renames back an old directory a kill between the two renames left aside). Files in the
    old directory that the writer did not produce are carried over, except those it ``owns`` (by default a
    ``UDSResult``'s files: a new result never keeps an old one's table); ``diagnose`` owns only its own files, so
    a ``score`` result in the same directory stays whole.

    ``check(target)`` runs under the lock before the block: a check-then-write that no concurrent writer can slip
    between (``UDSResult.save`` refuses there a result another run wrote meanwhile).

    Examples:
        >>> with atomic_result_dir(out / "npo") as staging:
        ...     (staging / "summary.json").write_text("{}")

    Raises:
        ResultNameError: ``target``'s name is not a single plain path component.
        ResultTargetError: ``target`` is a file, a link or a directory this package did not write
            (`check_result_target`).
        filelock.Timeout: another writer held the lock for more than ``timeout`` seconds.
    """
    target = check_result_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with result_lock(target, timeout):
        for aside in set_aside(target):
            if not is_ours(aside):
                continue  # not a directory this package set aside: left alone
            if not target.exists():  # a writer killed between replace_directory's renames: the old one back
                os.rename(aside, target)
            else:
                shutil.rmtree(aside, ignore_errors=True)
        for leftover in staged_siblings(target):
            if leftover.is_dir() and not leftover.is_symlink() and is_ours(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
        check_result_target(target)  # again under the lock: another process may have put something there
        if check is not None:
            check(target)
        staging = staging_path(target)  # OUT/.NAME.tmp-*: the one spelling of a writer's hidden sibling
        staging.mkdir()
        try:
            write_marker(staging)
            yield staging
            write_marker(staging)  # a writer that replaced the folder's files keeps the marker
            if target.is_dir():
                _carry_over(target, staging, owns)
            replace_directory(
                staging, target
            )  # the old one renamed aside, the new one in, the old one deleted
        except BaseException as error:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(error, OSError) and error.filename is None:
                error.filename = str(
                    target
                )  # a full disk fails write() naming no file: the message names this
            raise


def _carry_over(old: Path, new: Path, owns: Iterable[str]) -> None:
    """Copy into ``new`` what ``old`` holds that the writer did not produce and does not own: files and folders as
    they are, a symbolic link as a link (never what it points to: a link to ``/dev/zero`` or to ``..``), anything
    else (a pipe, a device) left out with a warning."""
    owned = {*owns, RESULT_MARKER}
    for entry in old.iterdir():
        destination = new / entry.name
        if entry.name in owned or os.path.lexists(destination):
            continue
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(entry), destination)
        elif stat.S_ISDIR(mode):
            shutil.copytree(entry, destination, symlinks=True, ignore=_special_files)
        elif stat.S_ISREG(mode):
            shutil.copy2(entry, destination)
        else:
            logger.warning(
                "%s is neither a file, a folder nor a link: not carried into the new result.", entry
            )


def _special_files(folder: str, names: list[str]) -> list[str]:
    """The entries of ``folder`` ``shutil.copytree`` must not open (pipes, devices, sockets: reading one blocks or
    never ends); links are copied as links."""
    special = []
    for name in names:
        mode = os.lstat(os.path.join(folder, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            logger.warning(
                "%s is neither a file, a folder nor a link: not carried into the new result.", name
            )
            special.append(name)
    return special


__all__ = [
    "DIAGNOSE_FILES",
    "DIRECTORY_FILES",
    "IDENTITY_KEYS",
    "INPUT_KEYS",
    "MAX_NAME_BYTES",
    "LOCK_TIMEOUT_S",
    "RESULT_FILES",
    "RESULT_FORMAT",
    "REQUIRED_FILES",
    "RESULT_MARKER",
    "OutputConflictError",
    "ResultIntegrityError",
    "ResultNameError",
    "ResultTargetError",
    "atomic_result_dir",
    "check_result_name",
    "check_result_target",
    "check_result_targets",
    "input_conflicts",
    "is_ours",
    "result_inputs",
    "write_marker",
    "conflict_error",
    "result_lock",
    "verify_result_dir",
]

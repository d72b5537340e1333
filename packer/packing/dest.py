"""What ``--overwrite`` may delete: only what packer wrote.

:func:`prepare_output` is the one rule for every output folder (``packer pack`` DEST, a distributed rank's part
folder, ``packer export`` OUT): a new or empty folder is used as it is; a non-empty one is replaced only with
``overwrite`` and only when every entry in it is something packer writes there. Anything else, a symbolic link,
or a folder that cannot be created is a :class:`DestinationError` (one line, exit 2) and nothing is deleted.

A DEST is a packer dataset when its ``manifest.json`` is packer's (format, format version, packer version) or it
holds packer's progress record (``.packer-in-progress``), and it holds nothing but packer's files: the manifest,
the journal, ``loader.json``, the files of the format writers (``Writer.FILES``), their ``.tmp`` names, and the
part folders ``part-NNNNN`` of a distributed conversion holding the same.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from ..arguments import spelled
from ..errors import DestinationError
from ..manifest import JOURNAL, MANIFEST, TUNED
from ..system import is_folder, is_regular_file

PART_INFO = "part.json"  # distributed.PART_INFO: a finished rank's part
PART_DIR = re.compile(r"part-\d{5}")
PART = "part-{:05d}"  # rank r's part folder: PART.format(r), a PART_DIR name
SHOWN = 4  # unexpected entries named in a message before "and N more"


def _packer_file(name: str, extra: tuple[str, ...] = ()) -> bool:
    from ..formats.base import writer_files

    patterns = (*writer_files(), *extra)
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_bytes()) if is_regular_file(path) else None
    except (OSError, ValueError, RecursionError):
        return None


def _is_packer_manifest(path: Path) -> bool:
    data = _read_json(path)
    return (isinstance(data, dict) and isinstance(data.get("format"), str)
            and isinstance(data.get("format_version"), int) and isinstance(data.get("packer_version"), str))


def _is_journal(path: Path) -> bool:
    data = _read_json(path)
    return isinstance(data, dict) and isinstance(data.get("options"), dict)


PART_OWN = (PART_INFO, PART_INFO + ".tmp", JOURNAL, JOURNAL + ".tmp")


def _unexpected_in(folder: Path, own: tuple[str, ...], parts: bool, prefix: str = "") -> list[str]:
    """Entries of ``folder`` that are neither a regular file named like packer's (``own`` or a writer's) nor,
    with ``parts``, a part folder holding only packer's files."""
    unexpected = []
    for entry in sorted(os.listdir(folder)):
        path = folder / entry
        if is_regular_file(path) and _packer_file(entry, own):
            continue
        if parts and PART_DIR.fullmatch(entry) and is_folder(path):
            unexpected += _unexpected_in(path, PART_OWN, False, prefix=entry + "/")
            continue
        unexpected.append(prefix + entry + ("/" if is_folder(path) else ""))
    return unexpected


def dataset_problems(dest: Path) -> list[str]:
    """Why the non-empty folder ``dest`` is not a packer dataset that ``--overwrite`` may replace; [] if it is."""
    found = []
    own: tuple[str, ...] = (MANIFEST + ".tmp", JOURNAL + ".tmp", TUNED, TUNED + ".tmp")
    if _is_packer_manifest(dest / MANIFEST):
        own += (MANIFEST,)
    elif os.path.lexists(dest / MANIFEST):
        found.append(f"its {MANIFEST} is not packer's")
    if _is_journal(dest / JOURNAL):
        own += (JOURNAL,)
    if MANIFEST not in own and JOURNAL not in own and not found:
        found.append(f"it has no packer {MANIFEST} or progress record")
    unexpected = [name for name in _unexpected_in(dest, own, True) if name != MANIFEST or not found]
    if unexpected:
        found.append(f"it {'also ' if found else ''}holds {name_some(unexpected)}")
    return found


def part_problems(part: Path) -> list[str]:
    """Why a rank's part folder holds more than packer's files; [] if it holds only those."""
    unexpected = _unexpected_in(part, PART_OWN, False)
    return [f"it also holds {name_some(unexpected)}"] if unexpected else []


def export_problems(out: Path, images: Callable[[str], bool], files: tuple[str, ...] = ()) -> list[str]:
    """Why the non-empty folder ``out`` is not a previous export: only class folders holding (in any
    sub-folder) files for which ``images(name)`` is true, and the top-level ``files`` (a table). [] if it is
    one."""
    unexpected = []
    for entry in sorted(os.listdir(out)):
        if entry in files and is_regular_file(out / entry):
            continue
        if not is_folder(out / entry):
            unexpected.append(entry)
            continue
        for dirpath, dirnames, filenames in os.walk(out / entry):
            rel = Path(dirpath).relative_to(out).as_posix()
            for name in sorted(dirnames):
                if not is_folder(Path(dirpath) / name):  # a link to a folder: not something export writes
                    unexpected.append(f"{rel}/{name}")
            unexpected += [f"{rel}/{n}" for n in sorted(filenames)
                           if not (images(n) and is_regular_file(Path(dirpath) / n))]
    return [f"it holds {name_some(unexpected)}, which export does not write"] if unexpected else []


def name_some(names: list[str]) -> str:
    """``a, b, c, d and 3 more``: the first few names of a list, for one-line messages."""
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def prepare_output(path: Path, overwrite: bool, problems: Callable[[Path], list[str]], what: str) -> None:
    """Make ``path`` an existing, empty folder: create it, or, with ``overwrite``, empty it when ``problems``
    finds nothing wrong with what it holds. ``what`` names such a folder in messages ("packer dataset").

    Raises:
        DestinationError: ``path`` is a file or a link, is not empty (without ``overwrite``, or holding
            something packer did not write), or cannot be created. Nothing is deleted then.
    """
    try:
        _prepare(path, overwrite, problems, what)
    except OSError as exc:
        raise DestinationError(f"{path}: cannot create or empty this folder ({exc.strerror or exc}); choose "
                               "another destination") from None


def check_output(path: Path, overwrite: bool, problems: Callable[[Path], list[str]], what: str) -> bool:
    """What :func:`prepare_output` checks, deleting nothing; returns whether ``path`` holds something (that
    ``overwrite`` allows replacing)."""
    try:
        return _check(path, overwrite, problems, what)
    except OSError as exc:
        raise DestinationError(f"{path}: cannot use this folder ({exc.strerror or exc}); choose another "
                               "destination") from None


def _check(path: Path, overwrite: bool, problems: Callable[[Path], list[str]], what: str) -> bool:
    if path.is_symlink():
        if overwrite and path.is_dir() and any(path.iterdir()):
            raise DestinationError(f"{path}: is a symbolic link, so {spelled('overwrite')} will not delete what it "
                                   "points to; "
                                   "give the real folder, or a new one")
        if not path.exists():
            raise DestinationError(f"{path}: is a broken symbolic link; remove it or choose another destination")
    if path.exists() and not path.is_dir():
        raise DestinationError(f"{path}: exists and is not a folder; choose another destination")
    if not (path.exists() and any(path.iterdir())):
        return False
    if not overwrite:
        raise DestinationError(f"{path}: already exists and is not empty; pass {spelled('overwrite')} to replace "
                               "it")
    found = problems(path)
    if found:
        raise DestinationError(f"{path}: is not a {what} ({'; '.join(found)}), so {spelled('overwrite')} will not "
                               "delete it; choose an empty or new folder")
    return True


def _prepare(path: Path, overwrite: bool, problems: Callable[[Path], list[str]], what: str) -> None:
    if _check(path, overwrite, problems, what):
        empty_folder(path)
    path.mkdir(parents=True, exist_ok=True)


def empty_folder(path: Path, keep: tuple[str, ...] = ()) -> None:
    """Delete what ``path`` holds (links themselves, never what they point to) but the entries named ``keep``,
    keeping the folder itself: its permissions, or a mount point. The manifest goes first (a folder half emptied
    is never taken for a dataset) and the progress record last (until then the folder is an unfinished conversion
    that ``--resume`` and ``--overwrite`` recognise, whenever the process is killed)."""
    last = {MANIFEST: 0, JOURNAL: 2}
    for entry in sorted(os.listdir(path), key=lambda name: last.get(name, 1)):
        if entry in keep:
            continue
        child = path / entry
        if is_folder(child):
            shutil.rmtree(child)
        else:
            child.unlink()


def only_leftovers(dest: Path) -> bool:
    """Whether ``dest`` holds something, and nothing but packer's temporary files (a progress record or manifest
    being written, a format's ``.tmp`` files): what a conversion killed before its progress record was in place
    leaves. Packer never leaves such a folder otherwise, so every command may empty it."""
    try:
        names = os.listdir(dest) if is_folder(dest) else []
    except OSError:
        return False
    own = (MANIFEST + ".tmp", JOURNAL + ".tmp", TUNED + ".tmp")
    return bool(names) and all(name.endswith(".tmp") and is_regular_file(dest / name) and _packer_file(name, own)
                               for name in names)

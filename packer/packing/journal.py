"""The progress record of an unfinished conversion: ``.packer-in-progress`` in the folder being written (DEST, or
a distributed rank's part folder).

Its presence marks the folder unfinished. It holds the options of the conversion (``--resume`` must be given the
same ones), the source position to continue from, the writer's state at its last durable point, and the images
skipped so far. :func:`finish` writes the folder's final record (the manifest, or a part's ``part.json``) and then
removes the journal, so a folder always has one or the other.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from ..errors import DestinationError, PackerError
from ..manifest import JOURNAL, write_json_atomic
from ..system import is_regular_file
from .dest import empty_folder

__all__ = ["JOURNAL", "differences", "discard", "finish", "read_journal", "resumable", "save", "start",
           "write_failed"]


def read_journal(folder: Path) -> dict | None:
    """The journal of an unfinished conversion in ``folder``, or None.

    Raises:
        DestinationError: it exists but cannot be read.
    """
    path = folder / JOURNAL
    if not is_regular_file(path):
        return None
    try:
        journal = json.loads(path.read_text())
        if not isinstance(journal, dict) or "options" not in journal:
            raise ValueError("not a journal")
        return journal
    except (OSError, ValueError) as exc:
        raise DestinationError(f"{path}: unreadable progress record ({exc}); start again with --overwrite") from None


def differences(old: dict, new: dict) -> list[str]:
    """The keys whose values differ between two option records, sorted."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def resumable(folder: Path, options: dict[str, Any], resume: bool,
              same: str = "source and options") -> dict | None:
    """The journal of the interrupted conversion into ``folder`` to continue, or None: nothing to resume (or
    ``resume`` not asked); then the caller prepares ``folder`` and starts a journal (:func:`start`).

    Args:
        folder: DEST, or a rank's part folder.
        options: what the conversion records; a resumed journal must hold the same.
        resume: continue an interrupted conversion if ``folder`` holds one.
        same: what a resumed conversion must keep, for the message when it does not.

    Raises:
        DestinationError: the interrupted conversion used other options.
    """
    journal = read_journal(folder) if resume else None
    if journal is not None:
        changed = differences(journal["options"], options)
        if changed:
            raise DestinationError(f"{folder}: the interrupted conversion used a different {', '.join(changed)}; "
                                   f"resume with the same {same}, or start again with --overwrite")
    return journal


def start(folder: Path, options: dict[str, Any]) -> dict:
    """A fresh journal for the conversion into the prepared ``folder``, written; returned."""
    journal = {"options": options, "position": 0, "skipped": [], "writer": None}
    save(folder, journal)
    return journal


def save(folder: Path, journal: dict) -> None:
    """Record progress: atomically, so that a kill leaves the previous record or this one."""
    write_json_atomic(folder / JOURNAL, journal)


def finish(folder: Path, name: str, record: dict[str, Any]) -> None:
    """Write ``folder/name`` (the manifest, or a part's ``part.json``), then remove the journal.

    Raises:
        PackerError: the write failed (:func:`write_failed`).
    """
    try:
        write_json_atomic(folder / name, record)
    except OSError as exc:
        raise write_failed(folder, exc) from None
    (folder / JOURNAL).unlink()


def discard(folder: Path, created: bool) -> None:
    """Remove what a conversion that packed nothing wrote into ``folder`` (emptied or created for it), so that
    the same command can run again; ``created``: the conversion created ``folder`` itself."""
    empty_folder(folder)
    if created:
        folder.rmdir()


# What to do about a failed write, by errno; LMDB reports every failed write as EIO, hence the broad default.
_WRITE_ADVICE: dict[int | None, str] = {  # by OSError.errno, which may be None
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space or raise your disk quota",
    errno.EFBIG: "a file outgrew the file-size limit (ulimit -f) or the file system's largest file; lift the limit "
                 "or choose a DEST on another file system",
    errno.EACCES: "fix permissions",
    errno.EPERM: "fix permissions",
    errno.EROFS: "the file system is read-only; remount it writable",
}


def write_failed(folder: Path, exc: OSError) -> PackerError:
    """The one-line error for a failed write into ``folder``, with what to do about it."""
    advice = _WRITE_ADVICE.get(exc.errno, "free space, lift any file-size limit (ulimit -f) or fix permissions")
    return PackerError(f"{folder}: write failed ({exc.strerror or exc}); {advice}, then run the same command with "
                       "--resume")

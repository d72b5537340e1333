"""Which file a reader reads: a dataset notes the identity of its data files when it reads its manifest, and
refuses a file that changed since then.

``packer pack --overwrite`` deletes DEST and writes new files under the same names. A reader that paired the
manifest it holds with whatever file now has the name would serve another conversion's samples under its own
class names and shapes. A reader that has opened a file keeps it (a memory map, an open file, an LMDB
environment keep the deleted file alive); a file it has not opened yet must still be the one its manifest
describes, or it refuses with :func:`changed_error`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from ..errors import CorruptDataError


class FileId(NamedTuple):
    """What tells one file at a path from its replacement: device and inode (a new file while the old one is
    still open or mapped gets another inode), size and modification time (a file rewritten in place)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_id(path: str | os.PathLike) -> FileId | None:
    """The identity of the file at ``path``, or None if it cannot be stat'ed (the open reports why)."""
    try:
        return FileId.of(os.stat(path))
    except OSError:
        return None


def changed_error(path: Path) -> CorruptDataError:
    return CorruptDataError(f"{path}: replaced or changed since this dataset was opened (was DEST repacked?); "
                            "open the dataset again")


def check_unchanged(path: Path, recorded: FileId | None, now: FileId) -> None:
    """Raise :func:`changed_error` when ``now`` is not the file noted as ``recorded`` (None: nothing noted)."""
    if recorded is not None and now != recorded:
        raise changed_error(path)

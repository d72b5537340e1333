"""Where a table's paths lead: every image and mask path of a table must resolve, links followed, inside its root
(``--root``, default the table's folder), and name a regular file.

A table may come from anyone; its paths must not make packer read, and copy into a dataset that is then shared,
any file the user can read. So a path (relative to the root, or absolute) is resolved with every link followed
(``os.path.realpath``) and must land inside the root's real path; ``--root /`` accepts any path, as an explicit
choice. Whether a path is outside is decided from its name and the links it passes through, never from whether
the file it names exists, so the refusal says nothing about the files outside the root. Inside the root, a path
that names nothing, or something that is not a regular file (a folder, a FIFO, a device), skips its row with a
message of one kind: "cannot read it". Nothing is opened until a path passed both checks; a reader checks again
before it opens (:meth:`Root.resolve`), so that a link changed meanwhile cannot lead out.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MISSING = "cannot read it: no such file; fix the path in the table, or restore the file"
NOT_REGULAR = "cannot read it: not a regular file (a folder, pipe or device); fix the path in the table"


class Outside(ValueError):
    """A path that leads outside the root."""


class Root:
    """The folder a table's paths are relative to, and the check that each stays inside it. Picklable: a
    conversion's workers check again before they open."""

    def __init__(self, root: str | os.PathLike):
        self.given = Path(root)
        self.absolute = os.path.abspath(root)
        self.real = os.path.realpath(root)
        self._prefix = self.real if self.real.endswith(os.sep) else self.real + os.sep
        self._dirs: dict[str, str] = {}  # real path of each folder met, so that a path costs one lstat

    def resolve(self, cell: str) -> str:
        """The real path ``cell`` names (relative to the root, or absolute), every link followed.

        Raises:
            Outside: it leads outside the root.
        """
        joined = os.path.join(self.absolute, cell)
        head, tail = os.path.split(joined)
        real_head = self._dirs.get(head)
        if real_head is None:
            real_head = self._dirs[head] = os.path.realpath(head)
        path = os.path.join(real_head, tail)
        if tail in ("", ".", "..") or os.path.islink(path):
            path = os.path.realpath(joined)
        if path != self.real and not path.startswith(self._prefix):
            raise Outside(f"{cell!r} leads outside --root {self.given}")
        return path

    def relpath(self, cell: str) -> str:
        """How the manifest names ``cell``: the path relative to the root with '/' separators (an absolute path
        made relative to the root it is inside), normalized."""
        path = os.path.normpath(os.path.join(self.absolute, cell))
        for base in (self.absolute, self.real):
            rel = os.path.relpath(path, base)
            if rel != ".." and not rel.startswith(".." + os.sep):
                return rel.replace(os.sep, "/")
        return cell

    def file_size(self, path: str) -> int | str:
        """The size of the file at ``path`` (a real path from :meth:`resolve`), or why it cannot be read."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return MISSING
        except OSError as exc:
            return f"cannot read it: {exc.strerror}; check the file"
        return st.st_size if stat.S_ISREG(st.st_mode) else NOT_REGULAR

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dirs": {}}

"""One writer per output folder: an OS lock (:func:`packer.system.lock_file`) on a small file next to the folder.

A conversion into DEST holds ``.DEST.packer-lock`` in DEST's parent folder from before it prepares DEST (which
``--overwrite`` may empty) until its manifest is written; under torchrun each rank also holds
``.DEST.part-NNNNN.packer-part-lock`` while it writes its part. A second writer fails at once, naming the process
that holds the lock. The lock file lives outside DEST, so it is never mistaken for, or deleted with, the
dataset's files; it is removed on release. The kernel releases the lock when its holder exits in any way,
SIGKILL included; a lock file left behind then is simply locked again by the next writer.

A file system without working locks (some network mounts) gets a warning and no lock, as before there was one.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

from ..errors import DestinationBusyError, DestinationError, warn
from ..system import file_is_at, lock_file, unlock_file
from .dest import PART_DIR

SUFFIX = ".packer-lock"
PART_SUFFIX = ".packer-part-lock"  # never the end of a DEST's lock name: DEST "x.part-00001" is not x's part
NAME_MAX = 255
_held: set[int] = set()  # this process's lock descriptors


def _close_in_child() -> None:
    """A forked child (a conversion worker) closes its copies of the lock descriptors: closing them does not
    unlock, and a child that outlives a killed parent for a moment must not keep DEST locked."""
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def lock_path(dest: str | os.PathLike, part: str | None = None) -> Path:
    """The lock file of ``dest`` (or of its part folder ``part``): in the parent of DEST's real path (symbolic
    links, symbolically linked parents, ``..`` and relative spellings resolved), so that every process writing
    that folder locks the same file however it names it."""
    dest = Path(os.path.realpath(dest))
    name, suffix = (f"{dest.name}.{part}", PART_SUFFIX) if part else (dest.name, SUFFIX)
    lock_name = f".{name}{suffix}"
    if len(os.fsencode(lock_name)) > NAME_MAX:  # DEST's own name is near the limit
        lock_name = f".{hashlib.sha256(os.fsencode(name)).hexdigest()[:32]}{suffix}"
    return dest.parent / lock_name


def _holder(fd: int) -> str:
    """``pid N on HOST`` as the holder wrote it; empty in the instant before it has."""
    try:
        pid, host = os.pread(fd, 4096, 0).decode("utf-8", "replace").split()
        return f" (pid {int(pid)} on {host})"
    except (OSError, ValueError):
        return ""


def _busy(folder: Path, holder: str, shown: str | None = None) -> DestinationBusyError:
    what = f"{shown} is being uploaded" if shown else f"{folder} is being written"
    return DestinationBusyError(f"{what} by another packer process{holder}; wait for it or stop it")


def check_free(dest: Path, part: str | None = None) -> None:
    """Fail at once if another process holds the lock of ``dest`` (or of its part folder ``part``); creates
    nothing.

    Raises:
        DestinationBusyError: it does.
    """
    path = lock_path(dest, part)
    folder = dest / part if part else dest
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # no lock file: nobody holds it (or it cannot be told here; acquiring it will)
    try:
        free = lock_file(fd, exclusive=False, blocking=False)
    except OSError:
        free = True  # it cannot be told here; acquiring it will
    try:
        if not free:
            raise _busy(folder, _holder(fd))
    finally:
        os.close(fd)


def check_parts_free(dest: Path) -> None:
    """Fail if a rank of another conversion still writes one of the part folders in ``dest``: ``--overwrite``
    would delete it under that rank."""
    try:
        names = sorted(os.listdir(dest))
    except OSError:
        return
    for name in names:
        if PART_DIR.fullmatch(name):
            check_free(dest, part=name)


class OutputLock:
    """The lock of an output folder, held from :meth:`acquire` to :meth:`release` (or the ``with`` block).

    Args:
        dest: the folder.
        part: the part folder in ``dest`` that a torchrun rank writes (its own lock).
        shown: the name the busy error gives instead of the folder's: the URL an upload stages ``dest`` for.
    """

    def __init__(self, dest: str | os.PathLike, part: str | None = None, shown: str | None = None):
        self.dest = Path(dest)
        self.shown = shown
        self.folder = self.dest / part if part else self.dest
        self.path = lock_path(self.dest, part)
        self.fd: int | None = None
        self.pid = 0

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            DestinationBusyError: another process holds it (exit 1).
            DestinationError: the folder for the lock file cannot be created.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DestinationError(f"{self.folder}: cannot create this folder ({exc.strerror or exc}); choose "
                                   "another destination") from None
        try:
            self.fd = self._lock()
        except OSError as exc:
            warn(f"{self.folder}: cannot lock it ({self.path}: {exc.strerror or exc}), so packer cannot tell "
                 "whether another process writes into it; make sure none does")
            return
        self.pid = os.getpid()
        _held.add(self.fd)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{self.pid} {socket.gethostname()}\n".encode(), 0)

    def _lock(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                locked = lock_file(fd, exclusive=True, blocking=False)
                # The previous holder removes the file when it releases: a file opened just before that is no
                # longer the lock file, so lock the one at the path now.
                if locked and file_is_at(fd, self.path):
                    return fd
            except BaseException:  # never keep a lock on a descriptor nobody holds: it would shut others out
                os.close(fd)
                raise
            if not locked:
                holder = _holder(fd)
                os.close(fd)
                raise _busy(self.folder, holder, self.shown)
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file and unlock (in the process that took it; a forked child holds no copy)."""
        if self.fd is None or os.getpid() != self.pid:
            return
        try:
            os.unlink(self.path)  # while still locked: a waiter that opened it sees it gone, and retries
        except OSError:
            pass  # left behind, harmless: the next writer locks it
        _held.discard(self.fd)
        try:
            unlock_file(self.fd)
        except OSError:
            pass  # closing unlocks too
        os.close(self.fd)
        self.fd = None

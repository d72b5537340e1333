"""The page cache: warm a dataset's files into it, evict them from it, and ask how much of them it holds."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..formats import close_all

BLOCK = 8 << 20
EVICTED_BELOW = 0.01  # resident fraction under which an eviction counts as done


class _Libc:
    """libc's mmap/munmap/mincore through ctypes: Python's mmap cannot give mincore a read-only map's address."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


_LIBC: _Libc | None = None
PROT_READ, MAP_SHARED = 1, 1
MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> _Libc | None:
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            _LIBC = _Libc()
    return _LIBC


def resident_bytes(path: str | os.PathLike) -> tuple[int, int] | None:
    """(bytes of ``path`` in the page cache, file size), or None where mincore cannot tell.

    Linux reports page-cache residency of a file's pages only to a process that owns or may write the file;
    for others it would say "not resident" for everything, so they get None."""
    libc = _libc()
    size = os.path.getsize(path)
    if libc is None:
        return None
    if size == 0:
        return 0, 0
    if os.stat(path).st_uid != os.geteuid() and not os.access(path, os.W_OK):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            return None
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            resident = int(np.count_nonzero(np.frombuffer(memoryview(vec), dtype=np.uint8) & 1))
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * page, size), size


def resident_fraction(paths: Iterable[str | os.PathLike]) -> float | None:
    """The fraction of the files' bytes in the page cache (None where unknown)."""
    resident = total = 0
    for path in paths:
        r = resident_bytes(path)
        if r is None:
            return None
        resident, total = resident + r[0], total + r[1]
    return resident / total if total else 0.0


def evict(paths: Iterable[str | os.PathLike]) -> bool:
    """Drop the files from the page cache: fsync (dirty pages cannot be dropped), then POSIX_FADV_DONTNEED.
    Pages mapped by any process stay, so nothing may have them mapped. False where fadvise is missing."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):  # some filesystems refuse fsync on a read-only handle
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def prewarm(paths: Iterable[str | os.PathLike]) -> None:
    """Read every file once so that it is in the page cache."""
    buf = bytearray(BLOCK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def dataset_files(root: str | os.PathLike) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def release_handles() -> None:
    """Unmap this process's datasets so that an eviction can take: drop unreferenced datasets (their maps and
    loader threads), then close the handles formats share per process (:func:`packer.formats.close_all`: LMDB's
    environments). Only call this with no loader running: closing a map under a reading thread crashes. The
    datasets reopen lazily; mincore then says whether anything was left mapped."""
    gc.collect()
    close_all()


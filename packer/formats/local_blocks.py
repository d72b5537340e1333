"""A local dataset read a block at a time within a page-cache budget (``open_dataset(FOLDER, page_budget=...)``):
the same :class:`~packer.formats.blocked.BlockedReader` and fetch-ahead thread as a URL larger than its cache, with
the kernel's page cache in the node cache's place.

- :class:`LocalBlocks` is the block store: a block is read (``pread``) into the reading process's own memory and
  then advised out of the page cache (``POSIX_FADV_DONTNEED``), unless it was all cached before the read (the
  fetch-ahead thread read it ahead: the other workers reading it find it there, and the thread drops it once
  every batch reading it was received); the fetch-ahead thread's :meth:`LocalBlocks.hold` has the kernel read a
  block ahead (:func:`read_ahead`) and its release drops it again (:func:`drop`). So the page
  cache holds about the blocks read ahead (at most ``page_budget``: :func:`~packer.formats.blocked.block_budget`
  sizes them), and each process holds the ``KEEP_BLOCKS`` blocks it keeps, in its own memory.
- :class:`UncachedSource` reads a format's layout (its headers and indexes) the same way, leaving nothing cached.
- :func:`open_local` turns a folder and a budget into what ``open_blocked`` reads (:class:`BlockedLocal`); the
  layout is cached in the packer cache folder (never in the dataset's folder), keyed by the data files' identity.

Where ``posix_fadvise`` does not exist (macOS) everything works, without the advice. Nothing here knows a format.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..arguments import parse_bytes
from ..errors import UsageError
from ..manifest import read_local_manifest
from ..system import default_cache_dir
from .advice import PAGE, advise
from .layout import LocalSource

DROP_EVERY = 256 << 10  # an uncached read drops what it read from the page cache this often (whole pages)
READ_AHEAD_STEP = 128 << 10  # bytes a read-ahead advises at a time: within the kernel's smallest window


def parse_page_budget(page_budget: int | str | None) -> int | None:
    """``page_budget`` in bytes: a positive int, or a string such as ``"2GB"``; None stays None. Anything else
    is a one-line :class:`UsageError` naming it."""
    if isinstance(page_budget, bool) or not isinstance(page_budget, (int, str, type(None))):
        raise UsageError(f"page_budget must be a size like 2GB or a number of bytes, not {page_budget!r}")
    try:
        return parse_bytes(page_budget)
    except ValueError as exc:
        raise UsageError(f"page_budget: {exc}") from None


def read_uncached(path: Path, start: int, end: int) -> bytearray:
    """Bytes ``[start, end)`` of ``path`` (fewer where it ends first), read into this process's memory without
    kernel read-ahead past them, and advised out of the page cache ``DROP_EVERY`` bytes at a time as they are read
    (a large read, such as a format's first megabyte of layout, never holds more of the page cache than that)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _no_readahead(fd)
        shared = _resident(fd, start, end)  # read ahead by the loader's thread: its release drops it, not this read
        data = bytearray(max(0, end - start))
        view, done = memoryview(data), 0
        while done < len(data):
            step = DROP_EVERY - (start + done) % PAGE  # ends on a page: the next read's first page is not dropped
            got = _pread_into(fd, view[done:done + step], start + done)
            if got == 0:
                break
            if not shared:
                advise(fd, start + done, start + done + got, "POSIX_FADV_DONTNEED")
            done += got
        return data if done == len(data) else data[:done]
    finally:
        os.close(fd)


_MINCORE: list = []  # libc's mincore, once looked up (an empty list inside: none)


def _mincore() -> Any:
    if not _MINCORE:
        found = None
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                found = ctypes.CDLL(None, use_errno=True).mincore
                found.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _MINCORE.append(found)
    return _MINCORE[0]


def _resident(fd: int, start: int, end: int) -> bool:
    """Whether every page of bytes ``[start, end)`` of ``fd`` is in the page cache (False where mincore cannot
    tell)."""
    found = _cached_pages(fd, start, end)
    return found is not None and bool(found[1].all())


def _cached_pages(fd: int, start: int, end: int) -> tuple[int, np.ndarray] | None:
    """The offset of the first page of bytes ``[start, end)`` of ``fd`` and, for each of the range's pages,
    whether it is in the page cache (read: mincore does not count a page whose read is still in flight); None
    where mincore cannot tell. A private map of the range is never written: mincore sees the file's cached pages."""
    mincore, st = _mincore(), os.fstat(fd)
    low, end = start - start % PAGE, min(end, st.st_size)
    if mincore is None or end <= start or not _may_see_pages(fd, st):
        return None
    try:
        mapped = mmap.mmap(fd, end - low, offset=low, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    try:
        vec = (ctypes.c_ubyte * -(-(end - low) // PAGE))()
        window = (ctypes.c_char * (end - low)).from_buffer(mapped)
        try:
            if mincore(ctypes.addressof(window), end - low, vec) != 0:
                return None
        finally:
            del window  # before the map closes: it exports its buffer
        return low, (np.frombuffer(memoryview(vec), np.uint8) & 1).astype(bool)
    finally:
        mapped.close()


def _may_see_pages(fd: int, st: os.stat_result) -> bool:
    """Whether mincore tells this process which of ``fd``'s pages are cached: Linux tells one that owns the file
    or may write it (root may), and says "not cached" for every page to any other."""
    return st.st_uid == os.geteuid() or os.geteuid() == 0 or os.access(f"/proc/self/fd/{fd}", os.W_OK)


def read_ahead(fd: int, start: int, end: int) -> None:
    """Read bytes ``[start, end)`` of ``fd`` into the page cache, and return once they are there. The kernel's
    read-ahead (``POSIX_FADV_WILLNEED``) reads at most its window a call (the device's ``read_ahead_kb`` or
    largest I/O: the first 8 MB of a 64 MB block here), and returns before its reads are done: a drop
    (``POSIX_FADV_DONTNEED``) meanwhile skips the pages still being read, which then stayed cached past the
    budget. So the range is advised ``READ_AHEAD_STEP`` bytes at a time, then one byte of the last page of each
    step is read (the read returns once that page's own read is done), without copying the range; twice more
    for the pages still missing, where mincore tells. ``fd`` should read without read-ahead of its own
    (:func:`_no_readahead`): the byte reads then bring in no page beyond their own."""
    if not hasattr(os, "posix_fadvise"):
        return  # no advice (macOS): the readers read the block themselves
    low, end = start - start % PAGE, min(end, os.fstat(fd).st_size)
    missing = np.arange(max(0, -(-(end - low) // PAGE)))  # every page, the first time
    for _ in range(3):
        if not len(missing):
            return
        runs = np.split(missing, np.flatnonzero(np.diff(missing) != 1) + 1)
        per_step = READ_AHEAD_STEP // PAGE
        steps = [(int(run[i]), int(run[min(i + per_step, len(run)) - 1])) for run in runs
                 for i in range(0, len(run), per_step)]
        for first, last in steps:
            advise(fd, low + first * PAGE, low + (last + 1) * PAGE, "POSIX_FADV_WILLNEED")
        for _, last in steps:
            os.pread(fd, 1, low + last * PAGE)
        found = _cached_pages(fd, start, end)
        if found is None:
            return
        missing = np.flatnonzero(~found[1])


def drop(fd: int, start: int, end: int, tries: int = 3) -> None:
    """Advise bytes ``[start, end)`` of ``fd`` out of the page cache, again while some page stays (the kernel
    keeps a page another process is copying at that moment)."""
    for _ in range(tries):
        advise(fd, start, end, "POSIX_FADV_DONTNEED")
        found = _cached_pages(fd, start, end)
        if found is None or not found[1].any():
            return


def _no_readahead(fd: int) -> None:
    """Turn off the kernel's read-ahead on this open file (reads then bring in only the pages they touch)."""
    if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_RANDOM"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` at ``offset``: the bytes read (0 at the end of the file)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)


class UncachedSource(LocalSource):
    """A :class:`~packer.formats.layout.LocalSource` whose reads leave nothing in the page cache (a format
    reads the layout through it)."""

    def read(self, relpath: str, start: int, end: int) -> bytes:
        return bytes(read_uncached(self.root / relpath, max(0, start), end))


class LocalBlocks:
    """The block store over a local dataset folder within a page-cache budget. Picklable (it holds only the
    folder): each process (a DataLoader worker) opens the files itself.

    :meth:`open` reads a block into the calling process's memory (not a map) and drops it from the page cache:
    a reader keeps ``KEEP_BLOCKS`` blocks a process that way, in its own memory, outside the page cache's count.
    :meth:`hold` (the fetch-ahead thread) has the kernel read the block ahead; its release drops it.

    Args:
        root: the dataset folder.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __str__(self) -> str:
        return os.fspath(self.root)

    def open(self, relpath: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of ``relpath``, read into this process's memory; then dropped from the page
        cache (``POSIX_FADV_DONTNEED``)."""
        return memoryview(read_uncached(self.root / relpath, start, end))

    def reader_stuck(self) -> bool:
        """Never: no reader waits for room in this process's page-cache budget."""
        return False

    def hold(self, relpath: str, start: int, end: int, wait: bool = True) -> Callable[[], None] | None:
        """Have the kernel read the block into the page cache (:func:`read_ahead`: on a fetch thread, returning
        once it is there); the returned call drops it (:func:`drop`). Never None: the loader holds no more blocks
        than the budget was cut for."""
        path = self.root / relpath
        fd = os.open(path, os.O_RDONLY)
        try:
            _no_readahead(fd)  # the reads that wait for the read-ahead bring in no more than it does
            read_ahead(fd, start, end)
        finally:
            os.close(fd)

        def release() -> None:
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    drop(fd, start, end)
                finally:
                    os.close(fd)

        return release


class BlockedLocal(NamedTuple):
    """A local dataset read a block at a time: what :func:`open_local` hands ``open_blocked``."""

    url: str  # the folder, for messages
    manifest: dict
    view: Path  # the dataset folder itself (read only: its loader.json...)
    source: UncachedSource
    store: LocalBlocks
    limit: int  # page_budget, in bytes
    total: int  # the data files' bytes
    layouts: Path  # the folder the layout is cached in (the packer cache's, never the dataset's)

    @property
    def budget(self) -> str:
        """The argument that set ``limit``, for the said-once line."""
        return "page_budget"

    def layout_path(self, version: int) -> Path:
        """Where the layout is cached: keyed by the data files' identity (path, size, modification time, inode,
        manifest sha256), so a re-packed or replaced dataset gets its own."""
        root = Path(self.url).resolve()
        parts = [f"{version}", os.fspath(root)]
        for entry in self.manifest["files"]:
            st = os.stat(root / entry["path"])
            parts.append(f"{entry['path']}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{entry.get('sha256', '')}")
        digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
        return self.layouts / f"layout-{digest[:24]}.npz"


def layout_folder(cache_dir: str | os.PathLike | None) -> Path:
    """``CACHE/layouts`` (created), else a temporary folder where the cache folder cannot be written: where what
    packer derives from a local dataset's files is kept (layouts, an older LMDB dataset's index), never in the
    dataset's own folder."""
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "layouts"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    folder = Path(tempfile.gettempdir()) / f"packer-layouts-{os.getuid() if hasattr(os, 'getuid') else 0}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def open_local(root: str | os.PathLike, manifest: dict, page_budget: int,
               cache_dir: str | os.PathLike | None = None) -> BlockedLocal | None:
    """What ``open_blocked`` reads for the local dataset ``root`` (its ``manifest``) within ``page_budget``
    bytes of page cache; None when its data files fit the budget whole (the mapped readers keep them). A
    dataset converted in parts is read a block at a time like any other (its parts' layouts joined)."""
    total = sum(int(entry["bytes"]) for entry in manifest["files"])
    if total <= page_budget:
        return None
    return BlockedLocal(os.fspath(root), manifest, Path(root), UncachedSource(root), LocalBlocks(root), page_budget,
                        total, layout_folder(cache_dir))


def open_paged(root: str | os.PathLike, page_budget: int | str, cache_dir: str | os.PathLike | None = None
               ) -> Path | BlockedLocal:
    """``open_dataset``'s ``page_budget``: the folder ``root`` itself when its data files fit the budget, else
    its :class:`BlockedLocal`.

    Raises:
        UsageError: a bad budget, or ``root`` is no local folder (a URL's bound is ``cache_limit``), in one line.
    """
    budget = parse_page_budget(page_budget)
    assert budget is not None  # page_budget is not None
    if not Path(root).is_dir():
        raise UsageError(f"{root}: page_budget bounds the page cache of a local dataset folder and this is none; "
                         "for a URL, bound its local cache with cache_limit instead")
    return open_local(root, read_local_manifest(root), budget, cache_dir) or Path(root)

"""Byte ranges of a remote dataset's data files: what reading a dataset larger than the local cache a block at a
time moves (``open_dataset(URL, cache_limit=...)`` below the dataset's size).

- :class:`RemoteSource` reads ranges straight from storage (a format's layout: its headers and indexes), with
  retries, concurrently where asked (the ``RangeSource`` protocol of :mod:`packer.formats.layout`, duck-typed:
  nothing here imports a format);
- :class:`RemoteBlocks` is the block store a blocked reader opens its blocks from: a block is one range
  ``[start, end)`` of one data file, fetched with one ranged GET, checked against its length (a range that is
  the whole file against the file's sha256), and kept in the node's cache as an object of its own (pinned while
  read, evicted least recently used, shared by every process on the node like the cache's whole files).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from ..errors import RemoteError
from .cache import STUCK_AFTER, Cache, Pin, when_room
from .fetch import _cat, retrying
from .fs import filesystem
from .presigned import sign_ahead
from .resolve import FETCH_THREADS, fetch_file
from .url import RemoteUrl

# data files whose URLs a blocked dataset presigns as it is opened, before its DataLoader workers are forked: the
# opening process signs each file as it first reads it anyway, so this moves that work earlier rather than adding
# any; beyond this many, opening would wait on it longer than a worker takes to make an S3 client of its own
SIGN_AT_OPEN = 256


def range_name(sha256: str, start: int, end: int, size: int) -> str:
    """The cache name of bytes ``[start, end)`` of the file ``sha256`` (of ``size`` bytes): the file's own
    sha256 for the whole file (the cached file is shared with whole-file reading), else the sha256 of
    ``"SHA256:START:END"``."""
    if start == 0 and end == size:
        return sha256
    return hashlib.sha256(f"{sha256}:{start}:{end}".encode()).hexdigest()


def _write_over(target: Path, data: bytes) -> None:
    """Write ``data`` over the reserved file ``target``, already its length: plain writes to a descriptor, where a
    buffered file object adds a seek or a check of its own (a syscall each) to every block a fetch thread stores."""
    fd = os.open(target, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def fetch_range(cache: Cache, remote: RemoteUrl, entry: dict, start: int, end: int,
                storage_options: dict | None) -> Pin:
    """A pin on the cached copy of bytes ``[start, end)`` of the data file ``entry`` (a manifest ``files``
    entry): fetched by one ranged GET when it is not cached, its length checked (the whole file: its sha256).
    A child forked while it is held does not share the pin."""
    size = int(entry["bytes"])
    url = remote.join(entry["path"])
    if not 0 <= start < end <= size:
        raise RemoteError(f"{url}: bytes [{start}, {end}) lie outside its {size:,} bytes; the dataset's layout is "
                          "damaged: delete the cache folder's layout-*.npz and retry")
    if start == 0 and end == size:
        return fetch_file(cache, remote, entry, storage_options, inherited=False)

    def fetch(target: Path) -> None:
        fs = filesystem(remote.protocol, storage_options)
        for attempt in (1, 2):
            data = retrying(lambda: _cat(fs, url, start, end), url)
            if len(data) == end - start:
                break
            if attempt == 2:
                raise RemoteError(f"{url}: bytes [{start}, {end}) came back as {len(data):,} bytes (fetched twice); "
                                  "the remote object is shorter than its manifest says or was replaced: re-pack or "
                                  "re-upload the dataset")
        _write_over(target, data)

    return cache.obtain(range_name(entry["sha256"], start, end, size), end - start, fetch, inherited=False)


class RemoteSource:
    """Byte ranges of the data files of the dataset at ``remote`` (a ``RangeSource``): read from storage, not
    cached (a format reads its layout through it once; the layout is cached)."""

    def __init__(self, remote: RemoteUrl, manifest: dict, storage_options: dict | None = None,
                 threads: int = FETCH_THREADS):
        self.remote = remote
        self.entries = {e["path"]: e for e in manifest["files"]}
        self.storage_options = storage_options
        self.threads = threads

    def _entry(self, relpath: str) -> dict:
        entry = self.entries.get(relpath)
        if entry is None:
            raise RemoteError(f"{self.remote.url}: {relpath} is not a file its manifest lists; re-pack the dataset")
        return entry

    def read(self, relpath: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``relpath`` (fewer where the file ends first), one ranged GET."""
        size = int(self._entry(relpath)["bytes"])
        start, end = max(0, start), min(end, size)
        if end <= start:
            return b""
        url = self.remote.join(relpath)
        fs = filesystem(self.remote.protocol, self.storage_options)
        return retrying(lambda: _cat(fs, url, start, end), url)

    def read_many(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """:meth:`read` of each ``(relpath, start, end)``, on up to ``threads`` threads, in order."""
        if len(ranges) < 2:
            return [self.read(*r) for r in ranges]
        with ThreadPoolExecutor(min(self.threads, len(ranges)), thread_name_prefix="packer-range") as pool:
            return list(pool.map(lambda r: self.read(*r), ranges))

    def size(self, relpath: str) -> int:
        """The file's size, as the manifest records it."""
        return int(self._entry(relpath)["bytes"])


def _mapped(path: str | Path) -> memoryview:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)


class RemoteBlocks:
    """The block store over the dataset at ``remote``: :meth:`open` gives a block's bytes (fetched into the
    cache first when they are not there) and the call that releases its pin. Picklable: each process (a
    DataLoader worker) opens the cache and its filesystem itself.

    Args:
        remote: the dataset's URL.
        manifest: its manifest (every data file's size and sha256).
        storage_options: the fsspec filesystem's options.
        cache_dir, cache_limit: the node's cache, as :class:`~packer.remote.cache.Cache` takes them.
    """

    def __init__(self, remote: RemoteUrl, manifest: dict, storage_options: dict | None,
                 cache_dir: str | os.PathLike | None, cache_limit: int | str | None):
        self.remote = remote
        self.entries = {e["path"]: e for e in manifest["files"]}
        self.storage_options = storage_options
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.cache_limit = cache_limit
        self._cache: tuple[int, Cache] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": None}

    def sign_ahead(self) -> None:
        """Presign the data files' URLs in this process (:func:`~packer.remote.presigned.sign_ahead`) when there
        are at most ``SIGN_AT_OPEN`` of them; more are signed as they are first read."""
        if len(self.entries) <= SIGN_AT_OPEN:
            fs = filesystem(self.remote.protocol, self.storage_options)
            sign_ahead(fs, [self.remote.join(relpath) for relpath in self.entries])

    def __str__(self) -> str:
        return self.remote.url

    @property
    def cache(self) -> Cache:
        """This process's :class:`Cache` (made on first use)."""
        if self._cache is None or self._cache[0] != os.getpid():
            self._cache = (os.getpid(), Cache(self.cache_dir, self.cache_limit))
        return self._cache[1]

    def _pin(self, relpath: str, start: int, end: int, wait: bool) -> Pin | None:
        return when_room(lambda: fetch_range(self.cache, self.remote, self.entries[relpath], start, end,
                                             self.storage_options), wait)

    def hold(self, relpath: str, start: int, end: int, wait: bool = True) -> Callable[[], None] | None:
        """Fetch the block into the cache when it is not there, pin it, and return the pin's release. When the
        cache has no room (every object pinned): with ``wait``, retry until there is (a :class:`RemoteError`
        after ``WAIT_FOR_ROOM`` seconds); else None at once."""
        pin = self._pin(relpath, start, end, wait)
        return None if pin is None else pin.release

    def reader_stuck(self) -> bool:
        """Whether a reader of the node's cache (of any process) has waited for room in it for ``STUCK_AFTER``
        seconds or more."""
        cache = self.cache
        return cache.limit is not None and cache.others_wait(STUCK_AFTER)

    def open(self, relpath: str, start: int, end: int) -> memoryview:
        """Block ``[start, end)`` of ``relpath``, fetched first when it is not cached (waiting for room as
        :meth:`hold` does): a read-only map of the cached object. The map stays valid for as long as it is
        referenced, even once the object is evicted (cached objects never change, and one is only ever renamed
        into place whole), so a reader keeps a few blocks mapped without keeping them in the cache's count: what it
        holds beyond the cache is bounded by the blocks it keeps."""
        if end <= start:
            return memoryview(b"")
        entry = self.entries[relpath]
        with contextlib.suppress(FileNotFoundError):  # cached (by the fetch-ahead, mostly): mapped without a pin,
            return _mapped(self.cache.object_path(range_name(entry["sha256"], start, end, int(entry["bytes"]))))
        pin = self._pin(relpath, start, end, True)  # which keeps it from eviction only until it is mapped
        assert pin is not None  # waiting for room returns a pin or raises
        try:
            return _mapped(pin.path)
        except OSError as exc:
            raise RemoteError(f"{pin.path}: cannot read a cached block ({exc.strerror or exc}); check the cache "
                              "folder") from None
        finally:
            pin.release()


class BlockedRemote(NamedTuple):
    """A dataset URL read a block at a time: what :func:`packer.remote.entry.open_remote` hands the entry point."""

    url: str
    manifest: dict
    view: Path  # the cache's folder for this URL: the layout is cached there
    source: RemoteSource
    store: RemoteBlocks
    limit: int  # the cache's bound, in bytes
    total: int  # the data files' bytes

    def layout_path(self, version: int) -> Path:
        """Where the layout of this dataset's files (their sha256s) at layout ``version`` is cached."""
        digest = hashlib.sha256(f"{version}:".encode()
                                + ",".join(e["sha256"] for e in self.manifest["files"]).encode()).hexdigest()
        return self.view / f"layout-{digest[:16]}.npz"

"""The local cache of remote data files, shared safely by every process on a node.

Layout under the cache folder (``cache_dir``, else ``PACKER_CACHE_DIR``, else ``~/.cache/packer``; its bound is
``cache_limit``, else ``PACKER_CACHE_LIMIT``, else none)::

    objects/<sha256>         data files, named by their content's sha256, and ranges of them (blocks, see
                             :mod:`.ranges`), named by the sha256 of ``"FILE_SHA256:START:END"``; each checked
                             (whole files against their sha256, ranges against their length) before it was
                             renamed here; one folder, since a block read makes an object and evicts another:
                             prefix folders (``objects/ab/<sha256>``, the layout before; still counted and
                             evicted, never read) cost a folder made and removed per block and one scanned per
                             object at every fetch
    tmp/                     downloads in progress, under temporary names (renamed into objects/ when checked)
    locks/<sha256>.lock      one per object being fetched: the process holding it is the only one fetching
                             that object; removed by that process as it lets go (a crashed fetcher's stays,
                             empty, and is reused)
    views/s3/bucket/ds-<hash> one per URL: its manifest.json and links to the objects, a folder the readers open

A process that uses an object holds a shared ``flock`` on it (a :class:`Pin`); eviction (least recently used
first, by access time, which a pin sets; the modification time stays that of the download, because a reader
that noted a file's identity (:mod:`packer.formats.identity`) refuses a file whose mtime moved, and another
process pinning the same object must not look like a repack) takes an exclusive, non-blocking lock before it deletes, so
it never removes a file another process has open, and it only ever deletes regular files inside ``objects/``
and abandoned downloads inside ``tmp/``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import re
import stat
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

from ..arguments import parse_bytes
from ..errors import RemoteError, UsageError
from ..system import default_cache_dir, file_is_at, is_folder, is_regular_file, lock_file, unlock_file

_SHA = re.compile(r"[0-9a-f]{64}")


def _touch(path: Path) -> None:
    """Set the LRU clock (the access time) of a cached object; its modification time is left as it was."""
    os.utime(path, ns=(time.time_ns(), os.stat(path, follow_symlinks=False).st_mtime_ns))


def parse_limit(limit: int | str | None) -> int | None:
    """``cache_limit`` in bytes: an int, or a string such as ``"10GB"`` or ``"512MiB"``; None: unbounded."""
    try:
        return parse_bytes(limit)
    except ValueError as exc:
        raise UsageError(f"cache_limit: {exc}") from None


class CacheFull(RemoteError):
    """No room for an object within ``cache_limit``: what is cached is pinned by readers or downloads.
    ``cache`` is the cache, ``seen`` a token of what it held (it changes as objects come and go)."""

    def __init__(self, message: str, cache: Cache | None = None, seen: int = 0):
        super().__init__(message)
        self.cache, self.seen = cache, seen

    def __reduce__(self):  # crosses to a DataLoader's main process as its message
        return CacheFull, (str(self),)


WAIT_FOR_ROOM = 120.0  # seconds a reader waits for room in a full cache where nothing comes or goes
# seconds a reader waits for room before the blocks fetched ahead of need let go (packer.loading.fetchahead): room
# normally comes within a batch or two as the readers' batches go by; a wait this long means the holders wait too
STUCK_AFTER = 2.0
_OPPORTUNISTIC = contextvars.ContextVar("packer_cache_opportunistic", default=False)


def when_room(obtain: Callable[[], Pin], wait: bool = True) -> Pin | None:
    """``obtain()`` when the cache has room for it (see :class:`Cache`: the rule readers that share a cache
    follow). Without ``wait`` (a fetch ahead of need): None at once when it has none, or when another reader
    waits for room. With ``wait`` (a block or file a reader needs now): marked as waiting in the cache, so that
    fetches ahead of need make way, and retried as others let go, for as long as what the cache holds changes;
    the :class:`CacheFull` once nothing has come or gone for ``WAIT_FOR_ROOM`` seconds (a holder that is stuck)."""
    if not wait:
        token = _OPPORTUNISTIC.set(True)
        try:
            return obtain()
        except CacheFull:
            return None
        finally:
            _OPPORTUNISTIC.reset(token)
    deadline, seen = time.monotonic() + WAIT_FOR_ROOM, None
    with contextlib.ExitStack() as waiting:
        while True:
            try:
                return obtain()
            except CacheFull as exc:
                if exc.cache is not None and seen is None:
                    waiting.enter_context(exc.cache.waiting())
                if exc.seen != seen:  # others made progress: keep waiting
                    deadline, seen = time.monotonic() + WAIT_FOR_ROOM, exc.seen
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


# Descriptors a forked child closes at once: the cache's locks a thread holds while it fetches (a child that kept
# one would hold the lock for its whole life: every process on the node would wait for it) and the pins of blocks
# (a persistent DataLoader worker would keep them from being evicted). fd -> the pid that opened it.
_NOT_INHERITED: dict[int, int] = {}


_OPENING = threading.Lock()  # a cache's eviction-lock descriptor is opened once per process


def _close_inherited() -> None:
    global _OPENING
    _OPENING = threading.Lock()
    for fd in list(_NOT_INHERITED):
        with contextlib.suppress(OSError):
            os.close(fd)
    _NOT_INHERITED.clear()


os.register_at_fork(after_in_child=_close_inherited)


def _open(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """``os.open``, the descriptor closed in a child forked while it is open (see :func:`_close`)."""
    fd = os.open(path, flags, mode)
    _NOT_INHERITED[fd] = os.getpid()
    return fd


def _close(fd: int) -> None:
    if _NOT_INHERITED.pop(fd, None) not in (None, os.getpid()):
        return  # a forked child's copy, closed when it started
    os.close(fd)


def _close_own(pid: int, fd: int) -> None:
    """Close ``fd`` in process ``pid`` only: a forked child closed its copy as it started, and its number may
    since belong to another file (a DataLoader worker's socket, which a second close would break)."""
    if os.getpid() == pid:
        _close(fd)


class Pin:
    """A shared lock on one cached object, held while a reader may use it; eviction skips it. With ``inherited``
    a forked child shares it (a resolved dataset's files, read by its DataLoader workers); without, a child
    forked while it is held closes its copy at once (a block, held by the process that fetched it ahead).
    :meth:`release` (or the process's exit) lets the object be evicted again."""

    def __init__(self, path: Path, fd: int, inherited: bool = True):
        self.path = path
        self._fd: int | None = fd
        self._pid, self._inherited = os.getpid(), inherited
        if inherited:
            _NOT_INHERITED.pop(fd, None)

    def release(self) -> None:
        if self._fd is not None:
            if self._inherited or self._pid == os.getpid():  # else a forked child's copy, closed as it started
                _close(self._fd)
            self._fd = None


class Cache:
    """A cache folder with an optional size bound (``limit`` in bytes or ``"10GB"``). Its objects are whole data
    files or byte ranges of them: both are regular files under ``objects/``, pinned, counted and evicted alike."""

    def __init__(self, root: str | os.PathLike | None = None, limit: int | str | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.limit = parse_limit(limit if limit is not None else os.environ.get("PACKER_CACHE_LIMIT"))
        try:
            for sub in ("objects", "tmp", "locks", "views", "waiting"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            # a read-only mount says so now; the probe is made beside the folders, where no eviction scans
            # (tmp/'s files are downloads, which another process's eviction may delete the moment they appear)
            fd, probe = tempfile.mkstemp(prefix=".writable-", dir=self.root)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise RemoteError(f"{self.root}: cannot write the cache folder ({exc.strerror or exc}); set "
                              "PACKER_CACHE_DIR or pass cache_dir to a writable folder") from None
        # the folders as strings, from the resolved root: every fetch scans and names files in them
        real = os.path.realpath(self.root)
        self._objects, self._tmp, self._locks, self._waiting = (os.path.join(real, sub) for sub in
                                                                ("objects", "tmp", "locks", "waiting"))
        self._eviction: tuple[int, int, threading.Lock] | None = None  # (pid, evict.lock's fd, a thread lock)

    def object_path(self, sha256: str) -> Path:
        if not _SHA.fullmatch(sha256):
            raise ValueError(f"not a sha256: {sha256!r}")
        return Path(f"{self._objects}/{sha256}")

    def view(self, url: str) -> Path:
        """The folder holding ``url``'s manifest and links to its cached files: ``views/s3/bucket/ds-<hash>``,
        readable in the messages of the readers that open it, and unique to the URL."""
        digest = hashlib.sha256(url.encode()).hexdigest()[:12]
        parts = [re.sub(r"[^A-Za-z0-9._-]+", "_", p) for p in re.split(r":/+|/", url) if p.strip(".")][:8]
        parts = [p[:60] for p in parts] or ["dataset"]
        parts[-1] = f"{parts[-1]}-{digest}"
        return self.root.joinpath("views", *parts)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark this thread as waiting for room (a locked file in ``waiting/``) until the block ends: fetches
        ahead of need, in any process, make no room for themselves meanwhile (:func:`when_room`)."""
        path = f"{self._waiting}/{os.getpid()}.{uuid.uuid4().hex[:8]}"
        while True:  # a scan may take a file not yet locked for a dead waiter's, and remove it: make it anew
            fd = _open(path, os.O_RDWR | os.O_CREAT)
            lock_file(fd)
            if file_is_at(fd, path):
                break
            _close(fd)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
            _close(fd)

    def others_wait(self, waited: float = 0.0) -> bool:
        """Whether a reader (of any process) waits for room, and has for ``waited`` seconds at least: a file in
        ``waiting/`` (made as it began waiting) whose lock is held (one whose holder died is free, and removed)."""
        began_before = time.time() - waited
        with contextlib.suppress(OSError), os.scandir(self._waiting) as found:
            for entry in found:
                if waited:
                    with contextlib.suppress(OSError):
                        if entry.stat(follow_symlinks=False).st_mtime > began_before:
                            continue
                try:
                    fd = _open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue
                try:
                    if not lock_file(fd, exclusive=False, blocking=False):
                        return True
                    with contextlib.suppress(OSError):  # a waiter that died: its file goes
                        os.unlink(entry.path)
                finally:
                    _close(fd)
        return False

    def pin(self, sha256: str, inherited: bool = True) -> Pin | None:
        """A :class:`Pin` on the cached object, or None when it is not cached."""
        path = self.object_path(sha256)
        try:
            fd = _open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            lock_file(fd, exclusive=False)
            # evicted between the open and the lock: the name no longer leads to the file this fd holds
            if not file_is_at(fd, path):
                raise FileNotFoundError(path)
            _touch(path)
        except OSError:
            _close(fd)
            return None
        return Pin(path, fd, inherited)

    @contextlib.contextmanager
    def _locked(self, path: str) -> Iterator[None]:
        """Hold the lock file ``path``, and remove it as it is let go (a cache read for weeks would otherwise
        keep one per object it ever fetched). A waiter whose lock file was removed while it waited holds a lock
        on a file no longer at ``path``: it tries again, on the file there (made anew by whoever came next)."""
        while True:
            fd = _open(path, os.O_RDWR | os.O_CREAT)
            try:
                lock_file(fd)
                if file_is_at(fd, path):
                    break
            except BaseException:  # never keep a lock others wait on while the error goes up
                _close(fd)
                raise
            _close(fd)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # gone already, or a system that cannot remove an open file
                os.unlink(path)
            _close(fd)

    @contextlib.contextmanager
    def _eviction_locked(self) -> Iterator[None]:
        """The node's eviction lock (``evict.lock``), held by one thread of one process at a time: its file is
        opened once per process (a flock does not exclude the threads that share a descriptor: a thread lock
        does) and closed with this object."""
        with _OPENING:
            held = self._eviction
            if held is None or held[0] != os.getpid():  # none yet, or a forked child's copy (closed at fork)
                fd = _open(self.root / "evict.lock", os.O_RDWR | os.O_CREAT)
                held = self._eviction = (os.getpid(), fd, threading.Lock())
                weakref.finalize(self, _close_own, os.getpid(), fd)
        _, fd, lock = held
        with lock:
            lock_file(fd)
            try:
                yield
            finally:
                unlock_file(fd)

    def obtain(self, sha256: str, size: int, fetch: Callable[[Path], None], inherited: bool = True) -> Pin:
        """A pin on the object ``sha256``, fetched first when it is not cached: by one process at a time (the
        others wait, then find it), into a reserved temporary file that ``fetch(path)`` fills and checks, then
        renamed into place. ``inherited``: whether a forked child shares the pin (:class:`Pin`)."""
        pin = self.pin(sha256, inherited)
        if pin is not None:
            return pin
        with self._locked(f"{self._locks}/{sha256}.lock"):
            pin = self.pin(sha256, inherited)
            if pin is not None:
                return pin
            tmp = Path(f"{self._tmp}/{sha256}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
            fd = self._reserve(tmp, size)
            try:
                fetch(tmp)
                path = self.object_path(sha256)
                with self._eviction_locked():  # a scan (under this lock) sees the reservation or the object, once
                    os.replace(tmp, path)
                    # the reservation's lock becomes the pin, under this lock: flock converts a lock by dropping
                    # it first, and an eviction in that gap would delete the object just fetched
                    lock_file(fd, exclusive=False)
                _touch(path)
                return Pin(path, fd, inherited)
            except BaseException:
                _close(fd)
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                raise

    def _reserve(self, tmp: Path, size: int) -> int:
        """Make room for ``size`` bytes and reserve them with a locked temporary file of that size, so that
        downloads running at once in several processes together stay within the limit."""
        with self._eviction_locked():
            if self.limit is not None:
                self._make_room(size)
            fd = _open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            lock_file(fd)  # an abandoned download is one whose lock is free
            os.ftruncate(fd, size)
        return fd

    def entries(self) -> list[tuple[float, int, str]]:
        """``(last use, bytes, path)`` of every cached object and download in progress (and of the objects an
        older layout keeps in prefix folders). Scanned with ``os.scandir`` (a directory's entries say what they
        are without a stat each): every fetch that needs room scans the whole cache, under the eviction lock."""
        found: list[tuple[float, int, str]] = []
        folders = [self._objects, self._tmp]
        while folders:
            with contextlib.suppress(OSError), os.scandir(folders.pop()) as files:
                for entry in files:
                    with contextlib.suppress(OSError):
                        if entry.is_dir(follow_symlinks=False):
                            if os.path.dirname(entry.path) == self._objects:  # an older layout's prefix folder
                                folders.append(entry.path)
                            continue
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            found.append((st.st_atime, st.st_size, entry.path))
        return found

    def used(self) -> int:
        """Bytes the cache holds (objects and reserved downloads)."""
        return sum(size for _, size, _ in self.entries())

    def _make_room(self, size: int) -> None:
        assert self.limit is not None  # called only for a bounded cache
        if size > self.limit:  # no eviction can make room: not worth waiting for (not a CacheFull)
            raise RemoteError(f"{self.root}: cannot fit an object of {size:,} bytes within cache_limit "
                              f"{self.limit:,}; raise cache_limit above the dataset's largest file")
        entries = sorted(self.entries())
        total = sum(s for _, s, _ in entries)
        seen = hash(frozenset(path for _, _, path in entries))
        if _OPPORTUNISTIC.get() and total + size > self.limit and self.others_wait():
            raise CacheFull(f"{self.root}: a reader waits for room", self, seen)  # a fetch ahead makes way
        for _, bytes_, path in entries:
            if total + size <= self.limit:
                return
            if self._evict(path):
                total -= bytes_
        if total + size > self.limit:
            raise CacheFull(f"{self.root}: cannot fit {size:,} more bytes within cache_limit {self.limit:,}: "
                            f"{total:,} bytes are in use by open datasets or downloads, and none came or went for "
                            f"{WAIT_FOR_ROOM:.0f} s; raise cache_limit, or read with packer.stream, which holds one "
                            "shard per worker", self, seen)

    def _evict(self, path: str) -> bool:
        """Delete one object (or abandoned download) that no process holds; False when one does."""
        parent = os.path.dirname(path)
        in_prefix = os.path.dirname(parent) == self._objects and is_folder(parent)  # not a link to elsewhere
        in_objects = parent == self._objects or in_prefix
        ours = parent == self._tmp or (in_objects and _SHA.fullmatch(os.path.basename(path)))
        if not (is_regular_file(path) and ours):
            return False  # only objects (in objects/, or an older layout's objects/ab/) and downloads in tmp/
        try:
            fd = _open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            locked = lock_file(fd, blocking=False)
        except OSError:
            locked = False
        if not locked:
            _close(fd)
            return False
        try:
            if file_is_at(fd, path):
                os.unlink(path)
                if in_prefix:  # an older layout's emptied prefix folder goes too (under the eviction lock)
                    with contextlib.suppress(OSError):
                        os.rmdir(parent)
                return True
            return False
        except OSError:
            return False
        finally:
            _close(fd)

"""The one resolve step the public entry points take for a URL (through :func:`packer.remote.entry.local_dataset`): a
dataset URL becomes a local folder of checked files, handed down to readers that never see the URL.

The manifest is fetched, then every data file its ``files`` list names (whatever the format: LMDB, HDF5,
shards and their index, the parts of a distributed conversion) is fetched whole into the cache, checked against
its size and sha256, and linked into a per-URL folder beside the manifest. The existing readers then open that
folder as a local dataset. :func:`remote_files` instead gives one :class:`RemoteFile` per data file, fetched when
it is read (``packer.stream``). The files of a resolved folder stay pinned (never evicted) for the life of the
process that resolved them, and of its forked DataLoader workers."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ManifestError, RemoteError, UrlError
from ..manifest import MANIFEST, max_manifest_bytes, parse_manifest
from .cache import Cache, Pin, when_room
from .fetch import download, read_bytes
from .fs import filesystem
from .url import READ_ONLY, RemoteUrl, remote_url

FETCH_THREADS = 8
_HELD: dict[Path, list[Pin]] = {}  # view -> the pins that keep its files cached while this process reads them
_HELD_LOCK = threading.Lock()


def remote_manifest(remote: RemoteUrl, storage_options: dict | None = None) -> tuple[dict, bytes]:
    """The parsed manifest at ``remote`` and its bytes; every data file must have a sha256."""
    url = remote.join(MANIFEST)
    fs = filesystem(remote.protocol, storage_options)
    try:
        text = read_bytes(fs, url, max_manifest_bytes())
    except UrlError as exc:
        if "not found" not in str(exc):
            raise
        if remote.protocol in READ_ONLY:  # packer cannot pack to it: there is nothing to resume either
            raise UrlError(f"{remote.url}: no packed dataset here (no {MANIFEST}); check the URL") from None
        raise UrlError(f"{remote.url}: no packed dataset here (no {MANIFEST}); pack one with `packer pack SRC "
                       f"{remote.url}`, or finish an interrupted upload with --resume") from None
    manifest = parse_manifest(text, url)
    for entry in manifest["files"]:
        if not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64:
            raise ManifestError(f"{url}: {entry['path']} has no sha256, which reading from a URL checks; re-pack "
                                "the dataset with this packer")
    return manifest, text


def read_remote_manifest(url: str, storage_options: dict | None = None) -> dict:
    """The manifest of the dataset at ``url`` (nothing else is fetched)."""
    return remote_manifest(remote_url(url), storage_options)[0]


def _link(view: Path, relpath: str, target: Path) -> None:
    """``view/relpath`` -> ``target``, replaced atomically (another process may be making the same link)."""
    link = view / relpath
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if os.readlink(link) == str(target):
            return
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}.link")
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _write_manifest(view: Path, text: bytes) -> None:
    tmp = view / f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
    tmp.write_bytes(text)
    os.replace(tmp, view / MANIFEST)


def fetch_file(cache: Cache, remote: RemoteUrl, entry: dict, storage_options: dict | None,
               inherited: bool = True) -> Pin:
    """A pin on the cached, checked copy of the data file ``entry`` (a manifest ``files`` entry); ``inherited``:
    whether a forked child shares it."""
    url = remote.join(entry["path"])

    def fetch(target: Path) -> None:
        download(filesystem(remote.protocol, storage_options), url, target, entry["bytes"], entry["sha256"])

    return cache.obtain(entry["sha256"], entry["bytes"], fetch, inherited)


def resolve(url: str, storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
            cache_limit: int | str | None = None, damaged: list[str] | None = None) -> Path:
    """Fetch the dataset at ``url`` into the cache and return the local folder that holds it.

    Args:
        url: the dataset's URL (``s3://bucket/ds``, ``https://host/ds``...).
        storage_options: passed to the fsspec filesystem (S3 settings also come from ``AWS_*`` variables).
        cache_dir: the cache folder (default ``PACKER_CACHE_DIR``, else ``~/.cache/packer``).
        cache_limit: bytes (or ``"10GB"``) the cache may hold; it must fit the whole dataset.
        damaged: when given, a file that fails its checks is listed here (one line each) instead of raised.

    Returns:
        the folder (``manifest.json`` and links to the cached files) the local readers open.
    """
    remote = remote_url(url)
    return resolve_fetched(remote, *remote_manifest(remote, storage_options), storage_options,
                           Cache(cache_dir, cache_limit), damaged)


def resolve_fetched(remote: RemoteUrl, manifest: dict, text: bytes, storage_options: dict | None, cache: Cache,
                    damaged: list[str] | None = None) -> Path:
    """:func:`resolve` of a dataset whose manifest (parsed, and its bytes) was fetched already."""
    total = sum(entry["bytes"] for entry in manifest["files"])
    if cache.limit is not None and total > cache.limit:
        raise RemoteError(f"{remote.url}: the dataset is {total:,} bytes, over cache_limit {cache.limit:,}; random "
                          "access keeps every file cached: raise cache_limit, or read it with packer.stream")
    view = cache.view(remote.url)
    view.mkdir(parents=True, exist_ok=True)

    def fetch_entry(entry: dict) -> Pin | None:
        try:
            pin = when_room(lambda: fetch_file(cache, remote, entry, storage_options))
            assert pin is not None  # waited for room
        except RemoteError as exc:
            if damaged is None:
                raise
            damaged.append(str(exc))
            return None
        _link(view, entry["path"], pin.path)
        return pin

    with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="packer-fetch") as pool:
        futures = [pool.submit(fetch_entry, entry) for entry in manifest["files"]]
        pins = []
        try:
            for future in futures:
                pin = future.result()
                if pin is not None:
                    pins.append(pin)
        except BaseException:
            for future in futures:
                with contextlib.suppress(BaseException):
                    if (pin := future.result()) is not None:
                        pin.release()
            raise
    _write_manifest(view, text)  # last: the folder is a dataset once every file it names is in place
    with _HELD_LOCK:
        for old in _HELD.pop(view, []):
            old.release()
        _HELD[view] = pins
    return view


def release(view: Path) -> None:
    """Let the files of a resolved ``view`` be evicted again (datasets opened from it must not be read after)."""
    with _HELD_LOCK:
        for pin in _HELD.pop(view, []):
            pin.release()


class RemoteFile:
    """One data file of a remote dataset (a :class:`packer.loading.stream.Fetchable`), fetched into the cache when
    :meth:`local` is entered and released (evictable) when it is left, or with ``cached=False`` into a temporary
    file deleted when it is left; picklable, so a DataLoader worker fetches with its own filesystem."""

    def __init__(self, remote: RemoteUrl, entry: dict, storage_options: dict | None, cache_dir: str | None,
                 cache_limit: int | str | None, cached: bool = True):
        self.remote, self.entry, self.cached = remote, entry, cached
        self.storage_options, self.cache_dir, self.cache_limit = storage_options, cache_dir, cache_limit

    @property
    def url(self) -> str:
        return self.remote.join(self.entry["path"])

    def __str__(self) -> str:
        return self.url

    @contextlib.contextmanager
    def local(self) -> Iterator[Path]:
        if not self.cached:
            with tempfile.NamedTemporaryFile(prefix="packer-", suffix=".part") as tmp:
                fs = filesystem(self.remote.protocol, self.storage_options)
                download(fs, self.url, Path(tmp.name), self.entry["bytes"], self.entry["sha256"])
                yield Path(tmp.name)
            return
        cache = Cache(self.cache_dir, self.cache_limit)
        pin = when_room(lambda: fetch_file(cache, self.remote, self.entry, self.storage_options))
        assert pin is not None  # waited for room
        try:
            yield pin.path
        finally:
            pin.release()


def remote_files(url: str, storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, cached: bool = True) -> tuple[dict, dict[str, RemoteFile]]:
    """The manifest at ``url`` and a :class:`RemoteFile` for each of its data files, by relative path."""
    remote = remote_url(url)
    manifest, _ = remote_manifest(remote, storage_options)
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
    return manifest, {e["path"]: RemoteFile(remote, e, storage_options, cache_dir, cache_limit, cached)
                      for e in manifest["files"]}


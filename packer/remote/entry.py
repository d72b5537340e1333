"""What the public entry points call with a dataset path that may be a URL: :func:`local_dataset` (a local folder
for it, fetched into the cache), :func:`open_remote` (or blocks, for a URL larger than the cache) and
:func:`read_manifest`. Imported by the entry points when they are called, so that ``import packer`` and the CLI's
start load none of the fetching machinery."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import manifest
from .cache import Cache
from .ranges import BlockedRemote, RemoteBlocks, RemoteSource
from .resolve import read_remote_manifest, remote_manifest, resolve, resolve_fetched
from .url import parse_url

__all__ = ["local_dataset", "open_remote", "read_manifest"]


def read_manifest(dest: str | os.PathLike, storage_options: dict | None = None) -> dict:
    """The manifest of the packed dataset at ``dest``: ``DEST/manifest.json`` of a folder, or of a URL (then only
    the manifest is fetched). This is ``packer.read_manifest``.

    Args:
        dest: the dataset folder, or its URL (``s3://bucket/ds``, ``gs://...``, ``https://...``).
        storage_options: for a URL, the fsspec filesystem's options.

    Returns:
        The manifest, as a dict.
    """
    if parse_url(dest) is None:
        return manifest.read_local_manifest(dest)
    return read_remote_manifest(os.fspath(dest), storage_options)


def local_dataset(path: str | os.PathLike | Any, storage_options: dict | None = None,
                  cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None) -> Any:
    """``path`` itself unless it is a URL; for a URL, the local folder its packed dataset was fetched into (every
    file checked, and kept cached while this process runs; see :func:`packer.remote.resolve.resolve`). What is
    not a path (a ``datasets.Dataset``...) is returned as it is.

    Args:
        path: a folder, a URL, or any other conversion source.
        storage_options: for a URL, the fsspec filesystem's options (credentials, endpoint).
        cache_dir: for a URL, the cache folder (default ``PACKER_CACHE_DIR``, else ``~/.cache/packer``).
        cache_limit: for a URL, the most bytes the cache keeps (an int or ``"10GB"``).

    Raises:
        UrlError: ``path`` is a URL that cannot be understood (see :func:`packer.remote.url.parse_url`).
    """
    if not isinstance(path, (str, os.PathLike)) or parse_url(path) is None:
        return path
    return Path(resolve(os.fspath(path), storage_options, cache_dir, cache_limit))


def open_remote(path: str | os.PathLike | Any, storage_options: dict | None = None,
                cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None) -> Any:
    """As :func:`local_dataset`, except for a URL whose data files are larger than ``cache_limit``: then a
    :class:`~packer.remote.ranges.BlockedRemote` (the manifest, a range source for the format's layout and a
    block store), which ``open_dataset`` reads a block at a time (a dataset converted in parts too: its parts'
    layouts are joined)."""
    if not isinstance(path, (str, os.PathLike)) or parse_url(path) is None:
        return path
    remote = parse_url(path)
    assert remote is not None  # a URL: checked above
    cache = Cache(cache_dir, cache_limit)
    manifest, text = remote_manifest(remote, storage_options)
    total = sum(int(entry["bytes"]) for entry in manifest["files"])
    if cache.limit is None or total <= cache.limit:
        return Path(resolve_fetched(remote, manifest, text, storage_options, cache))
    view = cache.view(remote.url)
    view.mkdir(parents=True, exist_ok=True)
    store = RemoteBlocks(remote, manifest, storage_options, cache_dir, cache.limit)
    store.sign_ahead()  # here, before a loader forks its workers: they read with these URLs
    return BlockedRemote(remote.url, manifest, view, RemoteSource(remote, manifest, storage_options), store,
                         cache.limit, total)

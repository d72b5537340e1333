"""Packed datasets on object storage and HTTP: moving bytes only (URLs, fsspec filesystems, a bounded shared
cache, retries). Nothing here runs a conversion, a check or a benchmark, and nothing imports a format: the public
entry points (``pack``, ``open_dataset``, ``export``, ``to_hf``, ``verify``, ``stream``, the CLI) resolve a URL
through this package and hand local folders (or :class:`packer.loading.stream.Fetchable` files) down.

- :mod:`.url` tells URLs from local paths (and refuses mangled ones);
- :mod:`.fs` makes fsspec filesystems per process and turns storage errors into one line;
- :mod:`.fetch` reads with retries and checks size and sha256;
- :mod:`.cache` is the local cache (LRU, locks, pins);
- :mod:`.resolve` turns a dataset URL into a local folder the readers open, or into one fetchable file per
  data file (for ``stream``);
- :mod:`.ranges` reads byte ranges of the data files, and keeps blocks (ranges) of them in the cache, for a
  dataset larger than the cache (:func:`open_remote`).

Uploading a conversion is :mod:`packer.packing.upload`'s, ``packer verify URL`` is :mod:`packer.verify`'s, ``packer
bench URL`` is :mod:`packer.bench.remote`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .url import is_url, parse_url

__all__ = ["is_url", "local_dataset", "open_remote", "parse_url", "read_manifest"]


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
        from .. import manifest

        return manifest.read_local_manifest(dest)
    from .resolve import read_remote_manifest

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
    from .resolve import resolve

    return Path(resolve(os.fspath(path), storage_options, cache_dir, cache_limit))


def open_remote(path: str | os.PathLike | Any, storage_options: dict | None = None,
                cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None) -> Any:
    """As :func:`local_dataset`, except for a URL whose data files are larger than ``cache_limit``: then a
    :class:`~packer.remote.ranges.BlockedRemote` (the manifest, a range source for the format's layout and a
    block store), which ``open_dataset`` reads a block at a time (a dataset converted in parts too: its parts'
    layouts are joined)."""
    if not isinstance(path, (str, os.PathLike)) or parse_url(path) is None:
        return path
    from .cache import Cache
    from .ranges import BlockedRemote, RemoteBlocks, RemoteSource
    from .resolve import remote_manifest, resolve_fetched

    remote = parse_url(path)
    assert remote is not None  # a URL: checked above
    cache = Cache(cache_dir, cache_limit)
    manifest, text = remote_manifest(remote, storage_options)
    total = sum(int(entry["bytes"]) for entry in manifest["files"])
    if cache.limit is None or total <= cache.limit:
        return Path(resolve_fetched(remote, manifest, text, storage_options, cache))
    view = cache.view(remote.url)
    view.mkdir(parents=True, exist_ok=True)
    return BlockedRemote(remote.url, manifest, view, RemoteSource(remote, manifest, storage_options),
                         RemoteBlocks(remote, manifest, storage_options, cache_dir, cache.limit), cache.limit, total)

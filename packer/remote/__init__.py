"""Packed datasets on object storage and HTTP: URLs, fsspec filesystems, a bounded shared cache, retries.

- :mod:`.url` tells URLs from local paths (and refuses mangled ones);
- :mod:`.fs` makes fsspec filesystems per process and turns storage errors into one line;
- :mod:`.fetch` reads with retries and checks size and sha256;
- :mod:`.cache` is the local cache (LRU, locks, pins);
- :mod:`.resolve` turns a dataset URL into a local folder the readers open;
- :mod:`.check` is ``packer verify`` for a URL.
"""

from __future__ import annotations

import os

from .url import is_url, parse_url

__all__ = ["is_url", "parse_url", "read_manifest"]


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

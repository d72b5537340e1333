"""The format registry: one module per format, each with its writer and reader side by side."""

from __future__ import annotations

import os

from ..errors import ManifestError
from ..manifest import MANIFEST, read_manifest
from ..remote.resolve import local_dataset
from .base import PackedDataset, Writer, format_names, get_format, register

__all__ = ["PackedDataset", "Writer", "format_names", "get_format", "open_dataset", "register"]


def open_dataset(root: str | os.PathLike, storage_options: dict | None = None,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 **kwargs) -> PackedDataset:
    """Read ``root/manifest.json`` and return the matching Dataset (``LmdbDataset``, ``Hdf5Dataset`` or
    ``WdsDataset``, or a ``PartedDataset`` over them for a conversion made by several ranks); keyword arguments
    go to its constructor (``transform``, ``resize``, ``center_crop``...).

    ``root`` may be a URL (``s3://bucket/ds``, ``gs://...``, ``https://...``): its files are fetched into the
    cache (``cache_dir``, bounded by ``cache_limit``, bytes or ``"10GB"``), checked, and read from there;
    ``storage_options`` go to the fsspec filesystem. See :mod:`packer.remote`."""
    root = local_dataset(root, storage_options, cache_dir, cache_limit)
    manifest = read_manifest(root)
    try:
        _, reader = get_format(manifest["format"])
    except ValueError as exc:
        raise ManifestError(f"{os.path.join(root, MANIFEST)}: {exc}") from None
    if manifest.get("parts") is not None:  # converted by several ranks: one reader per part
        from .parts import PartedDataset

        return PartedDataset(root, manifest=manifest, **kwargs)
    return reader(root, manifest=manifest, **kwargs)

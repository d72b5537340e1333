"""The format registry: one module per format, each with its writer and reader side by side."""

from __future__ import annotations

import os

from ..manifest import read_manifest
from .base import PackedDataset, Writer, format_names, get_format, register

__all__ = ["PackedDataset", "Writer", "format_names", "get_format", "open_dataset", "register"]


def open_dataset(root: str | os.PathLike, **kwargs) -> PackedDataset:
    """Read ``root/manifest.json`` and return the matching Dataset (``LmdbDataset``, ``Hdf5Dataset`` or
    ``WdsDataset``); keyword arguments go to its constructor (``transform``, ``resize``, ``center_crop``...)."""
    manifest = read_manifest(root)
    _, reader = get_format(manifest["format"])
    return reader(root, manifest=manifest, **kwargs)

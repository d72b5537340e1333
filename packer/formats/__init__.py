"""The formats: one folder each (``lmdb/``, ``hdf5/``, ``wds/``) with its writer and reader side by side behind the
interface of :mod:`.base`, this registry, and reading any of them a block at a time (:mod:`.blocked`).

Importing this package imports every format, which registers itself (:func:`register`); the order here is the
order of :func:`format_names`. Nothing here imports torch: the torch Datasets over these readers are in
:mod:`packer.reading.dataset`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ManifestError
from ..manifest import MANIFEST, read_local_manifest
from .base import Reader, Sample, StreamSample, Writer, format_names, get_format, readers, register, writer_files

# isort: off
# importing a format module registers it: this order is format_names()'s, the first the default
from . import lmdb  # noqa: F401
from . import hdf5  # noqa: F401
from . import wds  # noqa: F401
# isort: on
from .blocked import BlockedReader, open_blocked
from .local_blocks import open_paged
from .parts import PartedReader

__all__ = ["BlockedReader", "PartedReader", "Reader", "Sample", "StreamSample", "Writer", "close_all", "foreign_reader",
           "format_names", "get_format", "open_blocked", "open_paged", "open_reader", "reader_class", "register",
           "writer_files"]


def open_reader(root: str | os.PathLike, manifest: dict | None = None, **options) -> Reader:
    """The reader of the packed dataset in ``root``, as its ``manifest.json`` says: the format's reader, or a
    :class:`PartedReader` over them for a conversion made by several ranks.

    Args:
        root: the dataset folder (a local one: the public entry points resolve a URL into the cache first,
            see :func:`packer.remote.entry.local_dataset`).
        manifest: ``root``'s manifest as the caller read it (default: read now); ``packer verify`` gives it
            without the sha256 of the files it found damaged, so a reader reads them for it to name what differs.
        **options: the format reader's own options (LMDB's ``readahead``, HDF5's ``locking``).

    Returns:
        A :class:`Reader`, not yet open (each process opens its own handles on first use).
    """
    manifest = read_local_manifest(root) if manifest is None else manifest
    try:
        _, reader = get_format(manifest["format"])
    except ValueError as exc:
        raise ManifestError(f"{os.path.join(root, MANIFEST)}: {exc}") from None
    if manifest.get("parts") is not None:  # converted by several ranks: one reader per part
        return PartedReader(root, manifest=manifest, **options)
    return reader(root, manifest=manifest, **options)


def reader_class(manifest: dict, where: str | os.PathLike) -> type[Reader]:
    """The reader class of the format ``manifest`` names (its hooks answer for that format's keys: ``summary``,
    ``stream_files``...); a :class:`ManifestError` naming ``where`` (the manifest) for an unknown format."""
    try:
        return get_format(manifest["format"])[1]
    except ValueError as exc:
        raise ManifestError(f"{os.fspath(where)}: {exc}") from None


def foreign_reader(paths: list[Path], label_key: str | None = None) -> Reader:
    """A reader over data files another tool wrote (WebDataset shards from ``webdataset.ShardWriter``,
    img2dataset...): the first registered format that reads them (:meth:`Reader.from_foreign`), every member
    beyond the image and the label kept as a field; what it leaves out is in its ``skipped``."""
    for reader in readers():
        found = reader.from_foreign(paths, label_key)
        if found is not None:
            return found
    raise ValueError(f"{paths[0] if paths else 'no files'}: no format reads these files")


def close_all() -> None:
    """Close the handles every format's readers share per process (:meth:`Reader.close_process_handles`); they
    reopen on next use. Only while no loader is reading: closing a map under a reading thread crashes."""
    classes: list[type[Reader]] = [*readers(), BlockedReader]
    for reader in classes:
        reader.close_process_handles()

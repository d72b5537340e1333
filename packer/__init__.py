"""packer: pack an image folder into LMDB, HDF5 or WebDataset shards, and read it back fast.

Public API (imported lazily, so ``packer pack`` does not pay for torch until it needs it)::

    packer.pack(src, dest, format="lmdb", ...)      # convert (or repack); returns the manifest
    packer.export(dest, out)                        # a packed dataset back to an image folder
    packer.to_hf(dest)                              # a packed dataset as a Hugging Face datasets.Dataset
    packer.open_dataset(dest, transform=None)       # the format's Dataset
    packer.LmdbDataset, Hdf5Dataset, WdsDataset, PartedDataset, FolderDataset
    # dest may be a URL (s3://, gs://, https://...) wherever it is read or written: see packer.remote
    packer.make_loader(ds, batch_size=64)           # a pre-tuned torch DataLoader
    packer.to_device(loader, "cuda", normalize=(mean, std))
    packer.stream(dest, batch_size)                 # sequential reading of WebDataset shards, resumable
    packer.mix([ds_a, ds_b], weights=[0.8, 0.2])    # several datasets as one, drawn by weight every epoch
    packer.PackerError                              # base of every error packer raises
    packer.lightning.PackedDataModule               # a Lightning DataModule (the lightning extra; not imported here)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "pack": "packer.packing.pack",
    "export": "packer.exports.folder",
    "to_hf": "packer.exports.hf",
    "open_dataset": "packer.reading.dataset",
    "read_manifest": "packer.remote.entry",
    "LmdbDataset": "packer.reading.dataset",
    "Hdf5Dataset": "packer.reading.dataset",
    "WdsDataset": "packer.reading.dataset",
    "PartedDataset": "packer.reading.dataset",
    "stream": "packer.loading.stream",
    "mix": "packer.reading.mix",
    "FolderDataset": "packer.reading.folder",
    "make_loader": "packer.loading.loader",
    "to_device": "packer.loading.loader",
    "scan_folder": "packer.sources.folder",
    "PackerError": "packer.errors",
    "SourceError": "packer.errors",
    "ImageError": "packer.errors",
    "DestinationError": "packer.errors",
    "IncompleteDatasetError": "packer.errors",
    "ManifestError": "packer.errors",
    "CorruptDataError": "packer.errors",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # the same names, for type checkers and the API reference (griffe follows them as aliases)
    from .errors import CorruptDataError as CorruptDataError
    from .errors import DestinationError as DestinationError
    from .errors import ImageError as ImageError
    from .errors import IncompleteDatasetError as IncompleteDatasetError
    from .errors import ManifestError as ManifestError
    from .errors import PackerError as PackerError
    from .errors import SourceError as SourceError
    from .exports.folder import export as export
    from .exports.hf import to_hf as to_hf
    from .loading.loader import make_loader as make_loader
    from .loading.loader import to_device as to_device
    from .loading.stream import stream as stream
    from .packing.pack import pack as pack
    from .reading.dataset import Hdf5Dataset as Hdf5Dataset
    from .reading.dataset import LmdbDataset as LmdbDataset
    from .reading.dataset import PartedDataset as PartedDataset
    from .reading.dataset import WdsDataset as WdsDataset
    from .reading.dataset import open_dataset as open_dataset
    from .reading.folder import FolderDataset as FolderDataset
    from .reading.mix import mix as mix
    from .remote.entry import read_manifest as read_manifest
    from .sources.folder import scan_folder as scan_folder


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        if name == "read_manifest":  # each format registers its manifest keys' checks when packer.formats loads
            importlib.import_module("packer.formats")
        module = importlib.import_module(_EXPORTS[name])
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packer' has no attribute {name!r}")

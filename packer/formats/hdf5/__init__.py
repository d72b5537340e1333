"""HDF5: one file, ``DEST/data.h5``, laid out so that readers can memory-map it.

Datasets (all contiguous, uncompressed, readable by plain h5py and ``h5dump``):

- ``images``: raw images of a fixed shape as one ``(N, H, W, C)`` array; otherwise one ``uint8`` blob of every
  payload end to end, with ``offsets`` (``int64``, N+1) giving sample ``i`` as ``images[offsets[i]:offsets[i+1]]``;
- ``shapes`` (``uint16``, N x 3): each image's (H, W, C);
- ``labels`` (``int64``), ``crc32`` (``uint32``, of each payload), ``relpaths`` (UTF-8 strings);
- a dataset with fields beyond the image and its class (the manifest's ``fields``): per extra field, a number
  field of fixed shape as one typed dataset ``fields/NAME`` (``int64`` or ``float32``, N or N x n), any other as
  a group ``fields/NAME`` holding ``values`` (``uint8``, every value's bytes end to end) and ``offsets``
  (``int64``, N+1); and ``fields_crc32`` (``uint32``, :func:`packer.fields.fields_crc32` of each sample's).

During conversion payloads stream into a temporary blob file; ``close`` copies it into a contiguous dataset of
the final size (HDF5 cannot grow a dataset without chunking it, and chunks cannot be memory-mapped).

Read by byte ranges (a URL larger than the local cache, :mod:`packer.formats.layout`), a sample's range is its
slice of the ``images`` blob (or its row); :meth:`Hdf5Reader.layout` finds them with h5py reading the metadata
through :mod:`packer.formats.hdf5.ranges`, and keeps the small arrays in the layout's index.
"""

from __future__ import annotations

from ..base import register
from .reader import FILENAME, Hdf5Reader
from .writer import Hdf5Writer

__all__ = ["FILENAME", "Hdf5Reader", "Hdf5Writer"]

register("hdf5", Hdf5Writer, Hdf5Reader)

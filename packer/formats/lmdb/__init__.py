"""LMDB: one environment in DEST (``data.mdb``), one record per sample.

Keys are the sample index as 10 ASCII digits (``b"0000000042"``), written in order with ``append=True``.
Values are a 24-byte little-endian header, the relative path (UTF-8), then the payload; nothing is pickled:

    offset size  field
    0      4     magic b"PKR1"
    4      4     label (int32)
    8      4     crc32 of the payload (uint32)
    12     2     height (uint16)
    14     2     width (uint16)
    16     1     channels (uint8)
    17     1     reserved (0)
    18     2     length of the relative path in bytes (uint16)
    20     4     length of the payload in bytes (uint32)

The payload is the encoded image (original/jpeg/png) or the raw pixels, C-order (H, W, C), of the manifest's
dtype. A dataset with fields beyond the image and its class (the manifest's ``fields``) has records with magic
``PKR2``, whose payload is followed by the extra fields, in the manifest's order (skipping ``image`` and the
class): a uint32 crc32 of them (:func:`packer.fields.fields_crc32`), a uint32 count n, n uint32 lengths, then
the n values end to end (their bytes as :mod:`packer.fields` stores them). Plain py-lmdb reads it:
``lmdb.open(DEST, readonly=True, lock=False)``.

Beside ``data.mdb``, the label-and-size index ``lmdb_index.npy`` (listed in the manifest's ``files`` with its
size and sha256, like ``data.mdb``; no LMDB reader needs it) is a NumPy ``.npy`` file of one little-endian
structured row a record, row ``i`` for key ``i`` (:mod:`.index`):

    field   type  what
    label   <i4   the record header's label (-1: none)
    size    <u4   the record header's payload length in bytes (the stored image)
    offset  <u8   where the record's value starts in data.mdb, in bytes (its header's first byte)
    record  <u4   the value's length in bytes (header, path, payload and fields)

Class counts, stored sizes and blocks read it instead of the records (``packer info`` reads the manifest's
``class_counts``), checked first against its sha256 and every label a class index; each read has the kernel read
exactly ``offset .. offset + record`` ahead, from its rows alone (a row placing a record past ``data.mdb`` is
refused): opening reads no row, and no sample's label or bytes ever come from the index. A dataset packed before
the index existed is scanned once for it (:func:`.index.cached_index`).
"""

from __future__ import annotations

from ..base import register
from .reader import LmdbReader, close_environments
from .writer import LmdbWriter

__all__ = ["LmdbReader", "LmdbWriter", "close_environments"]

register("lmdb", LmdbWriter, LmdbReader)

"""WebDataset: POSIX tar shards ``DEST/shard-000000.tar``... that the ``webdataset`` library and ``tar`` read.

Each sample is three adjacent members named by a dot-free key, the 9-digit sample index:
``000000042.jpg`` (the image, under its format's lower-case extension; ``.npy`` for raw arrays),
``000000042.cls`` (the label as ASCII digits) and ``000000042.json`` (``relpath``, ``label``, ``class``,
``shape``). Members have mtime 0, owner 0 and mode 0644, so two conversions give identical bytes. In a
distributed conversion each rank's part (``part-00000/shard-000000.tar``...) numbers its keys from its first
position in the output order, so keys stay unique across parts.

A dataset with fields beyond the image and its class (the manifest's ``fields``) adds one member per extra field
after those, in the manifest's order, named ``000000042.NAME.EXT``: text ``txt``, JSON ``json``, an integer
``cls`` (ASCII digits), other numbers and vectors ``npy``, bytes ``bin``, a mask ``png``, a second image under its
own extension: the names the ``webdataset`` library decodes. Two parts where packer's own members have one, so no
field's member can take the image's, the class's or packer's json's name, nor another field's (names are unique
but for case, which webdataset ignores: :func:`~packer.formats.wds.members.check_schema` refuses the rest, and
names over 64 characters, before anything is written). The caption, the one text field (or the one
``--caption-column`` names; the manifest's ``caption``), is ``000000042.txt`` instead, as img2dataset and
open_clip read it. Without a class field there is no ``.cls`` member. The json member records the fields'
checksum (``fields_crc32``). Such a dataset is ``format_version`` 3; version 2 named a field as its extension
when the two were equal (a bare ``000000042.txt``) and packer's json ``000000042.packer.json`` beside a field
named ``json``. Every reader takes a sample's members by their order (image, class, json, then the fields), so
both read alike.

``packer.stream`` reads a packed dataset's shards from start to end (:meth:`WdsReader.stream_file`:
:func:`~packer.formats.wds.members.read_shard`), grouping members into samples by
:func:`~packer.formats.wds.members.sample_key`, the rule the scan of other tools' shards uses. The manifest's
``shards`` key (each shard's path and sample count) is read in this module only: its check, ``packer info``'s
lines, and the merge of a distributed conversion's parts.

For random access packer also writes ``wds_index.npy``: one row per sample with its shard and the byte offset
and size of its image payload (for ``.npy``, of the pixels after the header) and of its json member. Shards are
written under ``.tmp`` names and renamed once complete. Rows are in shard order, so the manifest's per-shard
counts say which shard holds each sample: blocks come from them, and opening reads no row (only the index's
header and size). Each row is checked as it is read (its shard where the counts put it, its label a class index,
its shape an image): a damaged row is one line naming the index and the row. Class counts, stored sizes and
shapes, and ``packer verify``, which use every row, check every row first.

A reader maps each shard on first use and keeps it; a shard (or the index) replaced since the reader read its
manifest, e.g. by ``packer pack --overwrite`` of the same DEST, is refused in one line rather than read at the
old offsets. A dataset read by byte ranges (a URL larger than the local cache) reads the index whole and each
sample's members from one range of its shard: :mod:`packer.formats.wds.layout`.

Shards written by other tools (:func:`scan_shards`, :meth:`WdsReader.from_shards`, and ``packer pack`` from
shards) are read as webdataset groups them, by key. What cannot be one unambiguous sample is never dropped or
guessed silently:

- refused, naming the shard and the member: names with an absolute path or ``..``; a missing label; a label
  that is not a class index (negative, ``1.7``, ``true``, or over :data:`MAX_SHARD_CLASSES`); a ``.npy`` image
  that is not a plain uint8 array (an object array is a pickle: it is never loaded);
- listed in ``skipped`` (the dataset's ``skipped``; for ``packer pack``, warned about and kept in the manifest's
  ``skipped``): link members, symbolic or hard, and other members that are not regular files; a key whose
  image or label member appears twice; a key with no image member (a ``.pyd`` or ``.pickle`` payload is
  never read).
"""

from __future__ import annotations

from ..base import register
from .reader import WdsReader, brace_pattern
from .writer import WdsWriter

__all__ = ["WdsReader", "WdsWriter", "brace_pattern"]

register("wds", WdsWriter, WdsReader)

"""An LMDB record, as the package's docstring lays it out: its key, its header, path, payload and fields."""

from __future__ import annotations

import struct
from collections.abc import Callable

from ...errors import CorruptDataError
from ...fields import fields_crc32
from ...images.transforms import Encoded
from ..base import Sample

HEADER = struct.Struct("<4siIHHBBHI")
MAGIC = b"PKR1"
MAGIC_FIELDS = b"PKR2"  # the payload is followed by the extra fields
FIELDS_HEADER = struct.Struct("<II")  # crc32 of the fields, their count


KEY_DIGITS = 10  # a key is the sample index in this many ASCII digits


def key(index: int) -> bytes:
    return b"%010d" % index


def pack_record(label: int, relpath: str, item: Encoded, extras: tuple[bytes, ...] | None = None) -> bytes:
    """A record: header, relative path, payload, and with ``extras`` (a dataset with fields) the fields."""
    path = relpath.encode("utf-8")
    h, w, c = item.shape
    magic = MAGIC if extras is None else MAGIC_FIELDS
    record = HEADER.pack(magic, label, item.crc32, h, w, c, 0, len(path), len(item.payload)) + path + item.payload
    if extras is None:
        return record
    lengths = struct.pack(f"<{len(extras)}I", *map(len, extras))
    return b"".join((record, FIELDS_HEADER.pack(fields_crc32(extras), len(extras)), lengths, *extras))


def unpack_fields(view: memoryview, where: str) -> tuple[tuple[memoryview, ...], int]:
    """The extra fields after a ``PKR2`` record's payload, and their checksum."""
    if len(view) < FIELDS_HEADER.size:
        raise CorruptDataError(f"{where}: record ends before its fields; the record is damaged, re-pack")
    crc, n = FIELDS_HEADER.unpack_from(view)
    start = FIELDS_HEADER.size + 4 * n
    if len(view) < start:
        raise CorruptDataError(f"{where}: record ends inside its fields' lengths; the record is damaged, re-pack")
    lengths = struct.unpack_from(f"<{n}I", view, FIELDS_HEADER.size)
    if start + sum(lengths) != len(view):
        raise CorruptDataError(f"{where}: record length does not match its fields; the record is damaged, re-pack")
    values = []
    for length in lengths:
        values.append(view[start:start + length])
        start += length
    return tuple(values), crc


def parse_record(value: bytes | memoryview, where: str | Callable[[], str]) -> tuple[Sample, int, int]:
    """A record's sample (its payload a view of ``value``), where its path ends and where its payload ends (its
    fields start, in a ``PKR2`` record): the one parser of a record's header, for reads from the map and from
    byte ranges alike. The label is not checked against the dataset's classes (the caller's). Any malformed
    record is a one-line :class:`CorruptDataError` naming ``where`` (a callable is called only then: the hot
    path names nothing)."""
    if len(value) >= HEADER.size:
        magic, label, crc, h, w, c, _, path_len, size = HEADER.unpack_from(value)
        start = HEADER.size + path_len
        end = start + size
        if end == len(value) if magic == MAGIC else (magic == MAGIC_FIELDS and end <= len(value)):
            return Sample(value[start:end], label, (h, w, c), crc), start, end
    where = where() if callable(where) else where
    if len(value) < HEADER.size:
        raise CorruptDataError(f"{where}: record is {len(value)} bytes, shorter than its header; re-pack")
    if magic not in (MAGIC, MAGIC_FIELDS):
        raise CorruptDataError(f"{where}: record header is damaged (bad magic); re-pack")
    raise CorruptDataError(f"{where}: record length does not match its header; re-pack")


def unpack_record(value: bytes | memoryview, where: str = "record") -> tuple[Sample, str]:
    """Split a record into its sample and relative path; any malformed record is a :class:`CorruptDataError`."""
    view = memoryview(value)
    sample, path_end, _ = parse_record(view, where)
    try:
        relpath = bytes(view[HEADER.size:path_end]).decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptDataError(f"{where}: record path is not UTF-8; the record is damaged, re-pack") from None
    return sample, relpath


def record_fields(value: bytes | memoryview, where: str) -> tuple[tuple[memoryview, ...], int]:
    """The extra fields of a ``PKR2`` record and their checksum (:func:`unpack_fields`)."""
    view = memoryview(value)
    if len(view) < HEADER.size or bytes(view[:4]) != MAGIC_FIELDS:
        raise CorruptDataError(f"{where}: record has no fields, the manifest says it has; run `packer verify`")
    return unpack_fields(view[parse_record(view, where)[2]:], where)

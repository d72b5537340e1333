"""Packer's WebDataset shards read by byte ranges (:mod:`packer.formats.layout`): the shard index read whole
through a :class:`~packer.formats.layout.RangeSource`, one range per sample, and a sample, its fields and their
checksum from its range's bytes, parsed by the functions the local reader uses (:mod:`.wds_members`).

A sample's range begins at its image payload (for ``.npy``, at the pixels after the header) and covers the
members after it: up to the end of its json member where the dataset has no extra fields, else up to the next
sample's payload (or the end of the shard), since the index does not record where the extra members end. A
sample never spans shards (its range lies in its shard), so neither does a block.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from ...errors import CorruptDataError
from ...fields import Field
from ..base import Sample
from ..layout import Layout, RangeSource
from .members import INDEX_DTYPE, NPY_ERRORS, after_json, field_members, fields_checksum_of, packer_info, payload_sample

MAX_INDEX_HEADER = 1 << 16  # the .npy header of the shard index: a few hundred bytes


def read_index(source: RangeSource, name: str, count: int, where: str) -> np.ndarray:
    """The shard index (``name``, a ``.npy`` of ``count`` rows of :data:`INDEX_DTYPE`) read whole through
    ``source``: its size must be a header and ``count`` rows before anything is read, and its header must say
    exactly that; no pickles. :class:`CorruptDataError` naming it otherwise."""
    path = f"{where.rstrip('/')}/{name}"
    size = source.size(name)
    header = size - count * INDEX_DTYPE.itemsize
    if not 0 < header <= MAX_INDEX_HEADER:
        raise CorruptDataError(f"{path}: {size} bytes, not an index of {count} samples; re-pack")
    raw = source.read(name, 0, size)
    buf = io.BytesIO(raw)
    try:
        major, _ = np.lib.format.read_magic(buf)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(buf, max_header_size=MAX_INDEX_HEADER)
    except NPY_ERRORS as exc:  # what numpy's header parser raises
        raise CorruptDataError(f"{path}: not a packer shard index ({exc}); re-pack") from None
    if dtype != INDEX_DTYPE or shape != (count,) or buf.tell() != header or len(raw) != size:
        what = f"shape {shape}" if dtype == INDEX_DTYPE else "another dtype"
        raise CorruptDataError(f"{path}: its header says {what}, not the packer shard index of {count} samples; "
                               "re-pack")
    return np.frombuffer(raw, INDEX_DTYPE, count, offset=header)


def shard_layout(rows: np.ndarray, name: str, shards: Sequence[str], sizes: Sequence[int], has_crc: bool,
                 has_extras: bool, where: str) -> Layout:
    """The layout of checked index ``rows`` (of the index file ``name``) over ``shards`` (their paths and sizes
    in bytes): one range per
    sample in its shard (see the module's docstring); ``index`` holds what the ranged hooks read besides it
    (``label``, ``shape``, ``size``, ``json_at``: the json member's offset in the range, ``json_size``, and
    ``crc32`` when the dataset records it). :class:`CorruptDataError` naming the shard when it is shorter than
    the index says, naming the index when its rows are not in shard order."""
    where = where.rstrip("/")
    shard = rows["shard"].astype(np.int32)
    start = rows["offset"].astype(np.int64)
    size = rows["size"].astype(np.int64)
    json_at = rows["json_offset"].astype(np.int64)
    json_size = rows["json_size"].astype(np.int64)
    json_end = json_at + json_size
    limit = np.asarray(sizes, dtype=np.int64)[shard]
    short = np.flatnonzero(json_end > limit)
    if len(short):
        i = int(short[0])
        raise CorruptDataError(f"{where}/{shards[shard[i]]}: {int(limit[i])} bytes, shorter than the shard index "
                               f"says (sample {i} ends at byte {int(json_end[i])}); the shard is truncated, re-pack")
    same = shard[1:] == shard[:-1]
    if np.any(shard[1:] < shard[:-1]) or np.any(same & (start[1:] <= json_end[:-1])) or np.any(json_at < start + size):
        raise CorruptDataError(f"{where}/{name}: its rows are not in shard order; the dataset is damaged, "
                               "re-pack")
    if has_extras:  # the extra members end where the next sample's members begin
        end = np.append(np.where(same, start[1:], limit[:-1]), limit[-1:])
    else:
        end = json_end
    index = {"label": rows["label"].astype(np.int64), "shape": np.asarray(rows["shape"]), "size": size,
             "json_at": json_at - start, "json_size": json_size}
    if has_crc:
        index["crc32"] = rows["crc32"].astype(np.uint32)
    layout = Layout(tuple(shards), shard, start, end, index)
    layout.check(len(rows), sizes, where)
    return layout


def shard_where(where: str, layout: Layout, index: int) -> str:
    """Sample ``index``'s shard, named from the dataset's URL or folder ``where``."""
    return f"{where.rstrip('/')}/{layout.files[int(layout.file[index])]}"


def ranged_sample(index: int, data: memoryview, layout: Layout, where: str) -> Sample:
    """:meth:`WdsReader.read` of sample ``index`` from its range's bytes."""
    ix = layout.index
    crc = int(ix["crc32"][index]) if "crc32" in ix else None
    return payload_sample(data, 0, int(ix["size"][index]), int(ix["label"][index]), crc,
                          tuple(ix["shape"][index].tolist()), shard_where(where, layout, index), index)


def ranged_extras(index: int, data: memoryview, layout: Layout, extras: Sequence[Field],
                  where: str) -> tuple[memoryview | bytes, ...]:
    """:meth:`WdsReader.read_extras` of sample ``index`` from its range's bytes: the members after its json
    member (its offsets in the shard rounded as there: the range begins at the payload, not at a tar block)."""
    ix, start = layout.index, int(layout.start[index])
    at = after_json(start + int(ix["json_at"][index]), int(ix["json_size"][index])) - start
    return field_members(memoryview(data), at, extras, layout.sample_name(where, index))


def ranged_fields_checksum(index: int, data: memoryview, layout: Layout) -> int | None:
    """:meth:`WdsReader.fields_checksum` of sample ``index`` from its range's bytes (its json member)."""
    ix = layout.index
    a, n = int(ix["json_at"][index]), int(ix["json_size"][index])
    where = f"{layout.files[int(layout.file[index])]} sample {index}"
    if a + n > len(data):
        raise CorruptDataError(f"{where}: shard is truncated; run `packer verify` and re-pack")
    return fields_checksum_of(packer_info(memoryview(data)[a:a + n], where))

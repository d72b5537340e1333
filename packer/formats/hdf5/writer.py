"""The HDF5 writer: payloads and fields streamed into temporary files, then copied into contiguous datasets of
their final size when the conversion closes.

Every extra field goes through the same two temporary files, whatever their number (a table may have a thousand
columns, and a file open per field would run out of descriptors): ``data.h5.fields.tmp`` holds each sample's field
values end to end, ``data.h5.lengths.tmp`` each value's length (one int64 row of F lengths a sample). At close,
one pass over them deals each field's bytes into its dataset, COPY_BYTES at a time."""

from __future__ import annotations

import errno
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...fields import NUMERIC, Field, fields_crc32
from ...images.transforms import Encoded
from ...manifest import file_entry
from ..base import Writer
from .reader import FILENAME

COPY_BYTES = 64 << 20


def enumerate_path_chunks(path: Path, chunk_bytes: int = 1 << 20) -> Iterator[tuple[int, list[bytes]]]:
    """``(first index, [relpath bytes, ...])`` pieces of a file of NUL-terminated paths, a megabyte at a time."""
    done, rest = 0, b""
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            *paths, rest = (rest + block).split(b"\0")
            if paths:
                yield done, paths
                done += len(paths)


class Hdf5Writer(Writer):
    RESUMES_FROM = "nothing: it writes its file whole at the end"
    FILES = (FILENAME, FILENAME + ".blob.tmp", FILENAME + ".paths.tmp", FILENAME + ".fields.tmp",
             FILENAME + ".lengths.tmp", FILENAME + ".field-*.tmp")  # field-*: written by packer 0.x, one a field

    def __init__(self, dest: Path, spec, expected_count: int, options: dict[str, Any]):
        super().__init__(dest, spec, expected_count, options)
        self.blob_path = dest / (FILENAME + ".blob.tmp")
        self.paths_path = dest / (FILENAME + ".paths.tmp")
        self.blob = open(self.blob_path, "wb")
        self.paths = open(self.paths_path, "wb")
        self.offsets = array("q", [0])
        self.labels = array("q")
        self.crcs = array("I")  # 4 bytes; "L" is 8 on 64-bit Linux and would not match uint32
        self.shapes = array("H")
        self.fields_path = dest / (FILENAME + ".fields.tmp")
        self.lengths_path = dest / (FILENAME + ".lengths.tmp")
        self.fields = open(self.fields_path, "wb") if self.extra_fields else None
        self.lengths = open(self.lengths_path, "wb") if self.extra_fields else None
        self.field_totals = [0] * len(self.extra_fields)  # bytes of each field so far
        self.fields_crcs = array("I")

    def write(self, label: int, relpath: str, item: Encoded, extras: tuple[bytes, ...] = ()) -> None:
        if self.fields is not None and self.lengths is not None:
            if len(extras) != len(self.extra_fields):
                raise ValueError(f"{relpath}: {len(extras)} field values for {len(self.extra_fields)} fields")
            lengths = array("q", map(len, extras))
            self.fields.write(b"".join(extras))
            self.lengths.write(lengths.tobytes())
            self.field_totals = [t + n for t, n in zip(self.field_totals, lengths, strict=True)]
            self.fields_crcs.append(fields_crc32(extras))
        self.blob.write(item.payload)
        self.paths.write(relpath.encode("utf-8") + b"\0")
        self.offsets.append(self.offsets[-1] + len(item.payload))
        self.labels.append(label)
        self.crcs.append(item.crc32)
        self.shapes.extend(item.shape)
        self.count += 1

    def close(self) -> dict[str, Any]:
        self.blob.close()
        self.paths.close()
        self._close_fields()
        n = self.count
        shape = self.spec.fixed_shape
        path = self.dest / FILENAME
        # The temporary files are read in COPY_BYTES pieces, not memory-mapped or read whole: a map's pages count
        # in the process's RSS (and a job's cgroup), so the peak grew with the dataset; read in pieces it stays
        # flat (docs/benchmarks.md, benchmarks/pack_memory.py).
        with h5py.File(path, "w", libver="earliest") as f:
            if self.spec.store == "raw" and shape:
                images = f.create_dataset("images", (n, *shape), dtype=np.dtype(self.spec.dtype))
                _copy_rows(self.blob_path, images)
            else:
                total = self.offsets[-1]
                _copy_rows(self.blob_path, f.create_dataset("images", (total,), dtype=np.uint8))
                f.create_dataset("offsets", data=np.frombuffer(self.offsets, dtype=np.int64))
            f.create_dataset("shapes", data=np.frombuffer(self.shapes, dtype=np.uint16).reshape(n, 3))
            f.create_dataset("labels", data=np.frombuffer(self.labels, dtype=np.int64))
            f.create_dataset("crc32", data=np.array(self.crcs, dtype=np.uint32))
            relpaths = f.create_dataset("relpaths", (n,), dtype=h5py.string_dtype("utf-8"))
            for a, chunk in enumerate_path_chunks(self.paths_path):
                relpaths[a:a + len(chunk)] = np.array(chunk, dtype=object)
            if self.extra_fields:
                _write_fields(f, self.extra_fields, self.field_totals, self.fields_path, self.lengths_path, n)
                f.create_dataset("fields_crc32", data=np.array(self.fields_crcs, dtype=np.uint32))
            f.attrs["packer_store"] = self.spec.store
            f.attrs["packer_dtype"] = self.spec.dtype
        self.blob_path.unlink()
        self.paths_path.unlink()
        if self.extra_fields:
            self.fields_path.unlink()
            self.lengths_path.unlink()
        return {"files": [file_entry(self.dest, FILENAME)]}

    def abort(self) -> None:
        self.blob.close()
        self.paths.close()
        self._close_fields()

    def _close_fields(self) -> None:
        for f in (self.fields, self.lengths):
            if f is not None:
                f.close()


def _copy_rows(source: Path, target: h5py.Dataset) -> None:
    """Fill ``target`` from the raw values in file ``source``, COPY_BYTES at a time."""
    n, row = target.shape[0], target.shape[1:]
    per = max(1, int(np.prod(row)))  # values a row
    step = max(1, COPY_BYTES // (per * target.dtype.itemsize))
    with open(source, "rb") as blob:
        for a in range(0, n, step):
            b = min(n, a + step)
            target[a:b] = np.fromfile(blob, dtype=target.dtype, count=(b - a) * per).reshape(b - a, *row)


def _write_fields(f: h5py.File, fields: list[Field], totals: list[int], values_path: Path, lengths_path: Path,
                  n: int) -> None:
    """Every extra field into ``fields/NAME``: a typed array when every value has the same number shape, else its
    bytes (``values``) and ``offsets``. One pass over the temporary files: each block of samples (at most
    COPY_BYTES of values, or one sample) is read once and each field's bytes in it written to its dataset."""
    targets = []
    for field, total in zip(fields, totals, strict=True):
        if field.kind in NUMERIC and field.shape is not None:
            targets.append((f.create_dataset(f"fields/{field.name}", (n, *field.shape), dtype=NUMERIC[field.kind]),
                            None))
        else:
            group = f.create_group(f"fields/{field.name}")
            offsets = group.create_dataset("offsets", (n + 1,), dtype=np.int64)
            offsets[0] = 0
            targets.append((group.create_dataset("values", (total,), dtype=np.uint8), offsets))
    done = np.zeros(len(fields), np.int64)  # bytes of each field written so far
    rows_per_read = max(1, (COPY_BYTES // 8) // len(fields))
    with open(values_path, "rb") as values, open(lengths_path, "rb") as lengths_file:
        a = 0
        while a < n:
            lengths = np.fromfile(lengths_file, np.int64, count=min(rows_per_read, n - a) * len(fields))
            lengths = lengths.reshape(-1, len(fields))
            if not len(lengths):
                raise OSError(errno.EIO, f"{lengths_path.name} ends early", str(lengths_path))
            for block in _blocks(lengths):
                _deal(values, lengths[block], targets, done, a + block.start)
            a += len(lengths)


def _blocks(lengths: np.ndarray) -> list[slice]:
    """Runs of rows whose values hold at most COPY_BYTES together (a row larger than that alone)."""
    ends = np.cumsum(lengths.sum(axis=1))
    out, start, base = [], 0, 0
    while start < len(lengths):
        stop = max(start + 1, int(np.searchsorted(ends, base + COPY_BYTES, side="right")))
        out.append(slice(start, stop))
        base, start = int(ends[stop - 1]), stop
    return out


def _deal(values, lengths: np.ndarray, targets: list, done: np.ndarray, first: int) -> None:
    """Read the values of the samples ``first``.. (``lengths``: their rows) and write each field's bytes to its
    dataset, its offsets after the ones written."""
    data = memoryview(values.read(int(lengths.sum())))
    ends = np.cumsum(lengths.ravel()).reshape(lengths.shape)  # where each value ends in ``data``
    rows = len(lengths)
    for k, (dataset, offsets) in enumerate(targets):
        piece = b"".join(data[e - size:e] for e, size in zip(ends[:, k].tolist(), lengths[:, k].tolist(),
                                                              strict=True))
        if offsets is None:
            dataset[first:first + rows] = np.frombuffer(piece, dataset.dtype).reshape(rows, *dataset.shape[1:])
        else:
            dataset[done[k]:done[k] + len(piece)] = np.frombuffer(piece, np.uint8)
            offsets[first + 1:first + 1 + rows] = done[k] + np.cumsum(lengths[:, k])
        done[k] += len(piece)

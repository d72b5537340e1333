"""The HDF5 writer: payloads and fields streamed into temporary files, then copied into contiguous datasets of
their final size when the conversion closes."""

from __future__ import annotations

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
    FILES = (FILENAME, FILENAME + ".blob.tmp", FILENAME + ".paths.tmp", FILENAME + ".field-*.tmp")

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
        self.field_paths = [dest / f"{FILENAME}.field-{k}.tmp" for k in range(len(self.extra_fields))]
        self.field_blobs = [open(path, "wb") for path in self.field_paths]
        self.field_offsets = [array("q", [0]) for _ in self.extra_fields]
        self.fields_crcs = array("I")

    def write(self, label: int, relpath: str, item: Encoded, extras: tuple[bytes, ...] = ()) -> None:
        for blob, offsets, value in zip(self.field_blobs, self.field_offsets, extras, strict=True):
            blob.write(value)
            offsets.append(offsets[-1] + len(value))
        if self.extra_fields:
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
            for field, path, offsets in zip(self.extra_fields, self.field_paths, self.field_offsets, strict=True):
                _write_field(f, field, path, offsets, n)
            if self.extra_fields:
                f.create_dataset("fields_crc32", data=np.array(self.fields_crcs, dtype=np.uint32))
            f.attrs["packer_store"] = self.spec.store
            f.attrs["packer_dtype"] = self.spec.dtype
        self.blob_path.unlink()
        self.paths_path.unlink()
        for path in self.field_paths:
            path.unlink()
        return {"files": [file_entry(self.dest, FILENAME)]}

    def abort(self) -> None:
        self.blob.close()
        self.paths.close()
        for blob in self.field_blobs:
            blob.close()

    def _close_fields(self) -> None:
        for blob in self.field_blobs:
            blob.close()


def _copy_rows(source: Path, target: h5py.Dataset) -> None:
    """Fill ``target`` from the raw values in file ``source``, COPY_BYTES at a time."""
    n, row = target.shape[0], target.shape[1:]
    per = max(1, int(np.prod(row)))  # values a row
    step = max(1, COPY_BYTES // (per * target.dtype.itemsize))
    with open(source, "rb") as blob:
        for a in range(0, n, step):
            b = min(n, a + step)
            target[a:b] = np.fromfile(blob, dtype=target.dtype, count=(b - a) * per).reshape(b - a, *row)


def _write_field(f: h5py.File, field: Field, path: Path, offsets: array, n: int) -> None:
    """One extra field into ``fields/NAME``: a typed array when every value has the same number shape, else its
    bytes and offsets."""
    if field.kind in NUMERIC and field.shape is not None:
        _copy_rows(path, f.create_dataset(f"fields/{field.name}", (n, *field.shape), dtype=NUMERIC[field.kind]))
        return
    group = f.create_group(f"fields/{field.name}")
    _copy_rows(path, group.create_dataset("values", (offsets[-1],), dtype=np.uint8))
    group.create_dataset("offsets", data=np.frombuffer(offsets, dtype=np.int64))

"""``verify()``: check a packed dataset against its manifest, and name every problem with its file and sample.

Quick checks: the manifest parses; every data file exists with the size and sha256 the manifest gives; the
sample count agrees with the data. Where a file's checksum is wrong, each of its samples' crc32 is checked so
the broken ones are named. ``deep=True`` also checks every sample's crc32, decodes it, and checks its shape and
label.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from .errors import PackerError
from .formats import open_dataset
from .manifest import read_manifest, sha256_file


def verify(dest: str | os.PathLike, deep: bool = False) -> list[str]:
    """Return the problems found in ``dest`` (empty when it is sound). Raises only for an unreadable manifest."""
    dest = Path(dest)
    manifest = read_manifest(dest)
    problems: list[str] = []
    damaged_files = set()
    for entry in manifest["files"]:
        path = dest / entry["path"]
        if not path.exists():
            problems.append(f"{path}: missing")
            damaged_files.add(entry["path"])
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
            damaged_files.add(entry["path"])
        elif entry.get("sha256") and sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (the file's bytes changed)")
            damaged_files.add(entry["path"])
    try:
        ds = open_dataset(dest, decode=True)
        ds._ensure_open()
    except PackerError as exc:
        return [*problems, str(exc)]
    problems += _check_counts(ds, manifest)
    if damaged_files or deep:
        problems += _check_samples(ds, manifest, deep, damaged_files)
    return problems


def _check_counts(ds, manifest: dict) -> list[str]:
    problems = []
    count = manifest["count"]
    if ds.format == "lmdb":
        entries = ds.env.stat()["entries"]
        if entries != count:
            problems.append(f"{ds.root / 'data.mdb'}: {entries} records, the manifest says {count}")
    elif ds.format == "hdf5":
        if len(ds.labels) != count:
            problems.append(f"{ds.path}: {len(ds.labels)} samples, the manifest says {count}")
    elif ds.format == "wds":
        shards = manifest.get("shards", [])
        if sum(s["count"] for s in shards) != count:
            problems.append(f"{ds.root}: shard counts add up to {sum(s['count'] for s in shards)}, not {count}")
    return problems


def _sample_file(ds, index: int) -> str:
    if ds.format == "wds":
        return ds.manifest["shards"][int(ds.index[index]["shard"])]["path"]
    return {"lmdb": "data.mdb", "hdf5": "data.h5"}.get(ds.format, "")


def _check_samples(ds, manifest: dict, deep: bool, damaged_files: set[str]) -> list[str]:
    problems = []
    n_classes = len(manifest["classes"])
    shape = manifest.get("shape")
    for i in range(len(ds)):
        if not deep and _sample_file(ds, i) not in damaged_files:
            continue
        where = ds._describe(i)
        try:
            sample = ds._read(i)
            if sample.crc32 is not None and zlib.crc32(sample.payload) != sample.crc32:
                problems.append(f"{where}: checksum mismatch, the stored bytes are damaged")
                continue
            if not 0 <= sample.label < n_classes:
                problems.append(f"{where}: label {sample.label} is not a class index (0..{n_classes - 1})")
            if deep:
                arr = ds._array(i, sample)
                if tuple(arr.shape) != tuple(sample.shape) or (shape and list(arr.shape) != list(shape)):
                    problems.append(f"{where}: decodes to {arr.shape}, recorded as {sample.shape}")
        except PackerError as exc:
            problems.append(str(exc))
    return problems

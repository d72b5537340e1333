"""``verify()``: check a packed dataset against its manifest, and name every problem with its file and sample.

Quick checks: the manifest parses; every data file exists with the size and sha256 the manifest gives; the
sample count agrees with the data. Where a file's checksum is wrong, each of its samples' crc32 is checked so
the broken ones are named. ``deep=True`` also checks every sample's crc32, decodes it, and checks its shape and
label.
"""

from __future__ import annotations

import json
import os
import tarfile
import zlib
from pathlib import Path

from .errors import PackerError
from .formats import open_dataset
from .formats.parts import PartedDataset
from .manifest import read_manifest, sha256_file
from .remote.url import parse_url


def verify(dest: str | os.PathLike, deep: bool = False) -> list[str]:
    """Return the problems found in ``dest`` (empty when it is sound). Raises only for an unreadable manifest."""
    if parse_url(dest) is not None:  # fetched into the cache, each file checked, then this on the local copy
        from .remote.check import verify_url

        return verify_url(os.fspath(dest), deep)
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
    if any(f.rsplit("/", 1)[-1] == "wds_index.npy" for f in damaged_files):  # labels, locations: all from it
        deep = True
    if damaged_files or deep:
        problems += _check_samples(ds, manifest, deep, damaged_files)
    if ds.format == "wds":
        problems += _check_wds_members(ds, manifest, deep, damaged_files)
    return problems


def _within(part: str, damaged_files: set[str]) -> set[str]:
    """The damaged files of one part, relative to it."""
    return {f[len(part) + 1:] for f in damaged_files if f.startswith(part + "/")}


def _check_counts(ds, manifest: dict) -> list[str]:
    if isinstance(ds, PartedDataset):  # several ranks' parts: each part against its own count
        return [p for sub in ds.readers for p in _check_counts(sub, sub.manifest)]
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
    if isinstance(ds, PartedDataset):
        p, local = ds.locate(index)
        return f"{ds.part_paths[p]}/{_sample_file(ds.readers[p], local)}"
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
            else:
                ds._check_label(i, sample.label)
            if deep:
                arr = ds._array(i, sample)
                if tuple(arr.shape) != tuple(sample.shape):
                    problems.append(f"{where}: decodes to {tuple(arr.shape)}, recorded as {tuple(sample.shape)}")
                elif shape and tuple(arr.shape) != tuple(shape):
                    problems.append(f"{where}: decodes to {tuple(arr.shape)}, the manifest says every image is "
                                    f"{tuple(shape)}")
        except PackerError as exc:
            problems.append(str(exc))
    return problems


def _check_wds_members(ds, manifest: dict, deep: bool, damaged_files: set[str], key_offset: int = 0) -> list[str]:
    """The labels webdataset readers see (the ``.cls`` and ``.json`` members) must agree with the index."""
    if isinstance(ds, PartedDataset):  # a part's keys start at its first position in the order
        return [p for sub, part, offset in zip(ds.readers, ds.part_paths, ds.key_offsets, strict=True)
                for p in _check_wds_members(sub, sub.manifest, deep, _within(part, damaged_files), offset)]
    problems = []
    for shard_no, shard in enumerate(manifest.get("shards", [])):
        path = ds.root / shard["path"]
        if not (deep or shard["path"] in damaged_files) or not path.exists():
            continue
        try:
            with tarfile.open(path, "r:") as tar:
                for member in tar:
                    key, _, ext = member.name.partition(".")
                    if ext not in ("cls", "json") or not key.isdigit() or not 0 <= int(key) - key_offset < len(ds):
                        continue
                    key = str(int(key) - key_offset)
                    data = tar.extractfile(member).read()
                    try:
                        label = int(data) if ext == "cls" else int(json.loads(data)["label"])
                    except (ValueError, KeyError, TypeError):
                        label = None
                    row = ds.index[int(key)]
                    if label != int(row["label"]) or int(row["shard"]) != shard_no:
                        problems.append(f"{path} sample {int(key)}: the .{ext} member says label {label}, the "
                                        f"index says {int(row['label'])}; the label is damaged")
        except (OSError, tarfile.TarError) as exc:
            problems.append(f"{path}: damaged tar shard ({exc})")
    return problems

"""``verify()``: check a packed dataset against its manifest, and name every problem with its file and sample.

Quick checks: the manifest parses; every data file exists with the size and sha256 the manifest gives; the
sample count agrees with the data. Where a file's checksum is wrong, each of its samples' crc32 is checked so
the broken ones are named (the crc32 of the image and of its fields). ``deep=True`` also checks every sample's
crc32 and its fields', decodes it and every field (a mask must have its image's size, and no stored image or
mask may declare more than ``max_pixels``), and checks its shape and label.

A URL: every data file is fetched afresh into a temporary cache (deleted afterwards: a sound copy in the shared
cache, whose objects are named by their sha256, says nothing about the remote objects) and checked against the
manifest's size and sha256, a damaged object named by its URL and never handed to a reader; when all are sound,
the local checks run on the fetched copy, with the problems naming the URL.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

from tqdm import tqdm

from .errors import PackerError
from .formats import Reader, open_reader
from .manifest import label_bounds, read_local_manifest, sha256_file
from .reading.decoding import Decoding
from .reading.fields import FieldDecoder
from .remote import parse_url
from .remote.cache import Cache
from .remote.resolve import release, resolve


def verify(dest: str | os.PathLike, deep: bool = False, progress: bool = False) -> list[str]:
    """Check the packed dataset ``dest`` against its manifest.

    Args:
        dest: the dataset folder, or its URL (``s3://bucket/ds``, ``https://...``).
        deep: also check every sample's crc32, decode it and its fields, and check its shape and label.
        progress: show progress bars on stderr when it is a terminal (the files' bytes, then the samples).

    Returns:
        The problems found, one line each naming the file (and sample); empty when the dataset is sound.

    Raises:
        PackerError: only for an unreadable manifest.
    """
    remote = parse_url(dest)
    if remote is not None:  # fetched into the cache, each file checked, then this on the local copy
        return _verify_url(remote.url, deep)
    dest = Path(dest)
    manifest = read_local_manifest(dest)
    problems: list[str] = []
    damaged_files = set()
    bar = tqdm(total=sum(e["bytes"] for e in manifest["files"]), desc="checking files", unit="B", unit_scale=True,
               disable=None if progress else True, leave=False)
    for entry in manifest["files"]:
        path = dest / entry["path"]
        size = path.stat().st_size if path.exists() else None
        if size is None:
            problems.append(f"{path}: missing")
            damaged_files.add(entry["path"])
        elif size != entry["bytes"]:
            problems.append(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
            damaged_files.add(entry["path"])
        elif entry.get("sha256"):  # the bar moves as the bytes are hashed: one LMDB file can be most of them
            if sha256_file(path, progress=bar.update) != entry["sha256"]:
                problems.append(f"{path}: sha256 differs from the manifest (the file's bytes changed)")
                damaged_files.add(entry["path"])
            continue
        bar.update(entry["bytes"])
    bar.close()
    try:
        # the reader is not told the sha256 of a file found damaged (LMDB's index checks its own): the checks
        # below read it, to name what differs
        told = {**manifest, "files": [{k: v for k, v in e.items() if k != "sha256" or e["path"] not in damaged_files}
                                      for e in manifest["files"]]}
        reader = open_reader(dest, manifest=told)
        reader.open()
    except PackerError as exc:
        return [*problems, str(exc)]
    problems += reader.count_problems()
    problems += _class_count_problems(reader, manifest, dest)
    if damaged_files & set(reader.index_files()):  # every sample's label and location come from it
        deep = True
    if damaged_files or deep:
        problems += _check_samples(reader, manifest, deep, damaged_files, progress)
    problems += reader.member_problems(deep, damaged_files)
    return problems


def _class_count_problems(reader: Reader, manifest: dict, dest: Path) -> list[str]:
    """The manifest's ``class_counts`` (what ``packer info`` shows) against the data's."""
    recorded = manifest.get("class_counts")
    if recorded is None or not manifest["classes"]:
        return []
    try:
        found = reader.class_counts().tolist()
    except PackerError as exc:
        return [str(exc)]
    if found != recorded:
        k = next((i for i, (a, b) in enumerate(zip(found, recorded, strict=False)) if a != b), 0)
        return [f"{dest / 'manifest.json'}: 'class_counts' says {recorded[k]} samples of class "
                f"{manifest['classes'][k]!r}, the data holds {found[k]}; re-pack"]
    return []


def _verify_url(url: str, deep: bool = False) -> list[str]:
    """The problems found in the dataset at ``url`` (parsed, without a trailing slash): its damaged objects, else
    :func:`verify`'s on a fresh copy, with the copy's folder replaced by the URL in each line."""
    damaged: list[str] = []
    with tempfile.TemporaryDirectory(prefix="verify-", dir=Cache(None).root) as fresh:
        view = resolve(url, None, fresh, None, damaged=damaged)
        if damaged:
            return damaged
        try:
            problems = verify(view, deep=deep)
        except PackerError as exc:
            problems = [str(exc)]
        release(view)
    return [p.replace(str(view), url) for p in problems]


def _check_samples(reader: Reader, manifest: dict, deep: bool, damaged_files: set[str],
                   progress: bool = False) -> list[str]:
    problems = []
    low, high = label_bounds(manifest)
    shape = manifest.get("shape")
    decoding = Decoding(reader)
    fields = FieldDecoder(reader.schema, reader.schema)  # deep: every field decoded, a mask against its image
    for i in tqdm(range(len(reader)), desc="decoding samples" if deep else "checking samples", unit="img",
                  disable=None if progress else True, leave=False):
        if not deep and reader.sample_file(i) not in damaged_files:
            continue
        where = reader.describe(i)
        try:
            sample = reader.read(i)
            if sample.crc32 is not None and zlib.crc32(sample.payload) != sample.crc32:
                problems.append(f"{where}: checksum mismatch, the stored bytes are damaged")
                continue
            if not low <= sample.label < high:
                problems.append(f"{where}: label {sample.label} is not a class index ({low}..{high - 1})")
            else:
                reader.check_label(i, sample.label)
            raw = reader.read_fields(i, verify=True)  # the extra fields' checksum
            if deep:
                arr = fields.sample_values(decoding, i, sample, raw, 0)["image"]
                if tuple(arr.shape) != tuple(sample.shape):
                    problems.append(f"{where}: decodes to {tuple(arr.shape)}, recorded as {tuple(sample.shape)}")
                elif shape and tuple(arr.shape) != tuple(shape):
                    problems.append(f"{where}: decodes to {tuple(arr.shape)}, the manifest says every image is "
                                    f"{tuple(shape)}")
        except PackerError as exc:
            problems.append(str(exc))
    return problems

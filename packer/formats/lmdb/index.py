"""The LMDB label-and-size index (``lmdb_index.npy`` beside ``data.mdb``): what ``packer info``, class counts,
stored sizes and blocks need of every record, without reading the records.

A record's header lies at the start of its value, and a value larger than about half a page lies on overflow
pages of its own, spread through the file between the tree's pages: reading every header reads a page of every
record, and the kernel's read-ahead around each reads most of the file. The index holds one row a record
(:data:`INDEX_DTYPE`, the layout the package's docstring documents), written at pack time by :func:`scan_index`,
which walks the B-tree's branch and leaf pages (:func:`~packer.formats.lmdb.pages.record_ranges`: no overflow page)
and then reads only each record's 24-byte header, through a map that reads no page around the ones touched. A
dataset packed before the index existed gets the same scan once, said on stderr, and kept in the packer cache
folder (:func:`cached_index`; never in the dataset's folder), keyed by the data file's identity.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import sys
from pathlib import Path

import numpy as np

from ...errors import CorruptDataError
from ...manifest import sha256_file
from ..advice import NPY_ERRORS, map_npy
from ..layout import LocalSource
from ..local_blocks import layout_folder
from .pages import record_ranges
from .records import HEADER, KEY_DIGITS, MAGIC, MAGIC_FIELDS

INDEX = "lmdb_index.npy"
# one row a record, by key: its label, payload bytes, and where its value lies in data.mdb
INDEX_DTYPE = np.dtype([("label", "<i4"), ("size", "<u4"), ("offset", "<u8"), ("record", "<u4")])
# a record header's fields, as records.HEADER packs them
_HEADER_DTYPE = np.dtype([("magic", "S4"), ("label", "<i4"), ("crc", "<u4"), ("height", "<u2"), ("width", "<u2"),
                          ("channels", "u1"), ("reserved", "u1"), ("path", "<u2"), ("size", "<u4")])
_CHUNK = 1 << 16  # headers gathered at a time: bounds the scan's memory
_SAID: set[str] = set()
_CHECKED: set[tuple] = set()  # the index files whose sha256 this process checked: (path, inode, size, mtime, sha)


def scan_index(root: Path, count: int) -> np.ndarray:
    """The index rows of the ``count`` records in ``root/data.mdb``: the tree's branch and leaf pages give each
    value's place and length, then each record's header is read where its value starts (one page a record, no
    read-ahead around it).

    Raises:
        CorruptDataError: the file is not packer's LMDB of ``count`` records, or a record's header is damaged
            (one line naming the record).
    """
    path = root / "data.mdb"
    start, end = record_ranges(LocalSource(root), "data.mdb", count, KEY_DIGITS, str(path))
    rows = np.zeros(count, INDEX_DTYPE)
    rows["offset"], rows["record"] = start, end - start
    short = np.flatnonzero(end - start < HEADER.size)
    if len(short):
        raise CorruptDataError(f"{path} sample {int(short[0])}: record is {int(end[short[0]] - start[short[0]])} "
                               "bytes, shorter than its header; re-pack")
    if count == 0:
        return rows
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            mapped.madvise(mmap.MADV_RANDOM)  # a header's page, not the kernel's read-ahead window around it
        data = np.frombuffer(mapped, np.uint8)
        try:
            for at in range(0, count, _CHUNK):
                heads = data[start[at:at + _CHUNK, None] + np.arange(HEADER.size)].view(_HEADER_DTYPE)[:, 0]
                _check_headers(heads, end[at:at + _CHUNK] - start[at:at + _CHUNK], at, path)
                rows["label"][at:at + _CHUNK] = heads["label"]
                rows["size"][at:at + _CHUNK] = heads["size"]
        finally:
            del data  # the map exports its buffer until then
    return rows


def _check_headers(heads: np.ndarray, lengths: np.ndarray, first: int, path: Path) -> None:
    """As :func:`~packer.formats.lmdb.records.parse_record` checks one header: the magic, and the header, path
    and payload filling the value (``PKR1``) or fitting in it (``PKR2``, fields after the payload)."""
    used = HEADER.size + heads["path"].astype(np.int64) + heads["size"].astype(np.int64)
    plain, fields = heads["magic"] == MAGIC, heads["magic"] == MAGIC_FIELDS
    bad = ~((plain & (used == lengths)) | (fields & (used <= lengths)))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        what = "bad magic" if not (plain[k] or fields[k]) else "its length does not match its header"
        raise CorruptDataError(f"{path} sample {first + k}: record header is damaged ({what}); re-pack")


def save_index(path: Path, rows: np.ndarray) -> None:
    """Save ``rows`` at ``path``, whole or not at all (under a temporary name of this process, then renamed)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, rows, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def check_index(rows: np.ndarray, count: int, path: object) -> np.ndarray:
    """``rows`` when they are an index of ``count`` records; else a one-line :class:`CorruptDataError` naming
    ``path``."""
    if rows.dtype != INDEX_DTYPE or rows.shape != (count,):
        raise CorruptDataError(f"{path}: not an LMDB index of {count} records ({rows.dtype}, {rows.shape}); the "
                               "dataset is damaged, run `packer verify` and re-pack")
    return rows


def check_sha(path: Path, sha256: str | None) -> None:
    """The index's bytes against ``sha256`` (the manifest's; None checks nothing): read whole once a process and
    file (forked workers inherit the check).

    Raises:
        CorruptDataError: they differ, or the file cannot be read (one line naming it): its labels would be
            wrong, so it is not used whole.
    """
    if sha256 is None:
        return
    try:
        stat = os.stat(path)
        checked = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, sha256)
        if checked not in _CHECKED:
            if sha256_file(path) != sha256:
                raise CorruptDataError(f"{path}: sha256 differs from the manifest (the LMDB index's bytes changed); "
                                       "run `packer verify` and re-pack")
            _CHECKED.add(checked)
    except OSError as exc:
        raise CorruptDataError(f"{path}: cannot read the LMDB index ({exc}); run `packer verify` and re-pack") from None


def map_index(path: Path, count: int) -> tuple[np.ndarray, mmap.mmap]:
    """The index at ``path`` and its map, mapped for random access (20 bytes a record: a batch reads the pages of
    its rows, :func:`~packer.formats.advice.map_npy`) and its shape checked; its bytes are not read.

    Raises:
        CorruptDataError: the file is missing, unreadable, or not an index of ``count`` records (one line naming
            it).
    """
    try:
        rows, mapped = map_npy(path)
    except NPY_ERRORS as exc:
        raise CorruptDataError(f"{path}: cannot read the LMDB index ({exc}); run `packer verify` and re-pack") from None
    return check_index(rows, count, path), mapped


def load_index(path: Path, count: int, sha256: str | None = None) -> np.ndarray:
    """The index at ``path``, mapped and checked: its shape, and its bytes against ``sha256`` when given
    (:func:`check_sha`, :func:`map_index`)."""
    check_sha(path, sha256)
    return map_index(path, count)[0]


def cached_index(root: Path, manifest: dict, cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """The index of a dataset packed before ``lmdb_index.npy`` existed: :func:`scan_index` once (said on stderr
    once a process), kept in the packer cache folder (``CACHE/layouts``), keyed by ``data.mdb``'s identity (path,
    size, modification time, inode, the manifest's sha256), so a repacked dataset gets its own."""
    count = int(manifest["count"])
    data = root / "data.mdb"
    st = os.stat(data)
    sha = next((f.get("sha256", "") for f in manifest.get("files", []) if f.get("path") == "data.mdb"), "")
    key = f"{os.path.realpath(data)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{sha}:{INDEX_DTYPE.str}"
    folder = layout_folder(cache_dir)
    path = folder / f"lmdb-index-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"
    with contextlib.suppress(CorruptDataError):
        if path.exists():
            return load_index(path, count)
    if os.fspath(root) not in _SAID:
        _SAID.add(os.fspath(root))
        print(f"packer: {root} was packed without an LMDB index ({INDEX}): reading each of its {count:,} records' "
              f"header once, kept in {folder} (re-pack to write one beside the data)", file=sys.stderr)
    rows = scan_index(root, count)
    with contextlib.suppress(OSError):  # a cache that cannot be written: scanned again next time
        save_index(path, rows)
    return rows

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
dtype. Plain py-lmdb reads it: ``lmdb.open(DEST, readonly=True, lock=False)``.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from pathlib import Path
from typing import Any

import lmdb

from ..errors import CorruptDataError, PackerError
from ..manifest import file_entry
from ..transforms import Encoded
from .base import PackedDataset, Sample, Writer, register

HEADER = struct.Struct("<4siIHHBBHI")
MAGIC = b"PKR1"
KEY_DIGITS = 10


def key(index: int) -> bytes:
    return b"%010d" % index


def pack_record(label: int, relpath: str, item: Encoded) -> bytes:
    path = relpath.encode("utf-8")
    h, w, c = item.shape
    return HEADER.pack(MAGIC, label, item.crc32, h, w, c, 0, len(path), len(item.payload)) + path + item.payload


def unpack_record(value: bytes | memoryview, where: str = "record") -> tuple[Sample, str]:
    """Split a record into its sample and relative path; any malformed record is a :class:`CorruptDataError`."""
    view = memoryview(value)
    if len(view) < HEADER.size:
        raise CorruptDataError(f"{where}: record is {len(view)} bytes, shorter than its header; re-pack")
    magic, label, crc, h, w, c, _, path_len, size = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptDataError(f"{where}: record header is damaged (bad magic); re-pack")
    if HEADER.size + path_len + size != len(view):
        raise CorruptDataError(f"{where}: record length does not match its header; re-pack")
    start = HEADER.size + path_len
    try:
        relpath = bytes(view[HEADER.size:start]).decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptDataError(f"{where}: record path is not UTF-8; the record is damaged, re-pack") from None
    return Sample(view[start:], label, (h, w, c), crc), relpath


class LmdbWriter(Writer):
    RESUMES_FROM = "its last committed transaction"
    FILES = ("data.mdb", "lock.mdb")
    COMMIT_BYTES = 256 << 20
    COMMIT_SAMPLES = 2000

    def __init__(self, dest: Path, spec, expected_count: int, options: dict[str, Any]):
        super().__init__(dest, spec, expected_count, options)
        map_size = max(1 << 30, int(options.get("estimated_bytes", 0) * 1.5))
        self.env = lmdb.open(str(dest), map_size=map_size, subdir=True, meminit=False, sync=False,
                             metasync=False, map_async=False, readahead=False, max_dbs=0)
        # commits are the points a conversion can resume from; PACKER_COMMIT_SAMPLES makes them denser (tests)
        self.commit_samples = int(os.environ.get("PACKER_COMMIT_SAMPLES", self.COMMIT_SAMPLES))
        self.pending: list[tuple[bytes, bytes]] = []
        self.pending_bytes = 0

    def write(self, label: int, relpath: str, item: Encoded) -> int | None:
        value = pack_record(label, relpath, item)
        self.pending.append((key(self.count), value))
        self.pending_bytes += len(value)
        self.count += 1
        if len(self.pending) >= self.commit_samples or self.pending_bytes >= self.COMMIT_BYTES:
            self._commit()
            self.env.sync(True)  # the journal may only count what is on disk
            return self.count
        return None

    def restore(self, state: dict[str, Any]) -> int:
        count = int(state["count"])
        with self.env.begin(write=True) as txn:
            cursor = txn.cursor()
            if cursor.set_range(key(count)):
                while cursor.delete():
                    pass
            kept = txn.stat()["entries"]
        if kept != count:
            raise PackerError(f"{self.dest / 'data.mdb'}: holds {kept} records, the progress record says {count}; "
                              "start again with --overwrite")
        self.count = count
        return count

    def _commit(self) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in self.pending:
                        if not txn.put(k, v, append=True):
                            raise PackerError(f"{self.dest}: LMDB refused key {k.decode()} (out of order)")
                break
            except lmdb.MapFullError:
                # The map is only address space on Linux: double it and redo the transaction.
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as exc:  # a failed write (a full disk): the last commit stays intact
                raise OSError(errno.EIO, f"LMDB commit failed: {exc}") from None
        self.pending.clear()
        self.pending_bytes = 0

    def close(self) -> dict[str, Any]:
        self._commit()
        self.env.sync(True)
        self.env.close()
        lock = self.dest / "lock.mdb"
        if lock.exists():
            lock.unlink()  # readers open with lock=False; the lock file is only the writer's
        return {"files": [file_entry(self.dest, "data.mdb")]}

    def abort(self) -> None:
        self.env.close()


_ENVS: dict[str, lmdb.Environment] = {}
_generation = 0


def close_environments() -> None:
    """Close (unmap) every LMDB environment this process's datasets share; they reopen lazily on next use.
    Call it only when no loader is reading: closing a map under a reading thread crashes the process.

    Never at a fork, on either side. In the parent, closing before the fork pulls the map from under its
    reading threads (make_loader's decode and prefetch threads) and crashes it. In the child, py-lmdb's close
    waits for the operations in flight when the process forked, which belonged to threads the child does not
    have: it hangs forever. A forked child instead keeps the environments it inherited (read-only, opened with
    ``lock=False``: no lock table or reader slot is tied to the parent) and begins its own transactions on them;
    py-lmdb refuses to open the same files a second time in one process anyway."""
    global _generation
    for env in _ENVS.values():
        env.close()
    _ENVS.clear()
    _generation += 1


_ENVS_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()  # a parent thread may have held it at the fork


os.register_at_fork(after_in_child=_new_lock_in_child)


def _shared_env(root: Path, readahead: bool) -> lmdb.Environment:
    """py-lmdb refuses to open one path twice in a process, so datasets on the same path share this process's
    environment (read-only, so sharing is safe). Opened under a lock: two threads opening the same dataset at
    once (make_loader's prefetch thread and the main thread) would otherwise both open it, and one would fail."""
    cache_key = os.path.realpath(root)
    env = _ENVS.get(cache_key)
    if env is not None:
        return env
    with _ENVS_LOCK:
        if cache_key not in _ENVS:
            try:
                _ENVS[cache_key] = lmdb.open(str(root), readonly=True, lock=False, readahead=readahead,
                                             meminit=False, max_spare_txns=1, subdir=True)
            except lmdb.Error as exc:
                raise CorruptDataError(f"{root / 'data.mdb'}: cannot open LMDB ({exc}); run `packer verify`") from None
        return _ENVS[cache_key]


class LmdbDataset(PackedDataset):
    """Reads an LMDB dataset: per process, one read-only environment (``lock=False``) and one long-lived
    ``buffers=True`` transaction, so a sample is a view of the memory map until it is decoded.

    ``readahead`` (default True) lets the OS read ahead in the map. Records are whole images, tens of KB and
    more, so without it a cold read faults them in one 4 KB page at a time (measured: 0.03x the folder's
    rate on a cold cache); turn it off only for records much smaller than a page."""

    def __init__(self, root, readahead: bool = True, **kwargs):
        super().__init__(root, **kwargs)
        self.readahead = readahead
        self._count = int(self.manifest["count"])
        self.env = None
        self.txn = None
        self._generation = -1

    def __len__(self) -> int:
        return self._count

    def _handles(self) -> tuple[str, ...]:
        return ("env", "txn")

    def _open(self) -> None:
        # LMDB maps the whole file and trusts it: reading a page past the end of a truncated file is SIGBUS, so a
        # file shorter than the manifest says is refused before it is mapped
        path = self.root / "data.mdb"
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise CorruptDataError(f"{path}: cannot read ({exc.strerror}); run `packer verify`") from None
        expected = next((f["bytes"] for f in self.manifest.get("files", []) if f.get("path") == "data.mdb"), 0)
        if size < expected:
            raise CorruptDataError(f"{path}: {size} bytes, the manifest says {expected}: the file is truncated; "
                                   "run `packer verify` and re-pack")
        self.env = _shared_env(self.root, self.readahead)
        self.txn = self.env.begin(buffers=True)
        self._generation = _generation

    def _ensure_open(self) -> None:
        if self._pid is not None and self._generation != _generation:
            self._pid = None  # close_environments() closed this process's environments
        super()._ensure_open()

    def _value(self, index: int) -> memoryview:
        try:
            value = self.txn.get(key(index))
        except lmdb.Error as exc:
            raise CorruptDataError(f"{self._describe(index)}: LMDB read failed ({exc}); run `packer verify`") from None
        if value is None:
            raise CorruptDataError(f"{self._describe(index)}: record missing; the dataset is damaged, re-pack")
        return value

    def _get(self, index: int) -> tuple[Sample, str]:
        return unpack_record(self._value(index), self._describe(index))

    def _read(self, index: int) -> Sample:
        # the hot path: check the header and slice the payload, without decoding the path or naming the sample
        value = self._value(index)
        if len(value) >= HEADER.size:
            magic, label, crc, h, w, c, _, path_len, size = HEADER.unpack_from(value)
            start = HEADER.size + path_len
            if magic == MAGIC and start + size == len(value):
                return Sample(value[start:], label, (h, w, c), crc)
        return self._get(index)[0]  # raises the detailed error

    def relpath(self, index: int) -> str:
        index = self._check_index(index)
        self._ensure_open()
        return self._get(index)[1]

    def _describe(self, index: int) -> str:
        return f"{self.root / 'data.mdb'} sample {index}"


register("lmdb", LmdbWriter, LmdbDataset)

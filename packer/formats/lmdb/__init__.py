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
dtype. A dataset with fields beyond the image and its class (the manifest's ``fields``) has records with magic
``PKR2``, whose payload is followed by the extra fields, in the manifest's order (skipping ``image`` and the
class): a uint32 crc32 of them (:func:`packer.fields.fields_crc32`), a uint32 count n, n uint32 lengths, then
the n values end to end (their bytes as :mod:`packer.fields` stores them). Plain py-lmdb reads it:
``lmdb.open(DEST, readonly=True, lock=False)``.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ...errors import CorruptDataError, PackerError, UsageError
from ...fields import Field, fields_crc32
from ...images.transforms import Encoded
from ...manifest import file_entry
from ..base import Reader, Sample, Writer, blocks_by_size, register
from ..identity import FileId, changed_error, check_unchanged, file_id
from ..layout import Layout, RangeSource
from .pages import record_ranges

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


class LmdbWriter(Writer):
    RESUMES_FROM = "its last committed transaction"
    FILES = ("data.mdb", "lock.mdb")
    COMMIT_BYTES = 64 << 20  # the pending records and the transaction's dirty pages: twice this at a commit
    COMMIT_SAMPLES = 2000

    def __init__(self, dest: Path, spec, expected_count: int, options: dict[str, Any]):
        super().__init__(dest, spec, options)
        # PACKER_LMDB_MAP_BYTES starts from a smaller map, so that tests reach the map growth in _commit
        map_size = (int(os.environ.get("PACKER_LMDB_MAP_BYTES", 0))
                    or max(1 << 30, int(options.get("estimated_bytes", 0) * 1.5)))
        self.env = self._open_env(map_size)
        # commits are the points a conversion can resume from; PACKER_COMMIT_SAMPLES makes them denser (tests)
        self.commit_samples = int(os.environ.get("PACKER_COMMIT_SAMPLES", self.COMMIT_SAMPLES))
        self.pending: list[tuple[bytes, bytes]] = []
        self.pending_bytes = 0

    def _open_env(self, map_size: int) -> lmdb.Environment:
        return lmdb.open(str(self.dest), map_size=map_size, subdir=True, meminit=False, sync=False, metasync=False,
                         map_async=False, readahead=False, max_dbs=0)

    def write(self, label: int, relpath: str, item: Encoded, extras: tuple[bytes, ...] = ()) -> int | None:
        value = pack_record(label, relpath, item, tuple(extras) if self.extra_fields else None)
        self.pending.append((key(self.count), value))
        self.pending_bytes += len(value)
        self.count += 1
        if len(self.pending) >= self.commit_samples or self.pending_bytes >= self.COMMIT_BYTES:
            self._commit()
            self.env.sync(True)  # the journal may only count what is on disk
            # the map's pages the transactions touched stay in this process's RSS while it is mapped (they are
            # the whole file by the end): a fresh map after each commit keeps the writer's memory flat
            map_size = self.env.info()["map_size"]
            self.env.close()
            self.env = self._open_env(map_size)
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


class _SharedEnv:
    """An environment this process opened (or inherited at a fork), and the readers that read it."""

    def __init__(self, env: lmdb.Environment, path: Path):
        self.env = env
        self.path = path
        self.pid = os.getpid()
        self.users: weakref.WeakSet = weakref.WeakSet()


# by the (st_dev, st_ino) of data.mdb: py-lmdb refuses to open the same file twice in a process, and a DEST
# repacked with --overwrite has a new data.mdb (another inode while the old one is mapped) under the same path
_ENVS: dict[tuple[int, int], _SharedEnv] = {}
_generation = 0


def close_environments() -> None:
    """Close (unmap) every LMDB environment this process's readers share; they reopen lazily on next use.
    Call it only when no loader is reading: closing a map under a reading thread crashes the process.

    Never at a fork, on either side. In the parent, closing before the fork pulls the map from under its
    reading threads (make_loader's decode and prefetch threads) and crashes it. In the child, py-lmdb's close
    waits for the operations in flight when the process forked, which belonged to threads the child does not
    have: it hangs forever. A forked child instead keeps the environments it inherited (read-only, opened with
    ``lock=False``: no lock table or reader slot is tied to the parent) and begins its own transactions on them;
    py-lmdb refuses to open the same files a second time in one process anyway."""
    global _generation
    for shared in _ENVS.values():
        shared.env.close()
    _ENVS.clear()
    _generation += 1


_ENVS_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()  # a parent thread may have held it at the fork


os.register_at_fork(after_in_child=_new_lock_in_child)


def _close_unused() -> None:
    """Close the environments of replaced files that no dataset reads any more, so that the deleted files'
    space is given back; only those this process opened (closing an inherited one hangs, see above). A thread
    reading through an environment holds its reader, so no reader is left on a closed map."""
    for key, shared in list(_ENVS.items()):
        now = file_id(shared.path)
        if shared.pid == os.getpid() and not shared.users and (now is None or (now.dev, now.ino) != key):
            shared.env.close()
            del _ENVS[key]


def _shared_env(root: Path, recorded: FileId, readahead: bool, user: LmdbReader) -> lmdb.Environment:
    """The environment of the data file noted as ``recorded``: this process's (or the one it inherited), shared
    by every reader of that file (read-only, so sharing is safe), else opened now, after checking that the
    file at the path is still that one. Opened under a lock: two threads opening the same dataset at once
    (make_loader's prefetch thread and the main thread) would otherwise both open it, and one would fail."""
    path = root / "data.mdb"
    key = (recorded.dev, recorded.ino)
    with _ENVS_LOCK:
        shared = _ENVS.get(key)
        if shared is None:
            _close_unused()
            try:
                env = lmdb.open(str(root), readonly=True, lock=False, readahead=readahead, meminit=False,
                                max_spare_txns=1, subdir=True)
            except lmdb.Error as exc:
                raise CorruptDataError(f"{path}: cannot open LMDB ({exc}); run `packer verify`") from None
            if file_id(path) != recorded:  # replaced between the check and the open
                env.close()
                raise changed_error(path)
            shared = _ENVS[key] = _SharedEnv(env, path)
        shared.users.add(user)
        return shared.env


class LmdbReader(Reader):
    """Reads an LMDB dataset: per process, one read-only environment (``lock=False``) and one long-lived
    ``buffers=True`` transaction, so a sample is a view of the memory map until it is decoded.

    Readers of the same ``data.mdb`` share its environment. A DEST repacked with ``--overwrite`` holds a new
    file: a new dataset opens it, an open one (and its forked workers) keeps reading its own, and one whose file
    was replaced before its first read refuses (see :mod:`packer.formats.identity`).

    ``readahead`` (default True) lets the OS read ahead in the map. Records are whole images, tens of KB and
    more, so without it a cold read faults them in one 4 KB page at a time, far slower than the folder on a
    cold cache (docs/measurements.md); turn it off only for records much smaller than a page."""

    HANDLES = ("env", "txn")

    @classmethod
    def close_process_handles(cls) -> None:
        """The environments readers share per process and path: :func:`close_environments`."""
        close_environments()

    def __init__(self, root, manifest: dict | None = None, readahead: bool = True):
        super().__init__(root, manifest)
        self.readahead = readahead
        self._count = int(self.manifest["count"])
        self.env = None
        self.txn = None
        self._generation = -1
        self._file_id = file_id(self.root / "data.mdb")  # the file the manifest just read describes
        self._data_name = str(self.root / "data.mdb")  # once: every decoded sample names itself for its errors

    def _check_size(self, now: FileId) -> None:
        """LMDB maps the whole file and trusts it: reading a page past the end of a truncated file is SIGBUS, so
        a file shorter than the manifest says is refused before it is mapped."""
        path = self.root / "data.mdb"
        expected = next((f["bytes"] for f in self.manifest.get("files", []) if f.get("path") == "data.mdb"), 0)
        if now.size < expected:
            raise CorruptDataError(f"{path}: {now.size} bytes, the manifest says {expected}: the file is "
                                   "truncated; run `packer verify` and re-pack")

    def _check_data(self) -> None:
        """Check the records against the manifest before anything is sized from it: as many records as the
        count, keys 0 to count-1 (the first and the last record), and those two well-formed samples. Every read
        checks its record's header and label again."""
        path = self.root / "data.mdb"
        recorded, now = self._file_id, file_id(path)
        if recorded is None or now is None:
            return  # missing: opening says so, naming the file
        check_unchanged(path, recorded, now)  # replaced since the manifest was read
        self._check_size(now)
        env = _shared_env(self.root, recorded, self.readahead, self)
        with env.begin(buffers=True) as txn:
            entries = txn.stat()["entries"]
            if entries != self._count:
                raise self.bad_count(path, entries)
            if not entries:
                return
            cursor = txn.cursor()
            for position, index in ((cursor.first, 0), (cursor.last, self._count - 1)):
                if not position() or bytes(cursor.key()) != key(index):
                    raise CorruptDataError(f"{path}: the records are not keyed 0..{self._count - 1} (found "
                                           f"{bytes(cursor.key())[:12]!r}); the dataset is damaged, re-pack")
                sample, _ = unpack_record(cursor.value(), self.describe(index))
                self.check_labels(self.describe(index), np.array([sample.label]))
                self.check_shapes(self.describe(index), np.array([sample.shape]))

    def __len__(self) -> int:
        self.validate()
        return self._count

    def _open(self) -> None:
        path = self.root / "data.mdb"
        now = file_id(path)
        recorded = self._file_id = self._file_id or now
        inherited = recorded is not None and (recorded.dev, recorded.ino) in _ENVS
        if not inherited or (now is not None and (now.dev, now.ino) == (recorded.dev, recorded.ino)):
            # the file at the path is the one to read: it must be there, unchanged since the manifest was read,
            # and whole. LMDB maps the whole file and trusts it: reading a page past the end of a truncated file
            # is SIGBUS, so a file shorter than the manifest says is refused before it is mapped
            if now is None:
                try:
                    path.stat()
                except OSError as exc:
                    raise CorruptDataError(f"{path}: cannot read ({exc.strerror}); run `packer verify`") from None
                raise changed_error(path)
            check_unchanged(path, recorded, now)
            self._check_size(now)
        # else: a file this process already reads (a forked worker, a dataset opened before DEST was repacked)
        self.env = _shared_env(self.root, recorded, self.readahead, self)
        self.txn = self.env.begin(buffers=True)
        self._generation = _generation
        entries = self.env.stat()["entries"]
        if entries != self._count:  # cheap (the meta page), and fewer records would read as a shorter dataset
            raise CorruptDataError(f"{path}: holds {entries} records, the manifest says {self._count}; "
                                   "run `packer verify`")

    def open(self) -> None:
        if self._pid is not None and self._generation != _generation:
            self._pid = None  # close_environments() closed this process's environments
        super().open()

    def _value(self, index: int) -> memoryview:
        try:
            value = self.txn.get(key(index))
        except lmdb.Error as exc:
            raise CorruptDataError(f"{self.describe(index)}: LMDB read failed ({exc}); run `packer verify`") from None
        if value is None:
            raise CorruptDataError(f"{self.describe(index)}: record missing; the dataset is damaged, re-pack")
        return value

    def _get(self, index: int) -> tuple[Sample, str]:
        return unpack_record(self._value(index), self.describe(index))

    def read(self, index: int) -> Sample:
        # the hot path: check the header and slice the payload, without decoding the path or naming the sample
        sample = parse_record(self._value(index), lambda: self.describe(index))[0]
        if not self.label_low <= sample.label < self.label_high:
            self.check_labels(self.describe(index), np.array([sample.label]))
        return sample

    def _fields(self, index: int) -> tuple[tuple[memoryview, ...], int]:
        return record_fields(self._value(index), self.describe(index))

    def read_extras(self, index: int) -> tuple[memoryview | bytes, ...]:
        return self._fields(index)[0]

    def fields_checksum(self, index: int) -> int | None:
        return self._fields(index)[1]

    # -- reading by byte ranges (packer.formats.layout): the same records, found by walking data.mdb's pages ----
    @classmethod
    def layout(cls, manifest: dict, source: RangeSource, where: str) -> Layout:
        """Each record's value in ``data.mdb`` (in its leaf page, or after its overflow page's header), from the
        B-tree's pages read by ranges, one round trip per tree level (:func:`lmdb_pages.record_ranges`; no
        py-lmdb, no payload read). ``index`` is empty: each record carries its own header.

        Raises:
            UsageError: a dataset converted in parts, or an LMDB file of another build than py-lmdb's here.
            CorruptDataError: ``data.mdb`` is damaged, or not keyed ``0..count-1`` as the manifest counts.
        """
        if manifest.get("parts") is not None:
            raise UsageError(f"{where}: converted in {len(manifest['parts'])} parts, each its own data.mdb: it "
                             "cannot be read a block at a time; raise cache_limit to the dataset's size")
        name = f"{str(where).rstrip('/')}/data.mdb"
        count = int(manifest["count"])
        start, end = record_ranges(source, "data.mdb", count, KEY_DIGITS, name)
        layout = Layout(("data.mdb",), np.zeros(count, np.int32), start, end)
        layout.check(count, [source.size("data.mdb")], name)
        return layout

    @classmethod
    def ranged_sample(cls, index: int, data: memoryview, layout: Layout, where: str) -> Sample:
        """:meth:`read` of sample ``index`` from its record's bytes (``data``: the LMDB value), parsed as
        :meth:`read` parses it; ``where``, the dataset's URL or folder, names it in errors (only then). The label
        is NOT checked against the dataset's classes here (a classmethod has no manifest): the caller does, with
        :meth:`Reader.check_labels` (and :meth:`Reader.checked` checks the crc32 and the class folder)."""
        return parse_record(data, lambda: layout.sample_name(where, index))[0]

    @classmethod
    def ranged_extras(cls, index: int, data: memoryview, layout: Layout, extras: Sequence[Field],
                      where: str) -> tuple[memoryview | bytes, ...]:
        """:meth:`read_extras` of sample ``index`` from its record's bytes; :class:`CorruptDataError` naming
        the sample (from ``where``, as :meth:`ranged_sample`) when the record holds another number of fields than
        ``extras``."""
        sample = layout.sample_name(where, index)
        values = record_fields(data, sample)[0]
        if len(values) != len(extras):
            raise CorruptDataError(f"{sample}: holds {len(values)} fields, the manifest says {len(extras)}; run "
                                   "`packer verify`")
        return values

    @classmethod
    def ranged_fields_checksum(cls, index: int, data: memoryview, layout: Layout) -> int | None:
        """:meth:`fields_checksum` of sample ``index`` from its record's bytes (errors name its file and index)."""
        return record_fields(data, f"{layout.files[int(layout.file[index])]} sample {index}")[1]

    def blocks(self, target_bytes: int) -> np.ndarray:
        """Index ranges of about ``target_bytes`` of records: records are written in index order, so their
        values lie in the file roughly in that order. The sizes come from the B-tree's leaves (a large value's
        own pages are not read)."""
        self.open()
        sizes = np.fromiter((len(value) for _, value in self.txn.cursor()), np.int64, self._count)
        return blocks_by_size(sizes, target_bytes)

    def relpath(self, index: int) -> str:
        self.open()
        return self._get(index)[1]

    def describe(self, index: int) -> str:
        return f"{self._data_name} sample {index}"

    def sample_file(self, index: int) -> str:
        return "data.mdb"

    def count_problems(self) -> list[str]:
        entries = self.env.stat()["entries"]
        count = self.manifest["count"]
        if entries != count:
            return [f"{self.root / 'data.mdb'}: {entries} records, the manifest says {count}"]
        return []


register("lmdb", LmdbWriter, LmdbReader)

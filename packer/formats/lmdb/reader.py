"""The LMDB reader: one environment per process and path, shared by the readers of that path, records parsed
without copying, checked against the manifest, each batch's records read ahead exactly (their ranges from the
label-and-size index, :mod:`.index`), and read a block at a time by ranges."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import lmdb
import numpy as np

from ...errors import CorruptDataError, UsageError
from ...fields import Field
from ..advice import read_whole, will_need
from ..base import Reader, Sample, blocks_by_size
from ..identity import FileId, changed_error, check_unchanged, file_id
from ..layout import Layout, RangeSource
from .index import INDEX, cached_index, check_sha, map_index, scan_index
from .pages import record_ranges
from .records import KEY_DIGITS, key, parse_record, record_fields, unpack_record


class _SharedEnv:
    """An environment this process opened (or inherited at a fork), the data file opened once more for read
    advice (:func:`~packer.formats.advice.will_need`), and the readers that read it."""

    def __init__(self, env: lmdb.Environment, path: Path, advice: BinaryIO):
        self.env = env
        self.path = path
        self.advice = advice
        self.pid = os.getpid()
        self.users: weakref.WeakSet = weakref.WeakSet()

    def close(self) -> None:
        self.env.close()
        self.advice.close()


# by the (st_dev, st_ino) of data.mdb: py-lmdb refuses to open the same file twice in a process, and a DEST
# repacked with --overwrite has a new data.mdb (another inode while the old one is mapped) under the same path
_ENVS: dict[tuple[int, int], _SharedEnv] = {}
_generation = 0  # bumped by close_environments: a reader's handle from before it is reopened


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
        shared.close()
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
    for env_key, shared in list(_ENVS.items()):
        now = file_id(shared.path)
        if shared.pid == os.getpid() and not shared.users and (now is None or (now.dev, now.ino) != env_key):
            shared.close()
            del _ENVS[env_key]


def _shared_env(root: Path, recorded: FileId, user: LmdbReader) -> _SharedEnv:
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
                # readahead=False: the map is advised for random access (a fault reads its own page, not the
                # kernel's read-ahead window around it); the reader advises each batch's records instead
                env = lmdb.open(str(root), readonly=True, lock=False, readahead=False, meminit=False,
                                max_spare_txns=1, subdir=True)
            except lmdb.Error as exc:
                raise CorruptDataError(f"{path}: cannot open LMDB ({exc}); run `packer verify`") from None
            try:
                advice = open(path, "rb", buffering=0)  # noqa: SIM115 - closed with the environment
            except OSError as exc:
                env.close()
                raise CorruptDataError(f"{path}: cannot read ({exc.strerror}); run `packer verify`") from None
            if file_id(path) != recorded or FileId.of(os.fstat(advice.fileno())) != recorded:  # replaced meanwhile
                env.close()
                advice.close()
                raise changed_error(path)
            shared = _ENVS[key] = _SharedEnv(env, path, advice)
        shared.users.add(user)
        return shared


class LmdbReader(Reader):
    """Reads an LMDB dataset: per process, one read-only environment (``lock=False``) and one long-lived
    ``buffers=True`` transaction, so a sample is a view of the memory map until it is decoded.

    Readers of the same ``data.mdb`` share its environment. A DEST repacked with ``--overwrite`` holds a new
    file: a new dataset opens it, an open one (and its forked workers) keeps reading its own, and one whose file
    was replaced before its first read refuses (see :mod:`packer.formats.identity`).

    ``readahead`` (default True) has the kernel read each record a read asks for ahead, exactly its bytes
    (its range from the index, :mod:`.index`; :func:`~packer.formats.advice.will_need`), all of a batch's at
    once. Records are whole images, tens of KB and more, so without it a cold read faults them in one 4 KB page
    at a time, far slower than the folder on a cold cache (docs/benchmarks.md); turn it off only for records
    much smaller than a page. Either way nothing around a record is read: the map is advised for random access,
    so a cold first batch reads its own records, not the kernel's read-ahead window around each.

    Labels, stored sizes and blocks come from the label-and-size index (``lmdb_index.npy``; for a dataset packed
    before it, a scan made once and kept in the packer cache folder: :func:`~.index.cached_index`), never from
    the records."""

    HANDLES = ("env", "txn", "_rows", "_rows_map", "_advice")

    @classmethod
    def close_process_handles(cls) -> None:
        """The environments readers share per process and path: :func:`close_environments`."""
        close_environments()

    def __init__(self, root, manifest: dict | None = None, readahead: bool = True):
        super().__init__(root, manifest)
        self.readahead = readahead
        self._count = int(self.manifest["count"])
        self.env: Any = None  # this process's lmdb Environment and read transaction (HANDLES), None until _open()
        self.txn: Any = None
        self._rows: np.ndarray | None = None  # the label-and-size index, mapped on first use
        self._rows_map: Any = None  # the map it views (None: the scan of a dataset packed before it, in memory)
        self._rows_checked = False  # whether the whole index was checked (index_rows(whole=True))
        self._advice: int | None = None  # this process's descriptor of data.mdb for read advice
        self._generation = -1
        self._file_id = file_id(self.root / "data.mdb")  # the file the manifest just read describes
        listed = {e.get("path") for e in self.manifest.get("files", []) if isinstance(e, dict)}
        self._index_id = file_id(self.root / INDEX) if INDEX in listed else None  # None: packed before the index
        self._has_index = INDEX in listed
        self._index_sha = next((e.get("sha256") for e in self.manifest.get("files", [])
                                if isinstance(e, dict) and e.get("path") == INDEX), None)
        self._data_name = str(self.root / "data.mdb")  # once: every decoded sample names itself for its errors
        self._data_bytes = next((f["bytes"] for f in self.manifest.get("files", []) if f.get("path") == "data.mdb"), 0)
        # the most any index row may place a record at: the manifest's size (a truncated file is refused on open)
        self._data_end = self._data_bytes or (self._file_id.size if self._file_id is not None else 0)

    def _check_size(self, now: FileId) -> None:
        """LMDB maps the whole file and trusts it: reading a page past the end of a truncated file is SIGBUS, so
        a file shorter than the manifest says is refused before it is mapped."""
        path = self.root / "data.mdb"
        expected = self._data_bytes
        if now.size < expected:
            raise CorruptDataError(f"{path}: {now.size} bytes, the manifest says {expected}: the file is "
                                   "truncated; run `packer verify` and re-pack")

    def _check_data(self) -> None:
        """Check the records against the manifest before anything is sized from it: as many records as the
        count, keys 0 to count-1 (the first and the last record), and those two well-formed samples. Every read
        checks its record's header and label again; the index is checked where it is used whole
        (:meth:`index_rows`), not here: a sample's label and bytes come from its record, never from the index."""
        path = self.root / "data.mdb"
        recorded, now = self._file_id, file_id(path)
        if recorded is None or now is None:
            return  # missing: opening says so, naming the file
        check_unchanged(path, recorded, now)  # replaced since the manifest was read
        self._check_size(now)
        env = _shared_env(self.root, recorded, self).env
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

    def index_rows(self, whole: bool = False) -> np.ndarray:
        """The label-and-size index, one row a record (:data:`.index.INDEX_DTYPE`): ``lmdb_index.npy``, mapped
        (a batch's read-ahead reads its rows' pages, nothing else); for a dataset packed before it, the scan
        :func:`~.index.cached_index` keeps (made once, said on stderr). With ``whole``, for what uses every row
        (class counts, sizes, blocks), it is checked first, once: its bytes against the manifest's sha256 and
        every label a class index."""
        if self._rows is None:
            path = self.root / INDEX
            if not self._has_index:
                self._rows = cached_index(self.root, self.manifest)
            else:
                now = file_id(path)
                if now is not None:  # missing: mapping says so, naming the file
                    check_unchanged(path, self._index_id, now)  # replaced since the manifest was read
                self._rows, self._rows_map = map_index(path, self._count)
        if whole and not self._rows_checked:
            if self._has_index:
                read_whole(self._rows_map)
                check_sha(self.root / INDEX, self._index_sha)
            self.check_labels(self.root / INDEX, np.asarray(self._rows["label"]))
            self._rows_checked = True
        return self._rows

    def __len__(self) -> int:
        self.validate()
        return self._count

    def _open(self) -> None:
        path = self.root / "data.mdb"
        now = file_id(path)
        recorded = self._file_id = self._file_id or now
        inherited = recorded is not None and (recorded.dev, recorded.ino) in _ENVS
        if recorded is None or not inherited or (
                now is not None and (now.dev, now.ino) == (recorded.dev, recorded.ino)):
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
        assert recorded is not None  # when it is None, so is now: refused above
        shared = _shared_env(self.root, recorded, self)
        self.env, self._advice = shared.env, shared.advice.fileno()
        if self.readahead:
            self.index_rows()
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

    def _read_ahead(self, indices: list[int] | int) -> None:
        """Have the kernel read these records now, exactly their bytes (with ``readahead``)."""
        if self.readahead:
            at = np.asarray(indices, np.int64).reshape(-1)
            rows = self.index_rows()[at]
            start = rows["offset"].astype(np.int64)
            end = start + rows["record"]
            outside = np.flatnonzero((start < 0) | (end > self._data_end))  # never a read of the rest of the file
            if len(outside):
                k = int(outside[0])
                raise CorruptDataError(f"{self.root / INDEX} row {int(at[k])}: places its record at bytes "
                                       f"{int(start[k])}..{int(end[k])}, past data.mdb's {self._data_end}; the "
                                       "index is damaged, run `packer verify` and re-pack")
            will_need(start, end, fd=self._advice)

    def _parsed(self, index: int) -> Sample:
        # the hot path: check the header and slice the payload, without decoding the path or naming the sample
        sample = parse_record(self._value(index), lambda: self.describe(index))[0]
        if not self.label_low <= sample.label < self.label_high:
            self.check_labels(self.describe(index), np.array([sample.label]))
        return sample

    def read(self, index: int) -> Sample:
        self._read_ahead(index)
        return self._parsed(index)

    def read_many(self, indices: list[int]) -> list[Sample]:
        """:meth:`read` of a batch: every record's read started at once, then each parsed."""
        self._read_ahead(indices)
        return [self._parsed(i) for i in indices]

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
        values lie in the file roughly in that order. The sizes come from the index (no record is read)."""
        self.validate()
        return blocks_by_size(np.asarray(self.index_rows(whole=True)["record"], np.int64), target_bytes)

    def class_counts(self) -> np.ndarray:
        """From the index's labels, without reading a record."""
        self.validate()
        labels = np.asarray(self.index_rows(whole=True)["label"], np.int64)
        return np.bincount(labels[labels >= 0], minlength=len(self.manifest["classes"]))

    def stored_sizes(self) -> np.ndarray:
        """Each record's payload bytes, from the index."""
        self.validate()
        return np.asarray(self.index_rows(whole=True)["size"], np.int64)

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

    def member_problems(self, deep: bool, damaged_files: set[str], key_offset: int = 0) -> list[str]:
        """The index against the records (with ``deep``, or when the index is damaged): every row's label, sizes
        and place as a scan of ``data.mdb`` finds them."""
        if not self._has_index or not (deep or INDEX in damaged_files):
            return []
        try:
            found = scan_index(self.root, self._count)
        except CorruptDataError as exc:
            return [str(exc)]
        rows = self.index_rows()
        wrong = np.flatnonzero(np.asarray(rows) != found)
        if not len(wrong):
            return []
        k = int(wrong[0])
        return [f"{self.root / INDEX}: {len(wrong)} row(s) disagree with the records, the first for sample {k} "
                f"(label {int(rows['label'][k])}, the record says {int(found['label'][k])}); re-pack"]

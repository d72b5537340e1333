"""The LMDB writer: records appended in key order, committed in batches whose end the journal records, the map
grown as it fills; the label-and-size index (:mod:`.index`) written beside them at the end."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lmdb

from ...errors import PackerError
from ...images.transforms import Encoded
from ...manifest import file_entry
from ..base import Writer
from .index import INDEX, save_index, scan_index
from .records import key, pack_record


class LmdbWriter(Writer):
    RESUMES_FROM = "its last committed transaction"
    FILES = ("data.mdb", "lock.mdb", INDEX, INDEX + ".*.tmp")
    COMMIT_BYTES = 64 << 20  # the pending records and the transaction's dirty pages: twice this at a commit
    COMMIT_SAMPLES = 2000

    def __init__(self, dest: Path, spec, expected_count: int, options: dict[str, Any]):
        super().__init__(dest, spec, expected_count, options)
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
        # the labels and sizes info, class counts and blocks read, from the records just written (their pages
        # mostly still cached): one scan, the one a dataset packed before the index gets once
        save_index(self.dest / INDEX, scan_index(self.dest, self.count))
        return {"files": [file_entry(self.dest, "data.mdb"), file_entry(self.dest, INDEX)]}

    def abort(self) -> None:
        self.env.close()

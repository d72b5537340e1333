"""A dataset read a block at a time (a URL larger than the local cache): :class:`BlockedReader`, generic over the
formats, which reads each sample from its block's bytes through the format's ``ranged_*`` hooks.

The format computes the dataset's :class:`~packer.formats.layout.Layout` once (cached beside the URL's view);
blocks are runs of consecutive samples in one file (:func:`~packer.formats.layout.span_blocks`), each fetched as
one range and kept by a :class:`BlockStore` (``packer.remote.ranges.RemoteBlocks`` for a URL: the node's cache,
pinned while read). Nothing here knows a URL or a format: ``open_dataset`` joins the two.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import CorruptDataError, UsageError
from .base import Reader, Sample
from .layout import LAYOUT_VERSION, Layout, RangeSource, block_spans, span_blocks
from .parts import dataset_layout

BLOCK_CAP = 64 << 20  # the largest block: a few seconds of decoding on one core
WINDOW = 4  # make_loader's block_window default: the blocks one window of the order mixes
KEEP_BLOCKS = 4  # blocks each process keeps mapped, at least: a window's, as a batch mixes them


class BlockStore(Protocol):
    """Where a :class:`BlockedReader` gets its blocks (for a URL: the node's cache, filled by ranged GETs)."""

    def open(self, relpath: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of ``relpath``, valid for as long as they are referenced."""
        ...

    def hold(self, relpath: str, start: int, end: int, wait: bool = True) -> Callable[[], None] | None:
        """Make the block present and keep it until the returned call; None (without ``wait``) when there is no
        room for it now."""
        ...

    def reader_stuck(self) -> bool:
        """Whether a reader (of any process) has waited for room in the store for a while: blocks held ahead of
        need make way."""
        ...


class BlockedSource(Protocol):
    """A dataset to read a block at a time, as the entry point found it (``packer.remote.ranges.BlockedRemote``)."""

    # read-only: a NamedTuple (BlockedLocal) is one
    @property
    def url(self) -> str: ...
    @property
    def manifest(self) -> dict: ...
    @property
    def view(self) -> Path: ...
    @property
    def source(self) -> RangeSource: ...
    @property
    def store(self) -> BlockStore: ...
    @property
    def limit(self) -> int: ...
    @property
    def total(self) -> int: ...

    def layout_path(self, version: int) -> Path: ...


def block_budget(limit: int, window: int = WINDOW, fetch_ahead: int | None = None,
                 ranks: int | None = None) -> tuple[int, int]:
    """The block size for a cache of ``limit`` bytes, and the blocks each rank's loader fetches ahead.

    The rule: what may be pinned at once fits the cache: each rank's ``fetch_ahead`` blocks (default three
    windows: the one being read, the next, which the batches in flight reach into, and one fetched while those
    are decoded; two left the decoders waiting on fetches, four cut more and smaller blocks, whose requests
    cost more CPU than the waits saved) and one more, room for a block that a worker fetches itself (one the
    fetch-ahead has not fetched or is not fetching: workers that need several take that room in turn), so
    ``block = limit // (ranks * fetch_ahead + 1)``, at most ``BLOCK_CAP`` (``ranks``: the node's,
    ``LOCAL_WORLD_SIZE``, default 1). A worker maps a block the fetch-ahead holds without pinning it, so it
    needs no room of its own for those; a block per worker on top cut smaller blocks, whose requests cost more
    CPU than that room saved. Each process also keeps at least ``KEEP_BLOCKS`` blocks mapped (a worker
    of packer's pool: every block of the batch it decodes), which may outlive their place in the cache
    (evicted, still mapped).
    """
    fetch_ahead = 3 * window if fetch_ahead is None else fetch_ahead
    if ranks is None:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit() else 1
    pinned = max(1, ranks) * fetch_ahead + 1
    return max(1, min(BLOCK_CAP, limit // pinned)), fetch_ahead


_SAID: set[str] = set()


def open_blocked(found: BlockedSource, reader_class: type[Reader], window: int = WINDOW) -> BlockedReader:
    """The :class:`BlockedReader` of ``found`` (its format's ``reader_class``): the layout loaded from the
    cache or computed by the format (then cached), cut into blocks that fit the cache; said once on stderr."""
    path = found.layout_path(LAYOUT_VERSION)
    layout = Layout.load(path) if path.exists() else None
    if layout is None:
        layout = dataset_layout(reader_class, found.manifest, found.source, found.url)
        layout.save(path)
    layout.check(int(found.manifest["count"]), [found.source.size(f) for f in layout.files], found.url)
    block, ahead = block_budget(found.limit, window)
    budget = getattr(found, "budget", "cache_limit")  # the argument that set limit (page_budget: a local folder)
    reader = BlockedReader(reader_class, found.manifest, layout, found.store, found.url, span_blocks(layout, block),
                           found.view, ahead, budget=budget, limit=found.limit)
    if found.url not in _SAID:
        _SAID.add(found.url)
        print(f"packer: {found.url} is {found.total:,} bytes, over {budget} {found.limit:,}: reading it a block "
              f"at a time ({len(reader.starts)} blocks of up to {block:,} bytes, {ahead} "
              f"{'read' if budget == 'page_budget' else 'fetched'} ahead; "
              f"shuffle=True reads it as shuffle='blocks', {window} blocks mixed at a time)", file=sys.stderr)
    return reader


_OPEN: weakref.WeakSet = weakref.WeakSet()  # this process's blocked readers, whose blocks close_all releases


class BlockedReader(Reader):
    """A dataset read a block at a time from a :class:`BlockStore`, through its format's ``ranged_*`` hooks:
    the same samples, labels, shapes and checksums as the format's own reader. Each sample's crc32 is always
    checked (a range carries no sha256). Picklable: a DataLoader worker opens its own blocks. Its errors speak of
    fetched blocks and the cache for a URL, and of the files for a local folder (``budget="page_budget"``).

    Args:
        format_class: the format's reader class (its hooks read the samples).
        manifest: the dataset's manifest.
        layout: its layout (each sample's range, the format's index).
        store: where the blocks come from.
        where: the dataset's URL (or local folder), for messages.
        starts: the block starts (:func:`~packer.formats.layout.span_blocks`).
        root: a local folder for this dataset (the cache's view of the URL).
        fetch_ahead: how many blocks the loader keeps fetched ahead of the batch being read.
        keep: blocks each process keeps open.
        budget: the argument that bounds it: ``"cache_limit"`` (a URL) or ``"page_budget"`` (a local folder).
        limit: that bound, in bytes.
    """

    HANDLES = ("_blocks", "_lock")
    ACCEPTS_PARTS = True  # a conversion made in parts is one layout over its parts' files (dataset_layout)

    def __init__(self, format_class: type[Reader], manifest: dict, layout: Layout, store: BlockStore, where: str,
                 starts: np.ndarray, root: str | os.PathLike, fetch_ahead: int = WINDOW, keep: int = KEEP_BLOCKS,
                 budget: str = "cache_limit", limit: int = 0):
        super().__init__(root, manifest=manifest)
        self.format = format_class.format
        self.format_class = format_class
        self.ranges = layout  # each sample's byte range (not "layout": the classmethod that computes one)
        self.store = store
        self.where = where
        self.starts = np.asarray(starts, dtype=np.int64)
        self.fetch_ahead = fetch_ahead
        self.keep = max(1, keep)
        self.budget = budget
        self.limit = limit
        self.spans = block_spans(layout, self.starts)  # per block: file, start, end
        self._blocks: collections.OrderedDict | None = None
        self._lock: Any = None
        self._batch_blocks = 0  # the blocks of the batch map_blocks mapped last: all kept open

    def __len__(self) -> int:
        return len(self.ranges)

    def _open(self) -> None:
        self._blocks, self._lock = collections.OrderedDict(), threading.Lock()
        _OPEN.add(self)

    def block_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The block of each sample index."""
        return np.searchsorted(self.starts, np.asarray(indices, dtype=np.int64), side="right") - 1

    def block_range(self, block: int) -> tuple[str, int, int]:
        """Block ``block``'s file and byte range ``(relpath, start, end)``."""
        file, start, end = (int(v) for v in self.spans[block])
        return self.ranges.files[file], start, end

    def block_bytes(self) -> np.ndarray:
        """Each block's bytes (its range's length)."""
        return self.spans[:, 2] - self.spans[:, 1]

    def hold_block(self, block: int, wait: bool = False) -> Callable[[], None] | None:
        """Fetch block ``block`` ahead and keep it until the returned call (None: no room now)."""
        return self.store.hold(*self.block_range(block), wait=wait)

    def reader_stuck(self) -> bool:
        """Whether a reader (of any process) has waited for room in the block store for a while (the fetch-ahead
        lets go)."""
        return self.store.reader_stuck()

    def _block(self, block: int) -> memoryview:
        """Block ``block``'s bytes, opened when this process has not kept them, and kept among the last ``keep``
        (or the blocks of the batch :meth:`map_blocks` mapped, where there are more)."""
        self.open()
        assert self._blocks is not None  # open() made it
        with self._lock:
            found = self._blocks.get(block)
            if found is None:
                found = self._blocks[block] = self.store.open(*self.block_range(block))
                while len(self._blocks) > max(self.keep, self._batch_blocks):
                    self._blocks.popitem(last=False)
            else:
                self._blocks.move_to_end(block)
        return found

    def map_blocks(self, indices: Sequence[int]) -> None:
        """Open every block that samples ``indices`` read, and keep them all open until the next call (a
        worker process does this before it decodes a batch: from then on the batch needs none of them in the
        cache, and the loader's fetch-ahead may let them go)."""
        self.open()
        blocks = np.unique(self.block_of(indices)).tolist()
        self._batch_blocks = len(blocks)
        for block in blocks:
            self._block(block)

    def _range(self, index: int) -> memoryview:
        """Sample ``index``'s range bytes, from its block: one sample's lookup without the arrays of
        :meth:`read_many`'s, which cost a per-sample read (a map-style ``__getitem__``) a noticeable share."""
        block = int(np.searchsorted(self.starts, index, side="right")) - 1  # block_of, for one sample
        offset = int(self.spans[block][1])
        return self._cut(index, self._block(block), int(self.ranges.start[index]) - offset,
                         int(self.ranges.end[index]) - offset)

    def _cut(self, index: int, data: memoryview, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of sample ``index``'s block ``data``."""
        if end > len(data):
            fix = (f"the file is shorter than when the dataset was opened; run `packer verify {self.where}` and "
                   "re-pack" if self.local else "the cached block is damaged: delete the cache folder and retry")
            raise CorruptDataError(f"{self.describe(index)}: its block holds {len(data):,} bytes, fewer than its "
                                   f"range needs; {fix}")
        return data[start:end]

    def close_blocks(self) -> None:
        """Let every block this process keeps mapped go (they are mapped again on next use)."""
        if self._blocks is not None and self._pid == os.getpid():
            with self._lock:
                self._blocks.clear()

    @classmethod
    def close_process_handles(cls) -> None:
        for reader in list(_OPEN):
            reader.close_blocks()

    def read(self, index: int) -> Sample:
        return self._checked(index, self._range(index))

    def read_many(self, indices: list[int]) -> list[Sample]:
        """:meth:`read` of a batch: its blocks and ranges looked up at once."""
        if not len(indices):
            return []
        at = np.asarray(indices, dtype=np.int64)
        blocks = self.block_of(at)
        offsets = self.spans[blocks, 1]
        starts, ends = (self.ranges.start[at] - offsets).tolist(), (self.ranges.end[at] - offsets).tolist()
        blocks_list = blocks.tolist()
        data = {block: self._block(block) for block in dict.fromkeys(blocks_list)}
        return [self._checked(index, self._cut(index, data[block], start, end))
                for index, block, start, end in zip(indices, blocks_list, starts, ends, strict=True)]

    def _checked(self, index: int, data: memoryview) -> Sample:
        """Sample ``index`` parsed from its range ``data``, its crc32 and label checked."""
        sample = self.format_class.ranged_sample(index, data, self.ranges, self.where)
        if sample.crc32 is not None and zlib.crc32(sample.payload) != sample.crc32:
            what, fix = ("the file's", "re-pack") if self.local else ("the fetched", "re-pack or re-upload")
            raise CorruptDataError(f"{self.describe(index)}: checksum mismatch, {what} bytes are damaged; run "
                                   f"`packer verify {self.where}` and {fix}")
        if not self.label_low <= sample.label < self.label_high:
            raise CorruptDataError(f"{self.describe(index)}: label {sample.label} is not a class index; the dataset "
                                   f"is damaged, run `packer verify {self.where}`")
        return sample

    def read_extras(self, index: int) -> tuple[memoryview | bytes, ...]:
        return self.format_class.ranged_extras(index, self._range(index), self.ranges, self.extra_fields, self.where)

    def fields_checksum(self, index: int) -> int | None:
        return self.format_class.ranged_fields_checksum(index, self._range(index), self.ranges)

    def read_fields(self, index: int, verify: bool = False) -> dict[str, memoryview | bytes]:
        """:meth:`Reader.read_fields`, always checked against the fields' checksum."""
        return super().read_fields(index, True)

    def check_label(self, index: int, label: int) -> None:
        """Labels are checked against the classes as each sample is read (sample paths are not read)."""

    def blocks(self, target_bytes: int) -> np.ndarray:
        """The blocks the dataset is read by (their size was chosen for its budget when it was opened)."""
        return self.starts

    def relpath(self, index: int) -> str:
        raise UsageError(f"{self.where}: sample paths are not read when a dataset larger than {self.budget} is "
                         f"read a block at a time; raise {self.budget} to the dataset's size to read them")

    @property
    def local(self) -> bool:
        """Whether the dataset is a local folder (read within ``page_budget``), not a URL."""
        return self.budget == "page_budget"

    def describe(self, index: int) -> str:
        return f"{self.where}/{self.sample_file(index)} sample {index}"

    def sample_file(self, index: int) -> str:
        return self.ranges.files[int(self.ranges.file[index])]

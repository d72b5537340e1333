"""Reading an HDF5 file's metadata and small datasets through byte ranges (a :class:`RangeSource`), for the
HDF5 layout (:meth:`packer.formats.hdf5.Hdf5Reader.layout`): h5py opens a :class:`RangeFile`, which fetches the
file in aligned chunks and keeps them, so that HDF5's many small metadata reads cost a few source reads.

A file packer wrote holds its superblock and the images dataset's header in the first chunk, then the images
blob, then everything else (the root group's heap, the other datasets' headers and values): a read past the
first chunk therefore fetches ahead, up to ``TAIL_BYTES``, so that the metadata after the blob and the small
datasets come in one source call.

Only contiguous, unfiltered datasets are read by byte ranges (packer writes no other kind); every extent is
checked against the file's size before anything is sized from it.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

import h5py
import numpy as np

from ...errors import CorruptDataError, UsageError
from ..layout import RangeSource

CHUNK = 1 << 20  # bytes a source read brings (aligned): HDF5's metadata reads are tens to hundreds of bytes
TAIL_BYTES = 64 << 20  # a read past the first chunk fetches ahead this far: the metadata and datasets after the blob


class RangeFile(io.RawIOBase):
    """A read-only file object over one file of a :class:`RangeSource` (what ``h5py.File`` accepts): bytes come
    in ``chunk``-aligned pieces, kept in memory for the object's life.

    Args:
        source: where the file's bytes are.
        relpath: the file, as the source names it.
        where: the file as errors name it.
        chunk: bytes a piece.
        ahead: bytes a read past the first piece fetches beyond what it asks for (when they are not in memory).
    """

    def __init__(self, source: RangeSource, relpath: str, where: str, chunk: int = CHUNK, ahead: int = TAIL_BYTES):
        super().__init__()
        self.source, self.relpath, self.where, self.chunk, self.ahead = source, relpath, where, chunk, ahead
        self.size = int(source.size(relpath))
        self.pos = 0
        self.pieces: dict[int, memoryview] = {}
        self.calls = 0  # source calls made (a read_many of several ranges counts once)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if self.pos >= self.chunk and self.pos // self.chunk not in self.pieces:
            self.fetch([(self.pos, self.pos + len(view) + self.ahead)])
        data = self.pread(self.pos, len(view))
        view[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def fetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Bring the pieces covering each ``[start, end)`` of ``ranges`` into memory: the missing ones in one
        ``read_many``, a run of consecutive pieces in one range."""
        size, chunk = self.size, self.chunk
        wanted: set[int] = set()
        for start, end in ranges:
            start, end = max(0, start), min(size, end)
            if end > start:
                wanted.update(range(start // chunk, (end - 1) // chunk + 1))
        missing = sorted(wanted.difference(self.pieces))
        if not missing:
            return
        runs: list[list[int]] = [[missing[0], missing[0]]]
        for c in missing[1:]:
            if c == runs[-1][1] + 1:
                runs[-1][1] = c
            else:
                runs.append([c, c])
        spans = [(self.relpath, a * chunk, min(size, (b + 1) * chunk)) for a, b in runs]
        self.calls += 1
        for (a, b), (_, start, end), data in zip(runs, spans, self.source.read_many(spans), strict=True):
            if len(data) != end - start:
                raise CorruptDataError(f"{self.where}: ended at byte {start + len(data)} where its size is {size}; "
                                       "it changed while being read, open the dataset again")
            view = memoryview(data)
            for c in range(a, b + 1):
                self.pieces[c] = view[(c - a) * chunk:(c - a + 1) * chunk]

    def pread(self, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)``, fewer where the file ends."""
        end = min(self.size, start + n)
        if end <= start:
            return b""
        self.fetch([(start, end)])
        chunk = self.chunk
        parts = []
        for c in range(start // chunk, (end - 1) // chunk + 1):
            a = max(start, c * chunk) - c * chunk
            b = min(end, (c + 1) * chunk) - c * chunk
            parts.append(self.pieces[c][a:b])
        return b"".join(parts)


def extent(dataset: h5py.Dataset, size: int, where: str) -> tuple[int, int]:
    """``(file offset, bytes)`` of a contiguous, unfiltered dataset, checked to lie in the file's ``size`` bytes
    (so that nothing is sized from a lying shape). UsageError for a chunked, compressed or external dataset."""
    name = dataset.name.lstrip("/")
    if dataset.chunks is not None or dataset.compression is not None or dataset.external:
        raise UsageError(f"{where}: '{name}' is chunked, compressed or external, so it cannot be read by byte "
                         "ranges; re-pack the dataset with packer, or raise cache_limit to its size")
    count = 1
    for side in dataset.shape:
        count *= int(side)
    nbytes = count * dataset.dtype.itemsize
    offset = dataset.id.get_offset()
    if nbytes == 0:
        return (0 if offset is None else int(offset)), 0
    if offset is None or int(offset) + nbytes > size:
        raise CorruptDataError(f"{where}: '{name}' ({nbytes} bytes at {offset}) lies outside the file's {size} bytes; "
                               "the file is damaged, re-pack")
    return int(offset), nbytes


def read_arrays(file: RangeFile, datasets: Sequence[h5py.Dataset], where: str) -> list[np.ndarray]:
    """The values of contiguous ``datasets`` (in their stored dtype and shape), fetched together: one source
    call for all of them, beyond the pieces already in memory."""
    extents = [extent(dataset, file.size, where) for dataset in datasets]
    file.fetch((offset, offset + nbytes) for offset, nbytes in extents)
    return [np.frombuffer(file.pread(offset, nbytes), dtype=dataset.dtype).reshape(dataset.shape)
            for dataset, (offset, nbytes) in zip(datasets, extents, strict=True)]


def check_offsets(offsets: np.ndarray, total: int, where: str, name: str) -> None:
    """CorruptDataError unless ``offsets`` start at 0, never decrease and end within ``total`` bytes."""
    if len(offsets) and int(offsets[0]) != 0:
        raise CorruptDataError(f"{where}: '{name}' starts at {int(offsets[0])}, not 0; the file is damaged, re-pack")
    steps = np.diff(offsets)
    if np.any(steps < 0):
        bad = int(np.flatnonzero(steps < 0)[0])
        raise CorruptDataError(f"{where}: '{name}' decrease at sample {bad}; the file is damaged, re-pack")
    if len(offsets) and int(offsets[-1]) > total:
        bad = int(np.flatnonzero(offsets > total)[0]) - 1
        raise CorruptDataError(f"{where}: '{name}' run past their {total} bytes at sample {max(0, bad)}; the file "
                               "is damaged, re-pack")

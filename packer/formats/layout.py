"""Where each sample's bytes lie in a dataset's data files: what reading a dataset a block at a time needs when
its files cannot be mapped whole (a URL larger than the local cache; page-cache budgets on local files).

A format computes a :class:`Layout` from byte ranges of its files (:meth:`packer.formats.Reader.layout`, given a
:class:`RangeSource`), once: each sample's file and ``[start, end)`` range (everything its ``read``, extras and
fields checksum touch, other than what the format keeps in ``index``), and ``index``, the small per-sample arrays
the format needs besides those bytes (labels, shapes, crc32s...). The format's ``ranged_*`` hooks then turn a
sample's range bytes into its :class:`~packer.formats.Sample`. Nothing here knows a format or a URL.
"""

from __future__ import annotations

import os
import tokenize
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import CorruptDataError, UsageError

LAYOUT_VERSION = 1  # bump when a format's layout or index arrays change meaning: cached layouts are rebuilt


class RangeSource(Protocol):
    """Byte ranges of a dataset's data files (by their manifest ``path``), wherever the files lie."""

    def read(self, relpath: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``relpath``; fewer only where the file ends before ``end``."""
        ...

    def read_many(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """:meth:`read` of each ``(relpath, start, end)``, concurrently where the source allows, in order."""
        ...

    def size(self, relpath: str) -> int:
        """The file's size in bytes."""
        ...


class LocalSource:
    """A :class:`RangeSource` over the files of a local dataset folder."""

    def __init__(self, root: str | os.PathLike, threads: int = 4):
        self.root = Path(root)
        self.threads = threads

    def read(self, relpath: str, start: int, end: int) -> bytes:
        with open(self.root / relpath, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def read_many(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        if len(ranges) < 2:
            return [self.read(*r) for r in ranges]
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(lambda r: self.read(*r), ranges))

    def size(self, relpath: str) -> int:
        return (self.root / relpath).stat().st_size


class PrefixedSource:
    """The :class:`RangeSource` of one folder of a dataset (a part of a distributed conversion): ``relpath``
    read as ``PREFIX/relpath`` of ``source``."""

    def __init__(self, source: RangeSource, prefix: str):
        self.source = source
        self.prefix = prefix.rstrip("/") + "/"

    def read(self, relpath: str, start: int, end: int) -> bytes:
        return self.source.read(self.prefix + relpath, start, end)

    def read_many(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        return self.source.read_many([(self.prefix + relpath, start, end) for relpath, start, end in ranges])

    def size(self, relpath: str) -> int:
        return self.source.size(self.prefix + relpath)


@dataclass(frozen=True)
class Layout:
    """Each sample's byte range in the data files, and the format's own per-sample arrays.

    Attributes:
        files: the data files holding the samples' ranges (manifest ``path`` s).
        file: per sample, its file (an index into ``files``; int32).
        start: per sample, the first byte of its range (int64).
        end: per sample, one past its last byte (int64).
        index: the format's arrays (each a numpy array with no objects, e.g. ``labels``, ``crc32``): what its
            ``ranged_*`` hooks read besides the range.
    """

    files: tuple[str, ...]
    file: np.ndarray
    start: np.ndarray
    end: np.ndarray
    index: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.start)

    def sample_name(self, where: str, index: int) -> str:
        """Sample ``index`` named for a message, from the dataset's URL or folder ``where``: its file, then its
        index (``s3://b/ds/data.mdb sample 7``)."""
        return f"{str(where).rstrip('/')}/{self.files[int(self.file[index])]} sample {index}"

    def check(self, count: int, sizes: Sequence[int], where: object) -> None:
        """:class:`CorruptDataError` naming ``where`` unless there is one range per sample (``count``), each in
        its file (``sizes``: each file's bytes) and not reversed."""
        file, start, end = self.file, self.start, self.end
        if not (len(file) == len(start) == len(end) == count):
            raise CorruptDataError(f"{where}: the layout has {len(start)} ranges for {count} samples; re-pack")
        if count == 0:
            return
        if file.min() < 0 or file.max() >= len(self.files):
            raise CorruptDataError(f"{where}: a sample's range names a file the dataset does not have; re-pack")
        limits = np.asarray(sizes, dtype=np.int64)[file]
        if np.any(start < 0) or np.any(end < start) or np.any(end > limits):
            bad = int(np.flatnonzero((start < 0) | (end < start) | (end > limits))[0])
            raise CorruptDataError(f"{where}: sample {bad}'s range [{int(start[bad])}, {int(end[bad])}) lies outside "
                                   f"{self.files[int(file[bad])]}; the data is damaged, re-pack")

    def save(self, path: str | os.PathLike) -> None:
        """Write the layout to ``path`` (an ``.npz``, no pickles), atomically."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # "sample_file", not "file": np.savez's own first parameter is named file
        arrays = {"files": np.array(self.files, dtype=str), "sample_file": self.file, "start": self.start,
                  "end": self.end, "version": np.array(LAYOUT_VERSION)}
        arrays.update({f"index.{name}": value for name, value in self.index.items()})
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub fears a key named allow_pickle
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Layout | None:
        """The layout saved at ``path``; None when there is none, or it is of another version or damaged (it is
        then computed again)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                if int(data["version"]) != LAYOUT_VERSION:
                    return None
                index = {name[6:]: data[name] for name in data.files if name.startswith("index.")}
                return cls(tuple(str(f) for f in data["files"]), data["sample_file"].astype(np.int32),
                           data["start"].astype(np.int64), data["end"].astype(np.int64), index)
        except (OSError, ValueError, KeyError, EOFError, SyntaxError, TypeError, OverflowError, tokenize.TokenError,
                zipfile.BadZipFile):  # what np.load raises for a damaged .npz or .npy header
            return None


def join_rows(indexes: Sequence[dict[str, np.ndarray]], counts: Sequence[int], where: object) -> dict[str, np.ndarray]:
    """Several layouts' ``index`` (of ``counts[k]`` samples each) end to end: every array must hold one row a
    sample, under the same names in every part; a one-line :class:`UsageError` naming ``where`` (the dataset)
    otherwise (an array of offsets into another needs its format's :meth:`~packer.formats.Reader.join_index`)."""
    names = set(indexes[0]) if indexes else set()
    for index, count in zip(indexes, counts, strict=True):
        if set(index) != names:
            raise UsageError(f"{where}: its parts' layouts hold different arrays; re-pack it in one piece to read "
                             "it a block at a time")
        for name, array in index.items():
            if array.ndim == 0 or len(array) != count:
                raise UsageError(f"{where}: '{name}' of its parts' layouts is not one row a sample, so a dataset "
                                 "converted in parts cannot be read a block at a time in this format; raise "
                                 "cache_limit (or page_budget) to the dataset's size")
    return {name: np.concatenate([index[name] for index in indexes]) for name in sorted(names)}


def concat_layouts(parts: Sequence[tuple[str, Layout]], where: object,
                   join_index: Callable[..., dict[str, np.ndarray]] = join_rows) -> Layout:
    """One layout over several folders' layouts (the parts of a distributed conversion), in order: each part's
    files named ``FOLDER/file``, its samples after the previous parts', its ``index`` joined by ``join_index``
    (``(indexes, counts, where)``: by default :func:`join_rows`, one row a sample end to end). Blocks of the
    result never span two parts (their files differ)."""
    if not parts:
        return Layout((), np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))
    files: list[str] = []
    file = []
    for folder, layout in parts:
        file.append(layout.file.astype(np.int32) + len(files))
        files.extend(f"{folder.rstrip('/')}/{name}" for name in layout.files)
    layouts = [layout for _, layout in parts]
    index = join_index([layout.index for layout in layouts], [len(layout) for layout in layouts], where)
    return Layout(tuple(files), np.concatenate(file), np.concatenate([layout.start for layout in layouts]),
                  np.concatenate([layout.end for layout in layouts]), index)


def span_blocks(layout: Layout, target_bytes: int) -> np.ndarray:
    """Block starts over the layout's samples: a new block where the file changes, or where the block's bytes so
    far (from its lowest range start to its highest range end: ranges need not rise with the index, e.g. LMDB
    records on pages a later transaction reused) would span more than ``target_bytes`` of their file (at least
    one sample a block). An increasing int64 array from 0."""
    n = len(layout)
    if n == 0:
        return np.zeros(0, np.int64)
    file, start, end = layout.file.tolist(), layout.start.tolist(), layout.end.tolist()
    starts = [0]
    low, high = start[0], end[0]
    for i in range(1, n):
        low_i, high_i = min(low, start[i]), max(high, end[i])
        if file[i] != file[i - 1] or high_i - low_i > target_bytes:
            starts.append(i)
            low_i, high_i = start[i], end[i]
        low, high = low_i, high_i
    return np.asarray(starts, dtype=np.int64)


def block_spans(layout: Layout, starts: np.ndarray) -> np.ndarray:
    """Each block's ``(file, first byte, one past the last byte)``: the one range that holds its samples' ranges,
    an (n, 3) int64 array for the blocks that begin at ``starts`` (:func:`span_blocks`' blocks never span files)."""
    if not len(layout):
        return np.zeros((0, 3), np.int64)
    return np.stack([layout.file[starts].astype(np.int64), np.minimum.reduceat(layout.start, starts),
                     np.maximum.reduceat(layout.end, starts)], axis=1)

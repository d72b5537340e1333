"""Advice to the kernel about a data file's pages: read exactly what a batch reads, and nothing around it.

A mapped data file read at random faults its pages in one at a time, and the kernel reads its read-ahead window
around each fault (``read_ahead_kb`` of the device: 128 KB on many systems, megabytes on others): a first batch of
random samples then reads tens or hundreds of megabytes besides its own, and a dataset larger than memory is read
several times over. So the readers map their sample data for random access (:func:`random_access`: no window
around a fault) and, before a batch touches its samples, advise exactly their byte ranges
(:func:`will_need`): the kernel starts every range's read at once, and the batch's samples arrive in one request
each. Advice only: where the calls do not exist (macOS, Windows) nothing is advised and reads still work.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tokenize
from collections.abc import Callable

import numpy as np

PAGE = mmap.PAGESIZE
# what numpy's .npy header parser raises for a damaged header (a changed byte can leave an unfinished literal,
# which its tokenizer reports as tokenize.TokenError), and what mapping the file raises
NPY_ERRORS = (OSError, ValueError, SyntaxError, TypeError, OverflowError, tokenize.TokenError)


def advise(fd: int, start: int, end: int, advice_name: str) -> None:
    """``posix_fadvise`` of bytes ``[start, end)`` of ``fd``, widened to whole pages (the kernel drops only the
    pages a range covers whole); nothing where the call or ``advice_name`` does not exist."""
    advice = getattr(os, advice_name, None)
    if advice is None or not hasattr(os, "posix_fadvise") or end <= start:
        return
    low = start - start % PAGE
    high = -(-end // PAGE) * PAGE
    with contextlib.suppress(OSError):  # advice only: a filesystem that refuses it still reads
        os.posix_fadvise(fd, low, high - low, advice)


def random_access(mapped: mmap.mmap, start: int = 0, length: int | None = None) -> None:
    """Advise ``MADV_RANDOM`` on bytes ``[start, start + length)`` of ``mapped`` (all of it by default): a fault
    reads its own page, not the read-ahead window around it."""
    if not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_RANDOM"):
        return
    low = start - start % PAGE
    length = len(mapped) - low if length is None else min(len(mapped) - low, length + start - low)
    if length > 0:
        with contextlib.suppress(OSError, ValueError):
            mapped.madvise(mmap.MADV_RANDOM, low, length)


def page_runs(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``[starts, ends)`` as whole pages, sorted, overlapping and touching ones joined: the fewest
    calls that advise them all (a batch read in order is one)."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    keep = ends > starts
    low, high = starts[keep] // PAGE * PAGE, -(-ends[keep] // PAGE) * PAGE
    if not len(low):
        return low, high
    order = np.argsort(low, kind="stable")
    low, high = low[order], np.maximum.accumulate(high[order])
    new = np.ones(len(low), bool)
    new[1:] = low[1:] > high[:-1]
    firsts = np.flatnonzero(new)
    return low[firsts], np.maximum.reduceat(high, firsts)


def will_need(starts: np.ndarray, ends: np.ndarray, fd: int | None = None,
              mapped: mmap.mmap | None = None) -> None:
    """Have the kernel start reading bytes ``[starts, ends)`` (file offsets) of a data file now, each range in
    one request and nothing around it: ``POSIX_FADV_WILLNEED`` on ``fd``, or ``MADV_WILLNEED`` on ``mapped`` (a map
    of the whole file). Pages already cached cost a look-up each."""
    call: Callable[[int, int], None] | None = None
    if mapped is not None and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        size = len(mapped)
        call = lambda low, n: mapped.madvise(mmap.MADV_WILLNEED, low, min(n, size - low))  # noqa: E731
    elif fd is not None and hasattr(os, "posix_fadvise"):
        call = lambda low, n: os.posix_fadvise(fd, low, n, os.POSIX_FADV_WILLNEED)  # noqa: E731
    if call is None:
        return
    lows, highs = page_runs(starts, ends)
    for low, high in zip(lows.tolist(), highs.tolist(), strict=True):
        with contextlib.suppress(OSError, ValueError):  # advice only
            call(low, high - low)


def map_npy(path: str | os.PathLike) -> tuple[np.ndarray, mmap.mmap]:
    """A ``.npy`` file's array (never unpickled) and the map it views, mapped read-only for random access: a
    per-sample index of which a batch reads a few rows reads a page for each, not the kernel's read-ahead window
    around it (:func:`read_whole` before reading all of it). The file must hold exactly what its header says.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a plain C-order ``.npy`` array of its size (for a damaged header numpy's parser
            may raise any of :data:`NPY_ERRORS`).
    """
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major not in (1, 2):
            raise ValueError(f"npy format version {major}")
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        header, size = f.tell(), os.fstat(f.fileno()).st_size
        count = int(np.prod(shape, dtype=np.int64))
        if fortran or dtype.hasobject:
            raise ValueError("not a plain C-order array")
        if size != header + count * dtype.itemsize:
            raise ValueError(f"{size} bytes, not the {header + count * dtype.itemsize} its header says")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    random_access(mapped)
    return np.frombuffer(mapped, dtype, count, offset=header).reshape(shape), mapped


def read_whole(mapped: mmap.mmap | None) -> None:
    """Have the kernel read all of ``mapped`` at once, in large requests: before an array mapped for random access
    (:func:`map_npy`) is read whole."""
    if mapped is not None and len(mapped):
        will_need(np.zeros(1, np.int64), np.array([len(mapped)], np.int64), mapped=mapped)

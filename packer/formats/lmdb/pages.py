"""The pages of an LMDB data file (``data.mdb``), read by byte ranges without py-lmdb and without the whole file:
where each record's value lies, for :meth:`packer.formats.lmdb.LmdbReader.layout` (a URL larger than the cache).

What is read, as LMDB 0.9's ``mdb.c`` lays it out in a 64-bit little-endian build (py-lmdb's, on this machine):

- every page starts with a 16-byte header (``PAGEHDRSZ``): page number (u64), pad (u16), flags (u16:
  ``P_BRANCH`` 1, ``P_LEAF`` 2, ``P_OVERFLOW`` 4, ``P_META`` 8), then ``lower``, ``upper`` (u16 each; an
  overflow page has its page count there instead). Page ``n`` starts at byte ``n * page size``.
- pages 0 and 1 are meta pages: the header, then ``MDB_meta``: magic (u32 ``0xBEEFC0DE``), data version (u32,
  1), address and map size (u64), two ``MDB_db`` (free pages, then the main DB: pad u32 (the free DB's holds the
  page size), flags u16, depth u16, branch, leaf and overflow page counts, entries, root page: u64 each), the
  last page (u64) and the transaction id (u64). The valid one with the higher transaction id is current.
- a branch or leaf page holds ``(lower - 16) / 2`` node offsets (u16, from the page's start) after its header.
  A node (``NODESIZE`` 8 bytes, then the key, then the data) is ``lo``, ``hi``, ``flags``, ``ksize`` (u16 each).
  On a branch page, ``lo | hi << 16 | flags << 32`` is the child page. On a leaf page, ``lo | hi << 16`` is the
  data size, and the data follows the key in the page, unless ``flags`` has ``F_BIGDATA`` (1): then the data is
  the u64 number of the overflow page whose bytes after its header hold the value.

Pages are read a tree level at a time, each level in one :meth:`RangeSource.read_many` (adjacent pages in one
range), so a remote walk costs one round trip per level (a leaf level over :data:`LEVEL_BYTES` takes one per
that many bytes). Every page number, count and size read from the file is checked against the file's size
before it is used; anything that is not such a file is a one-line :class:`CorruptDataError` naming it.
"""

from __future__ import annotations

import struct

import numpy as np

from ...errors import CorruptDataError, UsageError
from ..layout import RangeSource

PAGEHDRSZ = 16
NODESIZE = 8
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA = 0x01
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
P_INVALID = (1 << 64) - 1
MAX_DEPTH = 32  # mdb.c's CURSOR_STACK: no tree is deeper
MDB_DB = "IHHQQQQQ"  # pad (the free DB's: page size), flags, depth, branch, leaf, overflow pages, entries, root
META = struct.Struct("<QHHHH" + "IIQQ" + MDB_DB * 2 + "QQ")  # a meta page's header and MDB_meta
FOREIGN_DB_FLAGS = 0x7E  # main DB flags packer never sets: REVERSEKEY, DUPSORT, INTEGERKEY, DUPFIXED, INTEGERDUP...
# pages read in one read_many at most (about 1.2M encoded records' leaves): bounds a walk's memory (the leaves of
# inline values are the values themselves) to a few hundred MB
LEVEL_BYTES = 32 << 20
RUN_PAGES = 256  # adjacent pages read as one range at most


def _name(where: str, what: str) -> CorruptDataError:
    return CorruptDataError(f"{where}: {what}; the LMDB file is damaged, re-pack")


class Meta:
    """The current meta page's numbers: page size, the main DB's root, depth and entries."""

    def __init__(self, page: bytes, where: str):
        fields = META.unpack_from(page)
        (self.pgno, _, self.flags, _, _, self.magic, self.version, _, _, self.page_size, _, _, _, _, _, _, _,
         _, self.db_flags, self.depth, _, _, _, self.entries, self.root, self.last_page, self.txnid) = fields
        self.where = where

    @property
    def valid(self) -> bool:
        return bool(self.flags & P_META) and self.magic == MDB_MAGIC and self.version == MDB_DATA_VERSION


def _check_build(page: bytes, where: str) -> None:
    """:class:`UsageError` for an LMDB file of another build than the 64-bit little-endian one this reads;
    :class:`CorruptDataError` for one that is not LMDB at all."""
    magic, version = struct.unpack_from("<II", page, PAGEHDRSZ)
    if magic == int.from_bytes(MDB_MAGIC.to_bytes(4, "little"), "big"):
        raise UsageError(f"{where}: a big-endian LMDB file; packer reads the 64-bit little-endian layout py-lmdb "
                         "writes here: re-pack it on this machine")
    if magic != MDB_MAGIC:
        raise _name(where, "not an LMDB file (bad magic in the meta page)")
    if version != MDB_DATA_VERSION:
        raise UsageError(f"{where}: LMDB data version {version}, packer reads version {MDB_DATA_VERSION} (py-lmdb's "
                         "layout here): re-pack it on this machine")
    if not _page_size_ok(struct.unpack_from("<I", page, 40)[0]) and _page_size_ok(
            struct.unpack_from("<I", page, 32)[0]):
        raise UsageError(f"{where}: a 32-bit LMDB file; packer reads the 64-bit layout py-lmdb writes here: re-pack "
                         "it on this machine")


def _page_size_ok(size: int) -> bool:
    return 512 <= size <= 0x10000 and size & (size - 1) == 0


def read_meta(source: RangeSource, relpath: str, file_size: int, where: str) -> Meta:
    """The current meta page of ``relpath`` (the valid one of pages 0 and 1 with the higher transaction id)."""
    if file_size < 2 * META.size:
        raise _name(where, f"{file_size} bytes, too short for LMDB's meta pages")
    head = source.read(relpath, 0, min(file_size, 2 * 4096))
    if len(head) < META.size:
        raise _name(where, "ends inside its first meta page")
    _check_build(head, where)
    first = Meta(head, where)
    if not first.valid:
        raise _name(where, "page 0 is not a meta page")
    size = first.page_size
    if not _page_size_ok(size):
        raise _name(where, f"page size {size} in the meta page is not a power of two from 512 to 65536")
    if size + META.size > file_size:
        raise _name(where, f"{file_size} bytes, too short for a second meta page at {size}")
    second_page = head[size:size + META.size] if size + META.size <= len(head) else b""
    if len(second_page) < META.size:
        second_page = source.read(relpath, size, size + META.size)
        if len(second_page) < META.size:
            raise _name(where, "ends inside its second meta page")
    second = Meta(second_page, where)
    current = second if second.valid and second.page_size == size and second.txnid > first.txnid else first
    if current.db_flags & FOREIGN_DB_FLAGS:
        raise _name(where, f"the main database has flags {current.db_flags:#x}, not packer's plain keys")
    return current


def _u16(buf: np.ndarray, at: np.ndarray) -> np.ndarray:
    return buf[at].astype(np.int64) | (buf[at + 1].astype(np.int64) << 8)


def _u64(buf: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The u64s at ``at`` (any alignment), as int64 (a number past 2**63 turns negative: refused as a page)."""
    value = np.zeros(len(at), np.uint64)
    for k in range(8):
        value |= buf[at + k].astype(np.uint64) << np.uint64(8 * k)
    return value.astype(np.int64)


def _decimal(buf: np.ndarray, at: np.ndarray, digits: int) -> np.ndarray:
    """The ``digits`` ASCII digits at each ``at`` as a number; -1 where one is not a digit."""
    value = np.zeros(len(at), np.int64)
    good = np.ones(len(at), bool)
    for k in range(digits):
        digit = buf[at + k].astype(np.int64) - ord("0")
        good &= (digit >= 0) & (digit <= 9)
        value = value * 10 + digit
    return np.where(good, value, -1)


class _Level:
    """The pages of one tree level, read into one buffer, and their nodes: where each lies in the buffer."""

    def __init__(self, source: RangeSource, relpath: str, pages: np.ndarray, meta: Meta, want: int):
        size, where = meta.page_size, meta.where
        self.where = where
        self.pages = pages
        self.buf = _read_pages(source, relpath, pages, size, where)
        base = np.arange(len(pages), dtype=np.int64) * size
        numbers = _u64(self.buf, base)
        flags, lower, upper = (_u16(self.buf, base + k) for k in (10, 12, 14))
        bad = ((numbers != pages) | (flags & (P_BRANCH | P_LEAF | P_LEAF2 | P_OVERFLOW | P_META) != want)
               | (lower < PAGEHDRSZ + 2) | (lower > upper) | (upper > size))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            kind = "branch" if want == P_BRANCH else "leaf"
            raise _name(where, f"page {int(pages[k])} is not the {kind} page its parent names (header "
                               f"{int(numbers[k])}, flags {int(flags[k]):#x}, bounds {int(lower[k])}..{int(upper[k])})")
        counts = (lower - PAGEHDRSZ) // 2
        self.page_of = np.repeat(np.arange(len(pages), dtype=np.int64), counts)
        slot = np.arange(len(self.page_of), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        offsets = _u16(self.buf, base[self.page_of] + PAGEHDRSZ + 2 * slot)
        self.node = base[self.page_of] + offsets  # each node's first byte in buf
        self.end_of_page = base[self.page_of] + size
        bad = (offsets < upper[self.page_of]) | (self.node + NODESIZE > self.end_of_page)
        self._refuse(bad, "a node outside its page")
        self.lo, self.hi, self.flags, self.ksize = (_u16(self.buf, self.node + k) for k in (0, 2, 4, 6))
        self._refuse(self.node + NODESIZE + self.ksize > self.end_of_page, "a key past the end of its page")

    def _refuse(self, bad: np.ndarray, what: str) -> None:
        """:class:`CorruptDataError` naming the page of the first node ``bad`` marks."""
        if bad.any():
            raise _name(self.where, f"page {int(self.pages[self.page_of[np.flatnonzero(bad)[0]]])} has {what}")


def _read_pages(source: RangeSource, relpath: str, pages: np.ndarray, size: int, where: str) -> np.ndarray:
    """The pages (numbers, in that order) end to end, as one uint8 array; adjacent pages read as one range."""
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    runs = []
    for run in np.split(pages, breaks) if len(pages) else []:
        for at in range(0, len(run), RUN_PAGES):
            part = run[at:at + RUN_PAGES]
            runs.append((relpath, int(part[0]) * size, (int(part[-1]) + 1) * size))
    datas = source.read_many(runs)
    for (_, start, end), data in zip(runs, datas, strict=True):
        if len(data) != end - start:
            raise _name(where, f"ends before page {start // size + len(data) // size} its tree names (got "
                               f"{len(data)} of bytes {start}..{end})")
    return np.frombuffer(b"".join(datas), dtype=np.uint8)


def _children(source: RangeSource, relpath: str, pages: np.ndarray, meta: Meta, file_pages: int) -> np.ndarray:
    """The child pages the branch ``pages`` name, in key order."""
    level = _Level(source, relpath, pages, meta, P_BRANCH)
    children = level.lo | (level.hi << 16) | (level.flags << 32)
    _check_pages(children, file_pages, meta.where)
    return children


def _check_pages(pages: np.ndarray, file_pages: int, where: str) -> None:
    """Page numbers a tree names: past the meta pages, inside the file, each once."""
    bad = (pages < 2) | (pages >= file_pages)
    if bad.any():
        raise _name(where, f"its tree names page {int(pages[bad][0])}, outside the file's {file_pages} pages")
    if len(np.unique(pages)) != len(pages):
        raise _name(where, "its tree names a page twice")


def record_ranges(source: RangeSource, relpath: str, count: int, digits: int,
                  where: str) -> tuple[np.ndarray, np.ndarray]:
    """Where each record's value lies in ``relpath`` (an LMDB data file), by walking its B-tree.

    Args:
        source: the file's byte ranges.
        relpath: the file, as ``source`` names it.
        count: the records the file must hold, keyed ``0..count-1`` as ``digits`` zero-padded ASCII digits, in
            order (the keys are checked).
        digits: the keys' width.
        where: names the file in errors.

    Returns:
        ``(start, end)``: int64 arrays, record ``i``'s value is bytes ``start[i]:end[i]`` of the file (in a leaf
        page, or after an overflow page's header).

    Raises:
        CorruptDataError: the file is not such an LMDB file, or is damaged.
        UsageError: an LMDB file of another build (32-bit, big-endian, another data version).
    """
    file_size = source.size(relpath)
    meta = read_meta(source, relpath, file_size, where)
    size = meta.page_size
    file_pages = file_size // size
    if meta.entries != count:
        raise CorruptDataError(f"{where}: holds {meta.entries} records, the manifest says {count}; run `packer "
                               "verify`")
    if count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if meta.root == P_INVALID or not 1 <= meta.depth <= MAX_DEPTH:
        raise _name(where, f"the main database's root ({meta.root}) or depth ({meta.depth}) is not a tree's")
    if meta.root >= file_pages:
        raise _name(where, f"its root page {meta.root} lies outside the file's {file_pages} pages")
    pages = np.array([meta.root], dtype=np.int64)
    _check_pages(pages, file_pages, where)
    for _ in range(meta.depth - 1):
        per_read = max(1, LEVEL_BYTES // size)
        pages = np.concatenate([_children(source, relpath, pages[at:at + per_read], meta, file_pages)
                                for at in range(0, len(pages), per_read)])
        _check_pages(pages, file_pages, where)
    return _leaf_ranges(source, relpath, pages, meta, count, digits, file_size)


def _leaf_ranges(source: RangeSource, relpath: str, pages: np.ndarray, meta: Meta, count: int, digits: int,
                 file_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The records' ranges from the leaf ``pages`` (in key order), read :data:`LEVEL_BYTES` at a time."""
    where, size = meta.where, meta.page_size
    starts, ends, seen = [], [], 0
    per_read = max(1, LEVEL_BYTES // size)
    for at in range(0, len(pages), per_read):
        level = _Level(source, relpath, pages[at:at + per_read], meta, P_LEAF)
        n = len(level.node)
        if seen + n > count:
            raise _name(where, f"its leaves hold more than the {count} records its meta page counts")
        level._refuse((level.ksize != digits) | (level.flags & ~F_BIGDATA != 0),
                      "a record that is not packer's (a key of another width, or duplicates)")
        wrong = np.flatnonzero(_decimal(level.buf, level.node + NODESIZE, digits) != np.arange(seen, seen + n))
        if len(wrong):
            at = int(level.node[wrong[0]]) + NODESIZE
            found = bytes(level.buf[at:at + digits])[:12]
            raise CorruptDataError(f"{where}: record {seen + int(wrong[0])} has key {found!r}: the records are not "
                                   f"keyed 0..{count - 1} in order; the dataset is damaged, re-pack")
        data_size = level.lo | (level.hi << 16)
        data_at = level.node + NODESIZE + digits  # in buf
        big = (level.flags & F_BIGDATA) != 0
        inline = ~big
        level._refuse(inline & (data_at + data_size > level.end_of_page), "a value past the end of its page")
        level._refuse(big & (data_at + 8 > level.end_of_page), "an overflow page number past the end of its page")
        page_start = level.pages[level.page_of] * size  # in the file
        start = page_start + (data_at - level.page_of * size)
        if big.any():
            overflow = _u64(level.buf, data_at[big])
            past = (overflow < 2) | (overflow >= file_size // size) | (
                overflow * size + PAGEHDRSZ + data_size[big] > file_size)
            if past.any():
                k = int(np.flatnonzero(big)[np.flatnonzero(past)[0]])
                raise _name(where, f"record {seen + k}'s value ({int(data_size[k])} bytes on overflow page "
                                   f"{int(overflow[np.flatnonzero(past)[0]])}) lies past the file's end")
            start[big] = overflow * size + PAGEHDRSZ
        starts.append(start)
        ends.append(start + data_size)
        seen += n
    if seen != count:
        raise _name(where, f"its leaves hold {seen} records, its meta page counts {count}")
    return np.concatenate(starts), np.concatenate(ends)


"""LMDB read by byte ranges (issue 25): ``LmdbReader.layout`` walks ``data.mdb``'s B-tree through a RangeSource,
without py-lmdb, and the ``ranged_*`` hooks turn each record's bytes into what the local reader gives.

Checked against py-lmdb's own values (``txn.get``) for every record of packed datasets: encoded images on
overflow pages (original, jpeg), tiny raw images inline in leaf pages (packed with a commit every 10 samples, so
later transactions reuse freed pages and records do not lie in index order), an image + fields dataset; a tree
of depth 3 written by py-lmdb directly, read in one ``read_many`` per level; and damaged or foreign files, each
a one-line error naming data.mdb.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import noise_folder
from support.fields import SCHEMA, write_dataset

import packer
from packer.errors import CorruptDataError, UsageError
from packer.fields import extra_fields
from packer.formats.layout import Layout, LocalSource, block_spans, span_blocks
from packer.formats.lmdb import LmdbReader
from packer.formats.lmdb.records import HEADER, key

DEEP_COUNT = 60_000  # few-byte records: a tree of depth 3 with 4 KB pages
BIG_EVERY = 5_000  # every so many records, a 12 KB value on overflow pages
PAGE = 4096


class BytesSource:
    """A RangeSource over files held in memory ({relpath: bytes}), counting its read_many calls."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.calls = 0

    def read(self, relpath: str, start: int, end: int) -> bytes:
        return self.files[relpath][start:max(start, end)]

    def read_many(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        self.calls += 1
        return [self.read(*r) for r in ranges]

    def size(self, relpath: str) -> int:
        return len(self.files[relpath])


def deep_value(i: int) -> bytes:
    return b"v%d." % i * (1500 if i % BIG_EVERY == 0 else 1)


def write_env(path: Path, keys: Sequence[bytes], value=deep_value) -> Path:
    """An LMDB environment written by py-lmdb directly: ``keys`` with ``value(i)``, appended in one transaction."""
    env = lmdb.open(str(path), map_size=1 << 28, subdir=True)
    with env.begin(write=True) as txn:
        for i, k in enumerate(keys):
            txn.put(k, value(i))
    env.close()
    (path / "lock.mdb").unlink()
    return path


@pytest.fixture(scope="module")
def deep_env(tmp_path_factory) -> Path:
    return write_env(tmp_path_factory.mktemp("deep") / "env", [key(i) for i in range(DEEP_COUNT)])


@pytest.fixture(scope="module")
def datasets(pack_once, sample_data, tmp_path_factory) -> dict[str, Path]:
    """Packed LMDB datasets: encoded images (overflow pages), tiny raw images (inline), image + fields."""
    root = tmp_path_factory.mktemp("layout-lmdb")
    tiny = root / "tiny"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PACKER_COMMIT_SAMPLES", "10")  # many transactions: freed pages reused out of index order
        packer.pack(noise_folder(root / "src", 120, 8, "png"), tiny, "lmdb", store="raw", workers=1,
                    progress=False)
    write_dataset(root / "fields", "lmdb", SCHEMA)
    return {"original": pack_once(sample_data, "lmdb", "original"), "jpeg": pack_once(sample_data, "lmdb", "jpeg"),
            "raw_tiny": tiny, "fields": root / "fields"}


def manifest_of(dest: Path) -> dict:
    return json.loads((dest / "manifest.json").read_text())


def layout_of(dest: Path) -> Layout:
    return LmdbReader.layout(manifest_of(dest), LocalSource(dest), str(dest))


def one_line(exc: pytest.ExceptionInfo, *names: str) -> str:
    text = str(exc.value)
    assert "\n" not in text and all(name in text for name in names), text
    return text


def meta_root(data: bytes) -> tuple[int, int]:
    """The main DB's root page and depth, from the meta page with the higher txnid (read here with struct)."""
    metas = [struct.unpack_from("<HHQQQQQ", data, at + 16 + 76) for at in (0, PAGE)]
    txnids = [struct.unpack_from("<Q", data, at + 16 + 128)[0] for at in (0, PAGE)]
    _, depth, *_, root = metas[int(txnids[1] > txnids[0])]
    return root, depth


@pytest.mark.parametrize("kind", ["original", "jpeg", "raw_tiny", "fields"])
def test_every_range_is_py_lmdb_value(datasets, kind):
    dest = datasets[kind]
    layout = layout_of(dest)
    data = (dest / "data.mdb").read_bytes()
    reader = LmdbReader(dest)
    reader.open()
    assert layout.files == ("data.mdb",) and len(layout) == len(reader) and not layout.index
    for i in range(len(reader)):
        assert data[layout.start[i]:layout.end[i]] == bytes(reader.txn.get(key(i))), (kind, i)
    inline = (layout.start % PAGE != 16) & (layout.end - layout.start < PAGE)
    if kind == "raw_tiny":  # values in leaf pages, not in index order (pages reused by later transactions)
        assert inline.all() and (np.diff(layout.start) < 0).any()
    elif kind in ("original", "jpeg"):  # values on overflow pages, just after the page header
        assert not inline.any()


@pytest.mark.parametrize("kind", ["original", "jpeg", "raw_tiny", "fields"])
def test_ranged_hooks_give_what_the_reader_reads(datasets, kind):
    dest = datasets[kind]
    layout = layout_of(dest)
    data = memoryview((dest / "data.mdb").read_bytes())
    reader = LmdbReader(dest)
    reader.open()
    extras = extra_fields(reader.schema)
    assert bool(extras) == (kind == "fields")
    for i in range(len(reader)):
        record = data[layout.start[i]:layout.end[i]]
        got, want = LmdbReader.ranged_sample(i, record, layout, str(dest)), reader.read(i)
        assert bytes(got.payload) == bytes(want.payload), (kind, i)
        assert (got.label, got.shape, got.crc32) == (want.label, want.shape, want.crc32), (kind, i)
        if extras:
            values = LmdbReader.ranged_extras(i, record, layout, extras, str(dest))
            assert [bytes(v) for v in values] == [bytes(v) for v in reader.read_extras(i)]
            assert LmdbReader.ranged_fields_checksum(i, record, layout) == reader.fields_checksum(i)


def test_deep_tree_is_walked_one_read_many_per_level(deep_env):
    env = lmdb.open(str(deep_env), readonly=True, lock=False)
    assert env.stat()["depth"] >= 3
    data = (deep_env / "data.mdb").read_bytes()
    source = BytesSource({"data.mdb": data})
    layout = LmdbReader.layout({"count": DEEP_COUNT}, source, str(deep_env))
    assert source.calls == env.stat()["depth"]  # the root, each branch level, the leaves
    with env.begin(buffers=True) as txn:
        for i in range(DEEP_COUNT):
            assert data[layout.start[i]:layout.end[i]] == bytes(txn.get(key(i))), i
    env.close()
    big = np.arange(0, DEEP_COUNT, BIG_EVERY)
    assert (layout.start[big] % PAGE == 16).all()  # the large values: on overflow pages


def test_empty_environment(tmp_path):
    write_env(tmp_path / "env", [])
    layout = LmdbReader.layout({"count": 0}, LocalSource(tmp_path / "env"), str(tmp_path / "env"))
    assert len(layout) == 0


def test_blocks_span_at_most_their_target(datasets):
    """Records out of index order (reused pages) still make blocks whose one range is about the target, and
    every record lies in its block's range."""
    layout = layout_of(datasets["raw_tiny"])
    for target in (1000, 4096, 20000):
        starts = span_blocks(layout, target)
        spans = block_spans(layout, starts)
        bounds = np.append(starts, len(layout))
        for b, (_, low, high) in enumerate(spans.tolist()):
            a, z = bounds[b], bounds[b + 1]
            assert high - low <= target or z - a == 1
            assert low <= layout.start[a:z].min() and layout.end[a:z].max() <= high


# -- damaged and foreign files ---------------------------------------------------------------------------------


def damaged(deep_env: Path, edit) -> BytesSource:
    data = bytearray((deep_env / "data.mdb").read_bytes())
    edit(data)
    return BytesSource({"data.mdb": bytes(data)})


def set_bytes(data: bytearray, at: int, value: bytes) -> None:
    data[at:at + len(value)] = value


def branch_edit(how: str):
    def edit(data: bytearray) -> None:
        root, _ = meta_root(bytes(data))
        page = root * PAGE
        first = struct.unpack_from("<H", data, page + 16)[0]  # the first node's offset
        if how == "flags":
            set_bytes(data, page + 10, struct.pack("<H", 0x02))  # a leaf, where the depth says a branch
        elif how == "child":
            set_bytes(data, page + first, struct.pack("<HHH", 0xFFFF, 0xFFFF, 0x0FFF))  # a page far past the end
        elif how == "offset":
            set_bytes(data, page + 16, struct.pack("<H", PAGE - 2))  # a node that runs off its page
        elif how == "bounds":
            set_bytes(data, page + 12, struct.pack("<HH", PAGE, 20))  # lower past upper
        elif how == "garbage":
            data[page + 16:page + PAGE] = np.random.default_rng(3).integers(0, 256, PAGE - 16, np.uint8).tobytes()
    return edit


@pytest.mark.parametrize("how", ["flags", "child", "offset", "bounds", "garbage"])
def test_damaged_branch_page(deep_env, how):
    source = damaged(deep_env, branch_edit(how))
    with pytest.raises(CorruptDataError) as exc:
        LmdbReader.layout({"count": DEEP_COUNT}, source, "ds")
    one_line(exc, "ds/data.mdb")


def test_random_damage_to_tree_pages(deep_env):
    """A byte changed anywhere in the branch and leaf pages: a one-line CorruptDataError, or (a byte no walk
    reads, or a value's) a layout whose every range lies in the file."""
    data = (deep_env / "data.mdb").read_bytes()
    flags = np.frombuffer(data, np.uint8).reshape(-1, PAGE)[:, 10]
    tree_pages = np.flatnonzero((flags & 0x03) != 0)
    rng = np.random.default_rng(7)
    for _ in range(40):
        at = int(rng.choice(tree_pages)) * PAGE + int(rng.integers(0, 64 if rng.random() < 0.5 else PAGE))
        source = damaged(deep_env, lambda d, at=at: set_bytes(d, at, bytes([d[at] ^ int(rng.integers(1, 256))])))
        try:
            layout = LmdbReader.layout({"count": DEEP_COUNT}, source, "ds")
        except CorruptDataError as exc:
            assert "\n" not in str(exc) and "ds/data.mdb" in str(exc)
            continue
        layout.check(DEEP_COUNT, [len(data)], "ds")


@pytest.mark.parametrize("fraction", [0.5, 0.99, 0.001])
def test_truncated_file(datasets, tmp_path, fraction):
    dest = tmp_path / "ds"
    shutil.copytree(datasets["original"], dest)
    path = dest / "data.mdb"
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * fraction))
    with pytest.raises(CorruptDataError) as exc:
        layout_of(dest)
    one_line(exc, str(path))


def test_lying_sizes(datasets, tmp_path):
    """A leaf node whose value size runs past its page (inline) or whose overflow page lies past the file."""
    tiny = tmp_path / "tiny"
    shutil.copytree(datasets["raw_tiny"], tiny)
    layout = layout_of(tiny)
    node = int(layout.start[5]) - 10 - 8  # the node header: before the 10-byte key
    with open(tiny / "data.mdb", "r+b") as f:
        f.seek(node)
        f.write(struct.pack("<HH", 0xFFFF, 0x7FFF))
    with pytest.raises(CorruptDataError) as exc:
        layout_of(tiny)
    one_line(exc, "data.mdb")

    big = tmp_path / "big"
    shutil.copytree(datasets["original"], big)
    data = (big / "data.mdb").read_bytes()
    nodes, at = [], data.find(key(3))
    while at >= 0:
        nodes.append(at - 8)
        at = data.find(key(3), at + 1)
    # F_BIGDATA and a 10-byte key: record 3's node, and any old copy of its leaf that a freed page still holds
    # (copy-on-write; how many depends on the writer's commits), all given the same lie
    found = [at for at in nodes if struct.unpack_from("<HH", data, at + 4) == (1, 10)]
    assert found
    with open(big / "data.mdb", "r+b") as f:
        for node in found:
            f.seek(node + 8 + 10)  # record 3's overflow page number
            f.write(struct.pack("<Q", 1 << 40))
    with pytest.raises(CorruptDataError) as exc:
        layout_of(big)
    one_line(exc, "data.mdb", "record 3")


@pytest.mark.parametrize("keys, count, says", [
    ([key(i) for i in range(10) if i != 5] + [key(10)], 10, "not keyed 0..9"),  # a gap
    ([b"%09d" % i for i in range(10)], 10, "not packer's"),  # another width
    ([key(i) for i in range(10)], 12, "holds 10 records, the manifest says 12"),
    ([key(i) for i in range(1, 11)], 10, "has key b'0000000001'"),  # shifted by one
])
def test_keys_must_be_0_to_count_minus_1(tmp_path, keys, count, says):
    env = write_env(tmp_path / "env", keys)
    with pytest.raises(CorruptDataError) as exc:
        LmdbReader.layout({"count": count}, LocalSource(env), str(env))
    assert says in one_line(exc, str(env / "data.mdb"))


@pytest.mark.parametrize("edit, says", [
    (lambda d: set_bytes(d, 16, struct.pack(">I", 0xBEEFC0DE)), "big-endian"),
    (lambda d: set_bytes(d, 20, struct.pack("<I", 999)), "data version 999"),
    (lambda d: set_bytes(d, 32, struct.pack("<I", PAGE) + b"\0" * 8), "32-bit"),  # the page size where 32 bits have it
])
def test_other_lmdb_builds_are_usage_errors(deep_env, edit, says):
    with pytest.raises(UsageError) as exc:
        LmdbReader.layout({"count": DEEP_COUNT}, damaged(deep_env, edit), "ds")
    assert says in one_line(exc, "ds/data.mdb")


def test_not_lmdb_at_all(deep_env):
    source = damaged(deep_env, lambda d: set_bytes(d, 16, b"\0" * 8))
    with pytest.raises(CorruptDataError) as exc:
        LmdbReader.layout({"count": DEEP_COUNT}, source, "ds")
    assert "not an LMDB file" in one_line(exc, "ds/data.mdb")


def test_damaged_record_bytes(datasets):
    dest = datasets["fields"]
    layout = layout_of(dest)
    record = bytearray((dest / "data.mdb").read_bytes()[layout.start[2]:layout.end[2]])
    extras = extra_fields(LmdbReader(dest).schema)
    with pytest.raises(CorruptDataError) as exc:
        LmdbReader.ranged_extras(2, memoryview(record), layout, extras[:-1], "ds sample 2")
    assert "the manifest says" in one_line(exc, "ds sample 2")
    for cut in (HEADER.size - 1, HEADER.size + 10):  # inside the header; inside the path or payload
        with pytest.raises(CorruptDataError) as exc:
            LmdbReader.ranged_sample(2, memoryview(record)[:cut], layout, "ds sample 2")
        one_line(exc, "ds sample 2")
    record[0] ^= 0xFF  # the magic
    with pytest.raises(CorruptDataError) as exc:
        LmdbReader.ranged_sample(2, memoryview(record), layout, "ds sample 2")
    assert "bad magic" in one_line(exc, "ds sample 2")
    with pytest.raises(CorruptDataError) as exc:
        LmdbReader.ranged_fields_checksum(2, memoryview(record), layout)
    one_line(exc, "data.mdb sample 2")


def test_parted_dataset_is_refused(datasets):
    manifest = {**manifest_of(datasets["original"]), "parts": [{"path": "part-00000"}, {"path": "part-00001"}]}
    with pytest.raises(UsageError) as exc:
        LmdbReader.layout(manifest, LocalSource(datasets["original"]), "ds")
    one_line(exc, "ds", "2 parts")

"""WebDataset read by byte ranges (``WdsReader.layout`` and the ``ranged_*`` hooks, issue 25): for real packs
(original, jpeg and raw stores; an annotation table with a caption, numbers, JSON and a mask; a dataset with
every field kind), each sample's range bytes, read through ``LocalSource``, give exactly what the local reader
gives (payload bytes, label, shape, crc32, extra fields, fields checksum); blocks never span shards; a truncated
shard, a lying index and shards packer did not write are refused in one line.
"""

from __future__ import annotations

import csv
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from support.fields import SCHEMA, write_dataset

from packer.errors import CorruptDataError, UsageError
from packer.fields import decode
from packer.formats import get_format
from packer.formats.layout import Layout, LocalSource, block_spans, span_blocks
from packer.manifest import read_local_manifest

WdsReader = get_format("wds")[1]
INDEX = "wds_index.npy"


def layout_of(dest: Path) -> tuple[Layout, LocalSource]:
    source = LocalSource(dest)
    return WdsReader.layout(read_local_manifest(dest), source, str(dest)), source


def range_bytes(source: LocalSource, layout: Layout, i: int) -> memoryview:
    return memoryview(source.read(layout.files[int(layout.file[i])], int(layout.start[i]), int(layout.end[i])))


def check_every_sample(dest: Path, layout: Layout, source: LocalSource) -> WdsReader:
    """Every sample's ranged_* results equal the local reader's; returns the reader (open)."""
    reader = WdsReader(dest)
    reader.open()
    assert len(layout) == len(reader) > 0
    for i in range(len(reader)):
        data = range_bytes(source, layout, i)
        local, ranged = reader.read(i), WdsReader.ranged_sample(i, data, layout, str(dest))
        assert bytes(ranged.payload) == bytes(local.payload), i
        assert (ranged.label, ranged.shape, ranged.crc32) == (local.label, local.shape, local.crc32), i
        assert reader.checked(i, ranged) is ranged  # the crc32 and the label agree with the data
        assert WdsReader.ranged_fields_checksum(i, data, layout) == reader.fields_checksum(i), i
        extras = WdsReader.ranged_extras(i, data, layout, reader.extra_fields, str(dest))
        assert [bytes(v) for v in extras] == [bytes(v) for v in reader.read_extras(i)], i
        assert layout.files[int(layout.file[i])] == reader.sample_file(i)
    return reader


def check_ranges(layout: Layout, source: LocalSource) -> None:
    """Ranges lie in their shards, in order, without overlapping."""
    for f, name in enumerate(layout.files):
        mine = np.flatnonzero(layout.file == f)
        assert np.all(np.diff(mine) == 1)  # a shard's samples are consecutive
        assert np.all(layout.start[mine][1:] >= layout.end[mine][:-1])
        assert layout.end[mine].max() <= source.size(name)


@pytest.mark.parametrize("store", ["original", "jpeg", "raw"])
def test_ranges_give_what_the_local_reader_gives(pack_once, sample_data, store, tmp_path):
    dest = pack_once(sample_data, "wds", store)
    layout, source = layout_of(dest)
    check_ranges(layout, source)
    reader = check_every_sample(dest, layout, source)
    assert all(reader.read(i).crc32 is not None for i in range(len(reader)))
    layout.save(tmp_path / "layout.npz")  # the cached layout serves the same samples
    check_every_sample(dest, Layout.load(tmp_path / "layout.npz"), source)


def test_annotation_table_fields_from_ranges(pack_once):
    """A table packed with a caption, a float, a multi-label list, JSON and a mask: every field from the
    ranges equals the local reader's, and the caption is the table's."""
    table = REPO / "sample_data" / "annotations.csv"
    dest = pack_once(table, "wds", "original", root=REPO, label_column="subject", max_size=48,
                     field=("tags:int64[]",))
    layout, source = layout_of(dest)
    check_ranges(layout, source)
    reader = check_every_sample(dest, layout, source)
    assert {f.kind for f in reader.extra_fields} >= {"text", "float32", "json", "mask"}
    with open(table, newline="", encoding="utf-8") as f:
        captions = {row["image"]: row["caption"] for row in csv.DictReader(f)}
    caption = next(k for k, f in enumerate(reader.extra_fields) if f.name == "caption")
    for i in range(len(reader)):
        data = range_bytes(source, layout, i)
        assert WdsReader.ranged_fields_checksum(i, data, layout) is not None
        value = WdsReader.ranged_extras(i, data, layout, reader.extra_fields, str(dest))[caption]
        assert decode(reader.extra_fields[caption], value) == captions[reader.relpath(i)]


def test_every_field_kind_from_ranges(tmp_path):
    """The fields tests' dataset (text, numbers, vectors, JSON, two masks, bytes; shards of 5)."""
    dest = tmp_path / "ds"
    write_dataset(dest, "wds", SCHEMA)
    layout, source = layout_of(dest)
    check_ranges(layout, source)
    check_every_sample(dest, layout, source)


def test_blocks_never_span_shards(pack_once, sample_data):
    dest = pack_once(sample_data, "wds", "raw")
    layout, _ = layout_of(dest)
    shards = len(read_local_manifest(dest)["shards"])
    assert shards > 1
    for target in (1, 20_000, 1 << 40):
        starts = span_blocks(layout, target)
        spans = block_spans(layout, starts)
        for b in range(len(starts)):
            samples = range(int(starts[b]), int(starts[b + 1]) if b + 1 < len(starts) else len(layout))
            assert {int(layout.file[i]) for i in samples} == {int(spans[b, 0])}
            _, first, last = spans[b]
            assert all(first <= layout.start[i] and layout.end[i] <= last for i in samples)
    assert len(span_blocks(layout, 1 << 40)) == shards  # a whole shard at most: one block each


def one_line(exc: pytest.ExceptionInfo, *names: str) -> None:
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message
    for name in names:
        assert name in message, message


def test_truncated_shard_is_named(pack_once, sample_data, tmp_path):
    dest = tmp_path / "ds"
    shutil.copytree(pack_once(sample_data, "wds", "original"), dest)
    layout, source = layout_of(dest)
    shard = dest / layout.files[1]
    middle = int(layout.start[np.flatnonzero(layout.file == 1)[2]])
    with open(shard, "r+b") as f:
        f.truncate(middle)
    with pytest.raises(CorruptDataError) as exc:
        layout_of(dest)
    one_line(exc, str(shard), "truncated")
    # a layout cached before the shard was cut: the sample's range now ends early, named as it is read
    i = int(np.flatnonzero(layout.file == 1)[2])
    data = range_bytes(source, layout, i)
    assert len(data) == 0
    with pytest.raises(CorruptDataError) as exc:
        WdsReader.ranged_sample(i, data, layout, str(dest))
    one_line(exc, str(shard), "truncated")


def test_missing_extra_member_is_named(tmp_path):
    dest = tmp_path / "ds"
    write_dataset(dest, "wds", SCHEMA)
    layout, source = layout_of(dest)
    reader = WdsReader(dest)
    data = bytearray(range_bytes(source, layout, 3))
    at = data.index(b"000000003.mask.png")
    data[at:at + 18] = b"000000003.mast.png"
    with pytest.raises(CorruptDataError) as exc:
        WdsReader.ranged_extras(3, memoryview(bytes(data)), layout, reader.extra_fields, str(dest))
    one_line(exc, str(dest / layout.files[int(layout.file[3])]), "'mask'")


def rewrite_index(dest: Path, rows: np.ndarray) -> None:
    np.save(dest / INDEX, rows, allow_pickle=False)


@pytest.mark.parametrize("damage", ["extra bytes", "fewer rows", "object dtype", "label", "shard order", "count"])
def test_lying_index_is_refused_before_allocating(pack_once, sample_data, tmp_path, damage):
    dest = tmp_path / "ds"
    shutil.copytree(pack_once(sample_data, "wds", "raw"), dest)
    rows = np.load(dest / INDEX).copy()
    if damage == "extra bytes":
        with open(dest / INDEX, "ab") as f:
            f.write(b"\0" * rows.dtype.itemsize)
    elif damage == "fewer rows":
        rewrite_index(dest, rows[:-1])
    elif damage == "object dtype":  # a pickle where the index should be: never loaded
        np.save(dest / INDEX, np.array([{"a": 1}] * 4, dtype=object), allow_pickle=True)
    elif damage == "label":
        rows["label"][5] = 99
        rewrite_index(dest, rows)
    elif damage == "shard order":
        rows["offset"][3], rows["offset"][4] = rows["offset"][4], rows["offset"][3]
        rows["json_offset"][3], rows["json_offset"][4] = rows["json_offset"][4], rows["json_offset"][3]
        rewrite_index(dest, rows)
    else:  # a manifest whose count would size a huge array
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest["count"] = 10**15
        (dest / "manifest.json").write_text(json.dumps(manifest))
    manifest = json.loads((dest / "manifest.json").read_text())
    with pytest.raises(CorruptDataError) as exc:
        WdsReader.layout(manifest, LocalSource(dest), str(dest))
    one_line(exc, str(dest / INDEX) if damage != "count" else str(dest))


def test_foreign_shards_are_refused(pack_once, sample_data, tmp_path):
    """Shards another tool wrote (here: a packed dataset's tar members rewritten by tarfile, no index)."""
    src = pack_once(sample_data, "wds", "original")
    paths = []
    for entry in read_local_manifest(src)["shards"][:2]:
        paths.append(tmp_path / Path(entry["path"]).name)
        with tarfile.open(src / entry["path"]) as tin, tarfile.open(paths[-1], "w") as tout:
            for member in tin:
                if not member.name.endswith(".json"):
                    tout.addfile(member, tin.extractfile(member))
    reader = WdsReader.from_shards(paths)
    with pytest.raises(UsageError) as exc:
        WdsReader.layout(reader.manifest, LocalSource(tmp_path), str(tmp_path))
    one_line(exc, str(tmp_path), "pack them first")

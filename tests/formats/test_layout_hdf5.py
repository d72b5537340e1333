"""HDF5 read by byte ranges (issue 25): ``Hdf5Reader.layout`` over a :class:`LocalSource` gives every sample's
range of ``data.h5``, and the ranged hooks turn those bytes into exactly what the local reader gives (payload,
label, shape, crc32, extra fields and their checksum), for original, jpeg and raw stores and a dataset with
fields; the layout costs a few source reads, never the images blob; damaged files are one-line errors.

References are h5py reading the same file (the payload slice) and the local reader; packs are real.
"""

from __future__ import annotations

import io
import json
import shutil
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image
from support.fields import SCHEMA, write_dataset

from packer.errors import CorruptDataError, PackerError, UsageError
from packer.fields import extra_fields
from packer.formats.hdf5 import FILENAME, Hdf5Reader, Hdf5Writer
from packer.formats.layout import Layout, LocalSource
from packer.images.transforms import Encoded, TransformSpec
from packer.manifest import FORMAT_VERSION, MANIFEST, write_json_atomic


class CountingSource:
    """A LocalSource that counts the calls made to it (a read_many of several ranges is one) and the bytes."""

    def __init__(self, root: Path):
        self.local = LocalSource(root)
        self.calls = 0
        self.bytes = 0

    def read(self, relpath: str, start: int, end: int) -> bytes:
        return self.read_many([(relpath, start, end)])[0]

    def read_many(self, ranges):
        self.calls += 1
        out = self.local.read_many(ranges)
        self.bytes += sum(len(b) for b in out)
        return out

    def size(self, relpath: str) -> int:
        return self.local.size(relpath)


def manifest_of(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


def layout_of(root: Path, source=None) -> Layout:
    return Hdf5Reader.layout(manifest_of(root), source or LocalSource(root), str(root))


def check_every_sample(root: Path, layout: Layout) -> int:
    """Every sample's ranged_sample/ranged_extras/ranged_fields_checksum equal the local reader's read/
    read_extras/fields_checksum; the layout saved and loaded again gives the same. Returns the sample count."""
    reader = Hdf5Reader(root)
    reader.open()
    data = memoryview((root / FILENAME).read_bytes())
    extras = reader.extra_fields
    assert layout.files == (FILENAME,) and len(layout) == len(reader)
    for i in range(len(reader)):
        piece = data[int(layout.start[i]):int(layout.end[i])]
        got, want = Hdf5Reader.ranged_sample(i, piece, layout, str(root)), reader.read(i)
        assert bytes(got.payload) == bytes(want.payload), i
        assert (got.label, got.shape, got.crc32) == (want.label, want.shape, want.crc32), i
        assert type(got.label) is int and type(got.crc32) is int and all(type(s) is int for s in got.shape)
        assert zlib.crc32(got.payload) == got.crc32, i
        got_extras = Hdf5Reader.ranged_extras(i, piece, layout, extras, str(root))
        assert [bytes(v) for v in got_extras] == [bytes(v) for v in reader.read_extras(i)], i
        if extras:
            assert Hdf5Reader.ranged_fields_checksum(i, piece, layout) == reader.fields_checksum(i), i
        else:
            assert Hdf5Reader.ranged_fields_checksum(i, piece, layout) is None
    return len(reader)


def check_round_trip(layout: Layout, tmp_path: Path) -> Layout:
    layout.save(tmp_path / "layout.npz")
    again = Layout.load(tmp_path / "layout.npz")
    assert again is not None and again.files == layout.files
    assert np.array_equal(again.start, layout.start) and np.array_equal(again.end, layout.end)
    assert sorted(again.index) == sorted(layout.index)
    for name, value in layout.index.items():
        assert again.index[name].dtype == value.dtype and np.array_equal(again.index[name], value), name
    return again


@pytest.mark.parametrize("store", ["original", "jpeg", "raw_var"])
def test_ranges_are_the_payloads_of_an_offsets_store(pack_once, sample_data, store, tmp_path):
    root = pack_once(sample_data, "hdf5", store)
    layout = layout_of(root)
    with h5py.File(root / FILENAME, "r") as f:  # the reference: h5py's own slices of the blob
        begin, offsets, images = f["images"].id.get_offset(), f["offsets"][()], f["images"]
        for i in (0, 1, len(offsets) // 2, len(offsets) - 2):
            assert layout.start[i] == begin + offsets[i] and layout.end[i] == begin + offsets[i + 1]
            data = (root / FILENAME).read_bytes()[layout.start[i]:layout.end[i]]
            assert data == images[offsets[i]:offsets[i + 1]].tobytes()
    assert sorted(layout.index) == ["crc32", "labels", "shapes"]
    assert check_every_sample(root, layout) == 150
    assert check_every_sample(root, check_round_trip(layout, tmp_path)) == 150


@pytest.mark.parametrize(("store", "row"), [("raw", 56 * 56 * 3), ("raw_normalize", 32 * 40 * 3 * 2)])
def test_ranges_are_the_rows_of_a_fixed_shape_raw_store(pack_once, sample_data, tmp_path, store, row):
    root = pack_once(sample_data, "hdf5", store)  # 56 x 56 x 3 uint8 rows; 32 x 40 x 3 float16 rows
    layout = layout_of(root)
    assert np.all(layout.end - layout.start == row) and np.all(np.diff(layout.start) == row)
    with h5py.File(root / FILENAME, "r") as f:
        assert layout.start[0] == f["images"].id.get_offset()
        data = (root / FILENAME).read_bytes()
        assert data[layout.start[7]:layout.end[7]] == f["images"][7].tobytes()
    assert check_every_sample(root, layout) == 150
    check_every_sample(root, check_round_trip(layout, tmp_path))


@pytest.fixture(scope="module")
def fields_root(tmp_path_factory) -> Path:
    """An image + fields dataset (caption, numbers, json, masks and bytes) written through the HDF5 writer."""
    root = tmp_path_factory.mktemp("layout-fields") / "ds"
    write_dataset(root, "hdf5", SCHEMA)
    return root


def test_ranged_extras_are_the_fields_of_an_image_and_fields_dataset(fields_root, tmp_path):
    layout = layout_of(fields_root)
    names = [f.name for f in extra_fields(SCHEMA)]
    assert "caption" in names and "target" in names and "fields_crc32" in layout.index
    assert layout.index["values.target"].dtype == np.float32 and "offsets.target" not in layout.index
    assert layout.index["values.caption"].dtype == np.uint8 and "offsets.caption" in layout.index
    assert check_every_sample(fields_root, layout) == 12
    check_every_sample(fields_root, check_round_trip(layout, tmp_path))
    caption = Hdf5Reader.ranged_extras(3, memoryview(b""), layout, extra_fields(SCHEMA), "x")[names.index("caption")]
    assert bytes(caption).decode() == "a photo of sample 3 ü"


def tiny_png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), seed % 256, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def many_root(tmp_path_factory) -> Path:
    """40,000 tiny PNGs written through the HDF5 writer: the arrays after the blob span several megabytes."""
    root = tmp_path_factory.mktemp("layout-many") / "ds"
    root.mkdir()
    count, classes = 40_000, ["a", "b", "c"]
    spec = TransformSpec(store="png")
    pngs = [tiny_png(k) for k in range(256)]
    writer = Hdf5Writer(root, spec, count, {"classes": classes})
    for i in range(count):
        payload = pngs[i % 256] + i.to_bytes(4, "little")  # distinct payloads (PNG readers ignore trailing bytes)
        writer.write(i % 3, f"{classes[i % 3]}/s{i:05d}.png", Encoded(payload, "png", (4, 4, 3), zlib.crc32(payload)))
    entries = writer.close()
    write_json_atomic(root / MANIFEST, {
        "format": "hdf5", "format_version": FORMAT_VERSION, "count": count, "classes": classes,
        "class_to_idx": {c: k for k, c in enumerate(classes)}, "store": "png", "transform": spec.to_dict(),
        "shape": [4, 4, 3], "dtype": "uint8", "checksum": "crc32", **entries})
    return root


def test_the_layout_costs_a_few_source_reads_and_not_the_blob(many_root, pack_once, sample_data):
    source = CountingSource(many_root)
    layout = layout_of(many_root, source)
    size = (many_root / FILENAME).stat().st_size
    with h5py.File(many_root / FILENAME, "r") as f:
        blob = f["images"].nbytes
        tail = size - f["images"].id.get_offset() - blob
    assert tail > 2 << 20  # the other datasets and their headers span several pieces after the blob
    assert source.calls == 2, source.calls  # the first megabyte, then everything after the blob at once
    assert source.bytes <= (1 << 20) + tail + (1 << 20)
    assert check_every_sample(many_root, layout) == 40_000

    photos = pack_once(sample_data, "hdf5", "original")  # a 7 MB blob of photos
    source = CountingSource(photos)
    layout_of(photos, source)
    assert source.calls == 2 and source.bytes < (photos / FILENAME).stat().st_size // 2, (source.calls, source.bytes)


# -- damaged files ---------------------------------------------------------------------------------------------

def damaged_copy(root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ds"
    shutil.copytree(root, copy)
    return copy


def one_line_error(root: Path, kind: type[PackerError] = CorruptDataError) -> str:
    with pytest.raises(kind) as caught:
        layout_of(root)
    message = str(caught.value)
    assert "\n" not in message and FILENAME in message and str(root) in message, message
    return message


def test_offsets_not_increasing_is_a_one_line_error(pack_once, sample_data, tmp_path):
    root = damaged_copy(pack_once(sample_data, "hdf5", "original"), tmp_path)
    with h5py.File(root / FILENAME, "r+") as f:
        f["offsets"][10] = f["offsets"][12]  # sample 10 ends after sample 11 does
    assert "decrease at sample 10" in one_line_error(root)


def test_an_offset_past_the_blob_is_a_one_line_error(pack_once, sample_data, tmp_path):
    root = damaged_copy(pack_once(sample_data, "hdf5", "original"), tmp_path)
    with h5py.File(root / FILENAME, "r+") as f:
        offsets = f["offsets"][()]
        offsets[140:] += f["images"].shape[0]
        f["offsets"][...] = offsets
    assert "past" in one_line_error(root)


def test_a_field_offset_past_its_values_is_a_one_line_error(fields_root, tmp_path):
    root = damaged_copy(fields_root, tmp_path)
    with h5py.File(root / FILENAME, "r+") as f:
        f["fields/caption/offsets"][-1] = f["fields/caption/values"].shape[0] + 5
    assert "fields/caption/offsets" in one_line_error(root)


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_a_truncated_file_is_a_one_line_error(pack_once, sample_data, tmp_path, keep):
    root = damaged_copy(pack_once(sample_data, "hdf5", "original"), tmp_path)
    path = root / FILENAME
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else keep)
    assert "truncated" in one_line_error(root)


def test_an_overwritten_superblock_is_a_one_line_error(pack_once, sample_data, tmp_path):
    root = damaged_copy(pack_once(sample_data, "hdf5", "original"), tmp_path)
    with open(root / FILENAME, "r+b") as f:
        f.write(b"\xff" * 64)
    assert "signature" in one_line_error(root)


def test_a_file_shorter_than_its_source_says_is_a_one_line_error(pack_once, sample_data):
    root = pack_once(sample_data, "hdf5", "original")

    class Longer(CountingSource):  # a file that shrank between its size and its reads
        def size(self, relpath: str) -> int:
            return super().size(relpath) + 4096

    with pytest.raises(CorruptDataError, match="changed while being read") as caught:
        layout_of(root, Longer(root))
    assert "\n" not in str(caught.value) and FILENAME in str(caught.value)


def test_counts_and_lying_sizes_are_one_line_errors_before_any_allocation(pack_once, sample_data, tmp_path):
    root = damaged_copy(pack_once(sample_data, "hdf5", "original"), tmp_path)
    manifest = manifest_of(root)
    write_json_atomic(root / MANIFEST, {**manifest, "count": 149})
    assert "149" in one_line_error(root)
    write_json_atomic(root / MANIFEST, manifest)
    with h5py.File(root / FILENAME, "r+") as f:  # a terabyte of labels the file does not hold
        del f["labels"]
        f.create_dataset("labels", (1 << 40,), dtype=np.int64)
    assert "'labels'" in one_line_error(root)


def test_a_chunked_dataset_is_refused_in_one_line(pack_once, sample_data, tmp_path):
    root = damaged_copy(pack_once(sample_data, "hdf5", "original"), tmp_path)
    with h5py.File(root / FILENAME, "r+") as f:
        crcs = f["crc32"][()]
        del f["crc32"]
        f.create_dataset("crc32", data=crcs, chunks=(50,), compression="gzip")
    assert "chunked" in one_line_error(root, UsageError)


def test_a_range_of_the_wrong_size_is_a_one_line_error(pack_once, sample_data):
    root = pack_once(sample_data, "hdf5", "original")
    layout = layout_of(root)
    with pytest.raises(CorruptDataError, match=f"{FILENAME} sample 4: 3 bytes"):
        Hdf5Reader.ranged_sample(4, memoryview(b"abc"), layout, str(root))

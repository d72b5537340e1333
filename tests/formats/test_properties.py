"""Property tests for the parsers that read untrusted bytes: LMDB records, manifests and .npy headers.

Each must return a correct value or raise a :class:`packer.PackerError` subclass, never another exception
(a ``struct.error``, ``KeyError``, ``TypeError``, ``RecursionError``... would reach the user as a traceback).
"""

from __future__ import annotations

import copy
import io
import json
import math
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from packer.errors import CorruptDataError, ManifestError
from packer.formats.lmdb.records import HEADER, MAGIC, pack_record, unpack_record
from packer.formats.wds.foreign import _npy_header
from packer.images.transforms import Encoded
from packer.manifest import FORMAT_VERSION, parse_manifest

SETTINGS = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------------------------------------------
# LMDB records
# --------------------------------------------------------------------------------------------------------------

relpaths = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)  # anything UTF-8 can encode
shapes = st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 0xFF))
labels = st.integers(-(2**31), 2**31 - 1)


@st.composite
def records(draw) -> bytes:
    """A valid record, then possibly damaged: a byte changed, cut short, or extended."""
    payload = draw(st.binary(max_size=300))
    value = pack_record(draw(labels), draw(relpaths), Encoded(payload, "jpg", draw(shapes), zlib.crc32(payload)))
    how = draw(st.sampled_from(["intact", "flip", "cut", "extend", "header"]))
    if how == "flip" and value:
        i = draw(st.integers(0, len(value) - 1))
        value = value[:i] + bytes([value[i] ^ draw(st.integers(1, 255))]) + value[i + 1:]
    elif how == "cut":
        value = value[: draw(st.integers(0, len(value)))]
    elif how == "extend":
        value = value + draw(st.binary(min_size=1, max_size=20))
    elif how == "header":  # a well-formed header whose lengths disagree with the record
        value = HEADER.pack(MAGIC, 0, 0, 1, 1, 3, 0, draw(st.integers(0, 0xFFFF)),
                            draw(st.integers(0, 2**32 - 1))) + draw(st.binary(max_size=50))
    return value


def check_unpacked(data: bytes) -> None:
    """unpack_record either raises CorruptDataError naming ``where`` or returns what the header says."""
    try:
        sample, relpath = unpack_record(data, "data.mdb sample 7")
    except CorruptDataError as exc:
        assert "data.mdb sample 7" in str(exc) and "\n" not in str(exc)
        return
    magic, label, crc, h, w, c, _, path_len, size = HEADER.unpack_from(data)
    assert magic == MAGIC
    assert HEADER.size + path_len + size == len(data)
    assert relpath.encode("utf-8") == data[HEADER.size:HEADER.size + path_len]
    assert bytes(sample.payload) == data[HEADER.size + path_len:]
    assert (sample.label, sample.shape, sample.crc32) == (label, (h, w, c), crc)


@SETTINGS
@given(st.binary(max_size=200))
@example(b"")
@example(MAGIC)
@example(MAGIC + b"\0" * 20)
@example(HEADER.pack(MAGIC, 1, 2, 3, 4, 3, 0, 2, 0) + b"\xff\xfe")  # a path that is not UTF-8
def test_unpack_record_arbitrary_bytes(data):
    check_unpacked(data)


@SETTINGS
@given(records())
def test_unpack_record_damaged_records(data):
    check_unpacked(data)


@SETTINGS
@given(labels, relpaths, st.binary(max_size=2000), shapes)
def test_pack_unpack_round_trip(label, relpath, payload, shape):
    crc = zlib.crc32(payload)
    value = pack_record(label, relpath, Encoded(payload, "png", shape, crc))
    sample, path = unpack_record(value)
    assert path == relpath
    assert bytes(sample.payload) == payload
    assert sample.label == label and sample.shape == shape and sample.crc32 == crc
    # a reader over a memoryview (py-lmdb's buffers=True) sees the same
    sample2, path2 = unpack_record(memoryview(value))
    assert (bytes(sample2.payload), path2, sample2.label) == (payload, relpath, label)


# --------------------------------------------------------------------------------------------------------------
# manifest.json
# --------------------------------------------------------------------------------------------------------------

VALID = {
    "format": "lmdb", "format_version": FORMAT_VERSION, "packer_version": "0.1.0", "count": 3,
    "classes": ["a", "b"], "class_to_idx": {"a": 0, "b": 1},
    "transform": {"store": "original", "resize": None, "quality": 90},
    "files": [{"path": "data.mdb", "bytes": 1234, "sha256": "0" * 64}],
    "shards": [{"path": "shard-000000.tar", "count": 3}], "shape": None, "checksum": "crc32", "skipped": [],
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def check_manifest(text) -> None:
    try:
        result = parse_manifest(text, "/data/ds/manifest.json")
    except ManifestError as exc:
        assert "/data/ds/manifest.json" in str(exc) and "\n" not in str(exc)
        return
    # what a reader relies on once the manifest parsed
    assert isinstance(result, dict)
    assert isinstance(result["count"], int) and result["count"] >= 0
    assert result["class_to_idx"] == {c: i for i, c in enumerate(result["classes"])}
    assert result["format_version"] <= FORMAT_VERSION
    for entry in result["files"]:
        assert isinstance(entry["path"], str) and ".." not in entry["path"].split("/")
        assert not entry["path"].startswith("/")
        assert isinstance(entry["bytes"], int)


def test_valid_manifest_parses():
    assert parse_manifest(json.dumps(VALID)) == VALID


@SETTINGS
@given(st.binary(max_size=300))
@example(b"\xff\xfe\x00")
@example(b"[" * 100_000)  # nesting deep enough to exhaust the recursion limit
@example(b'{"a": ' * 50_000)
@example(b"1" * 5000)  # an integer with more digits than Python converts by default
def test_parse_manifest_arbitrary_bytes(data):
    check_manifest(data)


@SETTINGS
@given(json_values)
def test_parse_manifest_arbitrary_json(value):
    check_manifest(json.dumps(value))


@st.composite
def mutated_manifests(draw) -> dict:
    manifest = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["drop", "replace", "nested"]))
        key = draw(st.sampled_from(sorted(manifest) + ["extra"]))
        if how == "drop":
            manifest.pop(key, None)
        elif how == "replace":
            manifest[key] = draw(json_values)
        else:  # damage something inside files, classes or class_to_idx
            target = draw(st.sampled_from(["files", "classes", "class_to_idx"]))
            container = manifest.get(target)
            if isinstance(container, list) and container:
                i = draw(st.integers(0, len(container) - 1))
                if isinstance(container[i], dict) and draw(st.booleans()):
                    container[i][draw(st.sampled_from(["path", "bytes", "sha256"]))] = draw(
                        json_values | st.sampled_from(["../x", "/etc/passwd", "a/../../b", "", "a\\b"]))
                else:
                    container[i] = draw(json_values)
            elif isinstance(container, dict):
                container[draw(st.text(max_size=3))] = draw(json_values)
    return manifest


@SETTINGS
@given(mutated_manifests())
def test_parse_manifest_mutated(manifest):
    check_manifest(json.dumps(manifest))


@pytest.mark.parametrize("change", [
    {"format_version": 999}, {"format_version": True}, {"count": -1}, {"count": 1.5}, {"count": "3"},
    {"classes": ["a", 1]}, {"class_to_idx": {"a": 1, "b": 0}}, {"files": [{"path": "../etc/passwd", "bytes": 1}]},
    {"files": [{"path": "/abs", "bytes": 1}]}, {"files": ["data.mdb"]}, {"transform": []},
])
def test_parse_manifest_rejects(change):
    manifest = {**VALID, **change}
    with pytest.raises(ManifestError, match="manifest.json"):
        parse_manifest(json.dumps(manifest))


# --------------------------------------------------------------------------------------------------------------
# .npy headers of WebDataset members
# --------------------------------------------------------------------------------------------------------------

def npy(shape, dtype="uint8", fortran=False, version=None) -> bytes:
    buf = io.BytesIO()
    arr = np.zeros(shape, dtype=dtype, order="F" if fortran else "C")
    np.lib.format.write_array(buf, arr, version=version, allow_pickle=False)
    return buf.getvalue()


def check_npy(data: bytes) -> None:
    try:
        shape, header_len = _npy_header(data, "shard-000000.tar:000000001.npy")
    except CorruptDataError as exc:
        assert "shard-000000.tar:000000001.npy" in str(exc)
        return
    assert len(shape) == 3 and all(isinstance(x, int) and x >= 0 for x in shape)
    assert 0 < header_len <= len(data)
    # the header decodes to that shape with numpy itself
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
    np_shape, fortran, dtype = read(f)
    assert not fortran and dtype == np.uint8 and len(np_shape) in (2, 3)
    assert shape == (*np_shape[:2], np_shape[2] if len(np_shape) == 3 else 1) and f.tell() == header_len


@st.composite
def npy_headers(draw) -> bytes:
    shape = draw(st.lists(st.integers(0, 70000), min_size=0, max_size=4).filter(lambda s: math.prod(s) < 10_000))
    dtype = draw(st.sampled_from(["uint8", "float32", "<i2", "bool"]))
    data = npy(tuple(shape), dtype, draw(st.booleans()), draw(st.sampled_from([None, (1, 0), (2, 0), (3, 0)])))
    if draw(st.booleans()) and data:  # damage one byte of the header, or cut it short
        cut = min(len(data), 200)
        if draw(st.booleans()):
            i = draw(st.integers(0, cut - 1))
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
        else:
            data = data[: draw(st.integers(0, cut))]
    return data


@SETTINGS
@given(st.binary(max_size=300))
@example(b"\x93NUMPY\x01\x00\x10\x00{'descr': '|u1'}")
@example(b"\x93NUMPY\x03\x00\x10\x00\x00\x00\xff\xfe\xfd" + b" " * 16)
@example(b"\x93NUMPY\x01\x00" + struct.pack("<H", 60) + b"{'descr': '|u1', 'fortran_order': False, 'shape': ("
         + b"(" * 30 + b")}")
def test_npy_header_arbitrary_bytes(data):
    check_npy(data)


@SETTINGS
@given(npy_headers())
def test_npy_header_near_valid(data):
    assume(len(data) > 0)
    check_npy(data)


def test_npy_header_valid_examples():
    assert _npy_header(npy((5, 7, 3)), "x")[0] == (5, 7, 3)
    assert _npy_header(npy((5, 7)), "x")[0] == (5, 7, 1)
    assert _npy_header(npy((5, 7, 3), version=(2, 0)), "x") == ((5, 7, 3), len(npy((5, 7, 3), version=(2, 0))) - 105)
    for bad in (npy((5, 7, 3), "float32"), npy((5, 7, 3), fortran=True), npy((5,)), npy((2, 2, 2, 2))):
        with pytest.raises(CorruptDataError):
            _npy_header(bad, "x")

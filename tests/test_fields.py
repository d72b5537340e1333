"""packer.fields: typing table columns, and every kind's stored bytes back to the same value."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from packer.errors import ManifestError
from packer.fields import (
    Field,
    decode,
    encode,
    extra_fields,
    fields_crc32,
    is_pair_schema,
    label_field,
    parse_field_option,
    schema_of,
)
from packer.sources.table_values import cell_value, infer_field


@pytest.mark.parametrize("field, value", [
    (Field("n", "int64"), -(2**62)),
    (Field("x", "float32"), 0.25),
    (Field("box", "float32", (4,)), [0.5, 1.0, 2.0, 4.0]),
    (Field("tags", "int64", None), [3, 1, 4, 1, 5]),
    (Field("tags", "int64", None), []),
    (Field("caption", "text"), "a photo of an astronaut, ünïcode"),
    (Field("meta", "json"), {"b": [1, 2], "a": None}),
    (Field("blob", "bytes"), b"\x00\xff"),
])
def test_every_kind_round_trips(field, value):
    got = decode(field, encode(field, value))
    if isinstance(got, np.ndarray):
        assert got.tolist() == list(value)
    else:
        assert got == value


def test_stored_bytes_are_what_plain_tools_read():
    assert encode(Field("n", "int64"), 7) == np.int64(7).astype("<i8").tobytes()
    assert np.frombuffer(encode(Field("b", "float32", (2,)), [1, 2]), "<f4").tolist() == [1.0, 2.0]
    assert json.loads(encode(Field("m", "json"), {"z": 1, "a": 2})) == {"a": 2, "z": 1}


def test_a_vector_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="box"):
        encode(Field("box", "float32", (4,)), [1, 2, 3])
    with pytest.raises(ValueError, match="stored bytes"):
        decode(Field("box", "float32", (4,)), b"\0" * 12)


@pytest.mark.parametrize("cells, expected", [
    (["1", "-2", "30"], Field("c", "int64")),
    ([1, 2], Field("c", "int64")),
    (["1.5", "2", "1e3"], Field("c", "float32")),
    (["[1, 2]", "[3, 4]"], Field("c", "int64", (2,))),
    ([[1.5, 2], [3, 4]], Field("c", "float32", (2,))),
    (["[1]", "[2, 3]"], Field("c", "int64", (1,))),  # the first row's count; the second row is then refused
    (["[]", "[2, 3]"], Field("c", "int64", None)),
    (["1", "18446744073709551616"], Field("c", "int64")),  # the second is refused, not a reason to be float32
    (['{"a": 1}', '{"b": [2]}'], Field("c", "json")),
    ([["cat", "dog"], ["cat"]], Field("c", "json")),
    (["masks/a.png", "masks/b.PNG"], Field("c", "image")),
    (["a dog", "12"], Field("c", "text")),
    (["true", "false"], Field("c", "text")),
    (["nan", "1.5", "-inf"], Field("c", "float32")),
    (["²"], Field("c", "text")),
])
def test_columns_are_typed_from_their_cells(cells, expected):
    assert infer_field("c", cells) == expected


@pytest.mark.parametrize("cells, expected", [
    ([1, 2**64], Field("c", "int64")),
    (["1", "2"], Field("c", "text")),  # JSON strings are text, whatever they hold
    ([1, "a"], Field("c", "json")),  # JSON values of several types: JSON, each exact
    ([{"a": 1}, "a"], Field("c", "json")),
    ([True, False], Field("c", "json")),
    ([[1.5, 2], [3, 4]], Field("c", "float32", (2,))),
])
def test_json_lines_columns_are_typed_from_their_json_types(cells, expected):
    assert infer_field("c", cells, text=False) == expected


def test_cells_that_do_not_fit_their_type_say_why():
    with pytest.raises(ValueError, match="not an integer"):
        cell_value(Field("n", "int64"), "1.5")
    with pytest.raises(ValueError, match="2 values where the column holds 4.*--field box:float32\\[\\]"):
        cell_value(Field("box", "float32", (4,)), "[1, 2]")
    with pytest.raises(ValueError, match="outside int64"):
        cell_value(Field("n", "int64"), "9" * 5000)
    with pytest.raises(ValueError, match="beyond float32"):
        cell_value(Field("x", "float32"), "1e39")
    with pytest.raises(ValueError, match="not JSON"):
        cell_value(Field("m", "json"), float("nan"), text=False)
    with pytest.raises(ValueError, match="nested deeper than"):
        cell_value(Field("m", "json"), "[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match="appears twice"):
        cell_value(Field("m", "json"), '{"a": 1, "a": 2}')
    with pytest.raises(ValueError, match="not JSON"):
        cell_value(Field("m", "json"), "{oops")
    with pytest.raises(ValueError, match="empty"):
        cell_value(Field("caption", "text"), "")
    assert cell_value(Field("box", "float32", (2,)), "[1, 2.5]") == [1, 2.5]


@pytest.mark.parametrize("text, expected", [
    ("caption:text", Field("caption", "text")),
    ("box:float32[4]", Field("box", "float32", (4,))),
    ("tags:int64[]", Field("tags", "int64", None)),
    ("seg:mask", Field("seg", "mask", (), "uint8")),
    ("subject:class", Field("subject", "class")),
    ("seg:mask[uint16]", Field("seg", "mask", (), "uint16")),
])
def test_field_option(text, expected):
    assert parse_field_option(text) == expected


@pytest.mark.parametrize("text", ["caption", "caption:string", "seg:mask[2]", "bad name:text", ":text",
                                  "n:int64[uint8]", "t:text[3]", "box:float32[0]"])
def test_malformed_field_option_is_one_line(text):
    with pytest.raises(ValueError) as info:
        parse_field_option(text)
    assert "\n" not in str(info.value)


def test_schemas():
    pair = schema_of({})
    assert is_pair_schema(pair) and label_field(pair).name == "label" and extra_fields(pair) == []
    schema = [Field("image", "image"), Field("subject", "class"), Field("caption", "text"),
              Field("seg", "mask", (), "uint8")]
    manifest = {"fields": [f.to_dict() for f in schema]}
    assert schema_of(json.loads(json.dumps(manifest))) == schema
    assert not is_pair_schema(schema)
    assert [f.name for f in extra_fields(schema)] == ["caption", "seg"]


@pytest.mark.parametrize("fields", [
    [], [{"name": "caption", "kind": "text"}], [{"name": "image", "kind": "image"}, {"name": "x", "kind": "what"}],
    [{"name": "image", "kind": "image"}, {"name": "a/b", "kind": "text"}],
    [{"name": "image", "kind": "image"}, {"name": "v", "kind": "int64", "shape": [-3]}],
    [{"name": "image", "kind": "image"}, {"name": "t", "kind": "text"}, {"name": "t", "kind": "text"}],
])
def test_a_damaged_schema_is_a_manifest_error(fields):
    with pytest.raises(ManifestError, match="manifest.json"):
        schema_of({"fields": fields})


def test_fields_checksum_sees_moved_bytes():
    assert fields_crc32([b"ab", b"c"]) != fields_crc32([b"a", b"bc"])


@pytest.mark.parametrize("pixels", ["uint8", "uint16"])
def test_stored_masks_decode_to_their_exact_values(pixels):
    """The fast path for the grayscale PNGs packer stores gives what Pillow reads, value for value; a palette
    PNG (another tool's) keeps its indices, and a damaged one is one ImageError naming it."""

    from PIL import Image

    from packer.errors import ImageError
    from packer.images.masks import decode_mask, mask_array

    values = np.random.default_rng(0).integers(0, np.iinfo(pixels).max, (37, 53), dtype=pixels)
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, "PNG")
    data = buf.getvalue()
    decoded = decode_mask(memoryview(data), "m.png", pixels)
    assert decoded.dtype == pixels and np.array_equal(decoded, values)
    assert np.array_equal(decoded, mask_array(data, "m.png", pixels))
    palette = Image.fromarray(values.astype("uint8") % 7).convert("P")
    buf = io.BytesIO()
    palette.save(buf, "PNG")
    assert np.array_equal(decode_mask(buf.getvalue(), "p.png", "uint8"), np.asarray(palette))
    with pytest.raises(ImageError, match="m.png: cannot decode the mask"):
        decode_mask(data[:len(data) // 2], "m.png", pixels)


def test_tar_member_headers_parse_as_tarfile_reads_them(tmp_path):
    """packer's direct ustar parse gives tarfile's name and size for every header, and None for a damaged one."""
    import tarfile

    from packer.formats.wds.members import member_header

    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, size in (("000001.jpg", 0), ("000001.mask.png", 511), ("000002.txt", 513), ("x" * 99, 7)):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"a" * size))
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    assert [member_header(data[m.offset:m.offset + 512]) for m in members] == [(m.name, m.size) for m in members]
    damaged = bytearray(data[:512])
    damaged[3] ^= 1
    assert member_header(bytes(damaged)) is None and member_header(bytes(512)) is None

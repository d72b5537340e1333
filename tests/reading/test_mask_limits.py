"""Masks bounded and checked at read time (issue 44): a stored mask gets the images' pixel limit from its header,
before it is decoded, and must have its image's size; ``packer verify`` checks the fields' checksums and
``verify --deep`` decodes every field."""

from __future__ import annotations

import struct
import zlib

import pytest
from support.fields import HEIGHT, SCHEMA, WIDTH, write_dataset

import packer
from packer.errors import PackerError
from packer.verify import verify

FORMATS = ("lmdb", "hdf5", "wds")
MASK_SCHEMA = [f for f in SCHEMA if f.name in ("image", "label", "caption", "mask")]


def declared_png(width: int, height: int) -> bytes:
    """A valid grayscale PNG of ``width`` x ``height`` zeros, compressed a row block at a time (small: what a
    hostile writer stores to make a reader allocate ``width * height`` bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    squeeze = zlib.compressobj(1)
    row = b"\0" * (width + 1)  # filter byte and the row's pixels
    body = b"".join(squeeze.compress(row * min(1000, height - at)) for at in range(0, height, 1000))
    body += squeeze.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """Per format: sample 1's mask declares 20000 x 20000 (400 MB decoded), sample 2's is 10 x 10."""
    big, small = declared_png(20000, 20000), declared_png(10, 10)
    made = {}
    for fmt in FORMATS:
        dest = tmp_path_factory.mktemp(f"masks-{fmt}") / "ds"
        write_dataset(dest, fmt, MASK_SCHEMA, count=4, stored={(1, "mask"): big, (2, "mask"): small})
        made[fmt] = dest
    return made


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_mask_over_the_pixel_limit_is_refused_from_its_header(hostile, fmt):
    ds = packer.open_dataset(hostile[fmt])
    assert tuple(ds[0]["mask"].shape) == (HEIGHT, WIDTH)
    with pytest.raises(PackerError, match=r"sample 1 field 'mask'.*declares 20000x20000, over the "
                                          r"89,478,485-pixel limit") as exc:
        ds[1]
    assert "\n" not in str(exc.value)
    if fmt == "wds":
        with pytest.raises(PackerError, match="sample 000000001 field 'mask'.*declares 20000x20000"):
            list(packer.stream(hostile[fmt], batch_size=4, shuffle=False, num_workers=0))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_mask_of_another_size_than_its_image_is_refused(hostile, fmt):
    ds = packer.open_dataset(hostile[fmt])
    with pytest.raises(PackerError, match=rf"sample 2 field 'mask'.*the mask is 10x10, its image {WIDTH}x{HEIGHT}"):
        ds[2]
    cropped = packer.open_dataset(hostile[fmt], resize=8, center_crop=8)  # not rescaled into place either
    with pytest.raises(PackerError, match="the mask is 10x10"):
        cropped[2]


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_deep_decodes_every_field(hostile, fmt):
    assert verify(hostile[fmt]) == []  # files and checksums: as written, sound
    problems = verify(hostile[fmt], deep=True)
    assert len(problems) == 2, problems
    assert "sample 1 field 'mask'" in problems[0] and "declares 20000x20000" in problems[0]
    assert "sample 2 field 'mask'" in problems[1] and "the mask is 10x10" in problems[1]


def test_verify_checks_the_fields_checksums(tmp_path):
    dest = tmp_path / "ds"
    write_dataset(dest, "lmdb", MASK_SCHEMA, count=4)
    data = (dest / "data.mdb").read_bytes()
    at = data.index(b"a photo of sample 2")
    (dest / "data.mdb").write_bytes(data[:at] + b"A" + data[at + 1:])  # one byte of a caption
    problems = verify(dest)
    assert any("sample 2: checksum mismatch in its fields" in p for p in problems), problems

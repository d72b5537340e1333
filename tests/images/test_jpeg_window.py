"""The window decoder (packer.images.jpeg_window): only the part of a JPEG a crop needs, with the same pixels as a
whole decode at the same DCT scale, cropped; and the training crop it serves, unchanged by it."""

from __future__ import annotations

import io
import random
import re

import numpy as np
import pytest
import simplejpeg
from PIL import Image
from support.packed import libjpeg_turbo_headers

from packer.images import jpeg_window
from packer.reading.augment import sample_window, scaled_window, uniform_stream

needs_decoder = pytest.mark.skipif(not jpeg_window.available(), reason="built without libjpeg-turbo's headers")


def test_the_window_decoder_is_built_where_libjpeg_turbo_is_installed():
    """The extension is optional, so nothing else would notice it missing: where the headers are there (this
    project's machines and CI), the install must have built it."""
    if not libjpeg_turbo_headers():
        pytest.skip("no libjpeg-turbo headers under /usr/include")
    assert jpeg_window.available(), "pip install did not build packer.images._jpeg_window; see its build log"
    assert re.fullmatch(r"\d+\.\d+\.\d+", jpeg_window.libjpeg_turbo_version() or "")


@pytest.fixture(scope="module")
def photo(sample_data) -> Image.Image:
    path = sorted((sample_data / "rocket").glob("*.jpg"))[0]
    with Image.open(path) as img:
        return img.convert("RGB")


def encoded(img: Image.Image, kind: str) -> bytes:
    """``img`` as a JPEG of ``kind``: chroma subsampling 4:4:4, 4:2:2 or 4:2:0, progressive 4:2:0, or grey."""
    out = io.BytesIO()
    if kind == "grey":
        img.convert("L").save(out, "JPEG", quality=90)
    else:
        sub = {"444": 0, "422": 1, "420": 2, "progressive": 2}[kind]
        img.save(out, "JPEG", quality=90, subsampling=sub, progressive=kind == "progressive")
    return out.getvalue()


def regions(height: int, width: int, rng: random.Random) -> list[tuple[int, int, int, int]]:
    """Random (left, top, right, bottom) regions of a ``height`` x ``width`` image, and ones on its edges."""
    picks = [(0, 0, width, height), (0, 0, 1, 1), (width - 1, height - 1, width, height), (0, height // 2, 5, height)]
    for _ in range(12):
        left, top = rng.randrange(width), rng.randrange(height)
        picks.append((left, top, rng.randrange(left + 1, width + 1), rng.randrange(top + 1, height + 1)))
    return picks


@needs_decoder
@pytest.mark.parametrize("kind", ["444", "422", "420", "progressive", "grey"])
def test_a_window_is_the_whole_decode_cropped(photo, kind):
    """Exactly the pixels of simplejpeg's whole decode at the same scale (its own libjpeg-turbo), cropped: at
    every DCT scale, to RGB and to grey, for windows anywhere (the crop's edge columns, which libjpeg-turbo
    upsamples as an image edge, are decoded and dropped)."""
    data = encoded(photo, kind)
    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    rng = random.Random(kind)
    for gray in (False, True):
        for denom in (1, 2, 4, 8):
            whole = simplejpeg.decode_jpeg(data, colorspace="GRAY" if gray else "RGB", min_factor=denom,
                                           min_height=-(-height // denom), min_width=-(-width // denom))
            h, w = whole.shape[:2]
            buffer = np.empty(h * w * 3, np.uint8)
            for left, top, right, bottom in regions(h, w, rng):
                got = jpeg_window.decode_window(data, gray, denom, (left, top, right, bottom), buffer, (h, w))
                assert got is not None
                expected = whole[top:bottom, left:right].reshape(bottom - top, right - left, -1)
                assert np.array_equal(got, expected), (kind, gray, denom, (left, top, right, bottom))


@needs_decoder
def test_the_training_crop_is_the_same_whichever_part_is_decoded(sample_data):
    """The fast training path's output from the decoded part equals its output from the whole decode, for
    RandomResizedCrop windows of every photograph in sample_data, flipped or not, at full and reduced scales."""
    compared = 0
    for path in sorted(sample_data.glob("*/*.jpg")):
        data = path.read_bytes()
        full = simplejpeg.decode_jpeg_header(data)[:2]
        for i, size in enumerate([(224, 224), (64, 64), (40, 56)]):
            window = sample_window(*full, (0.08, 1.0), (3 / 4, 4 / 3), uniform_stream(7, i, compared), flip=True)
            whole = scaled_window(data, "RGB", full, window, size, "bilinear", partial=False).copy()
            part = scaled_window(data, "RGB", full, window, size, "bilinear", partial=True)
            assert np.array_equal(part, whole), (path.name, window, size)
            compared += 1
    assert compared >= 100


@needs_decoder
def test_damaged_and_cmyk_jpegs_take_the_whole_decode(photo, tmp_path):
    """A JPEG cut short inside the window is an error, as a whole decode's; a CMYK JPEG, which the window decoder
    does not take, is decoded whole, with the same output."""
    data = encoded(photo, "420")
    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    cut = data[:len(data) // 2]
    buffer = np.empty(height * width * 3, np.uint8)
    with pytest.raises(ValueError):
        jpeg_window.decode_window(cut, False, 1, (0, 0, width, height), buffer, (height, width))
    window = sample_window(height, width, (0.9, 1.0), (3 / 4, 4 / 3), uniform_stream(0, 0, 0))
    for partial in (False, True):
        with pytest.raises(ValueError):
            scaled_window(cut, "RGB", (height, width), window, (64, 64), "bilinear", partial=partial)

    out = io.BytesIO()
    photo.convert("CMYK").save(out, "JPEG", quality=90)
    cmyk = out.getvalue()
    assert jpeg_window.decode_window(cmyk, False, 1, (0, 0, width, height), buffer, (height, width)) is None
    outcomes = []
    for partial in (False, True):
        try:
            outcomes.append(scaled_window(cmyk, "RGB", (height, width), window, (64, 64), "bilinear",
                                          partial=partial).copy())
        except ValueError as exc:
            outcomes.append(str(exc))
    assert type(outcomes[0]) is type(outcomes[1])
    assert np.array_equal(*outcomes) if isinstance(outcomes[0], np.ndarray) else outcomes[0] == outcomes[1]


@needs_decoder
def test_damaged_bytes_never_crash_it_or_write_past_its_buffer(photo):
    """Hostile input: every one of a few hundred JPEGs with bytes changed or cut gives pixels, a ValueError or
    None (never a crash), and nothing is written past the buffer it was given; a JPEG whose dimensions are not
    the ones the caller read from its header is declined."""
    data = encoded(photo.resize((96, 64)), "420")
    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    rng = random.Random(0)
    size = height * width * 3
    guard = np.full(size + 4096, 0xA5, np.uint8)
    outcomes = set()
    for trial in range(400):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        if trial % 4 == 0:
            damaged = damaged[:rng.randrange(2, len(damaged))]
        try:
            got = jpeg_window.decode_window(bytes(damaged), trial % 2 == 1, 1, (10, 5, 90, 60), guard[:size],
                                            (height, width))
            outcomes.add("none" if got is None else "pixels")
        except ValueError:
            outcomes.add("error")
        assert (guard[size:] == 0xA5).all(), f"trial {trial} wrote past the buffer"
    assert {"pixels", "error"} <= outcomes
    assert jpeg_window.decode_window(data, False, 1, (0, 0, width, height), guard[:size], (height + 8, width)) is None

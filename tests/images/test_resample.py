"""The fast paths' OpenCV resampler (``packer.images.resample``): one-channel images, the flip folded into the batch
slot, and the kernel choice at its boundaries, each against Pillow's crop + resize (torchvision's ``resized_crop``)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from support.packed import psnr

from packer.images.resample import SOFTEN_FROM, enlarge, halvings, resample

OUT = 48
# Regions of a photograph, (left, top, right, bottom), for each kernel: upscale, a mild downscale (one bilinear
# pass), just under and just over SOFTEN_FROM, just under and at 2x (bilinear to 2x then 2 x 2 averages), 4x
# (two halvings), and fractional bounds (a window in a DCT-scaled decode: warpAffine).
REGIONS = {
    "upscale": (10, 20, 40, 50),
    "mild": (5, 7, 5 + 60, 7 + 60),
    "under soften": (0, 0, int(OUT * SOFTEN_FROM) - 1, int(OUT * SOFTEN_FROM) - 1),
    "soften": (0, 0, int(OUT * SOFTEN_FROM) + 1, int(OUT * SOFTEN_FROM) + 1),
    "under 2x": (3, 4, 3 + 2 * OUT - 1, 4 + 2 * OUT - 1),
    "2x": (3, 4, 3 + 2 * OUT, 4 + 2 * OUT),
    "4x": (1, 2, 1 + 4 * OUT, 2 + 4 * OUT),
    "fractional": (12.5, 30.25, 12.5 + 130.75, 30.25 + 120.5),
}


@pytest.fixture(scope="module")
def photo(sample_data) -> Image.Image:
    path = sorted((sample_data / "astronaut").glob("*.jpg"))[0]  # detailed: aliasing shows there first
    with Image.open(path) as img:
        return img.convert("RGB")


def pillow(img: Image.Image, box) -> np.ndarray:
    arr = np.asarray(img.resize((OUT, OUT), Image.Resampling.BILINEAR, box=box))
    return arr if arr.ndim == 3 else arr[:, :, None]


def hwc(img: Image.Image) -> np.ndarray:
    arr = np.asarray(img)
    return arr if arr.ndim == 3 else arr[:, :, None]


def test_kernel_choice_by_the_least_shrunk_axis():
    assert [halvings(h, h, OUT, OUT) for h in (30, 95, 96, 191, 192, 400)] == [0, 0, 1, 1, 2, 3]
    assert halvings(300, 90, OUT, OUT) == 0  # one axis under 2x: one bilinear pass
    assert halvings(300, 100, OUT, OUT) == 1


@pytest.mark.parametrize("region", list(REGIONS))
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_close_to_pillow_on_each_side_of_every_kernel_boundary(photo, region, mode):
    img = photo.convert(mode)
    box = REGIONS[region]
    got = resample(hwc(img), box, (OUT, OUT))
    assert got.shape == (OUT, OUT, 1 if mode == "L" else 3) and got.dtype == np.uint8
    # the fast path promises 30 dB on any photograph; on this one every kernel was over 41 dB, while bilinear
    # alone (no antialiasing) gave 26 dB at 4x and leaving out the soften step 34 dB
    assert psnr(got, pillow(img, box)) >= 38, region


def test_a_window_of_the_output_size_is_copied_exactly(photo):
    arr = hwc(photo)
    assert np.array_equal(resample(arr, (7, 9, 7 + OUT, 9 + OUT), (OUT, OUT)), arr[9:9 + OUT, 7:7 + OUT])


@pytest.mark.parametrize("region", list(REGIONS))
def test_one_channel_is_resampled_as_each_channel_of_rgb_into_its_slot(photo, region):
    """OpenCV drops the channel axis of a one-channel image; the slot keeps it, and gets the pixels the same
    grey image resampled as RGB has in each channel."""
    grey = hwc(photo.convert("L"))
    batch = np.zeros((3, OUT, OUT, 1), np.uint8)
    got = resample(grey, REGIONS[region], (OUT, OUT), out=batch[1])
    assert np.shares_memory(got, batch) and np.array_equal(batch[1], got)
    assert not batch[0].any() and not batch[2].any()
    as_rgb = resample(np.repeat(grey, 3, axis=2), REGIONS[region], (OUT, OUT))
    assert all(np.array_equal(got[:, :, 0], as_rgb[:, :, c]) for c in range(3))


@pytest.mark.parametrize("region", list(REGIONS))
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_flip_folded_into_the_slot_is_the_mirror_of_the_unflipped_output(photo, region, mode):
    arr = hwc(photo.convert(mode))
    plain = resample(arr, REGIONS[region], (OUT, OUT))
    batch = np.zeros((2, OUT, OUT, arr.shape[2]), np.uint8)
    flipped = resample(arr, REGIONS[region], (OUT, OUT), out=batch[1], flipped=True)
    assert np.shares_memory(flipped, batch)
    assert np.array_equal(batch[1], np.fliplr(plain)) and not batch[0].any()


def test_read_only_and_strided_sources(photo):
    """A raw store's array is a read-only view of the stored bytes; a window of it is strided."""
    arr = hwc(photo).copy()
    frozen = np.frombuffer(arr.tobytes(), np.uint8).reshape(arr.shape)
    assert not frozen.flags.writeable
    box = REGIONS["mild"]
    assert np.array_equal(resample(frozen, box, (OUT, OUT)), resample(arr, box, (OUT, OUT)))


# -- enlarge: the default decoder's kernel where a bilinear resize enlarges -----------------------------------------

def pillow_resize_crop(arr: np.ndarray, resized: tuple[int, int], region: tuple[int, int, int, int]) -> np.ndarray:
    """Pillow's whole resize then the crop: what ``decoder="pil"`` does."""
    top, left, height, width = region
    img = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    return hwc(img.resize((resized[1], resized[0]), Image.Resampling.BILINEAR))[top:top + height, left:left + width]


@pytest.mark.parametrize("channels", [1, 3])
def test_enlarge_within_one_level_of_pillow_on_the_sharpest_images(channels):
    """Random pixels, and random black-and-white ones (every neighbour a full-range step: the worst case for
    rounding), at many sizes and scales (just over 1x to 4x, one side only), every region a crop of them."""
    rng = np.random.default_rng(0)
    worst = 0
    for trial in range(60):
        h, w = (int(v) for v in rng.integers(8, 120, 2))
        arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        if trial % 2:
            arr = np.where(arr > 127, 255, 0).astype(np.uint8)
        resized = (h + int(rng.integers(0, 3 * h)), w + int(rng.integers(0 if trial % 3 else 1, 3 * w)))
        height, width = int(rng.integers(1, resized[0] + 1)), int(rng.integers(1, resized[1] + 1))
        region = (int(rng.integers(0, resized[0] - height + 1)), int(rng.integers(0, resized[1] - width + 1)),
                  height, width)
        got = enlarge(arr, resized, region)
        assert got.shape == (height, width, channels) and got.dtype == np.uint8
        diff = np.abs(got.astype(np.int16) - pillow_resize_crop(arr, resized, region))
        worst = max(worst, int(diff.max()))
    assert worst == 1  # off by one somewhere (Pillow rounds between its passes), never by more


def test_enlarge_into_a_slot_from_a_read_only_strided_view(photo):
    arr = hwc(photo)[::2, 1::2]  # strided
    frozen = np.frombuffer(arr.tobytes(), np.uint8).reshape(arr.shape)
    frozen_view = frozen[3:, 5:]
    resized = (frozen_view.shape[0] * 2 + 1, frozen_view.shape[1] + 7)
    region = (10, 3, 50, 40)
    batch = np.zeros((2, 50, 40, 3), np.uint8)
    got = enlarge(frozen_view, resized, region, out=batch[1])
    assert np.shares_memory(got, batch) and not batch[0].any()
    assert np.array_equal(got, enlarge(np.ascontiguousarray(frozen_view), resized, region))
    assert np.abs(got.astype(np.int16) - pillow_resize_crop(frozen_view.copy(), resized, region)).max() <= 1

"""Read-time training augmentation fused into decoding: ``random_resized_crop`` and ``flip``.

The window is torchvision's ``RandomResizedCrop.get_params`` (10 tries, then the centre-crop fallback) on the
stored image's full-size dimensions, which come from the stored header or index, never from decoding. Its
randomness is a pure function of ``(seed, epoch, index)``: a counter-based stream (splitmix64 of the three
numbers, then of a counter), plain integer arithmetic, so every process, thread and platform draws the same
window for a sample, and a draw costs well under a microsecond.

The output is torchvision's ``resized_crop(img, top, left, height, width, size, interpolation)`` then
``hflip`` when flipped: :func:`crop_resize` does exactly what torchvision does to a PIL image. The fast path
(:func:`scaled_window` for JPEGs, :func:`resized_window` for raw arrays and full decodes) decodes a JPEG at the
largest DCT scale (1/2, 1/4, 1/8) that keeps the scaled window at least ``MARGIN`` times the output, then
resamples only the window with OpenCV (:mod:`packer.images.resample`), straight into the batch slot, flip included.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import simplejpeg
from PIL import Image

from ..images.jpeg_window import available as window_decoder_available
from ..images.jpeg_window import decode_window
from ..images.resample import resample
from ..images.transforms import INTERPOLATIONS, as_hwc, to_pil
from .scratch import decode_scratch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
TRIES = 10  # torchvision's RandomResizedCrop.get_params
# DCT-scaled decodes keep the region at least MARGIN times the output, so that the bilinear resample after them
# still does the antialiasing: with 1 (the smallest scale that covers the output) small crops fell well below
# the 30 dB the fast path promises (docs/benchmarks.md, "Augmentation"). The cost is one scale step less.
MARGIN = 2


def _mix(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform_stream(seed: int, epoch: int, index: int) -> Iterator[float]:
    """The uniform draws in [0, 1) of sample ``index`` in ``epoch``: an endless, reproducible stream."""
    key = _mix(_mix(_mix(seed & _MASK) ^ (epoch & _MASK)) ^ (index & _MASK))
    counter = 0
    while True:
        yield (_mix(key + counter * _GOLDEN & _MASK) >> 11) * (1.0 / (1 << 53))
        counter += 1


class Window(NamedTuple):
    """A crop window in the stored image's full-size pixels, and whether the output is flipped."""

    top: int
    left: int
    height: int
    width: int
    flipped: bool


def sample_window(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
                  draws: Iterator[float], crop: bool = True, flip: bool = False) -> Window:
    """torchvision's ``RandomResizedCrop.get_params`` on a ``height`` x ``width`` image, drawing from
    ``draws``; the first draw decides the flip (p = 0.5) so that it does not depend on the number of tries.
    Without ``crop`` the window is the whole image."""
    flipped = next(draws) < 0.5 and flip
    if not crop:
        return Window(0, 0, height, width, flipped)
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(TRIES):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * next(draws))
        aspect = math.exp(log_lo + (log_hi - log_lo) * next(draws))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(next(draws) * (height - h + 1))
            left = int(next(draws) * (width - w + 1))
            return Window(top, left, h, w, flipped)
    in_ratio = width / height  # fallback: the centre crop, its aspect clamped to ``ratio``
    if in_ratio < min(ratio):
        w, h = width, max(1, int(round(width / min(ratio))))  # never a window without pixels
    elif in_ratio > max(ratio):
        h, w = height, max(1, int(round(height * max(ratio))))
    else:
        w, h = width, height
    return Window((height - h) // 2, (width - w) // 2, h, w, flipped)


def image_size(payload: bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) of encoded image bytes from the header alone: simplejpeg for JPEG, Pillow's lazy open
    for the rest. None when the header cannot be read (the decode then reports the damage)."""
    if payload[:2] == b"\xff\xd8":
        try:
            return simplejpeg.decode_jpeg_header(payload)[:2]
        except ValueError:
            return None
    try:
        with Image.open(io.BytesIO(payload)) as img:
            return img.height, img.width
    except Exception:  # Pillow raises many types for damaged headers
        return None


def crop_resize(img: Image.Image, window: Window, size: tuple[int, int], interpolation: str) -> Image.Image:
    """torchvision's ``resized_crop`` on a PIL image (``size`` is (height, width)); the flip is left to
    :func:`write_image`."""
    box = (window.left, window.top, window.left + window.width, window.top + window.height)
    img = img.crop(box)
    if img.size != (size[1], size[0]):
        img = img.resize((size[1], size[0]), INTERPOLATIONS[interpolation])
    return img


def dct_factor(full: tuple[int, int], min_height: int, min_width: int) -> int:
    """The largest of 8, 4, 2 and 1 that divides a ``full`` (height, width) image into one of at least
    ``min_height`` x ``min_width`` (libjpeg-turbo rounds the scaled sides up)."""
    factor = 8
    while factor > 1 and (-(-full[0] // factor) < min_height or -(-full[1] // factor) < min_width):
        factor //= 2
    return factor


def scaled_jpeg(payload: bytes | memoryview, mode: str, full: tuple[int, int], min_height: int,
                min_width: int) -> np.ndarray:
    """Decode a JPEG of ``full`` (height, width) at the smallest DCT scale among 1, 1/2, 1/4 and 1/8 whose image
    is at least ``min_height`` x ``min_width``: libjpeg-turbo skips most of the inverse DCT work at those. The
    pixels are this thread's scratch buffer (:func:`~packer.reading.scratch.decode_scratch`), valid until its
    next decode: they are resampled into the output before that.
    The other M/8 scales libjpeg-turbo offers are left out: they are slower than 1/2 and resample less well
    (docs/benchmarks.md)."""
    factor = dct_factor(full, min_height, min_width)
    height, width, channels = -(-full[0] // factor), -(-full[1] // factor), 1 if mode == "L" else 3
    arr = simplejpeg.decode_jpeg(payload, colorspace="GRAY" if mode == "L" else "RGB", min_factor=factor,
                                 min_height=height, min_width=width, buffer=decode_scratch(height * width * channels))
    return arr.reshape(height, width, channels)


def resample_box(arr: np.ndarray, full: tuple[int, int], box: tuple[float, float, float, float],
                 size: tuple[int, int], interpolation: str) -> Image.Image:
    """Resample the region ``box`` (left, top, right, bottom in full-size pixels) of ``arr``, an image decoded
    at a reduced scale of a ``full`` (height, width) image, to ``size`` (height, width)."""
    return to_pil(arr).resize((size[1], size[0]), INTERPOLATIONS[interpolation], box=scaled_box(arr, full, box))


def scaled_box(arr: np.ndarray, full: tuple[int, int], box: tuple[float, float, float, float]
               ) -> tuple[float, float, float, float]:
    """``box`` (left, top, right, bottom in the ``full`` (height, width) image's pixels) in the pixels of
    ``arr``, that image decoded at a reduced scale (unchanged at full scale)."""
    if arr.shape[:2] == full:
        return box
    sy, sx = arr.shape[0] / full[0], arr.shape[1] / full[1]
    return box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy


def resized_window(arr: np.ndarray, full: tuple[int, int], window: Window, size: tuple[int, int],
                   interpolation: str, out: np.ndarray | None = None) -> np.ndarray:
    """``window`` (in the ``full`` (height, width) image's pixels) of ``arr``, the image decoded at full or
    reduced scale, resampled to ``size`` (height, width) and mirrored when ``window.flipped``, written into
    ``out`` when given (a batch slot).

    Bilinear, the default, goes through OpenCV (:func:`packer.images.resample.resample`), several times faster than
    Pillow, which also needs a copy into a PIL image and one back out (docs/benchmarks.md). It is close to, not
    the same as, Pillow's antialiased filter; other interpolations are Pillow's, exactly."""
    box = (window.left, window.top, window.left + window.width, window.top + window.height)
    if interpolation == "bilinear":
        return resample(arr, scaled_box(arr, full, box), size, out, window.flipped)
    if arr.shape[:2] == full:
        img = pil_window(arr, window, size, interpolation)
    else:
        img = resample_box(arr, full, box, size, interpolation)
    return write_image(img, window.flipped, out)


def pil_window(arr: np.ndarray, window: Window, size: tuple[int, int], interpolation: str) -> Image.Image:
    """:func:`crop_resize` (Pillow, exactly) on a decoded (H, W, C) array, which is cropped first: only the
    window is copied into Pillow."""
    img = to_pil(arr[window.top:window.top + window.height, window.left:window.left + window.width])
    return img if img.size == (size[1], size[0]) else img.resize((size[1], size[0]), INTERPOLATIONS[interpolation])


def scaled_window(payload: bytes | memoryview, mode: str, full: tuple[int, int], window: Window,
                  size: tuple[int, int], interpolation: str, out: np.ndarray | None = None,
                  partial: bool = False) -> np.ndarray:
    """The fast path of :func:`crop_resize` for a JPEG: decode at the largest DCT scale that keeps the scaled
    window at least ``MARGIN`` times ``size``, resample only the window, mirrored when flipped, into ``out``.
    Within 30 dB of the exact output (resampling a DCT-scaled image is close to, not the same as, antialiased
    resampling of the full one).

    With ``partial`` (bytes packer decoded whole at pack time and whose crc32 the read checks) and bilinear
    interpolation, only the part of the JPEG the resample reads is decoded (:func:`jpeg_part`), where packer's
    window decoder was built: the same output, within a level of OpenCV's rounding."""
    h, w = full
    min_height, min_width = -(-h * size[0] * MARGIN // window.height), -(-w * size[1] * MARGIN // window.width)
    if partial and interpolation == "bilinear":
        part = jpeg_part(payload, mode, full, min_height, min_width, window)
        if part is not None:
            return resample(*part, size, out, window.flipped)
    arr = scaled_jpeg(payload, mode, full, min_height, min_width)
    return resized_window(arr, full, window, size, interpolation, out)


def jpeg_part(payload: bytes | memoryview, mode: str, full: tuple[int, int], min_height: int, min_width: int,
              window: Window) -> tuple[np.ndarray, tuple[float, float, float, float]] | None:
    """The part of a JPEG of ``full`` (height, width) that the bilinear resample of ``window`` reads, decoded
    at :func:`scaled_jpeg`'s scale by :func:`~packer.images.jpeg_window.decode_window`, and the window's box in
    its pixels: the same pixels :func:`scaled_jpeg` then :func:`scaled_box` give, less what the resample never
    reads. None where that decoder was not built, or does not take the file, or finds it damaged: the caller
    decodes it whole, which gives the error in the usual words. The pixels are this thread's scratch buffer."""
    if not window_decoder_available():
        return None
    factor = dct_factor(full, min_height, min_width)
    height, width, channels = -(-full[0] // factor), -(-full[1] // factor), 1 if mode == "L" else 3
    sy, sx = height / full[0], width / full[1]
    box = (window.left * sx, window.top * sy, (window.left + window.width) * sx, (window.top + window.height) * sy)
    # the bilinear taps reach one pixel beyond the box; one more against OpenCV's fixed-point rounding
    left, top = max(math.floor(box[0]) - 2, 0), max(math.floor(box[1]) - 2, 0)
    right, bottom = min(math.ceil(box[2]) + 2, width), min(math.ceil(box[3]) + 2, height)
    try:
        pixels = decode_window(payload, mode == "L", factor, (left, top, right, bottom),
                               decode_scratch((bottom - top) * width * channels), (height, width))
    except ValueError:
        return None
    if pixels is None:
        return None
    return pixels, (box[0] - left, box[1] - top, box[2] - left, box[3] - top)


def write_image(img: Image.Image | np.ndarray, flipped: bool, out: np.ndarray | None) -> np.ndarray:
    """``img`` as an (H, W, C) array, mirrored left-right when ``flipped`` (folded into the copy), written into
    ``out`` when given."""
    arr = as_hwc(img)
    if not flipped:
        if out is None:
            return arr
        out[...] = arr
        return out
    if out is None:
        out = np.empty(arr.shape, arr.dtype)
    # whole pixels as one opaque item each: numpy mirrors them about twice as fast as byte by byte
    pixel = f"V{arr.shape[2] * arr.itemsize}"
    np.copyto(out.view(pixel)[..., 0], arr.view(pixel)[..., 0][:, ::-1])
    return out


def nearest_indices(start: float, extent: float, count: int, limit: int) -> np.ndarray:
    """The stored pixel under the centre of each of ``count`` output pixels spread over ``[start, start +
    extent)``: ``floor(start + (i + 0.5) * extent / count)``, clipped to ``[0, limit)`` (torch's
    ``nearest-exact``). Integer bounds, the random resized crop's, are computed exactly in integers."""
    i = np.arange(count, dtype=np.int64)
    if float(start).is_integer() and float(extent).is_integer():
        found = int(start) + (2 * i + 1) * int(extent) // (2 * count)
    else:
        found = np.floor(start + (i + 0.5) * (extent / count)).astype(np.int64)
    return np.clip(found, 0, limit - 1)


def nearest_box(mask: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int],
                flipped: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """The region ``box`` (left, top, right, bottom, in ``mask``'s pixels) of a (H, W) label mask resampled to
    ``size`` (height, width) by nearest neighbour (:func:`nearest_indices`), mirrored left-right when ``flipped``:
    every output value is a stored value. Written into ``out`` when given."""
    rows = nearest_indices(box[1], box[3] - box[1], size[0], mask.shape[0])
    cols = nearest_indices(box[0], box[2] - box[0], size[1], mask.shape[1])
    if flipped:
        cols = cols[::-1]
    picked = mask.take(rows, axis=0).take(cols, axis=1)
    if out is None:
        return picked
    out[...] = picked
    return out

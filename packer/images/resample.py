"""The fast paths' resampler: a region of a uint8 (H, W, C) image to a fixed size with OpenCV's SIMD kernels,
written straight into the caller's array (a batch slot), mirrored in place when asked.

It approximates Pillow's antialiased bilinear filter (a triangle as wide as the scale factor), which is what
torchvision's ``resized_crop`` does to a PIL image, at a fraction of its cost. Which kernel, by the factor ``s``
(region size / output size) of the axis shrunk least:

- ``s < 2`` (upscales, and mild downscales: every window of a store of at most 256 px resampled to 224 px):
  one bilinear pass (``INTER_LINEAR``). Pillow's triangle is then at most twice as wide as OpenCV's, and both
  interpolate the same samples.
- ``s >= 2``: a bilinear pass to ``2**j`` times the output (``2**j <= s``), then ``j`` halvings by 2 x 2 pixel
  averages (``INTER_AREA`` at exactly 2, OpenCV's vectorised case). OpenCV's own area filter at any other factor
  was as slow as Pillow, and bilinear alone aliases (docs/benchmarks.md, "Augmentation and resampling").

Both leave the output sharper than Pillow's (its triangle is wider than a bilinear tap or a 2 x 2 average): on
every axis shrunk by ``SOFTEN_FROM`` or more, a 3-tap blur ``SOFTEN`` at the output's size adds what is missing
(a triangle of width ``s`` has twice the variance of a box of width ``s``); what it gains, what it costs and the
fast path's worst windows are in docs/benchmarks.md.

A region with fractional bounds (a window in an image decoded at a reduced DCT scale) goes through
``warpAffine``, which maps the output grid onto the exact fractional box; rounding the box to whole pixels
instead cost several dB.

:func:`enlarge` is the default decoder's kernel, not an approximation: where a bilinear resize enlarges an image
(neither side shrinks), Pillow's triangle is one pixel wide, a plain 2-tap linear interpolation, and OpenCV's
``INTER_LINEAR`` interpolates the same two pixels at the same positions. Run in float32 and rounded once, it
stays within one level of Pillow, which rounds to uint8 between its two passes (each result is within half a
level of the exact interpolation, Pillow's within one); OpenCV's uint8 kernel truncates partial sums and is not
held to that.
"""

from __future__ import annotations

import math
import threading

import cv2
import numpy as np

# packer decodes a batch on its own threads (one image per thread); OpenCV's pool on top of them would split
# every resize across the same cores again: more threads than cores, and each image waits on the others. This is
# process-wide, so it also applies to the user's own OpenCV calls in this process.
cv2.setNumThreads(1)

SOFTEN_FROM = 1.4  # below it the bilinear pass alone is already close to Pillow (docs/benchmarks.md)
SOFTEN = np.array([0.0625, 0.875, 0.0625], np.float32)
_KEEP = np.array([0.0, 1.0, 0.0], np.float32)

Box = tuple[float, float, float, float]  # left, top, right, bottom in source pixels, as Pillow's ``box``


def halvings(box_height: float, box_width: float, height: int, width: int) -> int:
    """How many 2 x 2 averaging steps follow the bilinear pass: the largest ``j`` with ``2**j`` at most the
    scale factor of the axis shrunk least (0 when that factor is under 2: one bilinear pass)."""
    factor = min(box_height / height, box_width / width)
    return int(math.floor(math.log2(factor))) if factor >= 2 else 0


def resample(src: np.ndarray, box: Box | None, size: tuple[int, int], out: np.ndarray | None = None,
             flipped: bool = False) -> np.ndarray:
    """``box`` of ``src`` (the whole image when None) resampled to ``size`` (height, width), mirrored
    left-right when ``flipped``.

    Args:
        src: a uint8 (H, W, C) array; C is 1 or 3. It may be a read-only or strided view.
        box: (left, top, right, bottom) in ``src`` pixels, possibly fractional; None for all of ``src``.
        size: the output's (height, width).
        out: a C-contiguous (height, width, C) uint8 array (a batch slot) to write into; allocated when None.
        flipped: mirror the output left-right (in place, after the resample).

    Returns:
        ``out``, or the new (height, width, C) array.
    """
    height, width = size
    channels = src.shape[2]
    if out is None:
        out = np.empty((height, width, channels), np.uint8)
    box = box or (0, 0, src.shape[1], src.shape[0])
    j = halvings(box[3] - box[1], box[2] - box[0], height, width)
    target = out if j == 0 else np.empty((height << j, width << j, channels), np.uint8)
    _linear(src, box, target)
    for level in range(j - 1, -1, -1):
        smaller = out if level == 0 else np.empty((height << level, width << level, channels), np.uint8)
        _into(cv2.resize(target, (smaller.shape[1], smaller.shape[0]), dst=_cv(smaller),
                         interpolation=cv2.INTER_AREA), smaller)
        target = smaller
    soften_x, soften_y = (box[2] - box[0]) / width >= SOFTEN_FROM, (box[3] - box[1]) / height >= SOFTEN_FROM
    if soften_x or soften_y:
        dst = _cv(out)
        _into(cv2.sepFilter2D(dst, -1, SOFTEN if soften_x else _KEEP, SOFTEN if soften_y else _KEEP, dst=dst,
                              borderType=cv2.BORDER_REPLICATE), out)
    if flipped:
        _into(cv2.flip(out, 1, dst=_cv(out)), out)
    return out


def enlarge(src: np.ndarray, resized: tuple[int, int], region: tuple[int, int, int, int],
            out: np.ndarray | None = None) -> np.ndarray:
    """``region`` of ``src`` resized to ``resized`` by Pillow's bilinear filter, within one level of Pillow's
    ``resize(..., BILINEAR)`` then ``crop``, where neither side shrinks (see the module docstring).

    Only the rows and columns up to the region's last are resampled: OpenCV's output grid starts at the image's
    first pixel, so the part above and left of the region is computed and dropped, the rest never touched.

    Args:
        src: a uint8 (H, W, C) array; C is 1 or 3. It may be a read-only or strided view.
        resized: the (height, width) of the whole resized image, each at least ``src``'s.
        region: (top, left, height, width) of the output in the resized image.
        out: a C-contiguous (height, width, C) uint8 array to write into; allocated when None.

    Returns:
        ``out``, or the new (height, width, C) array.
    """
    h, w = src.shape[:2]
    top, left, height, width = region
    if out is None:
        out = np.empty((height, width, src.shape[2]), np.uint8)
    rows, cols = _taps_to(top + height, h, resized[0]), _taps_to(left + width, w, resized[1])
    used = _cv(src[:rows, :cols])
    source = _reused("source", used.shape)
    np.copyto(source, used)
    fx, fy = resized[1] / w, resized[0] / h  # the scale given, not derived from an output size: exact positions
    scaled = cv2.resize(source, None, dst=_reused("scaled", (round(rows * fy), round(cols * fx), *used.shape[2:])),
                        fx=fx, fy=fy, interpolation=cv2.INTER_LINEAR)
    kept = scaled[top:top + height, left:left + width]
    if kept.shape[:2] != (height, width):  # the grid stops short of the region: never for sizes Pillow takes
        raise ValueError(f"cannot resize {w}x{h} to {resized[1]}x{resized[0]} for the region {region}")
    _into(cv2.convertScaleAbs(kept, dst=_cv(out)), out)  # rounded to the nearest level, saturated
    return out


_buffers = threading.local()  # each thread's float32 buffers for enlarge, reused: a fresh one pays page faults


def _reused(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """This thread's float32 buffer ``name`` as an array of ``shape``, grown when too small; reused by the next
    call of the same thread."""
    size = math.prod(shape)
    buffer = getattr(_buffers, name, None)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, np.float32)
        setattr(_buffers, name, buffer)
    return buffer[:size].reshape(shape)


def _taps_to(end: int, size: int, resized: int) -> int:
    """How many source pixels along an axis of ``size`` the linear taps of output pixels ``0..end-1`` of a resize
    to ``resized`` reach: output ``i`` samples ``(i + 0.5) * size / resized - 0.5`` and its right neighbour."""
    last = (end - 0.5) * size / resized - 0.5
    return min(size, math.floor(last) + 3)  # its two taps, and one more against rounding in OpenCV's grid


def _linear(src: np.ndarray, box: Box, dst: np.ndarray) -> None:
    """The bilinear pass of ``box`` of ``src`` into ``dst`` (its size is the pass's output size)."""
    left, top, right, bottom = box
    h, w = dst.shape[:2]
    if all(float(v).is_integer() for v in box):  # a window in whole pixels: resize its view, no copy
        region = src[int(top):int(bottom), int(left):int(right)]
        _into(cv2.resize(region, (w, h), dst=_cv(dst), interpolation=cv2.INTER_LINEAR), dst)
        return
    sx, sy = (right - left) / w, (bottom - top) / h
    # output pixel centre x + 0.5 maps to left + (x + 0.5) * sx in source coordinates, whose pixel centres are
    # at integers + 0.5: the same convention as Pillow's box and OpenCV's resize
    matrix = np.array([[sx, 0.0, left + 0.5 * sx - 0.5], [0.0, sy, top + 0.5 * sy - 0.5]])
    _into(cv2.warpAffine(src, matrix, (w, h), dst=_cv(dst), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                         borderMode=cv2.BORDER_REPLICATE), dst)


def _cv(arr: np.ndarray) -> np.ndarray:
    """``arr`` as OpenCV sees a destination: a one-channel image is 2-D there (a view, same memory)."""
    return arr[:, :, 0] if arr.shape[2] == 1 else arr


def _into(result: np.ndarray, dst: np.ndarray) -> None:
    """OpenCV writes into ``dst=`` when it fits, and returns a new array when it does not: copy that one."""
    if not np.may_share_memory(result, dst):
        dst[...] = result.reshape(dst.shape)

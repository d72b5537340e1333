"""Masks: per-pixel class indices (segmentation targets), stored losslessly and never smoothed.

A mask is read from any lossless image file (PNG, TIFF, BMP, PPM/PGM) of mode ``L``, ``P`` (its palette
indices are the values, not the colours), ``1``, ``I;16`` or ``I``; it must have the size of its image. It is
given the image's geometry (``--resize``, ``--max-size``, ``--center-crop``) with nearest-neighbour sampling, so
that every stored value is one of the source's, and stored as a PNG: mode ``L`` for uint8, ``I;16`` for uint16.
It is never normalized or re-encoded lossily.
"""

from __future__ import annotations

import io

import cv2
import numpy as np
from PIL import Image

from ..errors import ImageError
from .transforms import TransformSpec, apply_geometry, read_source_file

_LOSSY = ("JPEG", "WEBP", "MPO")


def mask_pixels(path: str, name: str) -> str:
    """``"uint8"`` or ``"uint16"``: what a mask file's values need (read from its header only)."""
    try:
        with Image.open(path) as img:
            return "uint16" if img.mode in ("I;16", "I;16B", "I;16L", "I") else "uint8"
    except (OSError, ValueError) as exc:
        raise ImageError(name, f"cannot read the mask ({exc})") from None


def mask_array(data: bytes, name: str, pixels: str) -> np.ndarray:
    """A mask file's values, (H, W), of ``pixels``; an :class:`ImageError` when it cannot be one."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format in _LOSSY:
                raise ImageError(name, f"a {img.format} mask has lost its exact values; store masks as PNG")
            img.load()
            array = np.asarray(img.convert("L") if img.mode == "1" else img)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(name, f"cannot decode the mask ({exc})") from None
    if array.ndim != 2:
        raise ImageError(name, f"a mask has one channel; this one has {array.shape[2]} (mode {img.mode})")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(pixels).max):
        raise ImageError(name, f"mask values {array.min()}..{array.max()} do not fit {pixels}; use --field NAME:mask "
                               "on 16-bit PNG masks")
    return array.astype(pixels)


def convert_mask(path: str, name: str, spec: TransformSpec, pixels: str, image_size: tuple[int, int]) -> bytes:
    """The stored PNG of the mask at ``path``: the image's geometry with nearest-neighbour sampling.

    Args:
        path: the mask file.
        name: how errors name it.
        spec: the image's transform (only its geometry applies).
        pixels: ``"uint8"`` or ``"uint16"``.
        image_size: the (width, height) of its image before the transform: the mask must have it.
    """
    array = mask_array(read_source_file(path, name), name, pixels)
    if (array.shape[1], array.shape[0]) != tuple(image_size):
        raise ImageError(name, f"mask is {array.shape[1]}x{array.shape[0]}, its image {image_size[0]}x"
                               f"{image_size[1]}; a mask must have its image's size")
    img = Image.fromarray(array)  # L for uint8, I;16 for uint16 (Pillow 13 refuses the mode given with uint16)
    img = apply_geometry(img, spec.resize, spec.max_size, spec.center_crop, "nearest")
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


_PNG = b"\x89PNG\r\n\x1a\n"
_GRAY_DEPTH = {"uint8": 8, "uint16": 16}  # bit depth of a grayscale PNG (colour type 0) whose values are pixels


def decode_mask(data: bytes | memoryview, name: str, pixels: str) -> np.ndarray:
    """A stored mask's values, (H, W). The grayscale PNGs :func:`convert_mask` writes are decoded by OpenCV
    (faster than Pillow, and the values of a grayscale PNG of that depth are exactly the pixels); any other
    file (a palette PNG from another tool, a TIFF, a damaged file) through :func:`mask_array`."""
    head = bytes(data[:26])
    if head[:8] == _PNG and head[12:16] == b"IHDR" and head[25] == 0 and head[24] == _GRAY_DEPTH.get(pixels):
        array = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
        if array is not None and array.ndim == 2 and array.dtype == pixels:
            return array
    return mask_array(bytes(data), name, pixels)

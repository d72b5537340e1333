"""Masks: per-pixel class indices (segmentation targets), stored losslessly and never smoothed.

A mask is read from any lossless image file (PNG, TIFF, BMP, PPM/PGM) of mode ``L``, ``P`` (its palette
indices are the values, not the colours), ``1``, ``I;16`` or ``I``; it must have the size of its image. A float
mask (mode ``F``, a float TIFF) is refused: its values are no class indices, and storing them as integers would
change them. A mask's values must fit its column's pixel type (uint8, or uint16 for a column whose first mask is
16-bit, or ``--field NAME:mask[uint16]``): a 16-bit mask whose values fit uint8 is stored losslessly as uint8. It is
given the image's geometry (``--resize``, ``--max-size``, ``--center-crop``) with nearest-neighbour sampling, so
that every stored value is one of the source's, and stored as a PNG: mode ``L`` for uint8, ``I;16`` for uint16.
It is never normalized or re-encoded lossily.
"""

from __future__ import annotations

import contextlib
import io

import cv2
import numpy as np
from PIL import Image

from ..errors import ImageError
from .transforms import TransformSpec, apply_geometry, open_regular, read_source_file

_LOSSY = ("JPEG", "WEBP", "MPO")
MASK_MODES = {"L": "uint8", "P": "uint8", "1": "uint8", "I;16": "uint16", "I;16B": "uint16", "I;16L": "uint16",
              "I": "uint16"}  # the Pillow modes a mask may have, and the pixel type each needs


def mask_mode(path: str | io.BytesIO, name: str) -> str:
    """The Pillow mode of the image file at ``path`` (read from its header only, and only if it is a regular file)
    or in a buffer of its bytes; an :class:`ImageError` naming ``name`` when it cannot be read. :data:`MASK_MODES`
    gives the pixel type a mask of that mode needs; a mode not in it is no mask (:func:`not_a_mask` says why)."""
    try:
        with (contextlib.nullcontext(path) if isinstance(path, io.BytesIO) else open_regular(path, name)) as f, \
                Image.open(f) as img:
            return img.mode
    except ImageError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(name, f"cannot read the mask ({_reason(exc)})") from None


def not_a_mask(mode: str) -> str:
    """Why an image of ``mode`` is no mask, and what to do."""
    if mode.startswith("F"):
        return (f"a float mask (mode {mode}) holds no exact class indices; save masks as 8- or 16-bit integer PNG "
                "(or TIFF)")
    return f"a mask has one channel of class indices; this one is mode {mode}; save it as a grey or palette PNG"


def _reason(exc: Exception) -> str:
    return "not an image Pillow knows" if isinstance(exc, Image.UnidentifiedImageError) else str(exc)


def mask_array(data: bytes, name: str, pixels: str, field: str | None = None,
               size: tuple[int, int] | None = None) -> np.ndarray:
    """A mask file's values, (H, W), of ``pixels``; an :class:`ImageError` when it cannot be one. ``field``: the
    table column being packed, for the advice when the values need more bits than the column has; ``size``: the
    (width, height) the mask must have, checked from its header before it is decoded."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format in _LOSSY:
                raise ImageError(name, f"a {img.format} mask has lost its exact values; store masks as PNG")
            if img.mode not in MASK_MODES:
                raise ImageError(name, not_a_mask(img.mode))
            if size is not None and img.size != tuple(size):
                raise ImageError(name, f"mask is {img.size[0]}x{img.size[1]}, its image {size[0]}x{size[1]}; a "
                                       "mask must have its image's size")
            img.load()
            array = np.asarray(img.convert("L") if img.mode == "1" else img)
    except ImageError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(name, f"cannot decode the mask ({_reason(exc)})") from None
    if array.ndim != 2:
        raise ImageError(name, f"a mask has one channel; this one has {array.shape[2]} (mode {img.mode})")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(pixels).max):
        advice = ("masks hold at most 65,536 classes" if pixels == "uint16" or field is None
                  else f"pass --field {field}:mask[uint16] to store the column as 16-bit masks")
        raise ImageError(name, f"mask values {array.min()}..{array.max()} do not fit {pixels}; {advice}")
    return array.astype(pixels)


def convert_mask(path: str, name: str, spec: TransformSpec, pixels: str, image_size: tuple[int, int],
                 field: str | None = None) -> bytes:
    """The stored PNG of the mask at ``path``: the image's geometry with nearest-neighbour sampling.

    Args:
        path: the mask file.
        name: how errors name it.
        spec: the image's transform (only its geometry applies).
        pixels: ``"uint8"`` or ``"uint16"``.
        image_size: the (width, height) of its image before the transform: the mask must have it.
        field: the table column, for advice in errors.
    """
    return convert_mask_bytes(read_source_file(path, name), name, spec, pixels, image_size, field)


def convert_mask_bytes(data: bytes, name: str, spec: TransformSpec, pixels: str, image_size: tuple[int, int],
                       field: str | None = None) -> bytes:
    """:func:`convert_mask` of a mask file's bytes (a Hugging Face dataset's cell)."""
    array = mask_array(data, name, pixels, field, image_size)
    img = Image.fromarray(array)  # L for uint8, I;16 for uint16 (Pillow 13 refuses the mode given with uint16)
    img = apply_geometry(img, spec.resize, spec.max_size, spec.center_crop, "nearest")
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


_PNG = b"\x89PNG\r\n\x1a\n"
_GRAY_DEPTH = {"uint8": 8, "uint16": 16}  # bit depth of a grayscale PNG (colour type 0) whose values are pixels


def stored_size(data: bytes | memoryview, name: str) -> tuple[int, int]:
    """The (width, height) a stored image file declares, from its header alone (a PNG's IHDR, else Pillow's
    lazy open); an :class:`ImageError` naming ``name`` when it has none."""
    head = bytes(data[:24])
    if head[:8] == _PNG and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            return img.size
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(name, f"cannot decode the mask ({exc})") from None


def decode_mask(data: bytes | memoryview, name: str, pixels: str, max_pixels: int | None = None) -> np.ndarray:
    """A stored mask's values, (H, W). The grayscale PNGs :func:`convert_mask` writes are decoded by OpenCV
    (faster than Pillow, and the values of a grayscale PNG of that depth are exactly the pixels); any other
    file (a palette PNG from another tool, a TIFF, a damaged file) through :func:`mask_array`. A mask whose
    header declares more than ``max_pixels`` pixels is an :class:`ImageError`, before anything is decoded."""
    if max_pixels is not None:
        width, height = stored_size(data, name)
        if width * height > max_pixels:
            raise ImageError(name, f"the mask declares {width}x{height}, over the {max_pixels:,}-pixel limit; the "
                                   "stored mask is damaged or hostile, re-pack")
    head = bytes(data[:26])
    if head[:8] == _PNG and head[12:16] == b"IHDR" and head[25] == 0 and head[24] == _GRAY_DEPTH.get(pixels):
        array = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
        if array is not None and array.ndim == 2 and array.dtype == pixels:
            return array
    return mask_array(bytes(data), name, pixels)

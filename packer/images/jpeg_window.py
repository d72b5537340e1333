"""Decoding only a window of a JPEG: the rows and columns a crop needs, at a reduced DCT scale.

libjpeg-turbo can skip the rows above a window without their inverse DCT (``jpeg_skip_scanlines``), decode only
the columns of whole iMCUs that cover it (``jpeg_crop_scanline``) and stop after its last row. Neither Pillow nor
simplejpeg exposes that, so packer carries a small C extension, ``packer.images._jpeg_window``
(``jpeg_window.c``, declared in ``setup.py``), built against the system's libjpeg-turbo when ``pip install`` finds
a C compiler and its headers (Debian: ``libjpeg62-turbo-dev``; Ubuntu: ``libjpeg-turbo8-dev``; Fedora:
``libjpeg-turbo-devel``). Without them the build is skipped and every JPEG is decoded whole, as before: same
pixels, slower. :func:`available` says which, and ``packer bench`` names it with the machine.

The pixels are a whole decode's at the same scale, cropped, except in the first and last column of a crop that
does not start or end at the image's edge: libjpeg-turbo upsamples the chroma of those as at an edge. The
window asked for is widened by one column on each side and those columns are dropped, so what
:func:`decode_window` returns is exactly the whole decode's.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

_extension: ModuleType | None
try:
    from . import _jpeg_window as _extension
except ImportError:  # built without libjpeg-turbo's headers: JPEGs decode whole
    _extension = None

EDGE = 1  # the crop's own edge columns, decoded and dropped (see the module docstring)


def available() -> bool:
    """Whether the window decoder was built (see the module docstring)."""
    return _extension is not None


def libjpeg_turbo_version() -> str | None:
    """The version of the libjpeg-turbo the window decoder was built against; None when it was not built."""
    return None if _extension is None else _extension.LIBJPEG_TURBO


def decode_window(payload: bytes | memoryview, gray: bool, denom: int, region: tuple[int, int, int, int],
                  buffer: np.ndarray, scaled: tuple[int, int]) -> np.ndarray | None:
    """Rows and columns ``region`` of a JPEG decoded at scale ``1/denom``, as a view of ``buffer``.

    Args:
        payload: the JPEG file's bytes (a packed sample's, checked at pack time: see the module docstring).
        gray: decode to one channel (L) rather than three (RGB).
        denom: 1, 2, 4 or 8.
        region: (left, top, right, bottom) in the scaled image's pixels, within it.
        buffer: a flat uint8 array of at least ``(bottom - top) * scaled width * channels`` bytes.
        scaled: the (height, width) the caller expects of the scaled image, from the header it read.

    Returns:
        The (bottom - top, right - left, channels) pixels, the same as a whole decode's at that scale cropped to
        ``region``; None when the extension was not built, the JPEG is one it does not take (CMYK), or
        libjpeg-turbo reads other dimensions from it than ``scaled`` (a file with conflicting headers).

    Raises:
        ValueError: libjpeg-turbo found the data damaged (it also reports what it would only warn about).
    """
    if _extension is None:
        return None
    left, top, right, bottom = region
    ask = max(left - EDGE, 0)
    try:
        rows, width, x, height, full_width = _extension.decode(payload, buffer, gray, denom, ask, top, right + EDGE,
                                                               bottom)
    except NotImplementedError:
        return None
    if (height, full_width) != scaled or not (x <= left and right <= x + width and rows == bottom - top):
        return None
    channels = 1 if gray else 3
    pixels = buffer[:rows * width * channels].reshape(rows, width, channels)
    return pixels[:, left - x:right - x]

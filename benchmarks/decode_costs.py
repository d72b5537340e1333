"""Single-thread cost of the decode steps issue 49 weighed, in µs per image (best of ``--repeats`` passes over the
same images), on the photographs of FOLDER (default sample_data):

    python benchmarks/decode_costs.py [FOLDER] [--repeats 5] [--tj3-lib /path/to/libturbojpeg.so.0]

Validation from JPEGs with the long side capped at 256 (re-encoded here with Pillow, quality 90: FFCV's geometry),
resize 256 + centre crop 224, the rows of one image's work:

- ``decode``: simplejpeg into a reused buffer (what the default's batch rows do);
- ``enlarge float32`` (the default's kernel now), ``OpenCV uint8 INTER_LINEAR`` (the same kernel in OpenCV's
  fixed point, which truncates partial sums), ``Pillow box resize`` (the default before), ``warpAffine``
  (``decoder="fast"``'s kernel): each the kept 224 x 224 region from the decoded image.

Training from the original files (RandomResizedCrop windows from ``(seed 0, epoch 0, index)``):

- ``whole decode, fresh array`` / ``into a reused buffer``: simplejpeg, a new numpy array per image against each
  thread's scratch buffer;
- ``lossless crop + decode``: the window's MCU-aligned crop by libjpeg-turbo's ``tjTransform`` (PyTurboJPEG, if
  importable, with the system's libturbojpeg), then simplejpeg on the cropped JPEG;
- ``window decoder (packer)``: :mod:`packer.images.jpeg_window` (libjpeg-turbo's ``jpeg_crop_scanline`` and
  ``jpeg_skip_scanlines``, the system's library); ``crop 224`` rows: the whole training crop
  (:func:`~packer.reading.augment.scaled_window`) from the whole decode and from the window decoder's part;
- ``partial decode (TurboJPEG 3)``: ``tj3SetCroppingRegion`` + ``tj3Decompress8`` through ctypes, with
  ``--tj3-lib`` (a libturbojpeg 3.x: no maintained Python package exposes it).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from packer.images import jpeg_window
from packer.images.resample import enlarge, resample
from packer.images.transforms import center_box, center_region, is_image_file, resize_crop
from packer.reading.augment import Window, sample_window, scaled_window, uniform_stream
from packer.reading.scratch import decode_scratch

REPO = Path(__file__).resolve().parent.parent
MCU = {"444": (8, 8), "420": (16, 16), "422": (16, 8), "440": (8, 16), "411": (32, 8), "Gray": (8, 8)}


def best(fn: Callable[[], object], count: int, repeats: int) -> float:
    """µs per image of ``fn`` (one pass over ``count`` images), best of ``repeats``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) / count * 1e6


def capped(path: Path, side: int) -> bytes:
    """The photograph as an RGB JPEG (quality 90) with its long side capped at ``side``."""
    with Image.open(path) as img:
        img = img.convert("RGB")
        scale = side / max(img.size)
        if scale < 1:
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                             Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        return buf.getvalue()


def validation_rows(paths: list[Path], repeats: int) -> list[tuple[str, float]]:
    datas = [capped(p, 256) for p in paths]
    arrays = [simplejpeg.decode_jpeg(d) for d in datas]
    out = np.empty((224, 224, 3), np.uint8)
    geometry = [center_region(a.shape[:2], 256, (224, 224)) for a in arrays]

    def decode() -> None:
        for d, a in zip(datas, arrays, strict=True):
            simplejpeg.decode_jpeg(d, buffer=decode_scratch(a.size))

    def float32() -> None:
        for a, (resized, region) in zip(arrays, geometry, strict=True):
            enlarge(a, resized, region, out)

    def uint8() -> None:
        for a, (resized, (top, left, h, w)) in zip(arrays, geometry, strict=True):
            scaled = cv2.resize(a, (resized[1], resized[0]), interpolation=cv2.INTER_LINEAR)
            out[...] = scaled[top:top + h, left:left + w]

    def pillow() -> None:
        for a in arrays:
            out[...] = np.asarray(resize_crop(Image.fromarray(a), 256, (224, 224)))

    def warp() -> None:
        for a in arrays:
            box, size, _ = center_box(a.shape[:2], 256, (224, 224))
            resample(a, box, size, out)

    n = len(datas)
    return [(name, best(fn, n, repeats)) for name, fn in (
        ("val <=256: decode (reused buffer)", decode), ("val <=256: enlarge float32 (default)", float32),
        ("val <=256: OpenCV uint8 INTER_LINEAR", uint8), ("val <=256: Pillow box resize (default before)", pillow),
        ("val <=256: warpAffine (decoder=fast)", warp))]


def training_rows(paths: list[Path], repeats: int, tj3_lib: str | None) -> list[tuple[str, float]]:
    datas = [p.read_bytes() for p in paths]
    headers = [simplejpeg.decode_jpeg_header(d) for d in datas]
    windows = [sample_window(h, w, (0.08, 1.0), (3 / 4, 4 / 3), uniform_stream(0, 0, i))
               for i, (h, w, _, _) in enumerate(headers)]
    n = len(datas)
    rows = [("train originals: whole decode, fresh array", best(
                lambda: [simplejpeg.decode_jpeg(d) for d in datas], n, repeats)),
            ("train originals: whole decode into a reused buffer", best(
                lambda: [simplejpeg.decode_jpeg(d, buffer=decode_scratch(h * w * 3))
                         for d, (h, w, _, _) in zip(datas, headers, strict=True)], n, repeats))]
    try:
        from turbojpeg import TurboJPEG  # PyTurboJPEG, optional
        jpeg = TurboJPEG()
    except Exception as exc:  # not installed, or no libturbojpeg
        print(f"lossless crop: skipped ({exc})", file=sys.stderr)
    else:
        def crop_then_decode() -> None:
            for d, (_, _, _, sub), win in zip(datas, headers, windows, strict=True):
                x0, y0 = _aligned(win, sub)
                cropped = jpeg.crop(d, x0, y0, win.left + win.width - x0, win.top + win.height - y0)
                simplejpeg.decode_jpeg(cropped)

        rows.append(("train originals: lossless crop (tjTransform) + decode", best(crop_then_decode, n, repeats)))
    if tj3_lib:
        rows.append(("train originals: partial decode (TurboJPEG 3)",
                     best(_tj3_partial(tj3_lib, datas, headers, windows), n, repeats)))
    if jpeg_window.available():
        rows += window_decoder_rows(datas, headers, windows, repeats)
    else:
        print("window decoder: skipped (packer was installed without it)", file=sys.stderr)
    area = np.mean([win.height * win.width / (h * w)
                    for win, (h, w, _, _) in zip(windows, headers, strict=True)])
    print(f"mean window: {area:.0%} of the image", file=sys.stderr)
    return rows


def window_decoder_rows(datas: list[bytes], headers: list, windows: list[Window],
                        repeats: int) -> list[tuple[str, float]]:
    """packer's window decoder (full scale, as every window of these photographs is: see MARGIN) against the
    whole decode, alone and within the training crop (:func:`scaled_window`, 224 px, into one output array)."""
    n = len(datas)
    out = np.empty((224, 224, 3), np.uint8)

    def window_only() -> None:
        for d, (h, w, _, _), win in zip(datas, headers, windows, strict=True):
            region = (win.left, win.top, win.left + win.width, win.top + win.height)
            jpeg_window.decode_window(d, False, 1, region, decode_scratch(win.height * w * 3), (h, w))

    def crop(partial: bool) -> Callable[[], None]:
        return lambda: [scaled_window(d, "RGB", (h, w), win, (224, 224), "bilinear", out, partial=partial)
                        for d, (h, w, _, _), win in zip(datas, headers, windows, strict=True)]

    return [("train originals: window decoder (packer)", best(window_only, n, repeats)),
            ("train originals: crop 224, whole decode", best(crop(False), n, repeats)),
            ("train originals: crop 224, window decoder (default)", best(crop(True), n, repeats))]


def _aligned(win: Window, sub: str) -> tuple[int, int]:
    mx, my = MCU.get(sub, (16, 16))
    return win.left // mx * mx, win.top // my * my


def _tj3_partial(path: str, datas: list[bytes], headers: list, windows: list[Window]) -> Callable[[], None]:
    class Region(ctypes.Structure):
        _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]

    lib = ctypes.CDLL(path)
    lib.tj3Init.restype = ctypes.c_void_p
    lib.tj3Init.argtypes = [ctypes.c_int]
    lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, Region]
    lib.tj3Decompress8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_int]
    handle = lib.tj3Init(1)  # TJINIT_DECOMPRESS

    def run() -> None:
        for d, (h, w, _, sub), win in zip(datas, headers, windows, strict=True):
            x0, y0 = _aligned(win, sub)
            width, height = min(w, win.left + win.width) - x0, min(h, win.top + win.height) - y0
            lib.tj3DecompressHeader(handle, d, len(d))
            lib.tj3SetCroppingRegion(handle, Region(x0, y0, width, height))
            buf = decode_scratch(width * height * 3)
            if lib.tj3Decompress8(handle, d, len(d), buf.ctypes.data, width * 3, 0) != 0:  # TJPF_RGB
                raise RuntimeError("tj3Decompress8 failed")

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=REPO / "sample_data")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tj3-lib", default=None, help="a libturbojpeg 3.x for the partial-decode row")
    args = parser.parse_args(argv)
    paths = sorted(p for p in args.folder.rglob("*") if is_image_file(p.name) and p.suffix.lower() in (".jpg",
                                                                                                          ".jpeg"))
    paths = [p for p in paths if simplejpeg.decode_jpeg_header(p.read_bytes())[2] == "YCbCr"]
    cv2.setNumThreads(1)
    print(f"{len(paths)} JPEG photographs of {args.folder}, one thread, best of {args.repeats}")
    for name, us in validation_rows(paths, args.repeats) + training_rows(paths, args.repeats, args.tj3_lib):
        print(f"{name:55s} {us:8.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

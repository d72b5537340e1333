"""Image decoding and the offline transforms: resize, centre crop, normalize, encode.

The same functions serve the converter (offline) and the readers (``resize``/``center_crop`` at read time), so a
transform gives the same pixels wherever it runs. Semantics follow torchvision on PIL images:

- ``resize=N`` scales the shorter side to N, keeping the aspect ratio (``Resize(N)``); ``resize=(W, H)`` is exact;
- ``max_size=N`` caps the longer side at N and never upscales (with ``resize=N`` it is ``Resize(N, max_size=N)``);
- ``center_crop`` crops the centre after the resize, padding with zeros where the image is smaller
  (``CenterCrop``);
- interpolation is Pillow's, antialiased when downscaling, bilinear by default.

Decoding converts to RGB as ImageFolder's ``pil_loader`` does (``--mode L`` keeps one channel). JPEGs in YCbCr or
grayscale are decoded with simplejpeg (libjpeg-turbo), which gives the same pixels as Pillow about three times as
fast; every other image goes through Pillow.
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import threading
import zlib
from dataclasses import asdict, dataclass, field
from typing import overload

import numpy as np
import simplejpeg
from PIL import Image, ImageOps

from ..errors import ImageError, UsageError
from .resample import enlarge

INTERPOLATIONS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}
STORES = ("original", "jpeg", "png", "raw")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Pillow's own decompression-bomb threshold (about 9459 x 9459): larger images are refused, not decoded.
DEFAULT_MAX_PIXELS = 89_478_485
MAX_SIDE = 65535  # the formats store height and width as uint16
# The image extension a stored member gets, by Pillow format; WebDataset decoders key on these.
# torchvision's ImageFolder extensions (datasets.folder.IMG_EXTENSIONS): a file is an image when its name ends in one
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
EXTENSION_BY_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "TIFF": "tif", "PPM": "ppm"}

Size = tuple[int, int]  # (width, height), as Pillow orders them


def is_image_file(name: str) -> bool:
    """Whether a file name ends, case-insensitively, in one of :data:`IMG_EXTENSIONS`."""
    return name.lower().endswith(IMG_EXTENSIONS)


@dataclass(frozen=True)
class TransformSpec:
    """Everything that decides the stored bytes of one image. Recorded in the manifest."""

    store: str = "original"
    resize: int | Size | None = None
    max_size: int | None = None
    center_crop: Size | None = None
    interpolation: str = "bilinear"
    mode: str = "RGB"
    exif_transpose: bool = False
    quality: int = 90
    normalize: bool = False
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: str = "uint8"
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.normalize and self.dtype == "uint8":
            object.__setattr__(self, "dtype", "float16")
        if self.dtype not in ("uint8", "float16", "float32") or (self.dtype != "uint8") != self.normalize:
            raise UsageError("dtype is uint8, or float16/float32 with normalize")
        if self.store not in STORES:
            raise UsageError(f"store must be one of {', '.join(STORES)}, not {self.store!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise UsageError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}")
        if self.mode not in ("RGB", "L"):
            raise UsageError("mode must be RGB or L")
        if self.store == "original" and self.changes_pixels:
            raise UsageError("store='original' keeps the file's bytes, so it cannot resize, crop, normalize or "
                             "change the mode; choose store jpeg, png or raw")
        if self.normalize and self.store != "raw":
            raise UsageError("normalize stores float arrays, so it needs store='raw'")
        if not 1 <= self.quality <= 100:
            raise UsageError("quality must be between 1 and 100")

    @property
    def changes_pixels(self) -> bool:
        return bool(self.resize or self.max_size or self.center_crop or self.normalize or self.mode != "RGB"
                    or self.exif_transpose)

    @property
    def channels(self) -> int:
        return 1 if self.mode == "L" else 3

    @property
    def fixed_shape(self) -> tuple[int, int, int] | None:
        """(H, W, C) when every stored image has it: an exact resize or a centre crop."""
        size = self.center_crop or (self.resize if isinstance(self.resize, tuple) else None)
        return (size[1], size[0], self.channels) if size else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransformSpec:
        d = dict(d)
        for key in ("resize", "center_crop"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        for key in ("mean", "std"):
            d[key] = tuple(d.get(key, getattr(cls, key)))
        return cls(**d)


@dataclass
class Encoded:
    """One converted image: the payload to store, and what a reader needs to know about it."""

    payload: bytes
    ext: str  # the member extension: jpg, png, ..., or npy-less "raw" for arrays
    shape: tuple[int, int, int]  # (H, W, C) of the decoded image
    crc32: int = field(default=0)


def parse_size(text: str | int | Size | None) -> int | Size | None:
    """``"256"`` -> 256; ``"320x240"`` -> (320, 240) as (width, height)."""
    if text is None:
        return None
    if isinstance(text, (int, tuple)) and not isinstance(text, bool):  # already parsed (or given in Python)
        values = text if isinstance(text, tuple) else (text,)
        if len(values) not in (1, 2) or not all(isinstance(v, int) and v >= 1 for v in values):
            raise UsageError(f"{text} is not a size: give a positive N, or WxH such as 320x240")
        return text
    text = str(text).lower().strip()
    size: int | Size | None
    try:
        if "x" in text:
            width, height = text.split("x", 1)
            size = (int(width), int(height))
        else:
            size = int(text)
    except ValueError:
        size = None
    if size is None or min(size if isinstance(size, tuple) else (size,)) < 1:
        raise UsageError(f"{text!r} is not a size: give a positive N, or WxH such as 320x240")
    return size


@overload
def as_pair(size: int | tuple[int, int]) -> tuple[int, int]: ...
@overload
def as_pair(size: None) -> None: ...
def as_pair(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """A size given as one int ``n`` (a square) as ``(n, n)``; a pair (or None) as it is."""
    return (size, size) if isinstance(size, int) else size


def output_size(width: int, height: int, resize: int | Size | None, max_size: int | None) -> Size:
    """The (W, H) that ``resize``/``max_size`` give an image of ``width`` x ``height`` (torchvision's rules)."""
    if isinstance(resize, tuple):
        return resize
    if resize:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = resize, int(resize * long / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
        return (new_short, new_long) if width <= height else (new_long, new_short)
    if max_size and max(width, height) > max_size:
        # int(max_size * short / long), as torchvision: int(short * (max_size / long)) can lose a pixel to float
        # rounding (a 97x97 image capped at 50 became 50x49)
        short, long = min(width, height), max(width, height)
        new_short = int(max_size * short / long)
        return (max_size, new_short) if width >= height else (new_short, max_size)
    return width, height


def center_crop(img: Image.Image, size: Size) -> Image.Image:
    """torchvision ``CenterCrop``: pad with zeros where the image is smaller, then crop the centre."""
    crop_w, crop_h = size
    w, h = img.size
    if crop_w > w or crop_h > h:
        left = (crop_w - w) // 2 if crop_w > w else 0
        top = (crop_h - h) // 2 if crop_h > h else 0
        padded = Image.new(img.mode, (max(w, crop_w), max(h, crop_h)))
        padded.paste(img, (left, top))
        img, (w, h) = padded, padded.size
    top = int(round((h - crop_h) / 2.0))
    left = int(round((w - crop_w) / 2.0))
    return img.crop((left, top, left + crop_w, top + crop_h))


def apply_geometry(img: Image.Image, resize: int | Size | None = None, max_size: int | None = None,
                   crop: Size | None = None, interpolation: str = "bilinear") -> Image.Image:
    """Resize, then centre-crop, a PIL image."""
    size = output_size(img.width, img.height, resize, max_size)
    if size != img.size:
        img = img.resize(size, INTERPOLATIONS[interpolation])
    if crop:
        img = center_crop(img, crop)
    return img


def center_region(full: tuple[int, int], resize: int | Size | None, crop: Size | None
                  ) -> tuple[tuple[int, int], tuple[int, int, int, int]] | None:
    """Where :func:`apply_geometry`'s centre crop falls in the resized image of a ``full`` (height, width) one:
    the resized (height, width) and the crop's (top, left, height, width) in it; None when the crop pads."""
    h, w = full
    rw, rh = output_size(w, h, resize, None)
    if crop and (crop[0] > rw or crop[1] > rh):
        return None
    cw, ch = crop or (rw, rh)
    return (rh, rw), (int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0)), ch, cw)


def center_box(full: tuple[int, int], resize: int | Size | None, crop: Size | None
               ) -> tuple[tuple[float, float, float, float], tuple[int, int], tuple[int, int]] | None:
    """What :func:`resize_crop` keeps of a ``full`` (height, width) image: the region (left,
    top, right, bottom, in its pixels), the output (height, width) and the resized (height, width) before the
    crop; None when the crop pads."""
    found = center_region(full, resize, crop)
    if found is None:
        return None
    (rh, rw), (top, left, ch, cw) = found
    sx, sy = full[1] / rw, full[0] / rh
    return (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy), (ch, cw), (rh, rw)


def resize_crop(img: Image.Image, resize: int | Size | None, crop: Size | None,
                interpolation: str = "bilinear") -> Image.Image:
    """Resize then centre-crop, fused: only the region that survives the crop is resampled, about twice as fast
    as :func:`apply_geometry`. Rounding in the resampling can make a pixel differ from it by one level, so the
    converter and ``decoder="pil"`` use :func:`apply_geometry`; every packed reader and FolderDataset use this
    one by default where the resize shrinks the image (:func:`resize_crop_array`), so they agree with each
    other exactly."""
    region = center_box((img.height, img.width), resize, crop)
    if not crop or region is None:
        return apply_geometry(img, resize, None, crop, interpolation)
    box, (height, width), _ = region
    return img.resize((width, height), INTERPOLATIONS[interpolation], box=box)


def geometry_shape(shape: tuple[int, ...], resize: int | Size | None, crop: Size | None) -> tuple[int, int, int]:
    """The (H, W, C) that :func:`apply_geometry` gives an image of ``shape`` (H, W, C)."""
    if crop:
        return crop[1], crop[0], shape[2]
    width, height = output_size(shape[1], shape[0], resize, None)
    return height, width, shape[2]


def resize_crop_array(arr: np.ndarray, resize: int | Size | None, crop: Size | None,
                      interpolation: str = "bilinear", out: np.ndarray | None = None) -> np.ndarray:
    """:func:`apply_geometry`'s resize and centre crop of an (H, W, C) array, within one level of it, written
    into ``out`` when given: the default decoder's read-time geometry.

    Only what the crop keeps is computed. An image already at the resized size is sliced (the same pixels);
    a bilinear resize that enlarges it (neither side shrinks: an image stored at most as large as the read-time
    resize) goes through :func:`packer.images.resample.enlarge`, several times faster than Pillow; anything
    else through Pillow's resize of the kept region (:func:`resize_crop`)."""
    found = center_region(arr.shape[:2], resize, crop)
    if found is not None and found[0] == arr.shape[:2]:
        top, left, height, width = found[1]
        result = arr[top:top + height, left:left + width]
    elif found is not None and interpolation == "bilinear" and min(np.subtract(found[0], arr.shape[:2])) >= 0:
        return enlarge(arr, found[0], found[1], out)
    else:
        result = as_hwc(resize_crop(to_pil(arr), resize, crop, interpolation))
    if out is None:
        return np.ascontiguousarray(result)
    if result.shape != out.shape:
        raise ValueError(f"the image comes out {result.shape}, not {out.shape}")
    out[...] = result
    return out


# Pillow's bomb check reads the process-wide Image.MAX_IMAGE_PIXELS; it is lifted only around the header parse,
# under this lock, so that packer's own check decides, at --max-pixels whether that is below or above Pillow's.
_PILLOW_LIMIT = threading.Lock()
_lifted_from: list[int | None] = []  # Pillow's limit while lifted


def _after_fork_in_child() -> None:
    """A child forked while another thread held the lock (a DataLoader worker) would wait on it forever, and
    keep Pillow's limit lifted: give it a fresh lock and Pillow's limit back."""
    global _PILLOW_LIMIT
    if _lifted_from:
        Image.MAX_IMAGE_PIXELS = _lifted_from.pop()
    _PILLOW_LIMIT = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_pixels(width: int, height: int, max_pixels: int, name: str) -> None:
    if width * height > max_pixels:
        raise ImageError(name, f"{width}x{height} is over the {max_pixels:,}-pixel limit (a decompression bomb?); "
                               "raise --max-pixels if the image is genuine")


def _open_checked(data: bytes, name: str, max_pixels: int) -> Image.Image:
    """``Image.open`` (the header only), refused over ``max_pixels`` before any pixel is decoded."""
    with _PILLOW_LIMIT:
        _lifted_from.append(Image.MAX_IMAGE_PIXELS)
        Image.MAX_IMAGE_PIXELS = None
        try:
            img = Image.open(io.BytesIO(data))
        finally:
            Image.MAX_IMAGE_PIXELS = _lifted_from.pop()
    _check_pixels(img.width, img.height, max_pixels, name)
    return img


def open_image(data: bytes, name: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open and fully decode ``data`` with Pillow, refusing decompression bombs; errors name ``name``."""
    if not data:
        raise ImageError(name, "empty file (0 bytes); remove it or restore the image")
    try:
        img = _open_checked(data, name, max_pixels)
        img.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(name, f"{exc}; raise --max-pixels if the image is genuine") from None
    except Image.UnidentifiedImageError:  # its message holds the address of a buffer, different every run
        raise ImageError(name, "cannot decode image (not an image format Pillow knows, or damaged); remove or "
                               "replace the file") from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError...) for bad files
        reason = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the image", str(exc))  # no addresses: messages repeat
        raise ImageError(name, f"cannot decode image ({reason}); remove or replace the file") from None
    return img


def jpeg_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) of a JPEG that simplejpeg decodes as Pillow would (YCbCr or grey), from its header;
    None for anything else (CMYK and YCCK JPEGs, other formats, damaged headers), which Pillow decodes."""
    if data[:2] != b"\xff\xd8":
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (height, width) if colorspace in ("YCbCr", "Gray") else None


def decode(data: bytes | memoryview, mode: str = "RGB", name: str = "<image>",
           max_pixels: int = DEFAULT_MAX_PIXELS, out: np.ndarray | None = None) -> np.ndarray:
    """Decode encoded image bytes to a uint8 (H, W, C) array, as ImageFolder's loader would. With ``out``
    (an array of the image's shape) the pixels are written there, JPEGs without an intermediate copy."""
    size = jpeg_size(data)  # the header parsed once, a small part of the decode (docs/benchmarks.md)
    if size is not None:
        try:
            h, w = size
            _check_pixels(w, h, max_pixels, name)
            channels = 1 if mode == "L" else 3
            direct = out is not None and out.shape == (h, w, channels) and out.flags.c_contiguous
            arr = simplejpeg.decode_jpeg(data, colorspace="GRAY" if mode == "L" else "RGB",
                                         buffer=out if direct else None)
            if direct:
                assert out is not None  # direct is only ever true with an out
                return out
            arr = arr.reshape(h, w, channels)
        except ValueError as exc:
            raise ImageError(name, f"cannot decode JPEG ({exc}); remove or replace the file") from None
    else:
        arr = as_hwc(open_image(bytes(data), name, max_pixels).convert(mode))
    if out is not None:
        if arr.shape != out.shape:
            raise ImageError(name, f"decoded to {arr.shape}, expected {out.shape}; the dataset is damaged")
        out[...] = arr
        return out
    return arr


def as_hwc(img: Image.Image | np.ndarray) -> np.ndarray:
    """A PIL image or array as (H, W, C): one-channel images keep a channel axis of 1."""
    arr = np.asarray(img)
    return arr if arr.ndim == 3 else arr[:, :, None]


def to_pil(array: np.ndarray) -> Image.Image:
    return Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)


MOVED = "deleted or moved while packing (no such file); restore it, or pack again"
NOT_REGULAR = "not a regular file (a folder, pipe or device); remove it"


def convert_file(path: str, name: str, spec: TransformSpec, missing: str = MOVED) -> Encoded:
    """Read the source file at ``path`` and produce what gets stored for it (``name`` is used in errors;
    ``missing``: why a file that is not there is not, see :func:`read_source_file`)."""
    return checked_sides(convert_bytes(read_source_file(path, name, missing), name, spec), name)


def checked_sides(encoded: Encoded, name: str) -> Encoded:
    """``encoded``, or an :class:`ImageError` when a side is over what the formats record."""
    if max(encoded.shape[:2]) > MAX_SIDE:  # every format records each side in 16 bits
        raise ImageError(name, f"{encoded.shape[1]}x{encoded.shape[0]} has a side over {MAX_SIDE} pixels, which "
                               "packer cannot store; shrink it (--max-size) or remove it")
    return encoded


def open_regular(path: str, name: str, missing: str = MOVED, not_regular: str = NOT_REGULAR):
    """``path`` opened for reading in binary, when it is a regular file: a FIFO, a device or a folder is never
    opened for reading (stat first; opened without blocking, and checked again once open, so that a file swapped
    for a FIFO in between cannot hang the caller). An :class:`ImageError` naming ``name`` otherwise; ``missing``
    and ``not_regular`` say what is wrong in those cases."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ImageError(name, not_regular)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        f = open(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            raise ImageError(name, not_regular)
        os.set_blocking(fd, True)
        return f
    except FileNotFoundError:
        raise ImageError(name, missing) from None
    except OSError as exc:
        advice = "check its permissions" if exc.errno in (errno.EACCES, errno.EPERM) else "check the file"
        raise ImageError(name, f"cannot read file: {exc.strerror}; {advice}") from None


def read_source_file(path: str, name: str, missing: str = MOVED) -> bytes:
    """The bytes of a regular source file (:func:`open_regular`); an :class:`ImageError` naming ``name`` when it
    cannot be read."""
    with open_regular(path, name, missing) as f:
        try:
            return f.read()
        except OSError as exc:
            raise ImageError(name, f"cannot read file: {exc.strerror}; check the file") from None


def convert_bytes(data: bytes, name: str, spec: TransformSpec) -> Encoded:
    if spec.store == "original":
        pixels = decode(data, spec.mode, name, spec.max_pixels)  # proves the file decodes; the bytes stay as they are
        fmt = _open_checked(data, name, spec.max_pixels).format
        ext = EXTENSION_BY_FORMAT.get(fmt or "", name.rsplit(".", 1)[-1].lower())  # fmt None: Pillow could not say
        return Encoded(data, ext, pixels.shape, zlib.crc32(data))
    img = open_image(data, name, spec.max_pixels)
    if spec.exif_transpose:
        img = ImageOps.exif_transpose(img)
    return encode_image(img, spec, name)


def convert_array(array: np.ndarray, name: str, spec: TransformSpec) -> Encoded:
    """What gets stored for an already decoded (H, W, C) uint8 image (a raw sample of a packed dataset being
    re-packed); ``exif_transpose`` does not apply, the pixels are already upright."""
    if spec.store == "original":
        raise ImageError(name, "is stored as decoded pixels, so there are no original file bytes to keep; choose "
                               "--store raw, png or jpeg")
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] not in (1, 3):
        raise ImageError(name, f"is a {array.dtype} array of shape {array.shape}, not (H, W, 1 or 3) uint8 pixels")
    return encode_image(to_pil(array), spec, name)


def check_output_size(width: int, height: int, spec: TransformSpec, name: str) -> None:
    """Refuse, before resizing, an image whose resized size is over ``spec.max_pixels`` or a side of
    ``MAX_SIDE``: a 1x20000 strip resized to 256 would need gigabytes."""
    out_w, out_h = output_size(width, height, spec.resize, spec.max_size)
    if out_w * out_h > spec.max_pixels or max(out_w, out_h) > MAX_SIDE:
        raise ImageError(name, f"{width}x{height} resizes to {out_w}x{out_h}, over the {spec.max_pixels:,}-pixel "
                               f"limit or a side of {MAX_SIDE}; crop or remove it, or raise --max-pixels")


def encode_image(img: Image.Image, spec: TransformSpec, name: str = "<image>") -> Encoded:
    """Convert to ``spec.mode``, apply the geometry, and encode as ``spec.store`` (jpeg, png or raw); ``name``
    names the image in errors."""
    check_output_size(img.width, img.height, spec, name)
    img = apply_geometry(img.convert(spec.mode), spec.resize, spec.max_size, spec.center_crop, spec.interpolation)
    shape = (img.height, img.width, spec.channels)
    if spec.store == "raw":
        arr = np.asarray(img)
        if spec.normalize:
            arr = normalize(arr.reshape(shape), spec.mean, spec.std, spec.dtype)
        payload = np.ascontiguousarray(arr).tobytes()
        return Encoded(payload, "raw", shape, zlib.crc32(payload))
    buf = io.BytesIO()
    if spec.store == "jpeg":
        img.save(buf, "JPEG", quality=spec.quality)
        ext = "jpg"
    else:
        img.save(buf, "PNG")
        ext = "png"
    payload = buf.getvalue()
    return Encoded(payload, ext, shape, zlib.crc32(payload))


def normalize(array: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], dtype: str) -> np.ndarray:
    """``(x / 255 - mean) / std`` per channel, computed in float32, stored as ``dtype``."""
    x = array.astype(np.float32) / np.float32(255)
    m = np.asarray(mean, dtype=np.float32)[: array.shape[2]]
    s = np.asarray(std, dtype=np.float32)[: array.shape[2]]
    return ((x - m) / s).astype(dtype)

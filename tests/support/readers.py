"""The packed formats read without packer: py-lmdb and the documented record header, h5py, tarfile and the
``webdataset`` library; and what each sample must hold, from the source read independently (ImageFolder's rules in
conftest, Pillow, torchvision's Resize/CenterCrop written out here)."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import math
import struct
import tarfile
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import h5py
import lmdb
import numpy as np
import webdataset as wds
from conftest import imagefolder_reference
from PIL import Image

import packer

FORMATS = ("lmdb", "hdf5", "wds")
HEADER = struct.Struct("<4siIHHBBHI")  # the documented 24-byte LMDB record header
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
EXT_BY_PIL_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "TIFF": "tif", "PPM": "ppm"}
WDS_IMAGE_KEYS = "jpg;png;webp;bmp;tif;ppm;npy"


# --------------------------------------------------------------------------------------------------------------
# Independent readers of the packed formats
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Record:
    relpath: str
    label: int
    shape: tuple[int, int, int]  # (H, W, C) as the format records it
    payload: bytes  # encoded image bytes, or the raw array's bytes (C order, manifest dtype)
    ext: str | None = None  # WebDataset member extension


def read_manifest(dest: Path) -> dict:
    return json.loads((dest / "manifest.json").read_text(encoding="utf-8"))


def read_lmdb(dest: Path) -> list[Record]:
    env = lmdb.open(str(dest), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            items = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()
    records = []
    for i, (key, value) in enumerate(items):
        assert key == b"%010d" % i
        magic, label, crc, h, w, c, reserved, path_len, size = HEADER.unpack_from(value)
        assert magic == b"PKR1" and reserved == 0
        assert len(value) == HEADER.size + path_len + size
        relpath = value[HEADER.size:HEADER.size + path_len].decode("utf-8")
        payload = value[HEADER.size + path_len:]
        assert zlib.crc32(payload) == crc
        records.append(Record(relpath, label, (h, w, c), payload))
    return records


def read_hdf5(dest: Path) -> list[Record]:
    with h5py.File(dest / "data.h5", "r") as f:
        labels = f["labels"][()]
        shapes = f["shapes"][()]
        crcs = f["crc32"][()]
        relpaths = list(f["relpaths"].asstr()[()])
        images = f["images"][()]
        offsets = f["offsets"][()] if "offsets" in f else None
    n = len(labels)
    assert len(shapes) == len(crcs) == len(relpaths) == n
    assert labels.dtype == np.int64 and shapes.dtype == np.uint16 and crcs.dtype == np.uint32
    if offsets is None:  # fixed-shape raw arrays: (N, H, W, C)
        assert images.ndim == 4 and images.shape[0] == n
        payloads = [images[i].tobytes() for i in range(n)]
        assert all(tuple(s) == images.shape[1:] for s in shapes)
    else:
        assert images.dtype == np.uint8 and images.ndim == 1
        assert offsets.dtype == np.int64 and len(offsets) == n + 1 and offsets[0] == 0
        assert offsets[-1] == len(images) and np.all(np.diff(offsets) >= 0)
        payloads = [images[offsets[i]:offsets[i + 1]].tobytes() for i in range(n)]
    records = []
    for i in range(n):
        assert zlib.crc32(payloads[i]) == int(crcs[i])
        records.append(Record(relpaths[i], int(labels[i]), tuple(int(x) for x in shapes[i]), payloads[i]))
    return records


def read_wds_tar(dest: Path, manifest: dict) -> list[Record]:
    """Read the shards with tarfile, checking WebDataset's naming rules on the way."""
    shard_names = [s["path"] for s in manifest["shards"]]
    assert sorted(p.name for p in dest.glob("*.tar")) == shard_names
    records = []
    for entry in manifest["shards"]:
        with tarfile.open(dest / entry["path"], "r:") as tar:
            members = tar.getmembers()
            groups: list[tuple[str, dict[str, bytes]]] = []
            for m in members:
                assert m.isfile() and m.mtime == 0, m.name
                assert "/" not in m.name, m.name
                key, ext = m.name.split(".", 1)
                assert key and "." not in ext and ext == ext.lower(), m.name
                if not groups or groups[-1][0] != key:
                    assert key not in {k for k, _ in groups}, f"members of {key} are not adjacent"
                    groups.append((key, {}))
                groups[-1][1][ext] = tar.extractfile(m).read()
        assert len(groups) == entry["count"]
        for key, parts in groups:
            assert set(parts) - {"cls", "json"} and {"cls", "json"} <= set(parts), (key, sorted(parts))
            (ext,) = set(parts) - {"cls", "json"}
            meta = json.loads(parts["json"].decode("utf-8"))
            label = int(parts["cls"].decode("ascii"))
            assert meta["label"] == label and meta["class"] == manifest["classes"][label]
            data = parts[ext]
            if ext == "npy":
                arr = np.load(io.BytesIO(data), allow_pickle=False)
                assert arr.dtype == np.dtype(manifest["dtype"]) and arr.ndim == 3
                data, shape = np.ascontiguousarray(arr).tobytes(), arr.shape
            else:
                shape = tuple(meta["shape"])
            assert list(shape) == meta["shape"]
            records.append(Record(meta["relpath"], label, tuple(shape), data, ext))
    return records


def read_packed(dest: Path, fmt: str, manifest: dict) -> list[Record]:
    return {"lmdb": read_lmdb, "hdf5": read_hdf5, "wds": lambda d: read_wds_tar(d, manifest)}[fmt](dest)


def read_wds_library(dest: Path, manifest: dict) -> list[tuple]:
    """The official webdataset pipeline: ``(image or array, label, json)`` per sample, in shard order."""
    urls = [str(dest / s["path"]) for s in manifest["shards"]]
    pipeline = wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple(WDS_IMAGE_KEYS, "cls", "json")
    return list(pipeline)


# --------------------------------------------------------------------------------------------------------------
# Independent reference pixels: Pillow + torchvision's Resize / CenterCrop rules written out
# --------------------------------------------------------------------------------------------------------------
def ref_output_size(w: int, h: int, resize, max_size) -> tuple[int, int]:
    if isinstance(resize, tuple):
        return resize
    short, long = (w, h) if w <= h else (h, w)
    if resize is not None:
        new_short, new_long = resize, int(resize * long / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
    elif max_size is not None and long > max_size:  # packer: max_size alone only ever shrinks
        new_short, new_long = int(max_size * short / long), max_size
    else:
        return w, h
    return (new_short, new_long) if w <= h else (new_long, new_short)


def ref_center_crop(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    cw, ch = size
    w, h = img.size
    if cw > w or ch > h:
        left, top = (cw - w) // 2 if cw > w else 0, (ch - h) // 2 if ch > h else 0
        right, bottom = (cw - w + 1) // 2 if cw > w else 0, (ch - h + 1) // 2 if ch > h else 0
        padded = Image.new(img.mode, (w + left + right, h + top + bottom), 0)
        padded.paste(img, (left, top))
        img = padded
        w, h = img.size
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return img.crop((left, top, left + cw, top + ch))


@cache
def _ref_pixels(path: str, mode: str, resize, max_size, crop, interpolation: str) -> np.ndarray:
    with Image.open(path) as img:
        img = img.convert(mode)
    size = ref_output_size(img.width, img.height, resize, max_size)
    if size != img.size:
        img = img.resize(size, getattr(Image.Resampling, interpolation.upper()))
    if crop is not None:
        img = ref_center_crop(img, crop)
    arr = np.asarray(img)
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    arr.setflags(write=False)
    return arr


def ref_pixels(path, mode="RGB", resize=None, max_size=None, crop=None, interpolation="bilinear") -> np.ndarray:
    if isinstance(crop, int):
        crop = (crop, crop)
    return _ref_pixels(str(path), mode, resize, max_size, crop, interpolation)


def ref_normalize(arr: np.ndarray, mean=MEAN, std=STD, dtype="float16") -> np.ndarray:
    c = arr.shape[2]
    x = arr.astype(np.float32) / np.float32(255)
    return ((x - np.asarray(mean, np.float32)[:c]) / np.asarray(std, np.float32)[:c]).astype(dtype)


def pil_pixels(data: bytes, mode: str) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        arr = np.asarray(img.convert(mode))
    return arr[:, :, None] if arr.ndim == 2 else arr


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def assert_close_float16(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.dtype == ref.dtype
    # a float16 ulp is about 2e-3 at the magnitudes of normalized pixels
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-3, atol=2e-3)


def check_packed(dest: Path, fmt: str, src: Path, *, store: str, mode: str = "RGB", resize=None, max_size=None,
                 crop=None, interpolation: str = "bilinear", normalize: bool = False, dtype: str | None = None,
                 mean=MEAN, std=STD, include_hidden: bool = False, skipped: tuple[str, ...] = (),
                 ordered: bool | None = None) -> tuple[dict, list[Record]]:
    """Read DEST independently and compare every sample with the source; returns (manifest, records)."""
    dtype = dtype or ("float16" if normalize else "uint8")
    manifest = read_manifest(dest)
    classes, class_to_idx, samples = imagefolder_reference(src, include_hidden)
    samples = [(rel, label) for rel, label in samples if rel not in skipped]
    assert manifest["format"] == fmt and manifest["store"] == store and manifest["dtype"] == dtype
    assert manifest["classes"] == classes and manifest["class_to_idx"] == class_to_idx
    assert manifest["count"] == len(samples)
    records = read_packed(dest, fmt, manifest)
    relpaths = [r.relpath for r in records]
    assert len(set(relpaths)) == len(relpaths), "an image is stored twice"
    assert sorted(relpaths) == sorted(rel for rel, _ in samples)
    if ordered is None:
        ordered = fmt != "wds"
    if ordered:
        assert relpaths == [rel for rel, _ in samples]
    label_of = dict(samples)
    channels = 1 if mode == "L" else 3
    for r in records:
        assert r.label == label_of[r.relpath], r.relpath
        path = src / r.relpath
        if store == "original":
            assert r.payload == path.read_bytes(), r.relpath
            with Image.open(path) as img:
                assert r.shape == (img.height, img.width, 3)
                if r.ext is not None:
                    assert r.ext == EXT_BY_PIL_FORMAT[img.format]
            continue
        ref = ref_pixels(path, mode, resize, max_size, crop, interpolation)
        if store == "raw":
            got = np.frombuffer(r.payload, dtype=dtype).reshape(r.shape)
            assert r.ext in (None, "npy")
        else:
            got = pil_pixels(r.payload, mode)
            assert r.ext in (None, {"jpeg": "jpg", "png": "png"}[store])
            with Image.open(io.BytesIO(r.payload)) as img:
                assert img.format == {"jpeg": "JPEG", "png": "PNG"}[store]
        assert r.shape == ref.shape == got.shape and r.shape[2] == channels, (r.relpath, r.shape, ref.shape)
        if normalize:
            assert_close_float16(got, ref_normalize(ref, mean, std, dtype))
        elif store == "jpeg":
            assert psnr(got, ref) > 30, r.relpath
        else:
            np.testing.assert_array_equal(got, ref, err_msg=r.relpath)
    return manifest, records


def check_wds_library(dest: Path, src: Path, manifest: dict, records: list[Record], *, store: str,
                      mode: str = "RGB", resize=None, max_size=None, crop=None, normalize: bool = False) -> None:
    """The webdataset library yields every sample, with its label, in shard order, with the right pixels."""
    items = read_wds_library(dest, manifest)
    assert [meta["relpath"] for _, _, meta in items] == [r.relpath for r in records]
    _, _, samples = imagefolder_reference(src)
    label_of = dict(samples)
    for image, label, meta in items:
        assert label == label_of[meta["relpath"]]
        path = src / meta["relpath"]
        if store == "raw":
            assert isinstance(image, np.ndarray)
            ref = ref_pixels(path, mode, resize, max_size, crop)
            if normalize:
                assert_close_float16(image, ref_normalize(ref))
            else:
                np.testing.assert_array_equal(image, ref)
            continue
        assert isinstance(image, Image.Image) and image.mode == "RGB"  # decode("pil") converts to RGB
        got = np.asarray(image)
        if store == "original":
            np.testing.assert_array_equal(got, ref_pixels(path))
            continue
        ref = ref_pixels(path, mode, resize, max_size, crop)
        ref = np.repeat(ref, 3, axis=2) if ref.shape[2] == 1 else ref
        if store == "jpeg":
            assert psnr(got, ref) > 30
        else:
            np.testing.assert_array_equal(got, ref)


def check_manifest(dest: Path, src: Path, fmt: str, manifest: dict) -> None:
    required = {"format", "format_version", "packer_version", "created", "source", "count", "classes",
                "class_to_idx", "store", "transform", "shape", "dtype", "files", "skipped", "hidden_skipped"}
    assert required <= set(manifest), required - set(manifest)
    assert manifest["format"] == fmt
    assert manifest["format_version"] == 1
    assert manifest["packer_version"] == packer.__version__
    created = datetime.datetime.fromisoformat(manifest["created"].replace("Z", "+00:00"))
    assert abs((datetime.datetime.now(datetime.timezone.utc) - created).total_seconds()) < 3600
    assert Path(manifest["source"]["root"]) == src.resolve()
    assert manifest["transform"]["store"] == manifest["store"]
    assert isinstance(manifest["skipped"], list) and isinstance(manifest["hidden_skipped"], int)
    # every data file is listed, with its true size and sha256, and nothing else is left in DEST
    listed = {entry["path"] for entry in manifest["files"]}
    present = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()} - {"manifest.json"}
    assert listed == present
    for entry in manifest["files"]:
        data = (dest / entry["path"]).read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    if fmt == "wds":
        assert sum(s["count"] for s in manifest["shards"]) == manifest["count"]
        assert all(s["count"] > 0 for s in manifest["shards"])



"""Support for the reader and loader tests: what each store packs (conftest's ``pack_once`` fixture packs it once
per session), and an independent Pillow reference of what every sample must decode to (torchvision ImageFolder +
Resize + CenterCrop semantics, written out here rather than taken from packer)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from pathlib import Path

import numpy as np
from PIL import Image

FORMATS = ("lmdb", "hdf5", "wds")

# Storage modes packed from sample_data. Resizes keep the packs small and exercise the offline geometry:
# an int resize gives a variable shape, a centre crop a fixed one; "40x32" is (width, height).
STORES: dict[str, dict] = {
    "original": {},
    "jpeg": {"store": "jpeg", "quality": 90},
    "png": {"store": "png", "resize": 96},
    "raw": {"store": "raw", "resize": 64, "center_crop": 56},
    "raw_var": {"store": "raw", "resize": 50},
    "raw_normalize": {"store": "raw", "normalize": True, "resize": 48, "center_crop": "40x32"},
    # quality 95 and 112 px: 4:2:0 JPEG of a small downscaled photo stays above 30 dB for every sample
    "jpeg_fixed": {"store": "jpeg", "quality": 95, "resize": 128, "center_crop": 112},
}
# What each store's pixels must be: (resize, crop as (w, h)) applied to the source image.
GEOMETRY: dict[str, tuple] = {
    "original": (None, None),
    "jpeg": (None, None),
    "png": (96, None),
    "raw": (64, (56, 56)),
    "raw_var": (50, None),
    "raw_normalize": (48, (40, 32)),
    "jpeg_fixed": (128, (112, 112)),
}
MEAN = (0.485, 0.456, 0.406)  # ImageNet, as torchvision documents them
STD = (0.229, 0.224, 0.225)

_reference: dict[tuple, np.ndarray] = {}


def tv_resize(img: Image.Image, size) -> Image.Image:
    """torchvision ``Resize(size)`` on a PIL image: an int scales the shorter side (the longer one is truncated,
    ``int(size * long / short)``), a (w, h) pair is exact; bilinear, as PIL does it (antialiased)."""
    w, h = img.size
    if isinstance(size, tuple):
        ow, oh = size
    elif w <= h:
        ow, oh = size, int(size * h / w)
    else:
        ow, oh = int(size * w / h), size
    if (ow, oh) == (w, h):
        return img
    return img.resize((ow, oh), Image.Resampling.BILINEAR)


def tv_center_crop(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """torchvision ``CenterCrop`` of a (w, h) no larger than the image."""
    cw, ch = size
    w, h = img.size
    assert cw <= w and ch <= h, "the tests only crop inside the image"
    top = int(round((h - ch) / 2.0))
    left = int(round((w - cw) / 2.0))
    return img.crop((left, top, left + cw, top + ch))


def reference(path: str | os.PathLike, resize=None, crop=None) -> np.ndarray:
    """HWC uint8 pixels of ``path`` as ImageFolder's loader (``convert("RGB")``) then Resize/CenterCrop give."""
    key = (str(path), resize, crop)
    if key not in _reference:
        with Image.open(path) as img:
            out = img.convert("RGB")
        if resize is not None:
            out = tv_resize(out, resize)
        if crop is not None:
            out = tv_center_crop(out, crop)
        arr = np.asarray(out)
        arr.flags.writeable = False
        _reference[key] = arr
    return _reference[key]


def reference_for(src: Path, relpath: str, store: str) -> np.ndarray:
    resize, crop = GEOMETRY[store]
    return reference(src / relpath, resize, crop)


def normalized(arr: np.ndarray) -> np.ndarray:
    """``(x / 255 - mean) / std`` per channel in float64."""
    return (arr.astype(np.float64) / 255.0 - np.array(MEAN)) / np.array(STD)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def hwc(image) -> np.ndarray:
    """A CHW tensor as an HWC numpy array."""
    return image.permute(1, 2, 0).contiguous().numpy()


def digest(image) -> str:
    """A content hash of an image tensor, to recognise a sample in a shuffled batch."""
    t = image.contiguous()
    return hashlib.sha1(t.numpy().tobytes() + str(tuple(t.shape)).encode()).hexdigest()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pixel_digest(image) -> str:
    """A short name for an image tensor's pixels (the blocked and page-budget tests find samples by it)."""
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


def pixel_table(dataset, count: int) -> dict[str, tuple[int, int]]:
    """Each sample's ``(index, label)`` of ``dataset`` by its pixels (``count`` distinct images expected)."""
    found = {pixel_digest(image): (i, label) for i, (image, label) in ((i, dataset[i]) for i in range(len(dataset)))}
    assert len(found) == count, "the test images are distinct"
    return found


def manifest_bytes(root: Path) -> int:
    """The bytes of the data files the manifest of the packed dataset ``root`` lists."""
    import packer

    return sum(e["bytes"] for e in packer.read_manifest(root)["files"])


def seen_indices(batches, table: dict[str, tuple[int, int]]) -> list[int]:
    """The sample index of every image in ``batches``, its label checked against ``table`` (:func:`pixel_table`)."""
    out = []
    for images, labels in batches:
        for image, label in zip(images, labels.tolist(), strict=True):
            index, expected = table[pixel_digest(image)]
            assert label == expected, f"sample {index}: label {label}, the reference reader says {expected}"
            out.append(index)
    return out


class Poll:
    """The most :meth:`sample` gave, sampled every 2 ms on a thread while the ``with`` block runs; ``samples``
    counts the looks."""

    def __init__(self) -> None:
        self.most, self.samples, self.stop = 0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        raise NotImplementedError

    def _run(self) -> None:
        while not self.stop.wait(0.002):
            self.most = max(self.most, self.sample())
            self.samples += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def noise_pack(root: Path, fmt: str, count: int, classes: list[str], seed: int, side: int = 16, **pack) -> Path:
    """``count`` distinct side x side noise images in ``classes`` (sample i in class i % len), packed raw as
    ``fmt`` into ``root/FMT-SEED`` (with ``center_crop=side``: the manifest records their one shape); different
    seeds give different images."""
    import packer

    rng = np.random.default_rng(seed)
    src = root / f"src-{seed}"
    for i in range(count):
        path = src / classes[i % len(classes)] / f"img{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)
    dest = root / f"{fmt}-{seed}"
    packer.pack(src, dest, fmt, **{"store": "raw", "center_crop": side, "progress": False, "workers": 1, **pack})
    return dest


def stop_and_resume(make, take, stop: int, epoch_batches: int, make_resumed=None) -> list:
    """What a loader gives when stopped after ``stop`` batches of its first epoch and resumed from its state by a
    new loader (``make_resumed()``, default ``make()``), through the end of the second epoch. ``take(loader,
    stop=None)`` reads one pass of a loader (up to ``stop`` batches). The state must be plain JSON."""
    import json

    first = make()
    seen = take(first, stop) if stop else []
    state = first.state_dict()
    assert json.loads(json.dumps(state)) == state
    resumed = (make_resumed or make)()
    resumed.load_state_dict(state)
    assert len(resumed) == (epoch_batches - stop or epoch_batches), "len() of the resumed epoch: its batches left"
    seen += take(resumed)
    if stop < epoch_batches:
        seen += take(resumed)
    return seen


def libjpeg_turbo_headers() -> bool:
    """Whether this machine has libjpeg-turbo's development headers where the C compiler looks (Debian's
    layout): where it does, ``pip install`` must build packer's window decoder (packer.images.jpeg_window)."""
    include = Path("/usr/include")
    configs = [include / "jconfig.h", *include.glob("*/jconfig.h")]
    return (include / "jpeglib.h").exists() and any(
        "LIBJPEG_TURBO_VERSION" in p.read_text(errors="replace") for p in configs if p.exists())


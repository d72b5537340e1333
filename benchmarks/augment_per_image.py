"""Single-thread cost of one training sample (RandomResizedCrop + flip) per decoding path, in µs per image.

    python benchmarks/augment_per_image.py PACKED_DATASET [--size 224] [--images 200] [--repeats 3]

Rows, each over the same images and the same windows (``augment_params``), best of ``--repeats`` interleaved passes:

- ``pillow``: Pillow full decode (raw stores: the stored array), ``convert`` to the dataset's mode, crop,
  resize (bilinear), flip: what torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` do after
  ImageFolder's loader (the baseline);
- ``packer pil``: ``ds[i]`` with ``decoder="pil"`` (the same pixels exactly);
- ``packer auto``: ``ds[i]`` with the default decoder (DCT-scaled JPEG decode, only the window resampled, by
  OpenCV);
- ``simplejpeg scaled`` / ``pillow draft``: the two ways of decoding a JPEG at a reduced DCT scale, each
  followed by a window resample (OpenCV's after simplejpeg, Pillow's after draft), to choose between them.

One thread on purpose: this is the work per image, which the loader's threads then share.
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
from PIL import Image

import packer
from packer.images.transforms import to_pil
from packer.loading.sampler import EpochIndex
from packer.reading.augment import MARGIN, resample_box, scaled_window, write_image


def per_image(fn, items) -> float:
    t = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - t) / len(items) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kwargs = {"random_resized_crop": args.size, "flip": True}
    auto = packer.open_dataset(args.dataset, **kwargs)
    pil = packer.open_dataset(args.dataset, decoder="pil", **kwargs)
    n = min(args.images, len(auto))
    mode = auto.spec.mode
    items = []
    for i in range(n):
        data, _ = auto.raw_sample(i)
        window = auto.augment_params(i, 0)
        if isinstance(data, np.ndarray):  # a raw store: the baseline resamples the stored array with Pillow
            items.append((i, data, window, data.shape[:2], False))
            continue
        with Image.open(io.BytesIO(data)) as img:
            full = (img.height, img.width)
            is_jpeg = img.format == "JPEG"
        items.append((i, bytes(data), window, full, is_jpeg))
    size = (args.size, args.size)
    out = np.empty((args.size, args.size, auto.spec.channels), np.uint8)

    def pillow(item):
        _, data, w, _, _ = item
        img = to_pil(data) if isinstance(data, np.ndarray) else Image.open(io.BytesIO(data)).convert(mode)
        img = img.crop((w.left, w.top, w.left + w.width, w.top + w.height)).resize(
            (args.size, args.size), Image.Resampling.BILINEAR)
        if w.flipped:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[...] = np.asarray(img).reshape(out.shape)

    def simplejpeg_scaled(item):
        _, data, w, full, _ = item
        scaled_window(data, mode, full, w, size, "bilinear", out)

    def pillow_draft(item):
        _, data, w, full, _ = item
        img = Image.open(io.BytesIO(data))
        img.draft(mode, (-(-full[1] * args.size * MARGIN // w.width), -(-full[0] * args.size * MARGIN // w.height)))
        arr = np.asarray(img.convert(mode))
        arr = arr if arr.ndim == 3 else arr[:, :, None]
        box = (w.left, w.top, w.left + w.width, w.top + w.height)
        write_image(resample_box(arr, full, box, size, "bilinear"), w.flipped, out)

    rows = [("pillow (baseline)", pillow, items),
            ("packer pil", lambda item: pil[EpochIndex(item[0], 0)], items),
            ("packer auto", lambda item: auto[EpochIndex(item[0], 0)], items)]
    jpegs = [item for item in items if item[4]]
    if jpegs:
        rows += [("simplejpeg scaled (JPEGs)", simplejpeg_scaled, jpegs), ("pillow draft (JPEGs)", pillow_draft, jpegs)]
    best = [float("inf")] * len(rows)
    for _ in range(args.repeats):  # passes interleaved, so that other load on the machine hits every row alike
        for r, (_, fn, subset) in enumerate(rows):
            best[r] = min(best[r], per_image(fn, subset))
    for (name, _, subset), us in zip(rows, best, strict=True):
        print(f"{name:28s} {us:8.0f} µs/image  ({len(subset)} images)")


if __name__ == "__main__":
    main()

"""Build a deterministic ImageFolder of real photographs for tests and benchmarks.

Every image is a random variation (crop, flip, colour jitter, resize) of one of
the public-domain / CC0 photographs that ship inside scikit-image, so no network
is needed.  The layout is torchvision's ``OUT/<class>/<class>_<index>.<ext>``.

Images are ImageNet-like: short side 300-480 px, long side <= 640 px, aspect
3:4..4:3; mostly JPEG (quality 75-95, 4:2:0 or 4:4:4 chroma subsampling, ~8%
progressive), ~5% PNG and exactly one greyscale (mode ``L``) JPEG.  The same
``--seed`` gives byte-identical files on every run, whatever ``--workers`` is.

    python scripts/make_sample_data.py sample_data --overwrite     # committed sample
    python scripts/make_sample_data.py /tmp/bench --per-class 1000  # benchmark set

Needs numpy, Pillow and scikit-image (``pip install scikit-image``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

try:
    import skimage.data
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("make_sample_data.py needs scikit-image: pip install scikit-image")

# class name -> skimage.data loaders of its source photograph(s); all load offline.
CLASSES: dict[str, tuple[str, ...]] = {
    "astronaut": ("astronaut",),
    "cat": ("chelsea",),
    "coffee": ("coffee",),
    "rocket": ("rocket",),
    "galaxy": ("hubble_deep_field",),
    "retina": ("retina",),
}
PNG_FRACTION = 0.05
PROGRESSIVE_FRACTION = 0.08


@functools.cache
def _sources(name: str) -> tuple[Image.Image, ...]:
    """Source photographs of a class, loaded once per process."""
    return tuple(Image.fromarray(getattr(skimage.data, f)()).convert("RGB") for f in CLASSES[name])


def _rng(seed: int, cls: int, idx: int) -> np.random.Generator:
    return np.random.default_rng([seed, cls, idx])


def _grey_index(seed: int, n_classes: int, per_class: int) -> tuple[int, int]:
    """(class, index) of the single greyscale image."""
    k = int(np.random.default_rng([seed, 2**31]).integers(n_classes * per_class))
    return divmod(k, per_class)


def make_image(
    name: str, cls: int, idx: int, seed: int, grey: bool = False
) -> tuple[Image.Image, dict]:
    """Return one random variation of class ``name`` and its ``Image.save`` options."""
    rng = _rng(seed, cls, idx)
    srcs = _sources(name)
    src = srcs[int(rng.integers(len(srcs)))]
    sw, sh = src.size
    # random-resized crop: area 0.35-1.0 of the source, aspect (w/h) 3/4..4/3
    for _ in range(20):
        area = sw * sh * rng.uniform(0.35, 1.0)
        aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
        cw, ch = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
        if cw <= sw and ch <= sh:
            break
    else:
        cw, ch = min(sw, sh), min(sw, sh)
        aspect = 1.0
    x0, y0 = int(rng.integers(sw - cw + 1)), int(rng.integers(sh - ch + 1))
    # output size: short side 300-480 px (ImageNet's typical is 375), long side <= 640 px
    short = int(rng.integers(300, 481))
    long = min(640, round(short * max(aspect, 1 / aspect)))
    w, h = (long, short) if aspect >= 1 else (short, long)
    img = src.resize((w, h), Image.Resampling.LANCZOS, box=(x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        img = enhance(img).enhance(rng.uniform(0.8, 1.2))
    if grey:
        img = img.convert("L")
    if not grey and rng.random() < PNG_FRACTION:
        return img, {"format": "PNG", "compress_level": 6}
    opts = {
        "format": "JPEG",
        "quality": int(rng.integers(75, 96)),
        "subsampling": 2 if rng.random() < 0.6 else 0,  # 4:2:0 or 4:4:4
    }
    if rng.random() < PROGRESSIVE_FRACTION:
        opts["progressive"] = True
    return img, opts


def _write(job: tuple[Path, str, int, int, int, bool]) -> tuple[int, str, bool, bool]:
    out, name, cls, idx, seed, grey = job
    img, opts = make_image(name, cls, idx, seed, grey)
    path = out / name / f"{name}_{idx:05d}.{'png' if opts['format'] == 'PNG' else 'jpg'}"
    img.save(path, **opts)
    return path.stat().st_size, opts["format"], bool(opts.get("progressive")), img.mode == "L"


def _clear(out: Path) -> None:
    """Remove files this script could have written; anything else (e.g. README.md) stays."""
    for name in CLASSES:
        d = out / name
        if d.is_dir():
            for p in d.glob(f"{name}_*"):
                if p.suffix in (".jpg", ".png"):
                    p.unlink()
            if not any(d.iterdir()):
                d.rmdir()


def build(
    out: Path, per_class: int = 30, classes: int = 5, seed: int = 0, workers: int | None = None
) -> list[tuple[int, str, bool, bool]]:
    """Write the ImageFolder into ``out``; return (bytes, format, progressive, grey) per image."""
    names = list(CLASSES)[:classes]
    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
    grey = _grey_index(seed, len(names), per_class)
    jobs = [
        (out, n, c, i, seed, (c, i) == grey) for c, n in enumerate(names) for i in range(per_class)
    ]
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(jobs) < 64:
        return [_write(j) for j in jobs]
    with Pool(workers) as pool:
        return pool.map(_write, jobs, chunksize=16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output folder (OUT/<class>/<image>)")
    ap.add_argument("--per-class", type=int, default=30, help="images per class (default 30)")
    ap.add_argument("--classes", type=int, default=5, help=f"classes, 1-{len(CLASSES)} (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    ap.add_argument("--overwrite", action="store_true", help="replace earlier output in OUT")
    a = ap.parse_args(argv)
    if not 1 <= a.classes <= len(CLASSES):
        ap.error(f"--classes must be 1-{len(CLASSES)}")
    if a.per_class < 1 or a.seed < 0:
        ap.error("--per-class must be >= 1 and --seed >= 0")
    if a.out.exists() and any(a.out.iterdir()):
        if not a.overwrite:
            ap.error(f"{a.out} exists and is not empty (use --overwrite)")
        _clear(a.out)
    t = time.perf_counter()
    res = build(a.out, a.per_class, a.classes, a.seed, a.workers)
    mb = sum(r[0] for r in res) / 1e6
    n_png = sum(r[1] == "PNG" for r in res)
    n_prog = sum(r[2] for r in res)
    n_grey = sum(r[3] for r in res)
    print(
        f"{len(res)} images ({a.classes} classes, {n_png} PNG, {n_prog} progressive JPEG, "
        f"{n_grey} greyscale), {mb:.1f} MB in {a.out} ({time.perf_counter() - t:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

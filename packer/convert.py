"""``pack()``: convert an image folder into a packed dataset.

Worker processes read, decode, transform and encode images in fixed chunks; the main process writes them in
order, so the output (samples, order, labels, bytes) does not depend on the number of workers. At most a few
chunks per worker are in flight, so memory stays flat however large the dataset.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from . import __version__
from .errors import DestinationError, ImageError, PackerError, SourceError
from .formats.base import get_format
from .manifest import FORMAT_VERSION, MANIFEST, write_manifest
from .scan import scan_folder
from .system import usable_cores
from .transforms import DEFAULT_MAX_PIXELS, IMAGENET_MEAN, IMAGENET_STD, TransformSpec, convert_file, parse_size

CHUNK = 16
MARKER = ".packer-in-progress"


def warn(message: str) -> None:
    print(f"packer: warning: {message}", file=sys.stderr, flush=True)


def _convert_chunk(args: tuple[str, list[tuple[int, str, int]], TransformSpec]) -> list[tuple]:
    root, items, spec = args
    out = []
    for position, relpath, label in items:
        try:
            out.append((position, relpath, label, convert_file(os.path.join(root, relpath), relpath, spec)))
        except ImageError as exc:
            out.append((position, relpath, label, exc))
    return out


def make_spec(store: str | None = None, resize: int | str | None = None, max_size: int | None = None,
              center_crop: int | str | None = None, interpolation: str = "bilinear", quality: int = 90,
              mode: str = "RGB", exif_transpose: bool = False, normalize: bool = False,
              mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
              dtype: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> TransformSpec:
    """Fill in the defaults: ``original`` unless pixels change, ``jpeg`` when resizing, ``raw`` to normalize."""
    crop = parse_size(center_crop)
    crop = (crop, crop) if isinstance(crop, int) else crop
    changes = bool(resize or max_size or crop or mode != "RGB" or exif_transpose)
    if store is None:
        store = "raw" if normalize else ("jpeg" if changes else "original")
    if dtype is None:
        dtype = "float16" if normalize else "uint8"
    return TransformSpec(store=store, resize=parse_size(resize), max_size=max_size, center_crop=crop,
                         interpolation=interpolation, mode=mode, exif_transpose=exif_transpose, quality=quality,
                         normalize=normalize, mean=tuple(mean), std=tuple(std), dtype=dtype, max_pixels=max_pixels)


def _prepare_dest(dest: Path, src: Path, overwrite: bool) -> None:
    src_r, dest_r = src.resolve(), dest.resolve()
    if dest_r == src_r or src_r.is_relative_to(dest_r):
        raise DestinationError(f"{dest}: the destination would contain the source; choose another folder")
    if dest.exists() and not dest.is_dir():
        raise DestinationError(f"{dest}: exists and is not a folder; choose another destination")
    if dest.exists() and any(dest.iterdir()):
        if not overwrite:
            raise DestinationError(f"{dest}: already exists and is not empty; pass --overwrite to replace it")
        if not ((dest / MANIFEST).exists() or (dest / MARKER).exists()):
            raise DestinationError(f"{dest}: is not a packer dataset, so --overwrite will not delete it; "
                                   "choose an empty or new folder")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def _estimate_bytes(src: Path, samples: list[tuple[str, int]], spec: TransformSpec) -> int:
    shape = spec.fixed_shape
    if spec.store == "raw" and shape:
        return len(samples) * int(np.prod(shape)) * np.dtype(spec.dtype).itemsize
    total = 0
    for rel, _ in samples:
        try:
            total += os.stat(src / rel).st_size
        except OSError:
            pass
    return total * (8 if spec.store == "raw" else 1)


def pack(src: str | os.PathLike, dest: str | os.PathLike, format: str = "lmdb", *, store: str | None = None,
         resize: int | str | None = None, max_size: int | None = None, center_crop: int | str | None = None,
         interpolation: str = "bilinear", quality: int = 90, mode: str = "RGB", exif_transpose: bool = False,
         normalize: bool = False, mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
         dtype: str | None = None, workers: int | None = None, shuffle: bool | None = None, seed: int = 0,
         shard_size: int | None = None, shard_samples: int | None = None, strict: bool = False,
         overwrite: bool = False, include_hidden: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS,
         progress: bool = True) -> dict[str, Any]:
    """Convert the image folder ``src`` into a ``format`` dataset in ``dest`` and return its manifest.

    See the README for every option; the CLI's ``packer pack`` calls this with the same names."""
    src, dest = Path(src), Path(dest)
    writer_cls, _ = get_format(format)
    spec = make_spec(store, resize, max_size, center_crop, interpolation, quality, mode, exif_transpose, normalize,
                     mean, std, dtype, max_pixels)
    scan = scan_folder(src, include_hidden=include_hidden)
    if scan.hidden_skipped:
        warn(f"skipped {scan.hidden_skipped} hidden files and folders in {src} (names starting with '.'); "
             "pass --include-hidden to keep them")
    for cls in scan.empty_classes:
        warn(f"class {cls!r} has no images; it keeps its index {scan.class_to_idx[cls]}")
    if strict and scan.errors:
        rel, why = scan.errors[0]
        raise ImageError(str(src / rel), why)
    if spec.normalize:
        per = np.dtype(spec.dtype).itemsize
        warn(f"--normalize stores {spec.dtype} arrays: {per}x the bytes of raw uint8 and far more than JPEG")
    _prepare_dest(dest, src, overwrite)
    (dest / MARKER).write_text("conversion in progress; no manifest.json yet\n")

    order = list(range(len(scan.samples)))
    if shuffle is None:
        shuffle = format == "wds"  # WebDataset is read sequentially, so its order is the shuffle
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(order)).tolist()
    samples = [scan.samples[i] for i in order]
    estimated = _estimate_bytes(src, samples, spec)
    options = {"estimated_bytes": estimated, "shard_bytes": shard_size, "shard_samples": shard_samples,
               "classes": scan.classes}
    started = time.time()
    writer = writer_cls(dest, spec, len(samples), options)
    skipped = [{"path": rel, "error": why} for rel, why in scan.errors]
    for entry in skipped:
        warn(f"skipped {src / entry['path']}: {entry['error']}")
    try:
        _run(src, samples, spec, writer, workers, strict, skipped, progress)
        if writer.count == 0:
            raise SourceError(f"{src}: none of the {len(samples)} images could be read; nothing was packed")
        extras = writer.close()
    except BaseException:
        writer.abort()
        raise
    manifest = {
        "format": format, "format_version": FORMAT_VERSION, "packer_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {"root": str(src.resolve()), "images": len(scan.samples), "bytes": estimated if spec.store !=
                   "raw" else None},
        "count": writer.count, "classes": scan.classes, "class_to_idx": scan.class_to_idx,
        "store": spec.store, "transform": spec.to_dict(),
        "shape": list(spec.fixed_shape) if spec.fixed_shape else None, "dtype": spec.dtype,
        "order": {"shuffle": bool(shuffle), "seed": seed}, "checksum": "crc32",
        **extras,
        "skipped": skipped, "hidden_skipped": scan.hidden_skipped, "empty_classes": scan.empty_classes,
        "conversion_seconds": round(time.time() - started, 3),
    }
    write_manifest(dest, manifest)
    (dest / MARKER).unlink()
    return manifest


def _run(src: Path, samples: list[tuple[str, int]], spec: TransformSpec, writer, workers: int | None,
         strict: bool, skipped: list[dict], progress: bool) -> None:
    workers = usable_cores() if workers is None else max(1, workers)
    chunks = [[(p, rel, label) for p, (rel, label) in enumerate(samples[i:i + CHUNK], start=i)]
              for i in range(0, len(samples), CHUNK)]
    bar = tqdm(total=len(samples), unit="img", disable=not progress, file=sys.stderr, dynamic_ncols=True,
               desc=f"packing {writer.format}")

    def consume(results: list[tuple]) -> None:
        for _, relpath, label, item in results:
            if isinstance(item, ImageError):
                if strict:
                    raise ImageError(str(src / relpath), item.reason)
                warn(f"skipped {src / relpath}: {item.reason}")
                skipped.append({"path": relpath, "error": item.reason})
            else:
                writer.write(label, relpath, item)
        bar.update(len(results))

    try:
        if workers == 1:
            for chunk in chunks:
                consume(_convert_chunk((str(src), chunk, spec)))
            return
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(workers) as pool:
            pending: deque = deque()
            window = 4 * workers
            for chunk in chunks:
                pending.append(pool.apply_async(_convert_chunk, ((str(src), chunk, spec),)))
                if len(pending) >= window:
                    consume(pending.popleft().get())
            while pending:
                consume(pending.popleft().get())
    except OSError as exc:
        raise PackerError(f"{writer.dest}: write failed ({exc.strerror}); free space or fix permissions, "
                          "then run the command again") from None
    finally:
        bar.close()

"""``pack()``: convert an image folder into a packed dataset.

Worker processes read, decode, transform and encode images in fixed chunks; the main process writes them in
order, so the output (samples, order, labels, bytes) does not depend on the number of workers. At most a few
chunks per worker are in flight, so memory stays flat however large the dataset.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
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
from .manifest import FORMAT_VERSION, MANIFEST, read_manifest, write_json_atomic, write_manifest
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


def _fingerprint(scan, src: Path) -> str:
    """A digest of what the scan found (paths, labels, sizes, mtimes): a resumed run must see the same source."""
    h = hashlib.sha256(json.dumps([scan.classes, scan.errors]).encode())
    for rel, label in scan.samples:
        try:
            st = os.stat(src / rel)
            h.update(f"{rel}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{rel}\0{label}\0missing\n".encode())
    return h.hexdigest()


def read_journal(dest: Path) -> dict | None:
    """The progress record of an unfinished conversion in ``dest``, or None."""
    path = dest / MARKER
    if not path.exists():
        return None
    try:
        journal = json.loads(path.read_text())
        if not isinstance(journal, dict) or "options" not in journal:
            raise ValueError("not a journal")
        return journal
    except (OSError, ValueError) as exc:
        raise DestinationError(f"{path}: unreadable progress record ({exc}); start again with --overwrite") from None


def _differences(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def pack(src: str | os.PathLike, dest: str | os.PathLike, format: str = "lmdb", *, store: str | None = None,
         resize: int | str | None = None, max_size: int | None = None, center_crop: int | str | None = None,
         interpolation: str = "bilinear", quality: int = 90, mode: str = "RGB", exif_transpose: bool = False,
         normalize: bool = False, mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
         dtype: str | None = None, workers: int | None = None, shuffle: bool | None = None, seed: int = 0,
         shard_size: int | None = None, shard_samples: int | None = None, strict: bool = False,
         overwrite: bool = False, resume: bool = False, include_hidden: bool = False,
         max_pixels: int = DEFAULT_MAX_PIXELS, progress: bool = True) -> dict[str, Any]:
    """Convert the image folder ``src`` into a ``format`` dataset in ``dest`` and return its manifest.

    ``resume=True`` continues an interrupted conversion of the same source with the same options, and returns
    the existing manifest if ``dest`` is already finished. See the README for every option; the CLI's
    ``packer pack`` calls this with the same names."""
    src, dest = Path(src), Path(dest)
    writer_cls, _ = get_format(format)
    spec = make_spec(store, resize, max_size, center_crop, interpolation, quality, mode, exif_transpose, normalize,
                     mean, std, dtype, max_pixels)
    if resume and (dest / MANIFEST).exists():
        print(f"packer: {dest} is already a finished dataset; nothing to resume", file=sys.stderr)
        return read_manifest(dest)
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
    if shuffle is None:
        shuffle = format == "wds"  # WebDataset is read sequentially, so its order is the shuffle
    options = {"format": format, "transform": spec.to_dict(), "shuffle": bool(shuffle), "seed": seed,
               "shard_size": shard_size, "shard_samples": shard_samples, "include_hidden": include_hidden,
               "strict": strict, "source": str(src.resolve()), "fingerprint": _fingerprint(scan, src)}
    options = json.loads(json.dumps(options))  # as the journal will hold them: lists, not tuples
    journal = read_journal(dest) if resume else None
    resuming = journal is not None
    if journal is not None:
        changed = _differences(journal["options"], options)
        if changed:
            raise DestinationError(f"{dest}: the interrupted conversion used a different {', '.join(changed)}; "
                                   "resume with the same source and options, or start again with --overwrite")
    else:
        if resume:
            warn(f"nothing to resume in {dest}; starting afresh")
        _prepare_dest(dest, src, overwrite)
        journal = {"options": options, "position": 0, "skipped": [], "writer": None}
        write_json_atomic(dest / MARKER, journal)

    order = list(range(len(scan.samples)))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(order)).tolist()
    samples = [scan.samples[i] for i in order]
    estimated = _estimate_bytes(src, samples, spec)
    writer_options = {"estimated_bytes": estimated, "shard_bytes": shard_size, "shard_samples": shard_samples,
                      "classes": scan.classes}
    started = time.time()
    writer = writer_cls(dest, spec, len(samples), writer_options)
    conversion = _Conversion(src, dest, samples, spec, writer, journal, strict, progress)
    for rel, why in scan.errors:
        warn(f"skipped {src / rel}: {why}")
    try:
        conversion.restore(resuming)
        conversion.run(workers)
        if writer.count == 0:
            raise SourceError(f"{src}: none of the {len(samples)} images could be read; nothing was packed")
        extras = writer.close()
    except BaseException:
        writer.abort()
        raise
    skipped = [{"path": rel, "error": why} for rel, why in scan.errors]
    skipped += [{"path": e["path"], "error": e["error"]} for e in conversion.skipped]
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
        "conversion_seconds": round(time.time() - started, 3), "resumed": conversion.resumed,
    }
    write_manifest(dest, manifest)
    (dest / MARKER).unlink()
    return manifest


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and ends the pool


class _Conversion:
    """Runs the workers and the writer, and keeps the journal that makes the conversion resumable.

    The journal (``.packer-in-progress``) records, each time the writer makes its output durable, how many
    samples it holds, the source position to continue from, and the images skipped so far."""

    def __init__(self, src: Path, dest: Path, samples: list[tuple[str, int]], spec: TransformSpec, writer,
                 journal: dict, strict: bool, progress: bool):
        self.src, self.dest, self.samples, self.spec = src, dest, samples, spec
        self.writer, self.journal, self.strict, self.progress = writer, journal, strict, progress
        self.skipped: list[dict] = []
        self.start = 0
        self.resumed = False
        self.pending: deque = deque()  # (count after writing, position) of samples not yet durable

    def restore(self, resuming: bool) -> None:
        state = self.journal.get("writer")
        kept = self.writer.restore(state) if state is not None else 0
        self.resumed = resuming
        if kept == 0:
            if resuming:
                warn(f"{self.dest}: no finished part to keep ({self.writer.format} keeps "
                     f"{self.writer.RESUMES_FROM}); converting again from the first image")
            return
        self.start = self.journal["position"]
        self.skipped = list(self.journal["skipped"])
        print(f"packer: resuming {self.dest} after {kept} samples", file=sys.stderr)

    def _checkpoint(self, durable: int) -> None:
        position = None
        while self.pending and self.pending[0][0] <= durable:
            position = self.pending.popleft()[1] + 1
        if position is None:
            return
        self.journal.update(position=position, writer=self.writer.state(),
                            skipped=[e for e in self.skipped if e["position"] < position])
        write_json_atomic(self.dest / MARKER, self.journal)

    def consume(self, results: list[tuple]) -> None:
        for position, relpath, label, item in results:
            if isinstance(item, ImageError):
                if self.strict:
                    raise ImageError(str(self.src / relpath), item.reason)
                warn(f"skipped {self.src / relpath}: {item.reason}")
                self.skipped.append({"path": relpath, "error": item.reason, "position": position})
                continue
            durable = self.writer.write(label, relpath, item)
            self.pending.append((self.writer.count, position))
            if durable is not None:
                self._checkpoint(durable)
        self.bar.update(len(results))

    def run(self, workers: int | None) -> None:
        workers = usable_cores() if workers is None else max(1, workers)
        root = str(self.src)
        chunks = [[(p, rel, label) for p, (rel, label) in enumerate(self.samples[i:i + CHUNK], start=i)]
                  for i in range(self.start, len(self.samples), CHUNK)]
        self.bar = tqdm(total=len(self.samples), initial=self.start, unit="img", disable=not self.progress,
                        file=sys.stderr, dynamic_ncols=True, desc=f"packing {self.writer.format}")
        try:
            if workers == 1:
                for chunk in chunks:
                    self.consume(_convert_chunk((root, chunk, self.spec)))
                return
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ctx.Pool(workers, initializer=_ignore_sigint) as pool:
                pending: deque = deque()
                window = 4 * workers  # chunks in flight: bounds memory whatever the dataset size
                for chunk in chunks:
                    pending.append(pool.apply_async(_convert_chunk, ((root, chunk, self.spec),)))
                    if len(pending) >= window:
                        self.consume(pending.popleft().get())
                while pending:
                    self.consume(pending.popleft().get())
        except OSError as exc:
            raise PackerError(f"{self.dest}: write failed ({exc.strerror}); free space or fix permissions, then "
                              "run the same command with --resume") from None
        finally:
            self.bar.close()

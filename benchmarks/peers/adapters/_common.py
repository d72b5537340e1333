"""The harness every adapter shares: scan, pack (timed), read (timed, in a child process), evict, report.

An adapter is a script that defines ``TOOL`` (its name in the table), ``VARIANTS`` (its rows) and these
functions, then calls :func:`main`::

    def check(variant) -> None                                 # optional: raise if the row cannot run here
    def pack(variant, samples, classes, dest) -> Path | None   # write ``dest``; return the folder read later
    def prepare(variant, dest) -> None                         # optional: imports, untimed, before ``pack``
    def data_files(variant, data) -> list[Path]                # optional: the files to evict (default: all)
    def make_loader(variant, data, batch_size, workers)        # an iterable of (images, labels) batches
    def versions() -> dict[str, str]                           # the packages that matter for the row

It runs inside the peer's own venv, so it may import only the standard library, numpy, Pillow, torch, psutil
and the peer itself. Every number in a row is measured the same way for every tool:

- conversion: wall time of ``pack`` with the source folder already in the page cache (it is read once first,
  untimed), so only the tool's own work counts; bytes on disk: every file under the folder it wrote;
- warm: the read runs in a child process with the packed files in the page cache (read once just before);
  epoch 1 includes starting the loader's workers, epoch 2 reuses them where the loader keeps them;
- cold: the packed files are fsync'ed and dropped from the page cache (``POSIX_FADV_DONTNEED``) while no process
  has them open, then a new child process reads one epoch;
- peak memory: the highest sum of RSS (and of PSS, which counts pages shared by forked workers once) over the
  child process and its descendants during the warm read: RSS sampled every 50 ms, PSS every second, both
  also taken at the end of every epoch;
- repeats: the warm and cold reads run ``--repeats`` times (packing once); each number is the median over the
  repeats, and the images/s figures also keep their min and max (``<key>_min``, ``<key>_max``).

Each variant belongs to one pipeline: ``val`` (resize 256 + centre crop 224, fixed per image) or ``train``
(RandomResizedCrop 224 + horizontal flip, random per image and epoch).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image

# torchvision's ImageFolder extensions
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
RESIZE, CROP = 256, 224
PIPELINES = ("val", "train")
# what a read does per image, for the table: rows are only comparable when this matches
FULL_DECODE = "decode+resize"
FULL_DECODE_RRC = "decode+RRC"
SAMPLE_EVERY_S = 0.05


@dataclass
class Variant:
    """One row of the table. Variants with the same ``pack_key`` share one packed copy (packed once)."""

    name: str
    pack_key: str
    options: dict[str, Any] = field(default_factory=dict)
    pipeline: str = "val"


# -- the common input and output ------------------------------------------------------------------------------

def scan(root: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    """``(path, label)`` pairs and class names with ImageFolder's rules (sorted class folders, sorted files)."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    samples = []
    for label, name in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(root / name, followlinks=True):
            dirnames.sort()
            for fname in sorted(filenames):
                if fname.lower().endswith(IMG_EXTENSIONS) and not fname.startswith("."):
                    samples.append((Path(dirpath) / fname, label))
    return samples, classes


def source_root(samples: list[tuple[Path, int]], classes: list[str]) -> Path:
    """The source folder: the parent of the first sample's class folder."""
    path, label = samples[0]
    while path.name != classes[label]:
        path = path.parent
    return path.parent


def resize_crop(img: Image.Image) -> Image.Image:
    """torchvision's ``Resize(256)`` then ``CenterCrop(224)`` on a PIL image (bilinear, as packer's default)."""
    img = img.convert("RGB")
    w, h = img.size
    if w <= h:
        size = (RESIZE, int(RESIZE * h / w))
    else:
        size = (int(RESIZE * w / h), RESIZE)
    img = img.resize(size, Image.BILINEAR)
    left, top = int(round((size[0] - CROP) / 2.0)), int(round((size[1] - CROP) / 2.0))
    return img.crop((left, top, left + CROP, top + CROP))


def to_chw(img: Image.Image) -> Any:
    """A PIL image as the uint8 CHW tensor every row ends with."""
    import torch

    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def transform(img: Image.Image) -> Any:
    """The per-image pipeline every peer without its own uses: RGB, resize 256, centre-crop 224, CHW uint8."""
    return to_chw(resize_crop(img))


def train_transform() -> Any:
    """The training pipeline a torchvision user writes: ``RandomResizedCrop(224)`` (bilinear, antialiased, the
    default scale and ratio), ``RandomHorizontalFlip()``, then ``PILToTensor()`` (CHW uint8; it passes a tensor
    through when the peer decodes to tensors itself). Needs torchvision in the peer's venv."""
    from torchvision import transforms

    return transforms.Compose([transforms.RandomResizedCrop(CROP), transforms.RandomHorizontalFlip(),
                               _ToTensorIfPil()])


class _ToTensorIfPil:
    """``PILToTensor`` for PIL images; tensors (from a peer that decodes itself) pass unchanged."""

    def __call__(self, img: Any) -> Any:
        if isinstance(img, Image.Image):
            return to_chw(img)
        return img


class RgbThen:
    """Convert a PIL image to RGB (as ImageFolder's loader does), then apply ``then``; picklable for workers."""

    def __init__(self, then: Any):
        self.then = then

    def __call__(self, img: Image.Image) -> Any:
        return self.then(img.convert("RGB"))


def pipeline_transform(variant: Variant) -> Any:
    """The per-image PIL pipeline of ``variant``'s pipeline: :func:`transform` for val, RGB then
    :func:`train_transform` for train."""
    return RgbThen(train_transform()) if variant.pipeline == "train" else transform


def folder_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in folder_files(root))


def warm(paths: list[Path]) -> None:
    """Read files once so they are in the page cache (conversion then times the tool, not the disk)."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass


def evict(paths: list[Path]) -> None:
    """Drop files from the page cache. Dirty pages are written first (fsync), since DONTNEED skips them."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore), to show that eviction worked; None if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    total = resident = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            ok = libc.mincore(addr, size, vec) == 0
            libc.munmap(addr, size)
        finally:
            os.close(fd)
        if not ok:
            return None
        total += pages
        resident += sum(b & 1 for b in vec)
    return resident / total if total else None


# -- measuring a read -----------------------------------------------------------------------------------------

class TreeMemory:
    """Samples the summed RSS (every 50 ms) and PSS (every second) of a process and all its descendants, in a
    background thread. Kept cheap, since it shares the cores it measures: the process list is refreshed every
    0.5 s, and PSS (a page-table walk, ~8 ms a process) once a second."""

    def __init__(self, pid: int):
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.procs = [self.root]
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(SAMPLE_EVERY_S):
            if tick % 10 == 0:
                try:
                    self.procs = [self.root, *self.root.children(recursive=True)]
                except self.psutil.Error:
                    return
            self.peak_rss = max(self.peak_rss, self._sum("rss"))
            if tick % 20 == 0:
                self.peak_pss = max(self.peak_pss, self._sum("pss"))
            tick += 1

    def _sum(self, key: str) -> int:
        total = 0
        for proc in self.procs:
            try:
                info = proc.memory_full_info() if key == "pss" else proc.memory_info()
                total += getattr(info, key, 0)
            except self.psutil.Error:
                pass
        return total

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak_rss, self.peak_pss


def batch_parts(batch: Any) -> tuple[Any, Any]:
    """``(images, labels)`` from a tuple/list batch or a dict batch with image and label keys."""
    if isinstance(batch, dict):
        images = next(batch[k] for k in ("image", "images", "jpg", "img") if k in batch)
        labels = next(batch[k] for k in ("label", "labels", "cls") if k in batch)
        return images, labels
    return batch[0], batch[1]


def check_images(images: Any) -> int:
    """Every row must end with the same thing: a uint8 (B, 3, 224, 224) tensor. Returns B."""
    import torch

    expected = (3, CROP, CROP)
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or tuple(images.shape[1:]) != expected:
        shape = getattr(images, "shape", None)
        raise TypeError(f"batch is {type(images).__name__} {getattr(images, 'dtype', '')} {shape}, "
                        f"not uint8 (B, 3, {CROP}, {CROP})")
    return int(images.shape[0])


def tree_memory(pid: int) -> tuple[int, int]:
    """Summed RSS and PSS of ``pid`` and its descendants now."""
    import psutil

    rss = pss = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        rss, pss = rss + info.rss, pss + getattr(info, "pss", 0)
    return rss, pss


def run_epochs(loader: Any, epochs: int) -> list[dict[str, float]]:
    """Iterate ``loader`` ``epochs`` times; each epoch's samples, seconds, time to its first batch, and the
    memory of this process tree at its end (untimed; workers are still up there, which the sampler in the
    parent can miss on an epoch shorter than its PSS period)."""
    results = []
    for _ in range(epochs):
        count, first = 0, None
        start = time.perf_counter()
        for batch in loader:
            images, labels = batch_parts(batch)
            size = check_images(images)
            n_labels = len(labels) if getattr(labels, "ndim", 1) else 1  # a squeezed batch of one is 0-d
            if n_labels != size:
                raise ValueError(f"a batch of {size} images came with {n_labels} labels")
            count += size
            if first is None:
                first = time.perf_counter() - start
        seconds = time.perf_counter() - start
        rss, pss = tree_memory(os.getpid())
        results.append({"samples": count, "seconds": seconds, "first_batch_s": first or 0.0,
                        "samples_per_s": count / seconds if seconds else 0.0, "end_rss": rss, "end_pss": pss})
    return results


def read_child(adapter_file: str, variant: Variant, data: Path, args: argparse.Namespace, epochs: int,
               result: Path) -> dict[str, Any]:
    """Run one read in a new process (its own imports, no pages or handles left from packing) and sample
    the memory of its process tree from here."""
    cmd = [sys.executable, adapter_file, "--read-child", json.dumps(asdict(variant)), "--data", str(data),
           "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--epochs", str(epochs),
           "--result", str(result)]
    result.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd)
    memory = TreeMemory(proc.pid)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"read timed out after {args.timeout} s") from None
    finally:
        peak_rss, peak_pss = memory.stop()
    out = json.loads(result.read_text()) if result.exists() else {}
    if out.get("error"):
        raise RuntimeError(out["error"])
    if code != 0 or "epochs" not in out:
        raise RuntimeError(f"read process exited with {code} (its traceback is in the log)")
    peak_rss = max([peak_rss, *(e["end_rss"] for e in out["epochs"])])
    peak_pss = max([peak_pss, *(e["end_pss"] for e in out["epochs"])])
    out.update(peak_rss_mb=peak_rss / 2**20, peak_pss_mb=peak_pss / 2**20)
    return out


# -- the driver -----------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pack a folder with one tool and time reading it back.")
    p.add_argument("--src", type=Path, help="ImageFolder-layout source folder")
    p.add_argument("--work", type=Path, help="where to write this tool's packed copies")
    p.add_argument("--out", type=Path, help="JSON file for the rows")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="warm epochs (the cold read is one epoch)")
    p.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--pipelines", default=",".join(PIPELINES), help="comma-separated, from val, train")
    p.add_argument("--repeats", type=int, default=3, help="warm and cold reads per row (median reported)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one read may take")
    p.add_argument("--read-child", help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child_main(adapter: ModuleType, args: argparse.Namespace) -> None:
    """The read process: build the tool's loader, iterate it, write the timings."""
    variant = Variant(**json.loads(args.read_child))
    try:
        loader = adapter.make_loader(variant, args.data, args.batch_size, args.workers)
        epochs = run_epochs(loader, args.epochs)
    except Exception as exc:  # the parent reports this message as the row's error
        traceback.print_exc()
        args.result.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
    args.result.write_text(json.dumps({"epochs": epochs}))


def read_once(adapter: ModuleType, variant: Variant, data: Path, args: argparse.Namespace,
              files: list[Path]) -> dict[str, Any]:
    """One warm read (files read into the page cache first) and one cold read (files evicted first)."""
    result = args.work / f".read-{os.getpid()}.json"
    warm(files)
    warm_read = read_child(adapter.__file__, variant, data, args, args.epochs, result)
    evict(files)
    run: dict[str, Any] = {"resident_after_evict": resident_fraction(files)}
    cold_read = read_child(adapter.__file__, variant, data, args, 1, result)
    result.unlink(missing_ok=True)
    for i, epoch in enumerate(warm_read["epochs"], 1):
        run[f"warm_epoch{i}_sps"] = epoch["samples_per_s"]
        run[f"warm_epoch{i}_samples"] = epoch["samples"]
        run[f"warm_epoch{i}_first_batch_s"] = epoch["first_batch_s"]
    run["cold_sps"] = cold_read["epochs"][0]["samples_per_s"]
    run["cold_samples"] = cold_read["epochs"][0]["samples"]
    run["peak_rss_mb"] = warm_read["peak_rss_mb"]
    run["peak_pss_mb"] = warm_read["peak_pss_mb"]
    return run


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every number over the repeats; images/s also keep their min and max."""
    summary: dict[str, Any] = {"repeats": len(runs), "runs": runs}
    for key in runs[0]:
        values = [r[key] for r in runs if r.get(key) is not None]
        if not values:
            summary[key] = None
            continue
        summary[key] = statistics.median(values)
        if key.endswith("_sps"):
            summary[f"{key}_min"], summary[f"{key}_max"] = min(values), max(values)
    return summary


def measure_variant(adapter: ModuleType, variant: Variant, args: argparse.Namespace,
                    samples: list[tuple[Path, int]], classes: list[str], packed: dict[str, dict]) -> dict[str, Any]:
    """Pack (once per ``pack_key``), then ``--repeats`` times: read warm, evict, read cold; one row."""
    row: dict[str, Any] = {"tool": adapter.TOOL, "variant": variant.name, "pipeline": variant.pipeline,
                           "images": len(samples), "batch_size": args.batch_size, "workers": args.workers}
    check = getattr(adapter, "check", None)
    if check is not None:  # before packing, so an unsupported row costs nothing
        check(variant)
    if variant.pack_key not in packed:
        dest = args.work / variant.pack_key
        prepare = getattr(adapter, "prepare", None)
        if prepare is not None:  # imports and scratch setup, kept out of the conversion time
            prepare(variant, dest)
        warm([p for p, _ in samples])
        start = time.perf_counter()
        data = adapter.pack(variant, samples, classes, dest)
        seconds = time.perf_counter() - start
        data = Path(data) if data is not None else dest
        packed[variant.pack_key] = {"data": data, "conversion_s": seconds if data != args.src else 0.0,
                                    "bytes": disk_bytes(data)}
    info = packed[variant.pack_key]
    data = info["data"]
    default_work = FULL_DECODE_RRC if variant.pipeline == "train" else FULL_DECODE
    row.update(read_work=variant.options.get("work", default_work), conversion_s=info["conversion_s"],
               bytes=info["bytes"], packed_at=str(data))
    files = adapter.data_files(variant, data) if hasattr(adapter, "data_files") else folder_files(data)
    row.update(summarize([read_once(adapter, variant, data, args, files) for _ in range(args.repeats)]))
    return row


def main(adapter: ModuleType, argv: list[str] | None = None) -> None:
    """Entry point of every adapter script."""
    args = parse_args(argv)
    if args.read_child:
        child_main(adapter, args)
        return
    args.src, args.work = args.src.resolve(), args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    samples, classes = scan(args.src)
    wanted = {v for v in args.variants.split(",") if v}
    pipelines = {p for p in args.pipelines.split(",") if p}
    variants = [v for v in adapter.VARIANTS if (not wanted or v.name in wanted) and v.pipeline in pipelines]
    versions = adapter.versions()
    rows, packed = [], {}
    for variant in variants:
        print(f"[{adapter.TOOL}] {variant.pipeline}: {variant.name}", file=sys.stderr, flush=True)
        try:
            row = measure_variant(adapter, variant, args, samples, classes, packed)
        except Exception as exc:  # one broken variant must not lose the others' rows
            traceback.print_exc()
            row = {"tool": adapter.TOOL, "variant": variant.name, "pipeline": variant.pipeline,
                   "error": f"{type(exc).__name__}: {exc}"}
        row["versions"] = versions
        row["notes"] = variant.options.get("notes", "")
        rows.append(row)
        args.out.write_text(json.dumps(rows, indent=2))
    args.out.write_text(json.dumps(rows, indent=2))


def package_versions(*names: str) -> dict[str, str]:
    """Installed versions of the named distributions (missing ones are left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found

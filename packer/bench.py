"""``packer bench``: measure how fast packed datasets load against the raw image folder, and what bounds them.

:func:`run_bench` packs SRC into each asked format and storage mode (or reuses packed datasets), then reads each
one and the folder itself (``FolderDataset(decoder="pil")``: Pillow + Resize + CenterCrop, the torchvision
ImageFolder baseline) through :func:`packer.make_loader`, every one giving the same uint8 NCHW batches. For each
(dataset, store, workers, epoch, cache) it records samples/s, MB/s read and decoded, time to the first batch, the
speedup over the folder with the same settings and the fraction of a ceiling measured in the same run:

- decode ceiling: the stored payloads decoded (and resized/cropped as the loader does) by a process pool of
  ``usable_cores()`` processes, with no loader, for encoded modes;
- memory-copy ceiling: ``np.copyto`` bandwidth / bytes per sample, for raw arrays that need no transform;
- disk ceiling (cold cache only): sequential read speed of the work folder's disk / bytes read per sample.

A cold run first evicts every file of the dataset from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``, with
nothing mapped) and checks with ``mincore`` that the eviction took; tmpfs and some overlay filesystems keep the
pages, and the row then says ``eviction_ok: false``.

:func:`tune` sweeps workers, batch size and prefetch factor on one packed dataset and writes the fastest to
``DEST/loader.json``, which :func:`packer.make_loader` then uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib.metadata
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from . import __version__
from .bench_train import PIPELINES, open_train, parse_pipelines, train_size
from .errors import PackerError, warn
from .system import usable_cores
from .transforms import STORES, apply_geometry, as_hwc, decode, open_image, parse_size, resize_crop, to_pil

DEFAULT_OUT = "bench-out"
WARMUP_BATCHES = 2  # batches of epoch 1 left out of its rate: worker start-up and first-touch costs
BLOCK = 8 << 20
EVICTED_BELOW = 0.01  # resident fraction under which an eviction counts as done
PAYLOAD_LIMIT = 256 << 20  # stored bytes held in memory for the decode ceiling
VERSIONED = ("torch", "numpy", "pillow", "simplejpeg", "h5py", "lmdb", "webdataset")

Size = int | tuple[int, int] | None


# -- the machine ------------------------------------------------------------------------------------------------
def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem holding ``path`` (ext4, xfs, tmpfs, overlay, nfs...), from /proc/self/mounts."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    try:  # a cgroup limit is what this process can really use
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(work: str | os.PathLike | None = None, src: str | os.PathLike | None = None) -> dict[str, Any]:
    """Cores, memory, CPU, library versions, start method and filesystem types, for results.json."""
    info: dict[str, Any] = {
        "usable_cores": usable_cores(), "cpu_count": os.cpu_count(), "cpu_model": _cpu_model(),
        "memory_gib": round(_memory_bytes() / 2**30, 1), "platform": platform.platform(),
        "python": platform.python_version(), "packer": __version__,
        "versions": {name: _version(name) for name in VERSIONED},
        "start_method": mp.get_context().get_start_method(),
    }
    if work is not None:
        info["work_filesystem"] = filesystem_type(work)
    if src is not None:
        info["src_filesystem"] = filesystem_type(src)
    return info


def describe_machine(m: dict[str, Any]) -> str:
    v = m["versions"]
    return (f"{m['usable_cores']} usable cores ({m['cpu_model']}), {m['memory_gib']} GiB, Python {m['python']}, "
            f"torch {v['torch']}, Pillow {v['pillow']}, simplejpeg {v['simplejpeg']}, h5py {v['h5py']}, "
            f"lmdb {v['lmdb']}, webdataset {v['webdataset']}, start method {m['start_method']}, work folder on "
            f"{m.get('work_filesystem', '?')}")


# -- the page cache ---------------------------------------------------------------------------------------------
class _Libc:
    """libc's mmap/munmap/mincore through ctypes: Python's mmap cannot give mincore a read-only map's address."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


_LIBC: _Libc | None = None
PROT_READ, MAP_SHARED = 1, 1
MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> _Libc | None:
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            _LIBC = _Libc()
    return _LIBC


def resident_bytes(path: str | os.PathLike) -> tuple[int, int] | None:
    """(bytes of ``path`` in the page cache, file size), or None where mincore cannot tell.

    Linux reports page-cache residency of a file's pages only to a process that owns or may write the file;
    for others it would say "not resident" for everything, so they get None."""
    libc = _libc()
    size = os.path.getsize(path)
    if libc is None:
        return None
    if size == 0:
        return 0, 0
    if os.stat(path).st_uid != os.geteuid() and not os.access(path, os.W_OK):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            return None
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            resident = int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * page, size), size


def resident_fraction(paths: Iterable[str | os.PathLike]) -> float | None:
    """The fraction of the files' bytes in the page cache (None where unknown)."""
    resident = total = 0
    for path in paths:
        r = resident_bytes(path)
        if r is None:
            return None
        resident, total = resident + r[0], total + r[1]
    return resident / total if total else 0.0


def evict(paths: Iterable[str | os.PathLike]) -> bool:
    """Drop the files from the page cache: fsync (dirty pages cannot be dropped), then POSIX_FADV_DONTNEED.
    Pages mapped by any process stay, so nothing may have them mapped. False where fadvise is missing."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):  # some filesystems refuse fsync on a read-only handle
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def prewarm(paths: Iterable[str | os.PathLike]) -> None:
    """Read every file once so that it is in the page cache."""
    buf = bytearray(BLOCK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def dataset_files(root: str | os.PathLike) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def _release_handles() -> None:
    """Unmap this process's datasets so that an eviction can take: drop unreferenced datasets (their maps and
    loader threads), then close the LMDB environments packer keeps per process and path. Only call this with no
    loader running: closing a map under a reading thread crashes. The datasets reopen lazily; mincore then says
    whether anything was left mapped."""
    gc.collect()
    from .formats.lmdb import close_environments

    close_environments()


# -- the limits ---------------------------------------------------------------------------------------------------
def memory_bandwidth(megabytes: int = 256, repeats: int = 3) -> float:
    """Bytes per second ``np.copyto`` copies between two large arrays (best of ``repeats``), one core."""
    n = megabytes << 20
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault in both arrays before timing
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return n / best


def disk_read_speed(folder: str | os.PathLike, megabytes: int = 384) -> dict[str, Any]:
    """Sequential read speed of the disk under ``folder``: write a file, evict it, read it back in big blocks."""
    path = Path(folder) / "disk-speed-test.bin"
    block = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()  # incompressible
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, (megabytes << 20) // BLOCK)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        evicted = evict([path])
        resident = resident_fraction([path])
        buf = bytearray(BLOCK)
        total = 0
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
        seconds = time.perf_counter() - t
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    ok = evicted and resident is not None and resident < EVICTED_BELOW
    return {"mb_per_s": total / seconds / 1e6, "file_mb": total / 1e6, "eviction_ok": ok,
            "resident_before": resident}


_POOL: dict[str, Any] = {}


def _pool_init(state: dict[str, Any]) -> None:
    _POOL.clear()
    _POOL.update(state)
    _POOL["out"] = None


def _decode_one(payload: Any, state: dict[str, Any]) -> None:
    """What a reader does to one stored sample: decode, resize/crop, copy into the batch."""
    if isinstance(payload, np.ndarray):
        arr = payload
    elif state["decoder"] == "pil":
        arr = as_hwc(open_image(bytes(payload), "<bench>").convert(state["mode"]))
    else:
        arr = decode(payload, state["mode"])
    if state["resize"] or state["crop"]:
        # the geometry the reader itself uses: exact for the pil decoder, the fused resize+crop otherwise
        img = to_pil(arr)
        if state["decoder"] == "pil":
            img = apply_geometry(img, state["resize"], None, state["crop"], state["interpolation"])
        else:
            img = resize_crop(img, state["resize"], state["crop"], state["interpolation"])
        arr = as_hwc(img)
    if state["out"] is None or state["out"].shape != arr.shape:
        state["out"] = np.empty_like(arr)
    state["out"][...] = arr


def _decode_range(bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    for payload in _POOL["payloads"][lo:hi]:
        _decode_one(payload, _POOL)
    return hi - lo


def _started(_: int) -> int:
    return os.getpid()


def decode_ceiling(payloads: Sequence[Any], *, decoder: str = "auto", mode: str = "RGB", resize: Size = None,
                   crop: tuple[int, int] | None = None, interpolation: str = "bilinear",
                   processes: int | None = None, min_seconds: float = 0.4, rounds: int = 3) -> float:
    """Samples per second ``processes`` processes decode (and resize/crop) ``payloads``, with no loader: the
    most any loader on these cores can give for these stored bytes. The best of ``rounds`` rounds of at least
    ``min_seconds``, since other load on the machine can only lower it."""
    processes = processes or usable_cores()
    state = {"payloads": list(payloads), "decoder": decoder, "mode": mode, "resize": resize, "crop": crop,
             "interpolation": interpolation}
    n = len(state["payloads"])
    per = max(1, math.ceil(n / (processes * 4)))  # several chunks per process to balance uneven images
    chunks = [(a, min(n, a + per)) for a in range(0, n, per)]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(processes, initializer=_pool_init, initargs=(state,)) as pool:
        pool.map(_started, range(processes))
        best = 0.0
        for _ in range(rounds):
            done, t = 0, time.perf_counter()
            for _ in range(100):  # repeat small sets until the timing is long enough to trust
                done += sum(pool.imap_unordered(_decode_range, chunks))
                if time.perf_counter() - t >= min_seconds:
                    break
            best = max(best, done / (time.perf_counter() - t))
    return best


def _collect_payloads(ds: Any, limit_bytes: int = PAYLOAD_LIMIT) -> list[Any]:
    """The stored payloads of ``ds`` (bytes, or arrays for raw), up to ``limit_bytes``."""
    out: list[Any] = []
    total = 0
    for i in range(len(ds)):
        payload, _ = ds.raw_sample(i)
        out.append(payload)
        total += payload.nbytes if isinstance(payload, np.ndarray) else len(payload)
        if total >= limit_bytes:
            break
    return out


# -- what is measured -----------------------------------------------------------------------------------------------
def _size_text(size: Size) -> str:
    return f"{size[0]}x{size[1]}" if isinstance(size, tuple) else str(size)


@dataclass(frozen=True)
class Variant:
    """One way of packing: a storage mode with its offline resize and centre crop."""

    store: str
    resize: Size = None
    center_crop: Size = None

    @property
    def label(self) -> str:
        if not (self.resize or self.center_crop):
            return self.store
        return f"{self.store} {_size_text(self.resize) if self.resize else '-'}" + (
            f"/{_size_text(self.center_crop)}" if self.center_crop else "")

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "-").replace("/", "-")


def parse_variant(text: str, resize: Size = None, center_crop: Size = None) -> Variant:
    """``jpeg`` (with the default ``resize``/``center_crop``), ``original``, or ``STORE:RESIZE[/CROP]`` such as
    ``jpeg:256`` (resized, cropped at read time) or ``raw:256/224``; ``jpeg:/224`` crops only."""
    store, _, geometry = text.strip().partition(":")
    if store not in STORES:
        raise ValueError(f"unknown store {store!r} in {text!r}; choose from {', '.join(STORES)}")
    if geometry:
        r, _, c = geometry.partition("/")
        resize, center_crop = parse_size(r) if r else None, parse_size(c) if c else None
    if store == "original":
        if geometry and (resize or center_crop):
            raise ValueError(f"{text!r}: store original keeps the file's bytes, so it cannot resize or crop")
        return Variant("original")
    return Variant(store, resize, center_crop)


def _pair(size: Size) -> tuple[int, int] | None:
    return (size, size) if isinstance(size, int) else size


def read_geometry(manifest: dict[str, Any], read_resize: Size, read_crop: Size) -> tuple[Size, Size]:
    """The read-time (resize, center_crop) that bring a packed dataset's images to the benchmark's output size:
    none when it is stored at that size, only the crop when it was stored resized to ``read_resize``."""
    crop = _pair(read_crop)
    shape = manifest.get("shape")
    if shape and crop and (shape[0], shape[1]) == (crop[1], crop[0]):
        return None, None
    t = manifest.get("transform", {})
    stored_resize = tuple(t["resize"]) if isinstance(t.get("resize"), list) else t.get("resize")
    if read_resize and stored_resize == read_resize and not t.get("center_crop") and not t.get("max_size"):
        return None, read_crop
    return read_resize, read_crop


@dataclass
class Target:
    """A dataset under test: a packed one or the folder baseline."""

    dataset: str  # lmdb, hdf5, wds or folder
    store: str  # the variant's label, or "files" for the folder
    store_mode: str
    root: Path
    count: int
    bytes_on_disk: int
    read_resize: Size
    read_crop: Size
    decoder: str = "auto"
    pack_resize: Size = None
    pack_crop: Size = None
    conversion: dict[str, Any] | None = None
    files: list[Path] = field(default_factory=list)
    pipeline: str = "val"  # or "train": read_crop is then the random resized crop's size (bench_train)

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes_on_disk / max(1, self.count)

    def open(self) -> Any:
        if self.pipeline == "train":
            return open_train(self.dataset, self.root, train_size(self.read_resize, self.read_crop))
        if self.dataset == "folder":
            from .folder import FolderDataset

            return FolderDataset(self.root, decoder="pil", resize=self.read_resize, center_crop=self.read_crop)
        from .dataset import open_dataset

        return open_dataset(self.root, resize=self.read_resize, center_crop=self.read_crop)


def folder_target(src: Path, read_resize: Size, read_crop: Size) -> Target:
    from .folder import FolderDataset

    ds = FolderDataset(src)
    files = [src / ds.relpath(i) for i in range(len(ds))]
    size = sum(p.stat().st_size for p in files)
    return Target("folder", "files", "files", src, len(ds), size, read_resize, read_crop, decoder="pil",
                  files=files)


def packed_target(dest: Path, read_resize: Size, read_crop: Size, conversion: dict | None = None) -> Target:
    from .manifest import read_manifest

    manifest = read_manifest(dest)
    t = manifest["transform"]
    resize = tuple(t["resize"]) if isinstance(t.get("resize"), list) else t.get("resize")
    crop = tuple(t["center_crop"]) if isinstance(t.get("center_crop"), list) else t.get("center_crop")
    crop = crop[0] if isinstance(crop, tuple) and crop[0] == crop[1] else crop
    variant = Variant(manifest["store"], resize, crop)
    if t.get("normalize"):
        raise PackerError(f"{dest}: stores normalized floats; the benchmark compares uint8 images, so pack it "
                          "without --normalize")
    r, c = read_geometry(manifest, read_resize, read_crop)
    size = sum(f["bytes"] for f in manifest["files"])
    return Target(manifest["format"], variant.label, variant.store, dest, int(manifest["count"]), size, r, c,
                  pack_resize=resize, pack_crop=crop, conversion=conversion, files=dataset_files(dest))


def pack_target(src: Path, work: Path, fmt: str, variant: Variant, source_bytes: int, read_resize: Size,
                read_crop: Size, progress: bool) -> Target:
    from .convert import pack

    dest = work / f"{fmt}-{variant.slug}"
    t = time.perf_counter()
    manifest = pack(src, dest, fmt, store=variant.store, resize=variant.resize, center_crop=variant.center_crop,
                    overwrite=True, progress=progress)
    seconds = time.perf_counter() - t
    size = sum(f["bytes"] for f in manifest["files"])
    conversion = {"dataset": fmt, "store": variant.label, "images": manifest["count"], "seconds": seconds,
                  "images_per_s": manifest["count"] / seconds, "bytes_on_disk": size,
                  "source_bytes": source_bytes, "size_vs_source": size / source_bytes if source_bytes else None}
    return packed_target(dest, read_resize, read_crop, conversion)


# -- reading through the loader -------------------------------------------------------------------------------------
@dataclass
class EpochStats:
    samples: int = 0  # samples in the measured window
    seconds: float = 0.0  # the measured window: waiting for batches plus the simulated steps
    wait: float = 0.0  # time the main loop waited for batches in the window
    decoded_bytes: int = 0
    first_batch_s: float = 0.0
    batches: int = 0
    skipped_batches: int = 0


def make_bench_loader(ds: Any, batch_size: int, workers: int, prefetch_factor: int | None = None,
                      seed: int = 0, **overrides: Any) -> Any:
    """``make_loader`` with every setting given: ``workers`` processes, or with 0 packer's in-process loader
    (decode threads and a background thread ``prefetch_factor`` batches ahead)."""
    from .loader import make_loader

    kwargs: dict[str, Any] = {"num_workers": workers, **overrides}
    if workers > 0 and prefetch_factor:
        kwargs["prefetch_factor"] = prefetch_factor
    # Every setting is given explicitly, so a loader.json beside the dataset does not apply (tuned=False).
    return make_loader(ds, batch_size=batch_size, shuffle=True, seed=seed, tuned=False,
                       prefetch_batches=prefetch_factor if workers == 0 and prefetch_factor else None, **kwargs)


def _check_signature(signature: tuple, expected: tuple | None, where: str) -> tuple:
    """Every dataset must give what the folder gives: (C, H, W, dtype)."""
    if expected is not None and signature != expected:
        raise PackerError(f"{where}: gives images of {signature}, the folder gives {expected}; pass --read-resize "
                          "and --read-crop that make every dataset's output the same shape")
    return signature


def _signature(images: Any) -> tuple:
    return (*(int(x) for x in images.shape[1:]), str(images.dtype).replace("torch.", ""))


def run_epochs(loader: Any, epochs: int, step_s: float = 0.0, skip: int = WARMUP_BATCHES,
               expected: tuple | None = None, where: str = "", bar: tqdm | None = None) -> list[EpochStats]:
    """Iterate ``epochs`` epochs of ``loader``, sleeping ``step_s`` per batch as a training step would.

    Epoch 1 leaves its first ``skip`` batches out of the rate, at most half of them so that short epochs still
    measure something; every epoch records the time from ``iter(loader)`` to its first batch."""
    results = []
    for epoch in range(epochs):
        stats = EpochStats()
        drop = min(skip, len(loader) // 2) if epoch == 0 else 0
        stats.skipped_batches = drop
        t = time.perf_counter()
        it = iter(loader)
        for i in itertools.count():
            if i > 0:
                t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            got = time.perf_counter()
            images = batch[0]
            if i == 0:
                stats.first_batch_s = got - t
                expected = _check_signature(_signature(images), expected, where)
            if step_s:
                time.sleep(step_s)
            stats.batches += 1
            if i >= drop:
                stats.samples += len(images)
                stats.decoded_bytes += images.numel() * images.element_size()
                stats.wait += got - t
                stats.seconds += time.perf_counter() - t
            if bar is not None:
                bar.update(len(images))
        results.append(stats)
    return results


def _run_once(target: Target, workers: int, cache: str, settings: dict[str, Any], repeat: int,
              expected: tuple | None, bar: tqdm | None) -> dict[str, Any]:
    """One fresh loader (workers not shared with any other run) over ``epochs`` epochs, after warming or
    evicting the page cache."""
    ds = target.open()
    if cache == "cold":
        _release_handles()
        evict(target.files)
    else:
        prewarm(target.files)
    resident = resident_fraction(target.files)
    loader = make_bench_loader(ds, settings["batch_size"], workers, settings["prefetch_factor"], seed=repeat)
    threads = loader.threads
    epochs = run_epochs(loader, settings["epochs"], settings["step_ms"] / 1000, expected=expected,
                        where=f"{target.dataset} {target.store}", bar=bar)
    # Every epoch ran to its end, so nothing reads any more: shut the workers down and unmap before the next
    # eviction. (Not on an error: a loader's threads may still be reading then.)
    del loader, ds
    _release_handles()
    return {"resident_before": resident, "epochs": epochs, "threads": threads}


def _row(target: Target, workers: int, cache: str, epoch: int, runs: list[dict], settings: dict,
         output_bytes: int) -> dict[str, Any]:
    stats: list[EpochStats] = [r["epochs"][epoch] for r in runs]
    rates = [s.samples / s.seconds if s.seconds else 0.0 for s in stats]
    rate = statistics.median(rates)
    resident = [r["resident_before"] for r in runs]
    resident_known = None if any(x is None for x in resident) else statistics.median(resident)
    row = {
        "dataset": target.dataset, "store": target.store, "store_mode": target.store_mode,
        "pipeline": target.pipeline,
        "pack_resize": target.pack_resize, "pack_crop": target.pack_crop,
        "read_resize": target.read_resize, "read_crop": target.read_crop, "decoder": target.decoder,
        "workers": workers, "threads": runs[0]["threads"], "batch_size": settings["batch_size"], "epoch": epoch + 1,
        "cache": cache,
        "samples": stats[0].samples, "skipped_batches": stats[0].skipped_batches,
        "samples_per_s": rate, "samples_per_s_runs": rates,
        "mb_per_s_read": rate * target.bytes_per_sample / 1e6,
        "mb_per_s_decoded": rate * output_bytes / 1e6,
        "first_batch_s": statistics.median(s.first_batch_s for s in stats),
        "bytes_per_sample_read": target.bytes_per_sample, "bytes_per_sample_decoded": output_bytes,
        "resident_before": resident_known,
        "eviction_ok": (resident_known is not None and resident_known < EVICTED_BELOW) if cache == "cold" else None,
        "data_stall": (statistics.median(s.wait / s.seconds for s in stats if s.seconds)
                       if settings["step_ms"] else None),
        "repeats": len(runs),
    }
    return row


def measure(target: Target, settings: dict[str, Any], expected: tuple | None, bar: tqdm | None) -> list[dict]:
    """Every (workers, cache, epoch) row of one target, each the median of ``repeats`` runs."""
    rows = []
    output_bytes = int(np.prod(expected[:3])) if expected else 0
    for cache in settings["caches"]:
        for workers in settings["workers"]:
            runs = [_run_once(target, workers, cache, settings, r, expected, bar) for r in range(settings["repeats"])]
            rows += [_row(target, workers, cache, e, runs, settings, output_bytes) for e in range(settings["epochs"])]
    return rows


def output_signature(target: Target) -> tuple:
    """(C, H, W, dtype) of the batches ``target`` gives, from one batch read without a loader."""
    ds = target.open()
    batch = ds.__getitems__(list(range(min(len(ds), 2))))
    images = getattr(batch, "images", None)
    del ds, batch
    _release_handles()
    if images is None:
        raise PackerError(f"{target.root}: its images do not all have one size; pass --read-crop so the benchmark "
                          "compares fixed-size batches")
    return _signature(images)


# -- ceilings, speedups ------------------------------------------------------------------------------------------------
def measure_limits(targets: list[Target], work: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Memory-copy bandwidth, disk read speed and one decode ceiling per store variant (and the folder)."""
    limits: dict[str, Any] = {"processes": usable_cores(), "decode": {}}
    limits["memory_copy_gb_per_s"] = memory_bandwidth() / 1e9
    disk = disk_read_speed(work, settings["disk_test_mb"]) if settings["disk_test_mb"] else None
    limits["disk"] = disk
    for target in targets:
        key = _ceiling_key(target)
        if key in limits["decode"] or target.pipeline != "val":  # no ceiling model for the train pipeline yet
            continue
        if target.store_mode == "raw" and not (target.read_resize or target.read_crop):
            limits["decode"][key] = {"kind": "memcpy", "samples_per_s": None}
            continue
        ds = target.open()
        payloads = _collect_payloads(ds)
        mode = ds.spec.mode
        del ds
        _release_handles()
        rate = decode_ceiling(payloads, decoder=target.decoder, mode=mode, resize=target.read_resize,
                              crop=_pair(target.read_crop), processes=limits["processes"])
        kind = "resize" if target.store_mode == "raw" else "decode"
        limits["decode"][key] = {"kind": kind, "samples_per_s": rate, "payloads": len(payloads)}
    return limits


def _ceiling_key(target: Target) -> str:
    return f"{target.store}|{target.decoder}|{target.read_resize}|{target.read_crop}"


def add_ceilings(rows: list[dict], targets: list[Target], limits: dict[str, Any]) -> None:
    """Give each row its ceiling (the lowest bound that applies) and its fraction of it."""
    keys = {(t.dataset, t.store, t.pipeline): _ceiling_key(t) for t in targets}
    copy_bw = limits.get("memory_copy_gb_per_s", 0) * 1e9
    disk = limits.get("disk") or {}
    for row in rows:
        entry = limits.get("decode", {}).get(keys[(row["dataset"], row["store"], row["pipeline"])], {})
        entry = entry if row["pipeline"] == "val" else {}
        kind, cpu = entry.get("kind"), entry.get("samples_per_s")
        if kind == "memcpy" and copy_bw and row["bytes_per_sample_decoded"]:
            cpu = copy_bw / row["bytes_per_sample_decoded"]
        candidates = {kind: cpu} if cpu else {}
        disk_rate = None
        if row["cache"] == "cold" and disk.get("mb_per_s") and row["bytes_per_sample_read"]:
            disk_rate = disk["mb_per_s"] * 1e6 / row["bytes_per_sample_read"]
            candidates["disk"] = disk_rate
        row["cpu_ceiling_samples_per_s"] = cpu
        row["disk_ceiling_samples_per_s"] = disk_rate
        if candidates:
            row["ceiling_kind"] = min(candidates, key=candidates.get)
            row["ceiling_samples_per_s"] = candidates[row["ceiling_kind"]]
            row["fraction_of_ceiling"] = row["samples_per_s"] / row["ceiling_samples_per_s"]
        else:
            row["ceiling_kind"] = row["ceiling_samples_per_s"] = row["fraction_of_ceiling"] = None


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_folder: the row's rate over the folder's with the same workers, epoch and cache."""
    folder = {(r["pipeline"], r["workers"], r["epoch"], r["cache"]): r["samples_per_s"] for r in rows
              if r["dataset"] == "folder"}
    for row in rows:
        base = folder.get((row["pipeline"], row["workers"], row["epoch"], row["cache"]))
        row["speedup_vs_folder"] = row["samples_per_s"] / base if base else None


# -- output ---------------------------------------------------------------------------------------------------------
COLUMNS = [("dataset", "dataset", "{}"), ("store", "store", "{}"), ("pipeline", "pipeline", "{}"),
           ("workers", "workers", "{}"),
           ("threads", "threads", "{}"),
           ("cache", "cache", "{}"), ("epoch", "epoch", "{}"), ("samples_per_s", "samples/s", "{:.0f}"),
           ("mb_per_s_read", "MB/s read", "{:.1f}"), ("mb_per_s_decoded", "MB/s out", "{:.1f}"),
           ("first_batch_s", "1st batch s", "{:.2f}"), ("speedup_vs_folder", "vs folder", "{:.2f}x"),
           ("ceiling_samples_per_s", "ceiling/s", "{:.0f}"), ("ceiling_kind", "bound", "{}"),
           ("fraction_of_ceiling", "of ceiling", "{:.0%}"), ("data_stall", "stall", "{:.0%}"),
           ("eviction_ok", "evicted", "{}")]


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return fmt.format(value)


def _columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    """Drop columns with nothing in them (stall without --step-ms, evicted without cold runs)."""
    return [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]


def format_table(rows: list[dict]) -> str:
    cols = _columns(rows)
    cells = [[title for _, title, _ in cols]] + [[_cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    cols = _columns(rows)
    lines = ["| " + " | ".join(title for _, title, _ in cols) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|"]
    lines += ["| " + " | ".join(_cell(r, k, f) for k, _, f in cols) + " |" for r in rows]
    return "\n".join(lines)


def limits_lines(results: dict[str, Any]) -> list[str]:
    limits = results.get("limits") or {}
    if not limits:
        return ["limits not measured (--no-limits)"]
    lines = [f"memory copy: {limits['memory_copy_gb_per_s']:.1f} GB/s (np.copyto, one core)"]
    disk = limits.get("disk")
    if disk:
        evicted = "" if disk["eviction_ok"] else " (NOT evicted: the disk figure is the page cache's)"
        lines.append(f"disk sequential read: {disk['mb_per_s']:.0f} MB/s over {disk['file_mb']:.0f} MB{evicted}")
    for key, entry in limits.get("decode", {}).items():
        if entry.get("samples_per_s"):
            store, decoder, _, _ = key.split("|")
            lines.append(f"{entry['kind']} ceiling, {store} ({decoder} decoder): {entry['samples_per_s']:.0f} "
                         f"samples/s with {limits['processes']} processes")
    return lines


def conversion_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for c in results.get("conversions", []):
        ratio = f", {c['size_vs_source']:.2f}x the source's {c['source_bytes'] / 1e6:.1f} MB" if c.get(
            "size_vs_source") else ""
        seconds = f"{c['seconds']:.1f} s, {c['images_per_s']:.0f} images/s, " if c.get("seconds") else ""
        lines.append(f"{c['dataset']} {c['store']}: {c['images']} images, {seconds}"
                     f"{c['bytes_on_disk'] / 1e6:.1f} MB on disk{ratio}")
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    parts = ["# packer bench results", "", f"Command: `{results['command']}`", "",
             f"Machine: {describe_machine(results['machine'])}", "", markdown_table(results["rows"]), "",
             "## Limits measured in the same run", ""]
    parts += [f"- {line}" for line in limits_lines(results)]
    if results.get("conversions"):
        parts += ["", "## Conversion", ""] + [f"- {line}" for line in conversion_lines(results)]
    parts += ["", "## Notes", ""] + [f"- {note}" for note in results.get("notes", [])]
    return "\n".join(parts) + "\n"


def plot(results: dict[str, Any], path: str | os.PathLike) -> bool:
    """A bar chart of samples/s per dataset and store (most workers; last epoch warm, epoch 1 cold, as epoch 2 of
    a cold run is mostly warm), one panel per cache, with the folder baseline as a dashed line and each bar's
    ceiling as a black tick. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("matplotlib is not installed, so no chart was drawn; pip install 'packer[bench]'")
        return False
    rows = results["rows"]
    workers = max(r["workers"] for r in rows)
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    bars = len({(r["dataset"], r["store"]) for r in rows}) - 1
    fig, axes = plt.subplots(len(caches), 1, figsize=(max(7.0, 0.9 * bars + 2), 4.2 * len(caches)), squeeze=False)
    for ax, cache in zip(axes[:, 0], caches, strict=True):
        epoch = 1 if cache == "cold" else max(r["epoch"] for r in rows)
        chosen = [r for r in rows if r["cache"] == cache and r["workers"] == workers and r["epoch"] == epoch]
        packed = [r for r in chosen if r["dataset"] != "folder"]
        x = np.arange(len(packed))
        ax.bar(x, [r["samples_per_s"] for r in packed], color="tab:blue")
        for i, r in enumerate(packed):
            if r.get("ceiling_samples_per_s"):
                ax.plot([i - 0.4, i + 0.4], [r["ceiling_samples_per_s"]] * 2, color="black", lw=2)
        for r in chosen:
            if r["dataset"] == "folder":
                ax.axhline(r["samples_per_s"], color="tab:red", ls="--",
                           label=f"folder {r['pipeline']} {r['samples_per_s']:.0f}/s")
        ax.set_xticks(x, [f"{r['dataset']}\n{r['store']}\n{r['pipeline']}" for r in packed], fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{cache} cache, {workers} workers, epoch {epoch}")
        ax.set_ylabel("samples/s (black tick: ceiling)")
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(results: dict[str, Any], out: str | os.PathLike) -> dict[str, str]:
    """results.json, results.md, results.txt (the table) and bench.png in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "txt": out / "results.txt",
             "png": out / "bench.png"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths["md"].write_text(render_markdown(results))
    paths["txt"].write_text(render_text(results))
    if not plot(results, paths["png"]):
        del paths["png"]
    return {k: str(v) for k, v in paths.items()}


def render_text(results: dict[str, Any]) -> str:
    parts = [f"machine: {describe_machine(results['machine'])}", "", format_table(results["rows"]), ""]
    parts += limits_lines(results)
    parts += conversion_lines(results)
    parts += results.get("notes", [])
    return "\n".join(parts) + "\n"


# -- the API ------------------------------------------------------------------------------------------------------
def split_names(text: str) -> list[str]:
    """``"lmdb,hdf5"`` -> ["lmdb", "hdf5"]."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError(f"{text!r} is not a comma-separated list")
    return names


def split_ints(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]."""
    try:
        values = [int(x) for x in split_names(text)]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if any(v < 0 for v in values):
        raise ValueError(f"{text!r}: numbers must not be negative")
    return values


def optional_size(text: str | None) -> Size:
    """A size option where ``none`` (or 0) means no resize/crop."""
    if text is None or str(text).strip().lower() in ("", "none", "0"):
        return None
    return parse_size(text)


def default_workers() -> list[int]:
    """0 (the main process), 1, half and all of the usable cores: 0,1,2 on two cores."""
    cores = usable_cores()
    return sorted({0, 1, cores // 2, cores})


def _notes(settings: dict[str, Any], rows: list[dict], machine: dict[str, Any], count: int) -> list[str]:
    notes = [f"epoch 1 rates leave out its first {WARMUP_BATCHES} batches (worker start-up); first_batch_s is "
             "the time from iter(loader) to the first batch",
             "workers 0 is make_loader's in-process loader: `threads` decode threads in the main process and a "
             "background thread prefetching; workers N are N DataLoader processes of one decode thread each",
             "ceilings use every usable core"]
    if "cold" in settings["caches"] and settings["epochs"] > 1:
        notes.append("cold epoch 2 reads what epoch 1 left in the page cache: it shows re-reading, not a cold disk")
    batches = math.ceil(count / settings["batch_size"])
    if batches < 20:
        notes.append(f"only {batches} batches per epoch: rates this short are noisy, and epoch 1 overstates "
                     "parallel loaders (their first batches are decoded side by side before the clock starts); use "
                     "a larger SRC (scripts/make_sample_data.py) or --repeats for figures to rely on")
    if any(r["eviction_ok"] is False for r in rows):
        notes.append(f"eviction did NOT take on some cold runs (the work folder is on "
                     f"{machine.get('work_filesystem')}; tmpfs and some overlays keep pages): those rows are warm")
    if settings["step_ms"]:
        notes.append(f"each batch is consumed by a simulated {settings['step_ms']} ms training step; data_stall is "
                     "the fraction of time the step waited for data")
    return notes


def run_bench(src: str | os.PathLike, *, formats: Sequence[str] = ("lmdb", "hdf5", "wds"),
              stores: Sequence[str | Variant] = ("original", "jpeg", "raw"), resize: Size = 256,
              center_crop: Size = 224, batch_size: int = 64, workers: Sequence[int] | None = None, epochs: int = 2,
              caches: Sequence[str] = ("warm", "cold"), step_ms: float = 0.0,
              out: str | os.PathLike | None = DEFAULT_OUT, keep: bool = False,
              packed: Sequence[str | os.PathLike] = (), repeats: int = 1, read_resize: Size = 256,
              read_crop: Size = 224, work: str | os.PathLike | None = None, limits: bool = True,
              disk_test_mb: int = 384, prefetch_factor: int = 4, progress: bool = True,
              command: str | None = None, pipelines: Sequence[str] = PIPELINES) -> dict[str, Any]:
    """Pack ``src`` into every format x store (or use ``packed``), read each and the folder through
    :func:`packer.make_loader`, and return (and write to ``out``, when given) every figure. See the module
    docstring for what is measured; ``stores`` entries are parsed by :func:`parse_variant`."""
    src = Path(src)
    read_resize, read_crop = parse_size(read_resize), parse_size(read_crop)
    if not read_crop and not isinstance(read_resize, tuple):
        raise ValueError("the benchmark needs a fixed output size: give read_crop (or read_resize as WxH)")
    bad = [c for c in caches if c not in ("warm", "cold")]
    if bad or epochs < 1 or repeats < 1 or batch_size < 1:
        raise ValueError("caches are warm and/or cold; epochs, repeats and batch_size are at least 1")
    variants = [s if isinstance(s, Variant) else parse_variant(s, parse_size(resize), parse_size(center_crop))
                for s in stores]
    pipelines = parse_pipelines(list(pipelines))
    if not src.is_dir():
        raise PackerError(f"{src}: no such folder; give the image folder to benchmark")
    settings = {"formats": list(formats), "stores": [v.label for v in variants], "batch_size": batch_size,
                "workers": list(workers) if workers is not None else default_workers(), "epochs": epochs,
                "caches": list(caches), "step_ms": step_ms, "repeats": repeats, "read_resize": read_resize,
                "read_crop": read_crop, "prefetch_factor": prefetch_factor, "disk_test_mb": disk_test_mb,
                "packed": [str(p) for p in packed], "pipelines": pipelines}
    work_parent = Path(work) if work else Path(out) if out else Path(tempfile.gettempdir())
    work_parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="packer-bench-", dir=work_parent))
    try:
        results = _bench(src, work_dir, variants, settings, packed, limits, progress)
        results["command"] = command or f"run_bench({str(src)!r}, ...)"
        results["work"] = str(work_dir) if keep else None
        if out is not None:
            results["outputs"] = write_outputs(results, out)
        return results
    finally:
        if not keep:
            shutil.rmtree(work_dir, ignore_errors=True)


def _bench(src: Path, work: Path, variants: list[Variant], settings: dict, packed: Sequence,
           limits: bool, progress: bool) -> dict[str, Any]:
    machine = machine_info(work, src)
    folder = folder_target(src, settings["read_resize"], settings["read_crop"])
    if packed:
        targets = [packed_target(Path(p), settings["read_resize"], settings["read_crop"]) for p in packed]
        conversions = [_existing_conversion(t, folder.bytes_on_disk) for t in targets]
    else:
        targets = [pack_target(src, work, fmt, v, folder.bytes_on_disk, settings["read_resize"],
                               settings["read_crop"], progress) for v in variants for fmt in settings["formats"]]
        conversions = [t.conversion for t in targets]
    expected = output_signature(folder)
    for target in targets:
        _check_signature(output_signature(target), expected, str(target.root))
    # the train pipeline crops every dataset to the output size from its full stored image
    train = {"read_resize": settings["read_resize"], "read_crop": settings["read_crop"]}
    everything = [replace(t, pipeline=p, **(train if p == "train" else {}))
                  for p in settings["pipelines"] for t in [folder, *targets]]
    limit_info = measure_limits(everything, work, settings) if limits else {}
    per_sample = len(settings["workers"]) * len(settings["caches"]) * settings["repeats"] * settings["epochs"]
    bar = tqdm(total=sum(t.count for t in everything) * per_sample, unit="img", desc="reading",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    rows: list[dict] = []
    try:
        for target in everything:
            bar.set_postfix_str(f"{target.dataset} {target.store}")
            rows += measure(target, settings, expected, bar)
    finally:
        bar.close()
    add_speedups(rows)
    if limit_info:
        add_ceilings(rows, everything, limit_info)
    return {"packer_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine, "settings": settings, "source": {"root": str(src.resolve()), "images": folder.count,
                                                                 "bytes": folder.bytes_on_disk},
            "output": {"shape": list(expected[:3]), "dtype": expected[3]}, "limits": limit_info,
            "conversions": conversions, "rows": rows, "notes": _notes(settings, rows, machine, folder.count)}


def _existing_conversion(target: Target, source_bytes: int) -> dict[str, Any]:
    from .manifest import read_manifest

    manifest = read_manifest(target.root)
    seconds = manifest.get("conversion_seconds")
    return {"dataset": target.dataset, "store": target.store, "images": target.count, "seconds": seconds,
            "images_per_s": target.count / seconds if seconds else None, "bytes_on_disk": target.bytes_on_disk,
            "source_bytes": source_bytes, "size_vs_source": target.bytes_on_disk / source_bytes if source_bytes
            else None}


# -- tuning -------------------------------------------------------------------------------------------------------
def tune_workers() -> list[int]:
    """0, 1, 2, 4, ... up to the usable cores, and the usable cores themselves."""
    cores = usable_cores()
    counts = {0, cores}
    n = 1
    while n < cores:
        counts.add(n)
        n *= 2
    return sorted(counts)


def _tune_one(target: Target, workers: int, batch_size: int, prefetch: int, samples: int,
              max_seconds: float) -> dict[str, Any]:
    """Read at least ``samples`` samples after the warm-up batches, or for about ``max_seconds``. Each epoch is
    cut short by its sampler, never by leaving the loop: a loader left mid-epoch still has threads reading."""
    import torch

    ds = target.open()
    epoch = min(len(ds), samples + WARMUP_BATCHES * batch_size)
    sampler = torch.utils.data.RandomSampler(ds, num_samples=epoch, generator=torch.Generator().manual_seed(0))
    loader = make_bench_loader(ds, batch_size, workers, prefetch, sampler=sampler)
    threads = loader.threads
    measured = seconds = 0.0
    first = batch = None
    seen = 0
    started = time.perf_counter()
    while measured < samples and time.perf_counter() - started < max_seconds:
        t = time.perf_counter()
        for batch in loader:
            got = time.perf_counter()
            first = got - started if first is None else first
            if seen >= WARMUP_BATCHES:
                measured += len(batch[0])
                seconds += got - t
            seen += 1
            t = time.perf_counter()
    del loader, ds, batch
    _release_handles()
    return {"num_workers": workers, "batch_size": batch_size, "prefetch_factor": prefetch, "threads": threads,
            "samples_per_s": measured / seconds if seconds else 0.0, "samples": int(measured),
            "first_batch_s": first}


def tune(dest: str | os.PathLike, *, workers: Sequence[int] | None = None,
         batch_sizes: Sequence[int] = (32, 64, 128), prefetch_factors: Sequence[int] = (2, 4),
         samples: int | None = None, max_seconds: float = 10.0, read_resize: Size = 256, read_crop: Size = 224,
         progress: bool = True) -> dict[str, Any]:
    """Sweep workers x batch size x prefetch factor on the packed dataset ``dest`` (warm cache, short runs) and
    write the fastest to ``dest/loader.json``; return what was written."""
    from .loader import TUNED
    from .manifest import write_json_atomic

    dest = Path(dest)
    target = packed_target(dest, parse_size(read_resize), parse_size(read_crop))
    samples = samples or min(target.count, 2000)
    workers = list(workers) if workers is not None else tune_workers()
    configs = list(itertools.product(workers, batch_sizes, prefetch_factors))
    prewarm(target.files)
    results = []
    for w, b, p in tqdm(configs, desc="tuning", unit="config", disable=not progress, file=sys.stderr):
        results.append(_tune_one(target, w, b, p, samples, max_seconds))
    best = max(results, key=lambda r: r["samples_per_s"])
    loader = {k: best[k] for k in ("num_workers", "batch_size", "prefetch_factor")}
    data = {"loader": loader,
            "measured": {"samples_per_s": best["samples_per_s"], "cache": "warm", "samples_per_config": samples,
                         "read_resize": target.read_resize, "read_crop": target.read_crop,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "machine": machine_info(dest), "results": results}}
    write_json_atomic(dest / TUNED, data)
    return data


def format_tune(data: dict[str, Any], dest: str | os.PathLike) -> str:
    rows = sorted(data["measured"]["results"], key=lambda r: -r["samples_per_s"])
    lines = [f"{'workers':>7}  {'threads':>7}  {'batch':>5}  {'prefetch':>8}  {'samples/s':>9}"]
    lines += [f"{r['num_workers']:>7}  {r['threads']:>7}  {r['batch_size']:>5}  {r['prefetch_factor']:>8}  "
              f"{r['samples_per_s']:>9.0f}" for r in rows]
    lines.append(f"best: {data['loader']} -> {Path(dest) / 'loader.json'} (make_loader uses it from now on)")
    return "\n".join(lines)

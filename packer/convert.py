"""``pack()``: convert an image folder (or a packed dataset, or WebDataset shards) into a packed dataset.

Worker processes read, decode, transform and encode images in fixed chunks; the main process writes them in
order, so the output (samples, order, labels, bytes) does not depend on the number of workers. At most a few
chunks per worker are in flight, so memory stays flat however large the dataset. What is read comes from a
:class:`packer.sources.Source`; under torchrun each rank converts one contiguous part (:mod:`packer.distributed`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from . import __version__
from .dest import JOURNAL, dataset_problems, empty_folder, is_regular_file, prepare_output
from .errors import DestinationError, ImageError, NothingPackedError, PackerError, warn
from .formats.base import get_format
from .manifest import FORMAT_VERSION, MANIFEST, read_manifest, write_json_atomic, write_manifest
from .remote.url import parse_url
from .sources import SampleReader, Source, open_source
from .system import usable_cores
from .transforms import DEFAULT_MAX_PIXELS, IMAGENET_MEAN, IMAGENET_STD, MAX_SIDE, TransformSpec, parse_size

CHUNK = 16
MARKER = JOURNAL


def _convert_items(reader: SampleReader, items: list[tuple[int, int]], spec: TransformSpec) -> list[tuple]:
    """Convert ``(position, source index)`` items; returns ``(position, relpath, label, Encoded or error)``."""
    out = []
    for position, index in items:
        try:
            relpath, label, encoded = reader.convert(index, spec)
            out.append((position, relpath, label, encoded))
        # errors travel as plain tuples: anything the pool cannot unpickle would hang it instead of failing
        except ImageError as exc:
            out.append((position, exc.path, -1, ("skip", exc.reason)))
        except Exception as exc:  # a bug, not a bad image: the conversion stops and names the file
            out.append((position, reader.name(index), -1, ("fail", f"{type(exc).__name__}: {exc}")))
    return out


_READER: SampleReader | None = None  # the source's reader, in each worker process


def _init_worker(reader: SampleReader) -> None:
    global _READER
    _ignore_sigint()
    _die_with_parent()
    _READER = reader  # given once per worker (inherited through fork): chunks then carry only indices


def _die_with_parent() -> None:
    """On Linux, a worker is killed when the converter dies. Without it, a worker left blocked on the pool's
    queue lock after an error outlives the converter (seen after a full disk, with Python 3.11's Pool) and keeps
    its stdout and stderr open, so whoever waits for the command's output waits forever."""
    if not sys.platform.startswith("linux"):
        return
    parent = mp.parent_process()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent.pid:  # the converter died before prctl
        os._exit(1)


def _convert_chunk(args: tuple[list[tuple[int, int]], TransformSpec]) -> list[tuple]:
    items, spec = args
    return _convert_items(_READER, items, spec)


def make_spec(store: str | None = None, resize: int | str | None = None, max_size: int | None = None,
              center_crop: int | str | None = None, interpolation: str = "bilinear", quality: int = 90,
              mode: str | None = "RGB", exif_transpose: bool = False, normalize: bool = False,
              mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
              dtype: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> TransformSpec:
    """Fill in the defaults: ``original`` unless pixels change, ``jpeg`` when resizing, ``raw`` to normalize;
    ImageNet's mean and std (their first value for mode L). Bad sizes and normalisation values are a
    ValueError naming the option."""
    crop = _size("--center-crop", center_crop)
    crop = (crop, crop) if isinstance(crop, int) else crop
    mode = mode or "RGB"
    channels = 1 if mode == "L" else 3
    mean = IMAGENET_MEAN[:channels] if mean is None else tuple(mean)
    std = IMAGENET_STD[:channels] if std is None else tuple(std)
    if normalize:
        for name, values in (("--mean", mean), ("--std", std)):
            if len(values) != channels:
                raise ValueError(f"{name}: {len(values)} values, but mode {mode} has {channels} channel"
                                 f"{'s' if channels > 1 else ''}; give one value per channel")
            if not all(math.isfinite(v) for v in values) or (name == "--std" and min(values) <= 0):
                raise ValueError(f"{name}: {','.join(map(str, values))} must be finite numbers"
                                 f"{' above 0' if name == '--std' else ''}")
    else:  # unused without normalize: recorded as the defaults, so that they change no manifest
        mean, std = IMAGENET_MEAN, IMAGENET_STD
    changes = bool(resize or max_size or crop or mode != "RGB" or exif_transpose)
    if store is None:
        store = "raw" if normalize else ("jpeg" if changes else "original")
    if dtype is None:
        dtype = "float16" if normalize else "uint8"
    for option, size in (("--resize", _size("--resize", resize)), ("--center-crop", crop)):
        if isinstance(size, tuple) and (size[0] * size[1] > max_pixels or max(size) > MAX_SIDE):
            raise ValueError(f"{option}: {size[0]}x{size[1]} is over the {max_pixels:,}-pixel limit (--max-pixels) "
                             f"or a side of {MAX_SIDE}")
    return TransformSpec(store=store, resize=_size("--resize", resize), max_size=max_size, center_crop=crop,
                         interpolation=interpolation, mode=mode, exif_transpose=exif_transpose, quality=quality,
                         normalize=normalize, mean=tuple(mean), std=tuple(std), dtype=dtype, max_pixels=max_pixels)


def _size(option: str, value: int | str | None) -> int | tuple[int, int] | None:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _prepare_dest(dest: Path, src: Path, overwrite: bool) -> None:
    src_r, dest_r = src.resolve(), dest.resolve()
    if dest_r == src_r or src_r.is_relative_to(dest_r):
        raise DestinationError(f"{dest}: the destination would contain the source; choose another folder")
    if dest_r.is_relative_to(src_r):
        raise DestinationError(f"{dest}: the destination is inside the source folder {src}, so packing would change "
                               "the source; choose a folder outside it")
    prepare_output(dest, overwrite, dataset_problems, "packer dataset")


def read_journal(dest: Path) -> dict | None:
    """The progress record of an unfinished conversion in ``dest``, or None."""
    path = dest / MARKER
    if not is_regular_file(path):
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
         interpolation: str = "bilinear", quality: int = 90, mode: str | None = None, exif_transpose: bool = False,
         normalize: bool = False, mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
         dtype: str | None = None, workers: int | None = None, shuffle: bool | None = None, seed: int = 0,
         shard_size: int | None = None, shard_samples: int | None = None, strict: bool = False,
         overwrite: bool = False, resume: bool = False, include_hidden: bool = False,
         max_pixels: int = DEFAULT_MAX_PIXELS, label_key: str | None = None, distributed: bool | None = None,
         progress: bool = True) -> dict[str, Any]:
    """Convert ``src`` into a ``format`` dataset in ``dest`` and return its manifest.

    ``src`` is an image folder, a dataset packed by packer (any format: repacking keeps relpaths, and with
    ``store="original"`` the stored bytes), or WebDataset shards written by any tool (a folder of ``.tar`` files,
    one ``.tar``, or a glob; the label comes from ``label_key``: ``cls``, ``txt``, ``json:FIELD``...).
    ``mode`` defaults to RGB, or to the mode of a packed source.

    ``resume=True`` continues an interrupted conversion of the same source with the same options, and returns
    the existing manifest if ``dest`` is already finished. Under torchrun (``WORLD_SIZE`` > 1) or in an
    initialised process group, every rank converts one part and rank 0 writes one manifest over all of them
    (``distributed=False`` converts in this process only; see :mod:`packer.distributed`). See the README for
    every option; the CLI's ``packer pack`` calls this with the same names."""
    if parse_url(dest) is not None:  # converted into a staging folder in the cache, then uploaded
        return _pack_to_url(locals())
    from .distributed import detect, pack_distributed

    dest = Path(dest)
    writer_cls, _ = get_format(format)
    for name, value in (("shard_size", shard_size), ("shard_samples", shard_samples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"--{name.replace('_', '-')}: {value!r} is not a positive number")
    context = detect(distributed)

    def plan(quiet: bool = False) -> _Plan:
        return _plan(src, format, writer_cls, dict(
            store=store, resize=resize, max_size=max_size, center_crop=center_crop, interpolation=interpolation,
            quality=quality, mode=mode, exif_transpose=exif_transpose, normalize=normalize, mean=mean, std=std,
            dtype=dtype, max_pixels=max_pixels), shuffle=shuffle, seed=seed, shard_size=shard_size,
            shard_samples=shard_samples, strict=strict, include_hidden=include_hidden, label_key=label_key,
            workers=workers, progress=progress, quiet=quiet)

    if resume and is_regular_file(dest / MANIFEST):
        try:
            return _finished(dest, plan(quiet=context is not None and context.rank != 0),
                             speak=context is None or context.rank == 0)
        finally:
            if context is not None:
                context.close()
    if context is not None:
        return pack_distributed(context, plan, dest, resume=resume, overwrite=overwrite)
    p = plan()
    created = not _exists(dest)
    journal, resuming = open_journal(dest, p, resume, overwrite)
    started = time.time()
    try:
        result = convert_samples(dest, p, p.order, journal, resuming)
    except NothingPackedError:
        if not resuming:
            discard(dest, created)
        raise
    manifest = make_manifest(p, result.count, result.extras, result.skipped, result.resumed, time.time() - started)
    try:
        write_manifest(dest, manifest)
    except OSError as exc:
        raise _write_failed(dest, exc) from None
    (dest / MARKER).unlink()
    return manifest


def _pack_to_url(arguments: dict[str, Any]) -> dict[str, Any]:
    from .remote.upload import pack_to_url

    return pack_to_url(**arguments)


def _exists(path: Path) -> bool:
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):
        return False


def _finished(dest: Path, plan: _Plan, speak: bool) -> dict[str, Any]:
    """``--resume`` on a finished DEST: its manifest, if it was packed from the same source with the same
    options; a :class:`DestinationError` otherwise, as for an unfinished one."""
    manifest = read_manifest(dest)
    recorded = manifest.get("options")
    wanted = {k: v for k, v in plan.options.items() if k != "world_size"}
    if isinstance(recorded, dict):
        recorded = {k: v for k, v in recorded.items() if k != "world_size"}
    else:  # packed before the manifest recorded its options: compare what it does record
        recorded = {"format": manifest.get("format"), "transform": manifest.get("transform"),
                    "source": (manifest.get("source") or {}).get("root")}
        wanted = {"format": plan.format, "transform": wanted["transform"],
                  "source": plan.source.describe()["root"]}
    changed = _differences(recorded, wanted)
    if changed:
        raise DestinationError(f"{dest}: is a finished dataset packed with a different {', '.join(changed)}; "
                               "run with the same source and options, or start again with --overwrite")
    if speak:
        print(f"packer: {dest} is already a finished dataset; nothing to resume", file=sys.stderr)
    return manifest


def discard(dest: Path, created: bool) -> None:
    """Remove what a conversion that packed nothing wrote into ``dest`` (emptied or created for it), so that
    the same command can run again; ``created``: this run created ``dest`` itself."""
    empty_folder(dest)
    if created:
        dest.rmdir()


@dataclass
class _Plan:
    """Everything every rank decides identically before converting: the source, the transform, the options the
    journal records, and the output order (source indices)."""

    source: Source
    format: str
    writer_cls: type
    spec: TransformSpec
    options: dict[str, Any]
    order: list[int]
    sizes: np.ndarray  # bytes of each source sample, by source index
    shuffle: bool
    seed: int
    shard_size: int | None
    shard_samples: int | None
    strict: bool
    workers: int | None
    progress: bool
    shape: list[int] | None

    def estimate(self, indices: list[int]) -> int:
        """The bytes that converting these samples stores, roughly (LMDB map size, shard sizing)."""
        spec = self.spec
        if spec.store == "raw" and spec.fixed_shape:
            return len(indices) * int(np.prod(spec.fixed_shape)) * np.dtype(spec.dtype).itemsize
        total = int(self.sizes[np.asarray(indices, dtype=np.int64)].sum()) if len(indices) else 0
        return total * (8 if spec.store == "raw" and self.source.stored != "raw" else 1)


def _plan(src, format: str, writer_cls: type, transform: dict[str, Any], *, shuffle: bool | None, seed: int,
          shard_size: int | None, shard_samples: int | None, strict: bool, include_hidden: bool,
          label_key: str | None, workers: int | None, progress: bool, quiet: bool = False) -> _Plan:
    """Open the source, settle the transform and the order; ``quiet`` leaves the warnings to another rank."""
    source = open_source(src, include_hidden=include_hidden, label_key=label_key)
    if transform["store"] is None:
        transform["store"] = source.default_store
    transform["mode"] = transform["mode"] or source.mode
    spec = make_spec(**transform)
    source.check(spec)
    where = source.root if source.kind == "folder" else src
    if source.hidden_skipped and not quiet:
        warn(f"skipped {source.hidden_skipped} hidden files and folders in {where} (names starting with '.'); "
             "pass --include-hidden to keep them")
    for cls in source.empty_classes if not quiet else ():
        warn(f"class {cls!r} has no images; it keeps its index {source.class_to_idx[cls]}")
    if strict and source.errors:
        rel, why = source.errors[0]
        raise ImageError(source.where(rel), why)
    if spec.normalize and not quiet:
        per = np.dtype(spec.dtype).itemsize
        warn(f"--normalize stores {spec.dtype} arrays: {per}x the bytes of raw uint8 and far more than JPEG")
    if shuffle is None:  # WebDataset is read sequentially, so its order is the shuffle (unless it already is one)
        shuffle = format == "wds" and not source.shuffled
    options = {"format": format, "transform": spec.to_dict(), "shuffle": bool(shuffle), "seed": seed,
               "shard_size": shard_size, "shard_samples": shard_samples, "include_hidden": include_hidden,
               "strict": strict, "source": source.key, "fingerprint": source.fingerprint()}
    if label_key is not None:
        options["label_key"] = label_key
    options = json.loads(json.dumps(options))  # as the journal will hold them: lists, not tuples
    order = list(range(source.count))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(order)).tolist()
    if not quiet:
        for rel, why in source.errors:
            warn(f"skipped {source.where(rel)}: {why}")
    shape = list(spec.fixed_shape) if spec.fixed_shape else None
    geometry = spec.resize or spec.max_size or spec.center_crop or spec.normalize
    if shape is None and source.shape and not geometry and spec.mode == source.mode:
        shape = list(source.shape)  # a repack that keeps the pixels keeps the source's fixed shape
    return _Plan(source, format, writer_cls, spec, options, order, source.sizes(), bool(shuffle), seed, shard_size,
                 shard_samples, strict, workers, progress, shape)


def open_journal(dest: Path, plan: _Plan, resume: bool, overwrite: bool) -> tuple[dict, bool]:
    """The journal of the conversion into ``dest``: the interrupted one when resuming (its options must match),
    else a fresh one in a prepared, empty ``dest``. Returns it and whether it resumes."""
    journal = read_journal(dest) if resume else None
    if journal is not None:
        changed = _differences(journal["options"], plan.options)
        if changed:
            raise DestinationError(f"{dest}: the interrupted conversion used a different {', '.join(changed)}; "
                                   "resume with the same source and options, or start again with --overwrite")
        return journal, True
    if resume:
        warn(f"nothing to resume in {dest}; starting afresh")
    _prepare_dest(dest, plan.source.root, overwrite)
    journal = {"options": plan.options, "position": 0, "skipped": [], "writer": None}
    write_json_atomic(dest / MARKER, journal)
    return journal, False


@dataclass
class _Converted:
    count: int
    extras: dict[str, Any]  # what the writer adds to the manifest: files, shards
    skipped: list[dict]
    resumed: bool


def convert_samples(dest: Path, plan: _Plan, indices: list[int], journal: dict, resuming: bool, *,
                    allow_empty: bool = False, key_offset: int = 0, progress: bool | None = None,
                    desc: str | None = None, on_progress=None) -> _Converted:
    """Convert source samples ``indices``, in that order, into ``dest`` with its journal. ``allow_empty`` keeps a
    conversion where every image was skipped (one rank's part); ``key_offset`` numbers WebDataset keys from there."""
    writer_options = {"estimated_bytes": plan.estimate(indices), "shard_bytes": plan.shard_size,
                      "shard_samples": plan.shard_samples, "classes": plan.source.classes, "key_offset": key_offset}
    writer = plan.writer_cls(dest, plan.spec, len(indices), writer_options)
    conversion = _Conversion(plan.source, dest, indices, plan.spec, writer, journal, plan.strict,
                             plan.progress if progress is None else progress, desc, on_progress)
    try:
        conversion.restore(resuming)
        conversion.run(plan.workers)
        if writer.count == 0 and not allow_empty:
            where = plan.source.root if plan.source.kind == "folder" else plan.options["source"]
            raise NothingPackedError(f"{where}: none of the {len(indices)} images could be read; nothing was "
                                     "packed")
        extras = writer.close()
    except BaseException as exc:
        try:
            writer.abort()
        except OSError:
            pass  # a full disk fails the final flush too; the journal still marks the last durable point
        if isinstance(exc, OSError):  # from close(): finishing the data files
            raise _write_failed(dest, exc) from None
        raise
    skipped = [{"path": e["path"], "error": e["error"]} for e in conversion.skipped]
    return _Converted(writer.count, extras, skipped, conversion.resumed)


def make_manifest(plan: _Plan, count: int, extras: dict[str, Any], skipped: list[dict], resumed: bool,
                  seconds: float) -> dict[str, Any]:
    source, spec = plan.source, plan.spec
    return {
        "format": plan.format, "format_version": FORMAT_VERSION, "packer_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {**source.describe(), "images": source.count,
                   "bytes": int(plan.sizes.sum()) if spec.store != "raw" else None},
        "count": count, "classes": source.classes, "class_to_idx": source.class_to_idx,
        "store": spec.store, "transform": spec.to_dict(), "shape": plan.shape, "dtype": spec.dtype,
        "order": {"shuffle": plan.shuffle, "seed": plan.seed}, "checksum": "crc32",
        **extras,
        "skipped": [{"path": rel, "error": why} for rel, why in source.errors] + skipped,
        "hidden_skipped": source.hidden_skipped, "empty_classes": source.empty_classes,
        "conversion_seconds": round(seconds, 3), "resumed": resumed,
        "options": plan.options,  # what --resume compares, once the dataset is finished
    }


# What to do about a failed write, by errno; LMDB reports every failed write as EIO, hence the broad default.
_WRITE_ADVICE = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space or raise your disk quota",
    errno.EFBIG: "a file outgrew the file-size limit (ulimit -f) or the file system's largest file; lift the limit "
                 "or choose a DEST on another file system",
    errno.EACCES: "fix permissions",
    errno.EPERM: "fix permissions",
    errno.EROFS: "the file system is read-only; remount it writable",
}


def _write_failed(dest: Path, exc: OSError) -> PackerError:
    advice = _WRITE_ADVICE.get(exc.errno, "free space, lift any file-size limit (ulimit -f) or fix permissions")
    return PackerError(f"{dest}: write failed ({exc.strerror or exc}); {advice}, then run the same command with "
                       "--resume")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and ends the pool


class _Conversion:
    """Runs the workers and the writer, and keeps the journal that makes the conversion resumable.

    The journal (``.packer-in-progress``) records, each time the writer makes its output durable, how many
    samples it holds, the source position to continue from, and the images skipped so far."""

    def __init__(self, source: Source, dest: Path, indices: list[int], spec: TransformSpec, writer,
                 journal: dict, strict: bool, progress: bool, desc: str | None = None, on_progress=None):
        self.source, self.dest, self.indices, self.spec = source, dest, indices, spec
        self.writer, self.journal, self.strict, self.progress = writer, journal, strict, progress
        self.desc = desc or f"packing {writer.format}"
        self.on_progress = on_progress  # called with the samples written after each chunk (distributed liveness)
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
            if isinstance(item, tuple):
                kind, reason = item
                if kind == "fail":
                    raise PackerError(f"{self.source.where(relpath)}: unexpected error while converting ({reason}); "
                                      "please report it")
                if self.strict:
                    raise ImageError(self.source.where(relpath), reason)
                warn(f"skipped {self.source.where(relpath)}: {reason}")
                self.skipped.append({"path": relpath, "error": reason, "position": position})
                continue
            durable = self.writer.write(label, relpath, item)
            self.pending.append((self.writer.count, position))
            if durable is not None:
                self._checkpoint(durable)
        self.bar.update(len(results))
        if self.on_progress is not None:
            self.on_progress(self.writer.count)

    def run(self, workers: int | None) -> None:
        workers = usable_cores() if workers is None else max(1, workers)
        reader = self.source.reader()
        chunks = [list(enumerate(self.indices[i:i + CHUNK], start=i))
                  for i in range(self.start, len(self.indices), CHUNK)]
        self.bar = tqdm(total=len(self.indices), initial=self.start, unit="img", disable=not self.progress,
                        file=sys.stderr, dynamic_ncols=True, desc=self.desc)
        try:
            if workers == 1:
                for chunk in chunks:
                    self.consume(_convert_items(reader, chunk, self.spec))
                return
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(reader,))
            try:
                pending: deque = deque()
                window = 4 * workers  # chunks in flight: bounds memory whatever the dataset size
                for chunk in chunks:
                    pending.append(pool.submit(_convert_chunk, (chunk, self.spec)))
                    if len(pending) >= window:
                        self.consume(pending.popleft().result())
                while pending:
                    self.consume(pending.popleft().result())
            except BaseException:
                # Cancel what has not started and let each worker finish its chunk (a fraction of a second).
                # Killing workers instead can leave one dead in the middle of writing its result, and then
                # multiprocessing.Pool's terminate(), or the executor's exit hook, waits on that pipe forever.
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            pool.shutdown()
        except BrokenProcessPool:
            raise PackerError(f"{self.dest}: a conversion worker process died (killed, out of memory?); run the same "
                              "command with --resume to continue, with fewer --workers if memory is short") from None
        except OSError as exc:
            raise _write_failed(self.dest, exc) from None
        finally:
            self.bar.close()

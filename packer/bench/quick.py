"""``packer bench SRC``: the quick benchmark, what decides which format and store to pack with.

It packs SRC in each format with the stores a user would train from (``jpeg`` at the training size, and ``raw``
where it fits the disk), and reads each, and the folder, through make_loader's default loader, with the training
pipeline (random resized crop + flip) and the validation one, warm and cold (where the page cache can be dropped
without root: ``posix_fadvise``). Each figure reads for at least ``min_seconds`` (:mod:`~packer.bench.passes`);
the row is printed as it finishes (:mod:`~packer.bench.live`). Then the dataset it would choose is read with
fewer workers too, to say with how few a training step would not wait; and the verdict
(:mod:`~packer.bench.verdict`) comes first in what is printed and written. ``--full`` is :func:`run_bench`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..errors import PackerError, UsageError
from ..images.transforms import as_pair, parse_size
from ..system import usable_cores
from .limits import add_ceilings, interleaved_ceiling, measure_limits
from .live import LiveTable, widths_for
from .machine import load_average, machine_info
from .measure import SKIP_ABOVE, add_speedups, check_signature, evicted, output_signature, target_fields
from .passes import Figure, cold_figure, warm_figure
from .pipelines import parse_pipelines
from .report import QUICK_COLUMNS, quick_notes, quick_warnings
from .run import finish
from .targets import Size, Target, Variant, folder_target, pack_target, packed_target, parse_variant
from .verdict import choose, verdict

DEFAULT_STORES = ("jpeg", "raw")
MIN_SECONDS = 1.0
IMAGES = 2000  # images of a larger folder measured (a sample): the choice depends on the images, not their number
DISK_MARGIN = 0.8  # raw is packed only where it takes at most this fraction of the free space


def sweep_workers(default: int) -> list[int]:
    """The worker counts under make_loader's default tried for the chosen dataset: 1, 2, 4, ..."""
    counts, n = [], 1
    while n < default:
        counts.append(n)
        n *= 2
    return counts


def raw_bytes(variant: Variant, count: int, source_bytes: int) -> int:
    """About how many bytes ``count`` images take stored raw as ``variant`` (3 channels)."""
    crop, resize = as_pair(variant.center_crop), variant.resize
    if crop:
        return count * crop[0] * crop[1] * 3
    if isinstance(resize, int):
        return count * resize * resize * 4
    if resize:
        return count * resize[0] * resize[1] * 3
    return source_bytes * 10  # full-size pixels: about ten times their JPEG bytes


def fitting(variants: list[Variant], formats: Sequence[str], count: int, source_bytes: int,
            work: Path) -> tuple[list[Variant], list[str]]:
    """The variants whose packs fit the work folder's disk, and a line for each that does not."""
    free = shutil.disk_usage(work).free
    kept, skipped, needed = [], [], 0
    for v in variants:
        size = raw_bytes(v, count, source_bytes) * len(formats) if v.store == "raw" else 0
        if size and needed + size > DISK_MARGIN * free:
            skipped.append(f"store {v.label}: {len(formats)} packs of about {size / len(formats) / 1e9:.2f} GB "
                           f"would not fit the {free / 1e9:.1f} GB free under {work}")
            continue
        needed += size
        kept.append(v)
    return kept, skipped


def sample_folder(folder: Target, work: Path, images: int | None, seed: int = 0) -> Target:
    """``folder`` itself, or where it has more than ``images`` images, a folder of links to a random sample of them
    in ``work`` (their class folders kept), as a target."""
    if not images or folder.count <= images:
        return folder
    chosen = sorted(np.random.default_rng(seed).choice(folder.count, images, replace=False).tolist())
    root = work / "sample"
    for i in chosen:
        original = folder.files[i]
        link = root / original.relative_to(folder.root)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(original.resolve())
    return folder_target(root, folder.read_resize, folder.read_crop)


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Collections skip the objects alive now (torch's modules...): the eviction before each cold epoch collects
    garbage (:func:`~packer.bench.cache.release_handles`), in a fraction of the time."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _row(target: Target, figure: dict[str, Any], cache: str, settings: dict[str, Any],
         output_bytes: int) -> dict[str, Any]:
    plan = figure.pop("plan")
    rate = figure["samples_per_s"]
    return {**target_fields(target, output_bytes), "workers": plan.workers, "engine": plan.engine, "plan": str(plan),
            "batch_size": settings["batch_size"], "epoch": None, "cache": cache, **figure,
            "samples_per_s_runs": [rate], "repeats": 1, "mb_per_s_read": rate * target.bytes_per_sample / 1e6,
            "mb_per_s_decoded": rate * output_bytes / 1e6,
            "eviction_ok": evicted(figure["resident_before"]) if cache == "cold" else None,
            "step_ms": settings["step_ms"] or None, "min_seconds": settings["min_seconds"]}


def _speedup(row: dict[str, Any], rows: list[dict]) -> None:
    folder = next((r for r in rows if r["dataset"] == "folder" and (r["pipeline"], r["cache"], r["workers"]) ==
                   (row["pipeline"], row["cache"], row["workers"])), None)
    row["speedup_vs_folder"] = row["samples_per_s"] / folder["samples_per_s"] if folder and folder[
        "samples_per_s"] else None


class _Measurer:
    """Measures figures, keeps their rows and prints each as it finishes."""

    def __init__(self, settings: dict[str, Any], expected: tuple, live: LiveTable, limits: dict[str, Any]):
        self.settings, self.expected, self.live, self.limits = settings, expected, live, limits
        self.output_bytes = expected[0] * expected[1] * expected[2]
        self.rows: list[dict] = []
        self.count = 0

    def figure(self, target: Target, cache: str, workers: int | None, before: Any = None) -> None:
        s = self.settings
        fig = Figure(s["batch_size"], workers, s["min_seconds"], s["step_ms"] / 1000, self.expected)
        self.count += 1
        loader = f", {workers} worker{'s' if workers != 1 else ''}" if workers is not None else ""
        self.live.status(f"[{self.count}] {target.dataset} {target.store}, {target.pipeline}, {cache} cache{loader}...")
        if before is not None:
            before()
        if cache == "warm":
            figure = warm_figure(target, fig)
        else:
            warm = next((r for r in self.rows if (r["dataset"], r["store"], r["pipeline"], r["cache"]) == (
                target.dataset, target.store, target.pipeline, "warm") and workers in (None, r["workers"])), None)
            figure = cold_figure(target, fig, warm_rate=warm["samples_per_s"] if warm else None)
        row = _row(target, figure, cache, s, self.output_bytes)
        _speedup(row, self.rows)
        self.rows.append(row)
        self.live.add(row)

    def target(self, target: Target) -> None:
        with interleaved_ceiling(self.limits, target) as ceiling_round:
            for cache in self.settings["caches"]:
                for workers in self.settings["workers"] or [None]:
                    self.figure(target, cache, workers, ceiling_round)


def _size(size: Size | str) -> Size:
    """A size given as text (``"256"``, ``"320x240"``) or already parsed."""
    return parse_size(size) if isinstance(size, (str, int)) else size


def _check(read_resize: Size, read_crop: Size, caches: Sequence[str], batch_size: int, min_seconds: float) -> None:
    if not read_crop and not isinstance(read_resize, tuple):
        raise UsageError("the benchmark needs a fixed output size: give read_crop (or read_resize as WxH)")
    if [c for c in caches if c not in ("warm", "cold")] or not caches or batch_size < 1 or min_seconds <= 0:
        raise UsageError("caches are warm and/or cold; batch_size is at least 1; min_seconds is over 0")


def run_quick(src: str | os.PathLike, *, formats: Sequence[str] = ("lmdb", "hdf5", "wds"),
              stores: Sequence[str | Variant] | None = None, resize: Size = 256, center_crop: Size = 224,
              batch_size: int = 64, workers: Sequence[int] | None = None, caches: Sequence[str] = ("warm", "cold"),
              step_ms: float = 0.0, min_seconds: float = MIN_SECONDS, read_resize: Size = 256, read_crop: Size = 224,
              pipelines: Sequence[str] = ("train", "val"), packed: Sequence[str | os.PathLike] = (),
              out: str | os.PathLike | None = "bench-out", work: str | os.PathLike | None = None, keep: bool = False,
              limits: bool = True, disk_test_mb: int = 0, progress: bool = True, command: str | None = None,
              images: int | None = IMAGES, live: LiveTable | None = None) -> dict[str, Any]:
    """Measure what decides the choice of format and store for ``src`` and return (and write to ``out``) every
    figure, the verdict first (``results["verdict"]["lines"]``). See the module docstring; ``workers`` None reads
    with make_loader's default and then tries fewer workers on the chosen dataset. A folder of more than ``images``
    images is measured on a random sample of them (None: all). ``live`` prints each row as it finishes (default: on
    stderr, unless ``progress`` is False)."""
    src_given = str(src)
    src = Path(src)
    read_resize, read_crop = _size(read_resize), _size(read_crop)
    _check(read_resize, read_crop, caches, batch_size, min_seconds)
    pipelines = parse_pipelines(list(pipelines))
    if not src.is_dir():
        raise PackerError(f"{src}: no such folder; give the image folder to benchmark")
    variants = [s if isinstance(s, Variant) else parse_variant(s, _size(resize), _size(center_crop))
                for s in (stores or DEFAULT_STORES)]
    work_parent = Path(work) if work else Path(out) if out else Path(tempfile.gettempdir())
    work_parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="packer-bench-", dir=work_parent))
    load: dict[str, Any] = {"start": load_average(), "end": None, "usable_cores": usable_cores()}
    settings = {"mode": "quick", "src_given": src_given, "formats": list(formats), "batch_size": batch_size,
                "workers": list(workers) if workers is not None else None, "caches": list(caches),
                "step_ms": step_ms, "min_seconds": min_seconds, "read_resize": read_resize, "read_crop": read_crop,
                "pipelines": pipelines, "packed": [str(p) for p in packed], "disk_test_mb": disk_test_mb,
                "images": images}
    try:
        with frozen_gc():
            results = _quick(src, work_dir, variants, settings, packed, limits, progress, live)

        def judge(results: dict[str, Any]) -> None:
            results["verdict"] = verdict(results)
            results["warnings"] = quick_warnings(results)

        return finish(results, load, command or f"run_quick({src_given!r}, ...)", work_dir if keep else None, out,
                      judge)
    finally:
        if not keep:
            shutil.rmtree(work_dir, ignore_errors=True)


def _targets(src: Path, work: Path, variants: list[Variant], settings: dict, packed: Sequence, folder: Target,
             live: LiveTable) -> tuple[list[Target], list[dict], list[str]]:
    """The packed datasets to read (packing them), their conversions, and why any variant was not packed."""
    r, c = settings["read_resize"], settings["read_crop"]
    if packed:
        targets = [packed_target(Path(p), r, c) for p in packed]
        return targets, [], []
    variants, skipped = fitting(variants, settings["formats"], folder.count, folder.bytes_on_disk, work)
    targets = []
    for v in variants:
        for fmt in settings["formats"]:
            live.status(f"packing {folder.count} images as {fmt}, store {v.label}...")
            targets.append(pack_target(src, work, fmt, v, folder.bytes_on_disk, r, c, False))
    return targets, [t.conversion for t in targets if t.conversion], skipped


def _live_columns(settings: dict) -> list[tuple[str, str, str]]:
    """The live table's columns: those known as each row finishes (not the ceilings, measured along the rows)."""
    left_out = {"fraction_of_ceiling", "mb_per_s_read", *(() if settings["step_ms"] else ("data_stall",)),
                *(() if "cold" in settings["caches"] else ("eviction_ok",))}
    return [c for c in QUICK_COLUMNS if c[0] not in left_out]


def _live_widths(targets: list[Target], settings: dict) -> list[int]:
    texts = {"dataset": [t.dataset for t in targets], "store": [t.store for t in targets],
             "pipeline": settings["pipelines"], "cache": settings["caches"], "workers": ["99"], "eviction_ok": ["yes"]}
    return widths_for(_live_columns(settings), texts)


def _quick(src: Path, work: Path, variants: list[Variant], settings: dict, packed: Sequence, limits: bool,
           progress: bool, live: LiveTable | None) -> dict[str, Any]:
    started = time.perf_counter()
    machine = machine_info(work, src)
    whole = folder_target(src, settings["read_resize"], settings["read_crop"])
    folder = whole if packed else sample_folder(whole, work, settings["images"])
    table = live or LiveTable(_live_columns(settings), _live_widths([folder], settings), enabled=progress)
    try:
        targets, conversions, skipped = _targets(folder.root, work, variants, settings, packed, folder, table)
        if live is None:
            table.widths = _live_widths([folder, *targets], settings)
        expected = output_signature(folder)
        for target in targets:
            check_signature(output_signature(target), expected, str(target.root))
        limit_info = measure_limits(work, settings) if limits else {}
        train = {"read_resize": settings["read_resize"], "read_crop": settings["read_crop"]}
        everything = [replace(t, pipeline=p, **(train if p == "train" else {}))
                      for p in settings["pipelines"] for t in [folder, *targets]]
        measurer = _Measurer(settings, expected, table, limit_info)
        for target in everything:
            measurer.target(target)
        rows = measurer.rows
        default = max(r["workers"] for r in rows)  # make_loader's default, or the most workers asked for
        settings["default_workers"] = default
        choice = choose(rows, default)
        if choice is not None and settings["workers"] is None and "warm" in settings["caches"]:
            chosen = next(t for t in everything if (t.dataset, t.store, t.pipeline) == (
                choice["row"]["dataset"], choice["row"]["store"], choice["pipeline"]))
            for n in sweep_workers(default):
                measurer.figure(chosen, "warm", n)
    finally:
        table.close()
    add_speedups(rows)
    if limit_info:
        add_ceilings(rows, everything, limit_info)
    return {"mode": "quick", "packer_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine, "settings": settings,
            "source": {"root": str(src.resolve()), "images": folder.count, "bytes": folder.bytes_on_disk,
                       "all_images": whole.count, "all_bytes": whole.bytes_on_disk},
            "output": {"shape": list(expected[:3]), "dtype": expected[3]}, "limits": limit_info,
            "conversions": conversions, "skipped": skipped, "rows": rows,
            "notes": quick_notes(settings, rows, machine, SKIP_ABOVE),
            "seconds": time.perf_counter() - started}

"""``packer bench --tune``: sweep the loader's settings (workers, decode threads, prefetch factor, pinning; never
the batch size) on one packed dataset, for the read-time view it will serve, and write the fastest, with that view,
to ``DEST/loader.json``, which :func:`packer.make_loader` then uses for that view."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..errors import warn
from ..images.transforms import parse_size
from ..loading.plan import plan_loader
from ..loading.tuned import read_view
from ..manifest import TUNED, write_json_atomic
from ..system import usable_cores
from .cache import prewarm, release_handles
from .machine import machine_info
from .measure import WARMUP_BATCHES, build_loader
from .targets import Size, Target, packed_target


def tune_workers() -> list[int]:
    """0, 1, 2, 4, ... up to the usable cores, and the usable cores themselves."""
    cores = usable_cores()
    counts = {0, cores}
    n = 1
    while n < cores:
        counts.add(n)
        n *= 2
    return sorted(counts)


NOISE_SECONDS = 2.0  # measured seconds per config under which the figures are noise
NOISE_BATCHES = 2  # measured batches per config under which the figures are noise


def tune_threads(workers: int) -> list[int]:
    """Decode threads to try: 1 and the usable cores for the in-process loader (workers 0); 1 in workers."""
    return sorted({1, usable_cores()}) if workers == 0 else [1]


def tune_pinning() -> list[bool]:
    """Pinned batches matter only with CUDA: try both there, neither elsewhere."""
    return [False, True] if torch.cuda.is_available() else [False]


def _tune_one(target: Target, workers: int, threads: int, prefetch: int, pin: bool, batch_size: int,
              samples: int, min_seconds: float, max_seconds: float) -> dict[str, Any]:
    """Read at least ``samples`` samples and ``min_seconds`` of measured time after the warm-up batches (epoch after
    epoch), or for about ``max_seconds``. Each epoch is cut short by its sampler, never by leaving the loop: a
    loader left mid-epoch still has threads reading."""
    ds = target.open()
    epoch = min(len(ds), samples + WARMUP_BATCHES * batch_size)
    sampler = torch.utils.data.RandomSampler(ds, num_samples=epoch, generator=torch.Generator().manual_seed(0))
    loader, used_threads = build_loader(ds, batch_size, workers, prefetch, sampler=sampler, pin_memory=pin,
                                        **({"threads": threads} if workers == 0 else {}))
    measured = seconds = 0.0
    first = batch = None
    seen = batches = 0
    started = time.perf_counter()
    while (measured < samples or seconds < min_seconds) and time.perf_counter() - started < max_seconds:
        t = time.perf_counter()
        for batch in loader:
            got = time.perf_counter()
            first = got - started if first is None else first
            if seen >= WARMUP_BATCHES:
                measured += len(batch[0])
                seconds += got - t
                batches += 1
            seen += 1
            t = time.perf_counter()
    pool = getattr(loader, "worker_pool", None)
    if pool is not None:
        pool.close()
    del loader, ds, batch, pool
    release_handles()
    return {"num_workers": workers, "threads": used_threads, "prefetch_factor": prefetch, "pin_memory": pin,
            "batch_size": batch_size, "samples_per_s": measured / seconds if seconds else 0.0,
            "samples": int(measured), "batches": batches, "seconds": seconds, "first_batch_s": first}


def noise_warning(results: list[dict[str, Any]]) -> str | None:
    """Why a sweep's figures are noise, if they are: a config measured under :data:`NOISE_SECONDS` seconds or
    :data:`NOISE_BATCHES` batches."""
    short = [r for r in results if r["seconds"] < NOISE_SECONDS or r["batches"] < NOISE_BATCHES]
    if not short:
        return None
    least = min(short, key=lambda r: (r["batches"], r["seconds"]))
    return (f"{len(short)} of {len(results)} configs were measured too briefly to mean anything (the shortest: "
            f"{least['batches']} batches in {least['seconds']:.2f} s; each needs {NOISE_BATCHES}+ batches and "
            f"{NOISE_SECONDS:.0f}+ s): these figures are noise; tune on a larger dataset or with more samples")


def tune(dest: str | os.PathLike, *, workers: Sequence[int] | None = None, batch_size: int = 64,
         prefetch_factors: Sequence[int] = (2, 4), samples: int | None = None, min_seconds: float = NOISE_SECONDS,
         max_seconds: float = 10.0, read_resize: Size = 256, read_crop: Size = 224, pipeline: str = "val",
         progress: bool = True) -> dict[str, Any]:
    """Sweep the loader's settings (workers, decode threads, prefetch factor and, with CUDA, pinning; never the
    batch size, a training hyperparameter: every config reads batches of ``batch_size``) on the packed dataset
    ``dest`` opened as ``pipeline`` reads it (warm cache), and write the fastest to ``dest/loader.json`` with
    the read-time view it was measured on (:func:`packer.loading.tuned.read_view`; make_loader applies it to that
    view only). Warns when the figures are noise (:func:`noise_warning`). Returns what was written."""
    dest = Path(dest)
    target = packed_target(dest, parse_size(read_resize), parse_size(read_crop))
    if pipeline == "train":  # the train pipeline crops from the full stored image (as run_bench does)
        target = replace(target, pipeline="train", read_resize=parse_size(read_resize),
                         read_crop=parse_size(read_crop))
    samples = samples or min(target.count, 2000)
    workers = list(workers) if workers is not None else tune_workers()
    configs = [(w, t, p, pin) for w in workers for t in tune_threads(w) for p in prefetch_factors
               for pin in tune_pinning()]
    prewarm(target.files)
    results = []
    for w, t, p, pin in tqdm(configs, desc="tuning", unit="config", disable=not progress, file=sys.stderr):
        results.append(_tune_one(target, w, t, p, pin, batch_size, samples, min_seconds, max_seconds))
    best = max(results, key=lambda r: r["samples_per_s"])
    keys = ["num_workers", "prefetch_factor"] + (["threads"] if best["num_workers"] == 0 else [])
    keys += ["pin_memory"] if len(tune_pinning()) > 1 else []
    loader = {k: best[k] for k in keys}
    ds = target.open()
    view = read_view(ds)
    plan = plan_loader(ds, batch_size, tuned=loader)
    del ds
    release_handles()
    noise = noise_warning(results)
    if noise:
        warn(noise)
    data = {"loader": loader, "view": view,
            "measured": {"samples_per_s": best["samples_per_s"], "cache": "warm", "samples_per_config": samples,
                         "batch_size": batch_size, "pipeline": pipeline, "noise": noise,
                         "read_resize": target.read_resize, "read_crop": target.read_crop,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "machine": machine_info(dest), "plan": str(plan), "results": results}}
    write_json_atomic(dest / TUNED, data)
    return data


def format_tune(data: dict[str, Any], dest: str | os.PathLike) -> str:
    rows = sorted(data["measured"]["results"], key=lambda r: -r["samples_per_s"])
    lines = [f"{'workers':>7}  {'threads':>7}  {'prefetch':>8}  {'pinned':>6}  {'samples/s':>9}"]
    lines += [f"{r['num_workers']:>7}  {r['threads']:>7}  {r['prefetch_factor']:>8}  "
              f"{'yes' if r['pin_memory'] else 'no':>6}  {r['samples_per_s']:>9.0f}" for r in rows]
    lines.append(f"measured at batch size {data['measured']['batch_size']} (make_loader keeps yours)")
    if data["measured"].get("noise"):
        lines.append(f"WARNING: {data['measured']['noise']}")
    lines.append(f"best: {data['loader']} -> {Path(dest) / 'loader.json'} (make_loader uses it from now on, for "
                 "this read-time view)")
    if data["measured"].get("plan"):
        lines.append(f"make_loader's plan from it: {data['measured']['plan']}")
    return "\n".join(lines)

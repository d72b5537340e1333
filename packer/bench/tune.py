"""``packer bench --tune``: sweep workers, batch size and prefetch factor on one packed dataset and write the
fastest to ``DEST/loader.json``, which :func:`packer.make_loader` then uses."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..system import usable_cores
from ..transforms import parse_size
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


def _tune_one(target: Target, workers: int, batch_size: int, prefetch: int, samples: int,
              max_seconds: float) -> dict[str, Any]:
    """Read at least ``samples`` samples after the warm-up batches, or for about ``max_seconds``. Each epoch is
    cut short by its sampler, never by leaving the loop: a loader left mid-epoch still has threads reading."""
    import torch

    ds = target.open()
    epoch = min(len(ds), samples + WARMUP_BATCHES * batch_size)
    sampler = torch.utils.data.RandomSampler(ds, num_samples=epoch, generator=torch.Generator().manual_seed(0))
    loader, threads = build_loader(ds, batch_size, workers, prefetch, sampler=sampler)
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
    release_handles()
    return {"num_workers": workers, "batch_size": batch_size, "prefetch_factor": prefetch, "threads": threads,
            "samples_per_s": measured / seconds if seconds else 0.0, "samples": int(measured),
            "first_batch_s": first}


def tune(dest: str | os.PathLike, *, workers: Sequence[int] | None = None,
         batch_sizes: Sequence[int] = (32, 64, 128), prefetch_factors: Sequence[int] = (2, 4),
         samples: int | None = None, max_seconds: float = 10.0, read_resize: Size = 256, read_crop: Size = 224,
         progress: bool = True) -> dict[str, Any]:
    """Sweep workers x batch size x prefetch factor on the packed dataset ``dest`` (warm cache, short runs) and
    write the fastest to ``dest/loader.json``; return what was written."""
    from ..loader import TUNED
    from ..manifest import write_json_atomic

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

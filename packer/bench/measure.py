"""Reading a target through the loader: one run of a fresh loader over its epochs, and the rows made from runs."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from ..errors import PackerError
from ..loading.loader import make_loader
from .cache import EVICTED_BELOW, evict, prewarm, release_handles, resident_fraction
from .targets import Target

WARMUP_BATCHES = 2  # batches of epoch 1 left out of its rate: worker start-up and first-touch costs
SKIP_ABOVE = 4  # a quick run's pass leaves out its first batches only with this many batches per batch left out
CHUNKS = 5  # parts of a pass whose rates give a quick run's figure its noise
# the shortest part: the workers' prefetched batches arrive in bursts (a pass's last ones at once, as it drains),
# and a part of a tenth of a second timed a burst, not the machine's speed
PART_SECONDS = 0.25


@dataclass
class EpochStats:
    samples: int = 0  # samples in the measured window
    seconds: float = 0.0  # the measured window: waiting for batches plus the simulated steps
    wait: float = 0.0  # time the main loop waited for batches in the window
    decoded_bytes: int = 0
    first_batch_s: float = 0.0
    batches: int = 0
    skipped_batches: int = 0
    waits: list[float] = field(default_factory=list)  # seconds next() waited, for each batch in the window


def build_loader(ds: Any, batch_size: int, workers: int | None, prefetch_factor: int | None = None,
                 seed: int = 0, **overrides: Any) -> tuple[Any, int]:
    """The loader every benchmark run reads through, and its decode threads per process: ``make_loader`` with
    every setting given, so that a ``loader.json`` beside the dataset does not apply. ``workers`` processes of
    one decode thread each (packer's :class:`~packer.loading.workers.WorkerPool` where it applies), or with 0 packer's
    in-process loader (decode threads in the main process and a background thread ``prefetch_factor`` batches
    ahead).

    The one place the benchmark makes a loader (``tuned=False``: nothing tuned applies).

    Args:
        ds: the dataset to read.
        batch_size: samples per batch.
        workers: worker processes; 0 for the in-process loader; None: make_loader's default.
        prefetch_factor: batches prefetched per worker, or by the in-process loader's background thread (None:
            make_loader's default).
        seed: the sampler's seed (the shuffle order).
        **overrides: further ``make_loader`` settings, such as ``sampler``.

    Returns:
        The loader, and the decode threads each of its processes uses.
    """
    kwargs: dict[str, Any] = {**({} if workers is None else {"num_workers": workers}), **overrides}
    if workers and prefetch_factor:
        kwargs["prefetch_factor"] = prefetch_factor
    loader = make_loader(ds, batch_size=batch_size, shuffle=True, seed=seed, tuned=False,
                         prefetch_batches=prefetch_factor if workers == 0 and prefetch_factor else None, **kwargs)
    return loader, loader.threads


def check_signature(signature: tuple, expected: tuple | None, where: str) -> tuple:
    """Every dataset must give what the folder gives: (C, H, W, dtype)."""
    if expected is not None and signature != expected:
        raise PackerError(f"{where}: gives images of {signature}, the folder gives {expected}; pass --read-resize "
                          "and --read-crop that make every dataset's output the same shape")
    return signature


def output_signature_of(images: Any) -> tuple:
    """(C, H, W, dtype) of a batch of images."""
    return (*(int(x) for x in images.shape[1:]), str(images.dtype).replace("torch.", ""))


@dataclass
class Pass:
    """One pass of a loader: for each batch, its size and bytes, when ``next()`` was called for it and how long it
    waited, and its arrival, all in seconds since ``iter(loader)`` (the first wait counts ``iter`` itself); the
    training step slept after each batch, and when the last one ended."""

    sizes: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    step_s: float = 0.0
    end: float = 0.0
    signature: tuple | None = None

    def skipped(self, skip: int) -> int:
        """The batches left out of the rate: ``skip``, where the pass is long enough for that to be fair."""
        return skip if len(self.sizes) >= SKIP_ABOVE * max(1, skip) else 0

    def span(self, skip: int) -> tuple[int, float]:
        """(samples, seconds) the rate is taken over: from the arrival of the last batch left out."""
        k = self.skipped(skip)
        start = self.arrivals[k - 1] if k else 0.0
        return sum(self.sizes[k:]), (self.arrivals[-1] - start) if self.arrivals else 0.0

    def rate(self, skip: int) -> float:
        samples, seconds = self.span(skip)
        return samples / seconds if seconds else 0.0

    def chunk_rates(self, skip: int, chunks: int = CHUNKS, part_seconds: float = PART_SECONDS) -> list[float]:
        """The rates of ``chunks`` consecutive parts of the timed batches (fewer where the pass is short), each of at
        least two batches per worker and about ``part_seconds``: batches from several workers arrive together, so a
        shorter part could be timed over almost no time, or over the burst of a pass's last batches. A pass
        shorter than two such parts is one part: its whole rate."""
        k = self.skipped(skip)
        n = len(self.sizes) - k
        timed = self.span(skip)[1]
        per_batch = timed / n if n and timed > 0 else 0.0
        size = max(2 * max(1, skip), n // chunks, math.ceil(part_seconds / per_batch) if per_batch else n)
        if n and size > n // 2:  # too short to split
            size = n
        rates = []
        for lo in range(k, k + (n // size) * size, size):
            hi = lo + size
            seconds = self.arrivals[hi - 1] - (self.arrivals[lo - 1] if lo else 0.0)
            if seconds > 0:
                rates.append(sum(self.sizes[lo:hi]) / seconds)
        return rates


def timed_pass(loader: Any, step_s: float = 0.0, expected: tuple | None = None, where: str = "",
               bar: tqdm | None = None) -> Pass:
    """Iterate one pass of ``loader``, timing each ``next()`` (checking the first batch's output against
    ``expected``); sleep ``step_s`` after each batch, as a training step would."""
    result = Pass(step_s=step_s)
    start = t = time.perf_counter()
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        got = time.perf_counter()
        images = batch[0]
        if not result.sizes:
            result.signature = check_signature(output_signature_of(images), expected, where)
        result.sizes.append(len(images))
        result.nbytes.append(images.numel() * images.element_size())
        result.starts.append(t - start)
        result.waits.append(got - t)
        result.arrivals.append(got - start)
        del batch, images  # the loader reuses a batch's memory once nothing refers to it
        if step_s:
            time.sleep(step_s)
        if bar is not None:
            bar.update(result.sizes[-1])
        t = time.perf_counter()
        result.end = t - start
    return result


def run_epochs(loader: Any, epochs: int, step_s: float = 0.0, skip: int = WARMUP_BATCHES,
               expected: tuple | None = None, where: str = "", bar: tqdm | None = None) -> list[EpochStats]:
    """Iterate ``epochs`` epochs of ``loader``, sleeping ``step_s`` per batch as a training step would.

    Epoch 1 leaves its first ``skip`` batches out of the rate, at most half of them so that short epochs still
    measure something; every epoch records the time from ``iter(loader)`` to its first batch."""
    results = []
    for epoch in range(epochs):
        p = timed_pass(loader, step_s, expected, where, bar)
        expected = expected or p.signature
        drop = min(skip, len(p.sizes) // 2) if epoch == 0 else 0
        results.append(EpochStats(samples=sum(p.sizes[drop:]), seconds=p.end - p.starts[drop] if p.sizes else 0.0,
                                  wait=sum(p.waits[drop:]), decoded_bytes=sum(p.nbytes[drop:]),
                                  first_batch_s=p.arrivals[0] if p.arrivals else 0.0, batches=len(p.sizes),
                                  skipped_batches=drop, waits=p.waits[drop:]))
    return results


def _run_once(target: Target, workers: int, cache: str, settings: dict[str, Any], repeat: int,
              expected: tuple | None, bar: tqdm | None) -> dict[str, Any]:
    """One fresh loader (workers not shared with any other run) over ``epochs`` epochs, after warming or
    evicting the page cache."""
    ds = target.open()
    if cache == "cold":
        release_handles()
        evict(target.files)
    else:
        prewarm(target.files)
    resident = resident_fraction(target.files)
    loader, threads = build_loader(ds, settings["batch_size"], workers, settings["prefetch_factor"], seed=repeat)
    epochs = run_epochs(loader, settings["epochs"], settings["step_ms"] / 1000, expected=expected,
                        where=f"{target.dataset} {target.store}", bar=bar)
    # Every epoch ran to its end, so nothing reads any more: shut the workers down and unmap before the next
    # eviction. (Not on an error: a loader's threads may still be reading then.)
    plan = loader.plan
    pool = getattr(loader, "worker_pool", None)
    if pool is not None:
        pool.close()  # now, not whenever the loader is collected: a worker's open map keeps its pages resident
    del loader, ds, pool
    release_handles()
    return {"resident_before": resident, "epochs": epochs, "threads": threads, "plan": plan}


def _row(target: Target, workers: int, cache: str, epoch: int, runs: list[dict], settings: dict,
         output_bytes: int) -> dict[str, Any]:
    stats: list[EpochStats] = [r["epochs"][epoch] for r in runs]
    rates = [s.samples / s.seconds if s.seconds else 0.0 for s in stats]
    rate = statistics.median(rates)
    resident = [r["resident_before"] for r in runs]
    resident_known = None if any(x is None for x in resident) else statistics.median(resident)
    row = {
        **target_fields(target, output_bytes), "workers": workers, "threads": runs[0]["threads"],
        "engine": runs[0]["plan"].engine, "plan": str(runs[0]["plan"]), "batch_size": settings["batch_size"],
        "epoch": epoch + 1, "cache": cache,
        "samples": stats[0].samples, "skipped_batches": stats[0].skipped_batches,
        "samples_per_s": rate, "samples_per_s_runs": rates,
        "mb_per_s_read": rate * target.bytes_per_sample / 1e6,
        "mb_per_s_decoded": rate * output_bytes / 1e6,
        "first_batch_s": statistics.median(s.first_batch_s for s in stats),
        "resident_before": resident_known,
        "eviction_ok": evicted(resident_known) if cache == "cold" else None,
        "data_stall": (statistics.median(s.wait / s.seconds for s in stats if s.seconds)
                       if settings["step_ms"] else None),
        "repeats": len(runs),
        "noise": spread(rates),
        **wait_summary([w for s in stats for w in s.waits]),
    }
    return row


def target_fields(target: Target, output_bytes: int) -> dict[str, Any]:
    """A row's fields that come from its target: what is read, how it was packed, how it is read."""
    return {"dataset": target.dataset, "store": target.store, "store_mode": target.store_mode,
            "pipeline": target.pipeline, "pack_resize": target.pack_resize, "pack_crop": target.pack_crop,
            "read_resize": target.read_resize, "read_crop": target.read_crop, "decoder": target.decoder,
            "bytes_per_sample_read": target.bytes_per_sample, "bytes_per_sample_decoded": output_bytes,
            "bytes_on_disk": target.bytes_on_disk}


def evicted(resident: float | None) -> bool:
    """Whether a cold run's files were out of the page cache when it started (False where unknown)."""
    return resident is not None and resident < EVICTED_BELOW


def measure(target: Target, settings: dict[str, Any], expected: tuple | None, bar: tqdm | None,
            before_run: Callable[[], Any] | None = None) -> list[dict]:
    """Every (workers, cache, epoch) row of one target, each the median of ``repeats`` runs; ``before_run`` is
    called before each run (the decode ceiling's rounds, taken side by side with the runs)."""
    rows = []
    output_bytes = int(np.prod(expected[:3])) if expected else 0
    for cache in settings["caches"]:
        for workers in settings["workers"]:
            runs = []
            for r in range(settings["repeats"]):
                if before_run is not None:
                    before_run()
                runs.append(_run_once(target, workers, cache, settings, r, expected, bar))
            rows += [_row(target, workers, cache, e, runs, settings, output_bytes) for e in range(settings["epochs"])]
    return rows


def spread(rates: list[float]) -> float | None:
    """The noise of a figure made of ``rates`` (parts of its run, or its runs): their standard deviation over their
    mean, how much the machine's speed moved while it was measured (None under 2 of them)."""
    if len(rates) < 2 or not statistics.fmean(rates):
        return None
    return statistics.stdev(rates) / statistics.fmean(rates)


DEFAULT_NOISE = 0.05  # the noise taken for a rate whose own could not be measured


def machine_drift(limits: dict[str, Any] | None) -> float | None:
    """How much the machine's speed moved between a run's figures: the spread of each dataset's decode-ceiling
    rounds, taken one beside each of its figures (:func:`~packer.bench.limits.interleaved_ceiling`), pooled (their
    root mean square); None where no dataset has two rounds (``--no-limits``, or no validation pipeline)."""
    decode = (limits or {}).get("decode") or {}
    spreads = [spread(e["rounds"]) for e in decode.values() if isinstance(e, dict) and len(e.get("rounds") or []) >= 2]
    known = [s for s in spreads if s is not None]
    return math.sqrt(statistics.fmean(s * s for s in known)) if known else None


def add_drift(results: dict[str, Any]) -> None:
    """Each row's ``noise``: its own (``noise_within``: how much its rate moved while it was measured) combined
    with ``machine_drift``, how much the machine's speed moved between figures: two figures taken minutes apart,
    in one run or in two, differ by both. Idempotent; a run written before drift was recorded gets it on load."""
    drift = results["machine_drift"] = machine_drift(results.get("limits"))
    for row in results["rows"]:
        within = row["noise_within"] = row.get("noise_within", row.get("noise"))
        row["noise"] = math.hypot(within, drift) if within is not None and drift is not None else within


def change(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Row ``b``'s rate against row ``a``'s: the relative change, the noise of the difference (twice the two
    rates' noise combined, about a 95% interval) and whether the change is within it."""
    ra, rb = a["samples_per_s"], b["samples_per_s"]
    moved = (rb - ra) / ra if ra else math.inf
    noise = 2 * math.hypot(a.get("noise") or DEFAULT_NOISE, b.get("noise") or DEFAULT_NOISE)
    return {"a": ra, "b": rb, "change": moved, "noise": noise, "within": abs(moved) <= noise}


def wait_summary(waits: list[float]) -> dict[str, float | None]:
    """``wait_p50_ms``, ``wait_p95_ms`` and ``wait_max_ms``: the milliseconds ``next(loader)`` waited per batch."""
    if not waits:
        return {"wait_p50_ms": None, "wait_p95_ms": None, "wait_max_ms": None}
    ms = np.asarray(waits) * 1e3
    return {"wait_p50_ms": float(np.percentile(ms, 50)), "wait_p95_ms": float(np.percentile(ms, 95)),
            "wait_max_ms": float(ms.max())}


def output_signature(target: Target) -> tuple:
    """(C, H, W, dtype) of the batches ``target`` gives, from one batch read without a loader."""
    ds = target.open()
    batch = ds.__getitems__(list(range(min(len(ds), 2))))
    images = getattr(batch, "images", None)
    del ds, batch
    release_handles()
    if images is None:
        raise PackerError(f"{target.root}: its images do not all have one size; pass --read-crop so the benchmark "
                          "compares fixed-size batches")
    return output_signature_of(images)


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_folder: the row's rate over the folder's with the same workers, epoch and cache."""
    folder = {(r["pipeline"], r["workers"], r["epoch"], r["cache"]): r["samples_per_s"] for r in rows
              if r["dataset"] == "folder"}
    for row in rows:
        base = folder.get((row["pipeline"], row["workers"], row["epoch"], row["cache"]))
        row["speedup_vs_folder"] = row["samples_per_s"] / base if base else None

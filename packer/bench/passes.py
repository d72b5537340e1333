"""The quick benchmark's measurements: each figure reads for at least a minimum time, whatever the dataset's size.

A warm figure keeps one loader (and its workers) and reads passes of a :class:`RepeatSampler`, which repeats the
dataset's epochs back to back (a new permutation each), so that a small dataset is read as long as a large one would
be without the pause at each epoch's end: a first short pass, not counted, starts the workers and gives a first
estimate of the rate, then passes sized by it until ``min_seconds`` were measured. A cold figure reads single
epochs, each with a fresh loader whose workers were started before the dataset's files were evicted from the page
cache (:func:`~packer.bench.cache.evict`), until ``min_seconds`` were measured.

In every pass the first ``skip`` batches (one per worker process: the loader filling its workers) are left out of
the rate, which runs from the arrival of the last skipped batch to that of the last one, where the pass has at least
:data:`~packer.bench.measure.SKIP_ABOVE` batches per skipped one; a shorter pass is timed from ``iter(loader)``.
With a training step (``step_s``), a figure then reads as long again sleeping ``step_s`` after each batch, as a
training step on a GPU would leave the CPU to the loader: the waits in ``next()`` of those passes are what the step
waits for.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .cache import evict, prewarm, release_handles, resident_fraction
from .measure import PART_SECONDS, SKIP_ABOVE, Pass, build_loader, spread, timed_pass, wait_summary
from .targets import Target

MIN_BATCHES = 6  # batches per worker a warm figure measures at the least, whatever its time
MAX_COLD_EPOCHS = 12  # cold epochs a figure reads at most (each starts a loader and evicts the files)


class RepeatSampler(torch.utils.data.Sampler):
    """``length`` indices of a dataset of ``n`` samples: permutations of it back to back, a new one for each epoch
    (from ``seed`` and the epoch), continued across passes. Set ``length`` before each pass."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.length, self.epoch = n, seed, n, 0
        self._left: list[int] = []

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.length):
            if not self._left:
                generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
                self._left = torch.randperm(self.n, generator=generator).tolist()[::-1]
                self.epoch += 1
            yield self._left.pop()


def pass_figures(passes: list[Pass], stepped: list[Pass], skip: int, by_pass: bool = False) -> dict[str, Any]:
    """What a figure's passes give: the rate over all of them, its noise, and the waits per batch (those of the
    stepped passes where there are any: what the step waits for), each pass's skipped batches left out. The noise
    is the spread of the rates of parts of the passes (:meth:`Pass.chunk_rates`; passes too short to split are
    timed together, consecutive ones making parts of at least ``PART_SECONDS``), or with ``by_pass`` of the passes
    themselves (cold epochs, whose rate climbs within each as the first reads make way for the later ones), where
    there are 2 or more."""
    samples = seconds = 0.0
    parts: list[float] = []
    short = [0, 0.0]  # samples and seconds of consecutive passes each too short to split: timed as one part
    for p in passes:
        n, s = p.span(skip)
        samples, seconds = samples + n, seconds + s
        if s >= 2 * PART_SECONDS:
            parts += p.chunk_rates(skip)
            continue
        short = [short[0] + n, short[1] + s]
        if short[1] >= PART_SECONDS:
            parts.append(short[0] / short[1])
            short = [0, 0.0]
    if (by_pass and len(passes) >= 2) or len(parts) < 2:
        parts = [p.rate(skip) for p in passes]
    waits = [w for p in (stepped or passes) for w in p.waits[p.skipped(skip):]]
    figures: dict[str, Any] = {
        "samples": int(samples), "seconds": seconds, "samples_per_s": samples / seconds if seconds else 0.0,
        "batches": sum(len(p.sizes) for p in passes), "passes": len(passes),
        "skipped_batches": sum(p.skipped(skip) for p in passes),
        "noise": spread(parts), "samples_per_s_parts": parts,
        **wait_summary(waits), "waits_ms": [round(w * 1e3, 3) for w in waits], "data_stall": None,
    }
    if stepped:
        step = sum(p.step_s * (len(p.sizes) - p.skipped(skip)) for p in stepped)
        waited = sum(sum(p.waits[p.skipped(skip):]) for p in stepped)
        figures["data_stall"] = waited / (waited + step) if waited + step else 0.0
    return figures


def _size_pass(rate: float, seconds: float, batches: int, batch_size: int, step_s: float, skip: int) -> int:
    """Samples for a pass that measures about ``seconds`` at ``rate`` (or at a step's pace) and at least ``batches``
    batches, in whole batches."""
    per_batch = max(batch_size / rate if rate else 0.0, step_s)
    timed = math.ceil(seconds / per_batch) if per_batch else batches
    return (max(batches, timed, SKIP_ABOVE * skip - skip) + skip) * batch_size


def _stop(loader: Any) -> None:
    """Stop the loader's workers now and unmap what this process mapped: nothing reads any more."""
    pool = getattr(loader, "worker_pool", None)
    if pool is not None:
        pool.close()


@dataclass
class Figure:
    """How one figure is read: the loader's settings, the time to read for, the step, the output expected."""

    batch_size: int
    workers: int | None  # None: make_loader's default
    min_seconds: float
    step_s: float = 0.0
    expected: tuple | None = None
    seed: int = 0

    @property
    def max_seconds(self) -> float:
        """Wall time after which a warm figure stops adding passes (its first pass, an epoch, may take longer)."""
        return 4 * self.min_seconds * (2 if self.step_s else 1)

    @property
    def cold_seconds(self) -> float:
        """Wall time after which a cold figure reads no further epoch (each starts a loader and evicts)."""
        return 2 * self.min_seconds * (2 if self.step_s else 1)


def _measured(passes: list[Pass], skip: int) -> tuple[float, int]:
    """(seconds, batches) the passes' rate is taken over."""
    return (sum(p.span(skip)[1] for p in passes),
            sum(len(p.sizes) - p.skipped(skip) for p in passes))


def warm_figure(target: Target, fig: Figure, status: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``target`` read warm by one loader, for at least ``fig.min_seconds`` and :data:`MIN_BATCHES` batches per
    worker (then as long again with the step, if any): a short pass that is not counted (the workers' first
    batches are slower for longer than the batches any pass leaves out: first touches of the dataset and of the
    batch memory), then passes sized from the rate measured so far."""
    prewarm(target.files)
    resident = resident_fraction(target.files)
    ds = target.open()
    sampler = RepeatSampler(len(ds), fig.seed)
    loader, threads = build_loader(ds, fig.batch_size, fig.workers, sampler=sampler)
    skip = max(1, loader.plan.workers)
    least = MIN_BATCHES * skip
    where = f"{target.dataset} {target.store}"
    started = time.perf_counter()
    sampler.length = (SKIP_ABOVE * skip + 1) * fig.batch_size
    warmup = timed_pass(loader, 0.0, fig.expected, where)
    estimate = max(warmup.chunk_rates(skip, part_seconds=0.0) or [warmup.rate(skip)])
    passes: list[Pass] = []
    stepped: list[Pass] = []
    for done, step_s in ((passes, 0.0), (stepped, fig.step_s)):
        if done is stepped and not step_s:
            break
        while True:
            seconds, batches = _measured(done, skip)
            if done and ((seconds >= fig.min_seconds and batches >= least)
                         or time.perf_counter() - started > fig.max_seconds):
                break
            measured = _measured(passes, skip)[0]
            rate = sum(p.span(skip)[0] for p in passes) / measured if measured else estimate
            sampler.length = _size_pass(rate, fig.min_seconds - seconds, least - batches, fig.batch_size,
                                        step_s, skip)
            if status is not None:
                status(f"{where}: {sampler.length} samples{' with the step' if step_s else ''}")
            done.append(timed_pass(loader, step_s, fig.expected, where))
    plan = loader.plan
    _stop(loader)
    del loader, ds
    release_handles()
    row = pass_figures(passes, stepped, skip)
    row.update(first_batch_s=warmup.arrivals[0] if warmup.arrivals else None, threads=threads, plan=plan,
               resident_before=resident, epochs_read=sampler.epoch)
    return row


def _cold_length(count: int, warm_rate: float | None, fig: Figure, skip: int) -> int:
    """Samples a cold epoch reads: all, or where they would take longer than ``fig.min_seconds`` at the warm rate,
    as many whole batches as would take that long (never fewer than the batches left out, four times over)."""
    if not warm_rate:
        return count
    batches = max(math.ceil(warm_rate * fig.min_seconds / fig.batch_size), SKIP_ABOVE * skip + 1)
    return min(count, batches * fig.batch_size)


def _next_kind(free: list[Pass], stepped: list[Pass], fig: Figure, skip: int) -> str | None:
    """Which kind of cold epoch to read next (alternating while both are short of the minimum time), or None."""
    need_free = not free or sum(p.span(skip)[1] for p in free) < fig.min_seconds
    need_step = bool(fig.step_s) and (not stepped or sum(p.span(skip)[1] for p in stepped) < fig.min_seconds)
    if need_free and need_step:
        return "stepped" if len(stepped) < len(free) else "free"
    return "free" if need_free else "stepped" if need_step else None


def cold_figure(target: Target, fig: Figure, status: Callable[[str], Any] | None = None,
                warm_rate: float | None = None) -> dict[str, Any]:
    """``target`` read cold: single epochs, each by a fresh loader whose workers started before the files were
    evicted, until ``fig.min_seconds`` were measured (and, with a step, as long again with the step), or
    :data:`MAX_COLD_EPOCHS` epochs. Where an epoch would take longer than ``fig.min_seconds`` at ``warm_rate``
    (the target's warm rate, where measured), a random part of it that would not is read instead."""
    passes: list[Pass] = []
    stepped: list[Pass] = []
    resident: list[float | None] = []
    started = time.perf_counter()
    plan: Any = None
    threads = first = None
    skip = 1
    where = f"{target.dataset} {target.store}"
    for epoch in range(MAX_COLD_EPOCHS):
        kind = _next_kind(passes, stepped, fig, skip)
        if kind is None or (passes and time.perf_counter() - started > fig.cold_seconds):
            break
        if status is not None:
            status(f"{where}: cold epoch {epoch + 1}")
        ds = target.open()
        sampler = RepeatSampler(len(ds), fig.seed + epoch)
        loader, threads = build_loader(ds, fig.batch_size, fig.workers, sampler=sampler)
        sampler.length = 0
        for _ in loader:  # an empty pass: the workers start, and read nothing
            pass
        release_handles()
        evict(target.files)
        resident.append(resident_fraction(target.files))
        sampler.length = _cold_length(len(ds), warm_rate, fig, max(1, loader.plan.workers))
        p = timed_pass(loader, fig.step_s if kind == "stepped" else 0.0, fig.expected, where)
        (stepped if kind == "stepped" else passes).append(p)
        first = first if first is not None or not p.arrivals else p.arrivals[0]
        plan, skip = loader.plan, max(1, loader.plan.workers)
        _stop(loader)
        del loader, ds
        release_handles()
    row = pass_figures(passes, stepped, skip, by_pass=True)
    known = None if any(r is None for r in resident) else max(r for r in resident if r is not None)
    row.update(first_batch_s=first, threads=threads, plan=plan, resident_before=known, epochs_read=len(passes))
    return row

"""What bounds a loader on this machine, measured in the same run: memory-copy bandwidth, the disk's sequential
read speed, and each dataset's decode ceiling (its stored payloads decoded by a process pool on every core, with
no loader, through the reader's own decode, between its rows' runs); and each row's ceiling and fraction of it."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..formats.base import Sample
from ..reading.scratch import decode_buffer
from ..system import process_context, usable_cores
from .cache import BLOCK, EVICTED_BELOW, evict, release_handles, resident_fraction
from .targets import Target

PAYLOAD_LIMIT = 256 << 20  # stored bytes held in memory for the decode ceiling


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
    shape = state["dataset"].output_shape()
    # one batch row, reused as a batch is, and placed as a batch's rows are (where decodes run fastest)
    _POOL["out"] = None if shape is None else decode_buffer(int(np.prod(shape))).reshape(shape)
    _POOL["decode_row"] = state["dataset"].row_decoder()


def decode_like_reader(dataset: Any, payload: Any, index: int, out: np.ndarray | None,
                       decode_row: Any = None) -> np.ndarray:
    """What a reader does to one stored sample at read time (decode, resize/crop, write into its batch row),
    through the dataset's own decode path, with no read: the one place the benchmark calls it. With ``out``
    that is what a batch read runs per row, :meth:`~packer.reading.decoding.Decoding.row_decoder` (pass one in
    ``decode_row`` to make it once); without, :meth:`~packer.reading.decoding.Decoding.decode_array`. ``payload`` is
    what ``raw_sample`` returns: encoded bytes, or the raw array."""
    shape = payload.shape if isinstance(payload, np.ndarray) else (0, 0, 0)
    sample = Sample(payload, 0, shape, None)
    if out is None:
        return dataset.decode_array(index, sample, None, dataset.epoch)
    return (decode_row or dataset.row_decoder())(index, sample, out, dataset.epoch)


def _decode_range(bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    for index in range(lo, hi):
        decode_like_reader(_POOL["dataset"], _POOL["payloads"][index], index, _POOL["out"], _POOL["decode_row"])
    return hi - lo


def _started(_: int) -> int:
    return os.getpid()


class DecodePool:
    """``processes`` processes that decode ``payloads`` (samples 0, 1, ... of ``dataset``, as :meth:`raw_sample`
    gives them) as ``dataset`` does at read time, with no loader: what a loader on these cores could give for
    these stored bytes. A context manager; :meth:`round` measures once. The processes wait idle between
    rounds, so rounds can be taken between a loader's runs."""

    def __init__(self, dataset: Any, payloads: Sequence[Any], processes: int | None = None,
                 min_seconds: float = 0.4):
        self.processes = processes or usable_cores()
        self.state = {"dataset": dataset, "payloads": list(payloads)}
        n = len(self.state["payloads"])
        per = max(1, math.ceil(n / (self.processes * 4)))  # several chunks per process to balance uneven images
        self.chunks = [(a, min(n, a + per)) for a in range(0, n, per)]
        self.min_seconds = min_seconds
        self.pool: Any = None

    def __enter__(self) -> DecodePool:
        self.pool = process_context().Pool(self.processes, initializer=_pool_init, initargs=(self.state,))
        self.pool.map(_started, range(self.processes))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.terminate()
        self.pool.join()

    def round(self) -> float:
        """Samples per second over at least ``min_seconds`` and at least one pass over the payloads: as long
        as an epoch of the rows it bounds."""
        done, t = 0, time.perf_counter()
        for _ in range(100):  # repeat small sets until the timing is long enough to trust
            done += sum(self.pool.imap_unordered(_decode_range, self.chunks))
            if time.perf_counter() - t >= self.min_seconds:
                break
        return done / (time.perf_counter() - t)


def decode_rates(dataset: Any, payloads: Sequence[Any], *, processes: int | None = None,
                 min_seconds: float = 0.4, rounds: int = 3) -> list[float]:
    """``rounds`` rounds of a :class:`DecodePool` in a row: one rate per round."""
    with DecodePool(dataset, payloads, processes, min_seconds) as pool:
        return [pool.round() for _ in range(rounds)]


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


def measure_limits(work: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Memory-copy bandwidth and disk read speed; the decode ceilings are added per target by
    :func:`interleaved_ceiling`, between its runs."""
    limits: dict[str, Any] = {"processes": usable_cores(), "decode": {}}
    limits["memory_copy_gb_per_s"] = memory_bandwidth() / 1e9
    disk = disk_read_speed(work, settings["disk_test_mb"]) if settings["disk_test_mb"] else None
    limits["disk"] = disk
    return limits


@contextlib.contextmanager
def interleaved_ceiling(limits: dict[str, Any], target: Target) -> Iterator[Callable[[], Any] | None]:
    """Measure ``target``'s decode ceiling side by side with its rows: yields a function that takes one round
    of a :class:`DecodePool` (call it before each of the target's runs; None where no decode ceiling applies),
    and on exit puts the median of the rounds in ``limits["decode"]``, every round beside it.

    Why interleaved, and the median: on a shared host the cores' speed itself varies, by tens of percent between
    the 10th and the 90th percentile of one decode loop even with the load average under 1
    (docs/benchmarks.md). The ceiling was the best of three rounds taken at the start of a 15-minute run:
    near the top of that spread and minutes away from the rows, each of which is a median of runs. Taken
    between the runs, as a median, the ceiling sees the host as the rows do."""
    key = ceiling_key(target)
    if not limits or key in limits["decode"] or target.pipeline != "val":  # no ceiling model for train yet
        yield None
        return
    if target.store_mode == "raw" and not (target.read_resize or target.read_crop):
        limits["decode"][key] = {"kind": "memcpy", "samples_per_s": None}
        yield None
        return
    ds = target.open()
    payloads = _collect_payloads(ds)
    del ds
    release_handles()
    rates: list[float] = []
    # a fresh dataset, never opened: the pool only decodes, and nothing stays mapped for the cold runs
    with DecodePool(target.open(), payloads, limits["processes"]) as pool:
        yield lambda: rates.append(pool.round())
    release_handles()
    kind = "resize" if target.store_mode == "raw" else "decode"
    limits["decode"][key] = {"kind": kind, "samples_per_s": statistics.median(rates) if rates else None,
                             "rounds": rates, "payloads": len(payloads)}


def ceiling_key(target: Target) -> str:
    """Where ``target``'s decode ceiling is kept: one per dataset, store and read-time work."""
    return f"{target.dataset}|{target.store}|{target.decoder}|{target.read_resize}|{target.read_crop}"


def add_ceilings(rows: list[dict], targets: list[Target], limits: dict[str, Any]) -> None:
    """Give each row its ceiling (the lowest bound that applies) and its fraction of it."""
    keys = {(t.dataset, t.store, t.pipeline): ceiling_key(t) for t in targets}
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
            row["ceiling_kind"] = min(candidates, key=candidates.__getitem__)
            row["ceiling_samples_per_s"] = candidates[row["ceiling_kind"]]
            row["fraction_of_ceiling"] = row["samples_per_s"] / row["ceiling_samples_per_s"]
        else:
            row["ceiling_kind"] = row["ceiling_samples_per_s"] = row["fraction_of_ceiling"] = None

"""What bounds a loader on this machine, measured in the same run: memory-copy bandwidth, the disk's sequential
read speed, and each dataset's decode ceiling (its stored payloads decoded by a process pool on every core, with
no loader, through the reader's own decode, just before its rows); and each row's ceiling and fraction of it."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..formats.base import Sample
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
    _POOL["out"] = None if shape is None else np.empty(shape, np.uint8)  # one batch row, reused as a batch is
    _POOL["decode_row"] = state["dataset"].row_decoder()


def decode_like_reader(dataset: Any, payload: Any, index: int, out: np.ndarray | None,
                       decode_row: Any = None) -> np.ndarray:
    """What a reader does to one stored sample at read time (decode, resize/crop, write into its batch row),
    through the dataset's own decode path, with no read: the one place the benchmark calls it. With ``out``
    that is what a batch read runs per row, :meth:`~packer.decoding.Decoding.row_decoder` (pass one in
    ``decode_row`` to make it once); without, :meth:`~packer.decoding.Decoding.decode_array`. ``payload`` is
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


def decode_rates(dataset: Any, payloads: Sequence[Any], *, processes: int | None = None,
                 min_seconds: float = 0.4, rounds: int = 3) -> list[float]:
    """Samples per second ``processes`` processes decode ``payloads`` (samples 0, 1, ... of ``dataset``, as
    :meth:`raw_sample` gives them) as ``dataset`` does at read time, with no loader: what a loader on these
    cores could give for these stored bytes. One rate per round, each round at least ``min_seconds`` and at
    least one pass over ``payloads``: as long as an epoch of the rows it bounds, and as many rounds as their
    repeats, so that the ceiling (their median, :func:`add_decode_ceiling`) and the rows are the same statistic.
    """
    processes = processes or usable_cores()
    state = {"dataset": dataset, "payloads": list(payloads)}
    n = len(state["payloads"])
    per = max(1, math.ceil(n / (processes * 4)))  # several chunks per process to balance uneven images
    chunks = [(a, min(n, a + per)) for a in range(0, n, per)]
    ctx = process_context()
    rates = []
    with ctx.Pool(processes, initializer=_pool_init, initargs=(state,)) as pool:
        pool.map(_started, range(processes))
        for _ in range(rounds):
            done, t = 0, time.perf_counter()
            for _ in range(100):  # repeat small sets until the timing is long enough to trust
                done += sum(pool.imap_unordered(_decode_range, chunks))
                if time.perf_counter() - t >= min_seconds:
                    break
            rates.append(done / (time.perf_counter() - t))
    return rates


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
    :func:`add_decode_ceiling`, just before its rows are measured."""
    limits: dict[str, Any] = {"processes": usable_cores(), "decode": {}}
    limits["memory_copy_gb_per_s"] = memory_bandwidth() / 1e9
    disk = disk_read_speed(work, settings["disk_test_mb"]) if settings["disk_test_mb"] else None
    limits["disk"] = disk
    return limits


def add_decode_ceiling(limits: dict[str, Any], target: Target, rounds: int = 3) -> None:
    """Measure ``target``'s decode ceiling into ``limits["decode"]``, right before its own rows: the median of
    ``rounds`` rounds of :func:`decode_rates` (pass the rows' repeats), the statistic the rows use.

    Why not the best round: on a shared host the cores' speed itself varies. Measured here with the load
    average under 1, one thread decoding the same 100 JPEGs over and over for 20 s ran at 2,851 images/s at
    the 10th percentile, 3,101 at the median and 3,667 at the 90th; the best of three rounds sits near the top
    of that spread, a median of three epochs near its middle, so the best round bounded every row ~15% low
    whatever the loader did. Why right before: the speed also drifts over minutes (one image's decode took
    182-213 us in runs minutes apart), and a run of every table takes 15."""
    key = ceiling_key(target)
    if key in limits["decode"] or target.pipeline != "val":  # no ceiling model for the train pipeline yet
        return
    if target.store_mode == "raw" and not (target.read_resize or target.read_crop):
        limits["decode"][key] = {"kind": "memcpy", "samples_per_s": None}
        return
    ds = target.open()
    payloads = _collect_payloads(ds)
    del ds
    release_handles()
    # a fresh dataset, never opened: the pool only decodes, and nothing stays mapped for the cold runs
    rates = decode_rates(target.open(), payloads, processes=limits["processes"], rounds=rounds)
    release_handles()
    kind = "resize" if target.store_mode == "raw" else "decode"
    limits["decode"][key] = {"kind": kind, "samples_per_s": statistics.median(rates), "rounds": rates,
                             "payloads": len(payloads)}


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
            row["ceiling_kind"] = min(candidates, key=candidates.get)
            row["ceiling_samples_per_s"] = candidates[row["ceiling_kind"]]
            row["fraction_of_ceiling"] = row["samples_per_s"] / row["ceiling_samples_per_s"]
        else:
            row["ceiling_kind"] = row["ceiling_samples_per_s"] = row["fraction_of_ceiling"] = None

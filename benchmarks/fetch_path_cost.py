"""Where a remote epoch's CPU goes: one packed dataset read from a local S3 server with a cache smaller than it,
beside the same dataset read from local files, with the fetch path's CPU per block split by step.

    python -m packer pack bench-out/data-2000 /tmp/fp/lmdb --format lmdb --store jpeg --resize 256 --no-shuffle
    python benchmarks/fetch_path_cost.py /tmp/fp/lmdb                  # cache 1/8 of the data, 20 ms a request

The dataset is served by the lite S3 server (``peers/s3_lite.py``, as ``peers/remote_peers.py`` uses) in a child
process, so that this process's CPU is the reader's alone, with ``--latency-ms`` added to every request; it is
read through ``open_dataset("s3://...", cache_limit=..., random_resized_crop=224, flip=True)`` and
``make_loader(ds, batch_size=64, shuffle="blocks", num_workers=2)``, the case of ``remote_peers.py``, and then
read the same way from its local folder (warm). Each read is ``--rounds`` fresh loaders of ``--epochs`` epochs,
remote and local in turn; the figures are medians over every round's epochs after the first.

Per epoch: images a second, and the CPU seconds of the main process (the fetch-ahead's threads), of the
DataLoader workers (read from ``/proc``) and of the server. Per block fetched by the main process: the thread CPU
of each step of :meth:`packer.remote.cache.Cache.obtain`, measured by wrapping the functions that do them with
``time.thread_time`` (the wrapping itself costs a few microseconds a call): the GET, the room made in the cache
(the scan and the evictions, under the node's eviction lock), the rest of the reservation (the download file,
made and sized), the per-object lock file, the block's write, the pins, and the rest of ``obtain``. Blocks a
worker fetched itself (one the fetch-ahead had not reached) are not in these figures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE.parent / "tests")]

import s3_lite  # noqa: E402 - in peers/, beside the remote benchmark

STEPS = {  # what the figure is called: (module, attribute, function), its thread CPU summed per call
    "GET": ("packer.remote.ranges", None, "_cat"),
    "room (scan, evictions)": ("packer.remote.cache", "Cache", "_make_room"),
    "reservation (the room included)": ("packer.remote.cache", "Cache", "_reserve"),
    "write": ("packer.remote.ranges", None, "_write_over"),
    "pins": ("packer.remote.cache", "Cache", "pin"),
    "obtain (all of it)": ("packer.remote.cache", "Cache", "obtain"),
}
LOCK_STEP = "lock file (take, let go)"


def ticks_to_seconds(ticks: int) -> float:
    return ticks / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (its own, not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return ticks_to_seconds(int(fields[11]) + int(fields[12]))


def children_cpu(parent: int) -> float:
    """CPU seconds of the living children of ``parent`` (the DataLoader's workers)."""
    total = 0.0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(stat).read_text().rsplit(") ", 1)[1].split()
            if int(fields[1]) == parent:
                total += ticks_to_seconds(int(fields[11]) + int(fields[12]))
    return total


def own_cpu() -> float:
    times = os.times()
    return times.user + times.system


class Steps:
    """Thread CPU and calls of each step of the fetch path, in this process, while :meth:`counting`."""

    def __init__(self) -> None:
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def _timed(self, name: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - began
                self.calls[name] += 1
        return timed

    def _timed_lock(self, function: Callable) -> Callable:
        @contextlib.contextmanager
        def timed(*args: Any, **kwargs: Any) -> Iterator[None]:
            began = time.thread_time()
            with function(*args, **kwargs):
                self.seconds[LOCK_STEP] += time.thread_time() - began  # taking it
                yield
                began = time.thread_time()
            self.seconds[LOCK_STEP] += time.thread_time() - began  # letting it go
            self.calls[LOCK_STEP] += 1
        return timed

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        import importlib

        from packer.remote.cache import Cache

        saved = []
        for name, (module_name, holder_name, attribute) in STEPS.items():
            module = importlib.import_module(module_name)
            holder = getattr(module, holder_name) if holder_name else module
            saved.append((holder, attribute, getattr(holder, attribute)))
            setattr(holder, attribute, self._timed(name, getattr(holder, attribute)))
        saved.append((Cache, "_locked", Cache._locked))
        Cache._locked = self._timed_lock(Cache._locked)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for holder, attribute, original in reversed(saved):
                setattr(holder, attribute, original)


def read(url: str, options: dict[str, Any], epochs: int, server: int | None, steps: Steps | None
         ) -> list[dict[str, float]]:
    """``epochs`` epochs of a fresh dataset and loader: per epoch its seconds, images and CPU seconds."""
    import packer

    dataset = packer.open_dataset(url, random_resized_crop=224, flip=True, seed=0, **options)
    loader = packer.make_loader(dataset, batch_size=64, shuffle="blocks", seed=0, num_workers=2, tuned=False)
    rows = []
    with steps.counting() if steps is not None else contextlib.nullcontext():
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            began, main, workers = time.perf_counter(), own_cpu(), children_cpu(os.getpid())
            served = process_cpu(server) if server else 0.0
            images = sum(len(labels) for _, labels in loader)
            rows.append({"seconds": time.perf_counter() - began, "images": images, "main": own_cpu() - main,
                         "workers": children_cpu(os.getpid()) - workers,
                         "server": (process_cpu(server) - served) if server else 0.0})
    del loader, dataset
    return rows


def data_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def rate(rows: list[dict[str, float]]) -> float:
    """The median epoch's images a second."""
    return statistics.median(row["images"] / row["seconds"] for row in rows)


def report(args: argparse.Namespace, limit: int, remote: list[dict[str, float]], local: list[dict[str, float]],
           steps: Steps, loads: tuple[str, str]) -> str:
    lines = [f"{args.dataset}: cache_limit {limit:,} bytes ({args.cache_fraction:g} of the data), "
             f"{args.latency_ms:g} ms a request, {args.rounds} rounds of {args.epochs} epochs, "
             f"{time.strftime('%Y-%m-%d %H:%M')}; load average {loads[0]} at the start, {loads[1]} at the end",
             "",
             "| read | img/s | CPU s an epoch: main | workers | server |",
             "|---|---:|---:|---:|---:|"]
    for name, rows in (("remote", remote), ("local, warm", local)):
        lines.append(f"| {name} | {rate(rows):,.0f} | {median(rows, 'main'):.3f} | "
                     f"{median(rows, 'workers'):.3f} | {median(rows, 'server'):.3f} |")
    lines += ["", f"remote / local: {rate(remote) / rate(local):.2f}", ""]
    fetched = steps.calls["GET"]
    lines += [f"per block fetched by the main process ({fetched:,} blocks, every epoch of every round):", "",
              "| step | ms of CPU a block |", "|---|---:|"]
    for name in ["GET", "room (scan, evictions)", "reservation (the room included)", LOCK_STEP, "write", "pins",
                 "obtain (all of it)"]:
        lines.append(f"| {name} | {steps.seconds[name] * 1e3 / max(1, fetched):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", type=Path, help="a packed dataset's folder")
    parser.add_argument("--cache-fraction", type=float, default=0.125)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not (args.dataset / "manifest.json").is_file():
        parser.error(f"{args.dataset}: not a packed dataset (no manifest.json); pack one first (see --help)")
    if args.epochs < 2:
        parser.error("--epochs: at least 2 (the first epoch of each round is not counted)")
    limit = int(data_bytes(args.dataset) * args.cache_fraction)
    loads = [" ".join(f"{v:.2f}" for v in os.getloadavg())]
    steps = Steps()
    remote: list[dict[str, float]] = []
    local: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="fetch-path-") as work:
        served_root = Path(work) / "s3"
        shutil.copytree(args.dataset, served_root / "bench" / "data", copy_function=os.link)
        with s3_lite.served_in_child(served_root, args.latency_ms / 1000) as (endpoint, server):
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "benchmark")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "benchmark")
            for round_ in range(args.rounds):
                cache = Path(work) / f"cache-{round_}"
                options = {"cache_dir": cache, "cache_limit": limit, "storage_options": {"endpoint_url": endpoint}}
                remote += read("s3://bench/data", options, args.epochs, server, steps)[1:]
                local += read(str(args.dataset), {}, args.epochs, None, None)[1:]
                shutil.rmtree(cache, ignore_errors=True)
    loads.append(" ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(report(args, limit, remote, local, steps, (loads[0], loads[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

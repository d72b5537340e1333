"""``packer bench URL``: one random-order epoch of a remote dataset with an empty cache (cold: the open, which
fetches every file, included), and a second epoch of the same dataset (warm: read from the cache), beside two
epochs of the cached files opened as a local dataset (the first with their pages dropped from the page cache, so
cold, where nothing else maps them, and including the open). Each row gives samples/s, and the bytes and
requests fetched over the network."""

from __future__ import annotations

import gc
import tempfile
import time
from typing import Any

from ..loading.loader import make_loader
from ..reading.dataset import open_dataset
from ..remote.fetch import STATS
from .cache import evict


def _epoch(loader) -> int:
    return sum(len(labels) for _, labels in loader)


def bench_url(url: str, batch_size: int = 64, workers: int = 0, resize: int | tuple[int, int] | None = 256,
              center_crop: int | tuple[int, int] | None = 224,
              storage_options: dict | None = None) -> list[dict[str, Any]]:
    """Rows ``{"run", "samples", "seconds", "samples_per_s", "bytes", "requests"}`` for the cold epoch, the warm
    epoch, and two epochs of the same cached files opened as a local dataset.

    Args:
        url: a packed dataset's URL.
        batch_size, workers: the loader's batch size and worker processes.
        resize, center_crop: the read-time resize and crop (so that batches have one shape).
        storage_options: for the fsspec filesystem.

    Returns:
        the four rows, in that order.
    """
    rows = []
    with tempfile.TemporaryDirectory(prefix="packer-bench-") as cache_dir:

        def run(name: str, make) -> Any:
            before = dict(STATS)
            start = time.perf_counter()
            ds, loader = make()
            samples = _epoch(loader)
            seconds = time.perf_counter() - start
            rows.append({"run": name, "samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
                         "bytes": STATS["bytes"] - before["bytes"],
                         "requests": STATS["requests"] - before["requests"]})
            return ds, loader

        options: dict[str, Any] = {"resize": resize, "center_crop": center_crop}

        def opened(ds) -> tuple:
            return ds, make_loader(ds, batch_size=batch_size, shuffle=True, num_workers=workers)

        ds, loader = run("cold (empty cache)", lambda: opened(open_dataset(
            url, storage_options=storage_options, cache_dir=cache_dir, **options)))
        run("warm (second epoch)", lambda pair=(ds, loader): pair)
        root = ds.root
        del ds, loader  # unmapped (where nothing else holds them), so that evict can drop the pages
        gc.collect()
        evict(path for path in root.rglob("*") if path.is_file())
        local = run("local files, page cache dropped", lambda: opened(open_dataset(root, **options)))
        run("local files, second epoch", lambda: local)
    return rows


def format_bench_url(url: str, rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [f"{url}: one random-order epoch each", "",
             "| run | samples/s | seconds | bytes fetched | requests |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['run']} | {row['samples_per_s']:.0f} | {row['seconds']:.2f} | {row['bytes']:,} | "
                     f"{row['requests']} |")
    return "\n".join(lines)

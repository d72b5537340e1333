"""The harness of the remote-read adapters (``remote_*.py``), run by ``benchmarks/peers/remote_peers.py``.

A remote adapter defines ``TOOL``, ``versions()``, ``pack(src, dest, block_bytes)`` (write the tool's own copy of
the image folder ``src`` into ``dest``, in blocks, shards or chunks of about ``block_bytes``) and
``make_loader(url, cache_dir, cache_limit, batch_size, workers, block_bytes)`` (an iterable of
``(images, labels)`` batches read from ``url`` through the tool's own cache in ``cache_dir``, kept under
``cache_limit`` bytes; ``url`` may be a local folder for a local row), then calls :func:`main`. Like the other
adapters it runs in the tool's own venv and imports only the standard library, numpy, Pillow, torch and the
tool.

    python adapters/remote_X.py pack --src FOLDER --dest DIR --block-bytes N
    python adapters/remote_X.py read --url URL --cache-dir DIR --cache-limit N --batch-size 64 --workers 2 \\
        --epochs 2 --result OUT.json

``read`` writes ``{"epochs": [{samples, seconds, samples_per_s, first_batch_s}], "labels": [[...] per epoch],
"versions": {...}}``, or ``{"error": "..."}``; the labels are those the loader yielded, in order, so the
driver can score each tool's shuffle with packer's ``batch_mixing``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import batch_parts, check_images


def run_epochs(loader: Any, epochs: int) -> tuple[list[dict[str, float]], list[list[int]]]:
    """Iterate ``loader`` ``epochs`` times: each epoch's timings and the labels it yielded, in order. Every batch
    must be uint8 ``(B, 3, 224, 224)`` with B labels."""
    timings, labels = [], []
    for _ in range(epochs):
        seen: list[int] = []
        first = None
        start = time.perf_counter()
        for batch in loader:
            images, batch_labels = batch_parts(batch)
            size = check_images(images)
            values = [int(v) for v in (batch_labels.tolist() if hasattr(batch_labels, "tolist") else batch_labels)]
            if len(values) != size:
                raise ValueError(f"a batch of {size} images came with {len(values)} labels")
            seen.extend(values)
            if first is None:
                first = time.perf_counter() - start
        seconds = time.perf_counter() - start
        timings.append({"samples": len(seen), "seconds": seconds, "first_batch_s": first or 0.0,
                        "samples_per_s": len(seen) / seconds if seconds else 0.0})
        labels.append(seen)
    return timings, labels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pack an image folder with one tool, or read it back from a URL.")
    sub = p.add_subparsers(dest="command", required=True)
    pack = sub.add_parser("pack")
    pack.add_argument("--src", type=Path, required=True)
    pack.add_argument("--dest", type=Path, required=True)
    pack.add_argument("--block-bytes", type=int, required=True)
    read = sub.add_parser("read")
    read.add_argument("--url", required=True)
    read.add_argument("--cache-dir", type=Path, required=True)
    read.add_argument("--cache-limit", type=int, default=0, help="bytes; 0: the tool's default (a local row)")
    read.add_argument("--batch-size", type=int, default=64)
    read.add_argument("--workers", type=int, default=2)
    read.add_argument("--epochs", type=int, default=2)
    read.add_argument("--block-bytes", type=int, default=0, help="packer's block_bytes (LMDB, HDF5); 0: default")
    read.add_argument("--result", type=Path, required=True)
    return p.parse_args(argv)


def main(adapter: ModuleType, argv: list[str] | None = None) -> None:
    """Entry point of every remote adapter script."""
    args = parse_args(argv)
    if args.command == "pack":  # packer's own copies are packed by the driver, in its interpreter
        adapter.pack(args.src, args.dest, args.block_bytes)
        return
    try:
        loader = adapter.make_loader(args.url, args.cache_dir, args.cache_limit, args.batch_size, args.workers,
                                     args.block_bytes)
        timings, labels = run_epochs(loader, args.epochs)
    except Exception as exc:  # the driver reports this line as the row's error
        traceback.print_exc()
        lines = str(exc).strip().splitlines() or [""]
        cause = f" ({lines[-1].strip()})" if len(lines) > 1 else ""  # a worker's exception: its last line
        args.result.write_text(json.dumps({"error": f"{type(exc).__name__}: {lines[0]}{cause}"}))
        sys.exit(1)
    args.result.write_text(json.dumps({"epochs": timings, "labels": labels, "versions": adapter.versions()}))

"""Where the loaders lose against the decode ceiling, one layer at a time, side by side in one process.

    python benchmarks/loader_gap.py DEST [--crop 224] [--rounds 3]

For a packed dataset read with the validation pipeline (``--crop``: a read-time centre crop), prints samples/s and
the fraction of the decode ceiling (``packer bench``'s, :func:`packer.bench.decode_rates`) for, in order:

- ``simplejpeg x1``: simplejpeg alone on one thread, no row to write (JPEG stores only);
- ``row x1``: the dataset's row decoder (what a batch read runs per image) into one reused row, one thread;
- ``read_batch x1``: whole batches, one thread;
- ``rows x2``: two plain threads, each through the row decoder into its own reused row: no batches, no loader;
- ``read_batch x2``: whole batches on two threads (``read_batch(threads=2)``), in order;
- ``loader threads``: an epoch of ``make_loader(ds, 64, num_workers=0)``: the in-process loader, decode threads,
  shuffled, prefetched in the background;
- ``loader pool``: an epoch of ``make_loader(ds, 64)``: the default, packer's worker pool where it applies
  (:mod:`packer.loading.workers`), else the same as ``loader threads``.

Each figure is the median of ``--rounds`` rounds, the rounds of every layer interleaved, so that the host's
drifting speed touches them all alike.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import simplejpeg

import packer
from packer.bench import decode_rates
from packer.formats.base import Sample
from packer.reading.scratch import decode_buffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="a packed dataset")
    parser.add_argument("--crop", type=int, help="read-time centre crop")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kwargs = {"center_crop": args.crop} if args.crop else {}
    ds = packer.open_dataset(args.dest, **kwargs)
    n = len(ds)
    payloads = [ds.raw_sample(i)[0] for i in range(n)]
    samples = [Sample(p, 0, p.shape if isinstance(p, np.ndarray) else (0, 0, 0), None) for p in payloads]
    shape = ds.output_shape()
    batches = [list(range(a, min(n, a + 64))) for a in range(0, n, 64)]

    def rate(fn) -> float:
        start = time.perf_counter()
        count = fn()
        return count / (time.perf_counter() - start)

    def rows(lo: int, hi: int) -> int:
        row, decode_row = decode_buffer(int(np.prod(shape))).reshape(shape), ds.row_decoder()  # as a batch's
        for i in range(lo, hi):
            decode_row(i, samples[i], row, 0)
        return hi - lo

    def two_threads() -> int:
        threads = [threading.Thread(target=rows, args=(0, n // 2)), threading.Thread(target=rows, args=(n // 2, n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return n

    def batches_on(threads: int) -> int:
        for batch in batches:
            ds.read_batch(batch, threads=threads)
        return n

    loaders = {"loader threads": packer.make_loader(ds, 64, tuned=False, num_workers=0),
               "loader pool": packer.make_loader(ds, 64, tuned=False)}
    for loader in loaders.values():
        for _ in loader:  # open the files, start the decode threads or worker processes
            pass

    def epoch(loader) -> int:
        return sum(len(labels) for _, labels in loader)

    layers = {"rows x1": lambda: rows(0, n), "read_batch x1": lambda: batches_on(1), "rows x2": two_threads,
              "read_batch x2": lambda: batches_on(2),
              **{name: (lambda loader=loader: epoch(loader)) for name, loader in loaders.items()}}
    if isinstance(payloads[0], bytes) and payloads[0][:2] == b"\xff\xd8":
        layers = {"simplejpeg x1": lambda: sum(1 for p in payloads if simplejpeg.decode_jpeg(p) is not None),
                  **layers}
    results: dict[str, list[float]] = {name: [] for name in ["ceiling", *layers]}
    for _ in range(args.rounds):
        results["ceiling"] += decode_rates(packer.open_dataset(args.dest, **kwargs), payloads, rounds=1)
        for name, fn in layers.items():
            results[name].append(rate(fn))
    ceiling = statistics.median(results["ceiling"])
    print(f"{args.dest} ({n} samples{f', centre crop {args.crop}' if args.crop else ''}), median of {args.rounds}")
    for name, values in results.items():
        value = statistics.median(values)
        print(f"  {name:14s} {value:8,.0f}/s  {value / ceiling:5.0%} of the ceiling")


if __name__ == "__main__":
    main()

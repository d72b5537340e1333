"""Where one decode thread spends its time reading a packed dataset through the training pipeline.

    python benchmarks/profile_read.py bench-out/train/jpeg-max256 [--samples 1024] [--val]

Reads ``--samples`` samples in batches of 64 with ``read_batch(..., threads=1)``: once timed, once under
cProfile; prints microseconds per image and the functions that take the most time of their own. ``--val`` reads
with ``resize=256, center_crop=224`` instead of ``random_resized_crop=224, flip=True``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import packer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="a packed dataset")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--val", action="store_true", help="the validation pipeline (resize 256, crop 224)")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    pipeline = dict(resize=256, center_crop=224) if args.val else dict(random_resized_crop=224, flip=True, seed=0)
    ds = packer.open_dataset(args.dest, **pipeline)
    n = min(args.samples, len(ds))
    batches = [list(range(i, min(n, i + args.batch_size))) for i in range(0, n, args.batch_size)]
    ds.read_batch(batches[0], threads=1)  # open the files, warm the page cache
    start = time.perf_counter()
    for batch in batches:
        ds.read_batch(batch, threads=1)
    print(f"{args.dest}: {(time.perf_counter() - start) / n * 1e6:.0f} us an image, one thread, {n} samples")
    profile = cProfile.Profile()
    profile.enable()
    for batch in batches:
        ds.read_batch(batch, threads=1)
    profile.disable()
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:args.top]
    for (path, line, name), (_, _, own, _, _) in rows:
        where = f"{path.rsplit('/', 1)[-1]}:{line}"
        print(f"  {own / stats.total_tt * 100:5.1f}%  {own / n * 1e6:6.0f} us  {name} ({where})")


if __name__ == "__main__":
    main()

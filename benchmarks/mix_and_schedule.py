"""A mixture against one dataset, and a resolution schedule against a fixed size: the training pipeline's
throughput, side by side in one run (issue 48).

    python benchmarks/mix_and_schedule.py --prepare           # make the photos and the packs (not timed)
    python benchmarks/mix_and_schedule.py                     # measure
    python benchmarks/mix_and_schedule.py --data /tmp/img --images 2000 --out bench-out/mix

The image folder is packed twice, the same images in two formats (``--store jpeg --resize 256``, or the original
files with ``--resize 0``): LMDB and WebDataset shards. Every loader is ``make_loader``'s default engine (packer's
worker pool, a worker per core), batches of ``--batch-size``, ``random_resized_crop`` and ``flip``, pages warm (a
warm-up epoch each first).

- **mixture**: ``packer.mix([lmdb, wds], [1, 1], samples_per_epoch=N)``, against each dataset alone (N samples
  too): images/s of each, ``mix/lmdb``, ``mix/wds``, and ``mix/both``: against the rate reading N/2 from each
  alone would have (their harmonic mean: what mixing costs beyond the formats' own speeds).
- **schedule**: ``random_resized_crop=lambda e: 128 + 32 * e`` (128, 160, 192, 224) against a fixed 224, per
  epoch: images/s of each and ``schedule/fixed``; the last epoch is 224 in both (what the schedule itself costs).

Each figure is ``--passes`` epochs (of the same epoch number, for the schedule), taken ``--repeats`` times, the
loaders taking turns (so that both sides of a ratio see the same machine), and the median kept. Prints a markdown
table; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import packer

REPO = Path(__file__).resolve().parent.parent
SIZES = (128, 160, 192, 224)


def schedule(epoch: int) -> int:
    return SIZES[min(epoch, len(SIZES) - 1)]


def ensure_packs(data: Path, out: Path, images: int, resize: int) -> tuple[Path, Path]:
    """The image folder packed as LMDB and as WebDataset shards (``--store jpeg --resize RESIZE``; with 0 the
    original files, ``--store original``), made once."""
    if not data.is_dir():
        per_class = -(-images // 5)
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_sample_data.py"), str(data), "--per-class",
                        str(per_class), "--overwrite"], check=True)
    packs = out / "lmdb", out / "wds"
    for dest, fmt in zip(packs, ("lmdb", "wds"), strict=True):
        if not (dest / "manifest.json").exists():
            stored = {"store": "jpeg", "resize": resize} if resize else {"store": "original"}
            packer.pack(data, dest, fmt, progress=False, overwrite=True, **stored)
    return packs


def epoch_rate(loader, epoch: int | None = None, passes: int = 1) -> float:
    """Images per second over ``passes`` passes of ``loader``: each of epoch ``epoch`` when given, else the
    loader's next epochs."""
    start, n = time.perf_counter(), 0
    for _ in range(passes):
        if epoch is not None:
            loader.set_epoch(epoch)
        for batch in loader:
            n += len(batch[0])
    return n / (time.perf_counter() - start)


def measure(lmdb: Path, wds: Path, batch_size: int, repeats: int, passes: int) -> dict:
    augment = {"random_resized_crop": 224, "flip": True}
    single = {name: packer.open_dataset(path, **augment) for name, path in (("lmdb", lmdb), ("wds", wds))}
    n = len(single["lmdb"])
    mixed = packer.mix([packer.open_dataset(lmdb, **augment), packer.open_dataset(wds, **augment)], [1, 1],
                       samples_per_epoch=n)
    loaders = {name: packer.make_loader(ds, batch_size=batch_size) for name, ds in
               (("lmdb", single["lmdb"]), ("wds", single["wds"]), ("mixture", mixed))}
    scheduled = packer.open_dataset(lmdb, random_resized_crop=schedule, flip=True)
    loaders["schedule"] = packer.make_loader(scheduled, batch_size=batch_size)
    loaders["fixed"] = packer.make_loader(packer.open_dataset(lmdb, **augment), batch_size=batch_size)
    plans = {name: str(loader.plan) for name, loader in loaders.items()}
    for loader in loaders.values():  # warm-up: workers started, pages read
        epoch_rate(loader, 0)
    rates: dict[str, list[float]] = {name: [] for name in ("lmdb", "wds", "mixture")}
    for _ in range(repeats):
        for name in rates:
            rates[name].append(epoch_rate(loaders[name], passes=passes))
    per_epoch = []
    for epoch, size in enumerate(SIZES):
        taken = {"schedule": [], "fixed": []}
        for _ in range(repeats):
            for name in taken:
                taken[name].append(epoch_rate(loaders[name], epoch, passes))
        per_epoch.append({"epoch": epoch, "size": size, **{k: statistics.median(v) for k, v in taken.items()}})
    medians = {name: statistics.median(v) for name, v in rates.items()}
    both = 2 / (1 / medians["lmdb"] + 1 / medians["wds"])
    return {"images": n, "batch_size": batch_size, "repeats": repeats, "passes": passes, "cores": os.cpu_count(),
            "plans": plans,
            "mixture": {**medians, "both": both, "runs": rates}, "schedule": per_epoch}


def table(result: dict) -> str:
    m = result["mixture"]
    lines = ["| reading | images/s | ratio |", "| --- | ---: | ---: |",
             f"| lmdb alone | {m['lmdb']:.0f} | |", f"| wds alone | {m['wds']:.0f} | |",
             f"| mixture 1:1 | {m['mixture']:.0f} | mix/lmdb {m['mixture'] / m['lmdb']:.3f}, mix/wds "
             f"{m['mixture'] / m['wds']:.3f}, mix/both {m['mixture'] / m['both']:.3f} |",
             "", "| epoch | schedule size | schedule images/s | fixed 224 images/s | schedule/fixed |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for row in result["schedule"]:
        lines.append(f"| {row['epoch']} | {row['size']} | {row['schedule']:.0f} | {row['fixed']:.0f} | "
                     f"{row['schedule'] / row['fixed']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO / "bench-out" / "mix-data"), help="an image folder")
    parser.add_argument("--images", type=int, default=1000, help="images to make when --data does not exist")
    parser.add_argument("--out", default=str(REPO / "bench-out" / "mix"), help="where the packs go")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", type=int, default=5, help="epochs each timed figure spans")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--prepare", action="store_true", help="only make the data and the packs")
    parser.add_argument("--resize", type=int, default=256, help="the packs' stored size (0: the original files)")
    args = parser.parse_args()
    lmdb, wds = ensure_packs(Path(args.data), Path(args.out), args.images, args.resize)
    if args.prepare:
        return
    result = measure(lmdb, wds, args.batch_size, args.repeats, args.passes)
    print(table(result))
    print(f"\n{result['images']} images an epoch, batch {result['batch_size']}, each figure {result['passes']} "
          f"epochs, median of {result['repeats']}; "
          f"loader: {result['plans']['mixture']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

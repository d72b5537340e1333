"""Peak memory of ``packer pack`` as the dataset grows: the same photos linked 1, 2 and 4 times (and more with
``--copies``) into one ImageFolder tree, each packed by a fresh ``packer pack`` process. Peaks are the kernel's
high-water marks (``getrusage``'s ``ru_maxrss``), exact rather than sampled: the packing process's own, and the
largest of its conversion workers'.

    python benchmarks/pack_memory.py bench-out/data-3000 --work /tmp/packmem
    python benchmarks/pack_memory.py bench-out/data-3000 --copies 1,4,8 --store original --resize none \
        --center-crop none
    python benchmarks/pack_memory.py --tiny 20000,1000000 --store original --resize none --center-crop none

``--tiny N`` packs N tiny images instead (hard links of a few 8x8 JPEGs, 10 classes), so that a million images
fit on a small disk and pack in minutes: what grows with the count of images shows, not with their bytes.

The copies are hard links (no extra disk, same bytes), renamed so that every file is a sample of its own. Flat
means the peak does not grow with the number of images beyond the per-sample index every format keeps (a path,
a label and an offset or two: tens of bytes an image).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# runs `packer pack` in this process, then reports its peak and its workers' largest (ru_maxrss is in KiB)
PACK_AND_REPORT = """
import json, resource, sys
from packer.cli import main
try:
    main(sys.argv[2:], prog_name="packer")
finally:
    with open(sys.argv[1], "w") as f:
        json.dump([resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)], f)
"""


def linked_copies(src: Path, dest: Path, copies: int) -> int:
    """``dest`` as ``src``'s class folders with every file hard-linked ``copies`` times; the number of files."""
    count = 0
    for class_dir in sorted(p for p in src.iterdir() if p.is_dir()):
        (dest / class_dir.name).mkdir(parents=True, exist_ok=True)
        for path in sorted(class_dir.iterdir()):
            for k in range(copies):
                link = dest / class_dir.name / f"{path.stem}-{k}{path.suffix}"
                if not link.exists():
                    os.link(path, link)
                count += 1
    return count


def tiny_tree(dest: Path, count: int, classes: int = 10) -> int:
    """``dest`` as an ImageFolder tree of ``count`` tiny JPEGs: hard links of a few 8x8 files (one per 50,000
    links: ext4 allows 65,000 links to a file)."""
    from PIL import Image

    distinct = max(4, -(-count // 50_000))
    originals = dest.with_name(dest.name + "-originals")
    originals.mkdir(parents=True, exist_ok=True)
    files = []
    for k in range(distinct):
        path = originals / f"tiny-{k}.jpg"
        if not path.exists():
            Image.new("RGB", (8, 8), (40 * k % 256, (255 - 40 * k) % 256, k % 256)).save(path, quality=90)
        files.append(path)
    for i in range(count):
        folder = dest / f"class{i % classes:02d}"
        if i < classes:
            folder.mkdir(parents=True, exist_ok=True)
        link = folder / f"{i:08d}.jpg"
        if not link.exists():
            os.link(files[i % distinct], link)
    return count


def peak_of_pack(src: Path, dest: Path, options: list[str]) -> tuple[float, float, float]:
    """(seconds, peak RSS MB of the packing process, largest peak RSS MB of a worker) of ``packer pack src dest``."""
    report = dest.with_name(dest.name + ".peaks.json")
    command = [sys.executable, "-c", PACK_AND_REPORT, str(report), "pack", str(src), str(dest), "--quiet", *options]
    start = time.perf_counter()
    code = subprocess.run(command).returncode
    seconds = time.perf_counter() - start
    if code:
        raise SystemExit(f"packer pack {src} {dest} {' '.join(options)} failed with exit code {code}")
    own, workers = json.loads(report.read_text())
    report.unlink()
    return seconds, own / 1024, workers / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, nargs="?", help="an ImageFolder tree (e.g. bench-out/data-3000)")
    parser.add_argument("--tiny", default=None, help="pack these counts of tiny images instead of SRC (e.g. "
                        "20000,1000000)")
    parser.add_argument("--workers", default="2", help="--workers of packer pack")
    parser.add_argument("--work", type=Path, default=Path("bench-out/pack-memory"), help="scratch folder")
    parser.add_argument("--copies", default="1,2,4", help="dataset sizes, as multiples of SRC")
    parser.add_argument("--formats", default="lmdb,hdf5,wds")
    parser.add_argument("--store", default="jpeg", help="--store of packer pack")
    parser.add_argument("--resize", default="256", help="'none': no resize (as --store original needs)")
    parser.add_argument("--center-crop", default="224", help="'none': no crop")
    args = parser.parse_args()
    if (args.src is None) == (args.tiny is None):
        parser.error("give SRC or --tiny N, not both")
    options = ["--store", args.store, "--workers", args.workers]
    options += ["--resize", args.resize] if args.resize != "none" else []
    options += ["--center-crop", args.center_crop] if args.center_crop != "none" else []
    print("| format | images | seconds | peak RSS, packer (MB) | peak RSS, largest worker (MB) |\n"
          "|---|---:|---:|---:|---:|")
    try:
        sizes = args.tiny if args.tiny is not None else args.copies
        for size in [int(c) for c in sizes.split(",")]:
            src = args.work / f"src-{size}"
            count = tiny_tree(src, size) if args.tiny is not None else linked_copies(args.src, src, size)
            for fmt in args.formats.split(","):
                dest = args.work / f"{fmt}-{size}"
                shutil.rmtree(dest, ignore_errors=True)
                seconds, own, worker = peak_of_pack(src, dest, ["--format", fmt, *options])
                shutil.rmtree(dest, ignore_errors=True)
                print(f"| {fmt} | {count:,} | {seconds:.1f} | {own:.0f} | {worker:.0f} |", flush=True)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Distributed conversion scaling: ``packer pack`` in one process vs two torchrun ranks.

Converts an ImageNet-like folder (made by ``scripts/make_sample_data.py``) with ``--resize 256 --center-crop 224
--store jpeg`` (by default) three ways, each as its own command:

- ``single, 1 worker``: ``packer pack --workers 1``;
- ``torchrun 2 ranks x 1 worker``: ``torchrun --nproc_per_node=2 -m packer pack --workers 1`` (two parts);
- ``single, 2 workers``: ``packer pack --workers 2``, the single-process reference for the same cores.

Reported per run: the manifest's ``conversion_seconds`` (from the first image converted to the manifest written;
for the distributed run, rank 0's part plus waiting for the other rank and merging), the wall time of the whole
command (Python and torch start-up, scanning and torchrun's rendezvous included), images/s from each, and the
speed-up over the single process with 1 worker. Every output is checked to hold the same samples as the first.

    python benchmarks/distributed_scaling.py                         # 2000 images, into bench-out/
    python benchmarks/distributed_scaling.py --images 1000 --out /tmp/d
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from run_benchmarks import ensure_data  # noqa: E402 - a sibling script, not a package

PACK_OPTIONS = ["--resize", "256", "--center-crop", "224", "--store", "jpeg", "--quiet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, cmd: list[str], dest: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"distributed_scaling.py: {' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    manifest = json.loads((dest / "manifest.json").read_text())
    n = manifest["count"]
    return {"run": name, "images": n, "parts": len(manifest.get("parts") or []) or 1,
            "seconds": manifest["conversion_seconds"], "wall_seconds": round(wall, 3),
            "images_per_s": n / manifest["conversion_seconds"], "images_per_s_wall": n / wall}


def same_samples(a: Path, b: Path) -> bool:
    import packer

    x, y = packer.open_dataset(a, decode=False), packer.open_dataset(b, decode=False)
    return len(x) == len(y) and all(x.raw_sample(i) == y.raw_sample(i) for i in range(len(x)))


def table(rows: list[dict]) -> str:
    head = (f"{'run':30}  {'images':>6}  {'seconds':>7}  {'images/s':>8}  {'speed-up':>8}  {'wall s':>6}  "
            f"{'images/s (wall)':>15}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['run']:30}  {r['images']:>6}  {r['seconds']:>7.1f}  {r['images_per_s']:>8.1f}  "
                     f"{r['speedup']:>7.2f}x  {r['wall_seconds']:>6.1f}  {r['images_per_s_wall']:>15.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    ap.add_argument("--images", type=int, default=2000, help="images to convert (default 2000)")
    ap.add_argument("--classes", type=int, default=5)
    ap.add_argument("--format", default="lmdb", choices=["lmdb", "hdf5", "wds"])
    ap.add_argument("--data", default=None, help="the image folder to make or reuse (default OUT/dist-data-N)")
    ap.add_argument("--options", default=" ".join(PACK_OPTIONS), help="packer pack options of every run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = ensure_data(Path(args.data) if args.data else out / f"dist-data-{args.images}", args.images,
                      args.classes, seed=0)
    options = args.options.split()
    work = Path(tempfile.mkdtemp(prefix="distributed-scaling-", dir=out))
    pack = ["-m", "packer", "pack", str(src)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    runs = [
        ("single, 1 worker", [sys.executable, *pack], 1),
        ("torchrun 2 ranks x 1 worker", [*torchrun, f"--master_port={free_port()}", *pack], 1),
        ("single, 2 workers", [sys.executable, *pack], 2),
    ]
    rows = []
    try:
        for name, cmd, workers in runs:
            dest = work / name.replace(" ", "_").replace(",", "")
            full = [*cmd, str(dest), "--format", args.format, "--workers", str(workers), *options]
            print(f"running {name}: {' '.join(full)}", file=sys.stderr)
            rows.append(run(name, full, dest))
            rows[-1]["same_samples_as_first"] = same_samples(dest, work / runs[0][0].replace(" ", "_").replace(
                ",", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        r["speedup"] = rows[0]["seconds"] / r["seconds"]
    text = table(rows)
    print(text)
    result = {"format": args.format, "options": options, "source": str(src), "cpus": os.cpu_count(), "rows": rows}
    (out / "distributed_scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "distributed_scaling.txt").write_text(text + "\n")
    print(f"wrote {out / 'distributed_scaling.json'} and {out / 'distributed_scaling.txt'}", file=sys.stderr)
    if not all(r["same_samples_as_first"] for r in rows):
        print("distributed_scaling.py: the outputs differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

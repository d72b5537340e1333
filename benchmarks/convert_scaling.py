"""Conversion scaling: ``packer pack`` with 1 and 2 workers, and its peak memory at N and 2N images.

Converts an ImageNet-like folder (made by ``scripts/make_sample_data.py``) with ``--resize 256 --center-crop 224
--store jpeg`` into each format, with each worker count, for N and 2N images. Each conversion runs as its own
``python -m packer pack`` process; reported per run:

- seconds: the manifest's ``conversion_seconds`` (the conversion itself, not Python's start-up) and wall time;
- speedup: seconds with 1 worker / seconds with this many, same format and size;
- peak_tree_rss_mb: the largest sum of RSS over the converter and its worker processes, sampled with psutil every
  ``--interval`` s (it counts pages forked workers share with their parent once per process, so it overstates);
- peak_process_rss_mb: the largest RSS of any single process of the tree (``getrusage(RUSAGE_CHILDREN)``);
- memory growth: peak at 2N / peak at N, which stays near 1 when memory does not grow with the dataset.

    python benchmarks/convert_scaling.py                       # N=2000, into bench-out/
    python benchmarks/convert_scaling.py --images 200 --out /tmp/s
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from run_benchmarks import ensure_data  # noqa: E402 - a sibling script, not a package

# Runs the converter as its child, then writes the largest RSS any descendant reached (KiB on Linux).
WRAPPER = ("import resource, subprocess, sys\n"
           "rc = subprocess.call(sys.argv[2:])\n"
           "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
           "sys.exit(rc)\n")
PACK_OPTIONS = ["--resize", "256", "--center-crop", "224", "--store", "jpeg", "--quiet"]


def sample_tree(pid: int, stop: threading.Event, interval: float, peak: dict[str, int]) -> None:
    """Record the largest summed RSS of ``pid``'s descendants until ``stop`` is set."""
    try:
        import psutil
    except ImportError:
        return
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        try:
            procs = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        peak["tree"] = max(peak.get("tree", 0), total)
        stop.wait(interval)


def convert(src: Path, dest: Path, fmt: str, workers: int, interval: float) -> dict:
    """One ``packer pack`` run in its own process tree; its times and peak memory."""
    with tempfile.NamedTemporaryFile("r", suffix=".maxrss") as rusage:
        cmd = [sys.executable, "-m", "packer", "pack", str(src), str(dest), "--format", fmt,
               "--workers", str(workers), *PACK_OPTIONS]
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", WRAPPER, rusage.name, *cmd], cwd=REPO,
                                stdout=subprocess.DEVNULL)
        stop, peak = threading.Event(), {}
        sampler = threading.Thread(target=sample_tree, args=(proc.pid, stop, interval, peak), daemon=True)
        sampler.start()
        rc = proc.wait()
        wall = time.perf_counter() - started
        stop.set()
        sampler.join()
        if rc != 0:
            sys.exit(f"convert_scaling.py: {' '.join(cmd)} failed with exit code {rc}")
        maxrss = int(rusage.read() or 0) * (1 if sys.platform == "darwin" else 1024)
    manifest = json.loads((dest / "manifest.json").read_text())
    return {"format": fmt, "images": manifest["count"], "workers": workers,
            "seconds": manifest["conversion_seconds"], "wall_seconds": wall,
            "images_per_s": manifest["count"] / manifest["conversion_seconds"],
            "peak_tree_rss_mb": peak["tree"] / 1e6 if peak.get("tree") else None,
            "peak_process_rss_mb": maxrss / 1e6,
            "bytes_on_disk": sum(f["bytes"] for f in manifest["files"])}


def add_ratios(rows: list[dict]) -> None:
    """speedup over 1 worker (same format, size); memory growth over the smallest size (same format, workers)."""
    by = {(r["format"], r["images"], r["workers"]): r for r in rows}
    smallest = min(r["images"] for r in rows)
    for r in rows:
        one = by.get((r["format"], r["images"], 1))
        r["speedup"] = one["seconds"] / r["seconds"] if one else None
        base = by[(r["format"], smallest, r["workers"])]
        for key in ("peak_tree_rss_mb", "peak_process_rss_mb"):
            growth = key.replace("_mb", "_growth")
            r[growth] = r[key] / base[key] if r[key] and base[key] else None


def table(rows: list[dict]) -> str:
    def f(value, fmt):
        return "-" if value is None else fmt.format(value)

    head = (f"{'format':6}  {'images':>6}  {'workers':>7}  {'seconds':>7}  {'images/s':>8}  {'speedup':>7}  "
            f"{'tree RSS MB':>11}  {'x at N':>6}  {'max proc MB':>11}  {'x at N':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['format']:6}  {r['images']:>6}  {r['workers']:>7}  {r['seconds']:>7.1f}  "
                     f"{r['images_per_s']:>8.0f}  {f(r['speedup'], '{:.2f}x'):>7}  "
                     f"{f(r['peak_tree_rss_mb'], '{:.0f}'):>11}  {f(r['peak_tree_rss_growth'], '{:.2f}'):>6}  "
                     f"{r['peak_process_rss_mb']:>11.0f}  {f(r['peak_process_rss_growth'], '{:.2f}'):>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    ap.add_argument("--images", type=int, default=2000, help="N: the smaller set; the larger has 2N (default 2000)")
    ap.add_argument("--classes", type=int, default=5)
    ap.add_argument("--formats", default="lmdb,hdf5,wds")
    ap.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    ap.add_argument("--data", default=None, help="where the image folders go (default OUT/scaling-data)")
    ap.add_argument("--interval", type=float, default=0.05, help="memory sampling interval, s (default 0.05)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    data = Path(args.data) if args.data else out / "scaling-data"
    workers = [int(w) for w in args.workers.split(",")]
    rows = []
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="convert-scaling-", dir=out))
    try:
        for n in (args.images, 2 * args.images):
            src = ensure_data(data / f"n{n}", n, args.classes, seed=0)
            for fmt in args.formats.split(","):
                for w in workers:
                    dest = work / f"{fmt}-{n}-{w}"
                    rows.append(convert(src, dest, fmt, w, args.interval))
                    shutil.rmtree(dest)
                    print(f"{fmt} {n} images, {w} workers: {rows[-1]['seconds']:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    add_ratios(rows)
    print(table(rows))
    path = out / "convert_scaling.json"
    path.write_text(json.dumps({"command": " ".join(["python", "benchmarks/convert_scaling.py", *(
        argv if argv is not None else sys.argv[1:])]), "options": PACK_OPTIONS, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

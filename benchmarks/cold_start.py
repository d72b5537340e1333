"""Cold start: the bytes ``packer info`` and a loader's first batch read from disk, with the page cache dropped.

For each format, a dataset of ``--images`` small JPEGs (``--distinct`` of them, about ``--kb`` KB each, hard-linked
under ``--classes`` class folders: the folder costs no disk, the packed copies do) is packed with ``store="original"``;
then, each in a fresh process, with the dataset's files dropped from the page cache first
(``packer.bench.cache.evict``: ``POSIX_FADV_DONTNEED``, as ``packer bench --cache cold`` does; no root needed):

- ``info``: ``packer info DEST`` run in the process;
- ``first batch``: ``open_dataset(DEST, random_resized_crop=224, flip=True)``, ``make_loader(ds, batch_size=64)`` and
  the first batch (packer's worker pool on two or more cores: its workers read the batches they were sent).

Each row gives what the main process read from disk once packer (and for a batch, torch) was imported
(``read_bytes`` of ``/proc/self/io``: any file, the dataset's or not), what all of its processes brought into the page
cache (the dataset files' resident bytes afterwards, by ``mincore``), the stored
bytes of the samples the loader had sent out to be read by then (its sampler's indices so far), the resident
bytes beyond those, the wall time and the main process's peak resident memory.

    python benchmarks/cold_start.py --images 20000 --work /tmp/cold --formats lmdb,hdf5,wds
    python benchmarks/cold_start.py --images 200000 --work /tmp/cold --formats lmdb --keep

Packed copies are deleted after their rows unless ``--keep`` (200,000 images of 50 KB are 10 GB a format).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np

CLASSES = 10


def make_source(folder: Path, images: int, distinct: int, kb: int, classes: int) -> None:
    """``images`` JPEGs under ``classes`` folders: ``distinct`` noisy pictures of about ``kb`` KB, hard-linked."""
    from PIL import Image

    marker = folder / f".made-{images}-{distinct}-{kb}-{classes}"
    if marker.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "_distinct").mkdir(parents=True)
    rng = np.random.default_rng(0)
    side = int((kb * 1024 / 0.55) ** 0.5)  # noise at quality 90: about 0.55 bytes a pixel
    originals = []
    for k in range(distinct):
        base = np.linspace(0, 255, side, dtype=np.float32)[None, :, None] * rng.random(3, dtype=np.float32)
        noise = rng.normal(0, 40, (side, side, 3)).astype(np.float32)
        pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
        path = folder / "_distinct" / f"{k}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        originals.append(path)
    for c in range(classes):
        (folder / f"class{c:02d}").mkdir()
    for i in range(images):
        os.link(originals[i % distinct], folder / f"class{i % classes:02d}" / f"{i:07d}.jpg")
    shutil.rmtree(folder / "_distinct")
    marker.touch()


def io_bytes() -> int:
    """``read_bytes`` of this process (``/proc/self/io``): what it had read from the disk."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def peak_rss() -> int:
    """This process's peak resident memory (``VmHWM``: ``ru_maxrss`` would count the parent's, kept across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def child(what: str, dest: str) -> None:
    """One measurement in this fresh process, after evicting ``dest``'s files; prints a JSON row."""
    import packer
    from packer.bench.cache import dataset_files, evict, resident_bytes
    from packer.cli import main

    if what == "batch":
        import packer.loading.loader  # noqa: F401 - torch and the loader loaded first: reading them is not counted

    files = dataset_files(dest)
    evict(files)
    before_resident = sum(resident_bytes(p)[0] for p in files)
    start_io, start = io_bytes(), time.perf_counter()
    sent: list[int] = []
    if what == "info":
        with redirect_stdout(io.StringIO()) as out:
            main(["info", dest], standalone_mode=False)
        assert "samples per class" in out.getvalue(), out.getvalue()
    else:
        ds = packer.open_dataset(dest, random_resized_crop=224, flip=True)
        loader = packer.make_loader(ds, batch_size=64)
        images, _ = next(iter(loader))
        assert images.shape[0] == 64
    seconds = time.perf_counter() - start
    main_read = io_bytes() - start_io
    if what == "batch":
        if loader.worker_pool is not None:
            loader.worker_pool.close()  # its workers finish the batches they were sent; nothing more is sent
        current, sampler = loader.sampler._current, loader.sampler
        sent = current.indices()[:sampler.yielded] if current is not None else []
    resident = sum(resident_bytes(p)[0] for p in files) - before_resident
    row = {"what": what, "seconds": round(seconds, 3), "main_read": main_read, "resident": resident,
           "samples_sent": len(sent), "maxrss": peak_rss()}
    if sent:  # their stored ranges, from the format's layout (after the measurement: it reads the index)
        from packer.formats import reader_class
        from packer.formats.layout import LocalSource

        manifest = packer.read_manifest(dest)
        layout = reader_class(manifest, dest).layout(manifest, LocalSource(dest), dest)
        at = np.asarray(sent, np.int64)
        row["sent_bytes"] = int((layout.end[at] - layout.start[at]).sum())
    print(json.dumps(row), flush=True)


def measure(what: str, dest: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", what, str(dest)], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"{what} {dest}: {out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr.strip()[-300:]}


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--distinct", type=int, default=500)
    parser.add_argument("--kb", type=int, default=50)
    parser.add_argument("--work", type=Path, default=Path("/tmp/cold"))
    parser.add_argument("--formats", default="lmdb,hdf5,wds")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the packed copies")
    parser.add_argument("--child", nargs=2, metavar=("WHAT", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    import packer

    src = args.work / f"src-{args.images}"
    make_source(src, args.images, args.distinct, args.kb, CLASSES)
    print("| format | images | data MB | step | main process read MB | page cache MB | samples sent | their MB | "
          "beyond them MB | seconds | peak RSS MB |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        dest = args.work / f"{fmt}-{args.images}"
        if not (dest / "manifest.json").exists():
            shutil.rmtree(dest, ignore_errors=True)
            packer.pack(src, dest, fmt, store="original", progress=False)
        data = sum(int(e["bytes"]) for e in packer.read_manifest(dest)["files"])
        for what in ("info", "batch"):
            for _ in range(args.repeats):
                r = measure(what, dest)
                sent = r.get("sent_bytes", 0)
                print(f"| {fmt} | {args.images:,} | {mb(data)} | {what} | {mb(r['main_read'])} | {mb(r['resident'])} | "
                      f"{r['samples_sent']} | {mb(sent)} | {mb(r['resident'] - sent)} | {r['seconds']} | "
                      f"{mb(r['maxrss'])} |", flush=True)
                if r["stderr"]:
                    print(f"<!-- {fmt} {what} stderr: {r['stderr']} -->", flush=True)
        if not args.keep:
            shutil.rmtree(dest)


if __name__ == "__main__":
    main()

"""Issue 24's comparison, in one run: samples with fields (image + mask, image + caption) against their peers.

Makes (or reuses, under ``--out``) a set of real-photo JPEGs with ``scripts/make_sample_data.py`` (or takes the
JPEGs of ``--source``), a PNG mask of class indices per photo (``mask_of`` of
``scripts/make_sample_annotations.py``: 0, 1, 2 by brightness, 255 at the border), and two annotation tables:
``seg.csv`` (``image``, ``mask``) and ``captions.csv`` (``image``, ``txt``, so that the shards' caption member is
``.txt``). Each is packed with ``packer pack TABLE DEST --format F --max-size 256``. Then, epoch throughput
(images/s) through a loader with ``--workers`` worker processes and batches of ``--batch-size``, every output
3 x 224 x 224 uint8 (and the mask 224 x 224 uint8):

1. **image + mask** (segmentation training): ``open_dataset(dest, random_resized_crop=224, flip=True,
   fields=("image", "mask"))`` through ``make_loader`` (the mask gets the image's window and flip, resampled by
   nearest), for lmdb, hdf5 and wds, against the same pipeline in plain Pillow: a torch ``Dataset`` that opens
   the JPEG and the PNG, draws a RandomResizedCrop window (torchvision's algorithm, scale (0.08, 1), ratio
   (3/4, 4/3), packer's defaults) and a flip, crops and resizes the image (bilinear) and the mask (nearest),
   and makes tensors, read by a torch ``DataLoader`` (shuffled, persistent workers). The Pillow baseline reads
   the original files; a second Pillow row reads copies already at the packed size (long side <= 256, JPEG
   quality 90 as packer stores them, masks resized by nearest), which separates the packed size from the rest.
2. **image + caption**: ``open_dataset(wds, random_resized_crop=224, flip=True, fields=("image", "txt"))``
   through ``make_loader`` against plain ``webdataset`` reading the same shards as its README does:
   ``WebDataset(urls, shardshuffle=...).shuffle(1000).decode("pil").to_tuple("jpg", "txt")``, the same Pillow
   crop + flip on the image, ``batched``, ``WebLoader`` (a ``DataLoader``) with the same workers.

Rows run interleaved, each repeat a fresh loader over ``--epochs`` epochs (the last one is measured: workers
started, page cache warm); the figure is the median of ``--repeats``. The ratio is over the row's baseline
(Pillow on the original files; plain webdataset). Writes ``OUT/fields_pipeline.json`` and
``OUT/fields_pipeline.md`` (the machine line, the command and the tables, ready for the README) and prints the
markdown.

    python benchmarks/fields_pipeline.py --images 3000 --out bench-out/fields      # on an idle machine
    python benchmarks/fields_pipeline.py --quick --out /tmp/fields                 # smoke test: sample_data
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
FORMATS = ("lmdb", "hdf5", "wds")
SIZE = 224
MAX_SIZE = 256
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # packer's (and torchvision's) RandomResizedCrop defaults
QUALITY = 90  # packer's default JPEG quality
SEG, CAPTION = "image + mask", "image + caption"
TARGETS = {SEG: 4.0, CAPTION: 1.0}  # issue 24: packer's rows over their pipeline's baseline


# -- the data ---------------------------------------------------------------------------------------------------
def _mask_of() -> Callable[[Image.Image], np.ndarray]:
    """``mask_of`` from scripts/make_sample_annotations.py (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_sample_annotations",
                                                  REPO / "scripts" / "make_sample_annotations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mask_of


def photos(source: Path | None, out: Path, images: int, seed: int) -> list[Path]:
    """``images`` JPEG photos: the first of ``source``, or of a set made once under ``out`` and reused."""
    if source is None:
        source = out / f"photos-seed{seed}"
        have = sorted(source.rglob("*.jpg")) if source.is_dir() else []
        if len(have) < images:  # ~5% of the generated images are PNGs: make a tenth more
            per_class = math.ceil(images * 1.1 / 5) + 1
            cmd = [sys.executable, str(REPO / "scripts" / "make_sample_data.py"), str(source), "--per-class",
                   str(per_class), "--classes", "5", "--seed", str(seed), "--overwrite"]
            print("making data:", shlex.join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)
    found = sorted(source.rglob("*.jpg"))
    if len(found) < images:
        sys.exit(f"{source}: {len(found)} JPEGs, --images asks for {images}; pass fewer --images")
    return found[:images]


def work_folder(out: Path, files: list[Path]) -> Path:
    """Where the masks, small copies, tables and packs of exactly these photos live (reused by a later run with
    the same photos, never by one with others)."""
    key = hashlib.sha1("\n".join(str(p) for p in files).encode()).hexdigest()[:10]
    return out / f"set-{len(files)}-{key}"


def make_tables(files: list[Path], data: Path) -> tuple[Path, Path, list[tuple[Path, Path]], list[tuple[Path, Path]]]:
    """seg.csv and captions.csv under ``data`` (paths absolute), each photo's mask, and the copies at the packed
    size: the (image, mask) pairs of the originals and of the small copies."""
    mask_of = _mask_of()
    masks, small = data / "masks", data / "small"
    masks.mkdir(parents=True, exist_ok=True)
    small.mkdir(parents=True, exist_ok=True)
    originals, smalls, seg_rows, caption_rows = [], [], [], []
    for i, path in enumerate(files):
        mask_path, small_image, small_mask = masks / f"{i:06d}.png", small / f"{i:06d}.jpg", small / f"{i:06d}.png"
        if not (mask_path.exists() and small_image.exists() and small_mask.exists()):
            with Image.open(path) as image:
                image.load()
                mask = Image.fromarray(mask_of(image))
                mask.save(mask_path)
                scale = min(1.0, MAX_SIZE / max(image.size))
                size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
                image.convert("RGB").resize(size, Image.Resampling.BILINEAR, reducing_gap=None).save(
                    small_image, quality=QUALITY)
                mask.resize(size, Image.Resampling.NEAREST).save(small_mask)
        originals.append((path, mask_path))
        smalls.append((small_image, small_mask))
        seg_rows.append({"image": str(path), "mask": str(mask_path)})
        caption_rows.append({"image": str(path), "txt": f"photo {i} of {path.parent.name}, {path.stem}"})
    tables = []
    for name, rows in (("seg.csv", seg_rows), ("captions.csv", caption_rows)):
        with open(data / name, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        tables.append(data / name)
    return tables[0], tables[1], originals, smalls


def pack(table: Path, dest: Path, fmt: str) -> Path:
    """``packer pack TABLE DEST --format F --max-size 256`` (reused when DEST holds a finished pack)."""
    if (dest / "manifest.json").exists():
        return dest
    cmd = [sys.executable, "-m", "packer", "pack", str(table), str(dest), "--format", fmt, "--max-size",
           str(MAX_SIZE), "--quiet", "--overwrite",
           "--root", "/"]  # the tables' paths are absolute: the photos of --source and the masks made here
    print("packing:", shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, cwd=REPO)
    return dest


# -- the peers' pipelines ----------------------------------------------------------------------------------------
def rrc_window(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (left, top, w, h), with python's ``random``."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * random.uniform(*SCALE)
        aspect = math.exp(random.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, width - w), random.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif in_ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def crop_flip(img: Image.Image, window: tuple[int, int, int, int], flip: bool, resample: int) -> Image.Image:
    left, top, w, h = window
    out = img.resize((SIZE, SIZE), resample, box=(left, top, left + w, top + h))
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out


def image_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)  # a copy, as torchvision's


class PillowSegmentation(torch.utils.data.Dataset):
    """The segmentation pipeline in plain Pillow: one window and flip for the image (bilinear) and its mask
    (nearest), uint8 tensors out."""

    def __init__(self, pairs: list[tuple[Path, Path]]):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, mask_path = self.pairs[index]
        with Image.open(image_path) as image, Image.open(mask_path) as mask:
            window, flip = rrc_window(*image.size), random.random() < 0.5
            out = crop_flip(image.convert("RGB"), window, flip, Image.Resampling.BILINEAR)
            out_mask = crop_flip(mask, window, flip, Image.Resampling.NEAREST)
        return image_tensor(out), torch.from_numpy(np.array(out_mask))


def pillow_crop_flip(image: Image.Image) -> torch.Tensor:
    """The image half of the pipeline, for webdataset's ``map_tuple``."""
    window = rrc_window(*image.size)
    return image_tensor(crop_flip(image.convert("RGB"), window, random.random() < 0.5, Image.Resampling.BILINEAR))


def keep(value: Any) -> Any:
    return value


def pillow_loader(pairs: list[tuple[Path, Path]], batch_size: int, workers: int, seed: int) -> Any:
    return torch.utils.data.DataLoader(PillowSegmentation(pairs), batch_size=batch_size, shuffle=True,
                                       num_workers=workers, persistent_workers=workers > 0,
                                       generator=torch.Generator().manual_seed(seed))


def webdataset_loader(shards: Path, batch_size: int, workers: int, seed: int) -> Any:
    import webdataset as wds

    urls = sorted(str(p) for p in shards.glob("*.tar"))
    pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=seed)
                .shuffle(1000)
                .decode("pil")
                .to_tuple("jpg", "txt")
                .map_tuple(pillow_crop_flip, keep)
                .batched(batch_size, partial=True))
    return wds.WebLoader(pipeline, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def packer_loader(dest: Path, fields: tuple[str, ...], batch_size: int, workers: int, seed: int) -> Any:
    import packer
    from packer.bench.measure import build_loader

    ds = packer.open_dataset(dest, random_resized_crop=SIZE, flip=True, fields=fields)
    return build_loader(ds, batch_size, workers, seed=seed)[0]


# -- measuring ---------------------------------------------------------------------------------------------------
def describe(batch: Any) -> list[str]:
    """What a batch holds, one entry per element: ``uint8 (4, 3, 224, 224)`` or ``list of 4 str``."""
    out = []
    for part in batch:
        if isinstance(part, torch.Tensor):
            out.append(f"{str(part.dtype).replace('torch.', '')} {tuple(part.shape)}")
        else:
            out.append(f"list of {len(part)} {type(part[0]).__name__}")
    return out


def epoch_rates(loader: Any, epochs: int) -> tuple[list[float], list[int], list[str]]:
    """Images/s of each epoch (from ``iter`` to the last batch), the images each gave, and what the first batch
    held."""
    rates, counts, first = [], [], []
    for _ in range(epochs):
        count, t = 0, time.perf_counter()
        for batch in loader:
            count += len(batch[0])
            first = first or describe(batch)
        rates.append(count / (time.perf_counter() - t))
        counts.append(count)
    return rates, counts, first


def close(loader: Any) -> None:
    """Shut a loader's workers down now, before the next row's start."""
    pool = getattr(loader, "worker_pool", None)
    if pool is not None:
        pool.close()
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def rows_to_measure(args: argparse.Namespace, packs: dict[str, Path], originals: list, smalls: list) -> list[dict]:
    b, w = args.batch_size, args.workers
    rows = [{"pipeline": SEG, "name": "Pillow + DataLoader, original files (baseline)", "baseline": True,
             "make": lambda s: pillow_loader(originals, b, w, s)},
            {"pipeline": SEG, "name": f"Pillow + DataLoader, files at long side <= {MAX_SIZE}",
             "make": lambda s: pillow_loader(smalls, b, w, s)}]
    for fmt in FORMATS:
        rows.append({"pipeline": SEG, "name": f"packer {fmt}", "format": fmt,
                     "make": lambda s, d=packs[f"seg-{fmt}"]: packer_loader(d, ("image", "mask"), b, w, s)})
    rows += [{"pipeline": CAPTION, "name": "webdataset + WebLoader, the same shards (baseline)", "baseline": True,
              "make": lambda s: webdataset_loader(packs["captions-wds"], b, w, s)},
             {"pipeline": CAPTION, "name": "packer wds", "format": "wds",
              "make": lambda s: packer_loader(packs["captions-wds"], ("image", "txt"), b, w, s)}]
    return rows


def measure(rows: list[dict], repeats: int, epochs: int) -> None:
    """Each row's ``rates`` (the last epoch of each repeat), rows interleaved so that other load hits all alike."""
    for row in rows:
        row["runs"], row["images"] = [], None
    for repeat in range(repeats):
        for row in rows:
            loader = row["make"](repeat)
            rates, counts, row["batch"] = epoch_rates(loader, epochs)
            close(loader)
            del loader
            row["runs"].append(rates[-1])
            row["images"] = counts[-1]
            print(f"  repeat {repeat + 1}/{repeats} {row['pipeline']}: {row['name']}: {rates[-1]:,.0f} img/s",
                  file=sys.stderr)
    for pipeline in dict.fromkeys(r["pipeline"] for r in rows):
        group = [r for r in rows if r["pipeline"] == pipeline]
        for row in group:
            row["images_per_s"] = statistics.median(row["runs"])
        base = next(r for r in group if r.get("baseline"))["images_per_s"]
        for row in group:
            row["ratio"] = row["images_per_s"] / base if base else None
            if "format" in row:  # a packer row
                row["target"] = TARGETS[pipeline]
                row["target_met"] = row["ratio"] is not None and row["ratio"] >= TARGETS[pipeline]


# -- the report --------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    from packer.bench.machine import describe_load, describe_machine

    s = result["settings"]
    lines = [f"Measured {result['started']}-{result['ended']} UTC on {describe_machine(result['machine'])}; "
             f"{describe_load(result['load'])}.",
             f"Command: `{result['command']}`. {s['images']} JPEG photos ({s['source']}), each with a PNG mask of "
             f"class indices; packed with `packer pack TABLE DEST --format F --max-size {MAX_SIZE}`. Medians of "
             f"{s['repeats']}, epoch {s['epochs']} of a fresh loader each, warm page cache, batch "
             f"{s['batch_size']}, {s['workers']} worker processes, RandomResizedCrop {SIZE} + flip, "
             f"3 x {SIZE} x {SIZE} uint8 out (masks {SIZE} x {SIZE} uint8, nearest)."]
    for pipeline in dict.fromkeys(r["pipeline"] for r in result["rows"]):
        lines += ["", f"**{pipeline}**", "", "| pipeline | img/s | x baseline |", "|---|---:|---:|"]
        for row in (r for r in result["rows"] if r["pipeline"] == pipeline):
            ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
            lines.append(f"| {row['name']} | {row['images_per_s']:,.0f} | {ratio} |")
        packer_rows = [r for r in result["rows"] if r["pipeline"] == pipeline and "format" in r]
        met = [r["format"] for r in packer_rows if r["target_met"]]
        missed = [r["format"] for r in packer_rows if not r["target_met"]]
        verdict = "; ".join(part for part in (f"met by {', '.join(met)}" if met else "",
                                              f"not met by {', '.join(missed)}" if missed else "") if part)
        lines += ["", f"Target (issue 24): packer at least {TARGETS[pipeline]:g}x the baseline: {verdict}."]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from packer.system import usable_cores

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, help="photos (default 3000; --quick: 16)")
    parser.add_argument("--repeats", type=int, help="runs per row; the median is reported (default 3; --quick: 1)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run; the last is measured (default 2)")
    parser.add_argument("--workers", type=int,
                        help="worker processes of every loader (default: the usable cores; --quick: 2)")
    parser.add_argument("--batch-size", type=int, help="default 64; --quick: 4")
    parser.add_argument("--source", type=Path, help="take the JPEGs of this folder instead of generating them "
                        "(--quick: sample_data)")
    parser.add_argument("--seed", type=int, default=0, help="make_sample_data.py's seed")
    parser.add_argument("--out", type=Path, default=Path("bench-out/fields"),
                        help="data, packs and results (reused by a later run)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a few images of sample_data, 1 repeat, 2 workers, batch 4")
    args = parser.parse_args(argv)
    defaults = {"images": 16, "repeats": 1, "workers": 2, "batch_size": 4} if args.quick else \
        {"images": 3000, "repeats": 3, "workers": usable_cores(), "batch_size": 64}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick and args.source is None:
        args.source = REPO / "sample_data"
    return args


def shown(path: Path | None, seed: int) -> str:
    """The photos' source as the report names it: a path from the repository root where it is inside it."""
    if path is None:
        return f"made by scripts/make_sample_data.py --seed {seed}"
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> None:
    from packer.bench.machine import load_average, machine_info
    from packer.system import usable_cores

    args = parse(argv)
    command = shlex.join(["python", "benchmarks/fields_pipeline.py", *(sys.argv[1:] if argv is None else argv)])
    out = args.out.resolve()
    files = photos(args.source.resolve() if args.source else None, out, args.images, args.seed)
    work = work_folder(out, files)
    seg, captions, originals, smalls = make_tables(files, work)
    packs = {f"seg-{fmt}": pack(seg, work / "packed" / f"seg-{fmt}", fmt) for fmt in FORMATS}
    packs["captions-wds"] = pack(captions, work / "packed" / "captions-wds", "wds")
    rows = rows_to_measure(args, packs, originals, smalls)
    started, load_start = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), load_average()
    measure(rows, args.repeats, args.epochs)
    result = {
        "command": command, "started": started, "ended": time.strftime("%H:%M", time.gmtime()),
        "machine": machine_info(out), "load": {"start": load_start, "end": load_average(),
                                               "usable_cores": usable_cores()},
        "work": str(work),
        "settings": {"images": len(files),
                     "source": shown(args.source, args.seed),
                     "repeats": args.repeats, "epochs": args.epochs, "workers": args.workers,
                     "batch_size": args.batch_size, "size": SIZE, "max_size": MAX_SIZE},
        "rows": [{k: v for k, v in row.items() if k != "make"} for row in rows],
    }
    (out / "fields_pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "fields_pipeline.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

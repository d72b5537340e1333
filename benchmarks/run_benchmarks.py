"""Issue 7's comparison, in one run: packed formats against the raw folder on an ImageNet-like set.

Makes (or reuses) an ImageFolder of real-photo JPEGs with ``scripts/make_sample_data.py``, then measures with
:func:`packer.bench.run_bench`, through ``make_loader`` (2 workers, batch 64, 224x224 uint8 output):

- raw packed with ``--resize 256 --center-crop 224`` (read as stored);
- jpeg packed the same way (decoded at read time);
- jpeg packed with ``--resize 256`` (decoded and centre-cropped at read time);
- original files (decoded, resized and cropped at read time);

each for lmdb, hdf5 and wds, against ``FolderDataset(decoder="pil", resize=256, center_crop=224)`` (torchvision
ImageFolder + Resize(256) + CenterCrop(224)), with a warm and a cold page cache, and each encoded mode's fraction
of its decode ceiling. Results (json, md, txt, png) go to ``--out``; ``--update-readme`` rewrites the part of
docs/benchmarks.md between ``<!-- bench:start -->`` and ``<!-- bench:end -->``.

    python benchmarks/run_benchmarks.py                        # 3000 images into bench-out/
    python benchmarks/run_benchmarks.py --images 300 --out /tmp/b
    python benchmarks/run_benchmarks.py --update-readme        # measure, then rewrite the docs section
    python benchmarks/run_benchmarks.py --readme-only          # rewrite it from bench-out/results.json
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# (variant given to run_bench, what is stored, the pack options, the read-time work)
VARIANTS = [
    ("raw:256/224", "raw 224x224", "--store raw --resize 256 --center-crop 224", "copy"),
    ("jpeg:256/224", "jpeg 224x224", "--store jpeg --resize 256 --center-crop 224", "decode"),
    ("jpeg:256", "jpeg, short side 256", "--store jpeg --resize 256", "decode + crop"),
    ("original", "original files", "--store original", "decode + resize + crop"),
]
FOLDER_LABEL = ('folder: `FolderDataset(decoder="pil")`, i.e. ImageFolder + Resize(256) + CenterCrop(224)',
                "Pillow decode + resize + crop")


def ensure_data(data: Path, images: int, classes: int, seed: int) -> Path:
    """The ImageFolder of ``images`` images (rounded up to whole classes), made once and reused."""
    per_class = math.ceil(images / classes)
    expected = per_class * classes
    have = sum(1 for p in data.rglob("*") if p.suffix in (".jpg", ".png")) if data.is_dir() else 0
    if have == expected:
        print(f"reusing {data} ({have} images)", file=sys.stderr)
        return data
    cmd = [sys.executable, str(REPO / "scripts" / "make_sample_data.py"), str(data), "--per-class", str(per_class),
           "--classes", str(classes), "--seed", str(seed), "--overwrite"]
    print("making data:", shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    return data


def run(args: argparse.Namespace, command: str) -> dict:
    from packer.bench import run_bench

    data = ensure_data(Path(args.data) if args.data else Path(args.out) / "data", args.images, args.classes,
                       args.seed)
    worker_counts = [int(w) for w in str(args.workers).split(",")]
    return run_bench(data, formats=args.formats.split(","), stores=[v[0] for v in VARIANTS], workers=worker_counts,
                     batch_size=args.batch_size, epochs=args.epochs, caches=args.cache.split(","),
                     repeats=args.repeats, read_resize=256, read_crop=224, out=args.out, keep=args.keep,
                     disk_test_mb=args.disk_test_mb, progress=not args.quiet, command=command,
                     pipelines=("val",))  # the training pipeline has its own README section (packer bench)


# -- the README section ---------------------------------------------------------------------------------------------
def _pick(rows: list[dict], cache: str, workers: int) -> dict[tuple[str, str], dict]:
    """One row per (dataset, store) for ``workers``: epoch 2 warm (steady state) or epoch 1 cold (the only
    epoch that reads from the disk)."""
    chosen = [r for r in rows if r["cache"] == cache and r["workers"] == workers
              and r.get("pipeline", "val") == "val"]
    if not chosen:
        return {}
    epoch = 1 if cache == "cold" else max(r["epoch"] for r in chosen)
    return {(r["dataset"], r["store"]): r for r in chosen if r["workers"] == workers and r["epoch"] == epoch}


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    parts = [f"{row['speedup_vs_folder']:.1f}x"] if row.get("speedup_vs_folder") else []
    if row.get("fraction_of_ceiling") is not None:
        parts.append(f"{row['fraction_of_ceiling']:.0%} of {row['ceiling_kind']}")
    return f"**{row['samples_per_s']:,.0f}**" + (f" ({', '.join(parts)})" if parts else "")


def _store_label(variant: str) -> str:
    """run_bench's label for a variant given as ``jpeg:256/224``."""
    from packer.bench import parse_variant

    return parse_variant(variant).label


def results_table(results: dict, cache: str, workers: int) -> list[str]:
    rows = _pick(results["rows"], cache, workers)
    formats = results["settings"]["formats"]
    lines = ["| stored as | packed with | read-time work | " + " | ".join(formats) + " | ceiling/s |",
             "|---|---|---|" + "---:|" * (len(formats) + 1)]
    for variant, stored, options, work in VARIANTS:
        label = _store_label(variant)
        cells = [_cell(rows.get((f, label))) for f in formats]
        ceilings = {round(r["ceiling_samples_per_s"]) for f in formats if (r := rows.get((f, label)))
                    and r.get("ceiling_samples_per_s")}
        ceiling = "/".join(f"{c:,}" for c in sorted(ceilings)) or "-"
        lines.append(f"| {stored} | `{options}` | {work} | " + " | ".join(cells) + f" | {ceiling} |")
    folder = rows.get(("folder", "files"))
    if folder:
        ceiling = f"{folder['ceiling_samples_per_s']:,.0f}" if folder.get("ceiling_samples_per_s") else "-"
        lines.append(f"| {FOLDER_LABEL[0]} | - | {FOLDER_LABEL[1]} | "
                     + " | ".join([_cell(folder)] + ["" for _ in formats[1:]]) + f" | {ceiling} |")
    return lines


def conversion_table(results: dict) -> list[str]:
    lines = ["| format | stored as | seconds | images/s | size on disk | vs source |", "|---|---|---:|---:|---:|---:|"]
    for c in results.get("conversions", []):
        lines.append(f"| {c['dataset']} | {c['store']} | {c['seconds']:.1f} | {c['images_per_s']:.0f} | "
                     f"{c['bytes_on_disk'] / 1e6:.0f} MB | {c['size_vs_source']:.2f}x |")
    return lines


def readme_section(results: dict) -> str:
    from packer.bench import describe_load, describe_machine, limits_lines

    s = results["settings"]
    src = results["source"]
    lines = [f"Measured by `{results['command']}` on {results['created']}.", "",
             f"Machine: {describe_machine(results['machine'])}.", "",
             f"Data: {src['images']:,} ImageNet-like photos (JPEG, short side 300-480 px; "
             f"{src['bytes'] / 1e6:,.0f} MB) made by `scripts/make_sample_data.py`. Every row gives the same "
             f"batches: {s['batch_size']} x 3 x 224 x 224 uint8, through `make_loader(ds, {s['batch_size']})`: "
             "`workers N` is N worker processes (packer's pool, decoding whole batches into shared memory: "
             "`make_loader`'s default for these datasets, with N = the usable cores), `workers 0` is "
             "`num_workers=0`, decode threads (one per core) in the main process; the folder baseline (Pillow "
             "decode, Resize(256), "
             "CenterCrop(224), as torchvision's ImageFolder pipeline) runs with the same setting. Cells: samples/s "
             "(speedup over the folder with the same settings, fraction "
             "of the row's ceiling: the decode ceiling is the same stored bytes decoded by a process pool on every "
             "core with no loader, one round of an epoch's length before each of the dataset's runs, their "
             "median; raw's is memory-copy bandwidth; cold rows are also bounded by the disk's sequential read "
             "speed).", ""]
    runs = f"Each figure is the median of {s['repeats']} runs" if s["repeats"] > 1 else "Each figure is one run"
    load = results.get("load_average")
    lines += [f"{runs}; {describe_load(load)}." if load else f"{runs}.", ""]
    lines += [f"**Warning:** {warning}\n" for warning in results.get("warnings", [])]
    for workers in s["workers"]:
        how = f"workers {workers}: " + ("decode threads in the main process" if workers == 0 else
                                         f"{workers} worker processes (packer's pool)")
        if "warm" in s["caches"]:
            lines += [f"Warm page cache, epoch {s['epochs']}, {how}:", ""]
            lines += results_table(results, "warm", workers) + [""]
        if "cold" in s["caches"]:
            cold = [r for r in results["rows"] if r["cache"] == "cold"]
            evicted = all(r["eviction_ok"] for r in cold)
            note = "" if evicted else " (the eviction did NOT take on every run: these rows are partly warm)"
            lines += [f"Cold page cache (each file evicted before the run), epoch 1, {how}{note}:", ""]
            lines += results_table(results, "cold", workers) + [""]
    lines += ["Conversion (all cores):", ""] + conversion_table(results) + [""]
    lines += ["Limits measured in the same run:", ""] + [f"- {line}" for line in limits_lines(results)] + [""]
    lines += ["Every figure, for every worker count and epoch, is in `results.json`; "
              "`python benchmarks/run_benchmarks.py --update-readme` regenerates this section."]
    return "\n".join(lines)


def update_readme(readme: Path, section: str) -> None:
    """Replace what lies between the markers, and nothing else."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        sys.exit(f"run_benchmarks.py: {readme} has no {START} ... {END} markers; add them where the results go")
    readme.write_text(text[:start + len(START)] + "\n" + section + "\n" + text[end:], encoding="utf-8")
    print(f"updated the results section of {readme}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="output folder (default bench-out/, git-ignored)")
    ap.add_argument("--images", type=int, default=3000, help="images in the generated set (default 3000)")
    ap.add_argument("--classes", type=int, default=5, help="classes in the generated set (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="image folder to use or make (default OUT/data)")
    ap.add_argument("--formats", default="lmdb,hdf5,wds")
    ap.add_argument("--workers", default="0,2",
                    help="DataLoader workers, comma-separated; 0 = make_loader's decode threads (default 0,2)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure, median (default 3)")
    ap.add_argument("--cache", default="warm,cold")
    ap.add_argument("--disk-test-mb", type=int, default=512, help="file read to measure the disk (default 512)")
    ap.add_argument("--keep", action="store_true", help="keep the packed datasets")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--update-readme", action="store_true", help="rewrite docs/benchmarks.md's results section")
    ap.add_argument("--readme-only", action="store_true", help="only rewrite it, from OUT/results.json")
    ap.add_argument("--readme", default=str(REPO / "docs" / "benchmarks.md"), help="the page to update")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "benchmarks/run_benchmarks.py", *(argv if argv is not None else sys.argv[1:])])
    if args.readme_only:
        results = json.loads((Path(args.out) / "results.json").read_text())
    else:
        started = time.perf_counter()
        results = run(args, command)
        from packer.bench import render_text

        print(render_text(results))
        print(f"wrote {', '.join(results['outputs'].values())} in {time.perf_counter() - started:.0f} s")
    section = readme_section(results)
    (Path(args.out) / "readme_section.md").write_text(section + "\n")
    if args.update_readme or args.readme_only:
        update_readme(Path(args.readme), section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

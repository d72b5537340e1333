"""What ``packer bench`` writes: the text and Markdown tables, the limits and conversion lines, the notes,
results.json and the chart."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

from .chart import plot
from .machine import describe_load, describe_machine
from .measure import WARMUP_BATCHES
from .shuffle_quality import quality_lines
from .summary import summary_lines

MIN_BATCHES = 20  # batches per epoch under which rates are too short to time
SAMPLE_DATA = "python scripts/make_sample_data.py bench-data --per-class 600"  # 5 classes: 3,000 images

COLUMNS = [("dataset", "dataset", "{}"), ("store", "store", "{}"), ("pipeline", "pipeline", "{}"),
           ("workers", "workers", "{}"),
           ("threads", "threads", "{}"),
           ("cache", "cache", "{}"), ("epoch", "epoch", "{}"), ("samples_per_s", "samples/s", "{:.0f}"),
           ("noise", "±", "{:.0%}"),
           ("mb_per_s_read", "MB/s read", "{:.1f}"), ("mb_per_s_decoded", "MB/s out", "{:.1f}"),
           ("first_batch_s", "1st batch s", "{:.2f}"), ("speedup_vs_folder", "vs folder", "{:.2f}x"),
           ("ceiling_samples_per_s", "ceiling/s", "{:.0f}"), ("ceiling_kind", "bound", "{}"),
           ("fraction_of_ceiling", "of ceiling", "{:.0%}"), ("wait_p50_ms", "wait p50 ms", "{:.1f}"),
           ("wait_p95_ms", "p95 ms", "{:.1f}"), ("wait_max_ms", "max ms", "{:.1f}"), ("data_stall", "stall", "{:.0%}"),
           ("eviction_ok", "evicted", "{}")]
# the quick run's table (and its live rows): what decides the choice, and whether a step would wait
QUICK_COLUMNS = [("dataset", "dataset", "{}"), ("store", "store", "{}"), ("pipeline", "pipeline", "{}"),
                 ("cache", "cache", "{}"), ("workers", "workers", "{}"), ("samples_per_s", "img/s", "{:,.0f}"),
                 ("noise", "±", "{:.0%}"), ("speedup_vs_folder", "vs folder", "{:.1f}x"),
                 ("wait_p50_ms", "wait p50 ms", "{:.1f}"), ("wait_p95_ms", "p95 ms", "{:.1f}"),
                 ("wait_max_ms", "max ms", "{:.1f}"), ("data_stall", "step waits", "{:.1%}"),
                 ("fraction_of_ceiling", "of ceiling", "{:.0%}"), ("mb_per_s_read", "MB/s read", "{:,.1f}"),
                 ("eviction_ok", "evicted", "{}")]


def cell(row: dict, key: str, fmt: str) -> str:
    """One cell of a table: the row's value in ``fmt``, "-" where there is none, yes/NO for a flag."""
    value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return fmt.format(value)


def _columns(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Drop columns with nothing in them (stall without --step-ms, evicted without cold runs)."""
    return [c for c in columns if any(r.get(c[0]) is not None for r in rows)]


def format_table(rows: list[dict], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    cols = _columns(rows, columns)
    cells = [[title for _, title, _ in cols]] + [[cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    cols = _columns(rows, columns)
    lines = ["| " + " | ".join(title for _, title, _ in cols) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|"]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in cols) + " |" for r in rows]
    return "\n".join(lines)


def limits_lines(results: dict[str, Any]) -> list[str]:
    limits = results.get("limits") or {}
    if not limits:
        return ["limits not measured (--no-limits)"]
    lines = [f"memory copy: {limits['memory_copy_gb_per_s']:.1f} GB/s (np.copyto, one core)"]
    disk = limits.get("disk")
    if disk:
        evicted = "" if disk["eviction_ok"] else " (NOT evicted: the disk figure is the page cache's)"
        lines.append(f"disk sequential read: {disk['mb_per_s']:.0f} MB/s over {disk['file_mb']:.0f} MB{evicted}")
    for key, entry in limits.get("decode", {}).items():
        if entry.get("samples_per_s"):
            dataset, store, decoder, _, _ = key.split("|")
            lines.append(f"{entry['kind']} ceiling, {dataset} {store} ({decoder} decoder): "
                         f"{entry['samples_per_s']:.0f} samples/s with {limits['processes']} processes")
    return lines


def conversion_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for c in results.get("conversions", []):
        ratio = f", {c['size_vs_source']:.2f}x the source's {c['source_bytes'] / 1e6:.1f} MB" if c.get(
            "size_vs_source") else ""
        seconds = f"{c['seconds']:.1f} s, {c['images_per_s']:.0f} images/s, " if c.get("seconds") else ""
        lines.append(f"{c['dataset']} {c['store']}: {c['images']} images, {seconds}"
                     f"{c['bytes_on_disk'] / 1e6:.1f} MB on disk{ratio}")
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    if results.get("mode") == "quick":
        return _quick_markdown(results)
    parts = ["# packer bench results", ""] + [f"**Warning:** {line}\n" for line in results.get("warnings", [])]
    parts += [f"{line}  " for line in summary_lines(results)] + [""]
    parts += [f"Command: `{results['command']}`", "", f"Machine: {describe_machine(results['machine'])}", ""]
    if results.get("load_average"):
        parts += [f"The {describe_load(results['load_average'])}.", ""]
    parts += [markdown_table(results["rows"]), "",
             "## Limits measured in the same run", ""]
    parts += [f"- {line}" for line in limits_lines(results)]
    if results.get("conversions"):
        parts += ["", "## Conversion", ""] + [f"- {line}" for line in conversion_lines(results)]
    if results.get("shuffle_quality"):
        quality = results["shuffle_quality"]
        parts += ["", "## Shuffle quality", ""] + quality_lines(quality["rows"], quality["batch_size"])
    parts += ["", "## Notes", ""] + [f"- {note}" for note in results.get("notes", [])]
    return "\n".join(parts) + "\n"


def write_outputs(results: dict[str, Any], out: str | os.PathLike) -> dict[str, str]:
    """bench.png (when matplotlib is installed; ``results["chart"]`` says where, or None), results.json,
    results.md and results.txt (the summary and the table) in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "txt": out / "results.txt",
             "png": out / "bench.png"}
    drawn = importlib.util.find_spec("matplotlib") is not None and plot(results, paths["png"])
    results["chart"] = str(paths["png"]) if drawn else None  # the summary says why there is none
    if not drawn:
        del paths["png"]
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths["md"].write_text(render_markdown(results))
    paths["txt"].write_text(render_text(results))
    return {k: str(v) for k, v in paths.items()}


def render_text(results: dict[str, Any]) -> str:
    if results.get("mode") == "quick":
        return _quick_text(results)
    summary = summary_lines(results)
    parts = [*summary, *([""] if summary else []), f"machine: {describe_machine(results['machine'])}", "",
             format_table(results["rows"]), ""]
    parts += limits_lines(results)
    parts += conversion_lines(results)
    if results.get("shuffle_quality"):
        quality = results["shuffle_quality"]
        parts += quality_lines(quality["rows"], quality["batch_size"])
    if results.get("load_average"):
        parts.append(describe_load(results["load_average"]))
    parts += results.get("notes", [])
    parts += [f"WARNING: {line}" for line in results.get("warnings", [])]
    return "\n".join(parts) + "\n"


def notes(settings: dict[str, Any], rows: list[dict], machine: dict[str, Any]) -> list[str]:
    notes = [f"epoch 1 rates leave out its first {WARMUP_BATCHES} batches (worker start-up); first_batch_s is "
             "the time from iter(loader) to the first batch",
             "workers 0 is make_loader's in-process loader: `threads` decode threads in the main process and a "
             "background thread prefetching; workers N are N worker processes of one decode thread each (packer's "
             "pool for packer datasets and the folder: make_loader's default on 2+ cores)",
             "ceilings use every usable core"]
    if "cold" in settings["caches"] and settings["epochs"] > 1:
        notes.append("cold epoch 2 reads what epoch 1 left in the page cache: it shows re-reading, not a cold disk")
    if settings["repeats"] > 1:
        notes.append(f"each figure is the median of {settings['repeats']} runs, each with a fresh loader "
                     "(samples_per_s_runs in results.json holds every run's rate); ± combines the spread of those "
                     "runs (noise_within) with the machine's drift between figures, the spread of the decode-ceiling "
                     "rounds taken beside them (machine_drift)")
    else:
        notes.append("each figure is one run (--repeats 1), not a median: use --repeats 3 for figures to publish")
    if any(r["eviction_ok"] is False for r in rows):
        notes.append(f"eviction did NOT take on some cold runs (the work folder is on "
                     f"{machine.get('work_filesystem')}; tmpfs and some overlays keep pages): those rows are warm")
    if settings["step_ms"]:
        notes.append(f"each batch is consumed by a simulated {settings['step_ms']} ms training step; data_stall is "
                     "the fraction of time the step waited for data")
    return notes


def batches_per_epoch(settings: dict[str, Any], count: int) -> int:
    """Batches in one epoch of ``count`` samples at the run's batch size (the last one may be short)."""
    return math.ceil(count / settings["batch_size"])


def _chart_line(results: dict[str, Any]) -> str:
    chart = results.get("chart")
    return f"chart: {chart}" if chart else "no chart: matplotlib is not installed; pip install matplotlib draws one"


def _quick_text(results: dict[str, Any]) -> str:
    """The quick run's report: the verdict, any warning, the table, the chart, then how it was measured."""
    parts = [*results["verdict"]["lines"], *(f"WARNING: {line}" for line in results.get("warnings", [])), "",
             format_table(results["rows"], QUICK_COLUMNS), "", _chart_line(results),
             f"machine: {describe_machine(results['machine'])}", describe_load(results["load_average"])]
    parts += limits_lines(results) + conversion_lines(results) + results.get("notes", [])
    return "\n".join(parts) + "\n"


def _quick_markdown(results: dict[str, Any]) -> str:
    parts = ["# packer bench results", "", "```", *results["verdict"]["lines"], "```", ""]
    parts += [f"**Warning:** {line}\n" for line in results.get("warnings", [])]
    parts += [markdown_table(results["rows"], QUICK_COLUMNS), ""]
    parts += ["![bench.png](bench.png)", ""] if results.get("chart") else []
    parts += [f"Command: `{results['command']}`", "", f"Machine: {describe_machine(results['machine'])}", "",
              f"The {describe_load(results['load_average'])}.", "", "## Limits measured in the same run", ""]
    parts += [f"- {line}" for line in limits_lines(results)]
    if results.get("conversions"):
        parts += ["", "## Conversion", ""] + [f"- {line}" for line in conversion_lines(results)]
    parts += ["", "## Notes", ""] + [f"- {note}" for note in results.get("notes", [])]
    return "\n".join(parts) + "\n"


def quick_notes(settings: dict[str, Any], rows: list[dict], machine: dict[str, Any], skip_above: int) -> list[str]:
    """How the quick run measured, in a few lines."""
    plan = rows[0]["plan"] if rows else "?"
    found = [f"each figure reads for at least {settings['min_seconds']:g} s: warm ones repeat the dataset's epochs "
             "back to back through one loader, after a short pass that is not counted; cold ones read single epochs "
             "(or a part of a long one), each by a fresh loader whose workers started before the dataset's files "
             "were evicted from the page cache",
             f"the loader is make_loader's default ({plan}); each rate leaves out the first batch of each worker "
             f"(the loader filling its workers) where a pass has {skip_above}+ batches per worker; ± combines the "
             "standard deviation of the rates of parts of its passes (of a cold figure: of its epochs) over their "
             "mean, how much the machine's speed moved while it was measured (noise_within in results.json; the "
             "live rows show it alone), with the machine's drift between figures, the spread of the decode-ceiling "
             "rounds taken beside them (machine_drift); two figures, of this run or of two, differ beyond their "
             "noise where they differ by more than twice their ± combined",
             "wait p50/p95/max: the milliseconds next(loader) waited for a batch"
             + (f", while a simulated {settings['step_ms']:g} ms training step followed each batch; step waits: "
                "the share of that loop's time spent waiting for data" if settings["step_ms"] else
                ", reading flat out (give --step-ms N to see what a training step of N ms would wait)"),
             "val reads the folder with Pillow + Resize + CenterCrop (torchvision's ImageFolder), train with "
             "RandomResizedCrop + flip; packed datasets with packer's decoder; every row gives the same batches",
             "packer bench SRC --full measures the whole matrix (stores original, jpeg and raw; workers 0, 1, half "
             "and all cores; two epochs; the median of 3 runs)"]
    if any(r["eviction_ok"] is False for r in rows):
        found.append(f"eviction did NOT take on some cold runs (the work folder is on "
                     f"{machine.get('work_filesystem')}; tmpfs and some overlays keep pages): those rows are warm")
    return found


NOISY = 0.25  # a rate whose noise is over this fraction of it is warned about


def quick_warnings(results: dict[str, Any]) -> list[str]:
    """Why some of a quick run's figures cannot be trusted, each with its reason: a busy machine, figures on too few
    batches to tell their noise, cold epochs too short to stand for a large dataset's, rates that moved a lot
    while measured."""
    rows, settings = results["rows"], results["settings"]
    found = [busy_warning(results["load_average"])] if results["load_average"].get("busy") else []
    unknown = [r for r in rows if r.get("noise") is None]
    if unknown:
        fewest = min(unknown, key=lambda r: r["batches"])
        found.append(f"{len(unknown)} figures rest on too few batches to say how much they vary (the fewest: "
                     f"{fewest['dataset']} {fewest['store']} {fewest['pipeline']} {fewest['cache']}, "
                     f"{fewest['batches']} batches in {fewest['seconds']:.2f} s): run with a larger --min-seconds")
    batches = math.ceil(results["source"]["images"] / settings["batch_size"])
    cold = [r for r in rows if r["cache"] == "cold" and batches < 4 * max(1, r["workers"])]
    if cold:
        found.append(f"the cold figures read epochs of {batches} batches of {settings['batch_size']}: the start of "
                     "each (opening the files, each worker's first batch) is most of their time, as it would not be "
                     "on a larger dataset; benchmark more images for cold figures to rely on (e.g. "
                     f"`{SAMPLE_DATA}`)")
    def moved(row: dict[str, Any]) -> float:  # while it was measured: its own spread, not the drift between figures
        return row.get("noise_within", row.get("noise")) or 0

    noisy = [r for r in rows if moved(r) > NOISY]
    if noisy:
        worst = max(noisy, key=moved)
        found.append(f"{len(noisy)} rates moved by more than ±{NOISY:.0%} while measured (the most: "
                     f"{worst['dataset']} {worst['store']} {worst['pipeline']} {worst['cache']}, "
                     f"±{moved(worst):.0%}): the machine's speed changed under them; rerun on an idle machine")
    drift = results.get("machine_drift")
    if drift is not None and drift > NOISY:
        found.append(f"the machine's speed moved by ±{drift:.0%} between figures (the decode-ceiling rounds taken "
                     "beside them): figures taken apart differ by that much; rerun on an idle machine")
    return found


def busy_warning(load: dict[str, Any]) -> str:
    return (f"the machine was busy (1-minute load average {load['start'][0] if load['start'] else '?'} "
            f"at the start, {load['end'][0] if load['end'] else '?'} at the end, on "
            f"{load['usable_cores']} usable cores): figures taken on a busy machine are not publishable; "
            "rerun on an idle one")


def figure_warnings(batches: int, load: dict[str, Any]) -> list[str]:
    """Why the figures of a run should not be relied on, if they should not: too few batches per epoch, or a
    busy machine."""
    found = []
    if batches < MIN_BATCHES:
        found.append(f"only {batches} batches per epoch (fewer than {MIN_BATCHES}): these figures are not "
                     "meaningful; rates this short are noise, and epoch 1 overstates parallel loaders (their first "
                     "batches are decoded side by side before the clock starts). Benchmark a larger folder, e.g. "
                     f"`{SAMPLE_DATA}` (3,000 images; needs scikit-image)")
    if load["busy"]:
        found.append(busy_warning(load))
    return found

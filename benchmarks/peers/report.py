"""Turn the peer benchmark's results into results.json, results.md, a chart, and README.md's peers section."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

START, END = "<!-- peers:start -->", "<!-- peers:end -->"
PIPELINES = ("val", "train")
PIPELINE_TITLES = {
    "val": "Validation pipeline: resize 256 + centre crop 224",
    "train": "Training pipeline: RandomResizedCrop 224 + horizontal flip",
}
# the row every other row of its pipeline is measured against, in order of preference
BASELINE_TOOLS = ("torchvision", "ImageFolder stand-in")

# What each tool is better at than packer, said plainly: the table only measures local read speed.
ABOUT = {
    "folder": "**ImageFolder (torchvision, or our `FolderDataset` stand-in)**: no conversion at all, so nothing to "
              "redo when images change, and no second copy on disk; the reference that every other row is "
              "measured against. It pays for one file open per image, which hurts on network filesystems and "
              "cold caches.",
    "datasets": "**Hugging Face `datasets`**: the ecosystem: the Hub (load and share with one call), Arrow "
                "columns that can be filtered, mapped, sorted and queried (and read by pandas, Polars, DuckDB), "
                "many modalities in one table, memory-mapped random access. Images are decoded row by row "
                "through Pillow in Python, so its speed is the speed of the transform you give it.",
    "streaming": "**MosaicML Streaming**: built for training from object storage (S3, GCS, Azure, OCI...) with a "
                 "bounded local cache; deterministic, elastic resumption mid-epoch even when the number of "
                 "nodes or GPUs changes; shuffles designed for many nodes (py1e, py1br); mixing several streams "
                 "in set proportions. Its shared-memory coordination between ranks and workers costs start-up "
                 "time on a small local run.",
    "litdata": "**LitData**: `optimize` maps any Python function over any inputs in parallel, on one machine or "
               "many, and writes chunks straight to cloud storage; `StreamingDataset` streams them back with "
               "caching, resumable loader state, subsampling and dataset mixing; it fits the Lightning tools.",
    "webdataset": "**`webdataset`**: plain POSIX tar shards that any tool can write and read, streamed from "
                  "anywhere a URL or a `pipe:` command reaches (HTTP, S3, GCS), with purely sequential I/O that "
                  "suits network storage and spinning disks; a small composable pipeline. No random access and "
                  "no exact epoch order (packer's `wds` format adds an index for both).",
    "ffcv": "**FFCV**: JIT-compiled (numba) decode-and-augment pipelines running in threads over libjpeg-turbo "
            "and OpenCV, with augmentations fused into decoding (e.g. RandomResizedCrop at decode time); a "
            "page-aware quasi-random order with its own cache for data larger than memory. It has no wheels "
            "(it builds from source against OpenCV and libjpeg-turbo); its latest release, 1.0.2, is from 2023.",
}

COLUMNS = [  # (key, header, format)
    ("conversion_s", "Convert (s)", "{:.1f}"),
    ("bytes", "On disk (MB)", "{:.1f}"),
    ("warm_epoch1_first_batch_s", "First batch (s)", "{:.1f}"),
    ("warm_epoch1_sps", "Epoch 1 warm (img/s)", "{:.0f}"),
    ("warm_epoch2_sps", "Epoch 2 warm (img/s)", "{:.0f}"),
    ("x_baseline", "× baseline", "{:.2f}×"),
    ("cold_sps", "Cold epoch (img/s)", "{:.0f}"),
    ("peak_rss_mb", "Peak RSS (MB)", "{:.0f}"),
    ("peak_pss_mb", "Peak PSS (MB)", "{:.0f}"),
]


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key == "bytes":
        value = value / 1e6
    text = fmt.format(value)
    low, high = row.get(f"{key}_min"), row.get(f"{key}_max")
    if row.get("repeats", 1) > 1 and low is not None and high is not None:  # the median, then the range
        text += f" ({fmt.format(low)}–{fmt.format(high)})"
    return text


def speed(row: dict[str, Any]) -> float | None:
    """The images/s a row is compared by: its last warm epoch (workers started, files cached), median."""
    return row.get("warm_epoch2_sps", row.get("warm_epoch1_sps"))


def pipeline_of(row: dict[str, Any]) -> str:
    return row.get("pipeline", "val")  # results from before the training rows had only val rows


def baseline(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ImageFolder row among ``rows`` (one pipeline of one run): torchvision's, else the stand-in's."""
    for tool in BASELINE_TOOLS:
        for row in rows:
            if row["tool"] == tool and "error" not in row and speed(row):
                return row
    return None


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per row, all of one pipeline; a failed row says why instead of numbers. "× baseline" is the
    row's speed over the ImageFolder row's among the same ``rows``."""
    base = baseline(rows)
    header = "| Tool | Variant | Read-time work | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    for row in rows:
        if "error" in row:
            cells = [f"failed: {row['error'][:150]}"] + [""] * (len(COLUMNS) - 1)
        else:
            ratio = speed(row) / speed(base) if base and speed(row) else None
            cells = [_cell({**row, "x_baseline": ratio}, key, fmt) for key, _, fmt in COLUMNS]
        lines.append(f"| {row['tool']} | {row['variant']} | {row.get('read_work', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pipeline_tables(rows: list[dict[str, Any]]) -> str:
    """One titled table per pipeline present, each with its own baseline."""
    parts = []
    for pipeline in PIPELINES:
        chosen = [r for r in rows if pipeline_of(r) == pipeline]
        if not chosen:
            continue
        base = baseline(chosen)
        against = f"{base['tool']} {base['variant']}" if base else "none measured"
        parts += [f"**{PIPELINE_TITLES[pipeline]}** (× baseline: epoch 2 warm img/s over {against}, same run)", "",
                  markdown_table(chosen), ""]
    return "\n".join(parts).rstrip()


WORK_LEGEND = ("Read-time work: *decode+resize* decodes the full-size source image, resizes it to 256 and crops "
               "224 (compare these rows with each other); *decode 224* / *copy 224* read images that were "
               "resized and cropped once at conversion (packer's jpeg/raw stores); FFCV's rows read images "
               "whose long side was capped at 256 at conversion (*decode <=256+resize*, *resize <=256*). "
               "*threads*: packer's in-process loader (decoding on threads in the main process, "
               "`num_workers=0`); *workers*: 2 worker processes, as every peer uses (packer's: its own pool, "
               "make_loader's default). Training rows: *+RRC* picks a random window "
               "(torchvision's RandomResizedCrop algorithm) and resizes only it to 224, then flips half the "
               "images; *decode 256+RRC* reads images stored with their short side at 256. With repeats, each "
               "images/s cell is the median, with the min–max in brackets.")


def status_line(status: dict[str, Any]) -> str:
    """One line per peer for the console and the report."""
    name = status["peer"]
    if status.get("status") == "skipped":
        return f"{name}: skipped: {status['error'].splitlines()[0]}"
    versions = ", ".join(f"{k} {v}" for k, v in status.get("versions", {}).items())
    extra = f", installed in {status['install_s']:.0f} s" if status.get("install_s") else ""
    if status.get("error"):
        extra += f"; {status['error'].splitlines()[0]}"
    return f"{name}: {status.get('status')} in {status.get('seconds', 0):.0f} s{extra} ({versions})"


def _loads(results: dict[str, Any]) -> tuple[float | None, float | None]:
    """The 1-minute load average at the start and the end (also from results written before load_start)."""
    m = results["machine"]
    start = m["load_start"][0] if "load_start" in m else m.get("load_before")
    end = m["load_end"][0] if "load_end" in m else m.get("load_after")
    return start, end


def machine_line(results: dict[str, Any]) -> str:
    m = results["machine"]
    start, end = _loads(results)
    load = f"load average {start:.1f} at the start"
    if end is not None:
        load += f", {end:.1f} at the end"
    if m.get("others_cpu_share") is not None:
        load += f"; other processes used {100 * m['others_cpu_share']:.0f}% of the cores"
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}, Python {m['python']} ({load})"


def publishable(results: dict[str, Any]) -> bool:
    """False when the load average exceeded the core count at the start or the end of the run."""
    if "publishable" in results:
        return bool(results["publishable"])
    return max(v or 0.0 for v in _loads(results)) <= results["machine"]["cores"]


def busy_warning(results: dict[str, Any]) -> str | None:
    """A warning when something else was using the cores: every number here is wall-clock."""
    if publishable(results):
        return None
    load = max(v or 0.0 for v in _loads(results))
    return (f"Not publishable: the machine was busy (load average up to {load:.1f} on "
            f"{results['machine']['cores']} cores); re-run on an idle machine.")


def setup_line(results: dict[str, Any]) -> str:
    src = results.get("src_display", results["src"])
    return (f"{results.get('images')} images ({src}), batch {results['batch_size']}, "
            f"{results['workers']} workers, {results['epochs']} warm epochs + 1 cold, "
            f"median of {results.get('repeats', 1)} run(s) per row, output uint8 3x224x224")


def render_markdown(results: dict[str, Any]) -> str:
    """results.md: the table, then what was skipped and why, versions, notes."""
    parts = [f"# packer vs. peers ({results['date']})", "",
             f"- machine: {machine_line(results)}", f"- setup: {setup_line(results)}",
             f"- command: `{results['command']}`", f"- whole run: {results.get('seconds', 0):.0f} s", ""]
    warning = busy_warning(results)
    if warning:
        parts += [f"**{warning}**", ""]
    parts += [pipeline_tables(results["rows"]), "", WORK_LEGEND, "", "## Peers", ""]
    for status in results["peers"]:
        parts.append(f"- {status_line(status)}")
        if status.get("error"):
            parts += ["", "  ```", *("  " + line for line in status["error"].splitlines()), "  ```"]
    notes = sorted({f"{r['tool']}: {r['notes']}" for r in results["rows"] if r.get("notes")})
    if notes:
        parts += ["", "## Notes", "", *(f"- {n}" for n in notes)]
    return "\n".join(parts) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Horizontal bars of images/s per row (epoch 1 warm, epoch 2 warm, cold), on a log scale since the raw
    rows run orders of magnitude faster than decoding ones. False without matplotlib or rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results["rows"] if "error" not in r]
    if not rows:
        return False
    series = [("warm_epoch1_sps", "epoch 1, warm cache (incl. start-up)"), ("warm_epoch2_sps", "epoch 2, warm"),
              ("cold_sps", "epoch 1, cold cache (incl. start-up)")]
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 1.6))
    height = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        ys = [y - 0.4 + height * (i + 0.5) for y in range(len(rows))]
        values = [max(r.get(key) or 0, 1e-3) for r in rows]
        bars = ax.barh(ys, values, height=height, label=label)
        if key == "warm_epoch2_sps":
            ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=6, padding=2)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [f"{pipeline_of(r)}: {r['tool']}  {r['variant']}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("images/s, log scale (uint8 224x224, batch 64; higher is better)")
    ax.set_title(f"packer vs. peers: {results.get('images')} images, {results['machine']['cores']} cores, "
                 f"{results['workers']} workers")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(results: dict[str, Any], out: Path) -> dict[str, str]:
    """results.json, results.md and peers.png in ``out``; returns the paths written."""
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "peers.png"}
    paths["json"].write_text(json.dumps(results, indent=2))
    paths["md"].write_text(render_markdown(results))
    if not plot(results, paths["png"]):
        del paths["png"]
    return {k: str(v) for k, v in paths.items()}


def readme_section(results: dict[str, Any]) -> str:
    """What goes between the markers: when, where, how, the table, and what each tool is better at."""
    lines = [f"Measured {results['date'][:10]} on {machine_line(results)}; {setup_line(results)}.",
             f"Command: `{results['command']}`. Method and adapters: `benchmarks/peers/README.md`.", ""]
    warning = busy_warning(results)
    if warning:
        lines += [warning, ""]
    lines += [pipeline_tables(results["rows"]), "", WORK_LEGEND, ""]
    skipped = [s for s in results["peers"] if s.get("status") == "skipped"]
    for status in skipped:
        lines.append(f"Not measured: {status['peer']}: {status['error'].splitlines()[0]}")
    if skipped:
        lines.append("")
    measured = {s["peer"] for s in results["peers"]}
    if "torchvision" in measured:
        measured.add("folder")
    lines += ["What each is better at than packer:", ""]
    lines += [f"- {text}" for name, text in ABOUT.items() if name in measured]
    return "\n".join(lines)


def update_readme(readme: Path, results: dict[str, Any]) -> None:
    """Replace only what lies between the peers markers; refuse if they are missing."""
    text = readme.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {START} ... {END} markers; add them where the table should go")
    section = f"{START}\n{readme_section(results)}\n{END}"
    readme.write_text(pattern.sub(lambda _: section, text, count=1))

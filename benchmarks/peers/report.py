"""Turn the peer benchmark's results into results.json, results.md, a chart, and README.md's peers section."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

START, END = "<!-- peers:start -->", "<!-- peers:end -->"

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
    return fmt.format(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per row; a failed row says why instead of numbers."""
    header = "| Tool | Variant | Read-time work | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    for row in rows:
        if "error" in row:
            cells = [f"failed: {row['error'][:150]}"] + [""] * (len(COLUMNS) - 1)
        else:
            cells = [_cell(row, key, fmt) for key, _, fmt in COLUMNS]
        lines.append(f"| {row['tool']} | {row['variant']} | {row.get('read_work', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


WORK_LEGEND = ("Read-time work: *decode+resize* decodes the full-size source image, resizes it to 256 and crops "
               "224 (compare these rows with each other); *decode 224* / *copy 224* read images that were "
               "resized and cropped once at conversion (packer's jpeg/raw stores); FFCV's rows read images "
               "whose long side was capped at 256 at conversion (*decode <=256+resize*, *resize <=256*). "
               "*threads*: packer's default loader (decoding on threads in the main process); *workers*: "
               "2 DataLoader worker processes, as every peer uses.")


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


def machine_line(results: dict[str, Any]) -> str:
    m = results["machine"]
    load = f"load average {m['load_before']:.1f} at the start"
    if "load_after" in m:
        load += f", {m['load_after']:.1f} at the end"
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}, Python {m['python']} ({load})"


def busy_warning(results: dict[str, Any]) -> str | None:
    """A warning when something else was using the cores: every number here is wall-clock."""
    m = results["machine"]
    load = max(m.get("load_before", 0), m.get("load_after", 0))
    if load > 0.5 * m["cores"]:
        return (f"The machine was busy (load average up to {load:.1f} on {m['cores']} cores): the numbers are "
                "indicative only; re-run on an idle machine.")
    return None


def setup_line(results: dict[str, Any]) -> str:
    src = results.get("src_display", results["src"])
    return (f"{results.get('images')} images ({src}), batch {results['batch_size']}, "
            f"{results['workers']} workers, {results['epochs']} warm epochs + 1 cold, output uint8 3x224x224")


def render_markdown(results: dict[str, Any]) -> str:
    """results.md: the table, then what was skipped and why, versions, notes."""
    parts = [f"# packer vs. peers ({results['date']})", "",
             f"- machine: {machine_line(results)}", f"- setup: {setup_line(results)}",
             f"- command: `{results['command']}`", f"- whole run: {results.get('seconds', 0):.0f} s", ""]
    warning = busy_warning(results)
    if warning:
        parts += [f"**{warning}**", ""]
    parts += [markdown_table(results["rows"]), "", WORK_LEGEND, "", "## Peers", ""]
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
    ax.set_yticks(range(len(rows)), [f"{r['tool']}  {r['variant']}" for r in rows], fontsize=8)
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
    lines += [markdown_table(results["rows"]), "", WORK_LEGEND, ""]
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

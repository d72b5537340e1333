"""``packer bench``'s first screen: what to use and how much faster it is than the folder, from the run's own rows,
and where the chart is (or the one line that says why there is none)."""

from __future__ import annotations

from typing import Any

PIPELINE_NAMES = {"val": "val: resize + centre crop", "train": "train: random resized crop + flip"}


def loader_label(row: dict[str, Any]) -> str:
    """How a row's loader reads: ``2 worker processes`` or ``in-process loader (2 threads)``."""
    workers = row["workers"]
    if workers:
        return f"{workers} worker process{'es' if workers > 1 else ''}"
    return f"in-process loader ({row.get('threads', '?')} threads)"


def _compared(rows: list[dict], pipeline: str) -> list[dict]:
    """The rows of ``pipeline`` to compare: the warm cache's last epoch (steady state), else the cold cache's
    first (a cold run's later epochs re-read what the first left in the page cache)."""
    mine = [r for r in rows if r["pipeline"] == pipeline]
    cache = "warm" if any(r["cache"] == "warm" for r in mine) else "cold"
    mine = [r for r in mine if r["cache"] == cache]
    epoch = max((r["epoch"] for r in mine), default=1) if cache == "warm" else 1
    return [r for r in mine if r["epoch"] == epoch]


def best_choice(rows: list[dict], pipeline: str) -> dict[str, Any] | None:
    """The fastest packed row of ``pipeline`` (see :func:`_compared`) and the folder's fastest row under the same
    pipeline, cache and epoch, with the ratio of their rates; None without both."""
    compared = _compared(rows, pipeline)
    packed = [r for r in compared if r["dataset"] != "folder"]
    folder = [r for r in compared if r["dataset"] == "folder"]
    if not packed or not folder:
        return None
    best = max(packed, key=lambda r: r["samples_per_s"])
    base = max(folder, key=lambda r: r["samples_per_s"])
    ratio = best["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else None
    return {"row": best, "folder": base, "ratio": ratio}


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One "Use: ..." line per pipeline measured, then the chart's path, or why no chart was drawn."""
    rows = results["rows"]
    lines = []
    for pipeline in dict.fromkeys(r["pipeline"] for r in rows):
        choice = best_choice(rows, pipeline)
        if choice is None:
            continue
        row, base, ratio = choice["row"], choice["folder"], choice["ratio"]
        if ratio is None:
            times = "your folder gave nothing"
        elif ratio < 1:
            times = f"{ratio:.2f}x your folder (slower: the folder is faster here)"
        else:
            times = f"{ratio:.1f}x your folder"
        lines.append(f"Use: {row['dataset']}, store {row['store']}, {loader_label(row)}: {times} "
                     f"({row['samples_per_s']:,.0f} img/s vs {base['samples_per_s']:,.0f}, the folder's fastest: "
                     f"{loader_label(base)}) [{PIPELINE_NAMES.get(pipeline, pipeline)}, {row['cache']} cache, "
                     f"epoch {row['epoch']}]")
        if row.get("plan"):
            lines.append(f"  its loader: {row['plan']}")
    if results.get("warnings"):
        lines.append("These figures are not reliable: see the WARNING lines at the end.")
    if "chart" in results:
        chart = results["chart"]
        lines.append(f"chart: {chart}" if chart else
                     "no chart: matplotlib is not installed; pip install matplotlib draws one")
    return lines

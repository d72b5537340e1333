"""``bench.png``: one panel per pipeline, a group of bars per format and store (one bar per cache and loader), the
folder as a line of the bar's colour, each decode ceiling as a tick over the one bar it is comparable with, and the
run's warnings across the top."""

from __future__ import annotations

import os
import textwrap
from typing import Any

import numpy as np

from ..errors import warn
from ..install_hints import DIST_NAME
from .summary import PIPELINE_NAMES

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red")
CEILING_KINDS = ("decode", "resize")  # ceilings of the CPU's work: comparable with a loader on as many processes


def chart_workers(rows: list[dict]) -> list[int]:
    """The worker counts charted: 0 (make_loader's in-process loader, decode threads in the main process) and
    the most worker processes measured (packer's pool: the default on 2+ cores), whichever of them the run has."""
    counts = {r["workers"] for r in rows}
    return [w for w in dict.fromkeys([0, max(counts)]) if w in counts]


def _loader_label(rows: list[dict], workers: int) -> str:
    if workers:
        return f"{workers} worker process{'es' if workers > 1 else ''}"
    threads = next((r["threads"] for r in rows if r["workers"] == 0), "?")
    return f"in-process loader ({threads} threads)"


def steady(rows: list[dict], cache: str) -> list[dict]:
    """The rows of ``cache`` that stand for it: a quick run's (no epoch), else a --full run's last warm epoch or
    first cold one (its later cold epochs re-read what the first left in the page cache)."""
    mine = [r for r in rows if r["cache"] == cache]
    epochs = [r["epoch"] for r in mine if r.get("epoch") is not None]
    if not epochs:
        return mine
    wanted = max(epochs) if cache == "warm" else 1
    return [r for r in mine if r.get("epoch") == wanted]


def comparable_ceiling(row: dict[str, Any], processes: int | None) -> float | None:
    """``row``'s decode ceiling where a bar can be held against it: the CPU's own work (decode or resize, not a
    memory copy or the disk), measured with as many processes as the row's loader has workers, on a warm cache."""
    if row["cache"] != "warm" or row.get("ceiling_kind") not in CEILING_KINDS or row["workers"] != processes:
        return None
    return row.get("cpu_ceiling_samples_per_s")


def _panel(ax: Any, rows: list[dict], pipeline: str, series: list[tuple[str, int]], processes: int | None) -> None:
    mine = [r for cache in dict.fromkeys(c for c, _ in series) for r in steady(rows, cache)
            if r["pipeline"] == pipeline]
    by_key = {(r["dataset"], r["store"], r["cache"], r["workers"]): r for r in mine}
    keys = list(dict.fromkeys((r["dataset"], r["store"]) for r in mine if r["dataset"] != "folder"))
    x = np.arange(len(keys))
    width = 0.8 / max(1, len(series))
    for k, (cache, workers) in enumerate(series):
        colour = COLOURS[k % len(COLOURS)]
        label = f"{cache} cache, {_loader_label(rows, workers)}"
        found = [by_key.get((*key, cache, workers)) for key in keys]
        centres = x - 0.4 + width * (k + 0.5)
        rates = [r["samples_per_s"] if r else 0 for r in found]
        noise = [rate * (r.get("noise") or 0) if r else 0 for rate, r in zip(rates, found, strict=True)]
        ax.bar(centres, rates, width, yerr=noise, color=colour, label=label, error_kw={"lw": 0.8, "capsize": 2})
        for centre, r in zip(centres, found, strict=True):
            if r and r.get("speedup_vs_folder"):
                ax.annotate(f"{r['speedup_vs_folder']:.1f}x", (centre, r["samples_per_s"]), ha="center",
                            va="bottom", fontsize=6)
            ceiling = comparable_ceiling(r, processes) if r else None
            if ceiling:
                ax.plot([centre - width / 2, centre + width / 2], [ceiling] * 2, color="black", lw=2)
        folder = by_key.get(("folder", "files", cache, workers))
        if folder:
            ax.axhline(folder["samples_per_s"], color=colour, ls="--",
                       label=f"folder, {cache} cache: {folder['samples_per_s']:,.0f}/s")
    ax.set_xticks(x, [f"{d}\n{s}" for d, s in keys], fontsize=7)
    ax.set_yscale("log")
    ax.set_title(PIPELINE_NAMES.get(pipeline, pipeline), fontsize=9)
    ax.set_ylabel("images/s (±: noise; black: decode ceiling)", fontsize=7)
    ax.legend(loc="best", fontsize=6)


def _series(results: dict[str, Any]) -> list[tuple[str, int]]:
    """(cache, workers) of each bar in a group: a quick run's default loader per cache, a --full run's in-process
    loader beside its most worker processes, per cache."""
    rows = results["rows"]
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    default = results.get("settings", {}).get("default_workers")
    workers = [default] if results.get("mode") == "quick" and default is not None else chart_workers(rows)
    return [(c, w) for c in caches for w in workers]


def plot(results: dict[str, Any], path: str | os.PathLike) -> bool:
    """The chart (see the module docstring) of a quick or a --full run. False without matplotlib."""
    try:  # imported here, not at load: every bench command imports this module, the chart is drawn last, pyplot
        # is the slowest import bench has, and a run without matplotlib still measures (it says why no chart)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("matplotlib is not installed, so no chart was drawn; pip install matplotlib (a dependency of "
             f"{DIST_NAME} that this environment lacks)")
        return False
    rows = results["rows"]
    series = _series(results)
    pipelines = list(dict.fromkeys(r["pipeline"] for r in rows))
    groups = len({(r["dataset"], r["store"]) for r in rows if r["dataset"] != "folder"})
    width = max(7.0, 0.35 * groups * len(series) + 2.5)
    banner = "\n".join(textwrap.fill(f"WARNING: {line}", int(width * 14)) for line in results.get("warnings", []))
    top = 0.1 + 0.17 * (banner.count("\n") + 1) if banner else 0.0
    fig, axes = plt.subplots(len(pipelines), 1, figsize=(width, 3.8 * len(pipelines) + top), squeeze=False)
    processes = (results.get("limits") or {}).get("processes")
    for ax, pipeline in zip(axes[:, 0], pipelines, strict=True):
        _panel(ax, rows, pipeline, series, processes)
    if banner:
        fig.text(0.01, 0.995, banner, color="tab:red", fontsize=8, va="top", ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - top / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

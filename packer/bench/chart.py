"""``bench.png``: samples/s per dataset and store, the default loader beside worker processes, with the folder
baselines and each bar's ceiling, and the run's warnings across the top."""

from __future__ import annotations

import os
import textwrap
from typing import Any

import numpy as np

from ..errors import warn
from ..install_hints import DIST_NAME

COLOURS = ("tab:blue", "tab:orange")
PIPELINE_LINES = {"val": "--", "train": ":"}


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


def _panel(ax: Any, rows: list[dict], cache: str, epoch: int, shown: list[int]) -> None:
    chosen = [r for r in rows if r["cache"] == cache and r["epoch"] == epoch and r["workers"] in shown]
    keys = list(dict.fromkeys((r["dataset"], r["store"], r["pipeline"]) for r in chosen if r["dataset"] != "folder"))
    by_key = {(r["dataset"], r["store"], r["pipeline"], r["workers"]): r for r in chosen}
    x = np.arange(len(keys))
    width = 0.8 / len(shown)
    for k, workers in enumerate(shown):
        colour = COLOURS[k % len(COLOURS)]
        rates = [by_key[(*key, workers)]["samples_per_s"] if (*key, workers) in by_key else 0 for key in keys]
        ax.bar(x - 0.4 + width * (k + 0.5), rates, width, color=colour, label=_loader_label(rows, workers))
        for r in chosen:
            if r["dataset"] == "folder" and r["workers"] == workers:
                ax.axhline(r["samples_per_s"], color=colour, ls=PIPELINE_LINES.get(r["pipeline"], "-."),
                           label=f"folder {r['pipeline']}, {_loader_label(rows, workers)}: "
                                 f"{r['samples_per_s']:.0f}/s")
    for i, key in enumerate(keys):
        ceiling = next((r["ceiling_samples_per_s"] for r in chosen if (r["dataset"], r["store"], r["pipeline"]) == key
                        and r.get("ceiling_samples_per_s")), None)
        if ceiling:
            ax.plot([i - 0.4, i + 0.4], [ceiling] * 2, color="black", lw=2)
    ax.set_xticks(x, [f"{d}\n{s}\n{p}" for d, s, p in keys], fontsize=7)
    ax.set_yscale("log")
    ax.set_title(f"{cache} cache, epoch {epoch}")
    ax.set_ylabel("samples/s (black tick: ceiling)")
    ax.legend(loc="best", fontsize=7)


def plot(results: dict[str, Any], path: str | os.PathLike) -> bool:
    """A bar chart of samples/s per dataset and store (last epoch warm, epoch 1 cold, as epoch 2 of a cold run is
    mostly warm), one panel per cache: the default loader beside the most worker processes measured, the folder
    baselines as lines of the same colour, each bar's ceiling as a black tick, and the run's warnings in red
    across the top. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("matplotlib is not installed, so no chart was drawn; pip install matplotlib (a dependency of "
             f"{DIST_NAME} that this environment lacks)")
        return False
    rows = results["rows"]
    shown = chart_workers(rows)
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    groups = len({(r["dataset"], r["store"], r["pipeline"]) for r in rows if r["dataset"] != "folder"})
    width = max(8.0, 0.45 * groups * len(shown) + 2)
    banner = "\n".join(textwrap.fill(f"WARNING: {line}", int(width * 14)) for line in results.get("warnings", []))
    top = 0.1 + 0.17 * (banner.count("\n") + 1) if banner else 0.0
    fig, axes = plt.subplots(len(caches), 1, figsize=(width, 4.2 * len(caches) + top), squeeze=False)
    for ax, cache in zip(axes[:, 0], caches, strict=True):
        _panel(ax, rows, cache, 1 if cache == "cold" else max(r["epoch"] for r in rows), shown)
    if banner:
        fig.text(0.01, 0.995, banner, color="tab:red", fontsize=8, va="top", ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - top / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

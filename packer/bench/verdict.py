"""The quick benchmark's first lines: what to pack with and why, in the user's terms.

The choice is the packed dataset (format and store) that trains fastest with the default loader on a warm page cache
(validation's speed decides where no training pipeline was measured); rates within their noise of the fastest count
as equal, and the smallest on disk of those is chosen. The lines give the command that packs it, its speed over the
folder for training and validation (warm, and cold where measured), its size on disk against the folder's, the next
best choice if disk is short, and the smallest number of workers with which a training step would not wait for data.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from .chart import steady
from .measure import change

PIPELINE_WORDS = {"train": "training (random resized crop + flip)", "val": "validation (resize + centre crop)"}
SMALLER = 0.8  # a choice "if disk is short" takes at most this fraction of the chosen one's bytes
WAITS_BELOW = 0.05  # a step that waits for data less than this fraction of its time "does not wait"


def _size(size: Any) -> str:
    return f"{size[0]}x{size[1]}" if isinstance(size, (list, tuple)) else str(size)


def pack_command(src: str, row: dict[str, Any]) -> str:
    """The ``packer pack`` command that packs ``src`` as ``row``'s dataset was packed, into a folder beside it named
    after the source, the format and the store (``sample_data-hdf5-jpeg``)."""
    given = Path(src)
    name = given.name or Path(src).resolve().name
    dest = given.parent / f"{name}-{row['dataset']}-{row['store_mode']}"
    words = ["packer", "pack", src, str(dest), "--format", row["dataset"], "--store", row["store_mode"]]
    if row.get("pack_resize"):
        words += ["--resize", _size(row["pack_resize"])]
    if row.get("pack_crop"):
        words += ["--center-crop", _size(row["pack_crop"])]
    return shlex.join(words)


def _steady(rows: list[dict], pipeline: str, cache: str, workers: int) -> list[dict]:
    """The rows of ``pipeline`` and ``cache`` read with ``workers`` that stand for that cache (:func:`steady`)."""
    return [r for r in steady(rows, cache) if r["pipeline"] == pipeline and r["workers"] == workers]


def _closest(packed: list[dict]) -> tuple[dict, dict]:
    """The smallest on disk of the rows within their noise of the fastest, and the fastest."""
    best = max(packed, key=lambda r: r["samples_per_s"])
    close = [r for r in packed if change(best, r)["within"]]
    return min(close, key=lambda r: (r["bytes_on_disk"], -r["samples_per_s"])), best


def choose(rows: list[dict], workers: int) -> dict[str, Any] | None:
    """The chosen packed row and its pipeline: among the warm rows read with ``workers`` of the training pipeline
    (else validation), the smallest on disk of those within their noise of the fastest; None without any."""
    for pipeline in ("train", "val"):
        packed = [r for r in _steady(rows, pipeline, "warm", workers) if r["dataset"] != "folder"]
        if packed:
            row, best = _closest(packed)
            return {"row": row, "pipeline": pipeline, "fastest": best}
    return None


def _same(rows: list[dict], row: dict, pipeline: str, cache: str, workers: int) -> tuple[dict | None, dict | None]:
    """``row``'s dataset and store read by ``pipeline`` with ``cache``, and the folder's row beside it."""
    mine = _steady(rows, pipeline, cache, workers)
    packed = next((r for r in mine if (r["dataset"], r["store"]) == (row["dataset"], row["store"])), None)
    folder = next((r for r in mine if r["dataset"] == "folder"), None)
    return packed, folder


def _times(packed: dict | None, folder: dict | None, words: str = "img/s against ") -> str | None:
    if packed is None or folder is None or not folder["samples_per_s"]:
        return None
    ratio = packed["samples_per_s"] / folder["samples_per_s"]
    return f"{ratio:.1f}x the folder ({packed['samples_per_s']:,.0f} {words}{folder['samples_per_s']:,.0f})"


def speed_lines(rows: list[dict], row: dict, workers: int) -> list[str]:
    """For each pipeline measured: ``row``'s speed over the folder's, warm, and cold where measured."""
    lines = []
    for pipeline in dict.fromkeys(r["pipeline"] for r in rows):
        warm = _times(*_same(rows, row, pipeline, "warm", workers))
        cold = _times(*_same(rows, row, pipeline, "cold", workers), words="against ")
        if warm is None and cold is None:
            continue
        parts = [f"{warm} warm" if warm else None, f"{cold} cold" if cold else None]
        lines.append(f"  {PIPELINE_WORDS.get(pipeline, pipeline)}: {', '.join(p for p in parts if p)}")
    return lines


def _mb(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n:.0f} bytes"


def disk_lines(src: str, rows: list[dict], choice: dict[str, Any], source: dict[str, Any], workers: int) -> list[str]:
    """The chosen dataset's size against the folder's (and for the whole folder, where a sample was measured), and
    the fastest choice smaller on disk."""
    row, source_bytes = choice["row"], source["bytes"]
    line = f"  on disk: {_mb(row['bytes_on_disk'])}"
    if source_bytes:
        line += f", {row['bytes_on_disk'] / source_bytes:.2f}x the folder's {_mb(source_bytes)}"
    everything = source.get("all_images") or source.get("images")
    if everything and source.get("images") and everything > source["images"]:
        line += (f" for the {source['images']:,} images measured: about "
                 f"{_mb(row['bytes_on_disk'] * everything / source['images'])} for all {everything:,}")
    lines = [line]
    packed = [r for r in _steady(rows, choice["pipeline"], "warm", workers) if r["dataset"] != "folder"]
    smaller = [r for r in packed if r["bytes_on_disk"] <= SMALLER * row["bytes_on_disk"]]
    if not smaller:
        lines.append("  if disk is short: this is the smallest on disk of those measured")
        return lines
    other = _closest(smaller)[0]
    speeds = [f"{pipeline} {t.split(' (')[0]}" for pipeline in ("train", "val")
              if (t := _times(*_same(rows, other, pipeline, "warm", workers)))]
    ratio = f", {other['bytes_on_disk'] / source_bytes:.2f}x the folder's size" if source_bytes else ""
    lines.append(f"  if disk is short: {pack_command(src, other)} ({_mb(other['bytes_on_disk'])}{ratio}; "
                 f"{', '.join(speeds)})")
    return lines


def worker_line(rows: list[dict], row: dict, pipeline: str, batch_size: int, step_ms: float) -> str | None:
    """The smallest number of workers with which a training step would not wait for ``row``'s dataset: measured
    with ``step_ms``; without it, the shortest step each worker count keeps up with."""
    mine = sorted((r for r in rows if r["pipeline"] == pipeline and r["cache"] == "warm" and r.get("epoch") is None
                   and (r["dataset"], r["store"]) == (row["dataset"], row["store"])), key=lambda r: r["workers"])
    if not mine:
        return None
    if step_ms:
        fine = [r for r in mine if r.get("data_stall") is not None and r["data_stall"] < WAITS_BELOW]
        if fine:
            r = fine[0]
            return (f"  workers: with {r['workers']} the GPU would not wait: a {step_ms:g} ms step waits for data "
                    f"{r['data_stall']:.1%} of the time (p95 wait {r['wait_p95_ms']:.1f} ms a batch)")
        r = mine[-1]
        stall = r.get("data_stall") or 0.0
        return (f"  workers: even with {r['workers']} a {step_ms:g} ms step waits for data {stall:.0%} of the time "
                f"(p95 wait {r['wait_p95_ms']:.1f} ms a batch): the loader, not the GPU, sets the pace")
    keeps = [f"{batch_size / r['samples_per_s'] * 1e3:.1f} ms or more with {r['workers']}" for r in mine
             if r["samples_per_s"]]
    return (f"  workers: a training step of {', '.join(keeps)} worker{'s' if mine[-1]['workers'] > 1 else ''} would "
            f"not wait for batches of {batch_size} (on average; --step-ms N measures a step of N ms)")


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """The verdict's lines and what they were made from (``results["verdict"]``)."""
    rows, settings = results["rows"], results["settings"]
    workers = settings["default_workers"]
    choice = choose(rows, workers)
    src = settings["src_given"]
    if choice is None:
        return {"lines": ["No packed dataset was measured: nothing to choose from."], "choice": None}
    row = choice["row"]
    lines = [f"Pack with: {pack_command(src, row)}"]
    packed, folder = _same(rows, row, choice["pipeline"], "warm", workers)
    if packed and folder and packed["samples_per_s"] < folder["samples_per_s"]:
        lines[0] += "  (though no packed dataset read faster than the folder here)"
    lines += speed_lines(rows, row, workers)
    lines += disk_lines(src, rows, choice, results["source"], workers)
    line = worker_line(rows, row, choice["pipeline"], settings["batch_size"], settings["step_ms"])
    if line:
        lines.append(line)
    lines += [f"  not measured: {why}" for why in results.get("skipped", [])]
    return {"lines": lines, "choice": {k: row[k] for k in ("dataset", "store", "store_mode", "pipeline")},
            "command": pack_command(src, row), "decided_by": choice["pipeline"]}

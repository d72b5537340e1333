"""``packer bench``'s entry point: :func:`run_bench` and the parsing of its options."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .. import __version__
from ..errors import PackerError, UsageError
from ..images.transforms import parse_size
from ..system import usable_cores
from .limits import add_ceilings, interleaved_ceiling, measure_limits
from .machine import load_average, load_text, machine_busy, machine_info
from .measure import add_drift, add_speedups, check_signature, measure, output_signature
from .pipelines import PIPELINES, parse_pipelines
from .report import batches_per_epoch, figure_warnings, notes, write_outputs
from .shuffle_quality import measure_shuffle_quality
from .targets import Size, Variant, existing_conversion, folder_target, pack_target, packed_target, parse_variant

DEFAULT_OUT = "bench-out"


def split_names(text: str) -> list[str]:
    """``"lmdb,hdf5"`` -> ["lmdb", "hdf5"]."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise UsageError(f"{text!r} is not a comma-separated list")
    return names


def split_ints(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]."""
    try:
        values = [int(x) for x in split_names(text)]
    except ValueError:
        raise UsageError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if any(v < 0 for v in values):
        raise UsageError(f"{text!r}: numbers must not be negative")
    return values


def optional_size(text: str | None) -> Size:
    """A size option where ``none`` (or 0) means no resize/crop."""
    if text is None or str(text).strip().lower() in ("", "none", "0"):
        return None
    return parse_size(text)


def default_workers() -> list[int]:
    """0 (the main process), 1, half and all of the usable cores: 0,1,2 on two cores."""
    cores = usable_cores()
    return sorted({0, 1, cores // 2, cores})


def run_bench(src: str | os.PathLike, *, formats: Sequence[str] = ("lmdb", "hdf5", "wds"),
              stores: Sequence[str | Variant] = ("original", "jpeg", "raw"), resize: Size = 256,
              center_crop: Size = 224, batch_size: int = 64, workers: Sequence[int] | None = None, epochs: int = 2,
              caches: Sequence[str] = ("warm", "cold"), step_ms: float = 0.0,
              out: str | os.PathLike | None = DEFAULT_OUT, keep: bool = False,
              packed: Sequence[str | os.PathLike] = (), repeats: int = 3, read_resize: Size = 256,
              read_crop: Size = 224, work: str | os.PathLike | None = None, limits: bool = True,
              disk_test_mb: int = 384, prefetch_factor: int = 4, progress: bool = True,
              command: str | None = None, pipelines: Sequence[str] = PIPELINES,
              log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Pack ``src`` into every format x store (or use ``packed``), read each and the folder through
    :func:`packer.make_loader`, and return (and write to ``out``, when given) every figure. See the module
    docstring for what is measured; ``stores`` entries are parsed by :func:`parse_variant`. Each row is the
    median of ``repeats`` runs. ``log``, when given, is handed the load average as the run starts."""
    src = Path(src)
    read_resize, read_crop = parse_size(read_resize), parse_size(read_crop)
    if not read_crop and not isinstance(read_resize, tuple):
        raise UsageError("the benchmark needs a fixed output size: give read_crop (or read_resize as WxH)")
    bad = [c for c in caches if c not in ("warm", "cold")]
    if bad or epochs < 1 or repeats < 1 or batch_size < 1:
        raise UsageError("caches are warm and/or cold; epochs, repeats and batch_size are at least 1")
    variants = [s if isinstance(s, Variant) else parse_variant(s, parse_size(resize), parse_size(center_crop))
                for s in stores]
    pipelines = parse_pipelines(list(pipelines))
    if not src.is_dir():
        raise PackerError(f"{src}: no such folder; give the image folder to benchmark")
    settings = {"formats": list(formats), "stores": [v.label for v in variants], "batch_size": batch_size,
                "workers": list(workers) if workers is not None else default_workers(), "epochs": epochs,
                "caches": list(caches), "step_ms": step_ms, "repeats": repeats, "read_resize": read_resize,
                "read_crop": read_crop, "prefetch_factor": prefetch_factor, "disk_test_mb": disk_test_mb,
                "packed": [str(p) for p in packed], "pipelines": pipelines}
    work_parent = Path(work) if work else Path(out) if out else Path(tempfile.gettempdir())
    work_parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="packer-bench-", dir=work_parent))
    load: dict[str, Any] = {"start": load_average(), "end": None, "usable_cores": usable_cores()}
    if log is not None:
        log(f"load average at the start (1, 5, 15 min): {load_text(load['start'])}, on {load['usable_cores']} "
            "usable cores")
    try:
        results = _bench(src, work_dir, variants, settings, packed, limits, progress)

        def judge(results: dict[str, Any]) -> None:
            results["warnings"] = figure_warnings(results["batches_per_epoch"], load)

        return finish(results, load, command or f"run_bench({str(src)!r}, ...)", work_dir if keep else None, out,
                      judge)
    finally:
        if not keep:
            shutil.rmtree(work_dir, ignore_errors=True)


def finish(results: dict[str, Any], load: dict[str, Any], command: str, kept: Path | None,
           out: str | os.PathLike | None, judge: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """A run's last steps: the load average at its end, its command, what ``judge`` concludes from them (warnings,
    a verdict), where its packs were kept, and its files written to ``out`` (when given)."""
    load["end"] = load_average()
    load["busy"] = machine_busy(load["start"], load["end"], load["usable_cores"])
    results["load_average"] = load
    results["command"] = command
    add_drift(results)
    judge(results)
    results["work"] = str(kept) if kept else None
    if out is not None:
        results["outputs"] = write_outputs(results, out)
    return results


def _bench(src: Path, work: Path, variants: list[Variant], settings: dict, packed: Sequence,
           limits: bool, progress: bool) -> dict[str, Any]:
    machine = machine_info(work, src)
    folder = folder_target(src, settings["read_resize"], settings["read_crop"])
    if packed:
        targets = [packed_target(Path(p), settings["read_resize"], settings["read_crop"]) for p in packed]
        conversions: list[dict[str, Any] | None] = [existing_conversion(t, folder.bytes_on_disk) for t in targets]
    else:
        targets = [pack_target(src, work, fmt, v, folder.bytes_on_disk, settings["read_resize"],
                               settings["read_crop"], progress) for v in variants for fmt in settings["formats"]]
        conversions = [t.conversion for t in targets]
    expected = output_signature(folder)
    for target in targets:
        check_signature(output_signature(target), expected, str(target.root))
    # the train pipeline crops every dataset to the output size from its full stored image
    train = {"read_resize": settings["read_resize"], "read_crop": settings["read_crop"]}
    everything = [replace(t, pipeline=p, **(train if p == "train" else {}))
                  for p in settings["pipelines"] for t in [folder, *targets]]
    limit_info = measure_limits(work, settings) if limits else {}
    per_sample = len(settings["workers"]) * len(settings["caches"]) * settings["repeats"] * settings["epochs"]
    bar = tqdm(total=sum(t.count for t in everything) * per_sample, unit="img", desc="reading",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    rows: list[dict] = []
    try:
        for target in everything:
            bar.set_postfix_str(f"{target.dataset} {target.store}")
            with interleaved_ceiling(limit_info, target) as ceiling_round:
                rows += measure(target, settings, expected, bar, before_run=ceiling_round)
    finally:
        bar.close()
    quality = measure_shuffle_quality(src, work, settings["batch_size"], progress)
    add_speedups(rows)
    if limit_info:
        add_ceilings(rows, everything, limit_info)
    return {"packer_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine, "settings": settings, "source": {"root": str(src.resolve()), "images": folder.count,
                                                                 "bytes": folder.bytes_on_disk},
            "output": {"shape": list(expected[:3]), "dtype": expected[3]}, "limits": limit_info,
            "conversions": conversions, "rows": rows, "shuffle_quality": quality,
            "notes": notes(settings, rows, machine),
            "batches_per_epoch": batches_per_epoch(settings, folder.count)}

"""The machine a benchmark runs on: cores, memory, CPU, library versions, filesystems and load average."""

from __future__ import annotations

import importlib.metadata
import multiprocessing as mp
import os
import platform
from pathlib import Path
from typing import Any

from .. import __version__
from ..images.jpeg_window import libjpeg_turbo_version
from ..system import usable_cores

VERSIONED = ("torch", "numpy", "pillow", "simplejpeg", "h5py", "lmdb", "webdataset")


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem holding ``path`` (ext4, xfs, tmpfs, overlay, nfs...), from /proc/self/mounts."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    try:  # a cgroup limit is what this process can really use
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(work: str | os.PathLike | None = None, src: str | os.PathLike | None = None) -> dict[str, Any]:
    """Cores, memory, CPU, library versions, start method and filesystem types, for results.json."""
    info: dict[str, Any] = {
        "usable_cores": usable_cores(), "cpu_count": os.cpu_count(), "cpu_model": _cpu_model(),
        "memory_gib": round(_memory_bytes() / 2**30, 1), "platform": platform.platform(),
        "python": platform.python_version(), "packer": __version__,
        "versions": {name: _version(name) for name in VERSIONED},
        "start_method": mp.get_context().get_start_method(),
        "window_decoder": libjpeg_turbo_version(),  # packer's JPEG window decoder: its libjpeg-turbo, or None
    }
    if work is not None:
        info["work_filesystem"] = filesystem_type(work)
    if src is not None:
        info["src_filesystem"] = filesystem_type(src)
    return info


def describe_machine(m: dict[str, Any]) -> str:
    v = m["versions"]
    return (f"{m['usable_cores']} usable cores ({m['cpu_model']}), {m['memory_gib']} GiB, Python {m['python']}, "
            f"torch {v['torch']}, Pillow {v['pillow']}, simplejpeg {v['simplejpeg']}, h5py {v['h5py']}, "
            f"lmdb {v['lmdb']}, webdataset {v['webdataset']}, {window_decoder(m)}, start method {m['start_method']}, "
            f"work folder on {m.get('work_filesystem', '?')}")


def window_decoder(m: dict[str, Any]) -> str:
    """Whether packer's JPEG window decoder was built, from :func:`machine_info` (runs before it had none)."""
    if "window_decoder" not in m:
        return "window decoder not recorded"
    version = m["window_decoder"]
    return f"window decoder on libjpeg-turbo {version}" if version else "no window decoder (JPEGs decode whole)"



def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the system does not keep them)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_busy(start: list[float] | None, end: list[float] | None, cores: int) -> bool:
    """Whether other work competed with a benchmark: a 1-minute load average above the usable cores before it
    started, or above twice them at its end (that one counts the benchmark's own loaders, which keep up to
    every usable core busy)."""
    return bool((start and start[0] > cores) or (end and end[0] > 2 * cores))


def load_text(values: list[float] | None) -> str:
    """``load_average()`` as ``"0.52, 0.61, 0.70"``."""
    return ", ".join(f"{v:.2f}" for v in values) if values else "unknown"


def describe_load(load: dict[str, Any]) -> str:
    """One line: the load averages at the start and end of a run, beside the usable cores."""
    return (f"load average (1, 5, 15 min): {load_text(load['start'])} at the start, {load_text(load['end'])} at "
            f"the end (which counts the benchmark's own loaders), on {load['usable_cores']} usable cores")

"""What this machine lets packer use."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.context import BaseContext
from pathlib import Path


def usable_cores() -> int:
    """Cores this process may run on: the affinity mask (which SLURM and taskset set), capped by a cgroup
    CPU quota and SLURM_CPUS_PER_TASK."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit():
        cores = min(cores, int(slurm))
    return max(1, cores)


def process_context() -> BaseContext:
    """The start method for packer's process pools: fork where the platform has it (workers inherit what the
    parent has loaded, and start at once), else spawn."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")

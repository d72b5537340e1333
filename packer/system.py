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


def cores_per_rank() -> int:
    """This process's share of :func:`usable_cores` when torchrun runs several ranks on the node
    (``LOCAL_WORLD_SIZE``): each rank's affinity mask is usually the whole node."""
    try:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        ranks = 1
    return max(1, usable_cores() // max(1, ranks))


def process_context() -> BaseContext:
    """The start method for packer's process pools: fork where the platform has it (workers inherit what the
    parent has loaded, and start at once), else spawn."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")

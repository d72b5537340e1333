"""What this machine lets packer use."""

from __future__ import annotations

import os
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

"""What this machine lets packer use, and the platform code packer's processes rely on: file locks, and worker
processes that end with the process that started them."""

from __future__ import annotations

import ctypes
import errno
import multiprocessing as mp
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterable
from multiprocessing.context import BaseContext
from pathlib import Path
from types import ModuleType

fcntl: ModuleType | None
msvcrt: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:  # POSIX
    msvcrt = None


def default_cache_dir() -> Path:
    """packer's cache folder: ``PACKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/packer``, else ``~/.cache/packer``
    (remote datasets' files and blocks; local datasets' layouts for ``page_budget``)."""
    env = os.environ.get("PACKER_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "packer"


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


def is_regular_file(path: str | os.PathLike) -> bool:
    """A regular file, not a link to one; False where it cannot be told (a name too long, for one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_folder(path: str | os.PathLike) -> bool:
    """A folder, not a link to one; False where it cannot be told."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def file_is_at(fd: int, path: str | os.PathLike) -> bool:
    """Whether the file open as ``fd`` is still the one at ``path``, not removed or replaced since it was opened
    (while ``fd`` is open, its inode's number is not reused): a lock file that its holder removes as it lets go
    was locked in vain by a waiter that opened it before."""
    try:
        here, mine = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def lock_file(fd: int, exclusive: bool = True, blocking: bool = True) -> bool:
    """Lock the open file ``fd`` for this open file (``fcntl.flock`` on POSIX; on Windows ``msvcrt.locking`` of
    its first byte, always exclusive). The lock goes with the file's last close, and with the process.

    Returns:
        True once locked; False when ``blocking`` is off and another open file holds the lock.

    Raises:
        OSError: the file system cannot lock, or this Python has no way to (neither fcntl nor msvcrt).
    """
    if fcntl is not None:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            return False
        return True
    if msvcrt is not None:
        while True:
            os.lseek(fd, 0, os.SEEK_SET)
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EDEADLK):
                    raise
            if not blocking:
                return False
            time.sleep(0.05)
    raise OSError(errno.ENOLCK, "this Python has neither fcntl nor msvcrt, so packer cannot lock files")


def unlock_file(fd: int) -> None:
    """Undo :func:`lock_file` (closing the file does too)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    elif msvcrt is not None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


# Which thread forked this process, and from which process: the parent-death signal follows the thread that
# forked, so it is set only in a child forked from its parent's main thread (a worker forked from a thread that
# ends would be killed with that thread).
_forked_by: tuple[int, bool] | None = None


def _before_fork() -> None:
    global _forked_by
    _forked_by = (os.getpid(), threading.current_thread() is threading.main_thread())


os.register_at_fork(before=_before_fork)


def close_fds(fds: Iterable[int]) -> None:
    """Close these descriptors, those that are open: in a forked worker, the parent's ends of pipes and other
    workers' pipes, which would keep the worker from seeing its parent go away."""
    for fd in set(fds):
        try:
            os.close(fd)
        except OSError:
            pass


def die_with_parent() -> None:
    """In a worker process just forked: be killed (SIGKILL) when the parent dies, through Linux's
    ``PR_SET_PDEATHSIG``; exit at once if the parent is already gone. A no-op where the platform has no such
    signal, in a child not forked (spawned), and in one forked from a thread other than its parent's main thread.
    A worker that closes the descriptors it does not own (:func:`close_fds`) still sees its pipe's end of file."""
    if not sys.platform.startswith("linux") or _forked_by is None:
        return
    parent, from_main = _forked_by
    if from_main:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
    if os.getppid() != parent:  # the parent died before prctl: nobody would send the signal
        os._exit(1)

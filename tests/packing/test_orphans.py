"""Workers die with their parent: a ``kill -9`` of the process that started packer's workers (what SLURM
preemption and the OOM killer do) leaves no worker process, and no shared memory of theirs, within 10 s. Real
processes: a training script iterating the default loader (packer's worker pool, and torch's DataLoader workers),
and ``packer pack --workers 2``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import write_image

import packer

GONE_WITHIN = 10.0  # seconds
TIMEOUT = 300

TRAINER = """
import sys, time, torch, packer
ds = packer.open_dataset(sys.argv[1], resize=24, center_crop=24)  # one shape: the worker pool serves it
extra = {"generator": torch.Generator()} if sys.argv[2] == "torch" else {}  # a setting only torch's workers take
loader = packer.make_loader(ds, batch_size=4, num_workers=2, tuned=False, **extra)
batches = iter(loader)
next(batches)
print("pool" if loader.worker_pool is not None else "torch", flush=True)
time.sleep(600)  # mid-epoch, iterator held, workers prefetching
"""


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("orphans")
    for i in range(64):
        write_image(root / "src" / ("cat" if i % 2 else "dog") / f"{i}.png", 32, 24, seed=i)
    packer.pack(root / "src", root / "ds", "lmdb", workers=1, progress=False)
    return root / "ds"


def shm_mapped(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes have mapped or open, by name."""
    names = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            paths = [m.path for m in proc.memory_maps()] + [f.path for f in proc.open_files()]
        except psutil.Error:
            continue
        names.update(p.split(" (deleted)")[0] for p in paths if p.startswith("/dev/shm/"))
    return names


def alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def kill_and_check(proc: subprocess.Popen, workers: list[int]) -> None:
    """``kill -9`` ``proc``; within 10 s none of ``workers`` runs and none of their /dev/shm files is left."""
    assert workers, "no worker processes to watch"
    shm = shm_mapped([proc.pid, *workers])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=TIMEOUT)  # not its pipes: a worker left alive would hold them open
    deadline = time.monotonic() + GONE_WITHIN
    while (alive(workers) or [n for n in shm if os.path.exists(n)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(workers)
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"workers outlived their parent: {left}"
    assert [n for n in shm if os.path.exists(n)] == []
    proc.communicate(timeout=TIMEOUT)


def children(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


@pytest.mark.parametrize("kind", ["pool", "torch"])
def test_kill_9_of_a_trainer_leaves_no_loader_worker(packed, kind):
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(packed), kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        workers = children(proc.pid)
        assert line == kind
        assert len(workers) >= 2
    except BaseException:
        for pid in [*children(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        print(proc.communicate(timeout=TIMEOUT))
        raise
    kill_and_check(proc, workers)


def test_kill_9_of_packer_pack_leaves_no_conversion_worker(tmp_path):
    src = tmp_path / "src"
    for i in range(8):
        write_image(src / ("cat" if i % 2 else "dog") / f"good{i}.png", 20, 16, seed=i)
    for i in range(1500):  # their warnings fill stderr, unread: the run stays mid-conversion
        (src / "cat" / f"bad{i:04d}.jpg").write_bytes(b"not an image")
    dest = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-m", "packer", "pack", str(src), str(dest), "--format", "lmdb",
                             "--quiet", "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(workers := children(proc.pid)) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the conversion never started its workers"
            time.sleep(0.05)
        time.sleep(0.5)  # converting
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    kill_and_check(proc, workers)


def test_workers_started_from_a_thread_outlive_that_thread(packed):
    """The parent-death signal follows the thread that forked: a pool started while a thread iterated (then
    ended) must keep serving the next epoch, so it is set only for workers forked from the main thread."""
    import threading

    ds = packer.open_dataset(packed, resize=24, center_crop=24)
    loader = packer.make_loader(ds, batch_size=8, num_workers=2, tuned=False, shuffle=False)
    first: list[int] = []
    thread = threading.Thread(target=lambda: first.extend(int(y) for _, labels in loader for y in labels))
    thread.start()
    thread.join(TIMEOUT)
    assert loader.worker_pool is not None and len(first) == len(ds)
    time.sleep(0.5)  # a signal sent when the thread ended would have arrived
    assert [int(y) for _, labels in loader for y in labels] == first
    assert all(p.is_alive() for p in loader.worker_pool.processes)
    loader.worker_pool.close()

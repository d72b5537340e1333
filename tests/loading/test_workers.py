"""packer's worker pool (``packer.loading.workers``): make_loader's default for fixed-shape packed datasets on 2+ cores,
and what ``num_workers=N`` gives them. Real worker processes, real shared memory."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import psutil
import pytest
import torch
from support.packed import FORMATS

import packer
from packer.errors import CorruptDataError, PackerError
from packer.loading.workers import WorkerPool
from packer.reading.buffers import shared_tensor
from packer.reading.scratch import DECODE_OFFSET
from packer.system import usable_cores

BATCH = 16
LIVENESS = 120  # a bound on a hung worker, not a timing


@pytest.fixture(scope="module")
def pack(pack_once, sample_data):
    return lambda fmt, store: pack_once(sample_data, fmt, store)


def threaded_epoch(ds, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled epoch through the in-process threaded loader: the reference."""
    return copied(packer.make_loader(ds, batch_size=BATCH, seed=seed, num_workers=0))


def copied(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An epoch's batches, each copied (the loader may reuse a batch's memory once it is dropped)."""
    return [(images.clone(), labels) for images, labels in loader]


def assert_same_batches(got, expected) -> None:
    assert len(got) == len(expected)
    for (images, labels), (ref_images, ref_labels) in zip(got, expected, strict=True):
        assert images.shape == ref_images.shape and images.dtype == ref_images.dtype
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


@pytest.mark.parametrize("store", ["jpeg_fixed", "raw"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_gives_the_threaded_loaders_batches_and_keeps_the_ones_held(pack, fmt, store):
    """Every epoch (shuffled, the last batch short) equals the threaded loader's, and the batches of epoch 1,
    all kept while epochs 2 and 3 run through the same slots, still hold their pixels afterwards."""
    ds = packer.open_dataset(pack(fmt, store))
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=2, timeout=LIVENESS)
    assert loader.worker_pool is None, "started at the first iteration"
    kept = list(loader)
    assert loader.worker_pool is not None and len(loader.worker_pool.processes) == 2
    assert len(ds) % BATCH and len(kept[-1][1]) == len(ds) % BATCH
    for epoch in (1, 2):
        assert_same_batches(copied(loader), threaded_epoch(ds, epoch))
    assert_same_batches(kept, threaded_epoch(ds, 0))


def test_default_loader_on_two_cores_is_the_pool(pack):
    ds = packer.open_dataset(pack("lmdb", "raw"))
    loader = packer.make_loader(ds, batch_size=BATCH)
    if usable_cores() < 2:
        pytest.skip("one usable core: the default is the threaded loader")
    assert loader.num_workers >= 2 and loader.threads == 1
    assert_same_batches(copied(loader), threaded_epoch(ds))
    # what the pool cannot make (a per-item transform, images of varying size) keeps the threaded loader
    assert packer.make_loader(packer.open_dataset(pack("lmdb", "raw"), transform=lambda x: x)).num_workers == 0
    assert packer.make_loader(packer.open_dataset(pack("lmdb", "original"))).num_workers == 0


def test_batches_start_where_jpeg_decodes_run_fastest(pack):
    """libjpeg-turbo decodes ~10% slower into memory at a multiple of 32 bytes, which is what every allocator
    gives (``packer.reading.scratch.DECODE_OFFSET`` has the measurements): the pool's slots, the threaded loader's
    batches and torch workers' shared batches start ``DECODE_OFFSET`` past a 64-byte boundary."""
    ds = packer.open_dataset(pack("hdf5", "jpeg_fixed"))
    for settings in ({"num_workers": 0}, {"num_workers": 2, "timeout": LIVENESS}):
        images, _ = next(iter(packer.make_loader(ds, BATCH, **settings)))
        assert images.data_ptr() % 64 == DECODE_OFFSET
    assert shared_tensor((2, 3), torch.float32).data_ptr() % 64 == DECODE_OFFSET


def test_slots_are_reused_once_dropped(pack):
    ds = packer.open_dataset(pack("hdf5", "jpeg_fixed"))
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=2, prefetch_factor=2, timeout=LIVENESS)
    for _ in range(4):
        assert sum(len(labels) for _, labels in loader) == len(ds)
    slots = len(loader.worker_pool.slots)
    assert slots <= loader.worker_pool.slots.keep, "batches nobody holds are written again, not made anew"


def test_copied_out_batches_free_their_slot_at_once(pack):
    """With pinned memory (on CUDA) each batch is copied out of its slot; the same path, unpinned, here."""
    ds = packer.open_dataset(pack("wds", "jpeg_fixed"))
    pool = WorkerPool(ds, workers=2, batch_size=BATCH, prefetch_factor=2, copy_out=True, timeout=LIVENESS)
    try:
        indices = list(range(len(ds)))
        batches = [indices[a:a + BATCH] for a in range(0, len(ds), BATCH)]
        kept = list(pool.iterate(iter(batches)))
        assert len(pool.slots) <= pool.depth + 1, "a copied-out slot is free again at once"
        reference = packer.make_loader(ds, batch_size=BATCH, shuffle=False, num_workers=0)
        assert_same_batches(kept, copied(reference))
    finally:
        pool.close()
    assert all(not p.is_alive() for p in pool.processes)


def test_a_new_pass_after_a_break_is_whole_and_right(pack):
    ds = packer.open_dataset(pack("lmdb", "jpeg_fixed"))
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=2, timeout=LIVENESS)
    for step, _ in enumerate(loader):  # stop with batches still in flight
        if step == 1:
            break
    assert_same_batches(copied(loader), threaded_epoch(ds, 1))


def test_a_damaged_sample_is_raised_in_the_main_process_naming_it(pack, tmp_path):
    dest = tmp_path / "ds"
    shutil.copytree(pack("hdf5", "jpeg_fixed"), dest)
    k = 21
    with h5py.File(dest / "data.h5", "r+") as f:
        at = int(f["offsets"][k]) + 40
        f["images"][at] ^= 0xFF
    ds = packer.open_dataset(dest, verify=True)
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False, num_workers=2, timeout=LIVENESS)
    with pytest.raises(CorruptDataError, match=rf"data\.h5 sample {k}\b") as info:
        for _ in loader:
            pass
    assert "\n" not in str(info.value)
    # the pool goes on serving the samples that are intact
    assert len(next(iter(loader))[1]) == BATCH


def test_a_killed_worker_is_an_error_not_a_hang(pack):
    ds = packer.open_dataset(pack("wds", "jpeg_fixed"))
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=2, timeout=LIVENESS)
    it = iter(loader)
    next(it)
    os.kill(loader.worker_pool.processes[0].pid, signal.SIGKILL)
    with pytest.raises(PackerError, match=r"loader worker 0 \(pid \d+\) exited with code -9"):
        for _ in it:
            pass
        for _ in loader:  # a worker killed after answering all of this epoch's batches fails the next one
            pass


def test_a_stuck_worker_times_out_in_one_line_and_writes_where_it_is_stuck(pack, capfd):
    """A worker stuck in a read (a hung network mount, here a read that never returns) is the loader's timeout
    error, one line, and each worker writes every thread's stack to stderr first: where it was stuck."""
    ds = packer.open_dataset(pack("lmdb", "raw"))
    parent = os.getpid()

    class StuckReads(type(ds)):
        def decode_slot(self, indices, arrays):
            if os.getpid() != parent:
                time.sleep(LIVENESS)  # a read that never returns
            return super().decode_slot(indices, arrays)

    ds.__class__ = StuckReads
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=2, timeout=2)
    try:
        with pytest.raises(PackerError, match=r"no batch from the loader's 2 worker processes in 2 s \(timeout=\); a "
                                              r"worker may be stuck reading .*\(each worker wrote where it is to "
                                              r"stderr\)$") as info:
            next(iter(loader))
        assert "\n" not in str(info.value)
        err = capfd.readouterr().err
        assert err.count("(most recent call first)") >= 2 and "in decode_slot" in err, err[-2000:]
    finally:
        for process in loader.worker_pool.processes:
            process.kill()


def test_dropped_loader_stops_its_workers(pack):
    def start() -> list[int]:
        loader = packer.make_loader(packer.open_dataset(pack("lmdb", "raw")), batch_size=BATCH, num_workers=2)
        next(iter(loader))
        return [p.pid for p in loader.worker_pool.processes]

    pids = start()
    gc.collect()
    deadline = time.monotonic() + LIVENESS
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                                              != psutil.STATUS_ZOMBIE for pid in pids):
        time.sleep(0.05)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


SMALL_SHM = """
import sys, warnings
import packer
from packer.errors import PackerError

ds = packer.open_dataset(sys.argv[1])
print("default", packer.make_loader(ds, 64).num_workers)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loader = packer.make_loader(ds, 64, num_workers=2, timeout=60)
    try:
        for _ in loader:  # the pool starts here
            pass
        print("read")
    except PackerError as exc:
        print("error", exc)
print("warned", len(caught), caught[0].message if caught else "")
"""


def test_a_forked_child_that_collects_its_copy_of_the_pool_leaves_the_workers_alone(pack):
    """A child forked while a pool lives (another library's worker, a subprocess) inherits the pool; collecting
    it there must not stop the parent's workers through the inherited pipes, nor raise in the child."""
    ds = packer.open_dataset(pack("lmdb", "raw"))
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False, num_workers=2, timeout=LIVENESS)
    expected = copied(loader)
    pid = os.fork()
    if pid == 0:  # the child: run the inherited pool's finalizer, as its garbage collection would
        try:
            loader.worker_pool._finalizer()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert all(p.is_alive() for p in loader.worker_pool.processes)
    assert_same_batches(copied(loader), expected)


def test_a_small_dev_shm_keeps_threads_by_default_and_is_one_line_when_asked_for(pack):
    """A container's /dev/shm is 64 MB unless told otherwise: the default loader then keeps to threads, and
    num_workers=2 warns and stops with a one-line error instead of a bus error. A 4 MiB tmpfs over /dev/shm, in
    a mount namespace of its own (skipped where that is not allowed)."""
    dest = pack("lmdb", "jpeg_fixed")  # 112 x 112: 2.3 MiB a batch of 64
    script = f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c '{SMALL_SHM}' {dest}"
    try:
        result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                capture_output=True, text=True, timeout=LIVENESS)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if "mount" in result.stderr or "unshare" in result.stderr:
        pytest.skip(f"no private /dev/shm here: {result.stderr.strip()[:200]}")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[0] == "default 0", (result.stdout, result.stderr[-2000:])
    assert lines[1].startswith("error no room in /dev/shm for a batch of 2.3 MiB") and "--shm-size" in lines[1]
    assert lines[2].startswith("warned 1 packer: /dev/shm has 4 MiB free")


def test_ranks_on_one_node_share_its_cores(pack, monkeypatch):
    """Under torchrun every rank's affinity mask is usually the whole node: each takes its share."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loader = packer.make_loader(packer.open_dataset(pack("lmdb", "raw")), batch_size=BATCH)
    share = max(1, usable_cores() // 2)
    assert loader.num_workers == (share if share >= 2 else 0)
    assert loader.threads == (1 if share >= 2 else share)

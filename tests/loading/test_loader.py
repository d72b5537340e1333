"""``make_loader``, real DataLoader worker processes under every start method, worker memory, ``to_device``."""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from support.packed import FORMATS, MEAN, STD, digest
from torch.utils.data import TensorDataset

import packer
from packer.loading.sampler import ResumableSampler
from packer.system import usable_cores

BATCH = 16
LIVENESS = 120  # DataLoader timeout: a hung worker fails the test instead of hanging the session


@pytest.fixture(scope="module")
def pack(pack_once, sample_data):
    return lambda fmt, store: pack_once(sample_data, fmt, store)


def open_reader(pack, sample_data, fmt: str, **kwargs):
    """The 56x56 raw pack of sample_data in ``fmt``, or for "folder" sample_data itself cropped to 56x56."""
    if fmt == "folder":
        return packer.FolderDataset(sample_data, resize=64, center_crop=56, **kwargs)
    return packer.open_dataset(pack(fmt, "raw"), **kwargs)


def sample_table(ds) -> tuple[dict[str, int], list[int]]:
    """{digest of ds[i]: i} (the images are all different) and the labels, read in this process."""
    items = [ds[i] for i in range(len(ds))]
    table = {digest(image): i for i, (image, _) in enumerate(items)}
    assert len(table) == len(ds), "sample images must be distinct to recognise them in a batch"
    return table, [label for _, label in items]


def epoch_indices(loader, table, labels, shape=(3, 56, 56)) -> list[int]:
    """Iterate one epoch; check every batch is NCHW uint8 with the right labels; return the sample indices."""
    order = []
    for images, batch_labels in loader:
        assert images.dtype == torch.uint8 and images.dim() == 4 and tuple(images.shape[1:]) == shape
        assert batch_labels.dtype == torch.int64 and len(batch_labels) == len(images) <= BATCH
        for image, label in zip(images, batch_labels, strict=True):
            i = table[digest(image)]
            assert int(label) == labels[i]
            order.append(i)
    return order


# -- batches ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [None, 0, 2])
@pytest.mark.parametrize("fmt", [*FORMATS, "folder"])
def test_make_loader_batches_equal_items_stacked(pack, sample_data, fmt, workers):
    ds = open_reader(pack, sample_data, fmt)
    kwargs = {} if workers is None else {"num_workers": workers}
    if workers:
        kwargs["timeout"] = LIVENESS
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False, **kwargs)
    start = 0
    for images, labels in loader:
        n = len(images)
        assert images.dtype == torch.uint8 and tuple(images.shape) == (n, 3, 56, 56)  # NCHW uint8
        expected = [ds[i] for i in range(start, start + n)]
        assert torch.equal(images, torch.stack([image for image, _ in expected]))
        assert labels.tolist() == [label for _, label in expected]
        start += n
    assert start == len(ds)


@pytest.mark.parametrize("fmt", FORMATS)
def test_make_loader_with_read_time_crop_of_originals(pack, fmt):
    """Encoded images made fixed-shape at read time batch as NCHW uint8 equal to the items."""
    ds = packer.open_dataset(pack(fmt, "original"), resize=80, center_crop=64)
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False)
    images, labels = next(iter(loader))
    assert tuple(images.shape) == (BATCH, 3, 64, 64) and images.dtype == torch.uint8
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(BATCH)]))
    assert labels.tolist() == [ds[i][1] for i in range(BATCH)]


def test_make_loader_shuffles_every_sample_once(pack, sample_data):
    ds = open_reader(pack, sample_data, "lmdb")
    table, labels = sample_table(ds)
    loader = packer.make_loader(ds, batch_size=BATCH)
    first, second = epoch_indices(loader, table, labels), epoch_indices(loader, table, labels)
    assert sorted(first) == sorted(second) == list(range(len(ds)))
    assert first != list(range(len(ds))) and first != second


# -- worker processes ---------------------------------------------------------------------------------------------

def worker_cases():
    cases = []
    for fmt in (*FORMATS, "folder"):
        for persistent in (True, False):
            for used_first in (True, False):
                cases.append(pytest.param(fmt, "fork", persistent, used_first,
                                          id=f"{fmt}-fork-{'persistent' if persistent else 'transient'}-"
                                             f"{'used' if used_first else 'fresh'}"))
        # spawn and forkserver workers import torch afresh (seconds each): the dataset always used first,
        # persistent workers under spawn, workers started anew each epoch under forkserver
        cases.append(pytest.param(fmt, "spawn", True, True, id=f"{fmt}-spawn-persistent-used",
                                  marks=pytest.mark.slow))
        if fmt != "folder":
            cases.append(pytest.param(fmt, "forkserver", False, True, id=f"{fmt}-forkserver-transient-used",
                                      marks=pytest.mark.slow))
    return cases


@pytest.mark.parametrize("fmt, ctx, persistent, used_first", worker_cases())
def test_workers_yield_every_sample_once_per_epoch(pack, sample_data, fmt, ctx, persistent, used_first):
    ds = open_reader(pack, sample_data, fmt)
    if used_first:
        table, labels = sample_table(ds)  # reads every sample here first: handles open in this process
    else:
        table, labels = sample_table(open_reader(pack, sample_data, fmt))
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=2, multiprocessing_context=ctx,
                                persistent_workers=persistent, timeout=LIVENESS)
    assert loader.num_workers == 2
    orders = [epoch_indices(loader, table, labels) for _ in range(2)]
    for order in orders:
        assert sorted(order) == list(range(len(ds))), "every sample exactly once per epoch"
    assert orders[0] != orders[1]
    # the main process still reads after the workers came and went
    for i in (0, len(ds) // 2, len(ds) - 1):
        image, label = ds[i]
        assert table[digest(image)] == i and label == labels[i]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dataset_survives_fork_while_open(pack, sample_data, fmt):
    """A dataset open in the parent keeps working in the parent and in a forked child, both reading."""
    ds = open_reader(pack, sample_data, fmt)
    table, labels = sample_table(ds)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: read everything, report through the pipe, never return into pytest
        code = 1
        try:
            ok = all(table[digest(ds[i][0])] == i and ds[i][1] == labels[i] for i in range(len(ds)))
            code = 0 if ok else 3
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    parent_ok = all(table[digest(ds[i][0])] == i for i in range(len(ds)))
    code = wait_child(pid)
    child = os.read(r, 1)
    os.close(r)
    assert parent_ok
    assert code == 0 and child == b"\x00"


def wait_child(pid: int, limit: float = 120) -> int | str:
    """The exit code of a forked child, or "hung" (then killed) if it has not ended within ``limit`` seconds:
    a bound that keeps a deadlocked child from hanging the session, not a timing."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


FORK_WHILE_PREFETCHING = """
import os, signal, sys, threading, time
import packer


def exit_code(pid, limit=60):
    deadline = time.monotonic() + limit  # a bound for a hung child, not a timing
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


for path in sys.argv[1:]:
    ds = packer.open_dataset(path, resize=80, center_crop=64)
    stored = packer.open_dataset(path, decode=False)
    stop = threading.Event()

    def read_stored():  # another thread of this process inside the format's reads
        while not stop.is_set():
            for i in range(len(stored)):
                stored[i]

    reader = threading.Thread(target=read_stored, daemon=True)
    reader.start()
    train = packer.make_loader(ds, batch_size=8, shuffle=True, num_workers=0)  # decodes on threads in this process
    it = iter(train)
    seen = len(next(it)[1])  # the prefetch thread now decodes the next batches
    for _ in range(10):  # anything that forks meanwhile: multiprocessing, subprocess with preexec_fn...
        pid = os.fork()
        if pid == 0:
            os._exit(0 if len(ds[3][0]) == 3 and len(stored[5][0]) > 0 else 1)
        code = exit_code(pid)
        assert code == 0, (path, "forked child", code)
    val = packer.make_loader(ds, batch_size=8, shuffle=False, num_workers=2, timeout=60)  # workers mid-prefetch
    assert sum(len(labels) for _, labels in val) == len(ds)
    seen += sum(len(labels) for _, labels in it)
    assert seen == len(ds), (path, seen)
    stop.set()
    reader.join()
print("ok")
"""


@pytest.mark.slow
def test_fork_while_the_threaded_loader_prefetches(pack):
    """Forking (worker processes, pools) while make_loader's threads read a dataset must not crash the parent
    or the child. In a subprocess: a crash there is a failed test, not a dead test session."""
    paths = [str(pack(fmt, "jpeg_fixed")) for fmt in FORMATS]
    result = subprocess.run([sys.executable, "-c", FORK_WHILE_PREFETCHING, *paths], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-3000:])


def test_abandoned_prefetch_thread_ends(pack):
    """Stopping early (``next(iter(loader))``, ``break``) must not leave the prefetch thread running with the
    batches it holds."""
    def first_batch_only() -> list[threading.Thread]:
        ds = packer.open_dataset(pack("lmdb", "original"), center_crop=64)
        loader = packer.make_loader(ds, batch_size=4, shuffle=False, num_workers=0)
        before = set(threading.enumerate())
        first = next(iter(loader))
        assert torch.equal(first[0], torch.stack([ds[i][0] for i in range(4)]))
        return [t for t in threading.enumerate() if t not in before]

    started = first_batch_only()  # the loader, its dataset and the iterator are all dropped on return
    assert started, "make_loader(num_workers=0) decodes in background threads"
    gc.collect()
    for thread in started:
        thread.join(timeout=30)  # a liveness bound, not a timing
        assert not thread.is_alive(), f"{thread.name} still running after its iterator was dropped"


def first_read(ds, barrier: threading.Barrier, labels: list, errors: list) -> None:
    barrier.wait()
    try:
        labels.append(ds[3][1])
    except Exception as exc:  # collected and reported by the test
        errors.append(exc)


def test_threads_open_one_lmdb_dataset_at_once(tmp_path, make_image):
    """The first reads of one LMDB dataset from several threads at once (make_loader's prefetch thread and the
    main thread, say) all succeed: the environment is opened once, not once per thread."""
    src = tmp_path / "src"
    for i in range(6):
        make_image(src / f"c{i % 2}" / f"{i}.png", 16, 12, seed=i)
    for attempt in range(3):
        dest = tmp_path / f"ds{attempt}"  # a path this process has never opened
        packer.pack(src, dest, "lmdb", store="raw", progress=False, workers=1)
        datasets = [packer.open_dataset(dest) for _ in range(8)]
        barrier = threading.Barrier(len(datasets))
        errors, labels = [], []

        threads = [threading.Thread(target=first_read, args=(ds, barrier, labels, errors)) for ds in datasets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert labels == [datasets[0][3][1]] * len(datasets)


# -- memory ---------------------------------------------------------------------------------------------------------

PERSISTENT_WORKERS = """
import json, sys
import psutil
import packer
ds = packer.open_dataset(sys.argv[1], center_crop=224)
ds[0]
before = {p.pid for p in psutil.Process().children()}
loader = packer.make_loader(ds, batch_size=int(sys.argv[2]), num_workers=2, persistent_workers=True,
                            timeout=int(sys.argv[3]))
seen, uss = [], []
for _ in range(4):
    seen.append(sum(len(labels) for images, labels in loader if int(images.sum()) >= 0))
    kids = [p for p in psutil.Process().children() if p.pid not in before]
    uss.append({p.pid: p.memory_full_info().uss for p in kids})
print(json.dumps({"len": len(ds), "seen": seen, "uss": uss}))
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_persistent_workers_do_not_grow(pack, fmt):
    """The workers' USS after epoch 4 is within 10% of their USS after epoch 2 (decoding full-size JPEGs: a
    per-worker cache of decoded images, or metadata copied on write as shuffled workers touch it, shows here).
    Epoch 1 is left out: in it each worker's malloc heap grows to its working size, from wherever the parent's
    heap was at the fork (an LMDB worker's heap went from about 9 to 11-12 MiB in epoch 1, then moved between 10.4
    and 11.9 MiB over nine more epochs without growing).
    The two workers' USS is summed: which worker made the last batch moves about one batch of freed memory
    between them, too much noise for a per-worker 10% bound on a ~14 MiB worker. The loop reads every image, as
    training does: packer's workers decode into shared slots, and a slot page only its worker has touched counts
    in that worker's USS. It runs in a process of its own, as a training script does: under the test session, a
    page the session writes after the fork becomes the worker's own copy and counted in its USS, growth that is
    the session's, not the worker's."""
    result = subprocess.run([sys.executable, "-c", PERSISTENT_WORKERS, str(pack(fmt, "original")), str(BATCH),
                             str(LIVENESS)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    seen, uss = out["seen"], [{int(pid): v for pid, v in epoch.items()} for epoch in out["uss"]]
    assert seen == [out["len"]] * 4
    assert len(uss[0]) == 2 and set(uss[3]) == set(uss[0]), "the same two persistent workers throughout"
    first, last = sum(uss[1].values()), sum(uss[3].values())
    assert last <= 1.10 * first, f"workers' USS {first / 2**20:.1f} -> {last / 2**20:.1f} MiB"


# -- to_device ---------------------------------------------------------------------------------------------------

def test_to_device_cpu_normalizes(pack):
    ds = packer.open_dataset(pack("hdf5", "raw"))
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False)
    plain = list(loader)
    device = packer.to_device(loader, "cpu", normalize=(MEAN, STD))
    assert len(device) == len(loader)
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    n = 0
    for (images, labels), (u8, u8_labels) in zip(device, plain, strict=True):
        assert images.dtype == torch.float32 and images.shape == u8.shape and images.device.type == "cpu"
        expected = ((u8.double() / 255 - mean) / std).float()
        torch.testing.assert_close(images, expected)
        assert torch.equal(labels, u8_labels)
        n += len(images)
    assert n == len(ds)
    assert torch.equal(plain[0][0], next(iter(loader))[0]), "normalizing did not touch the loader's batches"
    doubles = next(iter(packer.to_device(loader, "cpu", normalize=(MEAN, STD), dtype=torch.float64)))[0]
    assert doubles.dtype == torch.float64
    torch.testing.assert_close(doubles, (plain[0][0].double() / 255 - mean) / std)


def test_to_device_cpu_without_normalize_is_unchanged(pack):
    ds = packer.open_dataset(pack("lmdb", "raw"))
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False)
    plain = list(loader)
    moved = list(packer.to_device(loader, "cpu"))
    assert len(moved) == len(plain)
    for (images, labels), (u8, u8_labels) in zip(moved, plain, strict=True):
        assert images.dtype == torch.uint8 and torch.equal(images, u8) and torch.equal(labels, u8_labels)


# -- defaults -----------------------------------------------------------------------------------------------------

def test_usable_cores_respects_affinity():
    allowed = os.sched_getaffinity(0)
    assert 1 <= usable_cores() <= len(allowed)
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to restrict")
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert usable_cores() == 1
        assert packer.make_loader(TensorDataset(torch.arange(10))).num_workers == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert usable_cores() == packer.make_loader(TensorDataset(torch.arange(10))).num_workers


def test_make_loader_defaults_for_any_dataset():
    data = TensorDataset(torch.arange(100))
    loader = packer.make_loader(data)
    assert loader.num_workers == usable_cores()
    assert loader.batch_size == 64
    assert loader.pin_memory == torch.cuda.is_available()
    assert loader.persistent_workers == (loader.num_workers > 0)
    if loader.num_workers:
        assert loader.prefetch_factor == 4
    assert isinstance(loader.sampler, ResumableSampler) and loader.sampler.shuffle
    in_order = packer.make_loader(data, shuffle=False, batch_size=10, num_workers=0)
    assert [batch.tolist() for (batch,) in in_order] == [list(range(i, i + 10)) for i in range(0, 100, 10)]
    values = sorted(int(v) for (batch,) in packer.make_loader(data, batch_size=32, num_workers=0) for v in batch)
    assert values == list(range(100))


def test_make_loader_defaults_for_packer_datasets(pack):
    """Packer's datasets decode in parallel on as many decoders as there are usable cores: worker processes, or
    (the documented default) threads of the main process."""
    ds = packer.open_dataset(pack("wds", "raw"))
    loader = packer.make_loader(ds)
    decoders = loader.num_workers if loader.num_workers else loader.threads
    assert decoders == usable_cores()
    assert loader.batch_size == 64
    assert loader.persistent_workers == (loader.num_workers > 0)
    assert (loader.pin_memory or loader.pin_batches) == torch.cuda.is_available()


def test_one_dataset_backs_loaders_with_different_threads(pack):
    """Threads and pinning are the loader's: make_loader leaves the dataset as it was, and two loaders over one
    dataset decode on their own thread counts and give the same batches."""
    ds = packer.open_dataset(pack("lmdb", "jpeg"), resize=32, center_crop=32)
    before = dict(ds.__dict__)
    one = packer.make_loader(ds, batch_size=BATCH, shuffle=False, threads=1, prefetch_batches=2)
    three = packer.make_loader(ds, batch_size=BATCH, shuffle=False, threads=3)
    assert (one.threads, one.prefetch_batches, three.threads, three.prefetch_batches) == (1, 2, 3, 4)
    assert ds.__dict__ == before
    for (images_a, labels_a), (images_b, labels_b) in zip(one, three, strict=True):
        assert torch.equal(images_a, images_b) and torch.equal(labels_a, labels_b)
    assert ds.threads == 1


def test_tuned_false_ignores_loader_json_silently(tmp_path, sample_data, capsys):
    dest = tmp_path / "ds"
    packer.pack(sample_data, dest, "hdf5", store="raw", resize=24, center_crop=24, progress=False)
    (dest / "loader.json").write_text(json.dumps({"loader": {"batch_size": 5, "prefetch_factor": 2}}))
    ds = packer.open_dataset(dest)
    tuned = packer.make_loader(ds)
    # batches ahead: per worker process (the default on 2+ cores), or the in-process loader's
    ahead = lambda loader: loader.prefetch_factor if loader.num_workers else loader.prefetch_batches  # noqa: E731
    assert (tuned.batch_size, ahead(tuned)) == (64, 2), "batch_size is never tuned: loader.json's is ignored"
    assert "loader.json" in capsys.readouterr().err
    plain = packer.make_loader(ds, tuned=False)
    assert (plain.batch_size, ahead(plain)) == (64, 4)
    assert capsys.readouterr().err == ""


def test_make_loader_overrides_win(pack):
    ds = packer.open_dataset(pack("wds", "raw"))
    loader = packer.make_loader(ds, batch_size=5, shuffle=False, num_workers=1, persistent_workers=False,
                                pin_memory=False, prefetch_factor=2)
    assert (loader.batch_size, loader.num_workers, loader.persistent_workers, loader.pin_memory,
            loader.prefetch_factor) == (5, 1, False, False, 2)
    assert not loader.sampler.shuffle
    assert [labels.tolist() for _, labels in loader][:2] == [[ds[i][1] for i in range(5)],
                                                             [ds[i][1] for i in range(5, 10)]]
    none = packer.make_loader(TensorDataset(torch.arange(10)), num_workers=0)
    assert none.num_workers == 0 and none.persistent_workers is False


def test_make_loader_uses_tuned_settings_and_overrides_win(tmp_path, sample_data, make_image):
    src = tmp_path / "src"
    for i in range(12):
        make_image(src / f"c{i % 2}" / f"{i}.png", 20, 16, seed=i)
    dest = tmp_path / "ds"
    packer.pack(src, dest, "lmdb", store="raw", progress=False, workers=1)
    (dest / "loader.json").write_text(json.dumps({"loader": {"num_workers": 1, "batch_size": 5,
                                                             "prefetch_factor": 3}}))
    ds = packer.open_dataset(dest)
    tuned = packer.make_loader(ds)
    # batch_size is never tuned (a training hyperparameter): loader.json's is ignored, the caller's default used
    assert (tuned.batch_size, tuned.num_workers, tuned.prefetch_factor) == (64, 1, 3)
    assert sorted(len(labels) for _, labels in tuned) == [12]
    assert sorted(len(labels) for _, labels in packer.make_loader(ds, batch_size=5)) == [2, 5, 5]
    mine = packer.make_loader(ds, batch_size=4, num_workers=0)
    assert (mine.batch_size, mine.num_workers) == (4, 0)


def test_loader_labels_match_imagefolder(pack, sample_data, reference_scan):
    """Labels through a loader are ImageFolder's (sorted class folders), for every format."""
    _, class_to_idx, _ = reference_scan(sample_data)
    for fmt in FORMATS:
        ds = packer.open_dataset(pack(fmt, "raw"))
        loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False)
        labels = np.concatenate([batch_labels.numpy() for _, batch_labels in loader])
        expected = [class_to_idx[ds.relpath(i).split("/")[0]] for i in range(len(ds))]
        assert labels.tolist() == expected
        assert collections.Counter(expected) == collections.Counter({i: 30 for i in range(5)})


@pytest.mark.parametrize("workers", [0, 2])
def test_images_of_different_sizes_name_the_fix(pack, workers):
    ds = packer.open_dataset(pack("lmdb", "raw_var"))
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False, num_workers=workers)
    with pytest.raises(packer.PackerError, match=r"images in one batch differ in size \(.*\); pass resize= and "
                                                 r"center_crop= \(or random_resized_crop=\) to open_dataset"):
        next(iter(loader))


@pytest.mark.parametrize("fmt", ["hdf5", "wds"])
def test_images_of_different_sizes_are_refused_before_the_first_batch(pack, fmt):
    """Where the format indexes each image's size, make_loader says at once what to pass (LMDB keeps no such
    index: its first batch says it, above)."""
    ds = packer.open_dataset(pack(fmt, "raw_var"))
    with pytest.raises(packer.PackerError, match=r"images of \d+ sizes \(.*\) cannot be batched; pass resize= and "
                                                 r"center_crop= \(or random_resized_crop=\) to open_dataset, a "
                                                 r"collate_fn of your own to make_loader, or batch_size=1") as exc:
        packer.make_loader(ds, batch_size=BATCH, shuffle=False, num_workers=0)
    assert "\n" not in str(exc.value)
    assert len(list(packer.make_loader(ds, batch_size=1, shuffle=False, num_workers=0))) == len(ds)
    listed = packer.make_loader(ds, batch_size=BATCH, shuffle=False, num_workers=0, collate_fn=lambda b: b)
    assert sum(len(batch) for batch in listed) == len(ds)
    cropped = packer.open_dataset(pack(fmt, "raw_var"), resize=32, center_crop=32)
    images, _ = next(iter(packer.make_loader(cropped, batch_size=BATCH, shuffle=False, num_workers=0)))
    assert tuple(images.shape[1:]) == (3, 32, 32)


BREAK_AND_EXIT = """
import sys, packer
loader = packer.make_loader(packer.open_dataset(sys.argv[1], random_resized_crop=48, flip=True), batch_size=4)
for n, _ in enumerate(loader):
    if n == 1:
        break
"""


@pytest.mark.slow
def test_breaking_out_of_an_epoch_then_exiting_does_not_abort(pack):
    """A loop that breaks out mid-epoch and then ends the program: the prefetch thread was still decoding inside
    torch while the interpreter finalized, and about 1 run in 10 died with SIGABRT ("terminate called without an
    active exception"). Each run is a real process exit; 12 runs catch that rate most of the time."""
    dest = pack("lmdb", "jpeg")
    for _ in range(12):
        result = subprocess.run([sys.executable, "-c", BREAK_AND_EXIT, str(dest)], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]


def test_batches_a_caller_keeps_are_never_overwritten_and_released_ones_are_reused(pack):
    """The in-process loader reuses a batch's memory only once nothing refers to it: batches kept across a
    whole epoch (and one image kept from a dropped batch) keep their pixels; a batch dropped entirely gives its
    memory to a later one."""
    ds = packer.open_dataset(pack("lmdb", "jpeg_fixed"))
    loader = packer.make_loader(ds, BATCH, shuffle=False, tuned=False)
    expected = [ds.read_batch(list(range(a, min(len(ds), a + BATCH)))).images.clone()
                for a in range(0, len(ds), BATCH)]
    kept = [images for images, _ in loader]
    one_image = kept[1][3]
    del kept[1]
    for _ in range(2):
        for _batch in loader:  # later epochs, their batches dropped as they come
            pass
    assert len({images.data_ptr() for images in kept}) == len(kept)
    for k, images in enumerate(kept):
        assert torch.equal(images, expected[k if k < 1 else k + 1])
    assert torch.equal(one_image, expected[1][3])

    first = ds.read_batch(list(range(BATCH)))
    address = first.images.data_ptr()
    del first
    assert ds.read_batch(list(range(BATCH, 2 * BATCH))).images.data_ptr() == address

"""A URL larger than its ``cache_limit``, read a block at a time: blocks are ranges of the data files fetched by
one ranged GET each into the node's cache, read for two epochs through real DataLoader worker processes with
``shuffle="blocks"``, against the Range-capable file server (and moto's S3) the suite starts on 127.0.0.1.

Each epoch gives every sample exactly once with its label (compared by pixels with the local dataset), the cache
stays within its bound while the epoch runs, the server sends each byte about once an epoch, a state saved
mid-epoch resumes at another world size with exactly the remaining samples, and two processes reading the same
URL share the cache. Formats whose readers have no byte-range hooks yet are skipped.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from conftest import noise_folder
from support.packed import FORMATS, free_port, manifest_bytes, pixel_digest, pixel_table, seen_indices
from support.remote import CachePoll, S3Server, fault_proxy, serve_files, serving

import packer
from packer.errors import CorruptDataError, RemoteError
from packer.formats import Reader, get_format
from packer.formats.blocked import block_budget
from packer.formats.layout import LocalSource
from packer.loading.fetchahead import FETCHERS, WorkerMaps, block_plan
from packer.loading.sampler import ResumableSampler
from packer.remote.cache import Cache
from packer.remote.fetch import STATS
from packer.remote.ranges import RemoteBlocks, RemoteSource, range_name
from packer.remote.url import parse_url

COUNT, SIDE = 480, 16  # 16x16 raw noise images: 768 bytes of pixels each
BATCH, WORKERS = 16, 2
PACK = {"lmdb": {}, "hdf5": {}, "wds": {"shard_samples": 120}}
WORKER = Path(__file__).resolve().parents[1] / "workers" / "blocked_worker.py"


def ranged(fmt: str) -> bool:
    """Whether the format reads by byte ranges (its reader overrides Reader.layout)."""
    return get_format(fmt)[1].layout.__func__ is not Reader.layout.__func__


BLOCKED = [pytest.param(f, marks=pytest.mark.skipif(not ranged(f), reason=f"{f} has no byte-range hooks yet"))
           for f in FORMATS]


pytestmark = pytest.mark.usefixtures("quick_retries")


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    """``COUNT`` distinct images in 3 classes, packed raw in every format, in one folder the server serves; and
    ``parted``: two copies of the LMDB pack under one manifest, as a 2-rank conversion leaves them."""
    root = tmp_path_factory.mktemp("blocked")
    noise_folder(root / "src", COUNT, SIDE, "png")
    for fmt in FORMATS:
        packer.pack(root / "src", root / "packs" / fmt, fmt, store="raw", progress=False, workers=1, **PACK[fmt])
    parted, manifest = root / "packs" / "parted", packer.read_manifest(root / "packs" / "lmdb")
    for r in range(2):
        shutil.copytree(root / "packs" / "lmdb", parted / f"part-{r:05d}", ignore=shutil.ignore_patterns("*.json"))
    files = [{**e, "path": f"part-{r:05d}/{e['path']}"} for r in range(2) for e in manifest["files"]]
    parts = [{"path": f"part-{r:05d}", "count": COUNT, "range": [r * COUNT, (r + 1) * COUNT]} for r in range(2)]
    (parted / "manifest.json").write_text(json.dumps({**manifest, "count": 2 * COUNT, "files": files,
                                                      "parts": parts}))
    return root / "packs"


@pytest.fixture(scope="module")
def server(packs):
    yield from serving(packs)


@pytest.fixture(scope="module")
def truth(packs) -> dict[str, dict[str, tuple[int, int]]]:
    """Per format: each local sample's (index, label), by its pixels."""
    return {fmt: pixel_table(packer.open_dataset(packs / fmt), COUNT) for fmt in FORMATS}


def data_bytes(packs: Path, fmt: str) -> int:
    return manifest_bytes(packs / fmt)


def open_blocked(url: str, cache: Path, limit: int, **kwargs) -> packer.PackedDataset:
    ds = packer.open_dataset(url, cache_dir=cache, cache_limit=limit, **kwargs)
    assert type(ds.reader).__name__ == "BlockedReader"
    return ds


# --------------------------------------------------------------------------------------------------------------
# Blocks in the cache, without a format
# --------------------------------------------------------------------------------------------------------------
def test_a_block_is_one_ranged_get_kept_in_the_cache_as_its_own_object(packs, server, tmp_path):
    manifest = packer.read_manifest(packs / "lmdb")
    entry = max(manifest["files"], key=lambda e: e["bytes"])
    path, data = entry["path"], (packs / "lmdb" / entry["path"]).read_bytes()
    remote = parse_url(f"{server.url}/lmdb")
    store = RemoteBlocks(remote, manifest, None, tmp_path / "cache", None)
    before = server.gets(f"/lmdb/{path}")
    block = store.open(path, 100, 5000)
    assert bytes(block) == data[100:5000] and server.gets(f"/lmdb/{path}") == before + 1
    again = store.open(path, 100, 5000)  # cached: no request
    assert bytes(again) == data[100:5000] and server.gets(f"/lmdb/{path}") == before + 1
    assert Cache(tmp_path / "cache").object_path(range_name(entry["sha256"], 100, 5000, len(data))).stat().st_size \
        == 4900
    whole = store.open(path, 0, len(data))  # the whole file: the file's own object, sha256 checked
    assert bytes(whole) == data and Cache(tmp_path / "cache").object_path(entry["sha256"]).exists()
    source, local = RemoteSource(remote, manifest), LocalSource(packs / "lmdb")
    ranges = [(path, 0, 64), (path, 10, 20), (path, len(data) - 8, len(data) + 100)]
    assert source.read_many(ranges) == local.read_many(ranges) and source.size(path) == local.size(path)


def test_blocks_are_evicted_lru_within_the_limit_and_never_while_pinned(packs, server, tmp_path):
    manifest = packer.read_manifest(packs / "lmdb")
    entry = max(manifest["files"], key=lambda e: e["bytes"])
    store = RemoteBlocks(parse_url(f"{server.url}/lmdb"), manifest, None, tmp_path / "cache", 10_000)
    held = [store.hold(entry["path"], k * 4000, (k + 1) * 4000) for k in range(2)]
    assert store.hold(entry["path"], 8000, 12000, wait=False) is None  # 12,000 bytes: no room, both pinned
    held[0]()
    third = store.hold(entry["path"], 8000, 12000, wait=False)  # the first one goes
    cache = Cache(tmp_path / "cache")
    assert third is not None and cache.used() <= 10_000
    assert not cache.object_path(range_name(entry["sha256"], 0, 4000, entry["bytes"])).exists()
    assert cache.object_path(range_name(entry["sha256"], 4000, 8000, entry["bytes"])).exists()


def test_a_child_forked_while_a_block_is_held_does_not_keep_it(packs, server, tmp_path):
    """A DataLoader worker forked while the loader's thread holds blocks (or a cache lock) must not keep them:
    a persistent worker would keep them from being evicted (or every process waiting for the lock)."""
    manifest = packer.read_manifest(packs / "lmdb")
    entry = max(manifest["files"], key=lambda e: e["bytes"])
    store = RemoteBlocks(parse_url(f"{server.url}/lmdb"), manifest, None, tmp_path / "cache", 10_000)
    release = store.hold(entry["path"], 0, 4000)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    try:
        release()
        for k in (1, 2):  # 12,000 bytes in all: the first block must go, though the child was forked holding it
            done = store.hold(entry["path"], k * 4000, (k + 1) * 4000, wait=False)
            assert done is not None
            done()
        assert not Cache(tmp_path / "cache").object_path(range_name(entry["sha256"], 0, 4000, entry["bytes"])).exists()
    finally:
        child.terminate()
        child.join()


def test_a_short_range_is_refused_in_one_line(packs, tmp_path):
    root = tmp_path / "served"
    (root / "lmdb").mkdir(parents=True)
    manifest = packer.read_manifest(packs / "lmdb")
    entry = max(manifest["files"], key=lambda e: e["bytes"])
    (root / "lmdb" / entry["path"]).write_bytes((packs / "lmdb" / entry["path"]).read_bytes()[:3000])  # truncated
    served = serve_files(root)
    try:
        store = RemoteBlocks(parse_url(f"{served.url}/lmdb"), manifest, None, tmp_path / "cache", None)
        with pytest.raises(RemoteError) as error:
            store.open(entry["path"], 2000, 6000)
        assert "fetched twice" in str(error.value) and "\n" not in str(error.value)
        assert f"{served.url}/lmdb/{entry['path']}" in str(error.value)
        assert Cache(tmp_path / "cache").used() == 0
    finally:
        served.stop()


def test_a_dataset_that_fits_keeps_whole_files_and_one_in_parts_is_read_a_block_at_a_time(packs, server, tmp_path):
    total = data_bytes(packs, "lmdb")
    ds = packer.open_dataset(f"{server.url}/lmdb", cache_dir=tmp_path / "cache", cache_limit=2 * total)
    assert type(ds.reader).__name__ != "BlockedReader" and len(ds) == COUNT
    # 2 * total bytes, in a cache of its own (the dataset above keeps its files pinned in its cache)
    parted = open_blocked(f"{server.url}/parted", tmp_path / "other", total, decode=False)
    local = packer.open_dataset(packs / "parted", decode=False)  # the local parts reader
    assert len(parted) == len(local) == 2 * COUNT
    assert parted.reader.ranges.files == ("part-00000/data.mdb", "part-00001/data.mdb")
    for i in range(0, 2 * COUNT, 7):
        assert bytes(parted[i][0]) == bytes(local[i][0]) and parted[i][1] == local[i][1], i


@pytest.mark.parametrize("fmt", BLOCKED)
def test_damaged_bytes_are_one_line_naming_the_url_and_file(fmt, packs, tmp_path):
    shutil.copytree(packs / fmt, tmp_path / "served" / fmt)
    served = serve_files(tmp_path / "served")
    try:
        url = f"{served.url}/{fmt}"
        ds = open_blocked(url, tmp_path / "cache", data_bytes(packs, fmt) // 8)
        layout, index = ds.reader.ranges, 77
        path = tmp_path / "served" / fmt / layout.files[int(layout.file[index])]
        data = bytearray(path.read_bytes())
        for at in (int(layout.start[index]) + 1, (int(layout.start[index]) + int(layout.end[index])) // 2):
            data[at] ^= 0xFF  # in its range: the payload's first bytes, and wherever its middle lies
        path.write_bytes(bytes(data))  # the manifest's sha256 no longer holds: ranges are checked by crc32
        with pytest.raises(CorruptDataError) as error:
            ds[index]
        assert f"{url}/{layout.files[int(layout.file[index])]} sample {index}" in str(error.value)
        assert "\n" not in str(error.value)
    finally:
        served.stop()


# --------------------------------------------------------------------------------------------------------------
# Reading a dataset 8x larger than the cache
# --------------------------------------------------------------------------------------------------------------
def two_epochs_within_the_cache(loader, table: dict, server, cache: Path, limit: int, total: int) -> list[list[int]]:
    """Two epochs of ``loader`` (a URL read a block at a time): each gives every sample once with its label, the
    cache stays within its bound while it runs (sampled), and the server sends at most 1.1x the data an epoch;
    the two orders differ. The orders, as sample indices."""
    reader = loader.dataset.reader
    block = int((reader.spans[:, 2] - reader.spans[:, 1]).max())
    orders = []
    for _ in range(2):
        sent = server.sent
        with CachePoll(cache) as poll:
            orders.append(seen_indices(loader, table))
        assert sorted(orders[-1]) == list(range(COUNT))
        assert poll.most <= limit + WORKERS * block, (poll.most, limit, block)
        assert server.sent - sent <= 1.1 * total, (server.sent - sent, total)
    assert orders[0] != orders[1]
    return orders


@pytest.mark.parametrize("fmt", BLOCKED)
def test_two_epochs_through_workers_every_sample_once_within_the_cache(fmt, packs, server, truth, tmp_path, capfd):
    total = data_bytes(packs, fmt)
    limit = total // 8
    cache = tmp_path / "cache"
    ds = open_blocked(f"{server.url}/{fmt}", cache, limit)
    said = capfd.readouterr().err
    assert "a block at a time" in said and len(said.strip().splitlines()) == 1
    # batches of 8: the fetch-ahead's share of the cache holds those in flight (with BATCH it says it does not)
    loader = packer.make_loader(ds, batch_size=BATCH // 2, num_workers=WORKERS, shuffle=True, seed=3)
    said = capfd.readouterr().err
    assert "shuffle='blocks'" in said and loader.sampler.shuffle == "blocks" and "wait on fetches" not in said
    assert loader.plan.engine == "torch"  # raw images without one output size: torch's DataLoader workers
    two_epochs_within_the_cache(loader, truth[fmt], server, cache, limit, total)
    in_order = packer.make_loader(ds, batch_size=BATCH, num_workers=0, shuffle=False)
    assert seen_indices(in_order, truth[fmt]) == [truth[fmt][pixel_digest(ds[i][0])][0] for i in range(COUNT)]
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets: no open block, its own on first read
    assert copy.reader._blocks is None and pixel_digest(copy[5][0]) == pixel_digest(ds[5][0])


@pytest.mark.parametrize("fmt", BLOCKED)
def test_two_epochs_through_packer_s_pool_every_sample_once_within_the_cache(fmt, packs, server, tmp_path, capfd):
    """The same through packer's worker pool, which decodes a dataset of one output size (a read-time crop, as
    training reads): its workers map a batch's blocks before decoding it and the fetch-ahead lets them go then."""
    total = data_bytes(packs, fmt)
    limit, cache = total // 8, tmp_path / "cache"
    crops = pixel_table(packer.open_dataset(packs / fmt, center_crop=8), COUNT)  # each local sample's crop
    ds = open_blocked(f"{server.url}/{fmt}", cache, limit, center_crop=8)
    capfd.readouterr()
    loader = packer.make_loader(ds, batch_size=BATCH // 2, num_workers=WORKERS, shuffle="blocks", seed=3)
    assert loader.plan.engine == "pool" and "wait on fetches" not in capfd.readouterr().err
    two_epochs_within_the_cache(loader, crops, server, cache, limit, total)


@pytest.mark.parametrize("fmt", BLOCKED)
def test_a_mid_epoch_state_resumes_at_another_world_size(fmt, packs, server, truth, tmp_path):
    url, cache, limit = f"{server.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt) // 8
    ds = open_blocked(url, cache, limit)
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle="blocks", seed=1)
    first = []
    iterator = iter(loader)
    for _ in range(7):
        first.append(next(iterator))
    state = loader.state_dict()
    del iterator
    taken = seen_indices(first, truth[fmt])
    rest = []
    for rank in range(2):  # the rest of the epoch over two ranks
        again = open_blocked(url, cache, limit)
        sampler = ResumableSampler(again, batch_size=BATCH, shuffle="blocks", seed=1, num_replicas=2, rank=rank,
                                   blocks=again.blocks())
        resumed = packer.make_loader(again, batch_size=BATCH, num_workers=WORKERS, sampler=sampler)
        resumed.load_state_dict(state)
        rest.append(seen_indices(resumed, truth[fmt]))
    assert len(rest[0]) == len(rest[1])
    remaining = rest[0] + rest[1]
    padded = len(remaining) - (COUNT - len(taken))  # DistributedSampler's padding: at most one sample a rank
    assert 0 <= padded <= 1
    assert sorted(set(taken) | set(remaining)) == list(range(COUNT)) and not set(taken) & set(remaining)


CHILD = """
import hashlib, json, pathlib, sys, time
import packer
ds = packer.open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))
loader = packer.make_loader(ds, batch_size=16, num_workers=1, shuffle=True)
batches = iter(loader)  # the worker started
pathlib.Path(sys.argv[4]).touch()
while len(list(pathlib.Path(sys.argv[4]).parent.glob("ready-*"))) < 2:  # both start reading at once
    time.sleep(0.01)
digests = [hashlib.sha1(im.contiguous().numpy().tobytes()).hexdigest() for ims, _ in batches for im in ims]
print(json.dumps(sorted(digests)))
"""


@pytest.mark.parametrize("fmt", BLOCKED)
def test_two_processes_reading_one_url_share_the_cache(fmt, packs, server, truth, tmp_path):
    url, cache, total = f"{server.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt)
    reader = open_blocked(url, cache, total // 4).reader  # the layout, computed once for both
    ahead = reader.fetch_ahead * int(reader.block_bytes().max())  # of a next epoch, which neither child reads
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    sent = server.sent
    args = [url, str(cache), str(total // 4)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, *args, str(tmp_path / f"ready-{k}")], text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    for out, _ in outs:
        assert json.loads(out) == sorted(truth[fmt])
    # each block about once, not twice; beyond that, each child's fetch-ahead may have started on its next epoch
    assert server.sent - sent <= 1.25 * total + 2 * ahead < 2 * total, (server.sent - sent, total, ahead)
    assert list((cache / "locks").iterdir()) == []  # each fetcher removed its lock file as it let go


def test_s3_two_epochs_within_the_cache(packs, truth, tmp_path):
    fmt = next((f for f in FORMATS if ranged(f)), None)
    if fmt is None:
        pytest.skip("no format has byte-range hooks yet")
    s3 = S3Server()
    try:
        url = f"s3://bucket/blocked/{fmt}"
        packer.pack(packs.parent / "src", url, fmt, store="raw", progress=False, workers=1, **PACK[fmt])
        limit = data_bytes(packs, fmt) // 8
        ds = open_blocked(url, tmp_path / "cache", limit)
        loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle=True)
        for _ in range(2):
            with CachePoll(tmp_path / "cache") as poll:
                assert sorted(seen_indices(loader, truth[fmt])) == list(range(COUNT))
            assert poll.most <= limit + WORKERS * int((ds.reader.spans[:, 2] - ds.reader.spans[:, 1]).max())
    finally:
        s3.stop()


@pytest.mark.distributed
def test_torchrun_two_ranks_read_every_sample_once_an_epoch(packs, server, truth, tmp_path):
    fmt = next((f for f in FORMATS if ranged(f)), None)
    if fmt is None:
        pytest.skip("no format has byte-range hooks yet")
    url, limit = f"{server.url}/{fmt}", data_bytes(packs, fmt) // 8
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), url, str(tmp_path / "cache"), str(limit), str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        batches = [len(r["epochs"][epoch]) for r in ranks]
        assert batches[0] == batches[1]
        pairs = [pair for r in ranks for batch in r["epochs"][epoch] for pair in batch]
        assert all(truth[fmt][d][1] == label for d, label in pairs)
        counts = collections.Counter(d for d, _ in pairs)
        assert set(counts) == set(truth[fmt]) and len(pairs) - COUNT <= 1  # padding: at most one repeat
    assert max(r["most"] for r in ranks) <= limit + 2 * max(r["block"] for r in ranks)  # one worker a rank


def fetch_ahead_threads() -> list[threading.Thread]:
    """The fetch-ahead threads still alive after a short wait (they look at the batches every 10 ms)."""
    for _ in range(100):
        found = [t for t in threading.enumerate() if t.name == "packer-fetch-ahead"]
        if not found:
            return []
        time.sleep(0.02)
    return found


def test_block_plan_orders_blocks_by_first_read_with_their_last_batch():
    order, last = block_plan(np.array([0, 0, 1, 0, 2, 2, 1]), 2)  # batches 0 0 1 1 2 2 3
    assert order.tolist() == [0, 1, 2] and last.tolist() == [1, 3, 2]


def test_torch_s_workers_mapped_batches_are_those_up_to_the_least_worker_s_latest():
    """Each torch worker says the first sample of the latest batch whose blocks it mapped; batches go to the
    workers in order and each takes its own in order, so every batch up to the least of those is mapped."""
    maps = WorkerMaps(2)
    order = list(range(100, 120))  # a pass of 5 batches of 4: first samples 100, 104, 108, 112, 116
    mapped = maps.counter(order, 4)
    assert mapped() == 0  # no worker has mapped a batch yet
    maps.slots[0] = 108  # worker 0 has mapped batch 2
    assert mapped() == 0  # worker 1 none: batch 1 may still need its blocks
    maps.slots[1] = 104
    assert mapped() == 2  # batches 0 and 1
    maps.slots[1] = 112
    assert mapped() == 3  # batches 0 to 2
    maps.slots[0] = 7  # not the first sample of a batch of this pass (a previous pass's): counts as none
    assert mapped() == 0
    again = maps.counter(order, 4)  # a new pass clears what the last one said
    assert list(maps.slots) == [-1, -1] and again() == 0
    assert pickle.loads(pickle.dumps(maps)).slots is None  # the shared memory goes only to a worker starting


def test_torch_s_workers_say_which_batches_they_have_mapped_before_they_are_received(packs, server, truth, tmp_path):
    """Through torch's DataLoader workers (make_loader's engine for images without one output size), each worker
    maps a batch's blocks before it decodes it and says so in memory the main process shares: the fetch-ahead
    learns of batches mapped and not yet received, and lets their blocks go without waiting for the caller."""
    fmt = next(f for f in FORMATS if ranged(f))
    ds = open_blocked(f"{server.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt) // 8)
    loader = packer.make_loader(ds, batch_size=BATCH // 2, num_workers=WORKERS, shuffle=True, seed=5)
    assert loader.plan.engine == "torch"
    firsts = loader.sampler.next_pass().indices()[:: BATCH // 2]  # each batch's first sample, in order
    iterator = iter(loader)
    taken = [next(iterator)]  # one batch received; the workers have been sent the next ones
    slots, deadline = loader.dataset.maps.slots, time.monotonic() + 10
    while not all(s in firsts[1:] for s in slots[:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(s in firsts[1:] for s in slots[:]), (slots[:], firsts[:4])  # batches 1, 2...: not received yet
    taken.extend(iterator)
    assert sorted(seen_indices(taken, truth[fmt])) == list(range(COUNT))


class _SizedBlocks:
    """A blocked reader's fetch-ahead interface over blocks of given sizes, one sample each; records the bytes
    held at once."""

    def __init__(self, sizes: list[int]):
        self.sizes, self.held, self.most, self.lock = np.array(sizes), set(), 0, threading.Lock()
        self.waiting = False  # whether a reader of the cache has waited for room a while

    def block_of(self, indices):
        return np.asarray(indices)

    def block_bytes(self):
        return self.sizes

    def hold_block(self, block: int, wait: bool = False):
        with self.lock:
            self.held.add(block)
            self.most = max(self.most, int(self.sizes[list(self.held)].sum()))
        return lambda: self.held.discard(block)

    def reader_stuck(self) -> bool:
        return self.waiting


def test_the_fetch_ahead_holds_the_bytes_of_ahead_blocks_more_of_them_where_they_are_short():
    """Shard tails make short blocks: the fetch-ahead counts bytes, so a run of them is held further ahead, and
    never more than ``ahead`` of the largest blocks take."""
    from packer.loading.fetchahead import FetchAhead
    from packer.state import Progress

    reader = _SizedBlocks([100, 10, 10, 10, 10, 100, 100, 10])
    progress = Progress(None, 8)  # nothing received: every block is still needed
    owner = _SizedBlocks([])  # the iterator the caller holds: anything weakly referenced
    fetching = FetchAhead(reader, list(range(8)), 1, progress, owner, ahead=2)
    deadline = time.monotonic() + 10
    while len(reader.held) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # nothing more comes: the next block would pass 2 x 100 bytes
    assert sorted(reader.held) == [0, 1, 2, 3, 4] and reader.most == 140
    fetching.stop()
    assert reader.held == set()  # released as it stopped


def test_the_fetch_ahead_lets_go_of_its_blocks_while_another_reader_waits_for_room():
    """Readers sharing a small cache each hold up to most of it fetched ahead: while one waits for room, the
    others' fetch-aheads let go of every block they hold and fetch none, then fetch ahead again once it has its
    room (with the pins kept, three readers each waited for good on a block none had room for)."""
    from packer.loading.fetchahead import FetchAhead
    from packer.state import Progress

    reader = _SizedBlocks([100] * 8)
    owner = _SizedBlocks([])  # the iterator the caller holds: anything weakly referenced

    def held_becomes(blocks: set[int]) -> bool:
        deadline = time.monotonic() + 10
        while reader.held != blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        return reader.held == blocks

    fetching = FetchAhead(reader, list(range(8)), 1, Progress(None, 8), owner, ahead=4)
    try:
        assert held_becomes({0, 1, 2, 3})
        reader.waiting = True
        assert held_becomes(set())
        time.sleep(0.1)
        assert reader.held == set()  # nothing fetched ahead while the other waits
        reader.waiting = False
        assert held_becomes({0, 1, 2, 3})
    finally:
        fetching.stop()


def test_a_batch_mapped_starts_the_fetch_its_bytes_were_waiting_for_without_waiting_for_the_next_poll(monkeypatch):
    """Held to its bytes, the fetch-ahead looks for the next batch mapped every FRONTIER_POLL: the freed bytes go
    to the next block at once, a request's latency ahead of the decoder that needs it, not a POLL later."""
    from packer.loading import fetchahead
    from packer.state import Progress

    monkeypatch.setattr(fetchahead, "POLL", 600.0)  # only a fetch done, or the frontier's look, wakes the thread
    reader, owner, mapped = _SizedBlocks([100] * 8), _SizedBlocks([]), [0]

    def held_becomes(blocks: set[int]) -> bool:
        deadline = time.monotonic() + 30
        while reader.held != blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        return reader.held == blocks

    fetching = fetchahead.FetchAhead(reader, list(range(8)), 1, Progress(None, 8), owner, ahead=2,
                                     mapped=lambda: mapped[0])
    try:
        assert held_becomes({0, 1})
        mapped[0] = 1  # batch 0's decoder has mapped block 0: its bytes go to block 2
        assert held_becomes({1, 2})
        mapped[0] = 3
        assert held_becomes({3, 4})
    finally:
        fetching.stop()


def test_the_fetch_ahead_looks_for_a_stuck_reader_only_every_stuck_poll():
    """Each look scans the cache's waiting/ folder; the thread wakes every POLL for the batches, but a reader is
    stuck only after STUCK_AFTER, so it looks every STUCK_POLL."""
    from packer.loading import fetchahead
    from packer.state import Progress

    class Counted(_SizedBlocks):
        looks = 0

        def reader_stuck(self) -> bool:
            Counted.looks += 1
            return False

    reader, owner = Counted([100] * 8), _SizedBlocks([])
    fetching = fetchahead.FetchAhead(reader, list(range(8)), 1, Progress(None, 8), owner, ahead=2)
    began = time.monotonic()
    time.sleep(0.5)
    fetching.stop()
    assert 1 <= Counted.looks <= (time.monotonic() - began) / fetchahead.STUCK_POLL + 1


def test_the_main_process_fetches_ahead_and_its_thread_ends_with_the_iterator(packs, server, truth, tmp_path):
    fmt = next((f for f in FORMATS if ranged(f)), None)
    if fmt is None:
        pytest.skip("no format has byte-range hooks yet")
    ds = open_blocked(f"{server.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt) // 8)
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle=True)
    before = STATS["requests"]
    assert sorted(seen_indices(loader, truth[fmt])) == list(range(COUNT))
    assert STATS["requests"] > before  # blocks fetched ahead by this process (its workers fetch what is not)
    assert fetch_ahead_threads() == []  # the pass ended: so did its thread, releasing its pins
    iterator = iter(loader)
    next(iterator)
    assert [t.name for t in threading.enumerate()].count("packer-fetch-ahead") == 1
    del iterator  # a loop that breaks out: the thread ends too
    assert fetch_ahead_threads() == []
    most = ds.reader.fetch_ahead
    with pytest.raises(ValueError, match=rf"fetch_ahead={most + 1}: .*cut for at most {most} blocks"):
        packer.make_loader(ds, batch_size=BATCH, fetch_ahead=most + 1)  # would starve the workers
    quiet = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle=True, fetch_ahead=0)
    before = STATS["requests"]
    assert sorted(seen_indices(quiet, truth[fmt])) == list(range(COUNT))
    assert STATS["requests"] == before  # nothing fetched ahead: the workers fetched every block themselves


def test_a_full_fetch_ahead_leaves_room_for_a_block_a_worker_fetches_itself(packs, server, tmp_path):
    """The blocks are cut so that the most the fetch-ahead may hold (``fetch_ahead`` of the largest blocks) and
    one more fit the cache: a worker needing a block no one fetched gets it without waiting for room."""
    for limit, ranks in [(62_976, 1), (10**8 + 7, 1), (10**8 + 7, 2), (999, 3)]:  # below BLOCK_CAP
        block, most = block_budget(limit, ranks=ranks)
        assert ranks * most * block + block <= limit and block > limit // (ranks * most + 2)
    fmt = next(f for f in FORMATS if ranged(f))
    limit = data_bytes(packs, fmt) // 8
    reader = open_blocked(f"{server.url}/{fmt}", tmp_path / "cache", limit).reader
    sizes = reader.block_bytes()
    largest, budget, ahead = np.argsort(sizes, kind="stable")[::-1].tolist(), reader.fetch_ahead * sizes.max(), 0
    while sizes[largest[: ahead + 1]].sum() <= budget:  # the fetch-ahead's bytes at most, in its largest blocks
        ahead += 1
    other = largest[ahead]
    held = [reader.hold_block(b, wait=False) for b in largest[:ahead]]
    try:
        assert all(release is not None for release in held)
        mine = reader.hold_block(other, wait=False)  # a worker's own fetch, as RemoteBlocks.open makes it
        assert mine is not None and Cache(tmp_path / "cache").used() <= limit
        mine()
    finally:
        for release in held:
            if release is not None:
                release()


def test_a_cache_too_small_for_the_batches_in_flight_is_said_once_with_the_limit_that_holds_them(packs, server,
                                                                                                  tmp_path, capfd):
    """make_loader says, in one line naming the URL, when the fetch-ahead's share of cache_limit holds fewer samples
    than the loader keeps in flight (its decoders would wait on their own fetches), and what limit would hold
    them: at that limit it says nothing. A local folder read a block at a time (page_budget) is never told."""
    fmt = next(f for f in FORMATS if ranged(f))
    total, batch = data_bytes(packs, fmt), 24  # a batch size no other test uses: each line is said once a process
    capfd.readouterr()
    small = open_blocked(f"{server.url}/{fmt}", tmp_path / "small", total // 7)
    packer.make_loader(small, batch_size=batch, num_workers=WORKERS)
    said = [line for line in capfd.readouterr().err.splitlines() if "wait on fetches" in line]
    assert len(said) == 1 and said[0].startswith(f"packer: {server.url}/{fmt}: cache_limit holds about "), said
    # its figures agree: fewer held than needed, the samples needed the batches in flight and the window's rest
    found = re.search(r"holds about ([\d,]+) samples fetched ahead, fewer than the ([\d,]+) this loader needs there "
                      r"\(([\d,]+) in flight: \d+ batches of (\d+); ([\d,]+) more for the rest", said[0])
    assert found is not None, said
    held, needed, flight, size, rest = (int(figure.replace(",", "")) for figure in found.groups())
    assert held < needed == flight + rest and size == batch and flight % batch == 0, said
    need = float(said[0].split("raise cache_limit to about ")[1].split(" MB")[0]) * 1e6
    assert total // 7 < need < total  # more than it was, and still smaller than the dataset: read in blocks
    enough = open_blocked(f"{server.url}/{fmt}", tmp_path / "enough", int(need * 1.01))  # 3 figures, rounded
    packer.make_loader(enough, batch_size=batch, num_workers=WORKERS)
    local = packer.open_dataset(packs / fmt, page_budget=total // 7)
    packer.make_loader(local, batch_size=batch, num_workers=WORKERS)
    assert "wait on fetches" not in capfd.readouterr().err


def test_the_next_epochs_first_blocks_are_fetched_before_it_starts(packs, server, truth, tmp_path):
    """Once the pass's own blocks are fetched, the thread fetches those of the next epoch's first batch in each
    worker (as the sampler will make it): the next epoch does not start by waiting on requests."""
    fmt = next(f for f in FORMATS if ranged(f))
    ds = open_blocked(f"{server.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt) // 8)
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle=True, seed=4)
    batches = len(loader)
    for step, _ in enumerate(loader):
        if step == batches - 2:
            time.sleep(1.0)  # a slow step near the end: the thread has long reached the next epoch's blocks
    upcoming = loader.sampler.next_pass().indices()[: BATCH * WORKERS]
    cache, store = Cache(tmp_path / "cache"), ds.reader.store
    names = []
    for block in np.unique(ds.reader.block_of(upcoming)):
        relpath, start, end = ds.reader.block_range(int(block))
        entry = store.entries[relpath]
        names.append(range_name(entry["sha256"], start, end, int(entry["bytes"])))
    assert names and all(cache.object_path(name).exists() for name in names)
    assert fetch_ahead_threads() == []  # and released with the pass
    assert sorted(seen_indices(loader, truth[fmt])) == list(range(COUNT))


def test_every_pass_fetches_on_the_process_s_fetch_threads_started_once(packs, server, truth, tmp_path):
    """The threads that fetch blocks start once per process and serve every pass (started again each epoch, on
    cores the decoders keep busy, they delayed its first fetches past its first batches): their number does not
    grow with the epochs, and every sample is read once an epoch."""
    fmt = next(f for f in FORMATS if ranged(f))
    ds = open_blocked(f"{server.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt) // 8)
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle=True)
    counts = []
    for _ in range(3):
        assert sorted(seen_indices(loader, truth[fmt])) == list(range(COUNT))
        assert fetch_ahead_threads() == []
        counts.append([t.name for t in threading.enumerate()].count("packer-fetch-block"))
    assert counts[0] > 0 and len(set(counts)) == 1, counts


def test_the_thread_fetches_several_blocks_at_once_behind_a_slow_link(packs, server, truth, tmp_path):
    """Each block's request latency overlaps the others': with one reading thread (no worker processes) more
    than two requests in flight at once can only be the fetch-ahead thread's."""
    fmt = next((f for f in FORMATS if ranged(f)), None)
    if fmt is None:
        pytest.skip("no format has byte-range hooks yet")
    proxy = fault_proxy(server.url, latency=0.05)
    try:
        ds = open_blocked(f"{proxy.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt) // 8)
        loader = packer.make_loader(ds, batch_size=BATCH, num_workers=0, shuffle=True)
        assert sorted(seen_indices(loader, truth[fmt])) == list(range(COUNT))
        assert proxy.most_in_flight >= 3, proxy.most_in_flight
        assert fetch_ahead_threads() == []
    finally:
        proxy.stop()


def block_gets(ds, served) -> dict[int, int]:
    """GETs the server has answered so far for each block of ``ds`` (by its range)."""
    reader = ds.reader
    counts = {}
    for block in range(len(reader.starts)):
        relpath, start, end = reader.block_range(block)
        key = (f"{urlsplit(reader.where).path}/{relpath}", f"bytes={start}-{end - 1}")
        counts[block] = served.ranges[key]
    return counts


@pytest.mark.remote
def test_across_epoch_boundaries_the_cache_stays_bound_and_no_block_is_fetched_twice_in_an_epoch(
        packs, server, truth, tmp_path):
    """Three epochs back to back through packer's pool, the cache sampled throughout, boundaries included (where
    one pass holds the next one's first blocks, fetched ahead): it stays within its bound. In each epoch's
    stretch of time every block is fetched once at most, or twice where the next epoch reads it among the first
    blocks the fetch-ahead may hold (fetched ahead for that epoch); and the next epoch does not fetch those again."""
    fmt = next(f for f in FORMATS if ranged(f))
    total = data_bytes(packs, fmt)
    limit, cache = total // 8, tmp_path / "cache"
    crops = pixel_table(packer.open_dataset(packs / fmt, center_crop=8), COUNT)
    ds = open_blocked(f"{server.url}/{fmt}", cache, limit, center_crop=8)
    loader = packer.make_loader(ds, batch_size=BATCH // 2, num_workers=WORKERS, shuffle="blocks", seed=9)
    assert loader.plan.engine == "pool"
    reader, sizes = ds.reader, ds.reader.block_bytes()
    budget = reader.fetch_ahead * int(sizes.max())

    def first_blocks(epoch_pass) -> set[int]:
        """The blocks the fetch-ahead may fetch for ``epoch_pass`` before it starts: its first, within the budget."""
        order = block_plan(reader.block_of(epoch_pass.indices()), 1)[0]
        return set(order[np.cumsum(sizes[order]) <= budget].tolist())

    counts = [block_gets(ds, server)]
    ahead = []  # per epoch: its blocks that the epoch before may have fetched for it
    with CachePoll(cache) as poll:
        for _ in range(3):
            following = loader.sampler.next_pass().following()
            assert sorted(seen_indices(loader, crops)) == list(range(COUNT))
            counts.append(block_gets(ds, server))
            ahead.append(first_blocks(following))
    assert poll.most <= limit + WORKERS * int(sizes.max()), (poll.most, limit)
    fetched = [{b: counts[e + 1][b] - counts[e][b] for b in range(len(sizes))} for e in range(3)]
    for epoch in range(3):
        for block, times in fetched[epoch].items():
            assert times <= 1 + (block in ahead[epoch]), (epoch, block, times)
            if epoch and fetched[epoch - 1][block] == 2 and block not in ahead[epoch]:
                assert times == 0, (epoch, block)  # fetched for this epoch by the one before: not again


@pytest.mark.remote
def test_behind_a_slower_link_more_blocks_are_fetched_at_once_up_to_what_the_fetch_ahead_may_hold(
        packs, server, truth, tmp_path):
    """How many fetches run at once follows a fetch's time at the rate the batches use blocks: behind 0.3 s a
    request, with one reading thread that waits on them, more than the ``FETCHERS`` a pass starts with, and never
    more than the blocks the fetch-ahead may hold (and the reading thread's own fetch)."""
    fmt = next(f for f in FORMATS if ranged(f))
    proxy = fault_proxy(server.url, latency=0.3)
    try:
        ds = open_blocked(f"{proxy.url}/{fmt}", tmp_path / "cache", data_bytes(packs, fmt) // 8)
        loader = packer.make_loader(ds, batch_size=BATCH, num_workers=0, shuffle=True)
        assert sorted(seen_indices(loader, truth[fmt])) == list(range(COUNT))
        assert FETCHERS + 1 < proxy.most_in_flight <= ds.reader.fetch_ahead + 1, proxy.most_in_flight
    finally:
        proxy.stop()


def cached_blocks(packs: Path, fmt: str, ds, cache: Path) -> set[int]:
    """The blocks of ``ds`` whose range the cache at ``cache`` holds now."""
    entries = {e["path"]: e for e in packer.read_manifest(packs / fmt)["files"]}
    found = set()
    for block in range(len(ds.reader.starts)):
        relpath, start, end = ds.reader.block_range(block)
        entry = entries[relpath]
        if Cache(cache).object_path(range_name(entry["sha256"], start, end, entry["bytes"])).exists():
            found.add(block)
    return found


@pytest.mark.remote
def test_the_next_epoch_s_first_blocks_are_fetched_ahead_as_far_as_the_budget_allows(packs, server, truth, tmp_path):
    """Once an epoch's own blocks are all fetched or held, the fetch-ahead fetches the next epoch's, in the order
    it reads them, as far as what it may hold allows (not only its first batch's): the next epoch starts on them
    and fetches none of them again, and the cache stays within its bound."""
    fmt = next(f for f in FORMATS if ranged(f))
    limit, cache = data_bytes(packs, fmt) // 4, tmp_path / "cache"
    ds = open_blocked(f"{server.url}/{fmt}", cache, limit)
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=0, shuffle="blocks", seed=3)
    reader, sizes = ds.reader, ds.reader.block_bytes()
    budget = reader.fetch_ahead * int(sizes.max())
    this, following = loader.sampler.next_pass(), loader.sampler.next_pass().following()
    last_batch = set(reader.block_of(this.indices()[-BATCH:]).tolist())  # held until the last batch is received
    order = block_plan(reader.block_of(following.indices()), 1)[0]
    room = budget - int(sizes[sorted(last_batch)].sum())
    ahead = set(order[np.cumsum(sizes[order]) <= room].tolist())  # what the fetch-ahead may hold of them
    first = set(reader.block_of(following.indices()[:BATCH]).tolist())
    assert len(ahead - first) >= 2, (ahead, first)  # the budget holds more than the next epoch's first batch
    with CachePoll(cache) as poll:
        batches = iter(loader)
        seen = seen_indices([next(batches) for _ in range(len(loader) - 1)], truth[fmt])
        deadline = time.monotonic() + 60  # a bound on the wait, not a timing: the fetches finish long before
        while not ahead <= cached_blocks(packs, fmt, ds, cache) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ahead <= cached_blocks(packs, fmt, ds, cache), ahead - cached_blocks(packs, fmt, ds, cache)
        seen += seen_indices(batches, truth[fmt])
        assert sorted(seen) == list(range(COUNT))
        before = block_gets(ds, server)
        # the next epoch's batches up to the last that reads a block of ``ahead``: counted there, as later its own
        # fetch-ahead may fetch the epoch after's blocks, some of them the same, evicted meanwhile
        reads = reader.block_of(following.indices())
        covering = 1 + max(int(np.flatnonzero(reads == b)[0]) for b in ahead) // BATCH
        batches = iter(loader)
        seen = seen_indices([next(batches) for _ in range(covering)], truth[fmt])
        after = block_gets(ds, server)
        assert sorted(seen + seen_indices(batches, truth[fmt])) == list(range(COUNT))
    assert {b for b in ahead if after[b] > before[b]} == set()  # none of them fetched again
    assert poll.most <= limit, (poll.most, limit)  # counted under the eviction lock: exactly what it held

"""``packer.stream`` over a URL 8x larger than its ``cache_limit`` (issue 25's second "Done when"): the wds
shards are fetched into the node's cache as each worker process reaches them and released once read, from the
Range-capable file server (and moto's S3) the suite starts on 127.0.0.1, with the read-time ``resize`` and
``random_resized_crop``/``flip``.

Each epoch gives every sample exactly once with its label (recognised by its pixels in the local dataset opened
with the same options), the cache stays within its bound while the epoch runs (sampled on a thread), the server
sends each shard about once an epoch, a state saved mid-epoch at 2 ranks of 2 workers resumes at one rank with
exactly the remaining samples, a second process streaming the same URL shares the cache, and a real 2-rank
torchrun takes every sample once an epoch, then one process resumes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import noise_folder
from support.packed import manifest_bytes, pixel_table, seen_indices
from support.processes import launch, read_out
from support.remote import CachePoll, S3Server, serving

import packer

pytestmark = [pytest.mark.remote, pytest.mark.usefixtures("quick_retries")]

COUNT, SIDE, SHARD = 960, 16, 12  # 80 shards of 12 raw 16x16 noise images; the cache holds 10
# windows of 2 shards; the batches the workers hold in flight (4 each) span about 3 shards, well within the cache
BATCH, WORKERS, SEED, BUFFER = 4, 2, 3, 24
RESIZE = {"resize": 12}
AUGMENT = {"random_resized_crop": 12, "flip": True, "scale": (0.3, 1.0)}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    """``COUNT`` distinct images in 3 classes packed raw as wds shards of ``SHARD``, under ``packs/wds``."""
    root = tmp_path_factory.mktemp("stream-remote")
    noise_folder(root / "src", COUNT, SIDE, "png")
    packer.pack(root / "src", root / "packs" / "wds", "wds", store="raw", shard_samples=SHARD, progress=False,
                workers=1)
    return root / "packs"


@pytest.fixture(scope="module")
def server(packs):
    yield from serving(packs)


@pytest.fixture(scope="module")
def sizes(packs) -> tuple[int, int, int]:
    """The dataset's data bytes, its cache limit (an eighth of them) and its largest shard."""
    total = manifest_bytes(packs / "wds")
    return total, total // 8, max(e["bytes"] for e in packer.read_manifest(packs / "wds")["files"])


@pytest.fixture(scope="module")
def resized(packs) -> dict[str, tuple[int, int]]:
    """Each sample's (index, label) by its pixels, as ``open_dataset(local, resize=12)`` gives them."""
    return pixel_table(packer.open_dataset(packs / "wds", **RESIZE), COUNT)


def remote(url: str, cache: Path, limit: int, rank: int = 0, world: int = 1, workers: int = WORKERS,
           **options) -> packer.StreamLoader:
    """The stream of ``url`` at rank ``rank`` of ``world`` (as ``torch.distributed`` would give it those)."""
    loader = packer.stream(url, BATCH, num_workers=workers, seed=SEED, buffer=BUFFER, cache_dir=cache,
                           cache_limit=limit, **options)
    loader.rank, loader.world = rank, world
    return loader


def test_two_epochs_with_resize_every_sample_once_within_the_cache(packs, server, sizes, resized, tmp_path):
    total, limit, shard = sizes
    cache = tmp_path / "cache"
    loader = remote(f"{server.url}/wds", cache, limit, **RESIZE)
    orders = []
    for _ in range(2):
        sent = server.sent
        with CachePoll(cache) as poll:
            orders.append(seen_indices(loader, resized))
        assert sorted(orders[-1]) == list(range(COUNT))
        assert poll.most <= limit + WORKERS * shard, (poll.most, limit, shard)
        assert server.sent - sent <= 1.1 * total, (server.sent - sent, total)
    assert orders[0] != orders[1]


def test_a_cache_of_little_more_than_a_shard_per_worker_still_gives_every_sample(server, sizes, resized, tmp_path):
    """The smallest cache stream takes (one shard per worker) and half a shard: the workers wait for no one and
    find room, each fetching what it reads."""
    _, _, shard = sizes
    limit, cache = WORKERS * shard + shard // 2, tmp_path / "cache"
    with CachePoll(cache) as poll:
        assert sorted(seen_indices(remote(f"{server.url}/wds", cache, limit, **RESIZE), resized)) == list(range(COUNT))
    assert poll.most <= limit + WORKERS * shard, (poll.most, limit, shard)


def test_saved_at_two_ranks_of_two_workers_resumes_at_one_with_the_augmentation(packs, server, sizes, tmp_path):
    """random_resized_crop + flip: each sample's window comes from (seed, epoch, index), so whichever rank and
    worker takes a sample, its image is ``open_dataset(local, seed=SEED)``'s at that epoch."""
    total, limit, shard = sizes
    url, cache = f"{server.url}/wds", tmp_path / "cache"
    ds = packer.open_dataset(packs / "wds", seed=SEED, **AUGMENT)
    ds.set_epoch(1)
    table = pixel_table(ds, COUNT)
    taken, states = [], []
    for rank in range(2):
        loader = remote(url, cache, limit, rank, 2, **AUGMENT)
        loader.set_epoch(1)
        first = []
        for batch in loader:
            first.append(batch)
            if len(first) == 3:
                break
        states.append(loader.state_dict())
        taken += seen_indices(first, table)
    assert states[0] == states[1] and states[0]["samples_seen"] == 3 * BATCH * 2 and states[0]["epoch"] == 1
    resumed = remote(url, cache, limit, workers=1, **AUGMENT)
    resumed.load_state_dict(json.loads(json.dumps(states[0])))
    assert len(resumed) == (COUNT - 3 * BATCH * 2) // BATCH
    sent = server.sent
    with CachePoll(cache) as poll:
        batches = list(resumed)
    rest = seen_indices(batches, table)
    assert all(images.shape[1:] == (3, 12, 12) for images, _ in batches)
    assert sorted(taken + rest) == list(range(COUNT)), "each sample of the epoch exactly once"
    assert poll.most <= limit + shard and server.sent - sent <= 1.1 * total
    parts = []
    for rank in range(3):  # and at three ranks, in this process
        loader = remote(url, cache, limit, rank, 3, workers=0, **AUGMENT)
        loader.load_state_dict(states[0])
        parts.append(seen_indices(loader, table))
    assert len({len(part) for part in parts}) == 1, "every rank as many samples"
    assert sorted(taken + [i for part in parts for i in part]) == list(range(COUNT))


def test_s3_an_epoch_within_the_cache(packs, sizes, resized, tmp_path):
    _, limit, shard = sizes
    s3 = S3Server()
    try:
        url = "s3://bucket/stream/wds"
        packer.pack(packs.parent / "src", url, "wds", store="raw", shard_samples=SHARD, progress=False, workers=1)
        loader = remote(url, tmp_path / "cache", limit, **RESIZE)
        with CachePoll(tmp_path / "cache") as poll:
            assert sorted(seen_indices(loader, resized)) == list(range(COUNT))
        assert poll.most <= limit + WORKERS * shard
    finally:
        s3.stop()


CHILD = """
import hashlib, json, pathlib, sys, time
import packer
loader = packer.stream(sys.argv[1], 4, num_workers=1, seed=3, buffer=24, cache_dir=sys.argv[2],
                       cache_limit=int(sys.argv[3]), resize=12)
pathlib.Path(sys.argv[4]).touch()
while len(list(pathlib.Path(sys.argv[4]).parent.glob("ready-*"))) < 2:  # both start reading at once
    time.sleep(0.01)
pairs = [[hashlib.sha1(im.contiguous().numpy().tobytes()).hexdigest(), int(label)]
         for ims, labels in loader for im, label in zip(ims, labels)]
print(json.dumps(pairs))
"""


def test_two_processes_streaming_one_url_share_the_cache(server, sizes, resized, tmp_path):
    """Two processes on a node streaming one URL at once, through one cache with room for the dataset: each shard
    crosses the network once, fetched by whichever process asks first (the other waits for that fetch, or finds
    the shard cached). With less room than that, what they share depends on how far apart they run, which the
    machine's scheduling decides: a shard evicted before the slower one reaches it is fetched again."""
    total, _, _ = sizes
    limit = 2 * total
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    sent = server.sent
    args = [f"{server.url}/wds", str(tmp_path / "cache"), str(limit)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, *args, str(tmp_path / f"ready-{k}")], text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    for out, _ in outs:
        pairs = json.loads(out)
        assert sorted(resized[d][0] for d, _ in pairs) == list(range(COUNT))
        assert all(resized[d][1] == label for d, label in pairs)
    assert server.sent - sent <= total, (server.sent - sent, total)  # each shard once, not once a process


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks_stream_the_url_then_one_process_resumes(packs, server, sizes, resized, tmp_path):
    """A real 2-rank torchrun launch (one worker each, sharing the cache) reads two epochs, then an epoch it
    stops after 3 batches; one plain process resumes that state: every sample once an epoch."""
    total, limit, shard = sizes
    stream = {"batch_size": BATCH, "num_workers": 1, "seed": SEED, "buffer": BUFFER, "cache_dir": str(tmp_path / "c"),
              "cache_limit": limit, **RESIZE}
    job = {"path": f"{server.url}/wds", "table": {"path": str(packs / "wds"), "open": RESIZE}, "open": {},
           "stream": stream, "sync": True}  # the ranks step together, as DDP's all-reduce keeps them
    whole = dict(job, epochs=2, state_in=None, stop=None, state_out=None, out=str(tmp_path / "whole.{rank}.out"))
    two = dict(job, epochs=1, state_in=None, stop={"after_batches": 3}, state_out=str(tmp_path / "two.state"),
               out=str(tmp_path / "two.{rank}.out"))
    one = dict(job, epochs=1, state_in=str(tmp_path / "two.state"), stop=None, state_out=None,
               out=str(tmp_path / "one.{rank}.out"))
    sent = server.sent
    with CachePoll(tmp_path / "c") as poll:  # the ranks' workers share the node's cache
        launch([whole, two], tmp_path, "torchrun", ranks=2)
    assert poll.most <= limit + 2 * shard, (poll.most, limit, shard)
    # two epochs, then the start of a third (3 batches, and what the workers read ahead of them)
    assert server.sent - sent <= (2 * 1.1 + 0.2) * total, (server.sent - sent, total)
    ranks = [read_out(whole["out"], r) for r in range(2)]
    label_of = dict(resized.values())
    assert all(out["world"] == 2 for out in ranks)
    for epoch in range(2):
        per_rank = [[b for b in out["batches"] if b[0] == epoch] for out in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == COUNT // (2 * BATCH)
        indices = [i for batches in per_rank for b in batches for i in b[3]]
        labels = [label for batches in per_rank for b in batches for label in b[2]]
        assert sorted(indices) == list(range(COUNT))
        assert labels == [label_of[i] for i in indices]
    launch([one], tmp_path, "plain")
    stopped = [read_out(two["out"], r) for r in range(2)]
    assert all(out["states_equal"] for out in stopped) and stopped[0]["state"]["samples_seen"] == 3 * BATCH * 2
    before = [i for out in stopped for batch in out["batches"] for i in batch[3]]
    after = [i for batch in read_out(one["out"])["batches"] for i in batch[3]]
    assert len(before) == 3 * BATCH * 2 and sorted(before + after) == list(range(COUNT))


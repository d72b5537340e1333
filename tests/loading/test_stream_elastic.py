"""``packer.stream`` resumes exactly at another world size and number of workers (issue 25): every epoch has one
global order fixed by ``(seed, epoch)``, the ranks take it a step of ``batch_size * world`` samples at a time,
and the state is ``{epoch, samples_seen}``. Real DataLoader worker processes; ranks of a world size are the
same loader as ``torch.distributed`` would make it at that rank (and one real 2-rank torchrun launch). Samples
are recognised by their pixels in the dataset opened with ``open_dataset``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import noise_folder
from support.packed import digest
from support.processes import launch, one_line_value_error, read_out

import packer

COUNT, SHARD, BATCH, SEED = 96, 8, 4, 3  # 12 shards of 8; 96 samples: whole steps at 1 to 4 ranks
BUFFER = 48  # windows of 6 shards


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """96 distinct 16x16 images packed raw into shards of 8, and each image's index by its pixels."""
    root = tmp_path_factory.mktemp("elastic")
    noise_folder(root / "src", COUNT, 16, "png")
    dest = root / "wds"
    packer.pack(root / "src", dest, "wds", store="raw", shard_samples=SHARD, progress=False, workers=1)
    ds = packer.open_dataset(dest)
    table = {digest(ds[i][0]): i for i in range(len(ds))}
    assert len(table) == COUNT
    return dest, table


def make(dest: Path, rank: int = 0, world: int = 1, workers: int = 0, **options) -> packer.StreamLoader:
    """The stream of rank ``rank`` of ``world`` (as ``torch.distributed`` would give it those)."""
    loader = packer.stream(dest, BATCH, num_workers=workers, seed=SEED, buffer=BUFFER, **options)
    loader.rank, loader.world = rank, world
    return loader


def take(loader, table: dict[str, int], stop: int | None = None) -> list[list[int]]:
    """The sample indices of each batch of one pass over ``loader``, stopping after ``stop`` batches."""
    out = []
    for images, labels in loader:
        out.append([table[digest(image)] for image in images])
        assert len(labels) == len(images)
        if len(out) == stop:
            break
    return out


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def test_one_global_order_whatever_the_ranks_and_workers(dataset):
    dest, table = dataset
    loader = make(dest)
    epochs = [take(loader, table) for _ in range(2)]
    order = flat(epochs[0])
    assert sorted(order) == list(range(COUNT)) and sorted(flat(epochs[1])) == list(range(COUNT))
    assert order != flat(epochs[1]), "a new order every epoch"
    assert take(make(dest, workers=2), table) == epochs[0], "worker processes give the same batches"
    for world, workers in [(2, 0), (2, 2), (3, 1), (4, 0)]:
        parts = [take(make(dest, r, world, workers), table) for r in range(world)]
        assert len({len(part) for part in parts}) == 1, "every rank as many batches"
        for k in range(len(parts[0])):  # step k: the next batch_size * world samples of the one order
            step = sorted(i for part in parts for i in part[k])
            assert step == sorted(order[k * BATCH * world:(k + 1) * BATCH * world]), (world, workers, k)


def test_ranks_read_their_own_shards(dataset):
    """Windows of 6 shards over 2 ranks: each step is grouped by shard and each rank takes its group, so most of
    each shard goes to one rank (with ranks taking samples in turn, half of each would go to each)."""
    dest, table = dataset
    counts = torch.zeros(2, COUNT // SHARD)
    for r in range(2):
        for i in flat(take(make(dest, r, 2), table)):
            counts[r, i // SHARD] += 1
    assert counts.sum() == COUNT
    assert (counts.max(dim=0).values / SHARD).mean() > 0.8


def test_saved_at_two_ranks_and_two_workers_resumes_at_one_and_at_four(dataset):
    dest, table = dataset
    order = flat(take(make(dest), table))
    states, before = [], []
    for r in range(2):
        loader = make(dest, r, 2, workers=2)
        before += flat(take(loader, table, stop=3))
        states.append(loader.state_dict())
    state = states[0]
    assert states[1] == state and json.loads(json.dumps(state)) == state
    assert state["samples_seen"] == 3 * BATCH * 2 and state["world_size"] == 2 and state["epoch"] == 0
    assert sorted(before) == sorted(order[:24]), "the samples taken: the first positions of the one order"

    one = make(dest, workers=1)
    one.load_state_dict(state)
    assert len(one) == (COUNT - 24) // BATCH
    rest = flat(take(one, table))
    assert rest == order[24:], "at one rank: the rest of the same order"
    assert take(one, table) == take(one_epoch_later(dest), table), "then whole epochs"

    parts = []
    for r in range(4):
        loader = make(dest, r, 4, workers=2 if r % 2 else 0)
        loader.load_state_dict(state)
        parts.append(flat(take(loader, table)))
    assert len({len(part) for part in parts}) == 1
    assert sorted(before + [i for part in parts for i in part]) == list(range(COUNT)), "each sample exactly once"


def one_epoch_later(dest: Path) -> packer.StreamLoader:
    loader = make(dest)
    loader.set_epoch(1)
    return loader


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_of_an_uneven_world_take_as_many_batches(dataset, drop_last):
    """96 samples over 5 ranks: padded with the epoch's first samples (as DistributedSampler), or with
    drop_last only whole batches of distinct samples."""
    dest, table = dataset
    parts = [take(make(dest, r, 5, drop_last=drop_last), table) for r in range(5)]
    assert len({len(part) for part in parts}) == 1
    taken = [i for part in parts for i in flat(part)]
    if drop_last:
        assert all(len(batch) == BATCH for part in parts for batch in part)
        assert len(taken) == 80 and len(set(taken)) == 80
    else:
        assert set(taken) == set(range(COUNT)) and len(taken) == 100  # ceil(96 / 5) = 20 each


def test_augmented_stream_resumes_at_another_world_size(dataset):
    """random_resized_crop + flip: each sample's window is drawn from (seed, epoch, index), so the resumed
    epoch's images are open_dataset's, whatever world size took which sample."""
    dest, _ = dataset
    options = {"random_resized_crop": 12, "flip": True, "scale": (0.3, 1.0)}
    ds = packer.open_dataset(dest, seed=SEED, **options)
    want = sorted(digest(ds[i][0]) for i in range(len(ds)))
    images, state = [], None
    for r in range(2):
        loader = make(dest, r, 2, workers=2, **options)
        for k, (batch, _) in enumerate(loader):
            images += list(batch)
            if k == 1:
                break
        state = loader.state_dict()
    resumed = make(dest, **options)
    resumed.load_state_dict(state)
    images += [image for batch, _ in resumed for image in batch]
    assert all(image.shape == (3, 12, 12) and image.dtype == torch.uint8 for image in images)
    assert sorted(digest(image) for image in images) == want


def test_a_state_of_an_older_stream_or_other_window_is_one_line(dataset):
    dest, _ = dataset
    loader = make(dest)
    old = {"version": 1, "kind": "stream", "epoch": 2, "batches": 5, "batch_size": BATCH, "seed": SEED,
           "shuffle": True, "drop_last": False, "dataset_length": COUNT, "world_size": 1, "workers": 0}
    one_line_value_error(lambda: loader.load_state_dict(old), "older packer", "restart", "set_epoch(2)")
    other = packer.stream(dest, BATCH, num_workers=0, seed=SEED, buffer=8)
    state = other.state_dict()
    one_line_value_error(lambda: loader.load_state_dict(state), "window=")


@pytest.mark.distributed
def test_torchrun_two_ranks_then_one_process(dataset, tmp_path):
    """A real 2-rank torchrun launch (2 workers each) stops after 3 batches; one plain process resumes from its
    state: together they take every sample of the epoch exactly once."""
    dest, _ = dataset
    job = {"path": str(dest), "open": {},
           "stream": {"batch_size": BATCH, "num_workers": 2, "seed": SEED, "buffer": BUFFER}}
    two = dict(job, epochs=1, state_in=None, stop={"after_batches": 3}, state_out=str(tmp_path / "two.state"),
               out=str(tmp_path / "two.{rank}.out"))
    one = dict(job, epochs=1, state_in=str(tmp_path / "two.state"), stop=None, state_out=None,
               out=str(tmp_path / "one.{rank}.out"))
    launch([two], tmp_path, "torchrun", ranks=2)
    launch([one], tmp_path, "plain")
    ranks = [read_out(two["out"], r) for r in range(2)]
    assert all(out["states_equal"] and out["world"] == 2 for out in ranks)
    assert ranks[0]["state"]["samples_seen"] == 3 * BATCH * 2
    before = [i for out in ranks for batch in out["batches"] for i in batch[3]]
    after = [i for batch in read_out(one["out"])["batches"] for i in batch[3]]
    assert len(before) == 24 and sorted(before + after) == list(range(COUNT))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_out_of_place_is_one_line(dataset, tmp_path, workers):
    """Two shards swapped: their samples are not where the manifest's counts place them."""
    dest = tmp_path / "wds"
    shutil.copytree(dataset[0], dest)
    first, second = dest / "shard-000000.tar", dest / "shard-000001.tar"
    first.rename(tmp_path / "tmp.tar")
    second.rename(first)
    (tmp_path / "tmp.tar").rename(second)
    with pytest.raises(packer.PackerError) as info:
        for _ in make(dest, workers=workers):
            pass
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message and "shard-00000" in message, message
    assert "where the manifest's shard counts place sample" in message


def test_a_shard_read_skips_the_samples_a_stream_does_not_want(dataset):
    """What each worker process does with its rank's shards: the samples of the other workers are None, their
    data not read; the others are exactly what a whole read gives."""
    from packer.formats.wds.members import read_shard

    shard = dataset[0] / "shard-000003.tar"
    whole = list(read_shard(shard))
    some = list(read_shard(shard, wanted=lambda k: k % 3 == 1))
    assert len(whole) == len(some) == SHARD and [s.key for s in whole] == [f"{i:09d}" for i in range(24, 32)]
    assert some == [s if k % 3 == 1 else None for k, s in enumerate(whole)]

"""Resolution schedules: ``random_resized_crop`` (and ``resize``/``center_crop``) as a function of the epoch.

Every batch of an epoch has that epoch's size, with packer's worker pool (whose workers keep running while their
slots take the new size), decode threads and ``num_workers=0``, also in an epoch resumed from a state, and with
a lambda, which does not pickle to spawned workers: the loader sends each epoch's size with its indices.
"""

from __future__ import annotations

import pytest
import torch
from conftest import noise_folder
from support.packed import pixel_digest
from support.processes import one_line_value_error

import packer
from packer.reading.indices import EpochIndex

COUNT, BATCH = 24, 5
ENGINES = {"pool": {"num_workers": 2}, "threads": {"threads": 2}, "zero": {"num_workers": 0}}


def size_of(epoch: int) -> int:
    return 8 + 4 * min(epoch, 2)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    noise_folder(root / "src", COUNT, 32, "png")
    packer.pack(root / "src", root / "lmdb", "lmdb", store="raw", progress=False, workers=1)
    packer.pack(root / "src", root / "wds", "wds", progress=False, workers=1, shard_samples=7)
    return root


def epoch_sizes(loader, epochs: int) -> list[set]:
    return [{tuple(images.shape[2:]) for images, *_ in loader} for _ in range(epochs)]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_batch_of_an_epoch_has_its_size_and_the_pool_keeps_its_workers(pack, engine):
    ds = packer.open_dataset(pack / "lmdb", random_resized_crop=lambda epoch: size_of(epoch), flip=True)
    loader = packer.make_loader(ds, batch_size=BATCH, **ENGINES[engine])
    assert loader.plan.engine == ("pool" if engine == "pool" else "threads")
    first = epoch_sizes(loader, 1)
    pids = [p.pid for p in loader.worker_pool.processes] if engine == "pool" else None
    sizes = first + epoch_sizes(loader, 3)
    assert sizes == [{(size_of(e), size_of(e))} for e in range(4)]
    if pids is not None:
        assert [p.pid for p in loader.worker_pool.processes] == pids and all(
            p.is_alive() for p in loader.worker_pool.processes), "the same workers, reshaped slots"
    same = packer.open_dataset(pack / "lmdb", random_resized_crop=size_of(1), flip=True)
    batch = ds.read_batch([EpochIndex(i, 1) for i in range(4)])
    assert torch.equal(batch.images, same.read_batch([EpochIndex(i, 1) for i in range(4)]).images), \
        "an epoch's batches are those of a dataset opened at that epoch's size"


@pytest.mark.parametrize("engine", ["pool", "zero"])
def test_a_resumed_epoch_keeps_its_size_and_its_pixels(pack, engine):
    def make():
        ds = packer.open_dataset(pack / "wds", random_resized_crop=lambda epoch: size_of(epoch), flip=True)
        return packer.make_loader(ds, batch_size=BATCH, seed=2, **ENGINES[engine])

    whole = [[pixel_digest(images) for images, _ in make()] for _ in range(1)]
    reference = make()
    epochs = [[pixel_digest(images) for images, _ in reference] for _ in range(3)]
    assert epochs[0] == whole[0]
    first = make()
    for _ in first:  # epoch 0
        pass
    taken = []
    for images, _ in first:  # 2 batches of epoch 1
        taken.append(pixel_digest(images))
        if len(taken) == 2:
            break
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    rest = [(pixel_digest(images), tuple(images.shape[2:])) for images, _ in resumed]
    assert {shape for _, shape in rest} == {(size_of(1), size_of(1))}
    assert taken + [d for d, _ in rest] == epochs[1]
    assert epoch_sizes(resumed, 1) == [{(size_of(2), size_of(2))}]


def test_a_lambda_schedule_reaches_spawned_workers_as_each_epochs_size(pack):
    ds = packer.open_dataset(pack / "lmdb", random_resized_crop=lambda epoch: 6 + epoch)
    pool = packer.make_loader(ds, batch_size=BATCH, num_workers=2, multiprocessing_context="spawn")
    torchs = packer.make_loader(ds, batch_size=BATCH, num_workers=2, multiprocessing_context="spawn",
                                generator=torch.Generator())
    assert (pool.plan.engine, torchs.plan.engine) == ("pool", "torch")
    for loader in (pool, torchs):
        assert epoch_sizes(loader, 2) == [{(6, 6)}, {(7, 7)}]


def test_validation_sizes_follow_the_epoch_too(pack):
    ds = packer.open_dataset(pack / "lmdb", resize=lambda e: 16 + 4 * e, center_crop=lambda e: 12 + 4 * e)
    loader = packer.make_loader(ds, batch_size=BATCH, shuffle=False, num_workers=2)
    assert epoch_sizes(loader, 2) == [{(12, 12)}, {(16, 16)}]
    fixed = packer.open_dataset(pack / "lmdb", resize=20, center_crop=16)
    assert torch.equal(ds.read_batch([EpochIndex(3, 1)]).images, fixed.read_batch([3]).images)


def test_a_stream_follows_the_schedule_and_resumes_at_the_size(pack):
    def make(workers):
        return packer.stream(pack / "wds", BATCH, num_workers=workers, seed=1,
                             random_resized_crop=lambda epoch: size_of(epoch))

    for workers in (0, 2):
        loader = make(workers)
        assert epoch_sizes(loader, 2) == [{(size_of(0), size_of(0))}, {(size_of(1), size_of(1))}]
        state = loader.state_dict()
        resumed = make(2 - workers)
        resumed.load_state_dict(state)
        assert epoch_sizes(resumed, 1) == [{(size_of(2), size_of(2))}]


def test_a_schedule_that_gives_no_size_is_a_one_line_error_naming_the_epoch(pack):
    one_line_value_error(lambda: packer.open_dataset(pack / "lmdb", random_resized_crop=lambda e: 0),
                         "random_resized_crop", "epoch 0")
    ds = packer.open_dataset(pack / "lmdb", random_resized_crop=lambda e: 8 if e < 1 else None)
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=0)
    list(loader)
    one_line_value_error(lambda: list(loader), "random_resized_crop", "epoch 1")
    one_line_value_error(lambda: ds.read_batch([EpochIndex(0, 0), EpochIndex(1, 1)]), "one epoch")
    one_line_value_error(lambda: packer.open_dataset(pack / "lmdb", random_resized_crop=lambda e: 8, resize=10),
                         "random_resized_crop")

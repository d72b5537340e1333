"""A mixture (``packer.mix``) through ``make_loader`` and ``packer.stream``: exact resume at every batch boundary
(``num_workers`` 0 and 2, a resolution schedule included), across world sizes (the sampler's ranks, and real
torchrun), and streams of several WebDataset datasets mixed by weight.

Samples are recognised by their pixels in the datasets they came from (``support.packed.pixel_digest``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from support.fields import SCHEMA, write_dataset
from support.packed import noise_pack, pixel_digest, stop_and_resume
from support.processes import launch, one_line_value_error, read_out

import packer
from packer.loading.sampler import ResumableSampler
from packer.reading.mix import apportion

BATCH, LENGTH, SEED = 4, 40, 5  # 10 batches an epoch
CLASSES, OTHER = ["alpha", "beta", "gamma"], ["beta", "zeta"]


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixload")
    return {"lmdb": noise_pack(root, "lmdb", 30, CLASSES, 11),
            "wds": noise_pack(root, "wds", 7, OTHER, 12, shard_samples=3),
            "wds2": noise_pack(root, "wds", 20, CLASSES, 13, shard_samples=4)}


def mixture(packs, schedule: bool = False):
    crop = {"random_resized_crop": (lambda epoch: 8 + 4 * epoch), "flip": True} if schedule else {}
    sets = [packer.open_dataset(packs[name], **crop) for name in ("lmdb", "wds")]
    return packer.mix(sets, [1, 1], seed=SEED, samples_per_epoch=LENGTH)


def digests(loader, stop: int | None = None) -> list[tuple]:
    out = []
    for images, labels, sources in loader:
        out.append((pixel_digest(images), tuple(images.shape), labels.tolist(), sources.tolist()))
        if len(out) == stop:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("schedule", [False, True], ids=["fixed", "schedule"])
def test_resumes_exactly_at_every_batch_boundary(packs, workers, schedule):
    def make():
        return packer.make_loader(mixture(packs, schedule), batch_size=BATCH, num_workers=workers)

    reference = make()
    whole = [digests(reference) for _ in range(2)]
    nb = LENGTH // BATCH
    assert [len(e) for e in whole] == [nb, nb] and whole[0] != whole[1]
    if schedule:
        assert {b[1][2:] for b in whole[0]} == {(8, 8)} and {b[1][2:] for b in whole[1]} == {(12, 12)}
    for stop in range(nb + 1):  # a new mixture and loader resume, as after a restart
        assert stop_and_resume(make, digests, stop, nb) == whole[0] + whole[1], f"stopped after {stop} batches"


def test_ranks_share_one_order_and_resume_it_at_another_world_size(packs):
    """One rank takes 3 batches of the epoch; 3 ranks resume it: together they take the rest of the one global
    order (positions dealt in turn, padded to as many batches each), then whole 3-rank epochs."""
    ds = mixture(packs)
    one = ResumableSampler(ds, batch_size=BATCH)
    iterator = iter(one)
    taken = [next(iterator) for _ in range(3 * BATCH)]
    state = one.state_dict()
    assert (state["epoch"], state["samples_seen"]) == (0, 3 * BATCH) and "mixture" in state
    ranks = [ResumableSampler(ds, batch_size=BATCH, num_replicas=3, rank=r) for r in range(3)]
    for sampler in ranks:
        sampler.load_state_dict(state)
    rest = [list(sampler) for sampler in ranks]
    assert len({len(part) for part in rest}) == 1
    positions = taken + [p for step in zip(*rest, strict=True) for p in step]
    assert positions[:LENGTH] == list(range(LENGTH)), "the mixture's positions, in turn"
    assert all(index.epoch == 0 for part in rest for index in part)
    following = [list(sampler) for sampler in ranks]
    assert [p for step in zip(*following, strict=True) for p in step][:LENGTH] == list(range(LENGTH))
    assert all(index.epoch == 1 for part in following for index in part)


@pytest.mark.distributed
def test_a_mixture_resumes_in_new_processes_at_other_world_sizes(packs, tmp_path):
    """Real processes: 1 rank (2 workers) stops after 3 batches, 2 torchrun ranks finish the epoch; 2 ranks stop
    after 2 batches, 1 rank finishes it. Every drawn position is read exactly once (the draw is the uninterrupted
    run's), and the next epoch is the uninterrupted one's."""
    base = {"open": {}, "mix": {"paths": [str(packs["lmdb"]), str(packs["wds"])], "weights": [1, 1], "seed": SEED,
                                "samples_per_epoch": LENGTH},
            "loader": {"batch_size": BATCH, "num_workers": 2, "timeout": 120}}
    whole = dict(base, epochs=2, state_in=None, stop=None, state_out=None, out=str(tmp_path / "whole.out"))
    seg = {}
    for name, stop in (("1to2", 3), ("2to1", 2)):
        seg[name] = [dict(base, epochs=1, state_in=None, stop={"after_batches": stop},
                          state_out=str(tmp_path / f"{name}.state"), out=str(tmp_path / f"{name}.0.{{rank}}.out")),
                     dict(base, epochs=2, state_in=str(tmp_path / f"{name}.state"), stop=None, state_out=None,
                          out=str(tmp_path / f"{name}.1.{{rank}}.out"))]
    launch([whole, seg["1to2"][0]], tmp_path, "plain0")
    launch([seg["1to2"][1], seg["2to1"][0]], tmp_path, "ranks", ranks=2)
    launch([seg["2to1"][1]], tmp_path, "plain1")
    uninterrupted = read_out(whole["out"])["batches"]
    epoch = [[tuple(i) for b in uninterrupted if b[0] == e for i in b[3]] for e in (0, 1)]
    drawn = mixture(packs)
    assert epoch[0] == [drawn.locate(p, 0) for p in range(LENGTH)]
    for name, (before_ranks, after_ranks) in {"1to2": (1, 2), "2to1": (2, 1)}.items():
        first, second = seg[name]
        before = [[tuple(i) for b in read_out(first["out"], r)["batches"] for i in b[3]] for r in range(before_ranks)]
        after = [[tuple(i) for b in read_out(second["out"], r)["batches"] if b[0] == 0 for i in b[3]]
                 for r in range(after_ranks)]
        assert sorted(sum(before, []) + sum(after, [])) == sorted(epoch[0]), f"{name}: the epoch's draw, once"
        following = [[tuple(i) for b in read_out(second["out"], r)["batches"] if b[0] == 1 for i in b[3]]
                     for r in range(after_ranks)]
        assert [p for step in zip(*following, strict=False) for p in step] == epoch[1][:len(sum(following, []))]
        assert all(read_out(second["out"], r)["states_equal"] for r in range(after_ranks))


# -- packer.stream over several datasets ---------------------------------------------------------------------------

def stream_table(packs, names) -> dict[str, tuple[int, int, str]]:
    table = {}
    for k, name in enumerate(names):
        ds = packer.open_dataset(packs[name])
        for i in range(len(ds)):
            image, label = ds[i]
            table[pixel_digest(image)] = (k, i, ds.classes[label])
    return table


def stream_mixture(packs, workers: int = 0, **options):
    return packer.stream([packs["wds"], packs["wds2"]], BATCH, num_workers=workers, seed=SEED, weights=[1, 3],
                         samples_per_epoch=LENGTH, buffer=8, **options)


def stream_reads(loader, table, stop: int | None = None) -> list[list[tuple]]:
    out = []
    for images, labels, sources in loader:
        batch = []
        for image, label, source in zip(images, labels.tolist(), sources.tolist(), strict=True):
            k, index, name = table[pixel_digest(image)]
            assert k == source and loader.classes[label] == name, "the source and the class name"
            batch.append((k, index))
        out.append(batch)
        if len(out) == stop:
            break
    return out


def test_a_stream_mixture_draws_its_counts_each_round_whole_and_resumes_at_the_batch(packs):
    table = stream_table(packs, ["wds", "wds2"])
    counts = apportion([1, 3], LENGTH)
    reference = stream_mixture(packs)
    assert reference.names == [str(packs["wds"]), str(packs["wds2"])]
    assert reference.classes == ["beta", "zeta", "alpha", "gamma"]
    epochs = [stream_reads(reference, table) for _ in range(2)]
    for batches in epochs:
        reads = [r for batch in batches for r in batch]
        assert np.bincount([k for k, _ in reads], minlength=2).tolist() == counts
        for k, size in ((0, 7), (1, 20)):
            mine = [i for source, i in reads if source == k]
            rounds = [mine[r:r + size] for r in range(0, len(mine), size)]
            assert all(len(set(r)) == len(r) for r in rounds), "none twice within a round"
            assert all(sorted(r) == list(range(size)) for r in rounds[:-1]), "whole rounds"
    assert epochs[0] != epochs[1]
    nb = math.ceil(LENGTH / BATCH)
    for workers, other in ((0, 2), (2, 0)):
        assert stream_reads(stream_mixture(packs, workers), table) == epochs[0]
        for stop in (1, nb // 2, nb - 1, nb):
            seen = stop_and_resume(lambda w=workers: stream_mixture(packs, w),
                                   lambda loader, stop=None: stream_reads(loader, table, stop), stop, nb,
                                   lambda o=other: stream_mixture(packs, o))
            assert seen == epochs[0] + epochs[1], (workers, stop)


def test_a_stream_mixture_at_another_world_size_takes_the_same_steps(packs):
    table = stream_table(packs, ["wds", "wds2"])
    order = [r for batch in stream_reads(stream_mixture(packs), table) for r in batch]
    parts = []
    for rank in range(2):
        loader = stream_mixture(packs)
        loader.rank, loader.world = rank, 2
        parts.append(stream_reads(loader, table))
    assert len(parts[0]) == len(parts[1])
    for k in range(len(parts[0])):
        step = sorted(parts[0][k] + parts[1][k])
        assert step == sorted(order[k * 2 * BATCH:(k + 1) * 2 * BATCH])


def test_a_stream_mixture_refuses_what_it_cannot_do_in_one_line(packs):
    one_line_value_error(lambda: stream_mixture(packs, shuffle=False), "shuffle")
    one_line_value_error(lambda: packer.stream(packs["wds"], BATCH, weights=[1]), "list")
    state = stream_mixture(packs).state_dict()
    other = packer.stream([packs["wds"], packs["wds2"]], BATCH, seed=SEED, weights=[1, 1], samples_per_epoch=LENGTH,
                          buffer=8)
    one_line_value_error(lambda: other.load_state_dict(state), "mixture=")
    with pytest.raises(packer.PackerError, match="lmdb dataset has none"):
        packer.stream([packs["wds"], packs["lmdb"]], BATCH)


def test_a_stream_mixture_of_datasets_with_fields_gives_their_fields_and_the_source(tmp_path):
    values = [write_dataset(tmp_path / "x", "wds", SCHEMA), write_dataset(tmp_path / "y", "wds", SCHEMA, count=5)]
    loader = packer.stream([tmp_path / "x", tmp_path / "y"], 4, num_workers=0, weights=[1, 1], samples_per_epoch=16)
    sources = []
    for batch in loader:
        assert list(batch) == [f.name for f in SCHEMA] + ["source"]
        for j, k in enumerate(batch["source"].tolist()):
            i = int(batch["caption"][j].split()[4])
            assert np.array_equal(batch["mask"][j].numpy(), values[k][i]["mask"])
            assert batch["label"][j] == values[k][i]["label"]
            assert batch["tags"][j].tolist() == values[k][i]["tags"].tolist()
            sources.append(k)
    assert np.bincount(sources).tolist() == [8, 8]
    narrowed = packer.stream([tmp_path / "x", tmp_path / "y"], 4, num_workers=0, fields=("source", "caption"))
    got_sources, captions = next(iter(narrowed))
    assert got_sources.shape == (4,) and all(isinstance(c, str) for c in captions)

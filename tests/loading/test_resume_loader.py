"""Exact mid-epoch resume: ``make_loader``'s ``state_dict``/``load_state_dict``.

Every resume happens in a new process (``resume_worker.py``): the stream that stops and resumes must be, batch
by batch (pixels and labels), the stream of an uninterrupted run over 3 epochs. The cases run in a few process
launches shared by all tests: launch k runs segment k of every case. Elastic resumes run under real torchrun.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import noise_folder
from support.packed import FORMATS, stop_and_resume
from support.processes import launch, read_out, stream_of

import packer
from packer.loading.loader import collate
from packer.loading.sampler import ResumableSampler

WORKER = Path(__file__).resolve().parents[1] / "workers" / "resume_worker.py"
COUNT, BATCH, EPOCHS, SEED = 30, 4, 3, 3
AUGMENT = {"random_resized_crop": 8, "flip": True}
MODES = ("threads", "workers")
# with augmentation, the cases that resume inside an epoch or across its end suffice (the others only move the
# stop point, and the test time)
AUGMENT_SKIPS = ("batch 1", "last batch")
LIVENESS = 120  # DataLoader timeout: a hung worker fails the test instead of hanging the session


def epoch_batches(drop_last: bool) -> int:
    return COUNT // BATCH if drop_last else math.ceil(COUNT / BATCH)


def scenarios(drop_last: bool) -> dict[str, list[dict | None]]:
    """Where each case stops: one stop per segment but the last (None: run to the end). drop_last changes the
    epoch's end, so only the cases that stop there or cross it run both ways."""
    nb = epoch_batches(drop_last)
    early = {} if drop_last else {"batch 1": [{"after_batches": 1}, None], "mid-epoch": [{"after_batches": 3}, None]}
    return {
        "uninterrupted": [None],
        **early,
        "last batch": [{"after_batches": nb}, None],  # state taken in the loop, right after the epoch's last batch
        "epoch end": [{"after_epochs": 1}, None],  # state taken after the loop over epoch 0 ended
        # twice in epoch 0 (after 3, then 6 batches), then mid epoch 1
        "twice in epoch 0, then in epoch 1": [{"after_batches": 3}, {"after_batches": 3}, {"after_batches": nb}, None],
    }



@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """30 distinct 16x16 RGB images in 3 classes, packed raw in every format."""
    root = tmp_path_factory.mktemp("resume")
    noise_folder(root / "src", COUNT, 16, "png")
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        packer.pack(root / "src", out[fmt], fmt, store="raw", progress=False, workers=1)
    return out


def augmentation_supported(path: Path) -> bool:
    try:
        packer.open_dataset(path, **AUGMENT)
    except TypeError:  # the datasets do not take these keywords yet
        return False
    return True


def configs(augment: bool) -> list[tuple[str, str, bool, bool]]:
    """(format, mode, augment, drop_last). Augmentation draws from (seed, epoch, index) whatever drop_last is,
    so it runs with drop_last off only."""
    return [(fmt, mode, augment, drop_last) for fmt in FORMATS for mode in MODES
            for drop_last in ((False,) if augment else (False, True))]


def loader_kwargs(mode: str, drop_last: bool) -> dict:
    kwargs = {"batch_size": BATCH, "shuffle": True, "seed": SEED, "drop_last": drop_last}
    if mode == "workers":  # packer's worker pool
        kwargs.update(num_workers=2, timeout=LIVENESS)
    else:  # the in-process loader (the default on 2+ cores is the pool)
        kwargs.update(num_workers=0)
    return kwargs


@pytest.fixture(scope="module")
def runs(packs, tmp_path_factory):
    """Run every case, segment by segment, each segment in a new process; also the elastic torchrun cases.
    Returns ``{config: {scenario: [out of each segment]}}`` and the elastic outputs."""
    tmp = tmp_path_factory.mktemp("runs")
    augment = augmentation_supported(packs["lmdb"])
    cases = {}
    for config in [*configs(False), *(configs(True) if augment else [])]:
        fmt, mode, aug, drop_last = config
        for name, stops in scenarios(drop_last).items():
            if aug and name in AUGMENT_SKIPS:
                continue
            tag = "-".join(map(str, (fmt, mode, aug, drop_last, name.replace(" ", "_"))))
            segments = []
            for k, stop in enumerate(stops):
                segments.append({"path": str(packs[fmt]), "open": AUGMENT if aug else {},
                                 "loader": loader_kwargs(mode, drop_last), "epochs": EPOCHS,
                                 "state_in": str(tmp / f"{tag}.{k - 1}.state") if k else None, "stop": stop,
                                 "state_out": str(tmp / f"{tag}.{k}.state"), "out": str(tmp / f"{tag}.{k}.out")})
            cases.setdefault(config, {})[name] = segments
    # elastic: 2 ranks stop mid-epoch, 1 rank resumes; 1 rank stops mid-epoch, 2 ranks resume (then epoch 1)
    plain = {"path": str(packs["lmdb"]), "open": {}, "loader": loader_kwargs("threads", False), "epochs": 1}
    elastic = {
        "2to1": [dict(plain, state_in=None, stop={"after_batches": 2}, state_out=str(tmp / "2to1.0.state"),
                      out=str(tmp / "2to1.0.{rank}.out")),
                 dict(plain, epochs=2, state_in=str(tmp / "2to1.0.state"), stop=None, state_out=None,
                      out=str(tmp / "2to1.1.{rank}.out"))],
        "1to2": [dict(plain, state_in=None, stop={"after_batches": 3}, state_out=str(tmp / "1to2.0.state"),
                      out=str(tmp / "1to2.0.{rank}.out")),
                 dict(plain, epochs=2, state_in=str(tmp / "1to2.0.state"), stop=None, state_out=None,
                      out=str(tmp / "1to2.1.{rank}.out"))],
    }

    def segment(k: int) -> list[dict]:
        return [segs[k] for by_name in cases.values() for segs in by_name.values() if len(segs) > k]

    launch([*segment(0), elastic["1to2"][0]], tmp, "launch0")
    launch([elastic["2to1"][0], elastic["1to2"][1]], tmp, "torchrun", ranks=2)
    launch([*segment(1), elastic["2to1"][1]], tmp, "launch1")
    launch(segment(2), tmp, "launch2")
    launch(segment(3), tmp, "launch3")
    return cases, elastic, augment



@pytest.mark.parametrize("fmt, mode, augment, drop_last", [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-{'rrc+flip' if c[2] else 'plain'}-{'drop-last' if c[3] else 'keep-last'}")
    for c in [*configs(False), *configs(True)]])
def test_resumed_stream_equals_uninterrupted(runs, fmt, mode, augment, drop_last):
    cases, _, supported = runs
    if augment and not supported:
        pytest.skip("open_dataset does not take random_resized_crop/flip yet")
    by_name = cases[(fmt, mode, augment, drop_last)]
    whole = stream_of(by_name["uninterrupted"])
    nb = epoch_batches(drop_last)
    assert [b[0] for b in whole] == [e for e in range(EPOCHS) for _ in range(nb)]
    for epoch in range(EPOCHS):
        labels = [label for b in whole[epoch * nb:(epoch + 1) * nb] for label in b[2]]
        assert len(labels) == (nb * BATCH if drop_last else COUNT)
        if not augment:
            indices = [i for b in whole[epoch * nb:(epoch + 1) * nb] for i in b[3]]
            assert len(set(indices)) == len(indices), "no sample twice in an epoch"
    assert whole[:nb] != whole[nb:2 * nb], "each epoch has its own order"
    for name, segments in by_name.items():
        resumed = stream_of(segments)
        assert [b[0] for b in resumed] == [b[0] for b in whole], f"{name}: batches in other epochs"
        assert resumed == whole, f"{name}: the resumed stream differs from the uninterrupted one"
        for seg in segments:
            out = read_out(seg["out"])
            assert len(json.dumps(out["state"])) < 4096
            first_epoch = [b for b in out["batches"] if b[0] == (out["batches"] or [[None]])[0][0]]
            if out["lengths"] and seg["stop"] is None:
                assert out["lengths"][0] == len(first_epoch), f"{name}: len(loader) of the resumed epoch"


def indices_by_rank(path: str, ranks: int, epoch: int) -> list[list[int]]:
    return [[i for b in read_out(path, r)["batches"] if b[0] == epoch for i in b[3]] for r in range(ranks)]


def interleave(per_rank: list[list[int]]) -> list[int]:
    """The global order the ranks' batches came from: rank r took positions r, r + world, ..."""
    out = [None] * sum(len(p) for p in per_rank)
    for r, part in enumerate(per_rank):
        out[r::len(per_rank)] = part
    return out


def test_two_ranks_stop_mid_epoch_one_rank_finishes_it(runs):
    cases, elastic, _ = runs
    first, second = elastic["2to1"]
    assert all(read_out(first["out"], r)["states_equal"] for r in range(2)), "every rank saves the same state"
    states = [read_out(first["out"], r)["state"] for r in range(2)]
    assert states[0] == states[1] and states[0]["samples_seen"] == 2 * 2 * BATCH and states[0]["world_size"] == 2
    before = indices_by_rank(first["out"], 2, 0)
    assert [len(p) for p in before] == [2 * BATCH, 2 * BATCH]
    after = indices_by_rank(second["out"], 1, 0)[0]
    assert sorted(before[0] + before[1] + after) == list(range(COUNT)), "every sample of the epoch exactly once"
    # the epoch after it is an ordinary 1-rank epoch: the uninterrupted run's epoch 1
    whole = stream_of(cases[("lmdb", "threads", False, False)]["uninterrupted"])
    assert indices_by_rank(second["out"], 1, 1)[0] == [i for b in whole if b[0] == 1 for i in b[3]]


def test_one_rank_stops_mid_epoch_two_ranks_finish_it(runs):
    cases, elastic, _ = runs
    first, second = elastic["1to2"]
    before = indices_by_rank(first["out"], 1, 0)[0]
    assert len(before) == 3 * BATCH
    after = indices_by_rank(second["out"], 2, 0)
    assert len(after[0]) == len(after[1]), "the padding rule: both ranks get as many samples"
    assert [len(read_out(second["out"], r)["lengths"]) for r in range(2)] == [2, 2]
    assert sorted(before + after[0] + after[1]) == list(range(COUNT)), "every sample of the epoch exactly once"
    whole = stream_of(cases[("lmdb", "threads", False, False)]["uninterrupted"])
    assert before + interleave(after) == [i for b in whole if b[0] == 0 for i in b[3]], "the same global order"
    # epoch 1 is an ordinary 2-rank epoch: the same global permutation, dealt to the ranks in turn
    assert interleave(indices_by_rank(second["out"], 2, 1)) == [i for b in whole if b[0] == 1 for i in b[3]]
    assert all(read_out(second["out"], r)["states_equal"] for r in range(2))


def test_padding_after_an_elastic_resume():
    """1 rank took 12 of 30 samples; 4 ranks share the other 18 (5 each, 2 repeated), then whole 4-rank epochs."""
    one = ResumableSampler(COUNT, batch_size=BATCH, seed=SEED)
    iterator = iter(one)
    taken = [next(iterator) for _ in range(12)]
    state = one.state_dict()  # the sampler's own state: after the samples it yielded
    assert (state["epoch"], state["samples_seen"], state["world_size"]) == (0, 12, 1)
    ranks = [ResumableSampler(COUNT, batch_size=BATCH, seed=SEED, num_replicas=4, rank=r) for r in range(4)]
    for sampler in ranks:
        sampler.load_state_dict(state)
    rest = [list(sampler) for sampler in ranks]
    assert [len(part) for part in rest] == [5] * 4
    seen = taken + [i for part in rest for i in part]
    assert sorted(set(seen)) == list(range(COUNT)) and len(seen) - COUNT == 2
    assert all(index.epoch == 0 for part in rest for index in part)
    following = [list(sampler) for sampler in ranks]
    assert [len(part) for part in following] == [8] * 4 and all(i.epoch == 1 for p in following for i in p)


# -- state checks -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, key", [({"batch_size": 5}, "batch_size"), ({"seed": 4}, "seed"),
                                         ({"shuffle": False}, "shuffle"), ({"drop_last": True}, "drop_last")])
def test_state_from_other_settings_is_a_one_line_error(packs, change, key):
    ds = packer.open_dataset(packs["hdf5"])
    state = packer.make_loader(ds, batch_size=BATCH, seed=SEED).state_dict()
    other = packer.make_loader(ds, **dict({"batch_size": BATCH, "seed": SEED}, **change))
    with pytest.raises(ValueError) as info:
        other.load_state_dict(state)
    message = str(info.value)
    assert "\n" not in message and f"{key}=" in message


def test_state_from_another_dataset_length_is_a_one_line_error(packs):
    ds = packer.open_dataset(packs["wds"])
    state = packer.make_loader(torch.utils.data.Subset(ds, range(20)), batch_size=BATCH).state_dict()
    with pytest.raises(ValueError, match=r"^the loader state was saved with dataset_length=20, this loader has "
                                         r"dataset_length=30; resume with the same dataset_length$"):
        packer.make_loader(ds, batch_size=BATCH).load_state_dict(state)


def test_state_is_small_json_the_same_whenever_taken_between_batches(packs):
    ds = packer.open_dataset(packs["lmdb"])
    loader = packer.make_loader(ds, batch_size=BATCH, seed=SEED)
    assert loader.state_dict()["samples_seen"] == 0
    for step, _ in enumerate(loader, 1):
        state = loader.state_dict()
        assert json.loads(json.dumps(state)) == state and len(json.dumps(state)) < 4096
        if step < epoch_batches(False):
            assert (state["epoch"], state["samples_seen"]) == (0, step * BATCH)
    assert (state["epoch"], state["samples_seen"]) == (1, 0), "after the last batch: the next epoch's start"


def test_set_epoch_wins_and_keeps_a_loaded_position_only_for_its_epoch(packs):
    ds = packer.open_dataset(packs["lmdb"])
    loader = packer.make_loader(ds, batch_size=BATCH, seed=SEED)
    epochs = [[labels.tolist() for _, labels in loader] for _ in range(3)]
    loader.set_epoch(1)
    assert [labels.tolist() for _, labels in loader] == epochs[1]
    state = dict(loader.state_dict(), epoch=2, samples_seen=8)
    loader.load_state_dict(state)
    loader.set_epoch(2)
    assert [labels.tolist() for _, labels in loader] == epochs[2][2:]
    loader.load_state_dict(state)
    loader.set_epoch(0)
    assert [labels.tolist() for _, labels in loader] == epochs[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_len_of_a_resumed_pass_is_its_batches_throughout(packs, workers):
    ds = packer.open_dataset(packs["hdf5"])
    loader = packer.make_loader(ds, batch_size=BATCH, seed=SEED, num_workers=workers)
    loader.load_state_dict(dict(loader.state_dict(), samples_seen=3 * BATCH))
    lengths = [len(loader)]
    for _ in loader:
        lengths.append(len(loader))
    assert lengths[:-1] == [epoch_batches(False) - 3] * (epoch_batches(False) - 3)
    assert lengths[-1] == epoch_batches(False), "then whole epochs"


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iteration_that_handed_out_no_batch_never_started(packs, workers):
    """``iter(loader)`` twice, then the batches: the same epoch 0 as one ``iter`` (the first iterator's prefetch
    thread had already taken that pass from the sampler), its state epoch 0, and epoch 1 next."""
    ds = packer.open_dataset(packs["lmdb"])

    def epochs(iterations: int) -> tuple[list, dict, list]:
        loader = packer.make_loader(ds, batch_size=BATCH, seed=SEED, num_workers=workers)
        for _ in range(iterations):
            iterator = iter(loader)
        first = [next(iterator)[1].tolist()]
        state = loader.state_dict()
        first += [labels.tolist() for _, labels in iterator]
        return first, state, [labels.tolist() for _, labels in loader]

    once, twice = epochs(1), epochs(2)
    assert twice == once
    assert (twice[1]["epoch"], twice[1]["samples_seen"]) == (0, BATCH) and twice[0] != twice[2]


def test_loader_with_its_own_sampler_says_it_keeps_no_position(packs):
    ds = packer.open_dataset(packs["lmdb"])
    loader = packer.make_loader(ds, batch_size=BATCH, sampler=torch.utils.data.SequentialSampler(ds))
    with pytest.raises(ValueError, match="keeps no position; use make_loader without sampler="):
        loader.state_dict()


def labels_of(loader, stop: int | None = None) -> list[list[int]]:
    """The labels of each batch of one pass over ``loader``, stopping after ``stop`` batches."""
    out = []
    for _, labels in loader:
        out.append(labels.tolist())
        if len(out) == stop:
            break
    return out


# -- torchdata's StatefulDataLoader -------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch >= 2.10
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(packs, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        ds = packer.open_dataset(packs["wds"])
        sampler = ResumableSampler(ds, batch_size=BATCH, shuffle=True, seed=SEED)
        return StatefulDataLoader(ds, sampler=sampler, batch_size=BATCH, num_workers=workers,
                                  collate_fn=collate, persistent_workers=workers > 0)

    reference = make()
    whole = [batch for _ in range(EPOCHS) for batch in labels_of(reference)]
    nb = epoch_batches(False)
    for stop in (3, nb):  # mid-epoch; right after the last batch of epoch 0
        first = make()
        seen = labels_of(first, stop)
        state = first.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        for _ in range(EPOCHS - stop // nb):  # the rest of epoch 0 (if any), then whole epochs
            seen += labels_of(resumed)
        assert seen == whole, f"stopped after {stop} batches"


# -- packer.stream ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_stream_resumes_at_the_batch(packs, workers):
    def make():
        return packer.stream(packs["wds"], BATCH, num_workers=workers, seed=SEED)

    reference = make()
    whole = [labels_of(reference) for _ in range(2)]
    assert sorted(sum(whole[0], [])) == sorted(sum(whole[1], [])) and whole[0] != whole[1]
    nb = len(whole[0])
    for stop in (1, nb // 2, nb - 1, nb):
        assert stop_and_resume(make, labels_of, stop, nb) == whole[0] + whole[1], f"stopped after {stop} batches"
    first = make()  # another number of workers resumes exactly: the order does not depend on it
    seen = labels_of(first, nb // 2)
    other = packer.stream(packs["wds"], BATCH, num_workers=3 - workers, seed=SEED)
    other.load_state_dict(first.state_dict())
    assert seen + labels_of(other) == whole[0]

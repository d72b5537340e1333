"""``make_loader(ds, shuffle="blocks")``: a block-aware order over real LMDB, HDF5 and WebDataset packs.

Each format cuts its samples into blocks (a shard; a byte range of the LMDB or HDF5 file, checked here against
the sizes py-lmdb and h5py read); every epoch visits every sample once, in an order fixed by ``(seed, epoch)``
that keeps the samples of ``block_window`` blocks together; resumes are exact at the same and at another world
size (``resume_worker.py`` processes, one real 2-rank torchrun launch).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
import torch
from conftest import write_image
from support.packed import FORMATS
from support.processes import launch, read_out, stream_of

import packer
from packer.bench.shuffle_quality import batch_mixing, sampler_labels
from packer.errors import CorruptDataError, PackerError
from packer.formats.hdf5 import Hdf5Reader
from packer.formats.layout import Layout
from packer.formats.lmdb import LmdbReader
from packer.formats.wds import WdsReader
from packer.loading.block_order import block_order
from packer.loading.sampler import ResumableSampler

CLASSES, PER_CLASS = 4, 12
COUNT = CLASSES * PER_CLASS  # 48 samples of 8x8 raw pixels (192 bytes), packed in class order
SHARD = 6  # wds: samples per shard, so 8 equal blocks
BLOCK_BYTES = 1200  # LMDB and HDF5: about 6 samples a block
BATCH, WINDOW, SEED = 4, 2, 5


def digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """48 distinct images in 4 classes, packed raw in class order in every format (wds: shards of 6), and a
    dataset of two parts (two LMDB packs under one manifest, as a 2-rank conversion leaves them)."""
    root = tmp_path_factory.mktemp("blocks")
    for c in range(CLASSES):
        for i in range(PER_CLASS):
            write_image(root / "src" / f"c{c}" / f"{i:03d}.png", 8, 8, seed=100 * c + i)
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        packer.pack(root / "src", out[fmt], fmt, store="raw", shuffle=False, workers=1, progress=False,
                    **({"shard_samples": SHARD} if fmt == "wds" else {}))
    out["parted"] = parted = root / "parted"
    manifest = json.loads((out["lmdb"] / "manifest.json").read_text())
    files = []
    for r in range(2):
        shutil.copytree(out["lmdb"], parted / f"part-{r:05d}")
        (parted / f"part-{r:05d}" / "manifest.json").unlink()
        files += [{**e, "path": f"part-{r:05d}/{e['path']}"} for e in manifest["files"]]
    parts = [{"path": f"part-{r:05d}", "count": COUNT, "range": [r * COUNT, (r + 1) * COUNT]} for r in range(2)]
    (parted / "manifest.json").write_text(json.dumps({**manifest, "count": 2 * COUNT, "files": files,
                                                      "parts": parts}))
    return out


def table_of(ds) -> dict[str, int]:
    """Each sample's index, by its pixels."""
    table = {digest(ds[i][0]): i for i in range(len(ds))}
    assert len(table) == len(ds), "the test images are distinct"
    return table


def epoch_indices(loader, table: dict[str, int]) -> list[int]:
    return [table[digest(image)] for images, _ in loader for image in images]


def block_of(starts: np.ndarray, indices) -> np.ndarray:
    return np.searchsorted(starts, np.asarray(indices), side="right") - 1


def most_open_blocks(blocks: np.ndarray) -> int:
    """The most blocks begun and not yet finished at any point of an order: what must be at hand at once."""
    first = {b: p for p, b in reversed(list(enumerate(blocks.tolist())))}
    last = {b: p for p, b in enumerate(blocks.tolist())}
    return max(sum(first[b] <= p <= last[b] for b in first) for p in range(len(blocks)))


def stored_sizes(fmt: str, root: Path, tmp: Path) -> np.ndarray:
    """Each sample's stored bytes, read with py-lmdb (from a copy: py-lmdb opens a file once a process, and
    packer's reader has it) or h5py."""
    if fmt == "lmdb":
        env = lmdb.open(str(shutil.copytree(root, tmp / "lmdb")), readonly=True, lock=False)
        with env.begin() as txn:
            sizes = [len(v) for _, v in txn.cursor()]
        env.close()
        return np.array(sizes)
    with h5py.File(root / "data.h5", "r") as f:
        if "offsets" in f:
            return np.diff(f["offsets"][:])
        return np.full(len(f["labels"]), f["images"][0].nbytes)


# -- blocks ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_cuts_its_samples_into_blocks(packs, fmt, tmp_path):
    starts = packer.open_dataset(packs[fmt]).blocks(BLOCK_BYTES)
    assert starts.dtype == np.int64 and starts[0] == 0 and np.all(np.diff(starts) > 0) and starts[-1] < COUNT
    if fmt == "wds":  # one block per shard
        assert starts.tolist() == list(range(0, COUNT, SHARD))
        return
    sizes = stored_sizes(fmt, packs[fmt], tmp_path)
    spans = np.add.reduceat(sizes, starts)
    assert np.all(spans[:-1] >= BLOCK_BYTES - sizes.max()) and np.all(spans <= BLOCK_BYTES + sizes.max())


def test_blocks_of_a_parted_dataset_never_straddle_its_parts(packs):
    ds = packer.open_dataset(packs["parted"])
    one = packer.open_dataset(packs["lmdb"]).blocks(BLOCK_BYTES)
    assert COUNT not in one, "the test needs a part boundary inside a block of one part's layout"
    assert ds.blocks(BLOCK_BYTES).tolist() == one.tolist() + (one + COUNT).tolist()
    loader = packer.make_loader(ds, BATCH, shuffle="blocks", seed=SEED, block_window=WINDOW,
                                block_bytes=BLOCK_BYTES, num_workers=0)
    assert sorted(int(i) for i in loader.sampler) == list(range(2 * COUNT))
    labels = sorted(label for _, batch in loader for label in batch.tolist())
    assert labels == sorted(list(range(CLASSES)) * PER_CLASS * 2)


# -- the order ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_sample_once_an_epoch_in_an_order_fixed_by_seed_and_epoch(packs, fmt):
    ds = packer.open_dataset(packs[fmt])
    table = table_of(ds)
    starts = ds.blocks(BLOCK_BYTES)

    def make(dataset=ds, **extra):
        kwargs = {"shuffle": "blocks", "seed": SEED, "block_window": WINDOW, "block_bytes": BLOCK_BYTES,
                  "num_workers": 0}
        return packer.make_loader(dataset, BATCH, **{**kwargs, **extra})

    loader = make()
    epochs = [epoch_indices(loader, table) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(COUNT)), "every sample exactly once"
        assert most_open_blocks(block_of(starts, order)) <= WINDOW, "one window of blocks at a time"
        if fmt == "wds":  # equal blocks: each run of window * block samples stays within window + 1 blocks
            runs = np.array(order).reshape(-1, WINDOW * SHARD)
            assert all(len(set(block_of(starts, run).tolist())) <= WINDOW + 1 for run in runs)
    assert len({tuple(order) for order in epochs}) == 3, "a new order every epoch"
    assert epoch_indices(make(), table) == epochs[0], "the same order for the same seed and epoch"
    assert epoch_indices(make(seed=SEED + 1), table) != epochs[0]
    # packer's worker pool (images of one shape: a read-time crop that keeps all 8x8) reads the same batches
    pool = make(packer.open_dataset(packs[fmt], center_crop=8), num_workers=2, timeout=120)
    assert pool.worker_pool_settings is not None
    assert [epoch_indices(pool, table) for _ in range(2)] == epochs[:2]


def test_the_order_mixes_within_windows_only():
    starts = np.arange(0, 1000, 50)
    for window in (1, 3, 20):
        order, place = block_order(starts, 1000, window, seed=1, epoch=0)
        blocks = block_of(starts, order)
        assert sorted(order.tolist()) == list(range(1000))
        assert most_open_blocks(blocks) == window
        assert np.all(np.diff(place // window) >= 0)
    whole, _ = block_order(starts, 1000, 20, seed=1, epoch=0)
    assert len(set(block_of(starts, whole[:50]).tolist())) > 10, "one window of every block: a full shuffle"


def test_under_ddp_ranks_take_whole_blocks_and_as_many_batches():
    """40 blocks of 50, batches of 10, windows of 4 blocks over 4 ranks: most of each block goes to one rank (a
    quarter of it would, with ranks taking positions in turn)."""
    starts = np.arange(0, 2000, 50)
    ranks = [list(ResumableSampler(2000, batch_size=10, shuffle="blocks", seed=2, num_replicas=4, rank=r,
                                   blocks=starts, window=4)) for r in range(4)]
    assert [len(part) for part in ranks] == [500] * 4
    assert sorted(int(i) for part in ranks for i in part) == list(range(2000))
    counts = np.array([np.bincount(block_of(starts, part), minlength=40) for part in ranks])  # (rank, block)
    assert np.mean(counts.max(axis=0) / 50) > 0.75
    assert np.mean((counts > 0).sum(axis=0)) < 3


@pytest.mark.parametrize("first_world, then_world", [(1, 1), (3, 2), (2, 5), (4, 1)])
def test_a_state_resumes_exactly_at_any_world_size(first_world, then_world):
    """Ranks stop after 3 batches each; the ranks of another world size take exactly the samples left."""
    starts = np.array([0, 7, 20, 26, 40, 51, 63, 70, 88])
    kwargs = {"batch_size": 4, "shuffle": "blocks", "seed": 9, "blocks": starts, "window": 3}
    before, state = [], None
    for r in range(first_world):
        sampler = ResumableSampler(97, num_replicas=first_world, rank=r, **kwargs)
        iterator = iter(sampler)
        before += [int(next(iterator)) for _ in range(12)]
        state = sampler.state_dict()
    assert state["samples_seen"] == 12 * first_world
    after = []
    for r in range(then_world):
        sampler = ResumableSampler(97, num_replicas=then_world, rank=r, **kwargs)
        sampler.load_state_dict(state)
        after.append([int(i) for i in sampler])
    assert len({len(part) for part in after}) == 1, "every rank as many samples"
    seen = before + [i for part in after for i in part]
    assert set(seen) == set(range(97)) and len(after[0]) == -(-(97 - 12 * first_world) // then_world)
    order, _ = block_order(starts, 97, 3, 9, 0)
    assert sorted(before) == sorted(order[:12 * first_world].tolist()), "the taken samples: one global count"


# -- resume in new processes, and under torchrun ----------------------------------------------------------------------

@pytest.mark.distributed
def test_resume_in_new_processes_at_the_same_and_other_world_sizes(packs, tmp_path):
    loader = {"batch_size": BATCH, "shuffle": "blocks", "seed": SEED, "block_window": WINDOW,
              "block_bytes": BLOCK_BYTES, "num_workers": 0}
    job = {"path": str(packs["hdf5"]), "open": {}, "loader": loader}

    def seg(name: str, epochs: int, state_in: str | None, stop: dict | None) -> dict:
        return dict(job, epochs=epochs, state_in=state_in and str(tmp_path / state_in), stop=stop,
                    state_out=str(tmp_path / f"{name}.state"), out=str(tmp_path / f"{name}.{{rank}}.out"))

    whole = seg("whole", 2, None, None)
    one = [seg("one0", 1, None, {"after_batches": 3}), seg("one1", 2, "one0.state", None)]
    one_to_two = seg("1to2", 1, "one0.state", None)
    two_to_one = [seg("2to1.0", 1, None, {"after_batches": 2}), seg("2to1.1", 1, "2to1.0.state", None)]
    launch([whole, one[0]], tmp_path, "plain0")
    launch([two_to_one[0], one_to_two], tmp_path, "torchrun", ranks=2)
    launch([one[1], two_to_one[1]], tmp_path, "plain1")

    reference = stream_of([whole])
    epoch0 = [i for b in reference if b[0] == 0 for i in b[3]]
    assert sorted(epoch0) == list(range(COUNT))
    assert stream_of(one) == reference, "stopped and resumed at one rank: the same batches"

    def indices(name: str, rank: int) -> list[int]:
        return [i for b in read_out(str(tmp_path / f"{name}.{{rank}}.out"), rank)["batches"] for i in b[3]]

    # one rank took 3 batches; two ranks share the rest, as many batches each, whole blocks where they can
    after = [indices("1to2", r) for r in range(2)]
    outs = [read_out(str(tmp_path / "1to2.{rank}.out"), r) for r in range(2)]
    assert outs[0]["lengths"] == outs[1]["lengths"] and len(after[0]) == len(after[1])
    assert outs[0]["states_equal"] and outs[0]["state"]["epoch"] == 1
    assert sorted(indices("one0", 0) + after[0] + after[1]) == list(range(COUNT))
    assert sorted(after[0] + after[1]) == sorted(epoch0[3 * BATCH:])
    starts = packer.open_dataset(packs["hdf5"]).blocks(BLOCK_BYTES)
    shared = set(block_of(starts, after[0]).tolist()) & set(block_of(starts, after[1]).tolist())
    assert len(shared) < len(set(block_of(starts, after[0] + after[1]).tolist())), "not every block on both ranks"
    # two ranks took 2 batches each; one rank takes exactly the rest, in the global order
    before = indices("2to1.0", 0) + indices("2to1.0", 1)
    state = read_out(str(tmp_path / "2to1.0.{rank}.out"), 0)["state"]
    assert state["samples_seen"] == 2 * 2 * BATCH and state["shuffle"] == "blocks"
    assert sorted(before) == sorted(epoch0[:4 * BATCH])
    assert indices("2to1.1", 0) == epoch0[4 * BATCH:]


# -- settings and errors --------------------------------------------------------------------------------------------

def test_a_state_from_another_window_or_order_is_a_one_line_error(packs):
    ds = packer.open_dataset(packs["wds"])
    state = packer.make_loader(ds, BATCH, shuffle="blocks", block_window=2, num_workers=0).state_dict()
    assert json.loads(json.dumps(state)) == state and len(json.dumps(state)) < 1024
    for other, key in (({"shuffle": "blocks", "block_window": 3}, "block_window"), ({"shuffle": True}, "shuffle")):
        with pytest.raises(ValueError) as info:
            packer.make_loader(ds, BATCH, num_workers=0, **other).load_state_dict(state)
        assert "\n" not in str(info.value) and f"{key}=" in str(info.value)


def test_blocks_need_a_dataset_that_has_them(packs):
    subset = torch.utils.data.Subset(packer.open_dataset(packs["lmdb"]), range(10))
    with pytest.raises(PackerError, match=r"^shuffle='blocks' needs a dataset that knows its blocks .*use shuffle="):
        packer.make_loader(subset, BATCH, shuffle="blocks")
    with pytest.raises(ValueError, match="shuffle must be True, False or 'blocks'"):
        packer.make_loader(packer.open_dataset(packs["lmdb"]), BATCH, shuffle="block")


# -- shuffle quality --------------------------------------------------------------------------------------------------

def test_label_mixing_hand_cases():
    assert batch_mixing([0, 1, 0, 1], 2) == 0.0
    assert batch_mixing([0, 0, 1, 1], 2) == 0.5
    assert batch_mixing([0, 0, 1, 1, 2, 2], 3) == pytest.approx(1 / 3)
    assert batch_mixing([0, 1, 0, 1, 1], 2) == pytest.approx(0.1)  # the partial last batch is left out
    with pytest.raises(ValueError, match="no labels to score"):
        batch_mixing([], 2)


def test_wider_windows_mix_better_and_a_full_shuffle_best():
    """10 classes of 500 in class order, blocks of 50 (one class each), batches of 64."""
    labels, blocks = np.repeat(np.arange(10), 500), np.arange(0, 5000, 50)
    stored = batch_mixing(labels, 64)
    shuffled = batch_mixing(sampler_labels(labels, 64, True, 0), 64)
    windows = [batch_mixing(sampler_labels(labels, 64, "blocks", 0, blocks=blocks, window=w), 64) for w in (1, 4, 16)]
    assert stored > 0.85
    assert windows[0] > 0.7 and windows[0] > windows[1] > windows[2] > shuffled
    assert shuffled < 0.25


def test_order_labels_are_the_loaders(packs):
    ds = packer.open_dataset(packs["wds"])
    labels = [ds.raw_sample(i)[1] for i in range(len(ds))]
    loader = packer.make_loader(ds, BATCH, shuffle="blocks", seed=SEED, block_window=WINDOW, num_workers=0)
    read = [label for _, batch in loader for label in batch.tolist()]
    assert sampler_labels(labels, BATCH, "blocks", SEED, blocks=ds.blocks(), window=WINDOW).tolist() == read


def test_drop_last_gives_every_rank_whole_batches_of_distinct_samples():
    starts = np.array([0, 7, 20, 26, 40, 51, 63, 70, 88])
    ranks = [[int(i) for i in ResumableSampler(97, batch_size=4, shuffle="blocks", seed=1, drop_last=True,
                                               num_replicas=3, rank=r, blocks=starts, window=2)] for r in range(3)]
    assert [len(part) for part in ranks] == [32] * 3
    seen = [i for part in ranks for i in part]
    assert len(set(seen)) == len(seen) == 96


def test_an_image_folder_is_one_block_a_file(packs):
    folder = packer.FolderDataset(packs["lmdb"].parent / "src")
    assert folder.blocks().tolist() == list(range(COUNT))
    loader = packer.make_loader(folder, BATCH, shuffle="blocks", num_workers=0)
    assert sorted(int(i) for i in loader.sampler) == list(range(COUNT))


@pytest.mark.parametrize("reader_class, file, index", [
    (LmdbReader, "data.mdb", {}),
    (Hdf5Reader, "data.h5", {}),
    (WdsReader, "part-1/shard-000003.tar", {"crc32": np.zeros(3, np.uint32), "size": np.full(3, 10),
                                              "label": np.zeros(3, np.int64), "shape": np.ones((3, 3), np.int64)}),
])
def test_a_ranged_hook_names_the_damaged_sample_once_from_the_datasets_url(reader_class, file, index):
    """Every format's ``ranged_sample`` takes the dataset's URL (or folder) and names the sample from it, its file
    and its index, once: the blocked reader passes the URL, not a sample's name."""
    layout = Layout((file,), np.zeros(3, np.int32), np.array([0, 10, 20]), np.array([10, 20, 30]), index)
    with pytest.raises(CorruptDataError) as exc:
        reader_class.ranged_sample(1, memoryview(b"abc"), layout, "s3://bucket/ds/")
    text = str(exc.value)
    assert text.startswith(f"s3://bucket/ds/{file} sample 1:") and text.count("sample 1") == 1, text

"""A local dataset read a block at a time within a page-cache budget (``open_dataset(FOLDER, page_budget=...)``):
real packed files in every format, read for two epochs through real DataLoader worker processes with the budget
at 1/8 of the data, in this process and under a real 2-rank torchrun (tests/blocked_worker.py).

Each epoch gives every sample exactly once, with the pixels and label of the mapped reader's sample; the data
files' pages in the page cache (``mincore``, sampled on a thread while the epoch runs, after the files were
dropped from it) stay within the budget and one block per worker; a state saved mid-epoch resumes exactly; the
layout is cached in the cache folder, never in the dataset's; bad budgets and damaged files are one line, naming
the file, in a local folder's words (not a URL's).
"""

from __future__ import annotations

import collections
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import noise_folder
from support.packed import FORMATS, Poll, free_port, manifest_bytes, pixel_digest, pixel_table, seen_indices

import packer
from packer.bench.cache import EVICTED_BELOW, evict, release_handles, resident_bytes, resident_fraction
from packer.errors import CorruptDataError, UsageError
from packer.formats.local_blocks import LocalBlocks

COUNT, SIDE = 480, 64  # 64x64 raw noise images: 12 KiB of pixels each, blocks of many pages
BATCH, WORKERS = 16, 2
# one torchrun rank (test_blocked_remote's, too)
WORKER = Path(__file__).resolve().parents[1] / "workers" / "blocked_worker.py"
PACK = {"lmdb": {}, "hdf5": {}, "wds": {"shard_samples": 120}}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    """``COUNT`` distinct images in 3 classes, packed raw in every format."""
    root = tmp_path_factory.mktemp("paged")
    noise_folder(root / "src", COUNT, SIDE, "png")
    for fmt in FORMATS:
        packer.pack(root / "src", root / "packs" / fmt, fmt, store="raw", progress=False, workers=1, **PACK[fmt])
    return root / "packs"


@pytest.fixture(scope="module")
def truth(packs) -> dict[str, dict[str, tuple[int, int]]]:
    """Per format: each sample's (index, label) by its pixels, as the mapped reader gives them."""
    found = {fmt: pixel_table(packer.open_dataset(packs / fmt), COUNT) for fmt in FORMATS}
    release_handles()  # nothing of the data files stays mapped: their pages can be dropped
    return found


def data_files(packs: Path, fmt: str) -> list[Path]:
    return [packs / fmt / e["path"] for e in packer.read_manifest(packs / fmt)["files"]]


def data_bytes(packs: Path, fmt: str) -> int:
    return manifest_bytes(packs / fmt)


class ResidencyPoll(Poll):
    """The most bytes of ``files`` in the page cache, sampled with mincore while the block runs."""

    def __init__(self, files: list[Path]):
        super().__init__()
        self.files = files
        self.fetching = False  # whether the loader's fetch-ahead thread was seen running

    def sample(self) -> int:
        self.fetching |= any(t.name == "packer-fetch-ahead" for t in threading.enumerate())
        return sum(resident_bytes(f)[0] for f in self.files)


def fetch_ahead_ended() -> bool:
    """Whether the fetch-ahead thread ended (it looks at the batches every 10 ms, then releases what it holds)."""
    for _ in range(200):
        if not any(t.name == "packer-fetch-ahead" for t in threading.enumerate()):
            return True
        time.sleep(0.01)
    return False


def dropped(files: list[Path]) -> None:
    """Drop ``files`` from the page cache, or skip where this system cannot (or cannot tell)."""
    if resident_fraction(files) is None:
        pytest.skip("mincore cannot tell page-cache residency here")
    if not evict(files):
        pytest.skip("posix_fadvise is unavailable here")
    if resident_fraction(files) > EVICTED_BELOW:
        pytest.skip("this filesystem keeps the files' pages cached (tmpfs?): DONTNEED does not drop them")


def open_paged(packs: Path, fmt: str, tmp_path: Path, **kwargs) -> packer.PackedDataset:
    ds = packer.open_dataset(packs / fmt, page_budget=data_bytes(packs, fmt) // 8, cache_dir=tmp_path / "cache",
                             **kwargs)
    assert type(ds.reader).__name__ == "BlockedReader"
    return ds


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_epochs_through_workers_every_sample_once_within_the_page_budget(fmt, packs, truth, tmp_path, capfd):
    budget = data_bytes(packs, fmt) // 8
    ds = open_paged(packs, fmt, tmp_path)
    said = capfd.readouterr().err
    assert f"over page_budget {budget:,}: reading it a block at a time" in said and "read ahead" in said
    assert len(said.strip().splitlines()) == 1
    block = int((ds.reader.spans[:, 2] - ds.reader.spans[:, 1]).max())
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle=True, seed=3)
    assert "shuffle='blocks'" in capfd.readouterr().err and loader.sampler.shuffle == "blocks"
    files = data_files(packs, fmt)
    orders = []
    for _ in range(2):
        dropped(files)
        with ResidencyPoll(files) as poll:
            orders.append(seen_indices(loader, truth[fmt]))
        assert sorted(orders[-1]) == list(range(COUNT))
        # mincore counts whole pages: each block resident at once may add a partial page at either end
        pages = 2 * mmap.PAGESIZE * (budget // block + WORKERS + 1)
        assert poll.samples > 0 and poll.most <= budget + WORKERS * block + pages, (poll.most, budget, block)
        assert poll.fetching  # the main process advised the next blocks ahead
        assert fetch_ahead_ended()
        # released behind: what is left is within the budget (without release behind the held blocks stay). Not
        # nothing: a read-ahead advised for a block its workers were already done with can land after its release
        left = sum(resident_bytes(f)[0] for f in files)
        assert left <= budget, (left, budget, block)
    assert orders[0] != orders[1]
    in_order = packer.make_loader(ds, batch_size=BATCH, num_workers=0, shuffle=False)
    assert seen_indices(in_order, truth[fmt]) == list(range(COUNT))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_mid_epoch_state_resumes_exactly(fmt, packs, truth, tmp_path):
    def loader_of() -> packer.PrefetchLoader:
        return packer.make_loader(open_paged(packs, fmt, tmp_path), batch_size=BATCH, num_workers=WORKERS,
                                  shuffle="blocks", seed=1)

    uninterrupted = loader_of()
    epochs = [seen_indices(uninterrupted, truth[fmt]) for _ in range(2)]
    loader = loader_of()
    seen_indices(loader, truth[fmt])  # epoch 0, whole
    first, iterator = [], iter(loader)  # epoch 1, interrupted after 7 batches
    for _ in range(7):
        first.append(next(iterator))
    state = loader.state_dict()
    del iterator
    resumed = loader_of()
    resumed.load_state_dict(state)
    assert seen_indices(first, truth[fmt]) + seen_indices(resumed, truth[fmt]) == epochs[1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fmt", FORMATS)
def test_torchrun_two_ranks_read_every_sample_once_an_epoch_within_the_page_budget(fmt, packs, truth, tmp_path):
    ranks = 2
    budget, files = data_bytes(packs, fmt) // 8, data_files(packs, fmt)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), str(packs / fmt), str(tmp_path / "cache"), str(budget),
           str(tmp_path), str(WORKERS)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    dropped(files)
    with ResidencyPoll(files) as poll:  # this process samples the pages while the ranks read
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    for epoch in range(2):
        assert len({len(r["epochs"][epoch]) for r in out}) == 1  # every rank the same number of batches
        pairs = [pair for r in out for batch in r["epochs"][epoch] for pair in batch]
        assert all(truth[fmt][d][1] == label for d, label in pairs)  # pixels and label of the mapped reader's
        assert collections.Counter(truth[fmt][d][0] for d, _ in pairs) == dict.fromkeys(range(COUNT), 1)
    block = max(r["block"] for r in out)
    # one block per worker of each rank beyond the budget, and mincore's whole pages (see the test above)
    pages = 2 * mmap.PAGESIZE * (budget // block + ranks * WORKERS + 1)
    assert 0 < poll.most <= budget + ranks * WORKERS * block + pages, (poll.most, budget, block)


def test_the_layout_is_cached_in_the_cache_folder_never_in_the_dataset(packs, tmp_path):
    before = sorted(p.name for p in (packs / "lmdb").rglob("*"))
    open_paged(packs, "lmdb", tmp_path)
    layouts = list((tmp_path / "cache" / "layouts").glob("layout-*.npz"))
    assert len(layouts) == 1 and sorted(p.name for p in (packs / "lmdb").rglob("*")) == before
    stamp = layouts[0].stat().st_mtime_ns
    open_paged(packs, "lmdb", tmp_path)  # loaded, not computed and written again
    assert layouts[0].stat().st_mtime_ns == stamp


def test_worker_processes_prefetch_one_batch_each_unless_told(packs, tmp_path):
    """The blocks of the batches in flight are held out of the fetch-ahead's: four batches a worker would leave
    it nothing to fetch ahead. A given prefetch_factor wins."""
    ds = open_paged(packs, "wds", tmp_path)
    plan = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS).plan
    assert plan.prefetch == 1 and "read a block at a time" in dict(plan.why)["prefetch"]
    assert packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, prefetch_factor=3).plan.prefetch == 3
    whole = packer.open_dataset(packs / "wds")
    assert packer.make_loader(whole, batch_size=BATCH, num_workers=WORKERS).plan.prefetch > 1


def test_the_pool_says_when_a_batch_has_its_blocks_before_it_comes_back(packs, tmp_path):
    """A worker of packer's pool reads every block of its batch before it decodes it and says so: the fetch-ahead
    lets those blocks go then (mapped_batches), not once the batch comes back; the epoch is whole all the same."""
    ds = open_paged(packs, "lmdb", tmp_path, center_crop=8)  # one shape: packer's pool decodes it
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle="blocks", seed=2)
    assert loader.plan.engine == "pool"
    iterator = iter(loader)
    first = next(iterator)
    pool = loader._worker_pool
    deadline = time.monotonic() + 30
    while pool.mapped_batches() < 2 and time.monotonic() < deadline:  # batch 1 is in its worker
        time.sleep(0.01)
    assert pool.mapped_batches() >= 2 > loader._received.received == 1
    crops = {pixel_digest(ds[i][0]): i for i in range(COUNT)}  # each sample's crop, read without the pool
    seen = [crops[pixel_digest(image)] for images in [first[0], *(images for images, _ in iterator)]
            for image in images]
    assert sorted(seen) == list(range(COUNT))


def test_a_batchs_blocks_stay_open_while_it_is_decoded(packs, tmp_path):
    """map_blocks opens every block of a batch, more than KEEP_BLOCKS too, and reading its samples opens none
    again."""
    reader = open_paged(packs, "hdf5", tmp_path).reader
    indices = [int(start) for start in reader.starts[: reader.keep + 3]]  # one sample from each of 7 blocks
    opened = []
    store_open = reader.store.open
    reader.store.open = lambda *block: opened.append(block) or store_open(*block)
    reader.map_blocks(indices)
    assert len(opened) == len(indices) == len(reader._blocks)
    for index in reversed(indices):
        reader.read(index)
    assert len(opened) == len(indices)


def test_a_dataset_that_fits_the_budget_is_mapped_as_without_one(packs, tmp_path):
    ds = packer.open_dataset(packs / "hdf5", page_budget="1GB", cache_dir=tmp_path / "cache")
    assert type(ds.reader).__name__ == "Hdf5Reader" and len(ds) == COUNT


@pytest.mark.parametrize("budget, words", [(0, "not a positive size"), (-5, "not a positive size"),
                                           ("abc", "not a size like"), (True, "page_budget must be"),
                                           (1.5, "page_budget must be")])
def test_a_bad_budget_is_one_line(budget, words, packs):
    with pytest.raises(UsageError) as error:
        packer.open_dataset(packs / "lmdb", page_budget=budget)
    assert words in str(error.value) and "page_budget" in str(error.value) and "\n" not in str(error.value)


def test_a_budget_for_a_url_says_to_use_cache_limit():
    with pytest.raises(UsageError) as error:
        packer.open_dataset("s3://bucket/ds", page_budget="2GB")
    assert "cache_limit" in str(error.value) and "\n" not in str(error.value)


def test_without_fadvise_it_still_reads(packs, truth, tmp_path, monkeypatch):
    """Where posix_fadvise does not exist (macOS), the blocks are read without advice."""
    monkeypatch.delattr(os, "posix_fadvise")
    ds = open_paged(packs, "wds", tmp_path)
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=0, shuffle=True)
    assert sorted(seen_indices(loader, truth["wds"])) == list(range(COUNT))


def test_a_block_is_read_into_memory_and_dropped_and_a_held_one_is_read_ahead_and_kept_until_released(packs, truth):
    path = max(data_files(packs, "hdf5"), key=lambda p: p.stat().st_size)
    files, data, page = [path], path.read_bytes(), os.sysconf("SC_PAGE_SIZE")
    start, end = 10 * page + 100, 40 * page + 7
    dropped(files)
    store = LocalBlocks(packs / "hdf5")
    block = store.open(path.name, start, end)
    assert bytes(block) == data[start:end] and resident_bytes(path)[0] == 0  # in this process, not the cache
    release = store.hold(path.name, start, end)  # returns once the block is in the page cache
    assert end - start <= resident_bytes(path)[0] <= end - start + 2 * page
    assert bytes(store.open(path.name, start, end)) == data[start:end]  # read from the cache, left there for the
    assert resident_bytes(path)[0] >= end - start  # other workers: the thread that read it ahead drops it
    release()
    assert resident_bytes(path)[0] == 0


def test_a_block_larger_than_the_kernel_s_read_ahead_is_held_whole_and_a_release_at_once_leaves_none(tmp_path):
    """The kernel's read-ahead reads at most its window a call and returns before its reads are done; a block
    released as soon as it was held (its batches were already read) kept the pages still being read, past the
    budget."""
    path, page = tmp_path / "data.bin", os.sysconf("SC_PAGE_SIZE")
    path.write_bytes(os.urandom(24 << 20))
    start, end = page + 100, (20 << 20) + 7
    dropped([path])
    store = LocalBlocks(tmp_path)
    release = store.hold(path.name, start, end)
    assert end - start <= resident_bytes(path)[0] <= end - start + 2 * page  # the whole block, nothing beyond
    release()
    assert resident_bytes(path)[0] == 0
    for _ in range(3):
        store.hold(path.name, start, end)()
        time.sleep(0.02)  # a read still in flight at the release would land by now
        assert resident_bytes(path)[0] == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_bytes_are_one_line_naming_the_folder_and_file(fmt, packs, tmp_path):
    shutil.copytree(packs / fmt, tmp_path / fmt)
    ds = open_paged(tmp_path, fmt, tmp_path)
    layout, index = ds.reader.ranges, 77
    path = tmp_path / fmt / layout.files[int(layout.file[index])]
    data = bytearray(path.read_bytes())
    for at in (int(layout.start[index]) + 1, (int(layout.start[index]) + int(layout.end[index])) // 2):
        data[at] ^= 0xFF  # in its range: the payload's first bytes, and wherever its middle lies
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError) as error:
        ds[index]
    assert f"{tmp_path / fmt}/{layout.files[int(layout.file[index])]} sample {index}" in str(error.value)
    assert "\n" not in str(error.value)
    assert not any(url_word in str(error.value) for url_word in ("fetched", "re-upload", "cache")), error.value
    with pytest.raises(UsageError) as error:
        ds.relpath(index)
    assert "page_budget" in str(error.value) and "\n" not in str(error.value)


def test_a_damaged_local_block_says_to_verify_and_re_pack_naming_the_file(packs, tmp_path):
    """A local folder's messages speak of its files (a URL's, of fetched bytes and the cache)."""
    shutil.copytree(packs / "hdf5", tmp_path / "hdf5")
    ds = open_paged(tmp_path, "hdf5", tmp_path)
    layout, index, folder = ds.reader.ranges, 77, tmp_path / "hdf5"
    path = folder / layout.files[int(layout.file[index])]
    with open(path, "r+b") as f:  # the middle of its pixels: only the checksum can tell
        f.seek((int(layout.start[index]) + int(layout.end[index])) // 2)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    with pytest.raises(CorruptDataError) as error:
        ds[index]
    assert str(error.value) == (f"{path} sample {index}: checksum mismatch, the file's bytes are damaged; run "
                                f"`packer verify {folder}` and re-pack")
    with pytest.raises(CorruptDataError) as in_batch:  # read in a batch (a worker's read_many): the same words
        ds.reader.read_many([0, index, 1])
    assert str(in_batch.value) == str(error.value)
    last = len(ds) - 1  # a file cut short after it was opened: its last block is short
    os.truncate(path, int(layout.end[last]) - 1)
    with pytest.raises(CorruptDataError) as error:
        ds[last]
    said = str(error.value)
    assert said.startswith(f"{path} sample {last}: its block holds") and "\n" not in said
    assert f"the file is shorter than when the dataset was opened; run `packer verify {folder}` and re-pack" in said

"""A dataset converted in parts (a real ``torchrun --nproc_per_node=2 packer pack``), larger than its
``cache_limit`` (a URL, over the suite's Range-capable file server) or its ``page_budget`` (a local folder): read a
block at a time like any other, through real DataLoader worker processes with ``shuffle="blocks"``.

Its layout is its parts' layouts joined: every file named from DEST (``part-00000/...``), blocks never spanning
two files, samples in the local parts reader's order. Each epoch gives every sample exactly once with the label
and pixels of the local parts reader's sample, and the cache stays within its bound while it runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import noise_folder
from support.fields import SCHEMA, write_dataset
from support.packed import FORMATS, manifest_bytes, pixel_digest, pixel_table, seen_indices
from support.processes import torchrun
from support.remote import CachePoll, serving

import packer
from packer.errors import UsageError
from packer.formats import PartedReader, get_format
from packer.formats.layout import Layout, concat_layouts
from packer.remote.cache import Cache

COUNT, SIDE = 480, 16  # 16x16 raw noise images
BATCH, WORKERS = 16, 2
FIELDS_COUNT = 24  # samples a part of the image + fields dataset
OPTIONS = {"lmdb": [], "hdf5": [], "wds": ["--shard-samples", "60"]}  # wds: several shards a part


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    """``COUNT`` distinct images in 3 classes, packed raw in every format by two ranks (one part each)."""
    root = tmp_path_factory.mktemp("parts_blocks")
    noise_folder(root / "src", COUNT, SIDE, "png")
    for fmt in FORMATS:
        result = torchrun("pack", root / "src", root / "packs" / fmt, "--format", fmt, "--store", "raw",
                          "--workers", "1", "--quiet", *OPTIONS[fmt])
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert [p["count"] for p in packer.read_manifest(root / "packs" / fmt)["parts"]] == [COUNT // 2] * 2
    return root / "packs"


@pytest.fixture(scope="module")
def server(packs):
    yield from serving(packs)


@pytest.fixture(scope="module")
def truth(packs) -> dict[str, dict[str, tuple[int, int]]]:
    """Per format: each sample's (index, label) by its pixels, as the local parts reader gives them."""
    found = {}
    for fmt in FORMATS:
        local = packer.open_dataset(packs / fmt)
        assert isinstance(local.reader, PartedReader)
        found[fmt] = pixel_table(local, COUNT)
    return found


def check_layout(ds: packer.PackedDataset) -> None:
    """The joined layout: every file in a part's folder, both parts, each block in one file."""
    reader = ds.reader
    assert type(reader).__name__ == "BlockedReader" and len(ds) == COUNT
    assert {f.split("/")[0] for f in reader.ranges.files} == {"part-00000", "part-00001"}
    for block in range(len(reader.starts)):
        first = int(reader.starts[block])
        last = int(reader.starts[block + 1]) - 1 if block + 1 < len(reader.starts) else COUNT - 1
        assert reader.sample_file(first) == reader.sample_file(last) == reader.block_range(block)[0]


def epochs(ds: packer.PackedDataset, table: dict[str, tuple[int, int]], poll_cache: Path | None = None,
           limit: int = 0) -> None:
    """Two epochs through worker processes, every sample once each (the cache, if given, within its bound);
    then one in order: the local parts reader's order."""
    block = int((ds.reader.spans[:, 2] - ds.reader.spans[:, 1]).max())
    loader = packer.make_loader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle="blocks", seed=3)
    orders = []
    for _ in range(2):
        if poll_cache is None:
            orders.append(seen_indices(loader, table))
        else:
            with CachePoll(poll_cache) as poll:
                orders.append(seen_indices(loader, table))
            assert poll.most <= limit + WORKERS * block, (poll.most, limit, block)
        assert sorted(orders[-1]) == list(range(COUNT))
    assert orders[0] != orders[1]
    in_order = packer.make_loader(ds, batch_size=BATCH, num_workers=0, shuffle=False)
    assert seen_indices(in_order, table) == list(range(COUNT))
    assert all(table[pixel_digest(ds[i][0])][0] == i for i in (0, COUNT // 2 - 1, COUNT // 2, COUNT - 1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_url_in_parts_over_cache_limit_is_read_a_block_at_a_time(fmt, packs, server, truth, tmp_path, capfd):
    limit = manifest_bytes(packs / fmt) // 8
    cache = tmp_path / "cache"
    ds = packer.open_dataset(f"{server.url}/{fmt}", cache_dir=cache, cache_limit=limit)
    said = capfd.readouterr().err
    assert f"over cache_limit {limit:,}: reading it a block at a time" in said
    check_layout(ds)
    epochs(ds, truth[fmt], cache, limit)
    assert Cache(cache).used() <= limit


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_folder_in_parts_over_page_budget_is_read_a_block_at_a_time(fmt, packs, truth, tmp_path, capfd):
    budget = manifest_bytes(packs / fmt) // 8
    ds = packer.open_dataset(packs / fmt, page_budget=budget, cache_dir=tmp_path / "cache")
    assert f"over page_budget {budget:,}: reading it a block at a time" in capfd.readouterr().err
    check_layout(ds)
    epochs(ds, truth[fmt])
    assert not list((packs / fmt).rglob("layout-*"))  # the layout is cached in the cache folder, not DEST


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_image_and_fields_dataset_in_parts_gives_the_parts_readers_fields(fmt, tmp_path):
    """Two parts written by the format's writer (captions, numbers, json, masks, bytes), joined by its
    merge_parts as a 2-rank conversion joins them, read over page_budget: every sample's payload, label and
    fields as the local parts reader's, the fields checked against their checksum."""
    root = tmp_path / "ds"
    entries = {}
    for r in range(2):
        write_dataset(root / f"part-{r:05d}", fmt, SCHEMA, FIELDS_COUNT)
        part = json.loads((root / f"part-{r:05d}" / "manifest.json").read_text())
        (root / f"part-{r:05d}" / "manifest.json").unlink()
        entries[f"part-{r:05d}"] = part
    merged = get_format(fmt)[0].merge_parts(entries)
    parts = [{"path": name, "count": FIELDS_COUNT, "range": [r * FIELDS_COUNT, (r + 1) * FIELDS_COUNT]}
             for r, name in enumerate(entries)]
    (root / "manifest.json").write_text(json.dumps({**part, **merged, "count": 2 * FIELDS_COUNT, "parts": parts}))
    local = packer.open_dataset(root).reader
    assert isinstance(local, PartedReader)
    blocked = packer.open_dataset(root, page_budget=manifest_bytes(root) // 8, cache_dir=tmp_path / "cache").reader
    assert type(blocked).__name__ == "BlockedReader" and len(blocked) == len(local) == 2 * FIELDS_COUNT
    for i in range(len(local)):
        got, want = blocked.read(i), local.read(i)
        assert bytes(got.payload) == bytes(want.payload) and got.label == want.label, i
        assert {k: bytes(v) for k, v in blocked.read_fields(i).items()} == \
            {k: bytes(v) for k, v in local.read_fields(i).items()}, i


def test_parts_whose_index_is_not_one_row_a_sample_are_refused_in_one_line():
    """The generic join (a format without its own join_index): an array of offsets cannot be put end to end."""
    def part(n: int) -> Layout:
        rows = np.arange(n, dtype=np.int64)
        return Layout(("data",), np.zeros(n, np.int32), rows, rows + 1, {"offsets": np.arange(n + 1)})

    with pytest.raises(UsageError) as error:
        concat_layouts([("part-00000", part(3)), ("part-00001", part(2))], "DS")
    assert "DS: 'offsets'" in str(error.value) and "raise cache_limit" in str(error.value)
    assert "\n" not in str(error.value)
    joined = concat_layouts([("a", part(3)), ("b", part(2))], "DS", lambda indexes, counts, where: {})
    assert joined.files == ("a/data", "b/data") and joined.file.tolist() == [0, 0, 0, 1, 1]
    assert joined.start.tolist() == [0, 1, 2, 0, 1]

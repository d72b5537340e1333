"""Real ``torchrun --nproc_per_node=2`` (gloo, CPU) over every format: ``make_loader`` splits the data between
ranks, pads as DistributedSampler does, and reshuffles every epoch without ``set_epoch``."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.packed import FORMATS, free_port

import packer

WORKER = Path(__file__).resolve().parents[1] / "workers" / "dist_worker.py"
COUNT = 101  # odd: the sampler pads one rank with a repeated sample
BATCH, WORLD = 8, 2


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory):
    """Pack a 101-image folder into each format, run the worker under torchrun once, return what each rank saw."""
    root = tmp_path_factory.mktemp("dist")
    src = root / "src"
    rng = np.random.default_rng(0)
    for i in range(COUNT):
        path = src / f"class{i % 3}" / f"img{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (18 + i % 5, 20 + i % 7, 3), dtype=np.uint8)).save(path)
    paths = {}
    for fmt in FORMATS:
        paths[fmt] = root / fmt
        packer.pack(src, paths[fmt], fmt, store="raw", center_crop=16, progress=False, workers=1)
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), str(out), *map(str, paths.values())]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return src, {fmt: [rank["datasets"][str(path)] for rank in ranks] for fmt, path in paths.items()}, ranks


def test_torchrun_ranks(dist_run):
    _, _, ranks = dist_run
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, WORLD), (1, WORLD)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ranks_split_the_data_and_reshuffle_each_epoch(dist_run, reference_scan, fmt):
    src, per_format, _ = dist_run
    ranks = per_format[fmt]
    per_rank = math.ceil(COUNT / WORLD)
    padding = per_rank * WORLD - COUNT
    all_relpaths = {rel for rel, _ in reference_scan(src)[2]}
    permutations = []
    for epoch in range(2):
        seen = [rank["epochs"][epoch] for rank in ranks]
        for s in seen:
            assert len(s["indices"]) == per_rank
            assert s["batches"] == math.ceil(per_rank / BATCH)
        assert seen[0]["batches"] == seen[1]["batches"], "every rank runs the same number of steps"
        counts = collections.Counter(seen[0]["indices"] + seen[1]["indices"])
        assert set(counts) == set(range(COUNT)), "together the ranks cover the dataset"
        assert sum(c - 1 for c in counts.values()) == padding, "duplicates only up to the padding"
        assert len(set(seen[0]["indices"]) & set(seen[1]["indices"])) <= padding
        assert set(seen[0]["relpaths"]) | set(seen[1]["relpaths"]) == all_relpaths
        # both ranks took their share of one global permutation: rank r has positions r, r + 2, ...
        interleaved = [None] * (per_rank * WORLD)
        for r, s in enumerate(seen):
            interleaved[r::WORLD] = s["indices"]
        assert sorted(interleaved[:COUNT]) == list(range(COUNT))
        assert interleaved[COUNT:] == interleaved[:padding]
        permutations.append(interleaved)
    assert permutations[0] != permutations[1], "epoch 2 is reshuffled without set_epoch"
    for rank in ranks:
        assert rank["epochs"][0]["indices"] != rank["epochs"][1]["indices"]
        assert rank["len"] == COUNT


@pytest.mark.parametrize("fmt", FORMATS)
def test_augmented_batches_under_torchrun_are_one_process_outputs(dist_run, fmt):
    """Under 2 ranks, every augmented image is what one process gives for (seed, epoch, index): the crop and flip
    depend on nothing else, so the batches are the same on every rank count; epochs differ."""
    from workers.dist_worker import digest

    from packer.loading.sampler import EpochIndex

    _, per_format, _ = dist_run
    ranks = per_format[fmt]
    ds = packer.open_dataset(ranks[0]["path"], random_resized_crop=12, flip=True, seed=0)
    for rank in ranks:
        for epoch, (plain, augmented) in enumerate(zip(rank["epochs"], rank["augmented"], strict=True)):
            assert augmented == [digest(ds[EpochIndex(i, epoch)][0]) for i in plain["indices"]]
    assert ranks[0]["augmented"][0] != [digest(ds[EpochIndex(i, 1)][0]) for i in ranks[0]["epochs"][0]["indices"]]

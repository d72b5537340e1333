"""Distributed conversion: real ``torchrun --nproc_per_node=2 -m packer pack`` (gloo, CPU) into every format.

Each run is checked against a single-process conversion of the same source with the same options: the same
samples, labels, relative paths and stored bytes, in the same order; one manifest over both parts, which
``packer verify`` accepts. A rank that fails makes the whole run fail with its error, quickly, and ``--resume``
then finishes every part.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image
from support.processes import torchrun

import packer
from packer.packing.coordinator import partition

CLASSES = ("ant", "bee", "cat")
PER_CLASS = 32  # 96 images
BROKEN = "cat/zz_broken.png"  # sorts last: in rank 1's range
# per format: the options of both conversions (wds: shuffled, several shards per part; hdf5: fixed-shape raw)
OPTIONS = {
    "lmdb": [],
    "hdf5": ["--store", "raw", "--resize", "20", "--center-crop", "16"],
    "wds": ["--shard-samples", "10", "--seed", "3"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def cli_options(args: list[str]) -> dict:
    """The Python keyword arguments of CLI options (for the single-process reference)."""
    out, i = {}, 0
    while i < len(args):
        key = args[i][2:].replace("-", "_")
        out[key] = int(args[i + 1]) if args[i + 1].isdigit() and key in ("shard_samples", "seed") else args[i + 1]
        i += 2
    return out


def make_source(root: Path, broken: bool) -> Path:
    """96 small images (PNG, JPEG, one grayscale), and with ``broken`` one PNG damaged in the middle (same size)."""
    for c, cls in enumerate(CLASSES):
        for i in range(PER_CLASS):
            seed = c * 100 + i
            ext = "png" if i % 4 == 0 else "jpg"
            write_image(root / cls / f"{cls}_{i:02d}.{ext}", 24 + i % 9, 20 + i % 7, seed=seed,
                        mode="L" if (c, i) == (1, 5) else "RGB")
    good = write_image(root / BROKEN, 30, 26, seed=999)
    if broken:
        data = bytearray(good.read_bytes())
        data[len(data) // 2: len(data) // 2 + 16] = b"\x00" * 16  # damages the image data, keeps the size
        good.write_bytes(bytes(data))
    return root


def assert_same(dest: Path, reference: Path) -> None:
    """Same samples, labels, relpaths and stored bytes (or arrays), in the same order."""
    a = packer.open_dataset(dest, decode=False)
    b = packer.open_dataset(reference, decode=False)
    assert len(a) == len(b)
    assert a.classes == b.classes
    for i in range(len(a)):
        assert a.relpath(i) == b.relpath(i), i
        (pa, la), (pb, lb) = a.raw_sample(i), b.raw_sample(i)
        assert la == lb, i
        if isinstance(pa, np.ndarray):
            assert pa.dtype == pb.dtype and pa.shape == pb.shape and np.array_equal(pa, pb), i
        else:
            assert pa == pb, i


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("src"), broken=False)


@pytest.fixture(scope="module")
def distributed_runs(source, tmp_path_factory):
    """Every format converted once under torchrun, and once in a single process."""
    root = tmp_path_factory.mktemp("dist")
    runs = {}
    for fmt, args in OPTIONS.items():
        dest = root / fmt
        result = torchrun("pack", source, dest, "--format", fmt, "--quiet", *args)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        reference = root / f"{fmt}-single"
        packer.pack(source, reference, fmt, workers=1, progress=False, distributed=False, **cli_options(args))
        runs[fmt] = (dest, reference, result)
    return runs


@pytest.mark.parametrize("fmt", list(OPTIONS))
def test_distributed_conversion_is_one_dataset(distributed_runs, fmt, run_packer):
    dest, reference, result = distributed_runs[fmt]
    assert result.stdout.count(f"{dest}: 97 images") == 1, result.stdout  # rank 0 alone prints the summary
    manifest = json.loads((dest / "manifest.json").read_text())
    single = json.loads((reference / "manifest.json").read_text())
    assert manifest["count"] == single["count"] == 97
    for key in ("classes", "class_to_idx", "store", "transform", "shape", "dtype", "order", "skipped"):
        assert manifest[key] == single[key], key
    parts = manifest["parts"]
    assert [p["path"] for p in parts] == ["part-00000", "part-00001"]
    assert sum(p["count"] for p in parts) == 97 and min(p["count"] for p in parts) > 30  # balanced by bytes
    assert parts[0]["range"][0] == 0 and parts[0]["range"][1] == parts[1]["range"][0] and parts[1]["range"][1] == 97
    assert {f["path"].split("/")[0] for f in manifest["files"]} == {"part-00000", "part-00001"}
    assert not (dest / ".packer-in-progress").exists()
    for part in parts:
        info = json.loads((dest / part["path"] / "part.json").read_text())
        assert info["count"] == part["count"] and info["range"] == part["range"]
        assert not (dest / part["path"] / ".packer-in-progress").exists()
    if fmt == "wds":
        assert [s["path"].split("/")[0] for s in manifest["shards"]].count("part-00001") >= 2
        keys = []
        for shard in manifest["shards"]:
            with tarfile.open(dest / shard["path"]) as tar:
                keys += [m.name.split(".")[0] for m in tar if m.name.endswith(".cls")]
        assert len(keys) == len(set(keys)) == 97  # keys stay unique across parts
    check = run_packer("verify", dest, "--deep")
    assert check.returncode == 0, check.stdout + check.stderr
    assert_same(dest, reference)


@pytest.mark.parametrize("fmt", list(OPTIONS))
def test_distributed_dataset_reads_like_single(distributed_runs, fmt):
    dest, reference, _ = distributed_runs[fmt]
    a, b = packer.open_dataset(dest), packer.open_dataset(reference)
    boundary = json.loads((dest / "manifest.json").read_text())["parts"][0]["count"]
    indices = list(range(boundary - 5, boundary + 5)) + [0, 96, -1]  # a batch across both parts
    batch_a, batch_b = a.__getitems__(indices), b.__getitems__(indices)
    for (ia, la), (ib, lb) in zip(batch_a, batch_b, strict=True):
        assert la == lb and ia.shape == ib.shape and bool((ia == ib).all())
    image, label = a[boundary]
    assert label == b[boundary][1] and bool((image == b[boundary][0]).all())
    fixed = packer.open_dataset(dest, resize=12, center_crop=12)  # one size: batches of the DataLoader
    loader = packer.make_loader(fixed, batch_size=16, shuffle=False, num_workers=1)
    assert sum(len(labels) for _, labels in loader) == 97


def test_distributed_output_repacks(distributed_runs, tmp_path):
    """A dataset converted in parts is a source like any other."""
    dest, reference, _ = distributed_runs["lmdb"]
    out = tmp_path / "repacked"
    packer.pack(dest, out, "hdf5", workers=1, progress=False)
    assert_same(out, reference)


def test_partition_is_contiguous_and_balanced():
    sizes = np.array([10] * 50 + [1000] * 5 + [10] * 45)
    ranges = partition(sizes, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 100
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    shares = [sizes[a:b].sum() for a, b in ranges]
    assert max(shares) - min(shares) <= 1010
    few = partition(np.ones(3), 5)  # more ranks than samples: some ranks get nothing
    assert few[0][0] == 0 and few[-1][1] == 3 and sorted(b - a for a, b in few) == [0, 0, 1, 1, 1]
    assert partition(np.zeros(0), 2) == [(0, 0), (0, 0)]


def test_failing_rank_fails_the_run_then_resume_finishes(tmp_path):
    """--strict with a damaged image in rank 1's range: the run exits non-zero with that image's error, which rank 0
    reports too; once the image is repaired, --resume finishes both parts, keeping what was done."""
    src = make_source(tmp_path / "src", broken=True)
    dest = tmp_path / "dest"
    env = {"PACKER_COMMIT_SAMPLES": "8"}  # LMDB commits (resume points) every 8 samples
    args = ("pack", src, dest, "--format", "lmdb", "--strict", "--quiet")
    result = torchrun(*args, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "packer: error:" in output and "zz_broken.png" in output, output[-4000:]
    # rank 0 stops on rank 1's own error, not on the liveness timeout ("waited for ...") that a lost failure ends in
    assert re.search(r"packer: error: rank 1 failed: \S*zz_broken\.png: cannot decode", output), output[-4000:]
    assert "waited for" not in output, output[-4000:]
    assert not (dest / "manifest.json").exists()
    assert (dest / ".packer-in-progress").exists() and (dest / "part-00001" / ".packer-in-progress").exists()

    broken = src / BROKEN  # repair it with the same size and mtime: the source fingerprint stays the same
    stat = broken.stat()
    good = io.BytesIO()
    write_image(tmp_path / "good.png", 30, 26, seed=999)
    good.write((tmp_path / "good.png").read_bytes())
    assert len(good.getvalue()) == stat.st_size
    broken.write_bytes(good.getvalue())
    os.utime(broken, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    result = torchrun(*args, "--resume", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    kept = re.search(r"resuming \S*part-00001 after (\d+) samples", result.stderr)
    assert kept and int(kept.group(1)) >= 8, result.stderr[-3000:]  # rank 1 kept its committed samples
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["count"] == 97 and manifest["resumed"] is True
    reference = tmp_path / "single"
    packer.pack(src, reference, "lmdb", workers=1, progress=False, distributed=False)
    assert_same(dest, reference)
    assert packer.open_dataset(dest).relpath(96) == BROKEN


def test_distributed_overwrite_deletes_only_what_packer_wrote(source, tmp_path):
    """Rank 0 prepares DEST with the same rule as a single process: a folder that is not a packer dataset is
    refused with one line, and nothing in it is deleted."""
    dest = tmp_path / "app"
    dest.mkdir()
    (dest / "manifest.json").write_text('{"name": "my web app"}\n')
    (dest / "thesis.txt").write_text("precious\n")
    result = torchrun("pack", source, dest, "--format", "lmdb", "--overwrite", "--quiet")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("packer: error:")]
    assert errors and "not a packer dataset" in errors[0] and "thesis.txt" in errors[0], result.stderr[-3000:]
    assert sorted(os.listdir(dest)) == ["manifest.json", "thesis.txt"]
    assert (dest / "thesis.txt").read_text() == "precious\n"

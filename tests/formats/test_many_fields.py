"""A table of many columns (issue 44): every format packs and reads it with a bounded number of open files (HDF5
wrote one temporary file per field, and mapped each dataset on its own: a thousand columns ran out of
descriptors), and a failed conversion leaves nothing that opens as a dataset."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image
from support.processes import assert_ok, packer_limited

COLUMNS = 300
FILES = 64  # open descriptors allowed: far fewer than the columns


@pytest.fixture(scope="module")
def wide_table(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wide")
    with open(root / "t.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image"] + [f"c{k}" for k in range(COLUMNS)])
        for i in range(4):
            write_image(root / "images" / f"{i}.png", 16, 12, seed=i)
            writer.writerow([f"images/{i}.png"] + [_cell(i, k) for k in range(COLUMNS)])
    return root / "t.csv"


def _cell(i: int, k: int) -> str:
    return [f"text {i}.{k}", str(i * 1000 + k), json.dumps([i, k, 0.5]), json.dumps({"i": i, "k": k})][k % 4]


READ = """
import json, sys, resource
resource.setrlimit(resource.RLIMIT_NOFILE, ({files}, {files}))
import packer
ds = packer.open_dataset(sys.argv[1])
print(json.dumps({{ds.relpath(i): {{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in ds[i].items()
                                    if k != "image"}} for i in range(len(ds))}}))
"""


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "wds"])
def test_a_table_of_many_columns_packs_and_reads_with_few_open_files(wide_table, tmp_path, fmt):
    dest = tmp_path / "out"
    assert_ok(packer_limited("pack", wide_table, dest, "--format", fmt, "--quiet", "--workers", "1", files=FILES))
    assert sorted(os.listdir(dest)) == sorted(n for n in os.listdir(dest) if not n.endswith(".tmp"))
    read = subprocess.run([sys.executable, "-c", READ.format(files=FILES), str(dest)], capture_output=True,
                          text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    got = json.loads(read.stdout)
    for i in range(4):
        row = got[f"images/{i}.png"]
        assert len(row) == COLUMNS
        assert row["c0"] == f"text {i}.0" and row["c1"] == i * 1000 + 1
        assert np.allclose(row["c2"], [i, 2, 0.5]) and row["c299"] == {"i": i, "k": 299}

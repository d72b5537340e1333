"""Export loses nothing (issue 44): every path an export of a dataset with fields writes is unique by construction
(two images ``x.jpg`` and ``x.png`` with their own masks, an image named as the table, an image inside a folder
named as a field), floats are the shortest text that reads back to the same float32, and the command export
prints, pasted into a shell, packs the export back to the same samples and fields, byte for byte."""

from __future__ import annotations

import csv
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image
from PIL import Image
from support.fields import SCHEMA, write_dataset
from support.roundtrip import assert_same, decoded_stored, exported, stored_values

import packer

FORMATS = ("lmdb", "hdf5", "wds")


def mask(path: Path, size: tuple[int, int], seed: int) -> str:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 5, (size[1], size[0]), dtype=np.uint8)).save(path)
    return path.name


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    """Images whose exported paths would collide: ``x.jpg`` and ``x.png`` (each with its own mask), an image
    named ``annotations.csv`` (a PNG: the name of the table export writes) and one at ``mask/in.png`` (the
    mask field's folder); floats whose float32 text is short."""
    root = tmp_path_factory.mktemp("collide") / "src"
    write_image(root / "x.jpg", 20, 16, seed=1)
    write_image(root / "x.png", 18, 14, seed=2)
    write_image(root / "annotations.csv", 12, 10, seed=3, fmt="PNG")
    write_image(root / "mask" / "in.png", 10, 12, seed=4)
    rows = []
    for i, (name, size) in enumerate([("x.jpg", (20, 16)), ("x.png", (18, 14)), ("annotations.csv", (12, 10)),
                                      ("mask/in.png", (10, 12))]):
        rows.append([name, mask(root / "masks" / f"{i}.png", size, seed=10 + i), ["1.7", "0.1", "-3e-05", "1e+30"][i],
                     "ab"[i % 2]])
    with open(root / "t.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "mask", "score", "kind"])
        writer.writerows([[image, f"masks/{m}", score, kind] for image, m, score, kind in rows])
    return root / "t.csv"


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_writes_every_path_once_and_packs_back_byte_for_byte(table, tmp_path, fmt):
    dest = tmp_path / "ds"
    packer.pack(table, dest, format=fmt, label_column="kind", progress=False, workers=1)
    result, rows = exported(dest, tmp_path / "out")
    assert_same(decoded_stored(dest), rows, "export")  # both masks, the image named as the table: each its own
    out = tmp_path / "out"
    assert result["table"] == str(out / "annotations-2.csv")
    with open(result["table"], newline="", encoding="utf-8") as f:
        cells = list(csv.DictReader(f))
    assert sorted(c["score"] for c in cells) == sorted(["1.7", "0.1", "-3e-05", "1e+30"])  # shortest float32 text
    assert sorted(c["mask"] for c in cells) == sorted(["mask-2/x.jpg.png", "mask-2/x.png.png",
                                                       "mask-2/annotations.csv.png", "mask-2/mask/in.png.png"])
    assert f"--format {fmt} --no-shuffle" in result["command"]
    # the command as printed, pasted into a shell: the same samples, in the same order, byte for byte
    command = result["command"].replace(" NEW ", f" {tmp_path / 'again'} ")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    run = subprocess.run(["bash", "-c", f"{command} --quiet"], capture_output=True, text=True, timeout=300, env=env)
    if run.returncode == 127:  # no `packer` script beside this Python: the same command through it
        pasted = command.replace("packer pack", f"{shlex.quote(sys.executable)} -m packer pack", 1)
        run = subprocess.run(["bash", "-c", f"{pasted} --quiet"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert_same(stored_values(dest), stored_values(tmp_path / "again"), "export, then pack")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_table_of_images_alone_exports_and_packs_back(tmp_path, fmt):
    """A table with an image column and nothing else: no class and no fields, so its records carry no fields'
    checksum, and export must not look for one."""
    root = tmp_path / "src"
    for i in range(3):
        write_image(root / f"p{i}.png", 8 + i, 6, seed=i, fmt="PNG")
    (root / "t.csv").write_text("image\n" + "".join(f"p{i}.png\n" for i in range(3)), encoding="utf-8")
    dest = tmp_path / "ds"
    packer.pack(root / "t.csv", dest, format=fmt, progress=False, workers=1)
    result, rows = exported(dest, tmp_path / "out")
    assert_same(decoded_stored(dest), rows, "export")
    assert result["count"] == 3 and len(rows) == 3


def test_a_float_a_table_cannot_carry_is_one_line(tmp_path):
    """A stored float32 that is not finite (packed by an older packer from a number beyond float32's range) has
    no cell a table reads back: export names the sample and field rather than writing ``inf``."""
    schema = [f for f in SCHEMA if f.name in ("image", "label", "caption", "target")]
    dest = tmp_path / "ds"
    write_dataset(dest, "lmdb", schema, count=3, stored={(1, "target"): np.float32(np.inf).tobytes()})
    with pytest.raises(packer.PackerError, match=r"sample 1: field 'target' holds inf, which a table cell cannot "
                                                 r"carry back") as exc:
        packer.export(dest, tmp_path / "out", progress=False)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()

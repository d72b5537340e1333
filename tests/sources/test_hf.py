"""Hugging Face interop as a user meets it: a ``datasets.Dataset`` with real JPEG/PNG images, a ClassLabel and typed
columns packs into every format and reads back exactly; ``to_hf`` gives the same rows; ``packer pack hf:PATH``
reads a ``save_to_disk`` folder; every mistake is one line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

datasets = pytest.importorskip("datasets")

import packer  # noqa: E402
from packer.fields import decode  # noqa: E402
from packer.formats import open_reader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CLASSES = ["cat", "dog", "eel"]
FEATURES = datasets.Features({
    "image": datasets.Image(),
    "label": datasets.ClassLabel(names=CLASSES),
    "caption": datasets.Value("string"),
    "score": datasets.Value("float32"),
    "box": datasets.List(datasets.Value("float32"), length=2),
    "meta": {"n": datasets.Value("int64"), "tag": datasets.Value("string")},
})


def _image_bytes(i: int) -> bytes:
    rng = np.random.default_rng(i)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (9 + i, 12 + 2 * i, 3), dtype=np.uint8)).save(out, "JPEG" if i % 2 else "PNG")
    return out.getvalue()


def make_dataset(n: int = 8):
    return datasets.Dataset.from_dict({
        "image": [{"bytes": _image_bytes(i), "path": None} for i in range(n)],
        "label": [i % 3 for i in range(n)],
        "caption": [f"a photo, number {i} ☃" for i in range(n)],
        "score": [i / 8 for i in range(n)],
        "box": [[float(i), i + 0.5] for i in range(n)],
        "meta": [{"n": i, "tag": "x" * i} for i in range(n)],
    }, features=FEATURES)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, env=full,
                          timeout=300)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_dataset_packs_into_every_format_and_reads_back_exactly(tmp_path, fmt):
    ds = make_dataset()
    manifest = packer.pack(ds, tmp_path / "out", fmt, shuffle=False, workers=2, progress=False)
    assert manifest["count"] == len(ds) and manifest["classes"] == CLASSES and manifest["store"] == "original"
    assert [(f["name"], f["kind"]) for f in manifest["fields"]] == [
        ("image", "image"), ("label", "class"), ("caption", "text"), ("score", "float32"), ("box", "float32"),
        ("meta", "json")]
    reader = open_reader(tmp_path / "out")
    fields = {f.name: f for f in reader.schema}
    raw = ds.cast_column("image", datasets.Image(decode=False))
    for i, row in enumerate(raw):
        data, label = reader.raw_sample(i)
        assert data == row["image"]["bytes"]  # store original: the very bytes
        assert CLASSES[label] == CLASSES[row["label"]]
        stored = {k: decode(fields[k], v) for k, v in reader.read_fields(i, verify=True).items()}
        assert stored["caption"] == row["caption"]
        assert stored["score"] == np.float32(row["score"])
        assert stored["box"].tolist() == row["box"]
        assert stored["meta"] == row["meta"]
    sample = packer.open_dataset(tmp_path / "out")[3]  # the packed dataset as packer reads it
    assert sample["label"] == 0 and sample["caption"] == "a photo, number 3 ☃" and tuple(sample["image"].shape) == (
        3, 12, 18)


@pytest.mark.parametrize("fmt", ["lmdb", "wds"])
def test_to_hf_round_trip_equals_the_source_rows(tmp_path, fmt):
    ds = make_dataset()
    packer.pack(ds, tmp_path / "out", fmt, shuffle=False, progress=False)
    back = packer.to_hf(tmp_path / "out", cache_dir=tmp_path / "hf-cache")
    assert isinstance(back, datasets.Dataset)
    assert back.features == ds.features  # Image(), ClassLabel with the same names, the same Values and List
    assert back.features["label"].names == CLASSES
    undecoded = {"image": datasets.Image(decode=False)}
    assert back.cast_column("image", undecoded["image"]).to_list() == \
        ds.cast_column("image", undecoded["image"]).to_list()
    assert back[2]["image"].size == (16, 11)  # decoded by datasets as any Image() column


def test_to_hf_of_raw_pixels_gives_png_images_and_sees_a_repacked_dataset_anew(tmp_path):
    ds = make_dataset(4)
    packer.pack(ds, tmp_path / "raw", "hdf5", store="raw", progress=False)
    back = packer.to_hf(tmp_path / "raw", cache_dir=tmp_path / "hf-cache")
    for i in range(4):
        original = np.asarray(Image.open(io.BytesIO(ds.cast_column("image", datasets.Image(decode=False))[i]
                                                    ["image"]["bytes"])).convert("RGB"))
        got = back.cast_column("image", datasets.Image(decode=False))[i]["image"]["bytes"]
        assert got[:8] == b"\x89PNG\r\n\x1a\n"
        if i % 2 == 0:  # PNG sources: raw pixels are exactly the source's
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(got))), original)
    # packed again into the same folder with other samples: to_hf must not serve the cached rows of the first
    packer.pack(make_dataset(2), tmp_path / "raw", "hdf5", store="raw", overwrite=True, progress=False)
    assert len(packer.to_hf(tmp_path / "raw", cache_dir=tmp_path / "hf-cache")) == 2


def test_cli_packs_a_save_to_disk_folder_and_its_split(tmp_path):
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": make_dataset(6), "test": make_dataset(3)}).save_to_disk(str(folder))
    result = _run("pack", f"hf:{folder}", str(tmp_path / "out"), "--format", "hdf5", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{tmp_path / 'out'}: 6 images, 3 classes, hdf5 (original), " + \
        result.stdout.split("hdf5 (original), ", 1)[1].strip()
    result = _run("pack", f"hf:{folder}", str(tmp_path / "test"), "--format", "wds", "--split", "test", "--quiet",
                  "--image-column", "image", "--label-column", "label")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "test" / "manifest.json").read_text())
    assert manifest["count"] == 3 and manifest["source"]["split"] == "test"
    assert manifest["source"]["root"] == str(folder.resolve())
    single = tmp_path / "single"
    make_dataset(2).save_to_disk(str(single))
    result = _run("pack", f"hf:{single}", str(tmp_path / "one"), "--format", "lmdb", "--quiet")
    assert result.returncode == 0 and "2 images" in result.stdout, result.stderr


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("packer: error: "), result.stderr
    return lines[0]


@pytest.mark.slow
def test_mistakes_are_one_line(tmp_path):
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": make_dataset(2), "test": make_dataset(2)}).save_to_disk(str(folder))
    no_image = tmp_path / "no-image"
    datasets.Dataset.from_dict({"text": ["a", "b"], "n": [1, 2]}).save_to_disk(str(no_image))
    out = str(tmp_path / "out")

    line = _one_line_error(_run("pack", f"hf:{tmp_path / 'missing'}", out, "--format", "lmdb"))
    assert "no such folder" in line
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    line = _one_line_error(_run("pack", "hf:nobody/no-such-dataset", out, "--format", "lmdb", env=offline))
    assert "hf:nobody/no-such-dataset: no such folder, and not a dataset" in line and "save_to_disk" in line
    line = _one_line_error(_run("pack", f"hf:{folder}", out, "--format", "lmdb", "--split", "valid"))
    assert "--split valid" in line and "splits: train, test" in line
    line = _one_line_error(_run("pack", f"hf:{no_image}", out, "--format", "lmdb"))
    assert "no Image column (columns: text (Value), n (Value))" in line and "--image-column" in line
    line = _one_line_error(_run("pack", f"hf:{folder}", out, "--format", "lmdb", "--image-column", "caption"))
    assert "is a Value column, not an Image()" in line
    line = _one_line_error(_run("pack", str(REPO / "sample_data"), out, "--format", "lmdb", "--split", "train"))
    assert "--split is for a Hugging Face SRC" in line
    assert not Path(out).exists()


def test_unlabelled_rows_are_skipped_and_listed(tmp_path):
    ds = make_dataset(4).cast_column("label", datasets.Value("int64"))
    ds = ds.map(lambda row, i: {"label": -1 if i == 1 else row["label"]}, with_indices=True)
    ds = ds.cast_column("label", datasets.ClassLabel(names=CLASSES))
    manifest = packer.pack(ds, tmp_path / "out", "lmdb", progress=False, workers=1)
    assert manifest["count"] == 3
    assert manifest["skipped"][0]["path"] == "00000001" and "no class" in manifest["skipped"][0]["error"]


def test_a_shuffled_dataset_keeps_its_rows_and_unpackable_columns_are_left_out_with_a_warning(tmp_path, capfd):
    ds = make_dataset(6)
    ds = ds.add_column("frames", [[{"bytes": _image_bytes(i), "path": None}] for i in range(6)],
                       feature=datasets.List(datasets.Image()))
    shuffled = ds.shuffle(seed=3)  # an indices mapping over the stored table
    manifest = packer.pack(shuffled, tmp_path / "out", "hdf5", progress=False)
    assert "column 'frames' (List) is not packed" in capfd.readouterr().err
    assert [f["name"] for f in manifest["fields"]] == ["image", "label", "caption", "score", "box", "meta"]
    back = packer.to_hf(tmp_path / "out", cache_dir=tmp_path / "hf-cache")
    expected = shuffled.remove_columns("frames").cast_column("image", datasets.Image(decode=False))
    assert back.cast_column("image", datasets.Image(decode=False)).to_list() == expected.to_list()


def test_to_hf_keeps_masks_as_masks_and_json_as_json_and_packs_back_to_them(tmp_path):
    """A table's mask (uint8 and 16-bit) and JSON fields: ``to_hf`` gives one-channel ``Image()`` masks with the
    exact values and ``Json()`` values, and ``packer pack hf:...`` of it gives masks and JSON again, equal."""
    if not hasattr(datasets, "Json"):
        pytest.skip("this datasets has no Json feature")
    src = tmp_path / "src"
    src.mkdir()
    rows = []
    for i in range(4):
        Image.fromarray(np.full((10, 12 + i, 3), 30 * i, np.uint8)).save(src / f"{i}.png")
        ramp = np.arange(10 * (12 + i)).reshape(10, 12 + i)
        Image.fromarray((ramp % (i + 3)).astype(np.uint8)).save(src / f"m{i}.png")
        Image.fromarray((ramp * 300).astype(np.uint16)).save(src / f"d{i}.png")
        rows.append({"image": f"{i}.png", "seg_mask": f"m{i}.png", "depth_mask": f"d{i}.png",
                     "meta": {"id": i, "tags": ["a", str(i)]}})
    (src / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    packer.pack(src / "t.jsonl", tmp_path / "packed", format="lmdb", progress=False)
    before = packer.open_dataset(tmp_path / "packed")
    back = packer.to_hf(tmp_path / "packed", cache_dir=tmp_path / "hf-cache")
    assert type(back.features["meta"]).__name__ == "Json" and type(back.features["seg_mask"]).__name__ == "Image"
    for i in range(4):
        assert back[i]["meta"] == rows[i]["meta"]
        assert back[i]["seg_mask"].mode == "L" and back[i]["depth_mask"].mode.startswith("I")
        assert np.array_equal(np.asarray(back[i]["seg_mask"]), before[i]["seg_mask"].numpy())
        assert np.array_equal(np.asarray(back[i]["depth_mask"]).astype(np.int64), before[i]["depth_mask"].numpy())
    back.save_to_disk(tmp_path / "saved")
    packer.pack(f"hf:{tmp_path / 'saved'}", tmp_path / "again", format="hdf5", progress=False)
    again = packer.open_dataset(tmp_path / "again")
    assert [(f.name, f.kind, f.pixels) for f in again.fields[1:]] == \
        [("seg_mask", "mask", "uint8"), ("depth_mask", "mask", "uint16"), ("meta", "json", None)]
    for i in range(4):
        for name in ("image", "seg_mask", "depth_mask"):
            assert np.array_equal(again[i][name].numpy(), before[i][name].numpy()), (i, name)
        assert again[i]["meta"] == rows[i]["meta"]

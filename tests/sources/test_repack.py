"""Repacking and interoperability: a packed dataset (any format) or WebDataset shards written by other tools as
the source of ``packer pack``, and ``packer export`` back to an image folder.

References are independent of packer's readers where it matters: the source files' own bytes, the samples given
to ``webdataset.ShardWriter``, and PNG files decoded with Pillow.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import webdataset
from conftest import write_image
from PIL import Image

import packer
from packer.verify import verify

FORMATS = ("lmdb", "hdf5", "wds")
CLASSES = ("dog", "emu", "fox")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """30 images in 3 classes: JPEG, PNG, one grayscale JPEG, one BMP; files named in a nested folder too."""
    root = tmp_path_factory.mktemp("repack-src")
    for c, cls in enumerate(CLASSES):
        for i in range(10):
            ext = {0: "png", 7: "bmp"}.get(i, "jpg")
            sub = "nested/" if i == 3 else ""
            write_image(root / cls / f"{sub}{cls}{i}.{ext}", 20 + i, 18 + 2 * c, seed=10 * c + i,
                        mode="L" if (c, i) == (2, 4) else "RGB")
    return root


@pytest.fixture(scope="module")
def packed(source, tmp_path_factory) -> dict[str, Path]:
    """``source`` packed into every format with the original bytes (wds: shuffled, its default)."""
    out = {}
    for fmt in FORMATS:
        out[fmt] = tmp_path_factory.mktemp(f"orig-{fmt}") / "ds"
        packer.pack(source, out[fmt], fmt, workers=1, progress=False)
    return out


def samples(dest: Path) -> list[tuple[str, int, bytes | np.ndarray]]:
    ds = packer.open_dataset(dest, decode=False)
    return [(ds.relpath(i), *reversed(ds.raw_sample(i))) for i in range(len(ds))]


def same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for (ra, la, pa), (rb, lb, pb) in zip(a, b, strict=True):
        if ra != rb or la != lb:
            return False
        if isinstance(pa, np.ndarray):
            if not (isinstance(pb, np.ndarray) and pa.shape == pb.shape and np.array_equal(pa, pb)):
                return False
        elif pa != pb:
            return False
    return True


@pytest.mark.parametrize("src_fmt", FORMATS)
@pytest.mark.parametrize("dst_fmt", FORMATS)
def test_repack_between_formats_keeps_everything(packed, source, src_fmt, dst_fmt, tmp_path):
    dest = tmp_path / "repacked"
    manifest = packer.pack(packed[src_fmt], dest, dst_fmt, workers=1, progress=False,
                           shuffle=False if dst_fmt == "wds" else None)
    before, after = samples(packed[src_fmt]), samples(dest)
    assert same(after, before)
    for rel, _, payload in after:  # the original files' bytes, at their relative paths
        assert payload == (source / rel).read_bytes()
    assert manifest["store"] == "original"
    assert manifest["classes"] == list(CLASSES)
    assert manifest["source"]["kind"] == "packed" and manifest["source"]["format"] == src_fmt
    assert verify(dest) == []


def test_repack_default_order(packed, tmp_path):
    """A shuffled WebDataset repacked to wds keeps its order (it is already a shuffle); lmdb to wds shuffles."""
    packer.pack(packed["wds"], tmp_path / "a", "wds", workers=1, progress=False)
    assert same(samples(tmp_path / "a"), samples(packed["wds"]))
    m = packer.pack(packed["lmdb"], tmp_path / "b", "wds", workers=1, progress=False)
    assert m["order"]["shuffle"] is True
    assert sorted(samples(tmp_path / "b"), key=lambda s: s[0]) == sorted(samples(packed["lmdb"]), key=lambda s: s[0])


def test_repack_with_resize_matches_packing_the_folder(packed, source, tmp_path):
    options = {"resize": 12, "center_crop": 10, "store": "jpeg", "quality": 85}
    packer.pack(packed["hdf5"], tmp_path / "repacked", "lmdb", workers=1, progress=False, **options)
    packer.pack(source, tmp_path / "direct", "lmdb", workers=1, progress=False, **options)
    assert same(samples(tmp_path / "repacked"), samples(tmp_path / "direct"))
    manifest = json.loads((tmp_path / "repacked" / "manifest.json").read_text())
    assert manifest["shape"] == [10, 10, 3] and manifest["transform"]["resize"] == 12


def test_repack_raw(source, tmp_path, run_packer):
    raw = tmp_path / "raw"
    packer.pack(source, raw, "hdf5", store="raw", resize=16, center_crop=14, workers=1, progress=False)
    # raw -> raw in another format: the same arrays; raw -> png: the same pixels, losslessly
    packer.pack(raw, tmp_path / "raw2", "wds", workers=1, progress=False, shuffle=False)
    assert same(samples(tmp_path / "raw2"), samples(raw))
    assert json.loads((tmp_path / "raw2" / "manifest.json").read_text())["store"] == "raw"
    packer.pack(raw, tmp_path / "png", "lmdb", store="png", workers=1, progress=False)
    pngs = packer.open_dataset(tmp_path / "png")
    arrays = packer.open_dataset(raw)
    for i in range(len(arrays)):
        assert bool((pngs[i][0] == arrays[i][0]).all()) and pngs[i][1] == arrays[i][1]
    # there are no original bytes to keep
    result = run_packer("pack", raw, tmp_path / "orig", "--format", "lmdb", "--store", "original")
    assert result.returncode == 2
    assert "stores decoded pixels" in result.stderr and "--store raw" in result.stderr
    normalized = tmp_path / "norm"
    packer.pack(source, normalized, "lmdb", normalize=True, resize=8, center_crop=8, workers=1, progress=False)
    result = run_packer("pack", normalized, tmp_path / "from-norm", "--format", "hdf5")
    assert result.returncode == 2 and "normalized" in result.stderr


def write_shards(folder: Path, label_member: str) -> list[tuple[str, bytes, int]]:
    """Shards written by the official ``webdataset.ShardWriter``: 24 samples, 10 per shard; image bytes as
    given (jpg, png), the label as a ``cls`` member or a ``json`` field."""
    folder.mkdir(parents=True)
    written = []
    with webdataset.ShardWriter(str(folder / "data-%04d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(24):
            ext = "png" if i % 5 == 0 else "jpg"
            path = write_image(folder.parent / "tmp" / f"{i}.{ext}", 16 + i % 4, 14, seed=500 + i)
            data, label = path.read_bytes(), i % 3
            sample = {"__key__": f"sample{i:05d}", ext: data}
            if label_member == "cls":
                sample["cls"] = label
            else:
                sample["json"] = {"label": label, "caption": f"image {i}"}
                sample["txt"] = f"caption {i}"
            sink.write(sample)
            written.append((f"sample{i:05d}.{ext}", data, label))
    return written


def test_shardwriter_shards_as_source(tmp_path, run_packer):
    written = write_shards(tmp_path / "shards", "cls")
    dest = tmp_path / "from-cls"
    result = run_packer("pack", str(tmp_path / "shards" / "*.tar"), dest, "--format", "lmdb", "--quiet")
    assert result.returncode == 0, result.stderr
    got = samples(dest)
    assert [(rel.split("/")[-1], payload, label) for rel, label, payload in got] == written
    assert got[0][0] == "data-0000.tar/sample00000.png" and got[-1][0].startswith("data-0002.tar/")
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["classes"] == ["0", "1", "2"] and manifest["source"]["kind"] == "shards"
    # a folder of shards, label from a json field; into hdf5 re-encoded as PNG
    written = write_shards(tmp_path / "json-shards", "json")
    dest = tmp_path / "from-json"
    result = run_packer("pack", tmp_path / "json-shards", dest, "--format", "hdf5", "--label-key", "json:label",
                        "--store", "png", "--quiet")
    assert result.returncode == 0, result.stderr
    ds = packer.open_dataset(dest, fields=("image", "label"))  # its .json and .txt members are fields too
    for i, (_, data, label) in enumerate(written):
        expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        image, got_label = ds[i]
        assert got_label == label and np.array_equal(image.permute(1, 2, 0).numpy(), expected)
    # without a label member the samples get no class (every member kept as a field), and a warning says what
    # to pass to take one
    result = run_packer("pack", tmp_path / "json-shards", tmp_path / "x", "--format", "lmdb")
    assert result.returncode == 0 and "--label-key" in result.stderr
    result = run_packer("pack", tmp_path / "json-shards", tmp_path / "y", "--format", "lmdb", "--label-key", "txt")
    assert result.returncode != 0 and "label" in result.stderr


def test_export_and_repack_round_trip(packed, source, tmp_path, run_packer):
    out = tmp_path / "exported"
    result = run_packer("export", packed["wds"], out, "--quiet")
    assert result.returncode == 0, result.stderr
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    originals = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    assert files == originals
    for rel in files:
        assert (out / rel).read_bytes() == (source / rel).read_bytes()
    packer.pack(out, tmp_path / "again", "lmdb", workers=1, progress=False)
    assert same(samples(tmp_path / "again"), samples(packed["lmdb"]))  # the folder order, as the first pack
    # OUT is not replaced without --overwrite; with it, it is
    result = run_packer("export", packed["lmdb"], out)
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert run_packer("export", packed["lmdb"], out, "--overwrite", "--quiet").returncode == 0
    # a folder that is not an image folder is never deleted
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    result = run_packer("export", packed["lmdb"], other, "--overwrite")
    assert result.returncode == 2 and (other / "notes.txt").exists()


def test_export_raw_gives_lossless_pngs(source, tmp_path):
    raw = tmp_path / "raw"
    packer.pack(source, raw, "lmdb", store="raw", resize=15, workers=1, progress=False)
    out = tmp_path / "out"
    result = packer.export(raw, out, progress=False)
    ds = packer.open_dataset(raw, decode=False)
    assert result["count"] == len(ds) == 30
    for i in range(len(ds)):
        array, label = ds.raw_sample(i)
        assert ds.relpath(i).split("/")[0] == CLASSES[label]
        path = out / str(Path(ds.relpath(i)).with_suffix(".png"))
        with Image.open(path) as img:
            assert img.format == "PNG"
            pixels = np.asarray(img)
        assert np.array_equal(pixels.reshape(array.shape), array)


def test_export_of_shards_dataset_uses_class_folders(tmp_path):
    written = write_shards(tmp_path / "shards", "cls")
    packer.pack(tmp_path / "shards", tmp_path / "ds", "lmdb", workers=1, progress=False)
    packer.export(tmp_path / "ds", tmp_path / "out", progress=False)
    for name, data, label in written:
        shard = sorted((tmp_path / "out" / str(label)).glob(f"*/{name}"))
        assert len(shard) == 1 and shard[0].read_bytes() == data
    # the exported folder reads back with the same labels
    packer.pack(tmp_path / "out", tmp_path / "again", "lmdb", workers=1, progress=False)
    relabelled = {rel.split("/")[-1]: label for rel, label, _ in samples(tmp_path / "again")}
    assert relabelled == {name: label for name, _, label in written}


def test_label_key_needs_shards(source, tmp_path, run_packer):
    result = run_packer("pack", source, tmp_path / "x", "--format", "lmdb", "--label-key", "cls")
    assert result.returncode == 2 and "--label-key" in result.stderr

"""``packer.pack`` into LMDB, HDF5 and WebDataset, checked the way a user would check it.

The packed data is read back with the formats' own libraries (py-lmdb and the documented record header, h5py,
tarfile, the ``webdataset`` library), never with packer's readers, and compared with the source folder read
independently: ImageFolder's rules (conftest) and Pillow, with torchvision's Resize/CenterCrop written out below.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
from conftest import imagefolder_reference, write_image
from PIL import Image
from support.readers import (
    FORMATS,
    check_manifest,
    check_packed,
    check_wds_library,
    pil_pixels,
    psnr,
    read_lmdb,
    read_manifest,
    read_packed,
    read_wds_tar,
    ref_normalize,
    ref_pixels,
)

import packer

# --------------------------------------------------------------------------------------------------------------
# sample_data into every format and store (each packed once per module)
# --------------------------------------------------------------------------------------------------------------
SAMPLE_CASES = {
    "original": {"store": "original"},
    "jpeg": {"store": "jpeg"},
    "png": {"store": "png", "resize": 160},  # PNG-encoding full-size photos is slow; tricky_src covers full size
    "raw": {"store": "raw"},
    # normalize at a small fixed size: float16 arrays of full-size photos would be 160 MB per format
    "raw+normalize": {"store": "raw", "normalize": True, "resize": 72, "center_crop": 64},
}


@pytest.fixture(scope="module", params=[(f, c) for f in FORMATS for c in SAMPLE_CASES],
                ids=[f"{f}-{c}" for f in FORMATS for c in SAMPLE_CASES])
def packed_sample(request, tmp_path_factory, sample_data):
    fmt, case = request.param
    dest = tmp_path_factory.mktemp(f"sample-{fmt}-{case}") / "out"
    manifest = packer.pack(sample_data, dest, fmt, workers=2, progress=False, **SAMPLE_CASES[case])
    yield fmt, case, dest, manifest
    shutil.rmtree(dest, ignore_errors=True)


def _check_kwargs(case: str) -> dict:
    kw = dict(SAMPLE_CASES[case])
    if "center_crop" in kw:
        kw["crop"] = kw.pop("center_crop")
    return kw


def test_sample_data_content(packed_sample, sample_data):
    fmt, case, dest, returned = packed_sample
    manifest, records = check_packed(dest, fmt, sample_data, **_check_kwargs(case))
    assert json.loads(json.dumps(returned)) == manifest  # pack() returns the manifest it wrote
    assert len(records) == 150
    if case == "raw+normalize":
        assert manifest["shape"] == [64, 64, 3]
    else:
        assert manifest["shape"] is None
    if fmt == "wds":
        check_wds_library(dest, sample_data, manifest, records, **_check_kwargs(case))


def test_sample_data_manifest(packed_sample, sample_data):
    fmt, case, dest, _ = packed_sample
    manifest = read_manifest(dest)
    check_manifest(dest, sample_data, fmt, manifest)
    assert manifest["count"] == 150 and manifest["skipped"] == [] and manifest["hidden_skipped"] == 0
    assert manifest["classes"] == ["astronaut", "cat", "coffee", "galaxy", "rocket"]
    if fmt == "wds":
        assert len(manifest["shards"]) >= 8


# --------------------------------------------------------------------------------------------------------------
# Tricky sources made with Pillow
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tricky_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tricky") / "src"
    c = root / "color"
    write_image(c / "rgb.jpg", 64, 48, seed=1, quality=92)
    write_image(c / "UPPER.JPG", 48, 80, seed=2)
    write_image(c / "Upper.PNG", 50, 50, seed=3)
    write_image(c / "alt.jpeg", 90, 40, seed=4)
    write_image(c / "bitmap.bmp", 41, 43, seed=5)
    write_image(c / "tiff.tif", 60, 44, seed=6)
    write_image(c / "web.webp", 70, 50, seed=7, lossless=True)
    write_image(c / "pixmap.ppm", 45, 61, seed=8)
    write_image(c / "nested" / "deeper" / "n.png", 40, 40, seed=9)
    write_image(c / "nested" / "deep.jpg", 100, 75, seed=10)
    write_image(c / "with space é.jpg", 52, 66, seed=11)
    write_image(c / "日本 語.png", 66, 52, seed=12)
    (c / "readme.txt").write_text("not an image")
    g = root / "gray"
    write_image(g / "gray.jpg", 64, 64, seed=13, mode="L")
    write_image(g / "gray.png", 80, 60, seed=14, mode="L")
    write_image(g / "gray.pgm", 40, 56, seed=15, mode="L")
    write_image(g / "sixteen.png", 72, 48, seed=16, mode="I;16")
    m = root / "modes"
    write_image(m / "cmyk.jpg", 64, 40, seed=17, mode="CMYK")
    write_image(m / "rgba.png", 56, 72, seed=18, mode="RGBA")
    write_image(m / "palette.png", 60, 60, seed=19, mode="P", transparency=0)
    (root / "zz_empty").mkdir()
    # the fixture must really hold what it claims
    with Image.open(g / "sixteen.png") as img:
        assert img.mode == "I;16"
    with Image.open(m / "cmyk.jpg") as img:
        assert img.mode == "CMYK"
    with Image.open(m / "palette.png") as img:
        assert img.mode == "P" and "transparency" in img.info
    return root


TRICKY_CASES = {
    "original": {"store": "original"},
    "jpeg": {"store": "jpeg"},
    "png": {"store": "png"},
    "raw": {"store": "raw"},
    "raw+normalize": {"store": "raw", "normalize": True},
}


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")
@pytest.mark.parametrize("case", list(TRICKY_CASES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_tricky_sources(tricky_src, tmp_path, fmt, case, capfd):
    dest = tmp_path / "out"
    packer.pack(tricky_src, dest, fmt, workers=1, progress=False, **TRICKY_CASES[case])
    manifest, records = check_packed(dest, fmt, tricky_src, **TRICKY_CASES[case])
    assert manifest["count"] == 19 and manifest["skipped"] == []
    assert manifest["class_to_idx"]["zz_empty"] == 3 and "zz_empty" in manifest["empty_classes"]
    assert "zz_empty" in capfd.readouterr().err
    check_manifest(dest, tricky_src, fmt, manifest)
    if fmt == "wds":
        check_wds_library(dest, tricky_src, manifest, records, **TRICKY_CASES[case])


@pytest.fixture(scope="module")
def broken_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("broken") / "src"
    for i in range(5):
        write_image(root / "a" / f"ok{i}.jpg", 40 + i, 50, seed=i)
        write_image(root / "b" / f"ok{i}.png", 50, 40 + i, seed=10 + i)
    full = (root / "a" / "ok0.jpg").read_bytes()
    (root / "a" / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (root / "a" / "zero.jpg").write_bytes(b"")
    (root / "b" / "text.png").write_text("this is not a PNG\n")
    return root


BROKEN = ("a/truncated.jpg", "a/zero.jpg", "b/text.png")


@pytest.mark.parametrize("store", ["original", "raw"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_unreadable_images_are_skipped(broken_src, tmp_path, fmt, store, capfd):
    dest = tmp_path / "out"
    manifest = packer.pack(broken_src, dest, fmt, store=store, workers=2, progress=False)
    err = capfd.readouterr().err
    check_packed(dest, fmt, broken_src, store=store, skipped=BROKEN)
    assert manifest["count"] == 10
    assert sorted(e["path"] for e in manifest["skipped"]) == sorted(BROKEN)
    assert all(e["error"] for e in manifest["skipped"])
    for rel in BROKEN:
        assert str(broken_src / rel) in err


@pytest.mark.parametrize("fmt", FORMATS)
def test_strict_stops_at_an_unreadable_image(broken_src, tmp_path, fmt):
    dest = tmp_path / "out"
    with pytest.raises(packer.ImageError) as info:
        packer.pack(broken_src, dest, fmt, strict=True, workers=2, progress=False)
    assert any(str(broken_src / rel) in str(info.value) for rel in BROKEN)
    assert not (dest / "manifest.json").exists()


# --------------------------------------------------------------------------------------------------------------
# Determinism: workers, shuffle, seed
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def forty_src(tmp_path_factory) -> Path:
    """40 images in 3 classes: more than two conversion chunks."""
    root = tmp_path_factory.mktemp("forty") / "src"
    for i in range(40):
        cls = ("ant", "bee", "cow")[i % 3]
        ext = ("jpg", "png")[i % 2]
        write_image(root / cls / f"img{i:02d}.{ext}", 40 + i, 120 - i, seed=100 + i)
    return root


def hdf5_contents(path: Path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        out["attrs"] = dict(f.attrs)
    return out


def assert_same_hdf5(a: Path, b: Path) -> None:
    """Every dataset and attribute of two HDF5 files is equal."""
    c1, c2 = hdf5_contents(a), hdf5_contents(b)
    assert c1.keys() == c2.keys() and {"images", "labels", "shapes", "crc32", "relpaths"} <= c1.keys()
    for key in c1:
        if isinstance(c1[key], np.ndarray):
            assert c1[key].dtype == c2[key].dtype, key
            np.testing.assert_array_equal(c1[key], c2[key], err_msg=key)
        else:
            assert c1[key] == c2[key], key


def lmdb_records(dest: Path) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(str(dest), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def comparable(manifest: dict) -> dict:
    out = {k: v for k, v in manifest.items() if k not in ("created", "conversion_seconds")}
    if manifest["format"] == "lmdb":  # LMDB's file holds page bookkeeping that may differ; records are compared
        out["files"] = [{k: v for k, v in f.items() if k != "sha256"} for f in manifest["files"]]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_workers_do_not_change_the_output(forty_src, tmp_path, fmt):
    kw = {"store": "jpeg", "resize": 36} if fmt != "hdf5" else {"store": "raw", "resize": 36}
    m1 = packer.pack(forty_src, tmp_path / "w1", fmt, workers=1, progress=False, **kw)
    m2 = packer.pack(forty_src, tmp_path / "w2", fmt, workers=2, progress=False, **kw)
    assert comparable(m1) == comparable(m2)
    if fmt == "wds":
        assert len(m1["shards"]) >= 8
        for entry in m1["files"]:
            assert (tmp_path / "w1" / entry["path"]).read_bytes() == (tmp_path / "w2" / entry["path"]).read_bytes()
    elif fmt == "lmdb":
        r1 = lmdb_records(tmp_path / "w1")
        assert len(r1) == 40 and r1 == lmdb_records(tmp_path / "w2")
    else:
        assert_same_hdf5(tmp_path / "w1" / "data.h5", tmp_path / "w2" / "data.h5")
    check_packed(tmp_path / "w2", fmt, forty_src, store=kw["store"], resize=36)


def wds_order(dest: Path) -> list[str]:
    manifest = read_manifest(dest)
    return [r.relpath for r in read_wds_tar(dest, manifest)]


def test_wds_is_shuffled_by_default_and_deterministic(forty_src, tmp_path):
    scan_order = [rel for rel, _ in imagefolder_reference(forty_src)[2]]
    packer.pack(forty_src, tmp_path / "a", "wds", progress=False)
    packer.pack(forty_src, tmp_path / "b", "wds", progress=False, workers=1)
    packer.pack(forty_src, tmp_path / "c", "wds", progress=False, seed=1)
    packer.pack(forty_src, tmp_path / "d", "wds", progress=False, shuffle=False)
    a, c, d = wds_order(tmp_path / "a"), wds_order(tmp_path / "c"), wds_order(tmp_path / "d")
    assert sorted(a) == sorted(scan_order) and a != scan_order
    assert read_manifest(tmp_path / "a")["order"] == {"shuffle": True, "seed": 0}
    for shard in read_manifest(tmp_path / "a")["shards"]:
        assert (tmp_path / "a" / shard["path"]).read_bytes() == (tmp_path / "b" / shard["path"]).read_bytes()
    assert sorted(c) == sorted(scan_order) and c != a
    assert d == scan_order
    assert read_manifest(tmp_path / "d")["order"]["shuffle"] is False


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_shuffle_option_for_random_access_formats(forty_src, tmp_path, fmt):
    scan_order = [rel for rel, _ in imagefolder_reference(forty_src)[2]]
    packer.pack(forty_src, tmp_path / "plain", fmt, progress=False)
    packer.pack(forty_src, tmp_path / "s0", fmt, progress=False, shuffle=True, seed=3)
    packer.pack(forty_src, tmp_path / "s0b", fmt, progress=False, shuffle=True, seed=3, workers=1)
    packer.pack(forty_src, tmp_path / "s1", fmt, progress=False, shuffle=True, seed=4)
    order = {name: [r.relpath for r in read_packed(tmp_path / name, fmt, {})] for name in ("plain", "s0", "s0b", "s1")}
    assert order["plain"] == scan_order
    assert read_manifest(tmp_path / "plain")["order"]["shuffle"] is False
    assert sorted(order["s0"]) == sorted(scan_order) and order["s0"] != scan_order
    assert order["s0"] == order["s0b"] and order["s0"] != order["s1"]
    # labels still follow the files
    check_packed(tmp_path / "s1", fmt, forty_src, store="original", ordered=False)


# --------------------------------------------------------------------------------------------------------------
# WebDataset shards
# --------------------------------------------------------------------------------------------------------------
def test_default_shards(forty_src, tmp_path):
    manifest = packer.pack(forty_src, tmp_path / "out", "wds", progress=False)
    assert len(manifest["shards"]) >= 8
    assert [s["path"] for s in manifest["shards"]] == [f"shard-{i:06d}.tar" for i in range(len(manifest["shards"]))]
    check_packed(tmp_path / "out", "wds", forty_src, store="original")


@pytest.mark.parametrize("count", [8, 9, 14, 15, 23])
def test_default_gives_at_least_eight_shards(tmp_path, count):
    src = tmp_path / "src"
    for i in range(count):
        write_image(src / ("x", "y")[i % 2] / f"{i}.png", 40, 40, seed=i)
    manifest = packer.pack(src, tmp_path / "out", "wds", workers=1, progress=False)
    assert len(manifest["shards"]) >= 8
    check_packed(tmp_path / "out", "wds", src, store="original")


def test_shard_samples(forty_src, tmp_path):
    manifest = packer.pack(forty_src, tmp_path / "out", "wds", shard_samples=7, progress=False)
    assert [s["count"] for s in manifest["shards"]] == [7, 7, 7, 7, 7, 5]
    _, records = check_packed(tmp_path / "out", "wds", forty_src, store="original")
    check_wds_library(tmp_path / "out", forty_src, manifest, records, store="original")


@pytest.mark.parametrize("limit", [25_000, 31_000, 50_000])
def test_shard_size_caps_every_shard(forty_src, tmp_path, limit):
    manifest = packer.pack(forty_src, tmp_path / "out", "wds", shard_size=limit, store="jpeg", progress=False)
    sizes = [(tmp_path / "out" / s["path"]).stat().st_size for s in manifest["shards"]]
    assert max(sizes) <= limit, sizes  # the whole file: tar headers, padding and end-of-archive included
    assert len(sizes) >= 8
    if limit == 25_000:  # the limit, not the default of 8 shards, decides here
        assert len(sizes) > 8
    listed = {e["path"]: e["bytes"] for e in manifest["files"]}
    assert [listed[s["path"]] for s in manifest["shards"]] == sizes
    check_packed(tmp_path / "out", "wds", forty_src, store="jpeg")


def test_few_samples_still_pack(tmp_path):
    src = tmp_path / "src"
    for i in range(3):
        write_image(src / "only" / f"{i}.png", 40, 40, seed=i)
    manifest = packer.pack(src, tmp_path / "out", "wds", progress=False)
    assert 1 <= len(manifest["shards"]) <= 3 and manifest["count"] == 3
    check_packed(tmp_path / "out", "wds", src, store="original")


# --------------------------------------------------------------------------------------------------------------
# Geometry, mode and normalize options
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sizes_src(tmp_path_factory) -> Path:
    """Portrait, landscape, square (97: a size where float rounding bites), small, gray."""
    root = tmp_path_factory.mktemp("sizes") / "src"
    write_image(root / "p" / "portrait.jpg", 48, 100, seed=1)
    write_image(root / "p" / "landscape.png", 120, 40, seed=2)
    write_image(root / "q" / "square.png", 97, 97, seed=3)
    write_image(root / "q" / "small.png", 20, 30, seed=4)
    write_image(root / "q" / "gray.jpg", 77, 59, seed=5, mode="L")
    write_image(root / "q" / "odd.png", 101, 67, seed=6)
    return root


OPTION_CASES = [
    # (id, format, pack kwargs, check kwargs, expected manifest shape)
    ("resize-N", "lmdb", {"store": "raw", "resize": 32}, {"resize": 32}, None),
    ("resize-N-png", "wds", {"store": "png", "resize": "45"}, {"resize": 45}, None),
    ("resize-WxH", "hdf5", {"store": "raw", "resize": "40x30"}, {"resize": (40, 30)}, [30, 40, 3]),
    ("resize-WxH-wds", "wds", {"store": "raw", "resize": "33x50"}, {"resize": (33, 50)}, [50, 33, 3]),
    ("max-size", "hdf5", {"store": "raw", "max_size": 50}, {"max_size": 50}, None),
    ("max-size-png", "lmdb", {"store": "png", "max_size": 64}, {"max_size": 64}, None),
    ("resize+max-size", "lmdb", {"store": "raw", "resize": 32, "max_size": 60}, {"resize": 32, "max_size": 60},
     None),
    ("resize+crop", "hdf5", {"store": "raw", "resize": 48, "center_crop": 40}, {"resize": 48, "crop": (40, 40)},
     [40, 40, 3]),
    ("crop-WxH-pads", "lmdb", {"store": "raw", "center_crop": "60x50"}, {"crop": (60, 50)}, [50, 60, 3]),
    ("crop-odd", "wds", {"store": "png", "center_crop": 25}, {"crop": (25, 25)}, [25, 25, 3]),
    ("mode-L", "hdf5", {"store": "raw", "mode": "L"}, {"mode": "L"}, None),
    ("mode-L-png", "wds", {"store": "png", "mode": "L", "resize": 30}, {"mode": "L", "resize": 30}, None),
    ("mode-L-crop", "lmdb", {"store": "raw", "mode": "L", "center_crop": 24}, {"mode": "L", "crop": (24, 24)},
     [24, 24, 1]),
    ("nearest", "lmdb", {"store": "raw", "resize": 21, "interpolation": "nearest"},
     {"resize": 21, "interpolation": "nearest"}, None),
    ("jpeg-resize", "hdf5", {"store": "jpeg", "resize": 50}, {"resize": 50}, None),
    ("normalize-f32", "hdf5", {"store": "raw", "normalize": True, "dtype": "float32", "center_crop": 32,
                               "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3)},
     {"normalize": True, "dtype": "float32", "crop": (32, 32), "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3)},
     [32, 32, 3]),
    ("normalize-L", "lmdb", {"store": "raw", "normalize": True, "mode": "L"},
     {"normalize": True, "mode": "L"}, None),
]


@pytest.mark.parametrize(("fmt", "pack_kw", "check_kw", "shape"), [c[1:] for c in OPTION_CASES],
                         ids=[c[0] for c in OPTION_CASES])
def test_options(sizes_src, tmp_path, fmt, pack_kw, check_kw, shape):
    dest = tmp_path / "out"
    manifest = packer.pack(sizes_src, dest, fmt, workers=1, progress=False, **pack_kw)
    got_manifest, records = check_packed(dest, fmt, sizes_src, store=pack_kw["store"], **check_kw)
    assert manifest["shape"] == got_manifest["shape"] == shape
    if shape is not None:
        assert all(list(r.shape) == shape for r in records)


def test_normalize_float32_is_exact(sizes_src, tmp_path):
    packer.pack(sizes_src, tmp_path / "out", "lmdb", store="raw", normalize=True, dtype="float32", progress=False)
    for r in read_lmdb(tmp_path / "out"):
        got = np.frombuffer(r.payload, np.float32).reshape(r.shape)
        np.testing.assert_allclose(got, ref_normalize(ref_pixels(sizes_src / r.relpath), dtype="float32"),
                                   rtol=1e-6, atol=1e-6)


def test_max_size_never_upscales_and_keeps_squares_square(sizes_src, tmp_path):
    packer.pack(sizes_src, tmp_path / "out", "lmdb", store="raw", max_size=50, progress=False)
    shapes = {r.relpath: r.shape for r in read_lmdb(tmp_path / "out")}
    assert shapes["q/square.png"] == (50, 50, 3)
    assert shapes["q/small.png"] == (30, 20, 3)
    assert shapes["p/landscape.png"] == (16, 50, 3)
    assert shapes["p/portrait.jpg"] == (50, 24, 3)


def test_jpeg_quality(sizes_src, tmp_path):
    packer.pack(sizes_src, tmp_path / "q30", "lmdb", store="jpeg", quality=30, progress=False)
    packer.pack(sizes_src, tmp_path / "q95", "lmdb", store="jpeg", quality=95, progress=False)
    low, high = read_lmdb(tmp_path / "q30"), read_lmdb(tmp_path / "q95")
    assert sum(len(r.payload) for r in low) < sum(len(r.payload) for r in high)
    for r in high:
        assert psnr(pil_pixels(r.payload, "RGB"), ref_pixels(sizes_src / r.relpath)) > 35


@pytest.mark.parametrize("kwargs", [{"store": "original", "resize": 32}, {"store": "png", "normalize": True},
                                    {"store": "bogus"}, {"store": "jpeg", "quality": 0}, {"mode": "CMYK"}])
def test_invalid_option_combinations_are_refused(sizes_src, tmp_path, kwargs):
    dest = tmp_path / "out"
    with pytest.raises(ValueError):
        packer.pack(sizes_src, dest, "lmdb", progress=False, **kwargs)
    assert not dest.exists()


def test_store_defaults(sizes_src, tmp_path):
    assert packer.pack(sizes_src, tmp_path / "a", "lmdb", progress=False)["store"] == "original"
    assert packer.pack(sizes_src, tmp_path / "b", "lmdb", resize=32, progress=False)["store"] == "jpeg"
    m = packer.pack(sizes_src, tmp_path / "c", "lmdb", normalize=True, progress=False)
    assert m["store"] == "raw" and m["dtype"] == "float16"


# --------------------------------------------------------------------------------------------------------------
# Hidden files and the destination
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture
def hidden_src(tmp_path) -> Path:
    root = tmp_path / "src"
    write_image(root / "cat" / "ok.jpg", seed=1)
    write_image(root / "cat" / ".hidden.jpg", seed=2)
    write_image(root / "cat" / ".cache" / "inside.png", seed=3)
    write_image(root / ".ipynb_checkpoints" / "x.png", seed=4)
    write_image(root / "dog" / "ok.png", seed=5)
    (root / "dog" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    return root


@pytest.mark.parametrize("fmt", FORMATS)
def test_hidden_entries(hidden_src, tmp_path, fmt, capfd):
    manifest = packer.pack(hidden_src, tmp_path / "skip", fmt, progress=False)
    assert "4 hidden" in capfd.readouterr().err
    assert manifest["hidden_skipped"] == 4
    check_packed(tmp_path / "skip", fmt, hidden_src, store="original")
    assert manifest["classes"] == ["cat", "dog"] and manifest["count"] == 2

    manifest = packer.pack(hidden_src, tmp_path / "keep", fmt, include_hidden=True, progress=False)
    assert manifest["hidden_skipped"] == 0
    check_packed(tmp_path / "keep", fmt, hidden_src, store="original", include_hidden=True)
    assert manifest["classes"] == [".ipynb_checkpoints", "cat", "dog"] and manifest["count"] == 5


def test_dest_inside_source_is_refused(forty_src, tmp_path, tree_snapshot):
    before = tree_snapshot(forty_src)
    with pytest.raises(packer.DestinationError):
        packer.pack(forty_src, forty_src / "packed", "lmdb", progress=False)
    assert tree_snapshot(forty_src) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_overwrite_replaces_a_packed_dataset(forty_src, sizes_src, tmp_path, fmt):
    dest = tmp_path / "out"
    packer.pack(forty_src, dest, fmt, progress=False)
    with pytest.raises(packer.DestinationError):
        packer.pack(sizes_src, dest, fmt, progress=False)
    check_packed(dest, fmt, forty_src, store="original")
    packer.pack(sizes_src, dest, fmt, overwrite=True, progress=False)
    check_packed(dest, fmt, sizes_src, store="original")
    check_manifest(dest, sizes_src, fmt, read_manifest(dest))


def test_source_is_never_modified(tricky_src, tmp_path, tree_snapshot):
    before = tree_snapshot(tricky_src)
    stat_before = {p: os.stat(p).st_mtime_ns for p in tricky_src.rglob("*")}
    packer.pack(tricky_src, tmp_path / "out", "wds", store="raw", resize=20, progress=False)
    assert tree_snapshot(tricky_src) == before
    assert {p: os.stat(p).st_mtime_ns for p in tricky_src.rglob("*")} == stat_before


def test_hdf5_relpaths_are_copied_in_pieces_without_losing_one(tmp_path):
    """The HDF5 writer copies its temporary path list a megabyte at a time (so memory stays flat): a piece
    boundary inside a path, on a NUL, or in a multi-byte character loses and splits nothing."""
    from packer.formats.hdf5.writer import enumerate_path_chunks

    paths = [f"cls{i % 3}/ñame_{i:05d}_é.jpg".encode() for i in range(500)]
    file = tmp_path / "paths"
    file.write_bytes(b"".join(p + b"\0" for p in paths))
    for chunk_bytes in (1, 7, 29, 1 << 20):
        got = []
        for first, chunk in enumerate_path_chunks(file, chunk_bytes):
            assert first == len(got)
            got.extend(chunk)
        assert got == paths

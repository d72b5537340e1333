"""Reading datasets with fields (issue 24): every field read back exactly through ``ds[i]``, ``make_loader``
(threads and packer's worker processes) and ``packer.stream``, in all three formats; ``fields=`` selection; and
dense targets augmented with their image: each mask is the nearest-neighbour crop of the stored mask at
``augment_params(i, epoch)``, holds only stored values, and lines up with its image.

The datasets are written through each format's Writer with extras (as the packing engine does), and their
expected values are kept here: the references are numpy and Pillow on the values written, never packer.
"""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from support.fields import CLASSES, COUNT, HEIGHT, SCHEMA, STEP, WIDTH, nearest_expected, write_dataset

import packer
from packer.fields import Field

FORMATS = ("lmdb", "hdf5", "wds")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """{fmt: (dest, samples)} of the full schema."""
    root = tmp_path_factory.mktemp("fields")
    return {fmt: (root / fmt, write_dataset(root / fmt, fmt, SCHEMA)) for fmt in FORMATS}


def check_value(field: Field, got, want) -> None:
    """``got`` (what packer gives for one sample) is ``want`` (what was written), exactly."""
    name = field.name
    if field.kind == "image":
        assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8, name
        assert np.array_equal(got.permute(1, 2, 0).numpy(), want), name
    elif field.kind == "mask":
        assert isinstance(got, torch.Tensor) and got.dim() == 2, name
        assert got.dtype == (torch.uint8 if field.pixels == "uint8" else torch.int64), name
        assert np.array_equal(got.numpy(), want), name
    elif field.kind in ("int64", "float32"):
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == (torch.int64 if field.kind == "int64" else torch.float32), name
        assert np.array_equal(got.numpy(), np.asarray(want)), name
    elif field.kind == "class":
        assert got == want and isinstance(got, int), name
    else:
        assert got == want and type(got) is type(want), name


def check_batches(batches: list, samples: list[dict], order: list[int], schema: list[Field]) -> None:
    """Dict batches (as make_loader and stream give them) hold every sample of ``order`` exactly."""
    seen = 0
    for batch in batches:
        assert isinstance(batch, dict) and list(batch) == [f.name for f in schema]
        n = len(batch["caption"]) if "caption" in batch else len(batch[schema[0].name])
        for field in schema:
            column = batch[field.name]
            if field.kind == "image":
                assert column.shape == (n, 3, HEIGHT, WIDTH)
            elif field.kind == "mask":
                assert column.shape == (n, HEIGHT, WIDTH)
            elif field.kind == "class" or (field.kind in ("int64", "float32") and field.shape is not None):
                assert isinstance(column, torch.Tensor) and column.shape[0] == n, field.name
            else:
                assert isinstance(column, list) and len(column) == n, field.name
            for j in range(n):
                want = samples[order[seen + j]][field.name]
                got = column[j]
                if field.kind == "class":
                    got = int(got)
                check_value(field, got, want)
        seen += n
    assert seen == len(order)


# -- ds[i] ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_item_gives_every_field_exactly(datasets, fmt):
    dest, samples = datasets[fmt]
    ds = packer.open_dataset(dest)
    assert ds.fields == SCHEMA
    assert ds.classes == CLASSES
    checked = packer.open_dataset(dest, verify=True)  # every field's checksum checked on read
    for i in range(len(ds)):
        item = ds[i]
        assert isinstance(item, dict) and list(item) == [f.name for f in SCHEMA]
        for field in SCHEMA:
            check_value(field, item[field.name], samples[i][field.name])
            check_value(field, checked[i][field.name], samples[i][field.name])


@pytest.mark.parametrize("fmt", FORMATS)
def test_fields_selects_a_tuple_in_that_order(datasets, fmt):
    dest, samples = datasets[fmt]
    ds = packer.open_dataset(dest, fields=("caption", "image", "mask"))
    for i in (0, 5, len(ds) - 1):
        caption, image, mask = ds[i]
        assert caption == samples[i]["caption"]
        assert np.array_equal(image.permute(1, 2, 0).numpy(), samples[i]["image"])
        assert np.array_equal(mask.numpy(), samples[i]["mask"])
    only = packer.open_dataset(dest, fields=["meta"])
    assert only[3] == (samples[3]["meta"],)


def test_unknown_field_is_a_one_line_error(datasets):
    dest, _ = datasets["lmdb"]
    with pytest.raises(ValueError) as info:
        packer.open_dataset(dest, fields=("image", "captions"))
    message = str(info.value)
    assert "\n" not in message and "'captions'" in message
    assert all(f.name in message for f in SCHEMA)


def test_dataset_without_a_class_field(tmp_path):
    schema = [Field("image", "image"), Field("caption", "text"), Field("mask", "mask", (), "uint8")]
    samples = write_dataset(tmp_path / "ds", "hdf5", schema)
    ds = packer.open_dataset(tmp_path / "ds")
    assert ds.fields == schema
    item = ds[4]
    assert list(item) == ["image", "caption", "mask"]
    check_value(schema[1], item["caption"], samples[4]["caption"])
    batch = next(iter(packer.make_loader(ds, batch_size=4, shuffle=False, num_workers=0)))
    assert list(batch) == ["image", "caption", "mask"] and batch["caption"] == [s["caption"] for s in samples[:4]]


# -- batches ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_threads_give_every_field(datasets, fmt):
    dest, samples = datasets[fmt]
    ds = packer.open_dataset(dest)
    loader = packer.make_loader(ds, batch_size=5, shuffle=False, num_workers=0, tuned=False)
    assert loader.worker_pool_settings is None
    check_batches(list(loader), samples, list(range(COUNT)), SCHEMA)


@pytest.mark.parametrize("fmt", FORMATS)
def test_worker_pool_gives_every_field(datasets, fmt):
    dest, samples = datasets[fmt]
    ds = packer.open_dataset(dest)
    loader = packer.make_loader(ds, batch_size=5, shuffle=False, num_workers=2, tuned=False, timeout=120)
    batches = [dict(batch) for batch in loader]
    assert loader.worker_pool is not None and len(loader.worker_pool.processes) == 2
    check_batches(batches, samples, list(range(COUNT)), SCHEMA)
    shuffled = packer.make_loader(ds, batch_size=4, shuffle=True, seed=3, num_workers=2, tuned=False, timeout=120)
    order = [i for indices in shuffled.batch_sampler for i in indices]
    shuffled.set_epoch(0)
    check_batches(list(shuffled), samples, order, SCHEMA)
    loader.worker_pool.close()
    shuffled.worker_pool.close()


def test_worker_pool_gives_a_fields_tuple(datasets):
    dest, samples = datasets["hdf5"]
    ds = packer.open_dataset(dest, fields=("mask", "caption", "target"))
    loader = packer.make_loader(ds, batch_size=5, shuffle=False, num_workers=2, tuned=False, timeout=120)
    masks, captions, targets = next(iter(loader))
    assert masks.dtype == torch.uint8 and masks.shape == (5, HEIGHT, WIDTH)
    assert np.array_equal(masks.numpy(), np.stack([s["mask"] for s in samples[:5]]))
    assert captions == [s["caption"] for s in samples[:5]]
    assert targets.dtype == torch.float32 and targets.tolist() == [float(s["target"]) for s in samples[:5]]
    loader.worker_pool.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_gives_every_field(datasets, workers):
    dest, samples = datasets["wds"]
    loader = packer.stream(dest, batch_size=5, shuffle=False, num_workers=workers)
    batches = list(loader)
    # each stream reads its shards in order; the loader hands their batches out in turn
    order = [int(k) for batch in batches for k in _keys(batch, samples)]
    check_batches(batches, samples, order, SCHEMA)
    assert sorted(order) == list(range(COUNT))
    captions, = next(iter(packer.stream(dest, batch_size=3, shuffle=False, num_workers=0, fields=("caption",))))
    assert captions == [s["caption"] for s in samples[:3]]


def _keys(batch: dict, samples: list[dict]) -> list[int]:
    """Which samples a batch holds, found by caption."""
    by_caption = {s["caption"]: i for i, s in enumerate(samples)}
    return [by_caption[c] for c in batch["caption"]]


def test_to_device_moves_dict_batches(datasets):
    dest, samples = datasets["lmdb"]
    ds = packer.open_dataset(dest)
    loader = packer.make_loader(ds, batch_size=4, shuffle=False, num_workers=0)
    batch = next(iter(packer.to_device(loader, "cpu", normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))))
    assert batch["image"].dtype == torch.float32
    expected = (torch.from_numpy(np.stack([s["image"] for s in samples[:4]])).permute(0, 3, 1, 2) / 255 - 0.5) / 0.25
    assert torch.allclose(batch["image"], expected, atol=1e-5)
    assert batch["caption"] == [s["caption"] for s in samples[:4]]
    assert batch["mask"].dtype == torch.uint8



def check_lined_up(image: np.ndarray, mask: np.ndarray) -> None:
    """Where a mask pixel's 5x5 neighbourhood is one class (beyond the reach of the image's resampling filter),
    the image pixel says that class (STEP * class): a window or flip that differs between them fails this."""
    padded = np.pad(mask.astype(int), 2, mode="edge")
    same = np.ones(mask.shape, bool)
    for dy in range(5):
        for dx in range(5):
            same &= padded[dy:dy + mask.shape[0], dx:dx + mask.shape[1]] == mask
    assert same.sum() > mask.size // 10
    red = image[..., 0].astype(int)
    assert np.abs(red[same] - STEP * mask[same].astype(int)).max() <= 2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("decoder", ["auto", "pil"])
def test_masks_get_the_image_window_and_flip(datasets, fmt, decoder):
    dest, samples = datasets[fmt]
    size = (24, 32)
    ds = packer.open_dataset(dest, random_resized_crop=size, flip=True, seed=7, decoder=decoder,
                             scale=(0.2, 1.0))
    flips = set()
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            window = ds.augment_params(i, epoch)
            flips.add(window.flipped)
            item = ds[i]
            for name in ("mask", "depth"):
                stored = samples[i][name]
                got = item[name].numpy()
                want = nearest_expected(stored, window.top, window.left, window.height, window.width, size,
                                        window.flipped)
                assert got.shape == size and np.array_equal(got, want), (name, i, epoch)
                assert set(np.unique(got)) <= set(np.unique(stored))
            check_lined_up(item["image"].permute(1, 2, 0).numpy(), item["mask"].numpy())
    assert flips == {True, False}


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_masks_follow_each_epochs_window(datasets, workers):
    dest, samples = datasets["wds"]
    size = (24, 24)
    ds = packer.open_dataset(dest, random_resized_crop=size, flip=True, seed=1, fields=("image", "mask"))
    loader = packer.make_loader(ds, batch_size=5, shuffle=True, seed=2, num_workers=workers, tuned=False,
                                **({"timeout": 120} if workers else {}))
    for epoch in (0, 1):
        order = [i for indices in loader.batch_sampler for i in indices]
        loader.set_epoch(epoch)
        images, masks = zip(*list(loader), strict=True)
        images, masks = torch.cat(images), torch.cat(masks)
        for row, i in enumerate(order):
            window = ds.augment_params(i, epoch)
            want = nearest_expected(samples[i]["mask"], window.top, window.left, window.height, window.width,
                                    size, window.flipped)
            assert np.array_equal(masks[row].numpy(), want), (i, epoch)
            check_lined_up(images[row].permute(1, 2, 0).numpy(), masks[row].numpy())
    if loader.worker_pool is not None:
        loader.worker_pool.close()


def test_masks_get_the_read_time_resize_and_crop(datasets):
    dest, samples = datasets["hdf5"]
    ds = packer.open_dataset(dest, resize=36, center_crop=30)
    # torchvision: the shorter side (48) to 36 makes 48x36; the centre crop keeps rows 3..33, columns 9..39
    scale = HEIGHT / 36
    for i in (0, 7):
        item = ds[i]
        want = nearest_expected(samples[i]["mask"], 3 * scale, 9 * scale, 30 * scale, 30 * scale, (30, 30), False)
        assert np.array_equal(item["mask"].numpy(), want)
        assert item["image"].shape == (3, 30, 30)
        check_lined_up(item["image"].permute(1, 2, 0).numpy(), item["mask"].numpy())


def test_pair_dataset_is_unchanged(tmp_path):
    schema = [Field("image", "image"), Field("label", "class")]
    samples = write_dataset(tmp_path / "pair", "lmdb", schema)
    ds = packer.open_dataset(tmp_path / "pair")
    image, label = ds[2]
    assert label == samples[2]["label"] and np.array_equal(image.permute(1, 2, 0).numpy(), samples[2]["image"])
    images, labels = next(iter(packer.make_loader(ds, batch_size=4, shuffle=False, num_workers=0)))
    assert labels.tolist() == [s["label"] for s in samples[:4]] and images.shape == (4, 3, HEIGHT, WIDTH)
    assert json.loads((tmp_path / "pair" / "manifest.json").read_text())["fields"][0]["name"] == "image"


# -- export: images and a table that packs back ---------------------------------------------------------------------

TABLE_SCHEMA = [f for f in SCHEMA if f.kind != "bytes"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    samples = write_dataset(root / "ds", "wds", TABLE_SCHEMA)
    result = packer.export(root / "ds", root / "out", progress=False)
    return root, samples, result


def test_export_writes_images_and_a_table(exported):
    root, samples, result = exported
    out = root / "out"
    assert result["count"] == COUNT and result["table"] == str(out / "annotations.csv")
    with open(out / "annotations.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [f.name for f in TABLE_SCHEMA]
    for row, want in zip(rows, samples, strict=True):
        assert np.array_equal(np.asarray(Image.open(out / row["image"]).convert("RGB")), want["image"])
        assert row["label"] == CLASSES[want["label"]] and row["caption"] == want["caption"]
        assert np.float32(float(row["target"])) == want["target"] and int(row["count"]) == want["count"]
        assert json.loads(row["tags"]) == want["tags"].tolist()
        assert np.array_equal(np.asarray(json.loads(row["box"]), np.float32), want["box"])
        assert json.loads(row["meta"]) == want["meta"]
        for name in ("mask", "depth"):
            assert np.array_equal(np.asarray(Image.open(out / row[name])), want[name])
    assert "--field mask:mask" in result["command"] and "'tags:int64[]'" in result["command"]
    with pytest.raises(packer.PackerError) as info:
        write_dataset(root / "with-bytes", "hdf5", SCHEMA)
        packer.export(root / "with-bytes", root / "out2", progress=False)
    assert "'blob'" in str(info.value) and "\n" not in str(info.value)


def test_export_then_pack_gives_the_same_samples(exported, tmp_path):
    pytest.importorskip("packer.sources.table", reason="the table source (f24-src) packs the exported table")
    root, samples, result = exported
    new = tmp_path / "new"
    args = shlex.split(result["command"].replace(" NEW", f" {new}"))[1:]
    run = subprocess.run([sys.executable, "-m", "packer", *args, "--format", "lmdb", "--store", "png"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ds = packer.open_dataset(new)
    assert {f.name: f for f in ds.fields} == {f.name: f for f in TABLE_SCHEMA}
    by_caption = {s["caption"]: s for s in samples}
    for i in range(len(ds)):
        item = ds[i]
        want = by_caption[item["caption"]]
        for field in TABLE_SCHEMA:
            check_value(field, item[field.name], want[field.name])

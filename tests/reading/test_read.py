"""Readers: every sample of every format and storage mode against an independent Pillow decode of its source
file; FolderDataset against ImageFolder's rules; ``decode=False``; ``__getitems__`` against ``__getitem__``;
WebDataset shards written by the ``webdataset`` library; ``packer.stream``."""

from __future__ import annotations

import collections
import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.packed import (
    FORMATS,
    digest,
    hwc,
    normalized,
    psnr,
    reference,
    reference_for,
)

import packer
from packer.formats.wds.foreign import scan_shards
from packer.reading.decoding import ROW_DECODERS, CroppedJpegRow, Decoding, JpegIntoRow

CLASSES = {"lmdb": packer.LmdbDataset, "hdf5": packer.Hdf5Dataset, "wds": packer.WdsDataset}
ROUND_TRIP_STORES = ["original", "jpeg", "png", "raw", "raw_var", "raw_normalize", "jpeg_fixed"]
LOSSY = {"jpeg", "jpeg_fixed"}


@pytest.fixture(scope="module")
def pack(pack_once, sample_data):
    return lambda fmt, store: pack_once(sample_data, fmt, store)


@pytest.fixture(scope="module")
def ref_scan(sample_data, reference_scan):
    return reference_scan(sample_data)


def check_pixels(image: torch.Tensor, expected: np.ndarray, store: str, where: str) -> None:
    if store == "raw_normalize":
        assert image.dtype == torch.float16, where
        assert tuple(image.shape) == (3, *expected.shape[:2]), where
        # float16 storage: within half a float16 step (values are about -2.2..2.7, steps there 2**-9)
        np.testing.assert_allclose(hwc(image).astype(np.float64), normalized(expected), atol=2.5e-3, rtol=0,
                                   err_msg=where)
        return
    assert image.dtype == torch.uint8, where
    assert tuple(image.shape) == (3, *expected.shape[:2]), where
    if store in LOSSY:
        assert psnr(hwc(image), expected) > 30, where
    else:
        assert np.array_equal(hwc(image), expected), where


# -- round trips ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("store", ROUND_TRIP_STORES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_every_sample(pack, sample_data, ref_scan, fmt, store):
    classes, class_to_idx, samples = ref_scan
    ds = CLASSES[fmt](pack(fmt, store))
    assert type(ds) is CLASSES[fmt]
    assert len(ds) == len(samples) == 150
    assert ds.classes == classes
    assert ds.class_to_idx == class_to_idx
    expected_label = dict(samples)
    seen = []
    for i in range(len(ds)):
        rel = ds.relpath(i)
        image, label = ds[i]
        assert isinstance(label, int) and label == expected_label[rel], rel
        check_pixels(image, reference_for(sample_data, rel, store), store, f"{fmt}/{store} {i} {rel}")
        seen.append(rel)
    if fmt == "wds":  # WebDataset is shuffled at pack time: a permutation of the folder
        assert sorted(seen) == sorted(rel for rel, _ in samples)
    else:
        assert seen == [rel for rel, _ in samples]
    assert ds.relpath(-1) == seen[-1] and ds.relpath(-len(ds)) == seen[0]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.relpath(-len(ds) - 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_open_dataset_gives_the_format_class(pack, fmt):
    for store in ("original", "raw"):
        path = pack(fmt, store)
        ds = packer.open_dataset(path)
        assert type(ds) is CLASSES[fmt]
        direct = CLASSES[fmt](path)
        for i in (0, 77, len(ds) - 1):
            assert ds.relpath(i) == direct.relpath(i)
            a, b = ds[i], direct[i]
            assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_a_dataset_holds_its_decoding_and_routes_each_keyword(pack):
    """The read-time arguments build the dataset's Decoding, the reader's own options its reader; the read-time
    settings stay readable on the dataset."""
    ds = packer.LmdbDataset(pack("lmdb", "original"), resize=72, center_crop=64, flip=True, seed=7, readahead=False)
    assert isinstance(ds.decoding, Decoding) and not isinstance(ds, Decoding)
    assert ds.decoding.reader is ds.reader and ds.reader.readahead is False
    assert (ds.resize, ds.center_crop, ds.flip, ds.seed, ds.augments, ds.epoch) == (72, (64, 64), True, 7, True, 0)
    ds.set_epoch(2)
    assert ds.epoch == ds.decoding.epoch == 2 and ds.output_shape() == (64, 64, 3)
    with pytest.raises(TypeError):
        packer.LmdbDataset(pack("lmdb", "original"), sharpen=True)  # neither the decoding's nor the reader's


@pytest.mark.parametrize("store", ["original", "jpeg", "png", "raw", "raw_normalize"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_false_returns_stored_data(pack, sample_data, fmt, store):
    path = pack(fmt, store)
    raw = CLASSES[fmt](path, decode=False)
    decoded = CLASSES[fmt](path)
    for i in range(len(raw)):
        rel = raw.relpath(i)
        data, label = raw[i]
        assert label == decoded[i][1]
        where = f"{fmt}/{store} {rel}"
        if store == "original":
            assert isinstance(data, bytes) and data == (sample_data / rel).read_bytes(), where
        elif store in ("jpeg", "png"):
            assert isinstance(data, bytes), where
            assert data.startswith(b"\xff\xd8\xff" if store == "jpeg" else b"\x89PNG\r\n\x1a\n"), where
            with Image.open(io.BytesIO(data)) as img:
                assert img.format == ("JPEG" if store == "jpeg" else "PNG"), where
                pixels = np.asarray(img.convert("RGB"))
            # the stored bytes are what ds[i] decodes
            assert np.array_equal(pixels, hwc(decoded[i][0])), where
            if store == "png":
                assert np.array_equal(pixels, reference_for(sample_data, rel, store)), where
        else:
            assert isinstance(data, np.ndarray) and data.ndim == 3 and data.shape[2] == 3, where
            assert data.dtype == (np.float16 if store == "raw_normalize" else np.uint8), where
            assert np.array_equal(data, hwc(decoded[i][0])), where
    # a batch with decode=False is the same stored data
    batch = raw.__getitems__([3, 1, 3])
    assert len(batch) == 3
    for (data, label), i in zip(batch, [3, 1, 3], strict=True):
        expected, expected_label = raw[i]
        assert label == expected_label
        assert np.array_equal(data, expected) if isinstance(data, np.ndarray) else data == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_accepts_every_intact_sample(pack, fmt):
    """verify=True checks each sample's stored crc32 on read: an intact dataset reads through without an error
    (the per-sample checksums packer stored are those of the stored bytes), item by item and in batches."""
    for store in ("original", "png", "raw", "raw_normalize"):
        ds = CLASSES[fmt](pack(fmt, store), verify=True, decode=False)
        plain = CLASSES[fmt](pack(fmt, store), decode=False)
        for i in range(len(ds)):
            data, label = ds[i]
            expected, expected_label = plain[i]
            assert label == expected_label
            assert np.array_equal(data, expected) if isinstance(data, np.ndarray) else data == expected
        checked = CLASSES[fmt](pack(fmt, store), verify=True)
        batch = checked.__getitems__(INDICES)
        assert [label for _, label in batch] == [checked[i][1] for i in INDICES]


# -- FolderDataset ---------------------------------------------------------------------------------------------

def test_folder_dataset_follows_imagefolder(sample_data, ref_scan):
    classes, class_to_idx, samples = ref_scan
    ds = packer.FolderDataset(sample_data)
    assert len(ds) == len(samples)
    assert ds.classes == classes and ds.class_to_idx == class_to_idx
    assert [(ds.relpath(i), ds[i][1]) for i in range(len(ds))] == samples
    assert ds.samples == [(str(sample_data / rel), label) for rel, label in samples]
    for i, (rel, _) in enumerate(samples):
        check_pixels(ds[i][0], reference(sample_data / rel), "original", rel)


@pytest.mark.parametrize("fmt", FORMATS)
def test_folder_dataset_equals_packed_original(pack, sample_data, fmt):
    folder = packer.FolderDataset(sample_data)
    ds = CLASSES[fmt](pack(fmt, "original"))
    where = {folder.relpath(i): i for i in range(len(folder))}
    assert sorted(where) == sorted(ds.relpath(i) for i in range(len(ds)))
    for i in range(len(ds)):
        a, b = ds[i], folder[where[ds.relpath(i)]]
        assert a[1] == b[1]
        assert torch.equal(a[0], b[0]), ds.relpath(i)


@pytest.fixture(scope="module")
def folder_224(sample_data):
    """{relpath: (image, label)} of FolderDataset(resize=256, center_crop=224), read once."""
    folder = packer.FolderDataset(sample_data, resize=256, center_crop=224)
    assert folder.output_shape() == (224, 224, 3)
    return {folder.relpath(i): folder[i] for i in range(len(folder))}


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_time_resize_and_crop(pack, sample_data, folder_224, fmt):
    """resize=256, center_crop=224 at read time: FolderDataset and the packed originals agree exactly; both are
    within one level of Resize+CenterCrop (packer resamples only the cropped region), and decoder="pil" is
    exactly it."""
    ds = CLASSES[fmt](pack(fmt, "original"), resize=256, center_crop=224)
    pil = CLASSES[fmt](pack(fmt, "original"), resize=256, center_crop=224, decoder="pil")
    assert ds.output_shape() == (224, 224, 3)
    assert sorted(ds.relpath(i) for i in range(len(ds))) == sorted(folder_224)
    for i in range(len(ds)):
        rel = ds.relpath(i)
        image, label = ds[i]
        f_image, f_label = folder_224[rel]
        assert label == f_label
        assert tuple(image.shape) == (3, 224, 224) and image.dtype == torch.uint8
        assert torch.equal(image, f_image), rel
        expected = reference(sample_data / rel, 256, (224, 224))
        diff = np.abs(hwc(image).astype(np.int16) - expected.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.5, rel
        if i % 10 == 0:  # Pillow's full resize for a sample of them (the slow path)
            assert np.array_equal(hwc(pil[i][0]), expected), rel


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_time_crop_of_raw(pack, sample_data, fmt):
    """A read-time crop of stored raw pixels (rectangular, (w, h) = (40, 30))."""
    ds = CLASSES[fmt](pack(fmt, "raw_var"), center_crop="40x30")
    assert ds.output_shape() == (30, 40, 3)
    for i in range(0, len(ds), 3):
        expected = reference_crop(reference_for(sample_data, ds.relpath(i), "raw_var"), (40, 30))
        image = ds[i][0]
        assert tuple(image.shape) == (3, 30, 40)
        diff = np.abs(hwc(image).astype(np.int16) - expected.astype(np.int16))
        assert diff.max() <= 1, ds.relpath(i)


def reference_crop(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    cw, ch = size
    h, w = arr.shape[:2]
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return arr[top:top + ch, left:left + cw]


# -- __getitems__ ------------------------------------------------------------------------------------------------

INDICES = [5, 0, 149, -1, 5, 77, 33, 120, 64, 2, 98, 141, 17]
# (store, read-time kwargs, fixed output (H, W, C) or None)
BATCH_CASES = {
    "raw": ("raw", {}, (56, 56, 3)),
    "raw-verify": ("raw", {"verify": True}, (56, 56, 3)),
    "raw_normalize": ("raw_normalize", {}, (32, 40, 3)),
    "original-crop": ("original", {"resize": 72, "center_crop": 64}, (64, 64, 3)),
    "original-crop-rect": ("original", {"center_crop": "120x100"}, (100, 120, 3)),
    "jpeg_fixed": ("jpeg_fixed", {}, (112, 112, 3)),
    "jpeg_fixed-crop": ("jpeg_fixed", {"center_crop": 96}, (96, 96, 3)),
    "jpeg_fixed-same-resize-crop": ("jpeg_fixed", {"resize": 112, "center_crop": "100x90"}, (90, 100, 3)),
    "original": ("original", {}, None),
    "png": ("png", {}, None),
    "raw_var": ("raw_var", {}, None),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 3])
def test_getitems_equals_getitem(pack, fmt, case, threads):
    store, kwargs, shape = BATCH_CASES[case]
    ds = CLASSES[fmt](pack(fmt, store), threads=threads, **kwargs)
    assert ds.output_shape() == shape
    batch = ds.__getitems__(list(INDICES))
    items = [ds[i] for i in INDICES]
    assert len(batch) == len(items)
    for (image, label), (e_image, e_label) in zip(batch, items, strict=True):
        assert label == e_label
        assert image.dtype == e_image.dtype and torch.equal(image, e_image)
    if shape is not None:
        assert hasattr(batch, "images"), "a fixed-shape batch is one tensor"
        assert tuple(batch.images.shape) == (len(INDICES), shape[2], shape[0], shape[1])
        assert torch.equal(batch.images, torch.stack([image for image, _ in items]))
        assert batch.labels.dtype == torch.int64
        assert batch.labels.tolist() == [label for _, label in items]


@pytest.mark.parametrize("store, kwargs, chosen", [
    ("jpeg_fixed", {}, JpegIntoRow), ("jpeg_fixed", {"decoder": "fast"}, JpegIntoRow),
    ("jpeg_fixed", {"center_crop": 96}, CroppedJpegRow),
    ("original", {"resize": 72, "center_crop": 64}, CroppedJpegRow),
    ("original", {}, None), ("jpeg_fixed", {"center_crop": 96, "decoder": "fast"}, None),
    ("jpeg_fixed", {"decoder": "pil"}, None), ("jpeg_fixed", {"random_resized_crop": 64}, None), ("raw", {}, None)])
def test_batch_rows_decode_through_the_first_row_decoder_of_the_table_that_serves(pack, store, kwargs, chosen):
    """JPEGs at the output size, or with a centre crop left to do: simplejpeg straight into the row; the rest
    (Pillow, augmentation, raw, images of another store or size): the general decode_array."""
    ds = packer.open_dataset(pack("lmdb", store), **kwargs)
    decoding = ds.decoding  # the dataset holds its decoding
    decoder = ds.row_decoder()
    if chosen is None:
        assert decoder == decoding.decode_array and not any(kind.serves(decoding) for kind in ROW_DECODERS)
    else:
        assert type(decoder) is chosen is next(kind for kind in ROW_DECODERS if kind.serves(decoding))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("crop", [None, (96, 96), (100, 90), (111, 112)])
def test_read_time_crop_of_a_stored_jpeg_is_pillows_decode_cropped(pack, fmt, crop):
    """A JPEG stored at the output size, or at the read-time resize with a centre crop left to do, reads as
    Pillow decodes the stored bytes, cropped as torchvision's CenterCrop does (top = round((h - ch) / 2)):
    exactly, in a batch as one by one."""
    kwargs = {"resize": 112, "center_crop": f"{crop[0]}x{crop[1]}"} if crop else {}
    ds = CLASSES[fmt](pack(fmt, "jpeg_fixed"), threads=2, **kwargs)
    batch = ds.__getitems__(list(INDICES))
    for (image, label), i in zip(batch, INDICES, strict=True):
        payload, stored_label = ds.raw_sample(i)
        pixels = np.asarray(Image.open(io.BytesIO(payload)).convert("RGB"))
        if crop:
            width, height = crop
            top, left = round((pixels.shape[0] - height) / 2), round((pixels.shape[1] - width) / 2)
            pixels = pixels[top:top + height, left:left + width]
        assert label == stored_label
        assert np.array_equal(image.permute(1, 2, 0).numpy(), pixels)
        assert torch.equal(ds[i][0], image)


@pytest.mark.parametrize("fmt", FORMATS)
def test_getitems_with_transforms(pack, fmt):
    """With a transform the batch is a list of transformed items, equal to the transformed ``ds[i]``."""
    kwargs = {"transform": lambda t: t.flip(-1).float() / 255, "target_transform": lambda y: y + 100}
    ds = CLASSES[fmt](pack(fmt, "raw"), **kwargs)
    plain = CLASSES[fmt](pack(fmt, "raw"))
    batch = ds.__getitems__(INDICES)
    for (image, label), i in zip(batch, INDICES, strict=True):
        e_image, e_label = plain[i]
        assert label == e_label + 100
        assert torch.equal(image, e_image.flip(-1).float() / 255)
        assert torch.equal(ds[i][0], image)


# -- WebDataset shards from the webdataset library ----------------------------------------------------------

@pytest.fixture(scope="module")
def foreign_shards(tmp_path_factory, sample_data, ref_scan):
    """Shards written by ``webdataset.ShardWriter``: jpg + cls, png + cls (and json with the label)."""
    import webdataset

    _, class_to_idx, samples = ref_scan
    out = tmp_path_factory.mktemp("foreign")
    expected = []  # (key, ext, payload bytes, label, relpath)
    for kind in ("jpg", "png"):
        pattern = str(out / f"{kind}-%06d.tar")
        with webdataset.ShardWriter(pattern, maxcount=25, verbose=0) as sink:
            for n, (rel, label) in enumerate(samples[::3] if kind == "jpg" else samples[1::5]):
                if kind == "jpg" and not rel.endswith(".jpg"):
                    continue
                if kind == "jpg":
                    payload = (sample_data / rel).read_bytes()
                else:
                    buf = io.BytesIO()
                    Image.fromarray(reference(sample_data / rel, 40)).save(buf, "PNG")
                    payload = buf.getvalue()
                key = f"{kind}{n:05d}"
                sink.write({"__key__": key, kind: payload, "cls": label, "json": {"label": label, "path": rel}})
                expected.append((key, kind, payload, label, rel))
    return out, expected


def test_scan_shards_reads_webdataset_library_shards(foreign_shards):
    out, expected = foreign_shards
    for kind in ("jpg", "png"):
        paths = sorted(out.glob(f"{kind}-*.tar"))
        assert len(paths) > 1
        want = [e for e in expected if e[1] == kind]
        for label_key in ("cls", "json:label"):
            scanned = scan_shards(paths, label_key=label_key)
            index, relpaths = scanned.index, scanned.relpaths
            assert len(index) == len(relpaths) == len(want)
            for row, rel, (key, ext, payload, label, _) in zip(index, relpaths, want, strict=True):
                shard = paths[int(row["shard"])]
                assert rel == f"{shard.name}/{key}.{ext}"
                assert int(row["label"]) == label
                with open(shard, "rb") as f:
                    f.seek(int(row["offset"]))
                    assert f.read(int(row["size"])) == payload, rel


@pytest.mark.parametrize("label_key", ["cls", "json:label"])
@pytest.mark.parametrize("kind", ["jpg", "png"])
def test_wds_dataset_over_webdataset_library_shards(foreign_shards, sample_data, kind, label_key):
    out, expected = foreign_shards
    paths = sorted(out.glob(f"{kind}-*.tar"))
    want = [e for e in expected if e[1] == kind]
    ds = packer.WdsDataset.from_shards(paths, label_key=label_key)
    assert len(ds) == len(want)
    labels = [label for _, _, _, label, _ in want]
    assert ds.classes == [str(i) for i in range(max(labels) + 1)]
    for i, (key, ext, payload, label, rel) in enumerate(want):
        image, got = ds[i]
        assert got == label
        assert ds.relpath(i).endswith(f"/{key}.{ext}")
        expected_pixels = reference(sample_data / rel, None if kind == "jpg" else 40)
        assert np.array_equal(hwc(image), expected_pixels), rel
        assert ds.raw_sample(i) == (payload, label)
    batch = ds.__getitems__([2, 0, 2])
    for (image, label), i in zip(batch, [2, 0, 2], strict=True):
        assert label == labels[i] and torch.equal(image, ds[i][0])


def test_wds_dataset_over_foreign_shards_in_worker_processes(foreign_shards, ref_scan):
    out, expected = foreign_shards
    paths = sorted(out.glob("jpg-*.tar"))
    want = [e for e in expected if e[1] == "jpg"]
    classes = ref_scan[0]
    ds = packer.WdsDataset.from_shards(paths, classes=classes, center_crop=48)
    assert ds.classes == classes and ds.class_to_idx == {c: i for i, c in enumerate(classes)}
    loader = packer.make_loader(ds, batch_size=8, shuffle=False, num_workers=2)
    images = torch.cat([batch for batch, _ in loader])
    labels = torch.cat([batch_labels for _, batch_labels in loader])
    assert labels.tolist() == [label for _, _, _, label, _ in want]
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(len(ds))]))


# -- packer.stream (the webdataset library's streaming path) -------------------------------------------------

SHAPES = {"raw": (3, 56, 56), "jpeg_fixed": (3, 112, 112)}


def stream_samples(loader, epochs: int = 2):
    per_epoch = []
    for _ in range(epochs):
        batches = [(images, labels) for images, labels in loader]
        per_epoch.append(batches)
    return per_epoch


@pytest.fixture(scope="module")
def wds_lookup(pack):
    """{store: (path, {digest: label})} for the fixed-shape WebDataset packs."""
    out = {}
    for store in ("raw", "jpeg_fixed"):
        path = pack("wds", store)
        ds = packer.open_dataset(path)
        table = {digest(ds[i][0]): ds[i][1] for i in range(len(ds))}
        assert len(table) == len(ds)
        out[store] = (path, table)
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("store", ["raw", "jpeg_fixed"])
def test_stream_in_order_covers_every_sample_once(wds_lookup, store, workers):
    path, table = wds_lookup[store]
    loader = packer.stream(path, 16, shuffle=False, num_workers=workers)
    for batches in stream_samples(loader):
        seen = collections.Counter()
        for images, labels in batches:
            assert images.dtype == torch.uint8 and images.shape[1:] == SHAPES[store]
            assert len(images) == len(labels) <= 16
            for image, label in zip(images, labels, strict=True):
                d = digest(image)
                assert table[d] == int(label)
                seen[d] += 1
        assert seen == collections.Counter(table.keys()), "every sample exactly once per epoch"


@pytest.mark.parametrize("store", ["raw", "jpeg_fixed"])
def test_stream_shuffled_gives_every_sample_once_per_epoch(wds_lookup, store):
    path, table = wds_lookup[store]
    loader = packer.stream(path, 16)
    epochs = stream_samples(loader)
    orders = []
    for batches in epochs:
        assert len(batches) == len(loader)
        order = []
        for images, labels in batches:
            assert images.shape[1:] == SHAPES[store] and images.dtype == torch.uint8 and len(images) <= 16
            assert labels.tolist() == [table[digest(image)] for image in images]
            order += [digest(image) for image in images]
        assert sorted(order) == sorted(table), "every sample exactly once per epoch"
        orders.append(order)
    assert orders[0] != orders[1], "reshuffled every epoch"
    full = packer.stream(path, 16, drop_last=True, num_workers=0)
    assert [len(labels) for _, labels in full] == [16] * (len(table) // 16)


def test_stream_batch_larger_than_the_dataset_gives_each_sample_once(wds_lookup):
    path, table = wds_lookup["raw"]
    loader = packer.stream(path, 1000, num_workers=0)
    for batches in stream_samples(loader):
        assert [len(labels) for _, labels in batches] == [len(table)]


def test_stream_of_a_dataset_without_shards_says_what_to_use(pack):
    with pytest.raises(packer.PackerError, match=r"packer.stream reads WebDataset shards, and this lmdb dataset "
                                                 r"has none; read it with packer.open_dataset and packer.make_loader"):
        packer.stream(pack("lmdb", "raw"), 16)


def test_stream_npy_members_are_plain_numpy(pack):
    """Raw samples are .npy members any numpy reads, next to .cls and .json."""
    path = pack("wds", "raw")
    ds = packer.open_dataset(path)
    first = sorted(Path(path).glob("shard-*.tar"))[0]
    with tarfile.open(first) as tar:
        names = tar.getnames()[:3]
        assert [n.rsplit(".", 1)[1] for n in names] == ["npy", "cls", "json"]
        arr = np.load(io.BytesIO(tar.extractfile(names[0]).read()), allow_pickle=False)
    assert np.array_equal(arr, hwc(ds[0][0]))


def test_stream_and_the_shard_scan_group_members_alike(pack):
    """One grouping rule: the sequential reader ``stream`` uses and the scan of shards other tools wrote find
    the same samples, keys and labels in a packed dataset's shards, in the manifest's counts."""
    from packer.formats import get_format

    path = pack("wds", "raw")
    reader = get_format("wds")[1]
    files = reader.stream_files(packer.read_manifest(path))
    paths = [Path(path) / name for name, _ in files]
    streamed = [[(s.key, s.label) for s in reader.stream_file(p)] for p in paths]
    assert [len(samples) for samples in streamed] == [count for _, count in files]
    scanned = scan_shards(paths, label_key="cls")
    keys = [rel.rsplit("/", 1)[1].split(".", 1)[0] for rel in scanned.relpaths]
    assert list(zip(keys, scanned.index["label"].tolist(), strict=True)) == [s for ss in streamed for s in ss]


def test_close_all_closes_shared_handles_and_datasets_reopen(pack):
    """``formats.close_all`` (what ``packer bench`` calls before evicting the page cache) closes the handles
    readers share per process, LMDB's environments; a dataset reads on afterwards, reopening them."""
    from packer.formats import close_all
    from packer.formats.lmdb import reader as lmdb_format

    ds = packer.open_dataset(pack("lmdb", "raw"))
    image, label = ds[3]
    assert lmdb_format._ENVS
    close_all()
    assert not lmdb_format._ENVS
    again, again_label = ds[3]
    assert torch.equal(again, image) and again_label == label


def test_a_samples_fields_go_down_the_package_layers_from_table_to_batch():
    """scripts/count_climbs.py --trace-read: the annotation table packed in each format, then read with a training
    view through ds[i] and make_loader; no package calls back up into one that uses it, but for the one
    registry: the manifest runs the checks of the keys each format owns (Reader.check_manifest, added by
    packer.formats), so that a manifest read anywhere, by a URL's resolve too, is checked whole."""
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("count_climbs", repo / "scripts" / "count_climbs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    package_layer = script.layers(script.package_graph(script.imports(repo)))
    old = os.getcwd()
    os.chdir(repo)  # the table's paths are relative to the checkout
    try:
        calls = script.trace_read(repo, "sample_data/annotations.csv", ".")
    finally:
        os.chdir(old)
    assert ("packer.reading.dataset", "packer.reading.decoding") in calls
    up = script.calls_up(calls, package_layer)
    assert {a for a, _ in up} <= {"packer.manifest"} and {b.rsplit(".", 1)[0] for _, b in up} <= {
        "packer.formats", "packer.formats.wds"}, up

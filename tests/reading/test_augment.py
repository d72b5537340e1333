"""Read-time training augmentation (``random_resized_crop``, ``flip``): every format and store against an
independent Pillow reference at the window ``augment_params`` reports; the window statistics against
torchvision's ``RandomResizedCrop.get_params`` (written out here); the same windows in worker and fresh
processes; epochs; varying-size batches on the decode threads; the opt-in ``decoder="fast"``."""

from __future__ import annotations

import io
import json
import math
import random
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from support.packed import hwc, psnr

import packer
from packer.images import jpeg_window
from packer.loading.sampler import EpochIndex
from packer.reading.augment import uniform_stream

SIZE = 48  # small against the sources, so that the fast path decodes at 1/2, 1/4 and 1/8
FORMATS = ("lmdb", "hdf5", "wds")
STORES = {  # store: (pack options, modes)
    "original": ({}, ("RGB",)),
    "jpeg": ({"store": "jpeg", "quality": 95}, ("RGB", "L")),
    "png": ({"store": "png", "resize": 120}, ("RGB", "L")),
    "raw": ({"store": "raw", "resize": 100}, ("RGB", "L")),
}
CASES = [(i, epoch) for i in (0, 3, 5, 8, 10, 11) for epoch in (0, 7)]


def make_source(dest, sample_data):
    """A small ImageFolder: two photographs per class (PNGs among them), a large JPEG and a grey JPEG."""
    for cls in ("astronaut", "cat", "coffee", "galaxy", "rocket"):
        files = sorted((sample_data / cls).iterdir())
        picks = [f for f in files if f.suffix == ".png"][:1] + [f for f in files if f.suffix == ".jpg"][:2]
        (dest / cls).mkdir(parents=True)
        for f in picks[:2]:
            shutil.copy(f, dest / cls / f.name)
    big = Image.open(sample_data / "rocket" / sorted(p.name for p in (sample_data / "rocket").iterdir())[0])
    big.convert("RGB").resize((900, 700), Image.Resampling.BICUBIC).save(dest / "rocket" / "big.jpg", quality=92)
    big.convert("L").resize((300, 500)).save(dest / "galaxy" / "grey.jpg", quality=92)


@pytest.fixture(scope="module")
def source(tmp_path_factory, sample_data):
    dest = tmp_path_factory.mktemp("augment-src") / "src"
    make_source(dest, sample_data)
    return dest


@pytest.fixture(scope="module")
def pack(tmp_path_factory, source):
    """``pack(fmt, store, mode)``: ``source`` packed with ``STORES[store]``, once per module."""
    done: dict[tuple, object] = {}

    def get(fmt: str, store: str, mode: str = "RGB"):
        key = (fmt, store, mode)
        if key not in done:
            dest = tmp_path_factory.mktemp(f"aug-{fmt}-{store}-{mode}") / "ds"
            options = dict(STORES[store][0])
            if mode != "RGB":
                options["mode"] = mode
            packer.pack(source, dest, fmt, progress=False, workers=1, **options)
            done[key] = dest
        return done[key]

    return get


def stored_image(ds, index: int, mode: str) -> Image.Image:
    """The stored image decoded by Pillow alone (what ImageFolder's loader would give for it)."""
    data, _ = ds.raw_sample(index)
    if isinstance(data, np.ndarray):
        return Image.fromarray(data[:, :, 0] if data.shape[2] == 1 else data)
    with Image.open(io.BytesIO(data)) as img:
        return img.convert(mode)


def reference(img: Image.Image, window, size=(SIZE, SIZE)) -> np.ndarray:
    """torchvision ``resized_crop(img, top, left, height, width, size, BILINEAR)`` on a PIL image (crop, then
    Pillow's resize), then ``hflip`` when flipped; HWC."""
    top, left, height, width, flipped = window
    out = img.crop((left, top, left + width, top + height)).resize((size[1], size[0]), Image.Resampling.BILINEAR)
    arr = np.asarray(out)
    arr = arr if arr.ndim == 3 else arr[:, :, None]
    return arr[:, ::-1] if flipped else arr


def check_against_reference(ds, mode: str, exact: bool, where: str) -> None:
    channels = 1 if mode == "L" else 3
    for index, epoch in CASES:
        window = ds.augment_params(index, epoch)
        img = stored_image(ds, index, mode)
        top, left, height, width, _ = window
        assert 0 <= top and top + height <= img.height and 0 <= left and left + width <= img.width, where
        image, label = ds[EpochIndex(index, epoch)]
        assert tuple(image.shape) == (channels, SIZE, SIZE) and image.dtype == torch.uint8, where
        expected = reference(img, window)
        got = hwc(image)
        if exact:
            assert np.array_equal(got, expected), f"{where} sample {index} epoch {epoch} {window}"
        else:
            assert psnr(got, expected) >= 30, f"{where} sample {index} epoch {epoch} {window}"
    batch = ds.__getitems__([EpochIndex(i, e) for i, e in CASES])
    assert tuple(batch.images.shape) == (len(CASES), channels, SIZE, SIZE)
    for (image, label), (i, e) in zip(batch, CASES, strict=True):
        item = ds[EpochIndex(i, e)]
        assert label == item[1] and torch.equal(image, item[0]), where


@pytest.mark.parametrize("decoder", ["pil", "auto"])
@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_output_is_resized_crop_at_the_reported_window(pack, fmt, store, decoder):
    """Exact for decoder="pil"; within 30 dB for the fast path (DCT-scaled JPEG decodes, OpenCV's resampler)."""
    for mode in STORES[store][1]:
        ds = packer.open_dataset(pack(fmt, store, mode), random_resized_crop=SIZE, flip=True, seed=3,
                                 decoder=decoder, threads=2)
        check_against_reference(ds, mode, decoder == "pil", f"{fmt}/{store}/{mode}/{decoder}")


@pytest.mark.parametrize("decoder", ["pil", "auto"])
def test_folder_dataset_augments_like_the_readers(source, pack, decoder):
    folder = packer.FolderDataset(source, random_resized_crop=SIZE, flip=True, seed=3, decoder=decoder)
    check_against_reference(folder, "RGB", decoder == "pil", f"folder/{decoder}")
    packed = packer.open_dataset(pack("lmdb", "original"), random_resized_crop=SIZE, flip=True, seed=3,
                                 decoder=decoder)
    for index, epoch in CASES:  # same files, same order: same windows and pixels
        assert folder.augment_params(index, epoch) == packed.augment_params(index, epoch)
        assert torch.equal(folder[EpochIndex(index, epoch)][0], packed[EpochIndex(index, epoch)][0])


def test_parted_dataset_augments_with_global_indices(tmp_path, source, pack):
    """A dataset in two parts (as several ranks convert it) gives the windows and pixels of one in one part."""
    whole = pack("lmdb", "jpeg")
    manifest = json.loads((whole / "manifest.json").read_text())
    half = {cls: i < 3 for i, cls in enumerate(manifest["classes"])}
    dest = tmp_path / "parted"
    parts, files = [], []
    for n, first in enumerate((True, False)):
        src = tmp_path / f"src{n}"
        for cls in manifest["classes"]:
            shutil.copytree(source / cls, src / cls) if half[cls] == first else (src / cls).mkdir(parents=True)
        part = packer.pack(src, dest / f"part-{n:05d}", "lmdb", progress=False, workers=1, store="jpeg", quality=95)
        start = sum(p["count"] for p in parts)
        parts.append({"path": f"part-{n:05d}", "count": part["count"], "range": [start, start + part["count"]]})
        files += [{**f, "path": f"part-{n:05d}/{f['path']}"} for f in part["files"]]
        (dest / f"part-{n:05d}" / "manifest.json").unlink()
    (dest / "manifest.json").write_text(json.dumps({**manifest, "parts": parts, "files": files}))
    parted = packer.open_dataset(dest, random_resized_crop=SIZE, flip=True, seed=3)
    single = packer.open_dataset(whole, random_resized_crop=SIZE, flip=True, seed=3)
    assert type(parted).__name__ == "PartedDataset" and len(parted) == len(single)
    for index, epoch in CASES:
        assert parted.relpath(index) == single.relpath(index)
        assert parted.augment_params(index, epoch) == single.augment_params(index, epoch)
        assert torch.equal(parted[EpochIndex(index, epoch)][0], single[EpochIndex(index, epoch)][0])


# -- the window --------------------------------------------------------------------------------------------------

def tv_get_params(height, width, scale, ratio, uniform):
    """torchvision ``RandomResizedCrop.get_params``, written out, with ``uniform()`` in [0, 1) as its random
    source (torch draws ``uniform_(a, b)`` as ``a + (b - a) * u`` and ``randint(0, n)`` as ``floor(n * u)``)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * uniform())
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * uniform())
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int((height - h + 1) * uniform())
            j = int((width - w + 1) * uniform())
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


def test_windows_are_get_params_on_the_documented_stream(pack):
    """The window is get_params fed by uniform_stream(seed, epoch, index) (the first draw is the flip),
    on the stored image's full-size dimensions."""
    ds = packer.open_dataset(pack("lmdb", "original"), random_resized_crop=SIZE, flip=True, seed=11)
    for index in range(len(ds)):
        for epoch in (0, 1, 2):
            data, _ = ds.raw_sample(index)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
            draws = uniform_stream(11, epoch, index)
            flipped = next(draws) < 0.5
            expected = (*tv_get_params(height, width, (0.08, 1.0), (3 / 4, 4 / 3), draws.__next__), flipped)
            assert tuple(ds.augment_params(index, epoch)) == expected


@pytest.mark.parametrize(("height", "width", "scale", "ratio"), [
    (375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),
    (100, 1000, (0.08, 1.0), (3 / 4, 4 / 3)),  # elongated: many tries fail, the fallback shows up
    (480, 640, (0.5, 0.9), (0.5, 2.0)),
])
def test_window_statistics_match_torchvision(height, width, scale, ratio):
    """Over 4,000 samples the windows have torchvision's distribution (here drawn with Python's own Mersenne
    Twister): mean area fraction, fallback rate, aspect range; flips are fair."""
    from packer.reading.augment import sample_window

    n = 4000
    rng = random.Random(0)
    reference = [tv_get_params(height, width, scale, ratio, rng.random) for _ in range(n)]
    ours = [sample_window(height, width, scale, ratio, uniform_stream(5, 2, i), flip=True) for i in range(n)]

    def area(windows):
        return np.array([h * w / (height * width) for _, _, h, w in windows])

    def centred(windows):
        return np.mean([(i, j) == ((height - h) // 2, (width - w) // 2) for i, j, h, w in windows])

    windows = [tuple(w)[:4] for w in ours]
    assert abs(area(windows).mean() - area(reference).mean()) < 0.02
    assert abs(area(windows).std() - area(reference).std()) < 0.02
    assert abs(centred(windows) - centred(reference)) < 0.03  # the fallback's share, where tries fail
    aspects = np.array([w / h for _, _, h, w in windows])
    # rounding w and h to whole pixels moves the aspect a little past the range (windows are >= 77 px here)
    assert aspects.min() >= ratio[0] * 0.97 and aspects.max() <= ratio[1] * 1.03
    assert all(0 <= i and i + h <= height and 0 <= j and j + w <= width for i, j, h, w in windows)
    assert abs(np.mean([w.flipped for w in ours]) - 0.5) < 0.03


# -- determinism -------------------------------------------------------------------------------------------------

def test_epochs_differ_and_set_epoch_matches_epoch_index(pack):
    path = pack("hdf5", "original")
    ds = packer.open_dataset(path, random_resized_crop=SIZE, flip=True)
    windows = [[ds.augment_params(i, e) for i in range(len(ds))] for e in (0, 1)]
    assert sum(a != b for a, b in zip(*windows, strict=True)) >= len(ds) - 1
    assert [ds.augment_params(i) for i in range(len(ds))] == windows[0]  # epoch 0 by default
    ds.set_epoch(1)
    assert [ds.augment_params(i) for i in range(len(ds))] == windows[1]
    for i in range(len(ds)):
        assert torch.equal(ds[i][0], ds[EpochIndex(i, 1)][0])
    assert torch.equal(ds[EpochIndex(3, 0)][0], packer.open_dataset(path, random_resized_crop=SIZE, flip=True)[3][0])
    assert ds.augment_params(-1) == ds.augment_params(len(ds) - 1)  # keyed on the sample, not how it is named
    other_seed = packer.open_dataset(path, random_resized_crop=SIZE, flip=True, seed=1)
    assert sum(ds.augment_params(i) != other_seed.augment_params(i) for i in range(len(ds))) >= len(ds) - 1


def test_same_windows_in_a_fresh_process_and_in_worker_processes(pack):
    path = pack("lmdb", "original")
    ds = packer.open_dataset(path, random_resized_crop=SIZE, flip=True, seed=9)
    pairs = [(i, e) for e in (0, 4) for i in range(len(ds))]
    code = ("import json, sys, packer\n"
            f"ds = packer.open_dataset({str(path)!r}, random_resized_crop={SIZE}, flip=True, seed=9)\n"
            f"print(json.dumps([list(ds.augment_params(i, e)) for i, e in {pairs!r}]))\n")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(fresh.stdout) == [list(ds.augment_params(i, e)) for i, e in pairs]
    sampler = [EpochIndex(i, e) for i, e in pairs]
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
    images = torch.cat([batch for batch, _ in loader])
    assert torch.equal(images, torch.stack([ds[index][0] for index in sampler]))


# -- batches -----------------------------------------------------------------------------------------------------

def decode_threads() -> set[threading.Thread]:
    # Thread objects, not idents: a thread of an earlier dataset's pool that ended can hand its ident to a new one
    return {t for t in threading.enumerate() if t.name.startswith("packer-decode")}


@pytest.mark.parametrize("kwargs", [{}, {"flip": True}])
def test_varying_sizes_decode_on_the_dataset_threads(source, kwargs):
    """Images of varying size decode on the dataset's threads too. The threads are observed as any user can see
    them (by name): a ThreadPoolExecutor starts a thread only when a task is submitted and none is idle, so new
    ``packer-decode`` threads prove that the batch's decodes were handed to the pool."""
    ds = packer.FolderDataset(source, threads=3, **kwargs)
    assert ds.output_shape() is None
    before = decode_threads()
    batch = ds.__getitems__(list(range(len(ds))))
    assert len(decode_threads() - before) >= 2
    assert len({tuple(image.shape) for image, _ in batch}) > 1
    for (image, label), i in zip(batch, range(len(ds)), strict=True):
        assert label == ds[i][1] and torch.equal(image, ds[i][0])
    single = packer.FolderDataset(source, threads=1, **kwargs)
    before = decode_threads()
    single.__getitems__(list(range(len(ds))))
    assert not decode_threads() - before  # no new thread (an earlier pool's may have ended meanwhile)


def test_flip_alone_and_transform_after_the_crop(pack):
    path = pack("wds", "png")
    plain = packer.open_dataset(path)
    flipped = packer.open_dataset(path, flip=True)
    for i in range(len(plain)):
        image, window = flipped[i][0], flipped.augment_params(i)
        assert window[:4] == (0, 0, *plain[i][0].shape[1:])
        assert torch.equal(image, plain[i][0].flip(-1) if window.flipped else plain[i][0])
    crop = packer.open_dataset(path, random_resized_crop=(30, 40), flip=True)
    with_transform = packer.open_dataset(path, random_resized_crop=(30, 40), flip=True,
                                         transform=lambda t: t.float() / 255)
    batch = with_transform.__getitems__([1, 2])
    for (image, _), i in zip(batch, [1, 2], strict=True):
        assert image.dtype == torch.float32 and tuple(image.shape) == (3, 30, 40)
        assert torch.equal(image, crop[i][0].float() / 255)


def test_bad_arguments_are_refused(pack):
    path = pack("lmdb", "original")
    for kwargs, message in [({"random_resized_crop": 0}, "positive int"),
                            ({"random_resized_crop": (3, 4, 5)}, "positive int"),
                            ({"random_resized_crop": 8, "resize": 10}, "one or the other"),
                            ({"random_resized_crop": 8, "scale": (0.9, 0.1)}, "ranges"),
                            ({"decoder": "turbo"}, "'auto', 'fast' or 'pil'")]:
        with pytest.raises(ValueError, match=message):
            packer.open_dataset(path, **kwargs)


# -- decoder="fast" for validation -------------------------------------------------------------------------------

@pytest.mark.parametrize(("resize", "crop", "some_scaled"), [(64, 56, True), (100, None, True), (300, 224, False)])
def test_fast_decoder_is_close_to_the_default(pack, resize, crop, some_scaled):
    """decoder="fast" (DCT-scaled JPEG decodes where the image is over twice the resized size, OpenCV's resampler
    for every image) stays within 30 dB of the default (Pillow) on every image, scaled or not."""
    path = pack("hdf5", "original")
    default = packer.open_dataset(path, resize=resize, center_crop=crop)
    fast = packer.open_dataset(path, resize=resize, center_crop=crop, decoder="fast")
    scaled = 0
    for i in range(len(default)):
        a, b = default[i][0], fast[i][0]
        assert a.shape == b.shape
        assert psnr(hwc(a), hwc(b)) >= 30, default.relpath(i)
        with Image.open(io.BytesIO(default.raw_sample(i)[0])) as img:
            short = min(img.size)
        scaled += -(-short // 2) >= 2 * resize  # decoded at a reduced DCT scale
    assert (scaled > 0) == some_scaled  # the largest source is 900x700
    batch = fast.__getitems__([0, 4, 2])
    for (image, _), i in zip(batch, [0, 4, 2], strict=True):
        assert torch.equal(image, fast[i][0])


@pytest.mark.parametrize("decoder", ["pil", "auto"])
def test_damaged_images_are_one_line_errors_naming_the_file(tmp_path, source, decoder):
    """A file that is not an image, and a JPEG cut short after its header, fail with the file's name."""
    from packer.errors import ImageError

    root = tmp_path / "src"
    shutil.copytree(source, root)
    good = root / "rocket" / "big.jpg"
    (root / "cat" / "garbage.jpg").write_bytes(b"not an image at all")
    (root / "cat" / "truncated.jpg").write_bytes(good.read_bytes()[:2000])
    ds = packer.FolderDataset(root, random_resized_crop=SIZE, flip=True, decoder=decoder)
    for name in ("garbage.jpg", "truncated.jpg"):
        index = next(i for i in range(len(ds)) if ds.relpath(i).endswith(name))
        with pytest.raises(ImageError) as info:
            ds[index]
        assert str(info.value).startswith(str(root / "cat" / name)) and "\n" not in str(info.value)


# -- the window decoder (packer.images.jpeg_window) ---------------------------------------------------------------

@pytest.mark.skipif(not jpeg_window.available(), reason="built without libjpeg-turbo's headers")
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_jpegs_decode_only_the_window_and_give_the_same_batches(pack, source, fmt, monkeypatch):
    """A packed JPEG (checked whole at pack time, its crc32 checked as it is read) decodes only the part its
    window needs, with the same batch as the whole decode; a folder's files, which nothing checked, decode whole."""
    import packer.reading.augment as augment

    parts = []
    decode_window = augment.decode_window

    def counted(*args, **kwargs):
        parts.append(args[3])
        return decode_window(*args, **kwargs)

    items = [EpochIndex(i, e) for i, e in CASES]
    ds = packer.open_dataset(pack(fmt, "original"), random_resized_crop=SIZE, flip=True, seed=3, threads=2)
    monkeypatch.setattr(augment, "decode_window", counted)
    batch = ds.__getitems__(items)
    jpegs = sum(ds.relpath(i).endswith(".jpg") for i, _ in CASES)
    assert len(parts) == jpegs > 0
    monkeypatch.setattr(augment, "window_decoder_available", lambda: False)
    whole = ds.__getitems__(items)
    assert torch.equal(batch.images, whole.images) and torch.equal(batch.labels, whole.labels)
    assert len(parts) == jpegs

    monkeypatch.setattr(augment, "window_decoder_available", jpeg_window.available)
    folder = packer.FolderDataset(source, random_resized_crop=SIZE, flip=True, seed=3)
    folder.__getitems__(list(range(len(folder))))
    assert len(parts) == jpegs

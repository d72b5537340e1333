"""``packer.stream`` with the read-time transforms (issue 25): its batches hold exactly what
``packer.open_dataset`` gives for the same options, on the Quick start's own wds output (originals of varying
sizes), on raw and fixed-size stores, with each epoch's random resized crop and flip keyed by the sample (not by
its place in the stream), and with masks getting their image's window. The reference is ``ds[i]``: the map-style
path, which its own tests compare with Pillow and torchvision.
"""

from __future__ import annotations

import collections
import io
import shutil
import tarfile
import zlib

import numpy as np
import pytest
import torch
from support.fields import SCHEMA, nearest_expected, write_dataset
from support.packed import digest
from support.processes import one_line_value_error

import packer
from packer.loading.stream_decode import key_index


@pytest.fixture
def quick_start(pack_once, sample_data):
    """``packer pack sample_data out/wds --format wds``: originals of varying sizes, in shards of 40."""
    return pack_once(sample_data, "wds", "original", shard_samples=40)


def digests(images) -> collections.Counter:
    return collections.Counter(digest(image) for image in images)


def streamed(loader, epoch: int | None = None) -> tuple[torch.Tensor, list[int]]:
    if epoch is not None:
        loader.set_epoch(epoch)
    images, labels = zip(*list(loader), strict=True)
    return torch.cat(images), torch.cat(labels).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["original", "raw", "jpeg_fixed"])
@pytest.mark.parametrize("decoder", ["auto", "pil", "fast"])
def test_resize_and_crop_give_open_datasets_pixels(quick_start, pack_once, sample_data, store, decoder):
    dest = quick_start if store == "original" else pack_once(sample_data, "wds", store)
    options = {"resize": 48, "center_crop": 40, "decoder": decoder}
    ds = packer.open_dataset(dest, **options)
    images, labels = streamed(packer.stream(dest, 16, shuffle=False, num_workers=0, **options))
    assert images.shape == (len(ds), 3, 40, 40) and images.dtype == torch.uint8
    for i in range(len(ds)):  # one stream, unshuffled: the packed order
        image, label = ds[i]
        assert torch.equal(images[i], image) and labels[i] == label, i


@pytest.mark.parametrize("workers", [0, 2])
def test_random_resized_crop_and_flip_follow_the_sample_and_epoch(quick_start, workers):
    """Shuffled, through worker processes: each epoch's batches hold exactly ``ds[i]`` at that epoch, for the
    same seed, whatever order the stream gives them in."""
    dest = quick_start
    options = {"random_resized_crop": (40, 48), "flip": True, "scale": (0.3, 1.0)}
    ds = packer.open_dataset(dest, seed=5, **options)
    loader = packer.stream(dest, 16, seed=5, num_workers=workers, buffer=32, **options)
    seen = []
    for epoch in (0, 1):
        images, labels = streamed(loader, epoch)
        assert images.shape == (len(ds), 3, 40, 48)
        ds.set_epoch(epoch)
        want = digests(ds[i][0] for i in range(len(ds)))
        assert digests(images) == want, epoch
        assert collections.Counter(labels) == collections.Counter(ds[i][1] for i in range(len(ds)))
        seen.append(want)
    assert seen[0] != seen[1]  # the windows change with the epoch
    flips = {ds.augment_params(i, 1).flipped for i in range(len(ds))}
    assert flips == {True, False}


def test_the_augmentation_resumes_mid_epoch(quick_start):
    dest = quick_start
    options = {"random_resized_crop": 32, "flip": True, "seed": 3, "num_workers": 0, "buffer": 20}
    loader = packer.stream(dest, 8, **options)
    loader.set_epoch(1)
    batches = iter(loader)
    next(batches), next(batches)
    state = loader.state_dict()
    rest = [images for images, _ in batches]
    resumed = packer.stream(dest, 8, **options)
    resumed.load_state_dict(state)
    again = [images for images, _ in resumed]
    assert len(again) == len(rest) and all(torch.equal(a, b) for a, b in zip(again, rest, strict=True))


def test_mode_l_decodes_one_channel(quick_start):
    dest = quick_start
    images, _ = next(iter(packer.stream(dest, 4, shuffle=False, num_workers=0, mode="L", resize=24,
                                        center_crop=20)))
    assert images.shape == (4, 1, 20, 20)


def test_varying_sizes_without_a_transform_is_one_line(quick_start):
    dest = quick_start
    with pytest.raises(packer.PackerError) as info:
        next(iter(packer.stream(dest, 8, shuffle=False, num_workers=0)))
    assert "\n" not in str(info.value) and "resize=" in str(info.value)


@pytest.fixture(scope="module")
def fields_wds(tmp_path_factory):
    dest = tmp_path_factory.mktemp("stream-fields") / "wds"
    return dest, write_dataset(dest, "wds", SCHEMA)


@pytest.mark.parametrize("workers", [0, 2])
def test_masks_get_their_images_window_and_flip(fields_wds, workers):
    dest, samples = fields_wds
    size = (24, 32)
    options = {"random_resized_crop": size, "flip": True, "seed": 7, "scale": (0.2, 1.0)}
    ds = packer.open_dataset(dest, **options)
    loader = packer.stream(dest, 5, num_workers=workers, buffer=4, **options)
    for epoch in (0, 2):
        loader.set_epoch(epoch)
        ds.set_epoch(epoch)
        order = []
        for batch in loader:
            for row, caption in enumerate(batch["caption"]):
                i = next(k for k, s in enumerate(samples) if s["caption"] == caption)
                order.append(i)
                item, window = ds[i], ds.augment_params(i, epoch)
                assert torch.equal(batch["image"][row], item["image"]), (i, epoch)
                for name in ("mask", "depth"):
                    assert torch.equal(batch[name][row], item[name]), (name, i, epoch)
                want = nearest_expected(samples[i]["mask"], window.top, window.left, window.height, window.width,
                                        size, window.flipped)
                assert np.array_equal(batch["mask"][row].numpy(), want)
        assert sorted(order) == list(range(len(samples)))


def test_fields_tuple_with_a_read_time_crop(fields_wds):
    dest, samples = fields_wds
    ds = packer.open_dataset(dest, resize=36, center_crop=30, fields=("mask", "image"))
    masks, images = next(iter(packer.stream(dest, 4, shuffle=False, num_workers=0, resize=36, center_crop=30,
                                            fields=("mask", "image"))))
    assert masks.shape == (4, 30, 30) and images.shape == (4, 3, 30, 30)
    for i in range(4):
        mask, image = ds[i]
        assert torch.equal(masks[i], mask) and torch.equal(images[i], image)


def test_a_key_that_is_not_a_number_draws_its_window_from_its_crc32(quick_start, tmp_path):
    """Shards whose keys are strings (as other tools write them): each sample's window is the one of index
    ``crc32(key)``, the same in every run."""
    source = quick_start
    dest = tmp_path / "renamed"
    shutil.copytree(source, dest)
    keys = []
    for shard in sorted(dest.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar if m.isfile()]
        with tarfile.open(shard, "w") as tar:
            for member, data in members:
                key, ext = member.name.split(".", 1)
                member.name = f"img-{key}.{ext}"
                if not keys or keys[-1] != member.name.split(".")[0]:
                    keys.append(member.name.split(".")[0])
                tar.addfile(member, io.BytesIO(data))
    options = {"random_resized_crop": 32, "flip": True, "seed": 4}
    ds = packer.open_dataset(source, **options)
    ds.reader.open()
    images, _ = streamed(packer.stream(dest, 16, shuffle=False, num_workers=0, **options), 1)
    for i in range(0, len(ds), 7):
        want = ds.decode_array(zlib.crc32(keys[i].encode()), ds.reader.read(i), epoch=1)
        assert torch.equal(images[i], torch.from_numpy(np.array(want)).permute(2, 0, 1)), i


def test_a_samples_index_is_its_key():
    assert key_index("000000042") == 42 and key_index("7") == 7
    assert key_index("n01440764_10026") == zlib.crc32(b"n01440764_10026")
    assert key_index("٣") == zlib.crc32("٣".encode())  # a digit, but not ASCII: not a number here


@pytest.mark.parametrize("kwargs, name", [
    ({"resize": 0}, "size"), ({"center_crop": "x"}, "size"), ({"random_resized_crop": 0}, "random_resized_crop"),
    ({"random_resized_crop": 16, "scale": (0.5, 0.1)}, "scale"), ({"random_resized_crop": 16, "ratio": (1, 0)},
                                                                   "ratio"),
    ({"flip": "yes"}, "flip"), ({"decoder": "gpu"}, "decoder"),
    ({"random_resized_crop": 16, "resize": 20}, "random_resized_crop"),
])
def test_a_bad_transform_argument_is_one_line_at_the_call(quick_start, kwargs, name):
    dest = quick_start
    one_line_value_error(lambda: packer.stream(dest, 4, num_workers=0, **kwargs), name)

"""The default decoder's read-time resize and centre crop against ``decoder="pil"`` (torchvision's ``Resize`` +
``CenterCrop`` on PIL images): within one level on every sample_data photograph, through ``ds[i]`` and through
the loader's batch rows, in every format; most of all where the resize enlarges the stored image (stores whose
long side is capped at 256, FFCV's geometry, read with ``resize=256, center_crop=224``), the validation row
that OpenCV's kernel now makes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.packed import FORMATS, hwc

import packer
from packer.reading.fidelity import compare

# name: (pack options, read-time geometry)
CASES = {
    "jpeg-max256": ({"store": "jpeg", "max_size": 256}, {"resize": 256, "center_crop": 224}),
    "raw-max256": ({"store": "raw", "max_size": 256}, {"resize": 256, "center_crop": 224}),
    "grey-max96": ({"store": "jpeg", "max_size": 96, "mode": "L"}, {"resize": 112, "center_crop": "100x90"}),
    "exact-size": ({"store": "jpeg", "max_size": 96}, {"resize": "130x120"}),
    "shrinks": ({"store": "jpeg", "max_size": 96}, {"resize": 64, "center_crop": 56}),  # Pillow's kernel
    "pads": ({"store": "jpeg", "max_size": 96}, {"resize": 64, "center_crop": 80}),  # the crop pads with zeros
}


@pytest.fixture(scope="module")
def packed(tmp_path_factory, sample_data):
    done: dict[tuple[str, str], object] = {}

    def get(fmt: str, case: str):
        if (fmt, case) not in done:
            dest = tmp_path_factory.mktemp(f"{fmt}-{case}") / "ds"
            packer.pack(sample_data, dest, fmt, progress=False, workers=2, **CASES[case][0])
            done[fmt, case] = dest
        return done[fmt, case]

    return get


def within_one_level(ds, pil) -> list[np.ndarray]:
    """Every sample of ``ds`` against ``pil``'s; the images of ``ds``, in order."""
    images = []
    for i in range(len(ds)):
        got, label = ds[i]
        want, want_label = pil[i]
        assert label == want_label and got.shape == want.shape, ds.relpath(i)
        diff = np.abs(hwc(got).astype(np.int16) - hwc(want).astype(np.int16))
        assert diff.max() <= 1, (ds.relpath(i), int(diff.max()))
        images.append(hwc(got))
    return images


def assert_batches_equal(ds, images: list[np.ndarray]) -> None:
    """The loader's batch rows (the row decoders) give ``ds[i]``'s pixels exactly."""
    seen = 0
    for batch, _ in packer.make_loader(ds, batch_size=16, num_workers=0, shuffle=False):
        for image in batch:
            assert np.array_equal(hwc(image), images[seen]), ds.relpath(seen)
            seen += 1
    assert seen == len(images) == len(ds)


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_within_one_level_of_pil_where_the_resize_enlarges(packed, fmt):
    data = packed(fmt, "jpeg-max256")
    ds = packer.open_dataset(data, **CASES["jpeg-max256"][1])
    pil = packer.open_dataset(data, decoder="pil", **CASES["jpeg-max256"][1])
    ds.reader.open()
    shapes = {tuple(ds.reader.read(i).shape[:2]) for i in range(len(ds))}
    assert sum(min(s) < 256 for s in shapes) > 20  # enlarged at many scales (a square one is only cropped)
    images = within_one_level(ds, pil)
    assert_batches_equal(ds, images)


@pytest.mark.parametrize("case", [c for c in CASES if c != "jpeg-max256"])
def test_default_within_one_level_of_pil(packed, case):
    data = packed("lmdb", case)
    ds = packer.open_dataset(data, **CASES[case][1])
    pil = packer.open_dataset(data, decoder="pil", **CASES[case][1])
    images = within_one_level(ds, pil)
    if ds.output_shape() is not None:
        assert_batches_equal(ds, images)


def test_fidelity_measures_the_default_against_pil(packed):
    """``reading.fidelity.compare``, which gives the docs' figures: the default against ``decoder="pil"`` where
    the resize enlarges is at most one level apart and not identical everywhere (so at least 48.1 dB, the PSNR of
    one level on every channel), ``"pil"`` against itself is identical, and no samples is an error."""
    view = CASES["jpeg-max256"][1]
    data = packed("lmdb", "jpeg-max256")
    auto, pil = (packer.open_dataset(data, decoder=name, **view).decoding for name in ("auto", "pil"))
    for decoding in (auto, pil):
        decoding.reader.open()
    indices = range(len(auto.reader))
    got = compare(auto, pil, indices)
    assert got.samples == len(indices) and got.max_diff == 1 and 0 < got.identical < 1
    assert 48.1 < got.worst_psnr <= got.median_psnr < math.inf
    same = compare(pil, pil, indices)
    assert (same.worst_psnr, same.max_diff, same.identical) == (math.inf, 0, 1.0)
    with pytest.raises(ValueError, match="no samples"):
        compare(auto, pil, [])

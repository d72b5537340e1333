"""FFCV: ``DatasetWriter`` into one ``.beton`` file, read by ``ffcv.loader.Loader`` with its JIT-compiled pipeline.

Writer (FFCV's ImageNet recipe, cut to this benchmark's resolution): ``RGBImageField(write_mode=...,
max_resolution=256)`` plus ``IntField`` for the label, ``num_workers`` = 2. ``max_resolution`` caps the LONGER
side at 256 (FFCV's rule, OpenCV INTER_AREA), so stored images are smaller than the others' (short side ~190).
``jpg`` re-encodes (FFCV's default quality 90); ``raw`` stores the pixels.

Reader: FFCV's own decode+crop, ``CenterCropRGBImageDecoder((224, 224), ratio=224/256)`` (the centre square of
224/256 of the short side, resized with OpenCV to 224), then ``ToTensor`` and ``ToTorchImage`` (uint8 NCHW).
This is FFCV's recommended validation pipeline, not Pillow: running Pillow inside it would defeat its design.
Training rows read the same betons with FFCV's ImageNet training pipeline: ``RandomResizedCropRGBImageDecoder((224,
224))`` (the window is decoded and resized in one step; default scale and ratio) and FFCV's
``RandomHorizontalFlip()``, then ``ToTensor``, ``ToTorchImage``.
FFCV's ``num_workers`` are threads in one process. Epoch 1 includes numba's JIT compilation.
Orders: RANDOM with ``os_cache=True`` (the data fits in memory; FFCV's advice) and QUASI_RANDOM with
``os_cache=False`` (FFCV's own page-aware cache, for data bigger than memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

from _common import CROP, RESIZE, Variant, main, package_versions

TOOL = "ffcv"
NOTE = "FFCV's own pipeline: long side capped at 256 when written, OpenCV centre-crop+resize, not Pillow"
VARIANTS = [
    Variant("jpg/random+os_cache", "jpg", {"write_mode": "jpg", "order": "RANDOM", "os_cache": True,
                                           "work": "decode <=256+resize", "notes": NOTE}),
    Variant("jpg/quasi_random", "jpg", {"write_mode": "jpg", "order": "QUASI_RANDOM", "os_cache": False,
                                        "work": "decode <=256+resize", "notes": NOTE}),
    Variant("raw/random+os_cache", "raw", {"write_mode": "raw", "order": "RANDOM", "os_cache": True,
                                           "work": "resize <=256", "notes": NOTE}),
    Variant("jpg/random+os_cache", "jpg", {"write_mode": "jpg", "order": "RANDOM", "os_cache": True,
                                           "work": "decode <=256+RRC", "notes": NOTE}, "train"),
    Variant("raw/random+os_cache", "raw", {"write_mode": "raw", "order": "RANDOM", "os_cache": True,
                                           "work": "RRC <=256", "notes": NOTE}, "train"),
]


def versions() -> dict[str, str]:
    return package_versions("ffcv", "numba", "opencv-python", "torch", "numpy", "pillow")


class _Source:
    """The indexed dataset FFCV's writer wants: ``ds[i]`` -> (PIL RGB image, label)."""

    def __init__(self, samples: list):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as img:
            return img.convert("RGB"), label


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    dest.mkdir(parents=True, exist_ok=True)
    fields = {"image": RGBImageField(write_mode=variant.options["write_mode"], max_resolution=RESIZE),
              "label": IntField()}
    writer = DatasetWriter(str(dest / "data.beton"), fields, num_workers=2)
    writer.from_indexed_dataset(_Source(samples))
    return dest


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    if variant.pipeline == "train":
        image = [RandomResizedCropRGBImageDecoder((CROP, CROP)), RandomHorizontalFlip(), ToTensor(), ToTorchImage()]
    else:
        image = [CenterCropRGBImageDecoder((CROP, CROP), ratio=CROP / RESIZE), ToTensor(), ToTorchImage()]
    pipelines = {"image": image, "label": [IntDecoder(), ToTensor(), Squeeze()]}
    return Loader(str(data / "data.beton"), batch_size=batch_size, num_workers=workers,
                  order=getattr(OrderOption, variant.options["order"]), os_cache=variant.options["os_cache"],
                  drop_last=False, pipelines=pipelines)


if __name__ == "__main__":
    main(sys.modules[__name__])

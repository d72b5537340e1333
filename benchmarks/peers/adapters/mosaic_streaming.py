"""MosaicML Streaming: ``MDSWriter`` shards, read by ``StreamingDataset`` in a torch ``DataLoader``.

Writer (Streaming's ImageNet conversion): ``MDSWriter(out=DEST, columns={"image": "jpeg", "label": "int"})``
given ``PIL.Image.open(path)`` per sample. Streaming's ``jpeg`` encoding stores a JPEG file's original bytes
(it reads ``img.filename``); the few PNGs are not JPEGs, so the encoding re-encodes them as JPEG. Default shard
size limit (67 MB), no compression. One writer process, as in Streaming's examples.

Reader: a ``StreamingDataset(local=DEST, remote=None, shuffle=True, batch_size=64)`` subclass whose
``__getitem__`` applies the shared Pillow resize+crop (val) or torchvision's RandomResizedCrop + flip (train)
to the decoded PIL image, in a torch ``DataLoader``
(``num_workers``, ``persistent_workers=True``). Stale shared memory from an earlier crashed run is cleaned
first, as Streaming advises.

Not ``streaming.py``: that name would shadow the library.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from _common import Variant, main, package_versions, pipeline_transform

TOOL = "streaming"
VARIANTS = [Variant("MDSWriter(jpeg)+StreamingDataset", "mds",
                    {"notes": "PNG sources are re-encoded as JPEG by the 'jpeg' encoding"}, pipeline)
            for pipeline in ("val", "train")]


def versions() -> dict[str, str]:
    return package_versions("mosaicml-streaming", "torch", "torchvision", "pillow")


def prepare(variant: Variant, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    import streaming  # noqa: F401 - imported here so the import is not timed as conversion


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    from PIL import Image
    from streaming import MDSWriter

    with MDSWriter(out=str(dest), columns={"image": "jpeg", "label": "int"}) as writer:
        for path, label in samples:
            with Image.open(path) as img:
                writer.write({"image": img, "label": label})
    return dest


def _dataset_class():
    from streaming import StreamingDataset

    class ImageDataset(StreamingDataset):
        def __init__(self, *args, image_transform=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.image_transform = image_transform

        def __getitem__(self, index: int):
            sample = super().__getitem__(index)
            return self.image_transform(sample["image"]), sample["label"]

    return ImageDataset


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import torch
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = _dataset_class()(local=str(data), remote=None, shuffle=True, shuffle_seed=0, batch_size=batch_size,
                          image_transform=pipeline_transform(variant))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                       persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])

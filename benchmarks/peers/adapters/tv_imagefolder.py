"""torchvision's ``ImageFolder``: the raw folder, no conversion, the classic transforms. The baseline of both
pipelines.

``ImageFolder(SRC, transform=...)`` in a torch ``DataLoader`` (``shuffle=True``, ``num_workers``,
``persistent_workers=True``), with ``Compose([Resize(256), CenterCrop(224), PILToTensor()])`` (val) or
``Compose([RandomResizedCrop(224), RandomHorizontalFlip(), PILToTensor()])`` (train). Pillow decodes and
resizes (bilinear with antialiasing, as Pillow always does). Needs torch 2.14.1 + torchvision 0.29.1 (its own
venv).

Not ``torchvision.py``: that name would shadow the library.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _common import CROP, RESIZE, Variant, main, package_versions, source_root, train_transform

TOOL = "torchvision"
VARIANTS = [Variant("ImageFolder/pil/workers", "source", {"notes": "reads the source folder"}, pipeline)
            for pipeline in ("val", "train")]


def versions() -> dict[str, str]:
    return package_versions("torchvision", "torch", "pillow")


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    return source_root(samples, classes)  # nothing to convert: the folder is read as it is


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import torch
    from torchvision import datasets, transforms

    if variant.pipeline == "train":
        tf = train_transform()
    else:
        tf = transforms.Compose([transforms.Resize(RESIZE), transforms.CenterCrop(CROP), transforms.PILToTensor()])
    ds = datasets.ImageFolder(str(data), transform=tf)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                       persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])

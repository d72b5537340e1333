"""The plain image folder read like torchvision's ImageFolder: ``packer.FolderDataset(decoder="pil")``.

Our stand-in for ``torchvision.datasets.ImageFolder`` + ``Resize(256)`` + ``CenterCrop(224)`` + ``PILToTensor``
where torchvision cannot be imported beside the project's torch. Every image is decoded with Pillow, resized
then cropped (no fused resize), one image at a time in 2 DataLoader worker processes, as an ImageFolder user
would run it. Nothing is converted: the source folder is what is read. The training row uses packer's
read-time ``random_resized_crop=224, flip=True`` (Pillow, ``decoder="pil"``), once packer has it (issue 10).
"""

from __future__ import annotations

import sys
from pathlib import Path

from _common import CROP, RESIZE, Variant, main, package_versions, source_root
from packer_rows import check  # noqa: F401 - the same check: the training row needs packer's RRC (issue 10)

TOOL = "ImageFolder stand-in"
VARIANTS = [Variant("FolderDataset(pil)/workers", "source", {"notes": "reads the source folder"}, pipeline)
            for pipeline in ("val", "train")]


def versions() -> dict[str, str]:
    return package_versions("packer", "torch", "pillow")


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    return source_root(samples, classes)  # nothing to convert: the folder is read as it is


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import torch

    from packer import FolderDataset

    if variant.pipeline == "train":
        ds = FolderDataset(data, decoder="pil", random_resized_crop=CROP, flip=True, seed=0)
    else:
        ds = FolderDataset(data, decoder="pil", resize=RESIZE, center_crop=CROP)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                       persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])

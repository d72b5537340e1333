"""Hugging Face ``datasets``: Arrow files with the JPEG/PNG bytes embedded, memory-mapped when read.

Writer (the library's documented way for an ImageFolder layout): ``load_dataset("imagefolder", data_dir=SRC)``
(labels from the folder names, an ``Image()`` column that first holds paths), then ``save_to_disk(DEST)``,
which embeds each file's original bytes in the Arrow table. The builder's cache goes to a scratch ``HF_HOME``
inside the work folder and is not counted as bytes on disk; it is deleted before each conversion so nothing is
reused.

Reader (the "use with PyTorch" docs): ``load_from_disk(DEST)`` (memory-maps the Arrow file), ``set_transform``
with the shared Pillow pipeline (val) or torchvision's RandomResizedCrop + flip (train) (the Image feature
decodes each row to a PIL image), and a torch ``DataLoader`` (``shuffle=True``, ``num_workers``,
``persistent_workers=True``).

The module is not called ``datasets.py``: the script's folder is first on ``sys.path`` and would shadow the
library.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from _common import Variant, main, package_versions, pipeline_transform, source_root

TOOL = "datasets"
VARIANTS = [Variant("arrow/imagefolder+save_to_disk", "arrow", pipeline=pipeline) for pipeline in ("val", "train")]


def versions() -> dict[str, str]:
    return package_versions("datasets", "pyarrow", "torch", "pillow")


def prepare(variant: Variant, dest: Path) -> None:
    home = dest.parent / "hf-home"
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    os.environ["HF_HOME"] = str(home)  # read when datasets is first imported
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets  # noqa: F401 - imported here so the import is not timed as conversion


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    import datasets

    ds = datasets.load_dataset("imagefolder", data_dir=str(source_root(samples, classes)), split="train")
    if ds.num_rows != len(samples):
        raise RuntimeError(f"imagefolder found {ds.num_rows} images, the scan {len(samples)}")
    ds.save_to_disk(str(dest))
    return dest


class _ToTensors:
    """``set_transform``'s function: a batch of rows with PIL images -> CHW uint8 tensors."""

    def __init__(self, variant: Variant):
        self.transform = pipeline_transform(variant)

    def __call__(self, batch: dict) -> dict:
        return {"image": [self.transform(img) for img in batch["image"]], "label": batch["label"]}


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import datasets
    import torch

    ds = datasets.load_from_disk(str(data))
    ds.set_transform(_ToTensors(variant))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                       persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])

"""The pipelines ``packer bench`` measures: ``val`` (read-time resize and centre crop) and ``train``
(``random_resized_crop`` + ``flip`` fused into decoding).

The train pipeline's baseline is the folder read as torchvision's ImageFolder + ``RandomResizedCrop`` +
``RandomHorizontalFlip`` would: ``FolderDataset(decoder="pil", random_resized_crop=SIZE, flip=True)``, Pillow
for every image and exactly torchvision's pixels. Packed datasets use the default (fast) decoder. Every row
gives SIZE x SIZE batches, the benchmark's output size, whatever the stored geometry.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..reading.dataset import open_dataset
from ..reading.folder import FolderDataset

PIPELINES = ("val", "train")


def parse_pipelines(names: list[str]) -> list[str]:
    """Check ``--pipeline`` names: val, train or both."""
    bad = [n for n in names if n not in PIPELINES]
    if bad or not names:
        raise UsageError(f"unknown pipeline {', '.join(bad) or '(none)'}; choose val, train or val,train")
    return list(dict.fromkeys(names))


def train_size(read_resize: Any, read_crop: Any) -> tuple[int, int]:
    """The random resized crop's (height, width): the benchmark's output size, given as (width, height)."""
    size = read_crop or read_resize
    return (size, size) if isinstance(size, int) else (size[1], size[0])


def open_train(dataset: str, root: Any, size: tuple[int, int]) -> Any:
    """The dataset read through the train pipeline: the folder with Pillow (the baseline), a packed one with the
    default decoder."""
    if dataset == "folder":
        return FolderDataset(root, decoder="pil", random_resized_crop=size, flip=True)
    return open_dataset(root, random_resized_crop=size, flip=True)

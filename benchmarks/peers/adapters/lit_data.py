"""LitData: ``optimize`` into chunk files, read by ``StreamingDataset`` + ``StreamingDataLoader``.

Writer (LitData's README, "best practice"): ``optimize(fn, inputs, output_dir, num_workers=2,
chunk_bytes="64MB")`` where ``fn`` returns ``{"image": litdata.Image(path=...), "label": int}``: ``Image(path=...)``
stores the file's own bytes (JPEG or PNG), not a re-encoding. ``optimize`` runs its own worker processes.

Reader: ``StreamingDataset(DEST, shuffle=True)`` reading the local chunks in place, and ``StreamingDataLoader``
(batch 64, ``num_workers``, ``persistent_workers=True``). LitData decodes images itself (torchvision's
libjpeg-turbo ``decode_jpeg``, to an RGB CHW tensor); the tensor is then handed to Pillow for the shared
resize 256 + centre-crop 224, which costs one extra copy per image (val); for train, torchvision's
RandomResizedCrop + flip run on that tensor, as a LitData user would write them. The PyPI version check is turned off
(``LITDATA_DISABLE_VERSION_CHECK=1``) so no network call lands inside a timing.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from _common import Variant, main, package_versions, train_transform, transform

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

TOOL = "litdata"
VARIANTS = [Variant("optimize/Image(path)", "chunks", {"notes": "LitData decodes to a tensor; Pillow resizes"}),
            Variant("optimize/Image(path)", "chunks", {"notes": "LitData decodes to a tensor; torchvision's "
                                                                "RandomResizedCrop + flip on it"}, "train")]


def versions() -> dict[str, str]:
    return package_versions("litdata", "torch", "torchvision", "pillow")


def prepare(variant: Variant, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    import litdata  # noqa: F401 - imported here so the import is not timed as conversion


def _item(sample: tuple[str, int]) -> dict:
    import litdata

    path, label = sample
    return {"image": litdata.Image(path=path), "label": label}


def pack(variant: Variant, samples: list, classes: list, dest: Path) -> Path:
    import litdata

    litdata.optimize(fn=_item, inputs=[(str(p), label) for p, label in samples], output_dir=str(dest),
                     num_workers=2, chunk_bytes="64MB", verbose=False)
    return dest


class _ToPil:
    """LitData's decoded CHW tensor -> PIL -> the shared Pillow resize+crop -> CHW uint8."""

    def __call__(self, item: dict) -> tuple:
        from PIL import Image

        image = item["image"]
        pil = Image.fromarray(image.permute(1, 2, 0).numpy()) if hasattr(image, "permute") else image
        return transform(pil), item["label"]


class _Train:
    """torchvision's RandomResizedCrop + flip on LitData's decoded CHW uint8 tensor."""

    def __init__(self):
        self.transform = train_transform()

    def __call__(self, item: dict) -> tuple:
        image = item["image"]
        if not hasattr(image, "permute"):  # a PIL image
            image = image.convert("RGB")
        return self.transform(image), item["label"]


def make_loader(variant: Variant, data: Path, batch_size: int, workers: int):
    import litdata

    per_item = _Train() if variant.pipeline == "train" else _ToPil()
    ds = litdata.StreamingDataset(str(data), shuffle=True, transform=per_item)
    return litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers,
                                       persistent_workers=workers > 0)


if __name__ == "__main__":
    main(sys.modules[__name__])

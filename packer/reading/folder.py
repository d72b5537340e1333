"""``FolderDataset``: the raw image folder read with ImageFolder semantics, the baseline packed formats beat.

It scans like :func:`packer.sources.folder.scan_folder` and decodes like every packed reader (same ``resize``,
``center_crop``, ``transform`` and ``decoder`` arguments), so it gives the same pixels as a dataset packed with
``store=original`` from the same folder. Per-sample metadata is held in numpy arrays, not Python lists, so
DataLoader workers do not copy it page by page (pytorch issue 13246).
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import ImageError
from ..formats.base import Reader, Sample
from ..images.transforms import TransformSpec
from ..sources.folder import scan_folder
from .dataset import PackedDataset


class FolderDatasetReader(Reader):
    """The image files of an ImageFolder-layout folder, scanned with :func:`packer.scan_folder`: a sample's
    payload is its file's bytes."""

    format = "folder"

    def __init__(self, root: str | os.PathLike, manifest: dict | None = None, include_hidden: bool = False):
        scan = scan_folder(root, include_hidden=include_hidden)
        manifest = {"format": "folder", "count": len(scan.samples), "classes": scan.classes,
                    "class_to_idx": scan.class_to_idx, "transform": TransformSpec().to_dict(), "shape": None}
        super().__init__(root, manifest)
        paths = [rel.encode("utf-8") for rel, _ in scan.samples]
        self._paths = np.array(paths, dtype=bytes)
        self.labels = np.array([label for _, label in scan.samples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def _open(self) -> None:
        pass

    def read(self, index: int) -> Sample:
        path = self.root / self.relpath(index)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ImageError(str(path), f"cannot read file: {exc.strerror}") from None
        return Sample(data, int(self.labels[index]), (0, 0, 0), None)

    def relpath(self, index: int) -> str:
        return self._paths[index].decode("utf-8")

    def describe(self, index: int) -> str:
        return str(self.root / self.relpath(index))

    def sample_file(self, index: int) -> str:
        return self.relpath(index)


class FolderDataset(PackedDataset):
    """An ImageFolder-layout folder (``root/<class>/**/<image>``) as a Dataset of ``(CHW uint8 tensor, label)``:
    ``FolderDataset(root, include_hidden=False, ...)`` with the arguments of every packed dataset.

    ``decoder="pil"`` decodes every image with Pillow, as torchvision's ImageFolder does; the default uses
    simplejpeg for JPEGs, which gives the same pixels faster."""

    reader_class = FolderDatasetReader
    reader: FolderDatasetReader

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(path, label)`` pairs as ImageFolder's ``samples``, with full paths."""
        labels = self.reader.labels
        return [(str(self.root / self.relpath(i)), int(labels[i])) for i in range(len(self))]

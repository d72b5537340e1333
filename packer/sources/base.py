"""The two interfaces every source implements: a :class:`Source` (what is converted) and the picklable
:class:`SampleReader` a worker process converts its samples with. The kinds of source are in
:mod:`packer.sources.detect` and :mod:`packer.sources.table`."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import ImageError
from ..fields import PAIR_SCHEMA, Field
from ..images.transforms import Encoded, TransformSpec


class SampleReader:
    """Reads and converts one sample of a source, in a worker process. Picklable; opens its handles lazily."""

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        """``(relpath, label, encoded, extras)`` of source sample ``index`` (``extras``: the stored bytes of the
        source's extra fields, :func:`packer.fields.extra_fields`); raises :class:`ImageError` naming the relpath
        (or ``sample N`` when even that could not be read)."""
        raise NotImplementedError

    def name(self, index: int) -> str:
        """How messages name source sample ``index`` when converting it failed unexpectedly."""
        return f"sample {index}"


class Source:
    """Base of the three kinds of source. Attributes every kind sets:

    ``kind`` ("folder", "packed", "shards"), ``root`` (a folder, for messages and to keep DEST out of it),
    ``classes``, ``class_to_idx``, ``count``, ``stored`` (what samples hold: "original" for image files, or the
    packed dataset's store), ``mode`` (RGB or L), ``shape`` (fixed (H, W, C) or None), ``shuffled`` (the order is
    already a shuffle), ``schema`` (the fields of a sample: :data:`packer.fields.PAIR_SCHEMA` unless the source has
    more), and the scan's ``hidden_skipped``, ``empty_classes``, ``errors`` [(relpath, why)] and ``loose_images``
    (an image folder's images beside its class folders, in no class: left out, as ImageFolder leaves them)."""

    kind = ""
    stored = "original"
    mode = "RGB"
    shape: list[int] | None = None
    shuffled = False
    schema: list[Field] = list(PAIR_SCHEMA)

    def __init__(self, root: Path, classes: list[str], count: int):
        self.root = root
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.count = count
        self.hidden_skipped = 0
        self.empty_classes: list[str] = []
        self.errors: list[tuple[str, str]] = []
        self.loose_images: list[str] = []

    def sizes(self) -> np.ndarray:
        """Bytes of each sample (an estimate where the source does not record it), int64, one per sample."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def reader(self) -> SampleReader:
        raise NotImplementedError

    def where(self, relpath: str) -> str:
        """How messages name a sample."""
        return f"{relpath} in {self.root}"

    def describe(self) -> dict[str, Any]:
        """The manifest's ``source`` entry (the converter adds ``images`` and ``bytes``)."""
        return {"kind": self.kind, "root": str(self.root.resolve())}

    @property
    def key(self) -> str:
        """What the journal records as the source (a resumed conversion must name the same one)."""
        return str(self.root.resolve())

    @property
    def default_store(self) -> str | None:
        """The store to use when none is given (None: the converter's usual choice)."""
        return None

    def check(self, spec: TransformSpec) -> None:
        """Refuse a conversion this source cannot give (``store=original`` of decoded pixels)."""

    def dest_problem(self, dest: Path) -> str | None:
        """Why ``dest`` cannot be the output (it would hold the source, or be inside it), else None."""
        src_r, dest_r = self.root.resolve(), dest.resolve()
        if dest_r == src_r or src_r.is_relative_to(dest_r):
            return f"{dest}: the destination would contain the source; choose another folder"
        if dest_r.is_relative_to(src_r):
            return (f"{dest}: the destination is inside the source folder {self.root}, so packing would change the "
                    "source; choose a folder outside it")
        return None


def image_size(data: bytes, name: str) -> tuple[int, int]:
    """The (width, height) of an image file's bytes, from its header: the size a mask of the sample must have.

    Raises:
        ImageError: the bytes are not an image Pillow can open (``name`` is the sample in the message).
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (OSError, ValueError) as exc:
        raise ImageError(name, f"cannot read the image ({exc})") from None

"""WebDataset shards other tools wrote (``webdataset.ShardWriter``, img2dataset...), as a source: their members
scanned once, every member beyond the image and the label kept as a field."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import warn
from ..fields import label_field
from ..formats import foreign_reader
from .base import SampleReader, Source
from .packed import DatasetReader


class ShardsSource(Source):
    """``.tar`` shards from any WebDataset writer: one sample per key with an image member and an integer label
    read from ``label_key`` (``cls``, ``txt``, ``json:FIELD``...)."""

    kind = "shards"

    def __init__(self, paths: list[Path], label_key: str | None = None, pattern: str | None = None):
        reader = foreign_reader(paths, label_key=label_key)
        super().__init__(reader.root, reader.classes, len(reader))
        self.errors = list(reader.skipped)  # link and repeated members: warned about and listed in the manifest
        self.stored_reader = reader
        self.paths = [Path(p) for p in paths]
        self.label_key = label_key or ""
        self.schema = list(reader.schema)
        if label_field(self.schema) is None:
            warn(f"{paths[0]}: no sample has a .cls member, so the samples get no class; pass --label-key "
                 "(txt, json:FIELD...) to take one from another member")
        self.pattern = pattern
        present: np.ndarray | list[int] = reader.class_counts() if self.classes else []
        self.empty_classes = [c for c, n in zip(self.classes, present, strict=False) if n == 0]

    def sizes(self) -> np.ndarray:
        sizes = self.stored_reader.stored_sizes()
        return sizes if sizes is not None else np.ones(self.count, np.int64)

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.label_key.encode())
        for path in self.paths:
            st = os.stat(path)
            h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def reader(self) -> SampleReader:
        return DatasetReader(self.stored_reader)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "shards": [str(p.resolve()) for p in self.paths], "label_key": self.label_key}

    @property
    def key(self) -> str:
        return self.pattern or super().key


# -- telling them apart --------------------------------------------------------------------------------------------
def _shards_in(folder: Path) -> list[Path] | None:
    """The .tar files of a folder of shards: .tar files and no (visible) sub-folders. None if it is not one."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    if any(e.is_dir() and not e.name.startswith(".") for e in entries):
        return None
    tars = sorted(folder / e.name for e in entries if e.name.endswith(".tar") and e.is_file())
    return tars or None

"""A dataset packer packed, as a source: repacking it into another format or store, its samples read through
its format's reader, its fields kept."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError, PackerError, SourceError
from ..formats import Reader, open_reader
from ..images.transforms import MAX_SIDE, Encoded, TransformSpec, convert_array, convert_bytes
from .base import SampleReader, Source


# -- packed datasets and shards ------------------------------------------------------------------------------------
class DatasetReader(SampleReader):
    """Reads the stored bytes (or array) of a packed dataset or of foreign shards and converts them."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        reader = self.reader
        relpath = f"sample {index}"
        try:
            reader.open()
            relpath = reader.relpath(index)
            sample = reader.checked(index, reader.read(index))
            # the fields as stored (second images and masks too: repacking keeps them, it does not re-transform)
            extras = tuple(bytes(v) for v in reader.read_fields(index, verify=True).values())
            array = reader.stored_array(index, sample)
            if array is not None:
                encoded = convert_array(array, relpath, spec)
            else:
                encoded = convert_bytes(bytes(sample.payload), relpath, spec)
        except ImageError as exc:
            raise ImageError(relpath, exc.reason) from None
        except PackerError as exc:  # a damaged record or shard: skipped (or fatal with --strict) like a bad image
            raise ImageError(relpath, str(exc)) from None
        if max(encoded.shape[:2]) > MAX_SIDE:
            raise ImageError(relpath, f"{encoded.shape[1]}x{encoded.shape[0]} has a side over {MAX_SIDE} pixels; "
                                      "shrink it (--max-size)")
        return relpath, sample.label, encoded, extras


class PackedSource(Source):
    """A dataset packed by packer (any format): samples are read back as stored, checksums checked."""

    kind = "packed"

    def __init__(self, root: str | os.PathLike):
        root = Path(root)
        reader = open_reader(root)
        reader.open()  # a damaged or unreadable data file is one error here, not one skipped line per sample
        manifest = reader.manifest
        super().__init__(root, reader.classes, len(reader))
        if reader.spec.normalize:
            raise SourceError(f"{root}: stores normalized {reader.spec.dtype} arrays, which cannot be turned back "
                              "into pixels; re-pack from the original image folder")
        self.stored_reader = reader
        self.manifest = manifest
        self.schema = list(reader.schema)
        self.stored = reader.spec.store
        self.mode = reader.spec.mode
        self.shape = manifest.get("shape")
        self.shuffled = bool((manifest.get("order") or {}).get("shuffle"))
        self.empty_classes = list(manifest.get("empty_classes") or [])
        if self.count == 0:
            raise SourceError(f"{root}: the dataset holds no samples; nothing to pack")

    def sizes(self) -> np.ndarray:
        total = sum(int(f.get("bytes", 0)) for f in self.manifest["files"])
        return np.full(self.count, max(1, total // max(1, self.count)), np.int64)

    def fingerprint(self) -> str:
        m = self.manifest
        return hashlib.sha256(json.dumps([m["format"], m["count"], m["classes"], m["files"]],
                                         sort_keys=True).encode()).hexdigest()

    def reader(self) -> SampleReader:
        return DatasetReader(self.stored_reader)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "format": self.manifest["format"], "store": self.stored,
                "transform": self.manifest["transform"]}

    @property
    def default_store(self) -> str | None:
        return "raw" if self.stored == "raw" else None

    def check(self, spec: TransformSpec) -> None:
        if self.stored == "raw" and spec.store == "original":
            raise SourceError(f"{self.root}: stores decoded pixels (store raw), so there are no original file bytes "
                              "to keep; choose --store raw (the default for this source), png or jpeg")

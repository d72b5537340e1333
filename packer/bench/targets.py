"""What is measured: the store variants, and the datasets under test (packed ones and the folder baseline)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PackerError, UsageError
from ..images.transforms import STORES, as_pair, parse_size
from ..manifest import read_local_manifest
from ..packing.pack import pack
from ..reading.dataset import open_dataset
from ..reading.folder import FolderDataset
from .cache import dataset_files
from .pipelines import open_train, train_size

Size = int | tuple[int, int] | None


def _size_text(size: Size) -> str:
    return f"{size[0]}x{size[1]}" if isinstance(size, tuple) else str(size)


@dataclass(frozen=True)
class Variant:
    """One way of packing: a storage mode with its offline resize and centre crop."""

    store: str
    resize: Size = None
    center_crop: Size = None

    @property
    def label(self) -> str:
        if not (self.resize or self.center_crop):
            return self.store
        return f"{self.store} {_size_text(self.resize) if self.resize else '-'}" + (
            f"/{_size_text(self.center_crop)}" if self.center_crop else "")

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "-").replace("/", "-")


def parse_variant(text: str, resize: Size = None, center_crop: Size = None) -> Variant:
    """``jpeg`` (with the default ``resize``/``center_crop``), ``original``, or ``STORE:RESIZE[/CROP]`` such as
    ``jpeg:256`` (resized, cropped at read time) or ``raw:256/224``; ``jpeg:/224`` crops only."""
    store, _, geometry = text.strip().partition(":")
    if store not in STORES:
        raise UsageError(f"unknown store {store!r} in {text!r}; choose from {', '.join(STORES)}")
    if geometry:
        r, _, c = geometry.partition("/")
        resize, center_crop = parse_size(r) if r else None, parse_size(c) if c else None
    if store == "original":
        if geometry and (resize or center_crop):
            raise UsageError(f"{text!r}: store original keeps the file's bytes, so it cannot resize or crop")
        return Variant("original")
    return Variant(store, resize, center_crop)


def read_geometry(manifest: dict[str, Any], read_resize: Size, read_crop: Size) -> tuple[Size, Size]:
    """The read-time (resize, center_crop) that bring a packed dataset's images to the benchmark's output size:
    none when it is stored at that size, only the crop when it was stored resized to ``read_resize``."""
    crop = as_pair(read_crop)
    shape = manifest.get("shape")
    if shape and crop and (shape[0], shape[1]) == (crop[1], crop[0]):
        return None, None
    t = manifest.get("transform", {})
    stored_resize = tuple(t["resize"]) if isinstance(t.get("resize"), list) else t.get("resize")
    if read_resize and stored_resize == read_resize and not t.get("center_crop") and not t.get("max_size"):
        return None, read_crop
    return read_resize, read_crop


@dataclass
class Target:
    """A dataset under test: a packed one or the folder baseline."""

    dataset: str  # lmdb, hdf5, wds or folder
    store: str  # the variant's label, or "files" for the folder
    store_mode: str
    root: Path
    count: int
    bytes_on_disk: int
    read_resize: Size
    read_crop: Size
    decoder: str = "auto"
    pack_resize: Size = None
    pack_crop: Size = None
    conversion: dict[str, Any] | None = None
    files: list[Path] = field(default_factory=list)
    pipeline: str = "val"  # or "train": read_crop is then the random resized crop's size (pipelines)

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes_on_disk / max(1, self.count)

    def open(self) -> Any:
        if self.pipeline == "train":
            return open_train(self.dataset, self.root, train_size(self.read_resize, self.read_crop))
        if self.dataset == "folder":
            return FolderDataset(self.root, decoder="pil", resize=self.read_resize, center_crop=self.read_crop)
        return open_dataset(self.root, resize=self.read_resize, center_crop=self.read_crop)


def folder_target(src: Path, read_resize: Size, read_crop: Size) -> Target:
    ds = FolderDataset(src)
    files = [src / ds.relpath(i) for i in range(len(ds))]
    size = sum(p.stat().st_size for p in files)
    return Target("folder", "files", "files", src, len(ds), size, read_resize, read_crop, decoder="pil",
                  files=files)


def packed_target(dest: Path, read_resize: Size, read_crop: Size, conversion: dict | None = None) -> Target:
    manifest = read_local_manifest(dest)
    t = manifest["transform"]
    resize = tuple(t["resize"]) if isinstance(t.get("resize"), list) else t.get("resize")
    crop = tuple(t["center_crop"]) if isinstance(t.get("center_crop"), list) else t.get("center_crop")
    crop = crop[0] if isinstance(crop, tuple) and crop[0] == crop[1] else crop
    variant = Variant(manifest["store"], resize, crop)
    if t.get("normalize"):
        raise PackerError(f"{dest}: stores normalized floats; the benchmark compares uint8 images, so pack it "
                          "without --normalize")
    r, c = read_geometry(manifest, read_resize, read_crop)
    size = sum(f["bytes"] for f in manifest["files"])
    return Target(manifest["format"], variant.label, variant.store, dest, int(manifest["count"]), size, r, c,
                  pack_resize=resize, pack_crop=crop, conversion=conversion, files=dataset_files(dest))


def pack_target(src: Path, work: Path, fmt: str, variant: Variant, source_bytes: int, read_resize: Size,
                read_crop: Size, progress: bool) -> Target:
    dest = work / f"{fmt}-{variant.slug}"
    t = time.perf_counter()
    manifest = pack(src, dest, fmt, store=variant.store, resize=variant.resize, center_crop=variant.center_crop,
                    overwrite=True, progress=progress)
    seconds = time.perf_counter() - t
    size = sum(f["bytes"] for f in manifest["files"])
    conversion = {"dataset": fmt, "store": variant.label, "images": manifest["count"], "seconds": seconds,
                  "images_per_s": manifest["count"] / seconds, "bytes_on_disk": size,
                  "source_bytes": source_bytes, "size_vs_source": size / source_bytes if source_bytes else None}
    return packed_target(dest, read_resize, read_crop, conversion)


def existing_conversion(target: Target, source_bytes: int) -> dict[str, Any]:
    manifest = read_local_manifest(target.root)
    seconds = manifest.get("conversion_seconds")
    return {"dataset": target.dataset, "store": target.store, "images": target.count, "seconds": seconds,
            "images_per_s": target.count / seconds if seconds else None, "bytes_on_disk": target.bytes_on_disk,
            "source_bytes": source_bytes, "size_vs_source": target.bytes_on_disk / source_bytes if source_bytes
            else None}

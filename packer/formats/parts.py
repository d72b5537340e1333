"""A dataset converted by several ranks (``packer pack`` under torchrun), read as one.

DEST holds one folder per rank, ``part-00000``..., each a complete dataset of the format without a manifest of
its own, and one ``manifest.json`` whose ``parts`` list each folder, its sample count and the range of the output
order it holds; ``files`` and ``shards`` paths are relative to DEST (``part-00000/data.mdb``). Sample ``i`` is
found in the part whose cumulative counts contain it, so the order is the one a single process would give.
"""

from __future__ import annotations

import os
from typing import cast

import numpy as np

from ..errors import ManifestError
from ..manifest import MANIFEST, is_safe_relpath
from .base import Reader, Sample, get_format
from .layout import Layout, PrefixedSource, RangeSource, concat_layouts


def check_parts(manifest: dict, where: str) -> list[dict]:
    """The manifest's ``parts``, checked: a list of ``{"path", "count"}`` with safe paths, adding up to ``count``."""
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ManifestError(f"{where}: malformed 'parts'; the dataset is damaged, re-pack it")
    for entry in parts:
        count = entry.get("count") if isinstance(entry, dict) else None
        if (not is_safe_relpath(entry.get("path") if isinstance(entry, dict) else None)
                or not isinstance(count, int) or isinstance(count, bool) or count < 0):
            raise ManifestError(f"{where}: malformed entry in 'parts'; the dataset is damaged, re-pack it")
    if sum(e["count"] for e in parts) != manifest["count"]:
        raise ManifestError(f"{where}: the parts hold {sum(e['count'] for e in parts)} samples, the manifest says "
                            f"{manifest['count']}; the dataset is damaged, re-pack it")
    return parts


def part_manifest(manifest: dict, entry: dict) -> dict:
    """The manifest one part would have on its own: its count, and its files and shards relative to it (the
    whole dataset's ``class_counts`` are not the part's: left out)."""
    prefix = entry["path"].rstrip("/") + "/"
    sub = {k: v for k, v in manifest.items() if k not in ("parts", "class_counts")}
    sub["count"] = entry["count"]
    for key in ("files", "shards"):
        if key in manifest:
            sub[key] = [{**e, "path": e["path"][len(prefix):]} for e in manifest[key]
                        if isinstance(e, dict) and str(e.get("path", "")).startswith(prefix)]
    return sub


def dataset_layout(format_class: type[Reader], manifest: dict, source: RangeSource, where: str) -> Layout:
    """The :class:`~packer.formats.layout.Layout` of a dataset read a block at a time: its format's
    (:meth:`Reader.layout`), or for a conversion made in parts each part's, computed by the format over the
    part's folder and joined in the order :class:`PartedReader` gives the samples (empty parts left out)."""
    if manifest.get("parts") is None:
        return format_class.layout(manifest, source, where)
    root = str(where).rstrip("/")
    layouts = []
    for entry in check_parts(manifest, f"{root}/{MANIFEST}"):
        if entry["count"]:  # a rank whose images were all skipped holds no file the layout needs
            part = PrefixedSource(source, entry["path"])
            layouts.append((entry["path"], format_class.layout(part_manifest(manifest, entry), part,
                                                               f"{root}/{entry['path']}")))
    return concat_layouts(layouts, where, format_class.join_index)


def _within(part: str, damaged_files: set[str]) -> set[str]:
    """The damaged files of one part, relative to it."""
    return {f[len(part) + 1:] for f in damaged_files if f.startswith(part + "/")}


class PartedReader(Reader):
    """One reader over the parts of a distributed conversion: one reader of the format per part (each opens its
    handles lazily, per process), global index ``i`` mapped to (part, local index) through cumulative counts.
    :func:`packer.formats.open_reader` returns it for such a manifest; it takes the format reader's options."""

    ACCEPTS_PARTS = True

    def __init__(self, root: str | os.PathLike, manifest: dict | None = None, **options):
        super().__init__(root, manifest)
        self.format = self.manifest["format"]
        _, reader_cls = get_format(self.format)
        parts = check_parts(self.manifest, str(self.root / MANIFEST))
        self.readers: list[Reader] = []
        self.part_paths: list[str] = []
        self.key_offsets: list[int] = []  # WebDataset keys of a part start at its first position in the order
        counts = []
        for entry in parts:
            if entry["count"] == 0:
                continue  # a rank whose images were all skipped
            self.readers.append(reader_cls(self.root / entry["path"], manifest=part_manifest(self.manifest, entry),
                                           **options))
            self.part_paths.append(entry["path"])
            first = entry.get("range", [0])[0] if isinstance(entry.get("range"), list) else 0
            self.key_offsets.append(int(first) if isinstance(first, int) else 0)
            counts.append(entry["count"])
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._count = int(self.starts[-1])

    def __len__(self) -> int:
        self.validate()
        return self._count

    def _check_data(self) -> None:
        for reader in self.readers:  # each part against its own count, before the parts' sum is answered
            reader.validate()

    def _open(self) -> None:
        for reader in self.readers:
            reader.open()

    def locate(self, index: int) -> tuple[int, int]:
        """(part number among the non-empty parts, index within it) of sample ``index`` (in range)."""
        p = int(np.searchsorted(self.starts, index, side="right")) - 1
        return p, index - int(self.starts[p])

    def _part(self, p: int) -> Reader:
        reader = self.readers[p]
        reader.open()
        return reader

    def read(self, index: int) -> Sample:
        p, local = self.locate(index)
        return self._part(p).read(local)

    def _groups(self, indices: list[int]) -> list[tuple[int, np.ndarray, list[int]]]:
        """(part, positions in ``indices``, local indices) for each part the batch touches."""
        idx = np.asarray(indices, dtype=np.int64)
        parts = np.searchsorted(self.starts, idx, side="right") - 1
        groups = []
        for p in np.unique(parts):
            where = np.flatnonzero(parts == p)
            groups.append((int(p), where, (idx[where] - self.starts[p]).tolist()))
        return groups

    def read_many(self, indices: list[int]) -> list[Sample]:
        groups = self._groups(indices)
        if len(groups) == 1:
            p, _, local = groups[0]
            return self._part(p).read_many(local)
        out: list[Sample | None] = [None] * len(indices)
        for p, where, local in groups:
            for j, sample in zip(where.tolist(), self._part(p).read_many(local), strict=True):
                out[j] = sample
        return cast(list[Sample], out)  # the groups cover every position of indices

    def gather_raw(self, indices: list[int], out: np.ndarray) -> np.ndarray | None:
        groups = self._groups(indices)
        if len(groups) == 1:
            p, _, local = groups[0]
            return self._part(p).gather_raw(local, out)
        labels = np.empty(len(indices), np.int64)
        for p, where, local in groups:
            tmp = np.empty((len(local), *out.shape[1:]), out.dtype)
            got = self._part(p).gather_raw(local, tmp)
            if got is None:
                return None
            out[where] = tmp
            labels[where] = got
        return labels

    def read_extras(self, index: int) -> tuple[memoryview | bytes, ...]:
        p, local = self.locate(index)
        return self._part(p).read_extras(local)

    def fields_checksum(self, index: int) -> int | None:
        p, local = self.locate(index)
        return self._part(p).fields_checksum(local)

    def stored_array(self, index: int, sample: Sample) -> np.ndarray | None:
        p, local = self.locate(index)
        return self.readers[p].stored_array(local, sample)

    def class_counts(self) -> np.ndarray:
        """Each part's counts (each from its own labels' index), added up."""
        self.validate()
        counts = np.zeros(len(self.classes), np.int64)
        for reader in self.readers:
            counts += reader.class_counts()
        return counts

    def stored_sizes(self) -> np.ndarray | None:
        """Each part's stored sizes, end to end (None when a part's format does not know them)."""
        sizes = [reader.stored_sizes() for reader in self.readers]
        known = [s for s in sizes if s is not None]
        if len(known) < len(sizes):
            return None
        return np.concatenate(known) if known else np.zeros(0, np.int64)

    def blocks(self, target_bytes: int) -> np.ndarray:
        """Each part's blocks, placed at its first index: no block straddles two parts."""
        if self._count == 0:
            return np.zeros(0, np.int64)
        return np.concatenate([reader.blocks(target_bytes) + int(first)
                               for reader, first in zip(self.readers, self.starts[:-1], strict=True)])

    def stored_shapes(self) -> np.ndarray | None:
        shapes = [reader.stored_shapes() for reader in self.readers]
        known = [s for s in shapes if s is not None]
        if len(known) != len(shapes):
            return None
        return np.concatenate(known) if known else np.zeros((0, 3), np.int64)

    def relpath(self, index: int) -> str:
        p, local = self.locate(index)
        return self.readers[p].relpath(local)

    def describe(self, index: int) -> str:
        if 0 <= index < self._count:
            p, local = self.locate(index)
            return self.readers[p].describe(local)
        return f"{self.root} sample {index}"

    def sample_file(self, index: int) -> str:
        p, local = self.locate(index)
        return f"{self.part_paths[p]}/{self.readers[p].sample_file(local)}"

    def count_problems(self) -> list[str]:  # each part against its own count
        return [problem for reader in self.readers for problem in reader.count_problems()]

    def index_files(self) -> tuple[str, ...]:
        return tuple(f"{part}/{name}" for reader, part in zip(self.readers, self.part_paths, strict=True)
                     for name in reader.index_files())

    def member_problems(self, deep: bool, damaged_files: set[str], key_offset: int = 0) -> list[str]:
        # a part's keys start at its first position in the order
        return [problem for reader, part, offset in zip(self.readers, self.part_paths, self.key_offsets, strict=True)
                for problem in reader.member_problems(deep, _within(part, damaged_files), offset)]

"""A dataset converted by several ranks (``packer pack`` under torchrun), read as one.

DEST holds one folder per rank, ``part-00000``..., each a complete dataset of the format without a manifest of
its own, and one ``manifest.json`` whose ``parts`` list each folder, its sample count and the range of the output
order it holds; ``files`` and ``shards`` paths are relative to DEST (``part-00000/data.mdb``). Sample ``i`` is
found in the part whose cumulative counts contain it, so the order is the one a single process would give.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import numpy as np

from ..errors import ManifestError
from ..manifest import MANIFEST
from .base import PackedDataset, Sample, get_format

_BASE_ARGS = set(inspect.signature(PackedDataset.__init__).parameters) - {"self", "root", "manifest"}
_NOT_FOR_PARTS = {"transform", "target_transform"}  # applied once, by the dataset over all parts


def _is_safe_part(name) -> bool:
    return (isinstance(name, str) and bool(name) and not name.startswith("/") and "\\" not in name
            and ".." not in name.split("/"))


def check_parts(manifest: dict, where: str) -> list[dict]:
    """The manifest's ``parts``, checked: a list of ``{"path", "count"}`` with safe paths, adding up to ``count``."""
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ManifestError(f"{where}: malformed 'parts'; the dataset is damaged, re-pack it")
    for entry in parts:
        count = entry.get("count") if isinstance(entry, dict) else None
        if (not _is_safe_part(entry.get("path") if isinstance(entry, dict) else None) or not isinstance(count, int)
                or isinstance(count, bool) or count < 0):
            raise ManifestError(f"{where}: malformed entry in 'parts'; the dataset is damaged, re-pack it")
    if sum(e["count"] for e in parts) != manifest["count"]:
        raise ManifestError(f"{where}: the parts hold {sum(e['count'] for e in parts)} samples, the manifest says "
                            f"{manifest['count']}; the dataset is damaged, re-pack it")
    return parts


def part_manifest(manifest: dict, entry: dict) -> dict:
    """The manifest one part would have on its own: its count, and its files and shards relative to it."""
    prefix = entry["path"].rstrip("/") + "/"
    sub = {k: v for k, v in manifest.items() if k != "parts"}
    sub["count"] = entry["count"]
    for key in ("files", "shards"):
        if key in manifest:
            sub[key] = [{**e, "path": e["path"][len(prefix):]} for e in manifest[key]
                        if isinstance(e, dict) and str(e.get("path", "")).startswith(prefix)]
    return sub


class PartedDataset(PackedDataset):
    """One dataset over the parts of a distributed conversion: one reader of the format per part (each opens its
    handles lazily, per process), global index ``i`` mapped to (part, local index) through cumulative counts.
    ``packer.open_dataset`` returns it for such a manifest; it takes the same arguments as the format's reader."""

    _accepts_parts = True

    def __init__(self, root: str | os.PathLike, manifest: dict | None = None, **kwargs):
        base = {k: kwargs.pop(k) for k in list(kwargs) if k in _BASE_ARGS}
        super().__init__(root, manifest=manifest, **base)
        self.format = self.manifest["format"]
        _, reader_cls = get_format(self.format)
        parts = check_parts(self.manifest, str(Path(root) / MANIFEST))
        shared = {k: v for k, v in base.items() if k not in _NOT_FOR_PARTS}
        self.readers: list[PackedDataset] = []
        self.part_paths: list[str] = []
        self.key_offsets: list[int] = []  # WebDataset keys of a part start at its first position in the order
        counts = []
        for entry in parts:
            if entry["count"] == 0:
                continue  # a rank whose images were all skipped
            self.readers.append(reader_cls(self.root / entry["path"], manifest=part_manifest(self.manifest, entry),
                                           **shared, **kwargs))
            self.part_paths.append(entry["path"])
            first = entry.get("range", [0])[0] if isinstance(entry.get("range"), list) else 0
            self.key_offsets.append(int(first) if isinstance(first, int) else 0)
            counts.append(entry["count"])
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._count = int(self.starts[-1])

    def __len__(self) -> int:
        return self._count

    def _open(self) -> None:
        for reader in self.readers:
            reader._ensure_open()

    def locate(self, index: int) -> tuple[int, int]:
        """(part number among the non-empty parts, index within it) of sample ``index`` (in range)."""
        p = int(np.searchsorted(self.starts, index, side="right")) - 1
        return p, index - int(self.starts[p])

    def _part(self, p: int) -> PackedDataset:
        reader = self.readers[p]
        reader._ensure_open()
        return reader

    def _read(self, index: int) -> Sample:
        p, local = self.locate(index)
        return self._part(p)._read(local)

    def _groups(self, indices: list[int]) -> list[tuple[int, np.ndarray, list[int]]]:
        """(part, positions in ``indices``, local indices) for each part the batch touches."""
        idx = np.asarray(indices, dtype=np.int64)
        parts = np.searchsorted(self.starts, idx, side="right") - 1
        groups = []
        for p in np.unique(parts):
            where = np.flatnonzero(parts == p)
            groups.append((int(p), where, (idx[where] - self.starts[p]).tolist()))
        return groups

    def _read_many(self, indices: list[int]) -> list[Sample]:
        groups = self._groups(indices)
        if len(groups) == 1:
            p, _, local = groups[0]
            return self._part(p)._read_many(local)
        out: list[Sample | None] = [None] * len(indices)
        for p, where, local in groups:
            for j, sample in zip(where.tolist(), self._part(p)._read_many(local), strict=True):
                out[j] = sample
        return out

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

    def relpath(self, index: int) -> str:
        p, local = self.locate(self._check_index(index))
        return self.readers[p].relpath(local)

    def _describe(self, index: int) -> str:
        if 0 <= index < self._count:
            p, local = self.locate(index)
            return self.readers[p]._describe(local)
        return f"{self.root} sample {index}"

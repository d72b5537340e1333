"""The WebDataset reader: packer's shards memory-mapped and read through their index (or shards other tools wrote,
through their scan), checked against the manifest, read a block at a time by ranges, and streamed."""

from __future__ import annotations

import bisect
import dataclasses
import json
import mmap
import os
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CorruptDataError, ManifestError, PackerError, UsageError, warn
from ...fields import PAIR_SCHEMA, Field, label_field
from ...manifest import is_safe_relpath
from ..advice import random_access, read_whole, will_need
from ..base import Reader, Sample, StreamSample, run_starts
from ..identity import FileId, changed_error, check_unchanged, file_id
from ..layout import Layout, RangeSource
from .foreign import ForeignShards, scan_shards
from .layout import ranged_extras, ranged_fields_checksum, ranged_sample, read_index, shard_layout
from .members import (
    INDEX,
    INDEX_DTYPE,
    NAMED_FIELDS_VERSION,
    after_json,
    field_members,
    fields_checksum_of,
    load_index,
    packer_info,
    payload_sample,
    read_shard,
    shard_name,
    stored_bytes,
)


def brace_pattern(dest: str, paths: list[str]) -> str:
    """The shards as a string the ``webdataset`` library expands: ``DEST/shard-{000000..000012}.tar`` (one
    range per folder of consecutive shards, ranges joined by ``::``, as ``webdataset.WebDataset`` accepts)."""
    groups: dict[str, list[int]] = {}
    for path in paths:
        m = re.fullmatch(r"(.*?)shard-(\d{6})\.tar", path)
        if m is None:
            return "::".join(f"{dest.rstrip('/')}/{p}" for p in paths)
        groups.setdefault(m.group(1), []).append(int(m.group(2)))
    out = []
    for folder, numbers in groups.items():
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))) and len(numbers) > 1:
            out.append(f"{dest.rstrip('/')}/{folder}shard-{{{numbers[0]:06d}..{numbers[-1]:06d}}}.tar")
        else:
            out += [f"{dest.rstrip('/')}/{folder}{shard_name(n)}" for n in numbers]
    return "::".join(out)


class WdsReader(Reader):
    """Random access over WebDataset shards, through byte offsets recorded at pack time: exact ``len()``,
    shuffling and ``DistributedSampler`` work as for the other formats. Shards are memory-mapped per process.

    Shards written by other tools (``webdataset.ShardWriter``, img2dataset...) are read with
    :meth:`from_shards`. For sequential or remote reading through the ``webdataset`` library, see
    :func:`packer.stream`."""

    HANDLES = ("index", "maps", "_index_map")

    def __init__(self, root, manifest: dict | None = None, foreign: ForeignShards | None = None):
        super().__init__(root, manifest)
        self._count = int(self.manifest["count"])
        self.shard_paths = [self.root / s["path"] for s in self.manifest.get("shards", [])]
        # this process's handles (HANDLES), None until _open(): Any, as the reads that come after it cannot be
        # told apart from the unopened state by their type; the shard index and a map of each shard (or None)
        self.index: Any = None
        self.maps: Any = None  # list[mmap.mmap | None]
        self._index_map: mmap.mmap | None = None  # the map the index views (read ahead whole before a whole use)
        self.foreign = foreign  # shards packer did not write: their index, built from the tar headers
        # where each shard's samples end, by the manifest's counts (rows are in shard order): a row is checked
        # against them as it is read, so opening reads no row; None for shards packer did not write
        counts = [int(s.get("count", 0)) for s in self.manifest.get("shards", [])]
        self._ends: list[int] | None = None if foreign is not None else np.cumsum(counts, dtype=np.int64).tolist()
        self._rows_checked = foreign is not None  # whether check_rows passed over every row (foreign: scanned)
        self._has_crc = "crc32" in self.manifest.get("checksum", "crc32")
        # the files the manifest just read describes: a reader maps each shard on first use, so a shard replaced
        # by a repack of DEST before then is refused rather than read at the old index's offsets
        self._file_ids = {path: file_id(path) for path in [*self.shard_paths, self.root / INDEX]}

    def _check_data(self) -> None:
        """Check the index against the manifest before anything is sized from either, without reading its rows
        (:meth:`_map_index`: a packer shard index of one row per sample, by its header and its size; the
        manifest's shard counts adding up to the count). Each row is checked as it is read (:meth:`_row`: its
        shard where the manifest's counts put it, its label a class index, its shape an image), so a damaged
        row is one line of :class:`CorruptDataError` before any sample is made of it; what reads every row
        (class counts, sizes, shapes, ``packer verify``) checks every row first (:meth:`check_rows`)."""
        if self.foreign is not None:  # built by scan_shards from the tar headers, checked there
            return
        self._map_index()
        shards = self.manifest.get("shards", [])
        if sum(int(s.get("count", 0)) for s in shards) != self._count:
            raise self.bad_count(f"{self.root / 'manifest.json'} (its shard counts)",
                                 sum(int(s.get("count", 0)) for s in shards))

    def _map_index(self) -> np.ndarray:
        """The shard index, mapped (not read: its header and its size are), and checked to be the file the
        manifest was read beside (a file replaced since is refused, as a data file is), of packer's row type
        and one row per sample."""
        path = self.root / INDEX
        index, mapped = load_index(path)
        recorded, now = self._file_ids.get(path), file_id(path)
        if now is None or (recorded is not None and now != recorded):  # checked after mapping: the file mapped
            raise changed_error(path)
        self._file_ids[path] = now
        if index.dtype != INDEX_DTYPE or index.ndim != 1:
            raise CorruptDataError(f"{path}: not a packer shard index ({index.dtype}); re-pack")
        if len(index) != self._count:
            raise self.bad_count(path, len(index))
        self._index_map = mapped
        return index

    def check_rows(self, index: np.ndarray, path: object, manifest_path: object) -> None:
        """The checks of every row of the shard index (``path`` and ``manifest_path`` name the files in messages)
        against the manifest: one row per sample, the manifest's shard counts adding up to the count and matching
        the rows of each shard, in shard order, labels class indices and shapes images. Reads no file: the local
        reader checks its mapped index so (:meth:`checked_index`), :meth:`layout` the index it read by ranges."""
        shards = self.manifest.get("shards", [])
        if index.dtype != INDEX_DTYPE or index.ndim != 1:
            raise CorruptDataError(f"{path}: not a packer shard index ({index.dtype}); re-pack")
        if len(index) != self._count:
            raise self.bad_count(path, len(index))
        if sum(int(s.get("count", 0)) for s in shards) != self._count:
            raise self.bad_count(f"{manifest_path} (its shard counts)",
                                 sum(int(s.get("count", 0)) for s in shards))
        if not len(index):
            return
        shard = np.asarray(index["shard"])
        if int(shard.max()) >= len(shards):
            raise CorruptDataError(f"{path}: names shard {int(shard.max())}, the manifest lists {len(shards)}; re-pack")
        per_shard = np.bincount(shard, minlength=len(shards))
        counts = [int(s.get("count", 0)) for s in shards]
        if per_shard.tolist() != counts:
            raise CorruptDataError(f"{path}: holds {per_shard.tolist()[:8]} samples per shard, the manifest says "
                                   f"{counts[:8]}; the dataset is damaged, re-pack")
        wrong = np.flatnonzero(shard != np.repeat(np.arange(len(shards)), counts))  # rows are in shard order
        if len(wrong):
            raise CorruptDataError(f"{path}: row {int(wrong[0])} names shard {int(shard[wrong[0]])}, out of shard "
                                   "order; the dataset is damaged, re-pack")
        self.check_labels(path, np.asarray(index["label"]))
        self.check_shapes(path, np.asarray(index["shape"]))

    @classmethod
    def from_shards(cls, paths: Sequence[str | os.PathLike], label_key: str | None = "cls",
                    classes: list[str] | None = None, warn_skipped: bool = True,
                    keep_fields: bool = False) -> WdsReader:
        """Random access to shards packer did not write: one sample per key with an image member (jpg, png,
        webp, bmp, tif, ppm or uint8 npy) and an integer label from ``label_key`` (``cls``, or ``json:FIELD``;
        None: ``cls`` where the shards have it, else no label). With ``keep_fields`` every other member is a
        field (:func:`shard_field`). The index is built once, from the tar headers. Classes default to
        ``"0"``..``"max label"``.

        What :func:`scan_shards` leaves out (link members, repeated members, keys without an image) is listed
        in the reader's ``skipped``, ``[("SHARD/MEMBER", why)]``, and with ``warn_skipped`` said in one
        warning line; what it refuses raises."""
        shard_paths = [Path(p) for p in paths]
        if not shard_paths:
            raise PackerError("from_shards needs at least one shard path")
        skipped: list[tuple[str, str]] = []
        foreign = scan_shards(shard_paths, label_key, skipped, None if classes is None else len(classes))
        if not keep_fields:  # image and label only
            foreign = dataclasses.replace(foreign, members=foreign.members[:, :0], fields=[])
        index = foreign.index
        if len(index) == 0:
            raise PackerError(f"{shard_paths[0]}: no samples with an image in these shards")
        if classes is None:
            classes = [str(i) for i in range(int(index["label"].max()) + 1)] if foreign.labelled else []
        root = Path(os.path.commonpath([str(p.resolve().parent) for p in shard_paths]))
        manifest = {"format": "wds", "count": len(index), "classes": list(classes),
                    "class_to_idx": {c: i for i, c in enumerate(classes)}, "transform": {"store": "original"},
                    "shape": None, "checksum": "none",
                    "shards": [{"path": os.path.relpath(p.resolve(), root)} for p in shard_paths]}
        if foreign.fields or not foreign.labelled:
            schema = [PAIR_SCHEMA[0], *([Field("label", "class")] if foreign.labelled else []), *foreign.fields]
            manifest["fields"] = [f.to_dict() for f in schema]
        reader = cls(root, manifest=manifest, foreign=foreign)
        reader.skipped = skipped
        if skipped and warn_skipped:
            rel, why = skipped[0]
            shard = next(p for p in shard_paths if p.name == rel.split("/", 1)[0])
            warn(f"skipped {len(skipped)} member(s) of these shards, listed in the dataset's `skipped`; the first: "
                 f"{shard}/{rel.split('/', 1)[1]}: {why}")
        return reader

    @classmethod
    def from_foreign(cls, paths: list[Path], label_key: str | None = None) -> WdsReader:
        """Shards another tool wrote, every member beyond the image and the label a field (:meth:`from_shards`)."""
        return cls.from_shards(paths, label_key=label_key, warn_skipped=False, keep_fields=True)

    @classmethod
    def check_manifest(cls, data: dict, where: str) -> None:
        """``shards``: a list of ``{path, count}``, each path inside the dataset, each count an int from 0."""
        shards = data.get("shards", [])
        if not isinstance(shards, list) or not all(
                isinstance(s, dict) and isinstance(s.get("path"), str) and is_safe_relpath(s["path"])
                and isinstance(s.get("count", 0), int) for s in shards):
            raise ManifestError(f"{where}: malformed 'shards'; the dataset is damaged, re-pack it")
        if any(isinstance(s.get("count", 0), bool) or s.get("count", 0) < 0 for s in shards):
            raise ManifestError(f"{where}: a negative count in 'shards'; the dataset is damaged, re-pack it")
        if "caption" in data and not isinstance(data["caption"], str):
            raise ManifestError(f"{where}: malformed 'caption'; the dataset is damaged, re-pack it")

    @classmethod
    def summary(cls, dest: str, manifest: dict) -> list[str]:
        """How many shards, their sizes in samples, and the brace pattern the ``webdataset`` library reads."""
        shards = manifest.get("shards")
        if not shards:
            return []
        counts = [s["count"] for s in shards]
        caption = [f"  caption: field {manifest['caption']!r}, member KEY.txt"] if manifest.get("caption") else []
        return [f"  {len(counts)} shards, {min(counts)}-{max(counts)} samples each",
                f"  webdataset: {brace_pattern(dest, [s['path'] for s in shards])}", *caption]

    @classmethod
    def stream_files(cls, manifest: dict) -> list[tuple[str, int]] | None:
        return [(s["path"], int(s["count"])) for s in manifest.get("shards") or []] or None

    @classmethod
    def stream_file(cls, path: Path, extras: Sequence[Field] = (), where: object = None,
                    wanted: Callable[[int], bool] | None = None,
                    stored: Sequence[Field] | None = None) -> Iterator[StreamSample | None]:
        return read_shard(path, extras, where, wanted, stored)

    @classmethod
    def layout(cls, manifest: dict, source: RangeSource, where: str) -> Layout:
        """One range per sample from the shard index, read whole through ``source`` and checked as a local
        reader checks it (:meth:`check_rows`); see :mod:`packer.formats.wds.layout`. Shards packer did not
        write have no index: :class:`UsageError`."""
        listed = {e.get("path") for e in manifest.get("files", []) if isinstance(e, dict)}
        if INDEX not in listed or not manifest.get("shards"):
            raise UsageError(f"{where}: shards without packer's index ({INDEX}) cannot be read a block at a time; "
                             "pack them first (`packer pack SHARDS DEST --format wds`)")
        rows = read_index(source, INDEX, int(manifest["count"]), where)
        root = where.rstrip("/")
        reader = cls(root, manifest)  # the manifest's reader, for its checks: it opens no file
        reader.check_rows(rows, f"{root}/{INDEX}", f"{root}/manifest.json")
        shards = [s["path"] for s in manifest["shards"]]
        return shard_layout(rows, INDEX, shards, [source.size(p) for p in shards], reader._has_crc,
                            bool(reader.extra_fields), where)

    @classmethod
    def ranged_sample(cls, index: int, data: memoryview, layout: Layout, where: str) -> Sample:
        return ranged_sample(index, data, layout, where)

    @classmethod
    def ranged_extras(cls, index: int, data: memoryview, layout: Layout, extras: Sequence[Field],
                      where: str) -> tuple[memoryview | bytes, ...]:
        return ranged_extras(index, data, layout, extras, where)

    @classmethod
    def ranged_fields_checksum(cls, index: int, data: memoryview, layout: Layout) -> int | None:
        return ranged_fields_checksum(index, data, layout)

    def __len__(self) -> int:
        self.validate()
        return self._count

    def _open(self) -> None:
        # a forked worker keeps the index and shards its parent mapped (the files the parent reads)
        if self.maps is None:
            self.maps = [None] * len(self.shard_paths)
        if self.index is not None:
            return
        self.index = self.foreign.index if self.foreign is not None else self._map_index()

    def _map(self, shard: int) -> mmap.mmap:
        m = self.maps[shard]
        if m is None:
            path = self.shard_paths[shard]
            try:
                with open(path, "rb") as f:
                    now = FileId.of(os.fstat(f.fileno()))
                    check_unchanged(path, self._file_ids.get(path), now)
                    m = self.maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    random_access(m)  # a fault reads its own page: each read advises its samples' bytes
            except FileNotFoundError:
                if self._file_ids.get(path) is not None:  # there when the manifest was read
                    raise changed_error(path) from None
                raise CorruptDataError(f"{path}: cannot map shard (no such file); run `packer verify`") from None
            except (OSError, ValueError) as exc:
                raise CorruptDataError(f"{path}: cannot map shard ({exc}); run `packer verify`") from None
        return m

    def expected_shard(self, index: int) -> int:
        """The shard that holds sample ``index`` by the manifest's counts (shards packer did not write: by the
        index their scan built)."""
        if self._ends is None:
            return int(self.index[index]["shard"])
        return bisect.bisect_right(self._ends, index)

    def _row_error(self, index: int, shard: int, label: int, shape: Sequence[int]) -> CorruptDataError:
        """The error for row ``index`` of the index, which :meth:`_row`'s checks refused."""
        where = f"{self.root / INDEX} row {index}"
        if shard != self.expected_shard(index):
            what = (f"names shard {shard}, where the manifest's shard counts put sample {index} in shard "
                    f"{self.expected_shard(index)}")
        elif not self.label_low <= label < self.label_high:
            what = f"label {label} is not a class index ({self.label_low}..{self.label_high - 1})"
        else:
            what = f"shape {tuple(shape)} is not an (H, W, {self.spec.channels}) image"
        return CorruptDataError(f"{where}: {what}; the index is damaged, run `packer verify` and re-pack")

    def _row(self, index: int) -> tuple:
        """Row ``index`` of the index as a tuple (:data:`INDEX_DTYPE`'s fields), checked: its shard the one the
        manifest's counts give, its label a class index, its shape an image; else :meth:`_row_error`."""
        # one .item() for the whole row: a field at a time was a quarter of the read
        row = self.index[index].item()
        if self._ends is not None:
            shard, label, shape = row[0], row[5], row[7]
            if (shard != bisect.bisect_right(self._ends, index) or not self.label_low <= label < self.label_high
                    or shape[0] < 1 or shape[1] < 1 or shape[2] != self.spec.channels):
                raise self._row_error(index, shard, label, shape.tolist())
        return row

    def read_many(self, indices: list[int]) -> list[Sample]:
        """:meth:`read` of a batch: the kernel first told to read every sample's bytes, exactly, all at once, then
        each row checked and read (:meth:`_row`)."""
        rows = self.index[np.asarray(indices, np.int64)]
        shards, start = rows["shard"], rows["offset"].astype(np.int64)
        for shard in np.unique(shards).tolist():
            if shard < len(self.shard_paths):  # advice only: each row is checked as read() takes it
                mine = shards == shard
                will_need(start[mine], start[mine] + rows["size"][mine].astype(np.int64), mapped=self._map(shard))
        return [self.read(i) for i in indices]

    def read(self, index: int) -> Sample:
        shard, a, size, _, _, label, crc, shape = self._row(index)
        if shard >= len(self.shard_paths):  # shards packer did not write: their scan names only theirs
            raise CorruptDataError(f"{self.describe(index)}: index names a missing shard; re-pack")
        return payload_sample(self._map(shard), a, size, label, crc if self._has_crc else None,
                              tuple(shape.tolist()), self.shard_paths[shard], index)

    def read_extras(self, index: int) -> tuple[memoryview | bytes, ...]:
        """The members after the json member, in order: each header names the field it should be (shards packer
        did not write: the members their scan found)."""
        shard, _, _, json_offset, json_size, _, _, _ = self._row(index)
        m = memoryview(self._map(shard))
        where = f"{self.shard_paths[shard]} sample {index}"
        if self.foreign is not None:
            return tuple(stored_bytes(field, m[int(a):int(a) + int(n)], where)
                         for field, (a, n) in zip(self.extra_fields, self.foreign.members[index], strict=True))
        return field_members(m, after_json(json_offset, json_size), self.extra_fields, where)

    def fields_checksum(self, index: int) -> int | None:
        if self.foreign is not None:
            return None  # other tools record none
        return fields_checksum_of(self._info(index))

    def _info(self, index: int) -> dict:
        """Packer's json member of sample ``index``."""
        shard, _, _, a, size, _, _, _ = self._row(index)
        return packer_info(self._map(shard)[a:a + size], self.describe(index))

    def stored_array(self, index: int, sample: Sample) -> np.ndarray | None:
        if self.foreign is not None and tuple(sample.shape) != (0, 0, 0):  # a .npy member: uint8 pixels
            return self._as_array(index, sample, "uint8")
        return super().stored_array(index, sample)

    def checked_index(self) -> np.ndarray:
        """The whole index, every row checked first (:meth:`check_rows`, once), for what reads every row."""
        self.open()
        if not self._rows_checked:
            read_whole(self._index_map)
            self.check_rows(self.index, self.root / INDEX, self.root / "manifest.json")
            self._rows_checked = True
        return self.index

    def class_counts(self) -> np.ndarray:
        """From the index's labels, without mapping a shard."""
        labels = np.asarray(self.checked_index()["label"], dtype=np.int64)
        return np.bincount(labels[labels >= 0], minlength=len(self.manifest["classes"]))

    def stored_sizes(self) -> np.ndarray:
        return np.asarray(self.checked_index()["size"], dtype=np.int64)

    def stored_shapes(self) -> np.ndarray | None:
        if self.foreign is not None:
            return None  # (0, 0, 0) for encoded images: their size is in their headers
        return np.asarray(self.checked_index()["shape"])

    def blocks(self, target_bytes: int) -> np.ndarray:
        """One block per shard, whatever ``target_bytes``: a shard is read from start to end. Where each begins
        comes from the manifest's shard counts (no row is read; a row in another shard is refused as it is
        read)."""
        self.open()
        if self._ends is None:
            return run_starts(self.index["shard"])
        ends = np.asarray(self._ends, np.int64)
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        return starts[ends > starts]

    def relpath(self, index: int) -> str:
        if self.foreign is not None:
            return str(self.foreign.relpaths[index])
        self.open()
        relpath = self._info(index).get("relpath")
        if not isinstance(relpath, str):
            raise CorruptDataError(f"{self.describe(index)}: damaged json member; re-pack")
        return relpath

    def describe(self, index: int) -> str:
        if self.index is not None and 0 <= index < len(self.index):
            shard = self.expected_shard(index)
            if shard < len(self.shard_paths):
                return f"{self.shard_paths[shard]} sample {index}"
        return f"{self.root} sample {index}"

    def sample_file(self, index: int) -> str:
        return self.manifest["shards"][self.expected_shard(index)]["path"]

    def count_problems(self) -> list[str]:
        """The manifest's shard counts against its count, and every row of the index against the manifest
        (:meth:`check_rows`)."""
        shards, count = self.manifest.get("shards", []), self.manifest["count"]
        if sum(s["count"] for s in shards) != count:
            return [f"{self.root}: shard counts add up to {sum(s['count'] for s in shards)}, not {count}"]
        try:
            self.checked_index()
        except CorruptDataError as exc:
            return [str(exc)]
        return []

    def index_files(self) -> tuple[str, ...]:
        return (INDEX,)  # labels and locations: all from it

    def member_problems(self, deep: bool, damaged_files: set[str], key_offset: int = 0) -> list[str]:
        """The labels webdataset readers see (the ``.cls`` and ``.json`` members) must agree with the index."""
        problems = []
        for shard_no, shard in enumerate(self.manifest.get("shards", [])):
            path = self.root / shard["path"]
            if not (deep or shard["path"] in damaged_files) or not path.exists():
                continue
            try:
                with tarfile.open(path, "r:") as tar:
                    for member in tar:
                        problems += self._member_problem(tar, member, path, shard_no, key_offset)
            except (OSError, tarfile.TarError) as exc:
                problems.append(f"{path}: damaged tar shard ({exc})")
        return problems

    def _member_problem(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path, shard_no: int,
                        key_offset: int) -> list[str]:
        key, _, ext = member.name.partition(".")
        meta = "json" if self.manifest.get("format_version", 0) >= NAMED_FIELDS_VERSION or not any(
            f.name == "json" for f in self.extra_fields) else "packer.json"  # version 2 moved it for a field json
        if ext not in ("cls", meta) or label_field(self.schema) is None or not key.isdigit():
            return []
        if not 0 <= int(key) - key_offset < len(self):
            return []
        index = int(key) - key_offset
        extracted = tar.extractfile(member)  # None: not a regular file, so no label to read
        data = extracted.read() if extracted is not None else b""
        try:
            label = int(data) if ext == "cls" else int(json.loads(data)["label"])  # packer's json member
        except (ValueError, KeyError, TypeError):
            label = None
        row = self.index[index]
        if label != int(row["label"]) or int(row["shard"]) != shard_no:
            return [f"{path} sample {index}: the .{ext} member says label {label}, the index says "
                    f"{int(row['label'])}; the label is damaged"]
        return []

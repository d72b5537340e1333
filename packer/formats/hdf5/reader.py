"""The HDF5 reader: ``data.h5``'s arrays memory-mapped where h5py allows it, checked against the manifest, and
read a block at a time by ranges."""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from ...errors import CorruptDataError, PackerError
from ...fields import Field
from ..advice import random_access, will_need
from ..base import Reader, Sample, blocks_by_size
from ..identity import changed_error, check_unchanged, file_id
from ..layout import Layout, RangeSource, join_rows
from .ranges import RangeFile, check_offsets, extent, read_arrays

FILENAME = "data.h5"


def _offset(dataset: h5py.Dataset) -> int | None:
    """Where a contiguous dataset starts in its file; None for one stored otherwise (chunked, compressed)."""
    offset = dataset.id.get_offset()
    return None if dataset.chunks is not None or dataset.compression is not None else offset


def _memmap(mapped: mmap.mmap, dataset: h5py.Dataset) -> np.ndarray:
    """A read-only view of a contiguous dataset in ``mapped`` (the whole file's map), or its values read into
    memory if it is not one."""
    offset = _offset(dataset)
    if offset is None:
        return dataset[()]
    if dataset.size == 0:
        return np.zeros(dataset.shape, dataset.dtype)
    if offset + dataset.size * dataset.dtype.itemsize > len(mapped):
        raise ValueError(f"dataset {dataset.name} runs past the end of the file")
    # a plain ndarray (np.frombuffer): indexing a np.memmap subclass costs several times more per call
    return np.frombuffer(mapped, dataset.dtype, dataset.size, offset).reshape(dataset.shape)


def _sample(index: int, payload: memoryview, labels: np.ndarray, shapes: np.ndarray, crcs: np.ndarray) -> Sample:
    """Sample ``index`` of its payload and the per-sample arrays (the local and the ranged reads')."""
    return Sample(payload, int(labels[index]), tuple(shapes[index].tolist()), int(crcs[index]))


def _field_value(index: int, values: np.ndarray, offsets: np.ndarray | None, where: str) -> memoryview:
    """Sample ``index``'s stored bytes of one extra field: its row of a typed field (``offsets`` None), or its
    slice of a bytes field's ``values`` by ``offsets``; ``where`` names the sample in errors."""
    if offsets is None:
        return np.ascontiguousarray(values[index]).data.cast("B")
    a, b = int(offsets[index]), int(offsets[index + 1])
    if not 0 <= a <= b <= len(values):
        raise CorruptDataError(f"{where}: field offsets out of range; run `packer verify`")
    return values[a:b].data


def _field_index(name: str, node: h5py.Dataset | h5py.Group, arrays: list[np.ndarray], n: int,
                 where: str) -> dict[str, np.ndarray]:
    """The layout index arrays of extra field ``name`` (``node`` in the file), taking its values (and offsets)
    from the front of ``arrays``; CorruptDataError unless they hold ``n`` samples."""
    values = arrays.pop(0)
    if isinstance(node, h5py.Dataset):
        if values.ndim == 0 or len(values) != n:
            raise CorruptDataError(f"{where}: 'fields/{name}' is {values.shape}, {n} samples need {n} rows; the file "
                                   "is damaged, re-pack")
        return {f"values.{name}": values}
    offsets = arrays.pop(0)
    if offsets.shape != (n + 1,) or offsets.dtype.kind not in "iu" or values.ndim != 1 or values.dtype != np.uint8:
        raise CorruptDataError(f"{where}: 'fields/{name}' is {values.shape} {values.dtype} with offsets "
                               f"{offsets.shape} {offsets.dtype}; {n} samples need bytes and {n + 1} int offsets, "
                               "the file is damaged, re-pack")
    check_offsets(offsets.astype(np.int64), len(values), where, f"fields/{name}/offsets")
    return {f"values.{name}": values, f"offsets.{name}": offsets}


class Hdf5Reader(Reader):
    """Reads an HDF5 dataset. Each process opens the file lazily, memory-maps ``images``, ``offsets``,
    ``shapes``, ``labels`` and ``crc32`` at their file offsets, and reads them with numpy, not per sample
    through h5py. ``locking=False`` (the default) opens without HDF5 file locks, which fail on many network
    filesystems; the file is never written after packing."""

    HANDLES = ("file", "mapped", "images", "offsets", "shapes", "labels", "crcs", "field_maps", "fields_crcs")

    def __init__(self, root, manifest: dict | None = None, locking: bool = False):
        super().__init__(root, manifest)
        self.locking = locking
        self._count = int(self.manifest["count"])
        self.path = self.root / FILENAME
        # this process's handles (HANDLES), None until _open(): Any, as the reads that come after it cannot be
        # told apart from the unopened state by their type; the h5py File and numpy maps of its arrays
        self.file: Any = None
        self.images: Any = None
        self.offsets: Any = None  # None once opened too: fixed-size raw images
        self.shapes: Any = None
        self.labels: Any = None
        self.crcs: Any = None
        self.mapped: mmap.mmap | None = None  # the whole file, mapped once per process
        self._blob: int | None = None  # where the images dataset starts in the file (None: not mapped)
        self.field_maps: Any = None  # list[tuple[np.ndarray, np.ndarray | None]]
        self.fields_crcs: Any = None
        self._file_id = file_id(self.path)  # the file the manifest just read describes

    def _check_data(self) -> None:
        """Check the file's arrays against the manifest (:meth:`_check_file`); the file is closed again (each
        process opens its own)."""
        now = file_id(self.path)
        if self._file_id is not None and now is not None:
            check_unchanged(self.path, self._file_id, now)  # replaced since the manifest was read
        try:
            with h5py.File(self.path, "r", locking=self.locking) as f:
                self._check_file(f, self.path, rows=False)
        except PackerError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise CorruptDataError(f"{self.path}: cannot read HDF5 ({exc}); run `packer verify`") from None

    def _check_file(self, f: h5py.File, where: object, rows: bool = True) -> None:
        """Check an open file's arrays against the manifest before anything is sized from either: every
        per-sample array holds ``count`` rows, ``offsets`` one more and inside ``images``, a fixed-shape
        ``images`` has the manifest's shape and dtype, and with ``rows`` labels are class indices and shapes
        are images (the local reader checks each sample's as it reads it, and every one where it uses them
        whole: opening reads no per-sample array). ``where`` names the file in errors."""
        n = self._count
        arrays = {name: f[name] for name in ("images", "labels", "crc32", "shapes", "relpaths")}
        offsets = f["offsets"] if "offsets" in f else None
        if arrays["labels"].shape != (n,):
            raise self.bad_count(f"{where} (labels)", arrays["labels"].shape[0] if arrays["labels"].ndim else 0)
        expect = {"crc32": (n,), "relpaths": (n,), "shapes": (n, 3)}
        for name, shape in expect.items():
            if arrays[name].shape != shape:
                raise CorruptDataError(f"{where}: '{name}' is {arrays[name].shape}, {n} samples need {shape}; the "
                                       "file is damaged, re-pack")
        images = arrays["images"]
        fixed = self.manifest.get("shape")
        if offsets is None:
            if not self.is_raw or not fixed or images.shape != (n, *fixed) or images.dtype != self.spec.dtype:
                raise CorruptDataError(f"{where}: 'images' is {images.shape} {images.dtype}, the manifest says "
                                       f"{n} x {fixed} {self.spec.dtype}; the file is damaged, re-pack")
        else:
            if offsets.shape != (n + 1,) or images.ndim != 1:
                raise CorruptDataError(f"{where}: 'offsets' is {offsets.shape}, {n} samples need ({n + 1},); the "
                                       "file is damaged, re-pack")
            ends = offsets[[0, n]] if n else offsets[[0]]
            if int(ends[0]) != 0 or int(ends[-1]) > images.shape[0]:
                raise CorruptDataError(f"{where}: 'offsets' run past 'images'; the file is damaged, re-pack")
        for name in ("labels", "shapes"):
            if arrays[name].dtype.kind not in "iu":
                raise CorruptDataError(f"{where}: '{name}' is {arrays[name].dtype}, not integers; the file is "
                                       "damaged, re-pack")
        if rows:
            self.check_labels(where, arrays["labels"][()])
            self.check_shapes(where, arrays["shapes"][()])

    def __len__(self) -> int:
        self.validate()
        return self._count

    def _open(self) -> None:
        # the open file and the maps keep reading this file if DEST is repacked later; a file replaced before
        # this process opened it is refused
        now = file_id(self.path)
        recorded = self._file_id = self._file_id or now
        if now is not None:
            check_unchanged(self.path, recorded, now)
        try:
            self.file = h5py.File(self.path, "r", locking=self.locking)
            with open(self.path, "rb") as f:
                self.mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            images = self.file["images"]
            self.images = _memmap(self.mapped, images)
            # read a few samples at a time, at random: a fault reads its own page (not the kernel's window around
            # it, which would reach into the images), each read has the kernel read its samples' bytes ahead
            # (_read_ahead), and a whole array is read ahead before it is used whole (_whole)
            random_access(self.mapped)
            self._blob = _offset(images)
            self.offsets = _memmap(self.mapped, self.file["offsets"]) if "offsets" in self.file else None
            self.shapes = _memmap(self.mapped, self.file["shapes"])
            self.labels = _memmap(self.mapped, self.file["labels"])
            self.crcs = _memmap(self.mapped, self.file["crc32"])
            self.field_maps = [self._field_map(field) for field in self.extra_fields]
            self.fields_crcs = _memmap(self.mapped, self.file["fields_crc32"]) if self.extra_fields else None
        except (OSError, KeyError, ValueError) as exc:
            raise CorruptDataError(f"{self.path}: cannot read HDF5 ({exc}); run `packer verify`") from None
        if file_id(self.path) != recorded:  # replaced while it was being opened
            raise changed_error(self.path)
        if len(self.labels) != self._count:
            raise CorruptDataError(f"{self.path}: holds {len(self.labels)} samples, the manifest says "
                                   f"{self._count}; run `packer verify`")

    def _ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges of samples ``indices`` in the file (their images)."""
        blob = self._blob or 0
        if self.offsets is None:
            row = self.images[0].nbytes if self._count else 0
            start = blob + indices * row
            return start, start + row
        return blob + self.offsets[indices].astype(np.int64), blob + self.offsets[indices + 1].astype(np.int64)

    def _whole(self, array: np.ndarray) -> np.ndarray:
        """``array``, its bytes read ahead in one go first where it is a view of the map (a fault reads a page)."""
        if self.mapped is not None and array.nbytes and len(self.mapped):
            start = array.__array_interface__["data"][0] - np.frombuffer(self.mapped, np.uint8, 1).ctypes.data
            if 0 <= start < len(self.mapped):
                will_need(np.array([start]), np.array([start + array.nbytes]), mapped=self.mapped)
        return array

    def _read_ahead(self, indices: list[int]) -> None:
        """Have the kernel read these samples' images now, exactly their bytes (the map reads none around)."""
        if self._blob is not None and self.mapped is not None:  # mapped, not read into memory
            will_need(*self._ranges(np.asarray(indices, np.int64)), mapped=self.mapped)

    def read_many(self, indices: list[int]) -> list[Sample]:
        """:meth:`read` of a batch: every image's read started at once, then each sliced."""
        self._read_ahead(indices)
        return [self.read(i) for i in indices]

    def read(self, index: int) -> Sample:
        if self.offsets is None:
            payload = memoryview(self.images[index]).cast("B")
        else:
            a, b = int(self.offsets[index]), int(self.offsets[index + 1])
            if not 0 <= a <= b <= len(self.images):
                raise CorruptDataError(f"{self.describe(index)}: offsets out of range; run `packer verify`")
            payload = memoryview(self.images[a:b])
        sample = _sample(index, payload, self.labels, self.shapes, self.crcs)
        (height, width, channels), label = sample.shape, sample.label
        if (not self.label_low <= label < self.label_high or height < 1 or width < 1
                or channels != self.spec.channels):  # not checked at open: that would read every row
            self.check_labels(self.describe(index), np.array([label]))
            raise CorruptDataError(f"{self.describe(index)}: shape {sample.shape} is not an (H, W, "
                                   f"{self.spec.channels}) image; the dataset is damaged, re-pack")
        return sample

    def _field_map(self, field: Field) -> tuple[np.ndarray, np.ndarray | None]:
        """An extra field's values (typed, one row a sample) and no offsets, or its bytes and offsets."""
        node, mapped = self.file[f"fields/{field.name}"], self.mapped
        assert mapped is not None  # opened: the fields are mapped in _open
        if isinstance(node, h5py.Dataset):
            values = _memmap(mapped, node)
            if len(values) != self._count:
                raise ValueError(f"fields/{field.name} holds {len(values)} rows, not {self._count}")
            return values, None
        offsets = _memmap(mapped, node["offsets"])
        if len(offsets) != self._count + 1:
            raise ValueError(f"fields/{field.name}/offsets holds {len(offsets)} rows, not {self._count + 1}")
        return _memmap(mapped, node["values"]), offsets

    def read_extras(self, index: int) -> tuple[memoryview | bytes, ...]:
        where = self.describe(index)
        return tuple(_field_value(index, values, offsets, where) for values, offsets in self.field_maps)

    def fields_checksum(self, index: int) -> int | None:
        return int(self.fields_crcs[index])

    # -- reading by byte ranges (packer.formats.layout) ----------------------------------------------------------
    @classmethod
    def layout(cls, manifest: dict, source: RangeSource, where: str) -> Layout:
        """Each sample's range of ``images`` in ``data.h5`` (its slice of the blob by ``offsets``, or its row of a
        fixed-shape raw store), from byte ranges of the file: h5py reads the metadata through a
        :class:`~packer.formats.hdf5.ranges.RangeFile` (a few source reads: the file's first megabyte and what
        follows the images blob), and the small datasets are fetched together.

        ``index`` holds ``labels``, ``shapes``, ``crc32``, ``fields_crc32`` and, per extra field, ``values.NAME``
        (a number field's typed rows, or a bytes field's bytes end to end) and ``offsets.NAME`` (a bytes
        field's). Bytes fields (captions, masks) are read whole into the index for now: the images blob is what
        the ranges, and so the blocks, cover. Every dataset's extent is checked against the file's size, and
        every count against the manifest, before anything is sized from them.

        Raises:
            UsageError: a dataset of the file is chunked, compressed or external (packer writes none).
            CorruptDataError: the file disagrees with ``manifest`` or is damaged (one line naming data.h5).
        """
        path = f"{str(where).rstrip('/')}/{FILENAME}"
        checker = cls(where, manifest)  # the manifest's numbers and checks (count, labels, channels, fields)
        try:
            file = RangeFile(source, FILENAME, path)
            with h5py.File(file, "r") as f:
                return checker._layout_of(f, file, path)
        except PackerError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise CorruptDataError(f"{path}: cannot read HDF5 ({exc}); the file is damaged, re-pack") from None

    def _layout_of(self, f: h5py.File, file: RangeFile, where: str) -> Layout:
        """:meth:`layout` of the open file ``f`` (over ``file``); ``where`` names it in errors."""
        n = self._count
        images = f["images"]
        begin, nbytes = extent(images, file.size, where)
        file.fetch([(begin + nbytes, begin + nbytes + file.ahead)])  # the other datasets and their headers
        names = ["labels", "shapes", "crc32"] + (["offsets"] if "offsets" in f else [])
        names += ["fields_crc32"] if self.extra_fields else []
        nodes = [f[name] for name in names]
        groups = [f[f"fields/{field.name}"] for field in self.extra_fields]
        for node in groups:
            nodes += [node] if isinstance(node, h5py.Dataset) else [node["values"], node["offsets"]]
        values = read_arrays(file, nodes, where)
        arrays, fields = dict(zip(names, values[:len(names)], strict=True)), values[len(names):]
        self._check_file(f, where)  # counts against the manifest, labels, shapes (read again, from memory)
        for name in names[2:]:
            if arrays[name].dtype.kind not in "iu":
                raise CorruptDataError(f"{where}: '{name}' is {arrays[name].dtype}, not integers; the file is "
                                       "damaged, re-pack")
        index = {name: arrays[name] for name in ("labels", "shapes", "crc32")}
        if self.extra_fields:
            if arrays["fields_crc32"].shape != (n,):
                raise CorruptDataError(f"{where}: 'fields_crc32' is {arrays['fields_crc32'].shape}, {n} samples "
                                       f"need ({n},); the file is damaged, re-pack")
            index["fields_crc32"] = arrays["fields_crc32"]
        for field, node in zip(self.extra_fields, groups, strict=True):
            index.update(_field_index(field.name, node, fields, n, where))
        if "offsets" in arrays:
            if images.dtype != np.uint8:
                raise CorruptDataError(f"{where}: 'images' is {images.dtype}, not bytes; the file is damaged, re-pack")
            offsets = arrays["offsets"].astype(np.int64)
            check_offsets(offsets, nbytes, where, "offsets")
            start, end = begin + offsets[:-1], begin + offsets[1:]
        else:  # a fixed-shape raw store: one row a sample
            row = nbytes // n if n else 0
            start = begin + np.arange(n, dtype=np.int64) * row
            end = start + row
        layout = Layout((FILENAME,), np.zeros(n, np.int32), start, end, index)
        layout.check(n, [file.size], where)
        return layout

    @classmethod
    def join_index(cls, indexes: Sequence[dict[str, np.ndarray]], counts: Sequence[int],
                   where: object) -> dict[str, np.ndarray]:
        """The parts' indexes joined: a bytes field's ``values.NAME`` (its bytes) end to end and its
        ``offsets.NAME`` moved past the parts before (one offset more than samples); every other array one row
        a sample, end to end."""
        rest = [dict(index) for index in indexes]
        joined: dict[str, np.ndarray] = {}
        names = [key[len("offsets."):] for key in indexes[0] if key.startswith("offsets.")] if indexes else []
        for name in names:
            keys = (f"values.{name}", f"offsets.{name}")
            if not all(key in index for index in rest for key in keys):
                continue  # a part without it: join_rows says the parts differ
            pieces, offsets, base = [], [np.zeros(1, np.int64)], 0
            for index in rest:
                values, offset = index.pop(keys[0]), index.pop(keys[1]).astype(np.int64)
                first, last = int(offset[0]), int(offset[-1])  # checked within values by the part's layout
                pieces.append(values[first:last])
                offsets.append(offset[1:] - first + base)
                base += last - first
            joined[keys[0]], joined[keys[1]] = np.concatenate(pieces), np.concatenate(offsets)
        return {**join_rows(rest, counts, where), **joined}

    @classmethod
    def ranged_sample(cls, index: int, data: memoryview, layout: Layout, where: str) -> Sample:
        payload = memoryview(data).cast("B")
        size = int(layout.end[index]) - int(layout.start[index])
        if payload.nbytes != size:
            raise CorruptDataError(f"{layout.sample_name(where, index)}: {payload.nbytes} bytes "
                                   f"where its range holds {size}; open the dataset again")
        arrays = layout.index
        return _sample(index, payload, arrays["labels"], arrays["shapes"], arrays["crc32"])

    @classmethod
    def ranged_extras(cls, index: int, data: memoryview, layout: Layout, extras: Sequence[Field],
                      where: str) -> tuple[memoryview | bytes, ...]:
        arrays = layout.index
        sample = layout.sample_name(where, index)
        return tuple(_field_value(index, arrays[f"values.{field.name}"], arrays.get(f"offsets.{field.name}"), sample)
                     for field in extras)

    @classmethod
    def ranged_fields_checksum(cls, index: int, data: memoryview, layout: Layout) -> int | None:
        crcs = layout.index.get("fields_crc32")
        return None if crcs is None else int(crcs[index])

    def gather_raw(self, indices: list[int], out: np.ndarray) -> np.ndarray | None:
        """Fixed-shape raw images: one numpy gather from the map straight into ``out``."""
        if self.offsets is not None:
            return None
        images = self.images
        self._read_ahead(indices)
        for j, i in enumerate(indices):  # row copies: several times faster than np.take on a large axis 0
            out[j] = images[i]
        labels = self.labels[indices]
        self.check_labels(f"{self.path} (labels)", labels)
        return labels

    def stored_sizes(self) -> np.ndarray:
        """Each sample's image bytes: from the offsets, or the fixed size of a raw image."""
        self.open()
        if self.offsets is None:
            return np.full(self._count, self.images[0].nbytes if self._count else 0, np.int64)
        return np.diff(np.asarray(self._whole(self.offsets), dtype=np.int64))

    def class_counts(self) -> np.ndarray:
        """From the labels dataset, without touching an image; every label checked first."""
        self.open()
        labels = np.asarray(self._whole(self.labels), dtype=np.int64)
        self.check_labels(f"{self.path} (labels)", labels)
        return np.bincount(labels[labels >= 0], minlength=len(self.manifest["classes"]))

    def blocks(self, target_bytes: int) -> np.ndarray:
        """Byte ranges of the images dataset: from the offsets, or the fixed size of a raw image."""
        return blocks_by_size(self.stored_sizes(), target_bytes)

    def stored_shapes(self) -> np.ndarray | None:
        self.open()
        shapes = np.asarray(self._whole(self.shapes))
        self.check_shapes(f"{self.path} (shapes)", shapes)
        return shapes

    def relpath(self, index: int) -> str:
        self.open()
        return self.file["relpaths"].asstr()[index]

    def describe(self, index: int) -> str:
        return f"{self.path} sample {index}"

    def sample_file(self, index: int) -> str:
        return FILENAME

    def count_problems(self) -> list[str]:
        """The sample count against the manifest's, and every label and shape (``packer verify``)."""
        count = self.manifest["count"]
        if len(self.labels) != count:
            return [f"{self.path}: {len(self.labels)} samples, the manifest says {count}"]
        try:
            self.class_counts()
            self.stored_shapes()
        except CorruptDataError as exc:
            return [str(exc)]
        return []

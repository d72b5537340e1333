"""The common interface every format implements: a :class:`Writer` and a :class:`PackedDataset` reader.

A format module defines one subclass of each and registers them with :func:`register`. The converter only talks
to ``Writer``; ``open_dataset`` only to ``PackedDataset``. Readers share all decoding, read-time transforms and
batching here, so every format gives the same pixels for the same stored bytes.
"""

from __future__ import annotations

import operator
import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..errors import CorruptDataError
from ..manifest import read_manifest
from ..transforms import (
    Encoded,
    TransformSpec,
    apply_geometry,
    as_hwc,
    decode,
    open_image,
    parse_size,
    resize_crop,
    to_pil,
)


class Writer(ABC):
    """Writes converted samples, in order, into ``dest``. Lives in the main process only."""

    format: ClassVar[str]
    RESUMES_FROM: ClassVar[str] = "nothing"  # what an interrupted conversion keeps, for messages
    # fnmatch patterns of every file the writer leaves in DEST, finished or interrupted: --overwrite deletes
    # only these (and packer's own manifest, journal and loader.json)
    FILES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, dest: Path, spec: TransformSpec, expected_count: int, options: dict[str, Any]):
        self.dest = dest
        self.spec = spec
        self.expected_count = expected_count
        self.options = options
        self.count = 0

    @abstractmethod
    def write(self, label: int, relpath: str, item: Encoded) -> int | None:
        """Append one sample; its index is ``self.count`` before the call. When the call made samples durable
        (a committed transaction, a finished shard), return how many are now durable, else None."""

    def state(self) -> dict[str, Any]:
        """What :meth:`restore` needs to continue after the durable samples; saved in the journal."""
        return {"count": self.count}

    def restore(self, state: dict[str, Any]) -> int:
        """Drop anything written after ``state`` and continue from there; return the samples kept (0 restarts)."""
        return 0

    @abstractmethod
    def close(self) -> dict[str, Any]:
        """Finish every data file and return the manifest entries they add (at least ``files``)."""

    def abort(self) -> None:  # noqa: B027 - most writers have nothing to release
        """Release what is open after a failure; leave the files for --resume."""


class Sample(NamedTuple):
    """One stored sample as a reader finds it: the payload (a buffer, not yet copied) and what it needs."""

    payload: memoryview | bytes
    label: int
    shape: tuple[int, int, int]
    crc32: int | None


class PackedBatch(list):
    """What ``__getitems__`` returns: a list of ``(image, label)`` pairs, as ``default_collate`` expects, whose
    images are views into one batch tensor. :func:`packer.loader.collate` returns that tensor without copying."""

    images: torch.Tensor
    labels: torch.Tensor


def empty_batch(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """A tensor for a whole batch. In a DataLoader worker it is allocated in shared memory, so sending it to the
    main process copies nothing (as ``default_collate`` does); in the main process it can be pinned, so the
    copy to the GPU needs no staging copy."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    numel = int(np.prod(shape))
    storage = torch.UntypedStorage._new_shared(numel * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


class PackedDataset(Dataset):
    """Base of every reader. ``ds[i]`` is ``(image, label)``: a CHW tensor (uint8, or float when the dataset was
    packed with --normalize) and an int.

    Arguments shared by every reader:
        transform: a callable applied to the CHW tensor (torchvision v2 transforms work).
        target_transform: a callable applied to the label.
        decode: False returns the stored bytes (encoded modes) or array (raw) untouched.
        resize, center_crop, interpolation: a read-time resize and crop, with the same semantics as the
            offline ones (``resize=256, center_crop=224``); cheaper than an equivalent ``transform``.
        verify: check each sample's crc32 on read and raise :class:`CorruptDataError` on a mismatch.
        decoder: ``"auto"`` (simplejpeg for JPEG, Pillow otherwise; a read-time resize and crop resample only
            the cropped region) or ``"pil"`` (Pillow for everything, resize then crop: torchvision's pipeline).
        threads: threads that decode one batch in ``__getitems__`` (default 1; :func:`packer.make_loader` sets
            it to the usable cores when it decodes in the main process). Decoding releases the GIL.

    Nothing that cannot cross a fork or a pickle is opened in ``__init__``: each process opens its own handles
    on first use (checked by pid), and pickling drops them.
    """

    format: ClassVar[str] = ""
    _accepts_parts: ClassVar[bool] = False  # only PartedDataset reads a manifest of several parts

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None, decode: bool = True, resize: int | str | None = None,
                 center_crop: int | str | None = None, interpolation: str = "bilinear", verify: bool = False,
                 decoder: str = "auto", threads: int = 1, manifest: dict | None = None):
        self.root = Path(root)
        self.manifest = manifest if manifest is not None else read_manifest(self.root)
        if self.manifest.get("parts") is not None and not self._accepts_parts:
            raise ValueError(f"{self.root}: converted in {len(self.manifest['parts'])} parts (by several ranks); "
                             "open it with packer.open_dataset")
        self.classes: list[str] = list(self.manifest["classes"])
        self.class_to_idx: dict[str, int] = dict(self.manifest["class_to_idx"])
        self.spec = TransformSpec.from_dict(self.manifest["transform"])
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        crop = parse_size(center_crop)
        self.resize = parse_size(resize)
        self.center_crop = (crop, crop) if isinstance(crop, int) else crop
        self.interpolation = interpolation
        self.verify = verify
        self.decoder = decoder
        self.max_pixels = self.spec.max_pixels
        self.threads = threads
        self.pin_memory = False  # make_loader sets it: batches are then allocated in pinned memory
        self._pid: int | None = None
        self._executor: ThreadPoolExecutor | None = None
        if decoder not in ("auto", "pil"):
            raise ValueError("decoder must be 'auto' or 'pil'")
        if (self.resize or self.center_crop) and self.spec.normalize:
            raise ValueError("read-time resize/crop needs uint8 images; this dataset stores normalized floats")

    # -- per-format parts ----------------------------------------------------------------------------------
    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _open(self) -> None:
        """Open this process's handles (LMDB env, HDF5 file, mapped shards)."""

    @abstractmethod
    def _read(self, index: int) -> Sample:
        """The stored sample at ``index`` (already bounds-checked)."""

    def _read_many(self, indices: list[int]) -> list[Sample]:
        """Several samples at once; formats override this to serve a batch in one call."""
        return [self._read(i) for i in indices]

    def gather_raw(self, indices: list[int], out: np.ndarray) -> np.ndarray | None:
        """Formats that can copy a batch of raw images in one call do so into ``out`` and return the labels;
        None means "read them one by one"."""
        return None

    @abstractmethod
    def relpath(self, index: int) -> str:
        """The sample's path relative to the source folder, with '/' separators."""

    def _describe(self, index: int) -> str:
        """Where sample ``index`` lives, for error messages."""
        return f"{self.root} sample {index}"

    def open(self) -> None:
        """Open this process's handles now instead of at the first read, so that a missing, damaged or
        replaced data file is reported before any sample is asked for."""
        self._ensure_open()

    # -- shared machinery ----------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._pid != os.getpid():
            self._open()
            self._executor = None
            self._pid = os.getpid()

    def _parallel(self, fn: Callable, items: list) -> None:
        """Run ``fn`` over ``items``, on this process's decode threads when there are several."""
        if self.threads <= 1 or len(items) < 2:
            for item in items:
                fn(item)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="packer-decode")
        for _ in self._executor.map(fn, items):
            pass

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pid"] = None
        state["_executor"] = None
        for key in self._handles():
            state[key] = None
        return state

    def _handles(self) -> tuple[str, ...]:
        """Attribute names of per-process handles, dropped when pickled."""
        return ()

    def _check_index(self, index: int) -> int:
        index = operator.index(index)  # an int, numpy integer or EpochIndex; 1.5 is a TypeError, not sample 1
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for {n} samples")
        return index % n

    def _checked(self, index: int, sample: Sample) -> Sample:
        if self.verify and sample.crc32 is not None:
            if zlib.crc32(sample.payload) != sample.crc32:
                raise CorruptDataError(f"{self._describe(index)}: checksum mismatch, the stored bytes are damaged; "
                                       "run `packer verify` and re-pack")
            self._check_label(index, sample.label)
        return sample

    def _check_label(self, index: int, label: int) -> None:
        """The crc32 covers the payload only, so a damaged label is caught by comparing it with the class folder
        that starts the sample's relative path, which packer stores separately (ImageFolder: that folder is the
        class)."""
        folder = self.relpath(index).split("/", 1)[0]
        expected = self.class_to_idx.get(folder)
        if expected is not None and expected != label:
            raise CorruptDataError(f"{self._describe(index)}: label {label} does not match its class folder "
                                   f"{folder!r} ({expected}); the stored label is damaged, run `packer verify`")

    @property
    def _is_raw(self) -> bool:
        return self.spec.store == "raw"

    def _array(self, index: int, sample: Sample, out: np.ndarray | None = None) -> np.ndarray:
        """The sample as an (H, W, C) array with the read-time resize/crop applied, written into ``out`` when
        given (JPEGs decode straight into it). Without ``out`` it may be a read-only view of the stored data."""
        name = self._describe(index)
        geometry = self.resize or self.center_crop
        if self._is_raw:
            try:
                arr = np.frombuffer(sample.payload, dtype=self.spec.dtype).reshape(sample.shape)
            except ValueError:
                raise CorruptDataError(f"{name}: stored array has {len(sample.payload)} bytes, not the "
                                       f"{sample.shape} it should; re-pack") from None
            if geometry:
                arr = as_hwc(resize_crop(to_pil(arr), self.resize, self.center_crop, self.interpolation))
        elif self.decoder == "pil":
            img = open_image(bytes(sample.payload), name, self.max_pixels).convert(self.spec.mode)
            if geometry:
                img = apply_geometry(img, self.resize, None, self.center_crop, self.interpolation)
            arr = as_hwc(img)
        elif geometry:
            arr = decode(sample.payload, self.spec.mode, name, self.max_pixels)
            arr = as_hwc(resize_crop(to_pil(arr), self.resize, self.center_crop, self.interpolation))
        else:
            return decode(sample.payload, self.spec.mode, name, self.max_pixels, out=out)
        if out is not None:
            if arr.shape != out.shape:
                raise CorruptDataError(f"{name}: image is {arr.shape}, the dataset says {out.shape}; re-pack "
                                       "or pass resize/center_crop")
            out[...] = arr
            return out
        return arr

    def _finish(self, image: torch.Tensor, label: int) -> tuple[Any, Any]:
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def raw_sample(self, index: int) -> tuple[bytes | np.ndarray, int]:
        """The stored bytes (encoded modes) or a copy of the stored array (raw), and the label."""
        index = self._check_index(index)
        self._ensure_open()
        sample = self._checked(index, self._read(index))
        if self._is_raw:
            return np.frombuffer(sample.payload, dtype=self.spec.dtype).reshape(sample.shape).copy(), sample.label
        return bytes(sample.payload), sample.label

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if not self.decode:
            return self.raw_sample(index)
        index = self._check_index(index)
        self._ensure_open()
        sample = self._checked(index, self._read(index))
        arr = self._array(index, sample)
        image = torch.from_numpy(np.array(arr) if not arr.flags.writeable else arr).permute(2, 0, 1)
        return self._finish(image, sample.label)

    def output_shape(self) -> tuple[int, int, int] | None:
        """(H, W, C) of every decoded image when it is fixed, else None."""
        if self.center_crop:
            return self.center_crop[1], self.center_crop[0], self.spec.channels
        if isinstance(self.resize, tuple):
            return self.resize[1], self.resize[0], self.spec.channels
        shape = self.manifest.get("shape")
        return tuple(shape) if shape and not self.resize else None

    def __getitems__(self, indices: list[int]) -> list:
        """A whole batch in one call: one read of the format, then every image written straight into one
        (B, H, W, C) batch tensor. Returned as a :class:`PackedBatch` whose images are CHW views of it."""
        if not self.decode:
            return [self.raw_sample(i) for i in indices]
        indices = [self._check_index(i) for i in indices]
        self._ensure_open()
        shape = self.output_shape()
        if shape is None:
            items = []
            for i, s in zip(indices, self._read_many(indices), strict=True):
                arr = self._array(i, self._checked(i, s))
                items.append(self._finish(torch.from_numpy(np.array(arr)).permute(2, 0, 1), s.label))
            return items
        dtype = {"float16": torch.float16, "float32": torch.float32}.get(self.spec.dtype, torch.uint8)
        batch = empty_batch((len(indices), *shape), dtype, self.pin_memory)
        out = batch.numpy()
        labels = self.gather_raw(indices, out) if self._is_raw else None
        if labels is None:
            samples = self._read_many(indices)
            fill = lambda j: self._array(indices[j], self._checked(indices[j], samples[j]), out[j])  # noqa: E731
            if self._is_raw and not (self.resize or self.center_crop):
                for j in range(len(indices)):  # a copy each: less work than handing it to a thread
                    fill(j)
            else:
                self._parallel(fill, list(range(len(indices))))
            labels = [s.label for s in samples]
        images = batch.permute(0, 3, 1, 2)  # NCHW view, channels_last in memory: no transpose copy
        labels = torch.as_tensor(labels, dtype=torch.int64)
        pairs = zip(images.unbind(0), labels.tolist(), strict=True)
        if self.transform is not None or self.target_transform is not None:
            return [self._finish(image, label) for image, label in pairs]
        result = PackedBatch(pairs)
        result.images, result.labels = images, labels
        return result

_REGISTRY: dict[str, tuple[type[Writer], type[PackedDataset]]] = {}


def register(name: str, writer: type[Writer], reader: type[PackedDataset]) -> None:
    writer.format = name
    reader.format = name
    _REGISTRY[name] = (writer, reader)


def get_format(name: str) -> tuple[type[Writer], type[PackedDataset]]:
    from . import hdf5, lmdb, wds  # noqa: F401 - importing registers them

    if name not in _REGISTRY:
        raise ValueError(f"unknown format {name!r}; choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def writer_files() -> tuple[str, ...]:
    """The file-name patterns (fnmatch) that any format's writer leaves in DEST."""
    get_format(format_names()[0])  # registers every format
    return tuple(pattern for writer, _ in _REGISTRY.values() for pattern in writer.FILES)


def format_names() -> list[str]:
    return ["lmdb", "hdf5", "wds"]

"""The common interface every format implements: a :class:`Writer` and a :class:`PackedDataset` reader.

A format module defines one subclass of each and registers them with :func:`register`. The converter only talks
to ``Writer``; ``open_dataset`` only to ``PackedDataset``. Readers share all decoding, read-time transforms and
batching here, so every format gives the same pixels for the same stored bytes.
"""

from __future__ import annotations

import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..errors import CorruptDataError
from ..manifest import read_manifest
from ..transforms import DEFAULT_MAX_PIXELS, Encoded, TransformSpec, apply_geometry, decode, parse_size, to_pil


class Writer(ABC):
    """Writes converted samples, in order, into ``dest``. Lives in the main process only."""

    format: ClassVar[str]

    def __init__(self, dest: Path, spec: TransformSpec, expected_count: int, options: dict[str, Any]):
        self.dest = dest
        self.spec = spec
        self.expected_count = expected_count
        self.options = options
        self.count = 0

    @abstractmethod
    def write(self, label: int, relpath: str, item: Encoded) -> None:
        """Append one sample; its index is ``self.count`` before the call."""

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


def empty_batch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor for a whole batch; in a DataLoader worker it is allocated in shared memory, so sending it to the
    main process copies nothing (as ``default_collate`` does)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
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
        decoder: ``"auto"`` (simplejpeg for JPEG, Pillow otherwise) or ``"pil"`` (Pillow for everything).

    Nothing that cannot cross a fork or a pickle is opened in ``__init__``: each process opens its own handles
    on first use (checked by pid), and pickling drops them.
    """

    format: ClassVar[str] = ""

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None, decode: bool = True, resize: int | str | None = None,
                 center_crop: int | str | None = None, interpolation: str = "bilinear", verify: bool = False,
                 decoder: str = "auto", manifest: dict | None = None):
        self.root = Path(root)
        self.manifest = manifest if manifest is not None else read_manifest(self.root)
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
        self._pid: int | None = None
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

    @abstractmethod
    def relpath(self, index: int) -> str:
        """The sample's path relative to the source folder, with '/' separators."""

    def _describe(self, index: int) -> str:
        """Where sample ``index`` lives, for error messages."""
        return f"{self.root} sample {index}"

    # -- shared machinery ----------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._pid != os.getpid():
            self._open()
            self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pid"] = None
        for key in self._handles():
            state[key] = None
        return state

    def _handles(self) -> tuple[str, ...]:
        """Attribute names of per-process handles, dropped when pickled."""
        return ()

    def _check_index(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for {n} samples")
        return index % n

    def _checked(self, index: int, sample: Sample) -> Sample:
        if self.verify and sample.crc32 is not None and zlib.crc32(sample.payload) != sample.crc32:
            raise CorruptDataError(f"{self._describe(index)}: checksum mismatch, the stored bytes are damaged; "
                                   "run `packer verify` and re-pack")
        return sample

    @property
    def _is_raw(self) -> bool:
        return self.spec.store == "raw"

    def _array(self, index: int, sample: Sample) -> np.ndarray:
        """The sample as an (H, W, C) array, read-time resize/crop applied. May be a read-only view."""
        if self._is_raw:
            try:
                arr = np.frombuffer(sample.payload, dtype=self.spec.dtype).reshape(sample.shape)
            except ValueError:
                raise CorruptDataError(f"{self._describe(index)}: stored array has {len(sample.payload)} bytes, "
                                       f"not the {sample.shape} it should; re-pack") from None
        elif self.decoder == "pil":
            arr = np.asarray(_pil_decode(sample.payload, self.spec.mode, self._describe(index), self.max_pixels))
            arr = arr if arr.ndim == 3 else arr[:, :, None]
        else:
            arr = decode(sample.payload, self.spec.mode, self._describe(index), self.max_pixels)
        if self.resize or self.center_crop:
            img = apply_geometry(to_pil(arr), self.resize, None, self.center_crop, self.interpolation)
            arr = np.asarray(img)
            arr = arr if arr.ndim == 3 else arr[:, :, None]
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
        samples = self._read_many(indices)
        shape = self.output_shape()
        if shape is None:
            items = []
            for i, s in zip(indices, samples, strict=False):
                arr = self._array(i, self._checked(i, s))
                items.append(self._finish(torch.from_numpy(np.array(arr)).permute(2, 0, 1), s.label))
            return items
        dtype = torch.float16 if self.spec.dtype == "float16" else (
            torch.float32 if self.spec.dtype == "float32" else torch.uint8)
        batch = empty_batch((len(indices), *shape), dtype)
        out = batch.numpy()
        for j, (i, s) in enumerate(zip(indices, samples, strict=False)):
            self._checked(i, s)
            arr = self._array(i, s)
            if arr.shape != out.shape[1:]:
                raise CorruptDataError(f"{self._describe(i)}: image is {arr.shape}, the dataset says {shape}; "
                                       "re-pack or pass resize/center_crop")
            out[j] = arr
        images = batch.permute(0, 3, 1, 2)  # NCHW view, channels_last in memory: no transpose copy
        labels = torch.tensor([s.label for s in samples], dtype=torch.int64)
        if self.transform is not None or self.target_transform is not None:
            return [self._finish(images[j], int(labels[j])) for j in range(len(indices))]
        result = PackedBatch((images[j], int(labels[j])) for j in range(len(indices)))
        result.images, result.labels = images, labels
        return result


def _pil_decode(data: bytes | memoryview, mode: str, name: str, max_pixels: int = DEFAULT_MAX_PIXELS):
    from ..transforms import open_image

    return open_image(bytes(data), name, max_pixels).convert(mode)


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


def format_names() -> list[str]:
    return ["lmdb", "hdf5", "wds"]

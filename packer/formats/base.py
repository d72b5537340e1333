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

from ..augment import (
    Window,
    crop_resize,
    image_size,
    jpeg_size,
    pil_window,
    resized_window,
    sample_window,
    scaled_resize_crop,
    scaled_window,
    uniform_stream,
    write_image,
)
from ..errors import CorruptDataError, ImageError
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
            the cropped region; a random resized crop decodes JPEGs at a reduced DCT scale and resamples with
            OpenCV, within 30 dB of Pillow), ``"fast"`` (as
            auto, and a read-time resize of a JPEG also decodes at a reduced DCT scale: faster validation from
            large originals, a few levels from Pillow's pixels) or ``"pil"`` (Pillow for everything, resize
            then crop: torchvision's pipeline, exactly).
        random_resized_crop: an int or ``(height, width)``: torchvision's ``RandomResizedCrop`` fused into
            decoding, with ``scale`` and ``ratio`` as there. The window depends only on ``(seed, epoch, index)``
            (see :meth:`augment_params`); it replaces ``resize``/``center_crop``.
        flip: mirror left-right with probability 0.5, drawn from the same ``(seed, epoch, index)`` stream.
        seed: the augmentation seed (not the sample order's: that is the sampler's).
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
                 decoder: str = "auto", threads: int = 1, manifest: dict | None = None,
                 random_resized_crop: int | tuple[int, int] | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = False, seed: int = 0):
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
        if decoder not in ("auto", "fast", "pil"):
            raise ValueError("decoder must be 'auto', 'fast' or 'pil'")
        self.random_resized_crop = _height_width(random_resized_crop)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip = bool(flip)
        self.seed = int(seed)
        self.epoch = 0
        if not (0 < self.scale[0] <= self.scale[1] and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError("scale and ratio are (min, max) ranges of positive numbers")
        if self.random_resized_crop and (self.resize or self.center_crop):
            raise ValueError("random_resized_crop replaces resize and center_crop; give one or the other")
        if (self.resize or self.center_crop or self.augments) and self.spec.normalize:
            raise ValueError("read-time resize/crop/flip needs uint8 images; this dataset stores normalized floats")

    @property
    def augments(self) -> bool:
        """Whether reading applies a random resized crop or flip."""
        return bool(self.random_resized_crop or self.flip)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation ``ds[i]`` uses when the index does not carry one (an ``EpochIndex``
        from packer's samplers does, and wins)."""
        self.epoch = int(epoch)

    def augment_params(self, index: int, epoch: int | None = None) -> Window:
        """The random resized crop window and flip of sample ``index`` in ``epoch`` (default: the index's
        epoch, else :attr:`epoch`): ``(top, left, height, width, flipped)`` in the stored image's full-size
        pixels. The whole image when there is no random resized crop.

        Args:
            index: the sample index.
            epoch: the epoch; the same (seed, epoch, index) always gives the same window.

        Returns:
            a :class:`packer.augment.Window` named tuple.
        """
        if epoch is None:
            epoch = getattr(index, "epoch", self.epoch)
        index = self._check_index(index)
        self._ensure_open()
        return self._window(index, self._read(index), epoch)

    def _full_size(self, index: int, sample: Sample) -> tuple[int, int]:
        """(height, width) of the stored image from its index entry, or from its header (never by decoding)."""
        if sample.shape[0] and sample.shape[1]:
            return sample.shape[0], sample.shape[1]
        size = image_size(sample.payload)
        if size is None:  # a damaged header: decoding reports it with the sample's name
            size = self._plain_array(index, sample).shape[:2]
        return size

    def _window(self, index: int, sample: Sample, epoch: int) -> Window:
        height, width = self._full_size(index, sample)
        return sample_window(height, width, self.scale, self.ratio, uniform_stream(self.seed, epoch, index),
                             crop=self.random_resized_crop is not None, flip=self.flip)

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

    def _array(self, index: int, sample: Sample, out: np.ndarray | None = None, epoch: int = 0) -> np.ndarray:
        """The sample as an (H, W, C) array with the read-time resize/crop or augmentation of ``epoch`` applied,
        written into ``out`` when given (JPEGs decode straight into it). Without ``out`` it may be a read-only
        view of the stored data."""
        if not self.augments:
            return self._plain_array(index, sample, out)
        window = self._window(index, sample, epoch)
        if self.random_resized_crop is not None:
            return self._resized_crop(index, sample, window, out)
        image = self._plain_array(index, sample)  # flip only, after any resize/crop
        if out is not None and image.shape[:2] != out.shape[:2]:
            raise CorruptDataError(f"{self._describe(index)}: image is {image.shape}, the dataset says "
                                   f"{out.shape}; re-pack or pass resize/center_crop")
        return write_image(image, window.flipped, out)

    def _resized_crop(self, index: int, sample: Sample, window: Window, out: np.ndarray | None) -> np.ndarray:
        """The window resampled to the output size and mirrored when flipped, written into ``out`` when given:
        exactly torchvision's ``resized_crop`` then ``hflip`` on the decoded image (decoder pil), or the fast
        path (auto/fast): JPEGs decoded at a reduced DCT scale, OpenCV's resampler, within 30 dB of Pillow's."""
        name = self._describe(index)
        size = self.random_resized_crop
        full = self._full_size(index, sample)
        fast = self.decoder != "pil"
        if fast and not self._is_raw:
            arr = self._scaled_jpeg(sample, name, full, lambda data: scaled_window(
                data, self.spec.mode, full, window, size, self.interpolation, out))
            if arr is not None:
                return arr
        if self._is_raw or fast:
            arr = self._stored_array(sample, name) if self._is_raw else decode(sample.payload, self.spec.mode,
                                                                               name, self.max_pixels)
            decoded = arr.shape[:2]
        else:
            img = open_image(bytes(sample.payload), name, self.max_pixels).convert(self.spec.mode)
            decoded = (img.height, img.width)
        if decoded != full:
            raise CorruptDataError(f"{name}: image is {decoded[1]}x{decoded[0]}, the dataset says "
                                   f"{full[1]}x{full[0]}; re-pack")
        if fast:
            return resized_window(arr, full, window, size, self.interpolation, out)
        image = pil_window(arr, window, size, self.interpolation) if self._is_raw else crop_resize(
            img, window, size, self.interpolation)
        return write_image(image, window.flipped, out)

    def _scaled_jpeg(self, sample: Sample, name: str, full: tuple[int, int], fn: Callable) -> Any:
        """``fn(payload)`` for a JPEG simplejpeg decodes as Pillow would, after the checks a full decode makes;
        None for anything else (it takes the full decode)."""
        size = jpeg_size(sample.payload)
        if size is None:
            return None
        height, width = size
        if size != full:
            raise CorruptDataError(f"{name}: image is {width}x{height}, the dataset says {full[1]}x{full[0]}; "
                                   "re-pack")
        if height * width > self.max_pixels:
            raise ImageError(name, f"{width}x{height} is over the {self.max_pixels:,}-pixel limit; raise "
                                   "--max-pixels")
        try:
            return fn(sample.payload)
        except ValueError as exc:
            raise ImageError(name, f"cannot decode JPEG ({exc}); remove or replace the file") from None

    def _stored_array(self, sample: Sample, name: str) -> np.ndarray:
        try:
            return np.frombuffer(sample.payload, dtype=self.spec.dtype).reshape(sample.shape)
        except ValueError:
            raise CorruptDataError(f"{name}: stored array has {len(sample.payload)} bytes, not the "
                                   f"{sample.shape} it should; re-pack") from None

    def _plain_array(self, index: int, sample: Sample, out: np.ndarray | None = None) -> np.ndarray:
        """The sample with the read-time resize/crop applied (no augmentation); see :meth:`_array`."""
        name = self._describe(index)
        geometry = self.resize or self.center_crop
        if self._is_raw:
            arr = self._stored_array(sample, name)
            if geometry:
                arr = as_hwc(resize_crop(to_pil(arr), self.resize, self.center_crop, self.interpolation))
        elif self.decoder == "pil":
            img = open_image(bytes(sample.payload), name, self.max_pixels).convert(self.spec.mode)
            if geometry:
                img = apply_geometry(img, self.resize, None, self.center_crop, self.interpolation)
            arr = as_hwc(img)
        elif geometry:
            img = None
            if self.decoder == "fast":
                full = self._full_size(index, sample)
                img = self._scaled_jpeg(sample, name, full, lambda data: scaled_resize_crop(
                    data, self.spec.mode, full, self.resize, self.center_crop, self.interpolation))
            if img is None:
                img = resize_crop(to_pil(decode(sample.payload, self.spec.mode, name, self.max_pixels)),
                                  self.resize, self.center_crop, self.interpolation)
            arr = as_hwc(img)
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
        epoch = getattr(index, "epoch", self.epoch)  # before normalising: index % n drops it
        index = self._check_index(index)
        self._ensure_open()
        sample = self._checked(index, self._read(index))
        arr = self._array(index, sample, epoch=epoch)
        image = torch.from_numpy(np.array(arr) if not arr.flags.writeable else arr).permute(2, 0, 1)
        return self._finish(image, sample.label)

    def output_shape(self) -> tuple[int, int, int] | None:
        """(H, W, C) of every decoded image when it is fixed, else None."""
        if self.random_resized_crop:
            return *self.random_resized_crop, self.spec.channels
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
        epochs = [getattr(i, "epoch", self.epoch) for i in indices]  # before normalising: index % n drops it
        indices = [self._check_index(i) for i in indices]
        self._ensure_open()
        shape = self.output_shape()
        copies_only = self._is_raw and not (self.resize or self.center_crop or self.augments)
        if shape is None:  # images of varying size: each its own array, decoded on the threads all the same
            samples = self._read_many(indices)
            arrays: list = [None] * len(indices)

            def decode_one(j: int) -> None:
                arr = self._array(indices[j], self._checked(indices[j], samples[j]), epoch=epochs[j])
                arrays[j] = arr if arr.flags.writeable else np.array(arr)

            if copies_only:
                for j in range(len(indices)):
                    decode_one(j)
            else:
                self._parallel(decode_one, list(range(len(indices))))
            return [self._finish(torch.from_numpy(arr).permute(2, 0, 1), s.label)
                    for arr, s in zip(arrays, samples, strict=True)]
        dtype = {"float16": torch.float16, "float32": torch.float32}.get(self.spec.dtype, torch.uint8)
        batch = empty_batch((len(indices), *shape), dtype, self.pin_memory)
        out = batch.numpy()
        labels = self.gather_raw(indices, out) if copies_only else None
        if labels is None:
            samples = self._read_many(indices)
            fill = lambda j: self._array(indices[j], self._checked(indices[j], samples[j]), out[j],  # noqa: E731
                                         epochs[j])
            if copies_only:
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

def _height_width(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """An int or (height, width), torchvision's convention for ``RandomResizedCrop(size)``, as (height, width)."""
    if size is None:
        return None
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise ValueError(f"random_resized_crop must be a positive int or (height, width), not {size!r}")
    return pair


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

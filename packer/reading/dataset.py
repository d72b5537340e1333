"""The torch Datasets over packed data: one generic :class:`PackedDataset` that holds a format's
:class:`~packer.formats.base.Reader`, and the per-format names users construct (``LmdbDataset(root, ...)``).

The reader finds the stored samples; the :class:`~packer.reading.decoding.Decoding` the dataset holds (``ds.decoding``,
built from its read-time arguments) turns each into pixels; this module adds what torch needs: tensors, the
whole-batch read (``__getitems__``) with its decode threads, and pickling for worker processes.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import numpy as np
import torch

from .. import arguments
from ..errors import UsageError
from ..fields import Field, is_pair_schema, schema_of
from ..formats import PartedReader, Reader, open_blocked, open_paged, open_reader, reader_class
from ..formats.base import Sample
from ..formats.hdf5 import Hdf5Reader
from ..formats.lmdb import LmdbReader
from ..formats.wds import WdsReader
from .augment import Window
from .batches import TORCH_DTYPES, BatchDataset, FieldBatch, collate_fields, field_tensor
from .buffers import BatchPool, empty_batch
from .decoding import Decoding, Sized, View
from .fields import FieldDecoder, select_fields
from .threads import DecodeThreads


class PackedBatch(list):
    """What ``__getitems__`` returns: a list of ``(image, label)`` pairs, as ``default_collate`` expects, whose
    images are views into one batch tensor. :func:`packer.loading.loader.collate` returns that tensor without
    copying."""

    images: torch.Tensor
    labels: torch.Tensor
    sources: torch.Tensor | None = None  # a mixture's (packer.mix): the dataset each sample came from


_DATASETS: dict[type[Reader], type[PackedDataset]] = {}  # filled as the subclasses below are defined


def _decoding_attribute(name: str, doc: str) -> property:
    """A read-only attribute of the dataset that is its :class:`~packer.reading.decoding.Decoding`'s."""
    return property(lambda self: getattr(self.decoding, name), doc=doc)


class PackedDataset(BatchDataset):
    """A packed dataset as a torch Dataset. ``ds[i]`` is ``(image, label)``: a CHW tensor (uint8, or float when
    the dataset was packed with --normalize) and an int.

    Args:
        root: the dataset folder (read with the subclass's reader), or a :class:`~packer.formats.base.Reader`.
        transform: a callable applied to the CHW tensor (torchvision v2 transforms work).
        target_transform: a callable applied to the label.
        decode: False returns the stored bytes (encoded modes) or array (raw) untouched.
        verify: check each sample's crc32 on read and raise :class:`CorruptDataError` on a mismatch.
        threads: threads that decode one batch in ``__getitems__`` (default 1). :func:`packer.make_loader`
            passes its own to each batch read (:meth:`read_batch`) instead. Decoding releases the GIL.
        manifest: the manifest, when the caller has read it already.
        resize: a read-time resize as the offline one (N: the shorter side; ``"WxH"``), cheaper than a transform;
            or a function of the epoch that gives it (a resolution schedule: every batch of an epoch has that
            epoch's size).
        center_crop: a read-time centre crop after the resize (N or ``"WxH"``), as the offline one; or a function
            of the epoch.
        interpolation: the read-time resize's filter (``bilinear``, ``bicubic``, ``nearest``...).
        decoder: ``"auto"`` (simplejpeg for JPEG, else Pillow; a read-time resize and crop within one level of
            ``"pil"``; a random resized crop from a DCT-scaled decode, resampled by OpenCV, within 30 dB of Pillow),
            ``"fast"`` (also the read-time resize and crop from a DCT-scaled decode where the JPEG is over twice the
            resized size: faster from ``original`` stores, within 30 dB of auto; docs/training.md, "Which decoder
            for what") or ``"pil"`` (Pillow for everything: torchvision's pipeline, exactly).
        random_resized_crop: an int or ``(height, width)``: torchvision's ``RandomResizedCrop`` fused into decoding,
            its window a function of ``(seed, epoch, index)`` (:meth:`augment_params`); replaces the resize and crop.
            Or a function of the epoch that gives the size (``lambda epoch: 160 + 32 * min(epoch, 10) // 10``).
        scale: the crop's area as a fraction of the image's, ``(min, max)``, as torchvision's.
        ratio: the crop's width / height, ``(min, max)``, as torchvision's.
        flip: mirror left-right with probability 0.5, drawn from the same ``(seed, epoch, index)`` stream.
        seed: the augmentation seed (not the sample order's: that is the sampler's).
        fields: the fields to give, by name, as a tuple in that order (``("image", "caption")``); default:
            ``(image, label)`` for an image-and-class dataset, else a dict of every field (:attr:`fields`).
            Every image and mask field of a sample gets the image's read-time geometry and augmentation.
        **options: the reader's own options (LMDB's ``readahead``, HDF5's ``locking``).

    Nothing that cannot cross a fork or a pickle is opened in ``__init__``: each process opens its own handles
    on first use (checked by pid), and pickling drops them.
    """

    reader_class: ClassVar[type[Reader] | None] = None  # what a subclass reads ``root`` with

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.reader_class is not None:
            _DATASETS.setdefault(cls.reader_class, cls)  # open_dataset gives a reader's first dataset class

    spec = _decoding_attribute("spec", "How the images were stored (:class:`~packer.images.transforms.TransformSpec`).")
    resize = _decoding_attribute("resize", "The read-time resize (an int: the shorter side; or (w, h)), or None.")
    center_crop = _decoding_attribute("center_crop", "The read-time centre crop as (w, h), or None.")
    interpolation = _decoding_attribute("interpolation", "The read-time resize's filter.")
    decoder = _decoding_attribute("decoder", "``auto``, ``fast`` or ``pil``.")
    random_resized_crop = _decoding_attribute("random_resized_crop", "The fused crop's (height, width), or None.")
    scale = _decoding_attribute("scale", "The random resized crop's area range, (min, max).")
    ratio = _decoding_attribute("ratio", "The random resized crop's aspect-ratio range, (min, max).")
    flip = _decoding_attribute("flip", "Whether reading mirrors half the images left-right.")
    seed = _decoding_attribute("seed", "The augmentation seed.")
    epoch = _decoding_attribute("epoch", "The epoch ``ds[i]`` augments with when the index carries none.")
    augments = _decoding_attribute("augments", "Whether reading applies a random resized crop or flip.")

    def __init__(self, root: str | os.PathLike | Reader, transform: Callable | None = None,
                 target_transform: Callable | None = None, decode: bool = True, verify: bool = False,
                 threads: int = 1, manifest: dict | None = None, fields: Sequence[str] | str | None = None,
                 resize: Sized | None = None, center_crop: Sized | None = None,
                 interpolation: str = "bilinear", decoder: str = "auto",
                 random_resized_crop: Sized | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = False, seed: int = 0, **options: Any):
        if isinstance(root, Reader):
            if manifest is not None or options:
                raise TypeError(f"a dataset over a given reader takes no reader options ({', '.join(options)})")
            reader = root
        elif self.reader_class is None:
            raise TypeError("PackedDataset reads through a Reader: pass one, or use packer.open_dataset(root)")
        else:
            reader = self.reader_class(root, manifest=manifest, **options)
        self.reader = reader
        self.decoding = Decoding(reader, resize=resize, center_crop=center_crop, interpolation=interpolation,
                                 decoder=decoder, random_resized_crop=random_resized_crop, scale=scale, ratio=ratio,
                                 flip=flip, seed=seed)
        self.root = reader.root
        self.manifest = reader.manifest
        self.classes: list[str] = reader.classes
        self.class_to_idx: dict[str, int] = reader.class_to_idx
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        self.verify = verify
        self.threads = threads
        self._threads = DecodeThreads()
        self._batches = BatchPool()  # main-process batch arrays, reused once nothing refers to them
        self.schema: list[Field] = list(getattr(reader, "schema", None) or schema_of(reader.manifest))
        self._select(fields)

    def _select(self, fields: Sequence[str] | str | None) -> None:
        selected = select_fields(self.schema, fields)
        self._pair = fields is None and is_pair_schema(self.schema)  # ds[i] is (image, label), as always
        self._as_dict = fields is None
        self._fields = FieldDecoder(self.schema, selected)

    def with_fields(self, fields: Sequence[str] | str | None) -> PackedDataset:
        """This dataset giving ``fields`` instead (as ``open_dataset``'s ``fields=`` takes them): a copy that
        shares its reader and read-time options."""
        copied = copy.copy(self)
        copied._select(fields)
        copied._threads, copied._batches = DecodeThreads(), BatchPool()
        return copied

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation ``ds[i]`` uses when the index does not carry one (an ``EpochIndex``
        from packer's samplers does, and wins)."""
        self.decoding.set_epoch(epoch)

    def epoch_view(self, epoch: int) -> View | None:
        """The sizes a resolution schedule gives ``epoch`` (None without one): what packer's sampler sends with
        each index of the epoch (:meth:`Decoding.epoch_view`)."""
        return self.decoding.epoch_view(epoch)

    def augment_params(self, index: int, epoch: int | None = None) -> Window:
        """The random resized crop window and flip of sample ``index`` in ``epoch`` (default: the index's
        epoch, else :attr:`epoch`): ``(top, left, height, width, flipped)`` in the stored image's full-size
        pixels; the whole image without a random resized crop. See :meth:`Decoding.augment_params`."""
        epoch = getattr(index, "epoch", self.epoch) if epoch is None else epoch
        return self.decoding.for_epoch(epoch).augment_params(index, epoch)

    def output_shape(self, epoch: int | None = None) -> tuple[int, int, int] | None:
        """(H, W, C) of every decoded image of ``epoch`` (default :attr:`epoch`) when it is fixed, else None."""
        return self.decoding.for_epoch(self.epoch if epoch is None else epoch).output_shape()

    def decode_array(self, index: int, sample: Sample, out: np.ndarray | None = None, epoch: int = 0) -> np.ndarray:
        """The sample as an (H, W, C) array with the read-time geometry and augmentation of ``epoch``
        (:meth:`Decoding.decode_array`)."""
        return self.decoding.for_epoch(epoch).decode_array(index, sample, out, epoch)

    def row_decoder(self) -> Callable[[int, Sample, np.ndarray, int], np.ndarray]:
        """The decode of a batch's rows, chosen once per batch (:meth:`Decoding.row_decoder`)."""
        return self.decoding.for_epoch(self.epoch).row_decoder()

    @property
    def fields(self) -> list[Field]:
        """The dataset's schema: every field (name, kind, shape) in stored order."""
        return list(self.schema)

    @property
    def gives(self) -> tuple[str, list[Field]]:
        """What a sample is: ``"pair"`` (``(image, label)``), ``"dict"`` or ``"tuple"`` (``fields=``); and the
        fields it gives, in order."""
        return "pair" if self._pair else "dict" if self._as_dict else "tuple", list(self._fields.selected)

    @property
    def where(self) -> str:
        """What messages name the dataset by: its folder."""
        return str(self.root)

    @property
    def format(self) -> str:
        """The storage format's name (``lmdb``, ``hdf5``, ``wds``; ``folder`` for a :class:`FolderDataset`)."""
        return self.reader.format

    def __len__(self) -> int:
        return len(self.reader)

    def open(self) -> None:
        """Open this process's handles now instead of at the first read, so that a missing, damaged or
        replaced data file is reported before any sample is asked for."""
        self.reader.open()

    def blocks(self, target_bytes: int = 64 << 20) -> np.ndarray:
        """The start index of each block of about ``target_bytes`` that the reader reads sequentially (a
        WebDataset shard; a byte range of an LMDB or HDF5 file; never across two parts of a torchrun-converted
        dataset): what ``make_loader(shuffle="blocks")`` shuffles. An increasing int64 array from 0."""
        return self.reader.blocks(target_bytes)

    def relpath(self, index: int) -> str:
        """The sample's path relative to the source folder, with '/' separators."""
        return self.reader.relpath(self.reader.check_index(index))

    def raw_sample(self, index: int) -> tuple[bytes | np.ndarray, int]:
        """The stored bytes (encoded modes) or a copy of the stored array (raw), and the label."""
        return self.reader.raw_sample(self.reader.check_index(index), verify=self.verify)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_batches"] = BatchPool()
        return state

    def _verified(self, index: int, sample: Sample) -> Sample:
        return self.reader.checked(index, sample) if self.verify else sample

    def _finish(self, image: torch.Tensor, label: int) -> tuple[Any, Any]:
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if not self.decode:
            return self.raw_sample(index)
        epoch = getattr(index, "epoch", self.epoch)  # before normalising: index % n drops it
        decoding = self.decoding.of([index], self.epoch)
        index = self.reader.check_index(index)
        self.reader.open()
        if not self._pair:
            raw = self.reader.read_fields(index, self.verify) if self._fields.needs_fields else {}
            return self._item(decoding, index, self._verified(index, self.reader.read(index)), raw, epoch)
        sample = self._verified(index, self.reader.read(index))
        arr = decoding.decode_array(index, sample, epoch=epoch)
        image = torch.from_numpy(np.array(arr) if not arr.flags.writeable else arr).permute(2, 0, 1)
        return self._finish(image, sample.label)

    def __getitems__(self, indices: list[int]) -> list:
        """A whole batch in one call, on this dataset's ``threads``: see :meth:`read_batch`."""
        return self.read_batch(indices)

    def read_batch(self, indices: list[int], threads: int | None = None, pin_memory: bool = False) -> list:
        """A whole batch in one call: one read of the format, then every image written straight into one
        (B, H, W, C) batch tensor.

        Args:
            indices: sample indices (an ``EpochIndex`` carries the epoch its augmentation uses).
            threads: decode threads (default: the dataset's ``threads``).
            pin_memory: allocate the batch in pinned memory (in the main process), so that the copy to the GPU
                needs no staging copy. Without it, the main process's batches come from this dataset's
                :class:`~packer.reading.buffers.BatchPool`: memory is reused only once no tensor refers to it.

        Returns:
            A :class:`PackedBatch` whose images are CHW views of the batch tensor; a list of ``(image, label)``
            pairs when a transform applies or images vary in size; the stored samples with ``decode=False``.
        """
        if not self.decode:
            return [self.raw_sample(i) for i in indices]
        threads = self.threads if threads is None else threads
        if not self._pair:
            return self._read_fields_batch(indices, threads, pin_memory)
        shape = self.decoding.of(indices, self.epoch).output_shape()
        if shape is None:  # images of varying size: each its own array, decoded on the threads all the same
            return self._read_varying(indices, threads)
        batch = empty_batch((len(indices), *shape), self.output_dtype(), pin_memory, self._batches)
        labels = torch.as_tensor(self.decode_into(indices, batch.numpy(), threads), dtype=torch.int64)
        images = batch.permute(0, 3, 1, 2)  # NCHW view, channels_last in memory: no transpose copy
        pairs = zip(images.unbind(0), labels.tolist(), strict=True)
        if self.transform is not None or self.target_transform is not None:
            return [self._finish(image, label) for image, label in pairs]
        result = PackedBatch(pairs)
        result.images, result.labels = images, labels
        return result

    def decode_into(self, indices: list[int], out: np.ndarray, threads: int = 1,
                    rows: Sequence[int] | None = None) -> list[int] | np.ndarray:
        """Decode samples into the rows of a caller's array: what :meth:`read_batch` does after allocating its
        batch, and what packer's worker processes run into their shared-memory slots.

        Args:
            indices: sample indices (an ``EpochIndex`` carries the epoch its augmentation uses).
            out: a C-contiguous ``(len(indices), H, W, C)`` array of :meth:`output_shape` and the stored dtype.
            threads: decode threads.
            rows: the row of ``out`` each index is written into (default: in order); ``out`` may then have more.

        Returns:
            The labels, in order (no ``target_transform``: that is applied per item).
        """
        reader = self.reader
        decoding = self.decoding.of(indices, self.epoch)
        indices, epochs = self._batch_indices(indices)
        copies_only = self._copies_only(decoding)
        labels = reader.gather_raw(indices, out) if copies_only and not self.verify and rows is None else None
        if labels is None:
            samples = reader.read_many(indices)
            decode_row = decoding.row_decoder()
            at = range(len(indices)) if rows is None else rows
            fill = lambda j: decode_row(indices[j], self._verified(indices[j], samples[j]), out[at[j]],  # noqa: E731
                                        epochs[j])
            # a copy each is less work than handing it to a thread
            self._threads.run(fill, list(range(len(indices))), 1 if copies_only else threads)
            return [s.label for s in samples]
        return labels

    # -- fields (datasets beyond image + class, or fields=) ----------------------------------------------------
    def _package(self, values: dict[str, Any]) -> Any:
        """The selected values as a dict (no ``fields=``) or a tuple in the order asked, with the transform on
        the image and the target_transform on the label."""
        if self.transform is not None and "image" in values:
            values["image"] = self.transform(values["image"])
        label = self._fields.label_name
        if self.target_transform is not None and label in values:
            values[label] = self.target_transform(values[label])
        return values if self._as_dict else tuple(values.values())

    def _item(self, decoding: Decoding, index: int, sample: Sample, raw: dict, epoch: int) -> Any:
        """``ds[index]`` of a dataset with fields, from its stored sample and raw field bytes."""
        values = self._fields.sample_values(decoding, index, sample, raw, epoch)
        by_name = {f.name: f for f in self._fields.selected}
        return self._package({name: field_tensor(by_name[name], v) for name, v in values.items()})

    def batch_layout(self, epoch: int | None = None, decoding: Decoding | None = None
                     ) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
        """The batch tensors one batch row of this dataset fills in ``epoch`` (default :attr:`epoch`), ``(name,
        row shape, dtype)``: the images (H, W, C), and each image or mask field selected; None when images vary
        in size."""
        decoding = decoding or self.decoding.for_epoch(self.epoch if epoch is None else epoch)
        shape = decoding.output_shape()
        if shape is None:
            return None
        layout = [("image", tuple(shape), self.output_dtype())] if self._pair or self._fields.image else []
        for field in self._fields.dense:
            dtype = TORCH_DTYPES[self._fields.row_dtype(field)]
            layout.append((field.name, self._fields.row_shape(field, shape), dtype))
        return layout

    def decode_rows(self, indices: list[int], outs: dict[str, np.ndarray], threads: int = 1,
                    rows: Sequence[int] | None = None) -> tuple[list[int], dict[str, list]]:
        """Decode a batch of a dataset with fields: each dense field into the rows of its array in ``outs``
        (:meth:`batch_layout`; index j into row ``rows[j]``, default j), the rest into lists. What
        :meth:`read_batch` and packer's worker processes run.

        Returns:
            The labels, and the values of the fields that are not dense, by name (one list each).
        """
        reader, fields = self.reader, self._fields
        decoding = self.decoding.of(indices, self.epoch)
        indices, epochs = self._batch_indices(indices)
        samples = reader.read_many(indices)
        raws = reader.read_fields_many(indices, self.verify) if fields.needs_fields else [{}] * len(indices)
        values: dict[str, list] = {f.name: [None] * len(indices) for f in fields.selected if f.name not in outs}
        decode_row = decoding.row_decoder() if fields.image else None
        at = range(len(indices)) if rows is None else rows

        def fill(j: int) -> None:
            index = indices[j]
            row = fields.sample_values(decoding, index, self._verified(index, samples[j]), raws[j], epochs[j],
                                       {name: out[at[j]] for name, out in outs.items()}, decode_row)
            for name, column in values.items():
                column[j] = row[name]

        self._threads.run(fill, list(range(len(indices))), threads)
        return [s.label for s in samples], values

    def field_batch(self, tensors: dict[str, torch.Tensor], labels: list[int], values: dict[str, list]) -> Any:
        """The batch of a dataset with fields: dense fields as their batch tensors (images NCHW), the label and
        fixed-shape numbers stacked, text, JSON, bytes and variable-length vectors as lists; a dict, or a tuple
        in the ``fields=`` order."""
        batch = collate_fields(self._fields.selected, self._fields.label_name, tensors, labels, values)
        return batch if self._as_dict else tuple(batch.values())

    def decode_slot(self, indices: list[int], arrays: list[np.ndarray]) -> Any:
        """What a worker process runs: decode a batch into the arrays of its shared-memory slot, one per
        :meth:`batch_layout` entry; returns what :meth:`slot_batch` makes the batch with (the labels, and for a
        dataset with fields the other values)."""
        if self._pair:
            return self.decode_into(indices, arrays[0])
        layout = cast(list, self.batch_layout(decoding=self.decoding.of(indices, self.epoch)))  # slots: one layout
        return self.decode_rows(indices, {name: a for (name, _, _), a in zip(layout, arrays, strict=True)})

    def slot_batch(self, tensors: list[torch.Tensor], result: Any) -> Any:
        """The batch from a slot's tensors (:meth:`batch_layout`, (B, ...) each) and a worker's result
        (:meth:`decode_slot`): ``(images, labels)``, or the batch of a dataset with fields."""
        if self._pair:
            return tensors[0].permute(0, 3, 1, 2), torch.as_tensor(result, dtype=torch.int64)
        names = [name for name, _, _ in cast(list, self.batch_layout())]  # not None, as in decode_slot
        return self.field_batch(dict(zip(names, tensors, strict=True)), *result)

    def _read_fields_batch(self, indices: list[int], threads: int, pin_memory: bool) -> list:
        layout = self.batch_layout(decoding=self.decoding.of(indices, self.epoch))
        if layout is None or self.transform is not None or self.target_transform is not None:
            return self._read_field_items(indices, threads)
        n = len(indices)
        tensors = {name: empty_batch((n, *row), dtype, pin_memory, self._batches) for name, row, dtype in layout}
        labels, values = self.decode_rows(indices, {k: t.numpy() for k, t in tensors.items()}, threads)
        collated = self.field_batch(tensors, labels, values)
        named = collated if self._as_dict else dict(zip([f.name for f in self._fields.selected], collated,
                                                        strict=True))
        items = [{name: column[j] for name, column in named.items()} for j in range(n)]
        result = FieldBatch(items if self._as_dict else [tuple(item.values()) for item in items])
        result.collated = collated
        return result

    def _read_field_items(self, indices: list[int], threads: int) -> list:
        """Each sample on its own (images of varying size, or a per-item transform), decoded on the threads."""
        reader = self.reader
        decoding = self.decoding.of(indices, self.epoch)
        indices, epochs = self._batch_indices(indices)
        samples = reader.read_many(indices)
        raws = reader.read_fields_many(indices, self.verify) if self._fields.needs_fields else [{}] * len(indices)
        items: list = [None] * len(indices)

        def read_item(j: int) -> None:
            items[j] = self._item(decoding, indices[j], self._verified(indices[j], samples[j]), raws[j], epochs[j])

        self._threads.run(read_item, list(range(len(indices))), threads)
        result = FieldBatch(items)
        result.fields = self._fields.selected
        return result

    def output_dtype(self) -> torch.dtype:
        """The dtype of the images this dataset gives: uint8, or the float type it was packed with."""
        return {"float16": torch.float16, "float32": torch.float32}.get(self.spec.dtype, torch.uint8)

    def _copies_only(self, decoding: Decoding) -> bool:
        return self.reader.is_raw and not (decoding.resize or decoding.center_crop or decoding.augments)

    def _batch_indices(self, indices: list[int]) -> tuple[list[int], list[int]]:
        """The indices in range, and each one's epoch, taken first: ``index % n`` drops an EpochIndex's. Opens
        the reader."""
        epochs = [getattr(i, "epoch", self.epoch) for i in indices]
        indices = [self.reader.check_index(i) for i in indices]
        self.reader.open()
        return indices, epochs

    def _read_varying(self, indices: list[int], threads: int) -> list:
        reader = self.reader
        decoding = self.decoding.of(indices, self.epoch)
        indices, epochs = self._batch_indices(indices)
        samples = reader.read_many(indices)
        arrays: list = [None] * len(indices)

        def decode_one(j: int) -> None:
            arr = decoding.decode_array(indices[j], self._verified(indices[j], samples[j]), epoch=epochs[j])
            arrays[j] = arr if arr.flags.writeable else np.array(arr)

        self._threads.run(decode_one, list(range(len(indices))), 1 if self._copies_only(decoding) else threads)
        return [self._finish(torch.from_numpy(arr).permute(2, 0, 1), s.label)
                for arr, s in zip(arrays, samples, strict=True)]


class LmdbDataset(PackedDataset):
    """An LMDB dataset (:class:`packer.formats.lmdb.LmdbReader`): ``LmdbDataset(root, readahead=True, ...)``."""

    reader_class = LmdbReader


class Hdf5Dataset(PackedDataset):
    """An HDF5 dataset (:class:`packer.formats.hdf5.Hdf5Reader`): ``Hdf5Dataset(root, locking=False, ...)``."""

    reader_class = Hdf5Reader


class WdsDataset(PackedDataset):
    """WebDataset shards with random access (:class:`packer.formats.wds.WdsReader`). For sequential or remote
    reading through the ``webdataset`` library, see :func:`packer.stream`."""

    reader_class = WdsReader
    skipped: list[tuple[str, str]]  # from_shards only: what the scan left out

    @classmethod
    def from_shards(cls, paths: list[str | os.PathLike], label_key: str = "cls", classes: list[str] | None = None,
                    warn_skipped: bool = True, **kwargs: Any) -> WdsDataset:
        """Random access to shards packer did not write (see :meth:`WdsReader.from_shards`).

        Args:
            paths: the shard files.
            label_key: where the integer label is: ``cls``, or ``json:FIELD``.
            classes: the class names (default ``"0"``..``"max label"``).
            warn_skipped: say in one warning line what was left out.
            **kwargs: the dataset's arguments (``transform``, ``decode``...).

        Returns:
            The dataset; its ``skipped`` lists what :func:`~packer.formats.wds.scan_shards` left out, as
            ``[("SHARD/MEMBER", why)]``.
        """
        dataset = cls(WdsReader.from_shards(paths, label_key, classes, warn_skipped), **kwargs)
        dataset.skipped = dataset.reader.skipped
        return dataset


class PartedDataset(PackedDataset):
    """One dataset over the parts of a distributed conversion (:class:`packer.formats.parts.PartedReader`);
    :func:`open_dataset` returns it for such a manifest. It takes the same arguments as the format's dataset."""

    reader_class = PartedReader


_READER_OPTIONS = {"readahead": "lmdb", "locking": "hdf5"}  # open_dataset's reader options: the format of each


def open_dataset(root: str | os.PathLike, *, transform: Callable | None = None,
                 target_transform: Callable | None = None, decode: bool = True, verify: bool = False,
                 threads: int = 1, resize: Sized | None = None, center_crop: Sized | None = None,
                 interpolation: str = "bilinear", decoder: str = "auto",
                 random_resized_crop: Sized | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = False, seed: int = 0,
                 fields: Sequence[str] | str | None = None, readahead: bool | None = None, locking: bool | None = None,
                 storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, page_budget: int | str | None = None) -> PackedDataset:
    """The Dataset of the packed dataset in ``root``, as its ``manifest.json`` says. Every argument is checked
    here: a bad one is a one-line ``ValueError`` naming it, never a failure at the first read.

    Args:
        root: the dataset folder, or its URL (``s3://bucket/ds``, ``gs://``, ``https://``), read from the cache.
        transform: a callable applied to each CHW image tensor (torchvision v2 transforms work).
        target_transform: a callable applied to each label.
        decode: False returns the stored bytes (encoded stores) or array (raw) untouched.
        verify: check each sample's crc32 on read (a mismatch is a ``CorruptDataError``).
        threads: threads that decode one batch (``make_loader`` passes its own).
        resize: a read-time resize: N sets the shorter side to N (aspect kept), ``"WxH"`` an exact size.
        center_crop: a read-time centre crop after the resize: N or ``"WxH"``.
        interpolation: the resize's filter (``bilinear``, ``bicubic``, ``nearest``...).
        decoder: ``"auto"``, ``"fast"`` or ``"pil"`` (see :class:`PackedDataset`).
        random_resized_crop: an int or ``(height, width)``: torchvision's ``RandomResizedCrop`` fused into
            decoding; replaces ``resize``/``center_crop``. It, ``resize`` and ``center_crop`` may each be a
            function of the epoch giving the size (a resolution schedule): see :class:`PackedDataset`.
        scale: the crop's area as a fraction of the image's, ``(min, max)``: finite, ``0 < min <= max``.
        ratio: the crop's width / height, ``(min, max)``: finite, from 1e-6 to 1e6.
        flip: mirror left-right with probability 0.5.
        seed: the augmentation seed (an int from 0 to 2**63-1); not the sample order's, which is the loader's.
        fields: the fields to give, by name, as a tuple in that order (``("image", "caption")``); default
            ``(image, label)`` for an image-and-class dataset, else a dict of every field (``ds.fields``).
        readahead: LMDB only: each read has the kernel read its records ahead, exactly (default on).
        locking: HDF5 only: HDF5's file locking (default off).
        storage_options: for a URL, the fsspec filesystem's options (credentials, endpoint).
        cache_dir: for a URL, the cache folder (default ``PACKER_CACHE_DIR``, else ``~/.cache/packer``).
        cache_limit: for a URL, the most bytes the cache keeps (an int or ``"10GB"``); a dataset larger than it
            is read a block at a time, in blocks that fit (said once; see :func:`packer.formats.blocked.block_budget`).
        page_budget: a local folder over it (``"2GB"``) is read a block at a time (:mod:`packer.formats.local_blocks`).

    Returns:
        An ``LmdbDataset``, ``Hdf5Dataset`` or ``WdsDataset``, or a ``PartedDataset`` over them for a conversion
        made by several ranks.

    Raises:
        ValueError: (one line) an argument of the wrong type or range, naming it.
    """
    for name, value in (("transform", transform), ("target_transform", target_transform)):
        if value is not None and not callable(value):
            raise UsageError(f"{name} must be a callable or None, not {value!r}")
    for name, flag in (("decode", decode), ("verify", verify)):
        arguments.flag(name, flag)
    arguments.int_at_least("threads", threads, 1)
    options: dict[str, Any] = {n: arguments.flag(n, v) for n, v in (("readahead", readahead), ("locking", locking))
               if v is not None}
    from ..remote.entry import (
        open_remote,  # a URL is resolved here into a local folder, or blocks when over cache_limit
    )

    found = (open_remote(root, storage_options, cache_dir, cache_limit) if page_budget is None
             else open_paged(root, page_budget, cache_dir))
    reader = open_reader(found) if isinstance(found, (str, os.PathLike)) else open_blocked(  # or read a block at a time
        found, reader_class(found.manifest, found.url))
    for name in options:
        if reader.format != _READER_OPTIONS[name]:
            raise UsageError(f"{name} is an option of {_READER_OPTIONS[name]} datasets; {root} is {reader.format}")
    if options and isinstance(found, (str, os.PathLike)):  # options of the local files' readers
        reader = open_reader(reader.root, **options)
    return _DATASETS.get(type(reader), PackedDataset)(
        reader, transform=transform, target_transform=target_transform, decode=decode, verify=verify,
        threads=threads, resize=resize, center_crop=center_crop, interpolation=interpolation, decoder=decoder,
        random_resized_crop=random_resized_crop, scale=scale, ratio=ratio, flip=flip, seed=seed, fields=fields)

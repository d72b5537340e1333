"""``packer.stream``'s decoding: the samples a tar stream gives, decoded through the same
:class:`~packer.reading.decoding.Decoding` (and :class:`~packer.reading.fields.FieldDecoder` for fields) as
:func:`packer.open_dataset`, so the read-time ``resize``/``center_crop``/``random_resized_crop``/``flip``/``decoder``
options mean the same and give the same pixels. No second resampler lives here: only the adapter that lets
``Decoding`` read a sample met in a stream rather than at an index.

A sample's augmentation window is drawn from ``(seed, epoch, index)`` as the map-style path draws it. Its index
is its tar member key: packer writes sample ``i`` as ``000000042.*`` for ``i = 42``, so a stream's window for that
sample equals ``open_dataset(...).augment_params(42, epoch)``. A key that is not all digits (shards written by
other tools) gets a stable index of its own, :func:`key_index`: the crc32 of its UTF-8 bytes.
"""

from __future__ import annotations

import copy
import io
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import CorruptDataError, PackerError, UsageError
from ..fields import is_pair_schema, label_field
from ..formats.base import Reader, Sample, StreamSample
from ..reading.batches import collate_column, field_tensor
from ..reading.decoding import Decoding
from ..reading.fields import FieldDecoder, select_fields
from ..reading.mix import SOURCE, joined_classes, relabeled
from ..reading.scratch import decode_buffer


def key_index(key: str) -> int:
    """The sample index a tar member key stands for, which seeds its augmentation: the key's number for keys of
    ASCII digits (packer's, ``000000042`` -> 42), else the crc32 of its UTF-8 bytes (stable across runs,
    machines and Python versions, unlike ``hash``)."""
    if key.isascii() and key.isdigit():
        return int(key)
    return zlib.crc32(key.encode("utf-8"))


class StreamSamples(Reader):
    """The part of a :class:`~packer.formats.base.Reader` that :class:`~packer.reading.decoding.Decoding` uses, for
    samples that come from a tar stream rather than from an index: the dataset's transform spec (for encoded
    images, its mode replaced by the stream's), whether images are stored raw, and where a sample is, for messages.
    Nothing is read through it: the stream hands each decode its :class:`~packer.formats.base.Sample`."""

    def __init__(self, root: Any, manifest: dict, mode: str):
        super().__init__(root, manifest)
        self.root_name = str(root)
        if mode != self.spec.mode and not self.is_raw:  # encoded images decode to the stream's mode; raw
            # arrays are given as stored, in their own channels
            self.spec = copy.copy(self.spec)
            object.__setattr__(self.spec, "mode", mode)
        shape = self.manifest.get("shape")
        if shape and not self.is_raw and len(shape) == 3:  # encoded images decode to the stream's channels
            self.manifest = dict(self.manifest, shape=[shape[0], shape[1], self.spec.channels])
        self.names: dict[int, str] = {}  # the index of each sample being decoded -> "ROOT sample KEY"

    def __len__(self) -> int:
        return int(self.manifest.get("count", 0))

    def _open(self) -> None:
        pass

    def read(self, index: int) -> Sample:
        raise PackerError("packer.stream reads samples in shard order, not by index; use packer.open_dataset")

    def relpath(self, index: int) -> str:
        return self.describe(index)

    def sample_file(self, index: int) -> str:
        return self.describe(index)

    def describe(self, index: int) -> str:
        return self.names.get(index, f"{self.root_name} sample {index}")

    def stored_array(self, index: int, sample: Sample) -> np.ndarray | None:
        """The pixels of a ``.npy`` member: its payload holds the decoded array (see :func:`stream_sample`)."""
        return self._as_array(index, sample, str(np.dtype(self.spec.dtype))) if self.is_raw else None


def npy_array(data: bytes, where: str) -> np.ndarray:
    """A ``.npy`` member's array, (H, W, C); never unpickles."""
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise CorruptDataError(f"{where}: not a plain .npy array ({exc}); re-pack") from None
    return arr[..., None] if arr.ndim == 2 else arr


class StreamDecoder:
    """Decodes the batches of a stream: the image (or the selected fields) of each sample through one
    :class:`~packer.reading.decoding.Decoding`, written straight into the batch array when every image has one size.

    Args:
        root: what messages name the dataset by (its folder or URL).
        manifest: its manifest.
        mode: the PIL mode images decode to.
        fields: the fields a batch gives, by name (None: ``(images, labels)`` for an image-and-class dataset, else
            a dict of every field), as :func:`packer.open_dataset` takes them.
        options: :class:`~packer.reading.decoding.Decoding`'s read-time options (``resize``,
            ``random_resized_crop``...), checked here as :func:`packer.open_dataset` checks them.
    """

    def __init__(self, root: Any, manifest: dict, mode: str, fields: Sequence[str] | str | None = None,
                 **options: Any):
        self.root = root
        self.samples = StreamSamples(root, manifest, mode)
        self.decoding = Decoding(self.samples, **options)
        schema = self.samples.schema
        self.fields = FieldDecoder(schema, select_fields(schema, fields))
        self.pair, self.as_dict = fields is None and is_pair_schema(schema), fields is None
        self.dtype = np.dtype(self.samples.spec.dtype)

    def epoch_view(self, epoch: int) -> tuple | None:
        """The sizes a resolution schedule gives ``epoch`` (None without one), computed by the stream's process."""
        return self.decoding.epoch_view(epoch)

    def batch(self, batch: list[StreamSample], epoch: int, view: tuple | None = None) -> Any:
        """One batch of samples read from the shards, with the augmentation of ``epoch`` and the sizes ``view``
        (its resolution schedule's, computed by the stream's process)."""
        path = self.root
        samples = [self._sample(path, key, data, ext, label) for key, data, ext, label, _ in batch]
        indices = [key_index(key) for key, *_ in batch]
        self.samples.names = {i: f"{path} sample {key}" for i, (key, *_) in zip(indices, batch, strict=True)}
        d = self.decoding.for_epoch(epoch, view)
        try:
            if self.pair:
                return self._pairs(d, indices, samples, epoch)
            return self._fields(d, indices, samples, [s.fields for s in batch], epoch)
        finally:
            self.samples.names = {}

    def _sample(self, path: Any, key: str, data: bytes, ext: str, label: int) -> Sample:
        if ext != "npy":
            return Sample(data, label, (0, 0, 0), None)  # the size comes from the image's header
        arr = npy_array(data, f"{path} sample {key}")
        if not self.samples.is_raw:  # a .npy member of a dataset that says it stores encoded images
            raise CorruptDataError(f"{path} sample {key}: a .npy member in a {self.samples.spec.store} dataset; "
                                   "run `packer verify`")
        return Sample(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data, label, arr.shape, None)

    def _pairs(self, d: Decoding, indices: list[int], samples: list[Sample], epoch: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.tensor([s.label for s in samples], dtype=torch.int64)
        shape = d.output_shape()
        if shape is None:  # images of their own sizes: one size or the one-line error
            arrays = [d.decode_array(i, s, epoch=epoch) for i, s in zip(indices, samples, strict=True)]
            shapes = sorted({a.shape for a in arrays})
            if len(shapes) > 1:
                raise PackerError(f"images in one batch differ in size ({', '.join(map(str, shapes[:3]))}); "
                                  "pass resize= and center_crop= (or random_resized_crop=) to packer.stream, or "
                                  "pack with --resize and --center-crop")
            return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2), labels
        out = self._rows((len(samples), *shape), self.dtype)
        decode_row = d.row_decoder()
        for j, (index, sample) in enumerate(zip(indices, samples, strict=True)):
            decode_row(index, sample, out[j], epoch)
        return torch.from_numpy(out).permute(0, 3, 1, 2), labels

    @staticmethod
    def _rows(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised batch array, where decoding writes fastest."""
        return decode_buffer(int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)

    def _fields(self, d: Decoding, indices: list[int], samples: list[Sample],
                raws: list[dict[str, bytes | memoryview]], epoch: int) -> Any:
        """A batch of a dataset with fields (or ``fields=``), as :func:`packer.make_loader` gives it: images and
        masks decoded into their batch arrays when the images have one size, numbers stacked, the rest lists."""
        fields = self.fields
        shape = d.output_shape()
        n = len(samples)
        outs: dict[str, np.ndarray] = {}
        if shape is not None:
            if fields.image:
                outs["image"] = self._rows((n, *shape), self.dtype)
            for field in fields.dense:
                outs[field.name] = self._rows((n, *fields.row_shape(field, shape)), fields.row_dtype(field))
        decode_row = d.row_decoder() if fields.image and shape is not None else None
        columns: dict[str, list] = {f.name: [] for f in fields.selected if f.name not in outs}
        for j, (index, sample) in enumerate(zip(indices, samples, strict=True)):
            row = fields.sample_values(d, index, sample, raws[j], epoch, {k: v[j] for k, v in outs.items()},
                                       decode_row)
            for name, column in columns.items():
                column.append(row[name])
        by_name = {f.name: f for f in fields.selected}
        batch: dict[str, Any] = {}
        for field in fields.selected:
            name = field.name
            if name in outs:
                tensor = torch.from_numpy(outs[name])
                batch[name] = tensor.permute(0, 3, 1, 2) if tensor.dim() == 4 else tensor
            elif name == fields.label_name:
                batch[name] = torch.as_tensor(columns[name], dtype=torch.int64)
            else:
                batch[name] = collate_column([field_tensor(by_name[name], v) for v in columns[name]], by_name[name])
        return batch if self.as_dict else tuple(batch.values())


class MixedStreamDecoder:
    """Decodes the batches of a stream over several datasets (``packer.stream([...], weights=)``): each dataset's
    samples by its own :class:`StreamDecoder`, put back in the batch's order, with labels as indices into
    :attr:`classes` and each sample's dataset (``source``), as :func:`packer.mix`'s batches are.

    Args:
        decoders: one per dataset, each giving the same fields and image size.
        names: what each dataset is called (in messages).
        fields: the ``fields=`` names asked for (``"source"`` among them, or not); None: every field, and the source.

    Raises:
        ValueError: (one line) datasets that give other fields, image sizes or types.
    """

    def __init__(self, decoders: list[StreamDecoder], names: list[str], fields: list[str] | None):
        first = decoders[0]
        self.decoders = decoders
        self.fields, self.pair, self.as_dict = first.fields, first.pair, first.as_dict
        selected = first.fields.selected
        for decoder, name in zip(decoders[1:], names[1:], strict=True):
            if (decoder.pair, decoder.as_dict, decoder.fields.selected) != (first.pair, first.as_dict, selected):
                raise UsageError(f"{name} gives fields {_names(decoder.fields.selected)}, {names[0]} gives "
                                 f"{_names(selected)}; a mixture reads one kind of sample: pass fields= the names "
                                 "they share")
            for what, mine, theirs in (("images of", decoder.decoding.output_shape(), first.decoding.output_shape()),
                                       ("images of type", decoder.dtype, first.dtype)):
                if mine != theirs:
                    raise UsageError(f"{name} gives {what} {mine}, {names[0]} {theirs}; give one read-time size "
                                     "(random_resized_crop=, or resize= and center_crop=)")
        if any(f.name == SOURCE for f in selected):
            raise UsageError(f"{names[0]} has a field named {SOURCE!r}, which a mixture gives itself (the dataset of "
                             "each sample): pass fields= without it")
        label = label_field(selected)
        self.label_name = label.name if label is not None else None
        self.classes, self.relabels = (joined_classes([d.samples.classes for d in decoders]) if label is not None
                                       else ([], [None] * len(decoders)))
        self.output = fields if fields is not None else [f.name for f in selected] + [SOURCE]

    def epoch_view(self, epoch: int) -> tuple | None:
        """Each dataset's sizes under its resolution schedule in ``epoch`` (None when none has one)."""
        views = tuple(d.epoch_view(epoch) for d in self.decoders)
        if all(v is None for v in views):
            return None
        shapes = [d.decoding.for_epoch(epoch, v).output_shape() for d, v in zip(self.decoders, views, strict=True)]
        if any(shape != shapes[0] for shape in shapes):
            raise UsageError(f"the datasets of a mixture read images of one size every epoch; epoch {epoch} gives "
                             f"{', '.join(map(str, shapes))}")
        return views

    def batch(self, batch: list[StreamSample], epoch: int, view: tuple | None, sources: np.ndarray) -> Any:
        """One batch: ``batch[j]`` is a sample of dataset ``sources[j]``."""
        n = len(batch)
        merged: dict[str, Any] = {}
        for k in np.unique(sources).tolist():
            rows = np.flatnonzero(sources == k)
            part = self.decoders[k].batch([batch[r] for r in rows.tolist()], epoch, None if view is None else view[k])
            for name, value in self._named(part, k).items():
                _place(merged, name, value, rows, n)
        merged[SOURCE] = torch.from_numpy(np.asarray(sources, np.int64))
        if self.pair:
            return merged["image"], merged[self.label_name or "label"], merged[SOURCE]
        values = {name: merged[name] for name in self.output}
        return values if self.as_dict else tuple(values.values())

    def _named(self, part: Any, k: int) -> dict[str, Any]:
        """A dataset's batch by field name, its labels as indices into :attr:`classes`."""
        names = [f.name for f in self.fields.selected]
        named = dict(part) if isinstance(part, dict) else dict(zip(names, part, strict=True))
        table = self.relabels[k]
        if table is not None and self.label_name in named:
            named[self.label_name] = torch.from_numpy(relabeled(table, named[self.label_name].numpy()))
        return named


def _names(fields: list) -> str:
    return ", ".join(f"{f.name} ({f.kind})" for f in fields)


def _place(merged: dict[str, Any], name: str, value: Any, rows: np.ndarray, n: int) -> None:
    """Put one dataset's column of a batch (a tensor, or a list) at its ``rows`` of the whole batch's."""
    if isinstance(value, torch.Tensor):
        if name not in merged:
            if value.dim() == 4:  # NCHW images over NHWC memory: the whole batch laid out the same way
                shape = value.shape
                merged[name] = torch.empty((n, shape[2], shape[3], shape[1]), dtype=value.dtype).permute(0, 3, 1, 2)
            else:
                merged[name] = torch.empty((n, *value.shape[1:]), dtype=value.dtype)
        merged[name].index_copy_(0, torch.from_numpy(rows), value)
        return
    column = merged.setdefault(name, [None] * n)
    for row, item in zip(rows.tolist(), value, strict=True):
        column[row] = item

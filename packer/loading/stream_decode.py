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

from ..errors import CorruptDataError, PackerError
from ..fields import is_pair_schema
from ..formats.base import Reader, Sample, StreamSample
from ..reading.batches import collate_column, field_tensor
from ..reading.decoding import Decoding, decode_buffer
from ..reading.fields import FieldDecoder, select_fields


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

    def batch(self, batch: list[StreamSample], epoch: int) -> Any:
        """One batch of samples read from the shards, with the augmentation of ``epoch``."""
        path = self.root
        samples = [self._sample(path, key, data, ext, label) for key, data, ext, label, _ in batch]
        indices = [key_index(key) for key, *_ in batch]
        self.samples.names = {i: f"{path} sample {key}" for i, (key, *_) in zip(indices, batch, strict=True)}
        try:
            if self.pair:
                return self._pairs(indices, samples, epoch)
            return self._fields(indices, samples, [s.fields for s in batch], epoch)
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

    def _pairs(self, indices: list[int], samples: list[Sample], epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.decoding
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

    def _fields(self, indices: list[int], samples: list[Sample], raws: list[dict[str, bytes | memoryview]],
                epoch: int) -> Any:
        """A batch of a dataset with fields (or ``fields=``), as :func:`packer.make_loader` gives it: images and
        masks decoded into their batch arrays when the images have one size, numbers stacked, the rest lists."""
        d, fields = self.decoding, self.fields
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

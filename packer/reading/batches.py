"""The batches and items of datasets with fields (issue 24) as torch sees them: each decoded value as a tensor
(:func:`field_tensor`), a batch's values collated field by field (:func:`collate_column`), and
:class:`FieldBatch`, what a dataset's ``__getitems__`` gives and :func:`packer.loading.loader.collate` unwraps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import PackerError
from ..fields import Field
from .fields import mask_dtype


class BatchDataset(Dataset):
    """What packer's loaders read whole batches from: a :class:`~packer.reading.dataset.PackedDataset`, or a
    mixture of them (:func:`packer.mix`). ``make_loader`` gives such a dataset its decode threads and pinning
    (:meth:`read_batch`), and where its images have one shape, packer's worker pool, which decodes a batch in a
    worker into a shared-memory slot (:meth:`batch_layout`, :meth:`decode_slot`) and makes the batch from it in
    the main process (:meth:`slot_batch`)."""

    transform: Any = None  # a per-item transform (then the pool is not used)
    target_transform: Any = None
    decode: bool = True

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def where(self) -> str:
        """What messages name the dataset by."""
        raise NotImplementedError

    def epoch_view(self, epoch: int) -> tuple | None:
        """The sizes a resolution schedule gives ``epoch`` (None without one), sent with each of its indices."""
        raise NotImplementedError

    def read_batch(self, indices: list[int], threads: int | None = None, pin_memory: bool = False) -> list:
        """A whole batch, decoded on ``threads`` threads, in pinned memory when asked."""
        raise NotImplementedError

    def batch_layout(self, epoch: int | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
        """The batch tensors a row fills in ``epoch``, ``(name, row shape, dtype)``; None when images vary in size."""
        raise NotImplementedError

    def decode_slot(self, indices: list[int], arrays: list[np.ndarray]) -> Any:
        """Decode a batch into a slot's arrays (in a worker process); returns what :meth:`slot_batch` takes."""
        raise NotImplementedError

    def slot_batch(self, tensors: list[torch.Tensor], result: Any) -> Any:
        """The batch from a slot's tensors and :meth:`decode_slot`'s result (in the main process)."""
        raise NotImplementedError


class FieldBatch(list):
    """What ``__getitems__`` returns for a dataset with fields (or ``fields=``): a list of per-sample dicts or
    tuples, as ``default_collate`` expects, whose dense values are views into the batch tensors.
    :func:`packer.loading.loader.collate` returns :attr:`collated`, the whole batch, without copying."""

    collated: dict[str, Any] | tuple | None = None
    fields: list[Field] | None = None  # the fields of each item, in order (for collate)

    def collate(self) -> dict[str, Any] | tuple:
        """The whole batch: :attr:`collated` when the batch was decoded into batch tensors, else the samples'
        values collated field by field (:func:`collate_column`)."""
        if self.collated is not None:
            return self.collated
        fields = self.fields or []
        if self and isinstance(self[0], dict):
            by_name = {f.name: f for f in fields}
            return {key: collate_column([item[key] for item in self], by_name.get(key)) for key in self[0]}
        columns = zip(*self, strict=True)
        return tuple(collate_column(list(column), field) for column, field in zip(columns, fields, strict=True))


def collate_column(values: list, field: Field | None = None) -> Any:
    """One field of a batch of samples: tensors of one shape, ints and floats stacked; anything else (text,
    JSON, bytes, ``field``'s variable-length vectors) as a list. Images of different sizes raise the one-line
    error."""
    first = values[0] if values else None
    if field is not None and field.kind in ("int64", "float32") and field.shape is None:
        return values
    if isinstance(first, torch.Tensor):
        sizes = sorted({tuple(v.shape) for v in values})
        if len(sizes) == 1:
            return torch.stack(values)
        if first.dim() == 3:
            raise PackerError(f"images in one batch differ in size ({', '.join(map(str, sizes[:3]))}); pass "
                              "resize= and center_crop= (or random_resized_crop=) to open_dataset so that every "
                              "image has one size")
        return values
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return torch.as_tensor(values)
    return values


def field_tensor(field: Field, value: Any) -> Any:
    """A decoded field value as ``ds[i]`` gives it: images CHW tensors, masks (H, W) tensors (uint8, or int64
    for 16-bit masks), int64/float32 numbers tensors (0-d for scalars), a class an int; text, JSON and bytes as
    they are."""
    if field.kind in ("image", "mask"):
        arr = value if value.flags.writeable else np.array(value)
        if field.kind == "mask":
            return torch.from_numpy(arr.astype(mask_dtype(field), copy=False))
        return torch.from_numpy(arr).permute(2, 0, 1)
    if field.kind in ("int64", "float32"):
        return torch.as_tensor(np.asarray(value, "<i8" if field.kind == "int64" else "<f4"))
    return value


def collate_fields(selected: list[Field], label_name: str | None, tensors: dict[str, torch.Tensor],
                   labels: Any, values: dict[str, list]) -> dict[str, Any]:
    """The batch of a dataset with fields, by name in ``selected`` order: dense fields as their batch tensors
    (images NCHW), the label (``label_name``) and fixed-shape numbers stacked, text, JSON, bytes and
    variable-length vectors as lists."""
    batch: dict[str, Any] = {}
    for field in selected:
        name = field.name
        if name in tensors:
            t = tensors[name]
            batch[name] = t.permute(0, 3, 1, 2) if t.dim() == 4 else t
        elif name == label_name:
            batch[name] = torch.as_tensor(labels, dtype=torch.int64)
        elif field.kind in ("int64", "float32") and field.shape is not None:
            dtype = "<i8" if field.kind == "int64" else "<f4"
            batch[name] = torch.from_numpy(np.stack([np.asarray(v, dtype) for v in values[name]])
                                           if values[name] else np.zeros((0, *field.shape), dtype))
        elif field.kind in ("int64", "float32"):
            batch[name] = [field_tensor(field, v) for v in values[name]]
        else:
            batch[name] = values[name]
    return batch


TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int64): torch.int64}

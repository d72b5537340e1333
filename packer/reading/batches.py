"""The batches and items of datasets with fields (issue 24) as torch sees them: each decoded value as a tensor
(:func:`field_tensor`), a batch's values collated field by field (:func:`collate_column`), and
:class:`FieldBatch`, what a dataset's ``__getitems__`` gives and :func:`packer.loading.loader.collate` unwraps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import PackerError
from ..fields import Field
from .fields import mask_dtype


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


TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int64): torch.int64}

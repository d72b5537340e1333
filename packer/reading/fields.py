"""The read side of a sample's fields (issue 24): which fields a dataset gives (``fields=``), how each stored
value becomes what ``ds[i]`` and the batches give, and the geometry that dense targets share with their image.

The primary image goes through :class:`~packer.reading.decoding.Decoding` as it always has. Every other image field of
the sample gets the same read-time geometry: the same random resized crop window (the primary image's
``augment_params(i, epoch)``, scaled to the field's size when it differs), the same flip, the same read-time
resize and centre crop. A second image is resampled as the primary one is; a mask with nearest neighbour
(:func:`packer.reading.augment.nearest_box`), so it holds only values that are stored in it. No torch here:
:mod:`packer.reading.dataset` makes the tensors and batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from ..errors import CorruptDataError
from ..fields import Field, decode, extra_fields, label_field
from ..formats.base import Sample
from ..images.masks import decode_mask
from ..images.transforms import apply_geometry, as_hwc, center_box, to_pil
from ..images.transforms import decode as decode_image
from .augment import Window, nearest_box, pil_window, write_image
from .decoding import Decoding, write_into

DENSE = ("image", "mask")  # field kinds decoded into a batch array of the image's height and width


class Geometry(NamedTuple):
    """What every image field of one sample shares: the primary image's stored (height, width) and its
    augmentation window (None without random resized crop or flip)."""

    full: tuple[int, int]
    window: Window | None


def select_fields(schema: Sequence[Field], fields: Sequence[str] | str | None) -> list[Field]:
    """The fields a dataset gives, in order: every field of ``schema`` for None, else those named.

    Raises:
        ValueError: (one line) a name that is not a field, or a name given twice; it lists the fields.
    """
    if fields is None:
        return list(schema)
    names = [fields] if isinstance(fields, str) else list(fields)
    by_name = {f.name: f for f in schema}
    for name in names:
        if name not in by_name:
            raise ValueError(f"no field {name!r} in this dataset; its fields are {', '.join(by_name)}")
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"fields= names each field once (and at least one); this dataset's are "
                         f"{', '.join(by_name)}")
    return [by_name[name] for name in names]


def decode_value(field: Field, data: bytes | memoryview, where: str) -> Any:
    """:func:`packer.fields.decode` of a stored value of sample ``where`` (``"ROOT sample 7"``); bytes that do not
    decode as their field (damaged UTF-8, JSON, numbers) are one :class:`CorruptDataError` naming the dataset,
    sample and field, never a raw decode error."""
    try:
        return decode(field, data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = " ".join(str(exc).split())[:200]
        raise CorruptDataError(f"{where} field {field.name!r}: the stored {field.kind} value is damaged ({reason}); "
                               "run `packer verify` and re-pack") from None


def mask_dtype(field: Field) -> np.dtype:
    """The batch dtype of a mask field: uint8 for uint8 masks, int64 for uint16 ones (torch's uint16 has few
    operations)."""
    return np.dtype(np.uint8) if (field.pixels or "uint8") == "uint8" else np.dtype(np.int64)


def scaled_window(window: Window, full: tuple[int, int], size: tuple[int, int]) -> Window:
    """``window`` (in a ``full`` (height, width) image's pixels) in the pixels of an image of ``size``."""
    if size == full:
        return window
    sy, sx = size[0] / full[0], size[1] / full[1]
    top, left = round(window.top * sy), round(window.left * sx)
    height = max(1, min(size[0] - top, round(window.height * sy)))
    width = max(1, min(size[1] - left, round(window.width * sx)))
    return Window(top, left, height, width, window.flipped)


class FieldDecoder:
    """Decodes the selected fields of a dataset's samples (see the module docstring).

    It holds no reference to the dataset (each method is given its :class:`~packer.reading.decoding.Decoding`): a
    dataset and its decoder in a cycle would keep the data files open until the garbage collector ran.

    Args:
        schema: the dataset's fields.
        selected: the fields it gives, in order (:func:`select_fields`).
    """

    def __init__(self, schema: Sequence[Field], selected: Sequence[Field]):
        self.schema = list(schema)
        self.selected = list(selected)
        label = label_field(self.schema)
        self.label_name = label.name if label is not None else None
        names = {f.name for f in self.selected}
        self.extras = [f for f in extra_fields(self.schema) if f.name in names]  # read with read_fields
        self.dense = [f for f in self.extras if f.kind in DENSE]
        self.image = "image" in names

    @property
    def needs_fields(self) -> bool:
        """Whether any selected field is read beyond the image and the label."""
        return bool(self.extras)

    def sample_values(self, d: Decoding, index: int, sample: Sample, raw: dict[str, bytes | memoryview], epoch: int,
                      outs: dict[str, np.ndarray] | None = None, decode_row: Any = None) -> dict[str, Any]:
        """The selected fields of one sample, by name in the selected order: the image (through ``decode_row``,
        default :meth:`Decoding.decode_array`), the label, and each field in ``raw`` decoded; dense ones
        written into their row in ``outs`` when it has one."""
        outs = outs or {}
        geometry = self.geometry(d, index, sample, epoch) if self.dense else None
        values: dict[str, Any] = {}
        for field in self.selected:
            name = field.name
            if name == "image":
                values[name] = (decode_row or d.decode_array)(index, sample, outs.get(name), epoch)
            elif name == self.label_name:
                values[name] = sample.label
            else:
                data = raw.get(name)
                if data is None:
                    raise CorruptDataError(f"{d.reader.describe(index)}: no stored value for field "
                                           f"{name!r}; run `packer verify` and re-pack")
                values[name] = self.value(d, index, field, data, geometry, outs.get(name))
        return values

    def geometry(self, d: Decoding, index: int, sample: Sample, epoch: int) -> Geometry:
        """The primary image's stored size and augmentation window for sample ``index`` in ``epoch``."""
        full = d._full_size(index, sample)
        window = d._window(index, sample, epoch) if d.augments else None
        return Geometry(full, window)

    @staticmethod
    def row_shape(field: Field, image_shape: tuple[int, int, int]) -> tuple[int, ...]:
        """The batch row of a dense field when the primary image's rows are ``image_shape`` (H, W, C)."""
        return image_shape[:2] if field.kind == "mask" else tuple(image_shape)

    @staticmethod
    def row_dtype(field: Field) -> np.dtype:
        """The numpy dtype of a dense field's batch rows."""
        return mask_dtype(field) if field.kind == "mask" else np.dtype(np.uint8)

    def value(self, d: Decoding, index: int, field: Field, data: bytes | memoryview, geometry: Geometry | None,
              out: np.ndarray | None = None) -> Any:
        """One stored field value decoded: a dense field through the sample's ``geometry`` (into ``out`` when
        given), anything else with :func:`packer.fields.decode`."""
        if not field.dense:
            return decode_value(field, data, d.reader.describe(index))
        assert geometry is not None  # given whenever the sample has a dense field
        if field.kind == "mask":
            return self.mask(d, index, field, data, geometry, out)
        return self.second_image(d, index, field, data, geometry, out)

    @staticmethod
    def _describe(d: Decoding, index: int, field: Field) -> str:
        return f"{d.reader.describe(index)} field {field.name!r}"

    def mask(self, d: Decoding, index: int, field: Field, data: bytes | memoryview, geometry: Geometry,
             out: np.ndarray | None = None) -> np.ndarray:
        """A mask field with the sample's geometry, resampled by nearest neighbour: exact stored values."""
        name = self._describe(d, index, field)
        mask = decode_mask(data, name, field.pixels or "uint8", d.max_pixels)
        full, window = geometry
        if mask.shape != full:
            raise CorruptDataError(f"{name}: the mask is {mask.shape[1]}x{mask.shape[0]}, its image {full[1]}x"
                                   f"{full[0]}; a mask has its image's size, re-pack")
        flipped = window is not None and window.flipped
        if d.random_resized_crop is not None:
            assert window is not None  # a random resized crop augments: every sample has a window
            box: tuple[float, float, float, float] = (window.left, window.top, window.left + window.width,
                                                      window.top + window.height)
            result = nearest_box(mask, box, d.random_resized_crop, flipped)
        elif d.resize or d.center_crop:
            region = center_box(full, d.resize, d.center_crop)
            if region is None:  # the crop pads: Pillow's nearest resize, then the zero-padded crop
                resized = np.asarray(apply_geometry(Image.fromarray(mask), d.resize, None, d.center_crop, "nearest"))
                result = resized[:, ::-1] if flipped else resized
            else:
                box, size, _ = region
                result = nearest_box(mask, box, size, flipped)
        else:
            result = mask[:, ::-1] if flipped else mask
        return write_into(out, result, lambda got, want: f"{name}: the mask comes out {got}, its image {want}; "
                                                         "re-pack with the mask at its image's size")

    def second_image(self, d: Decoding, index: int, field: Field, data: bytes | memoryview, geometry: Geometry,
                     out: np.ndarray | None = None) -> np.ndarray:
        """An image field other than the primary one, decoded as it is (the same pixels for the same bytes)
        with the primary image's window and flip."""
        sample = Sample(data, -1, (0, 0, 0), None)
        if d.reader.is_raw:  # the primary image is an array; a second one is an encoded file all the same
            arr = decode_image(data, d.spec.mode, self._describe(d, index, field), d.max_pixels)
            return self._resampled(d, arr, geometry, out)
        if geometry.window is None:
            return d._plain_array(index, sample, out)
        full = d._full_size(index, sample)
        window = scaled_window(geometry.window, geometry.full, full)
        if d.random_resized_crop is not None:
            return d._resized_crop(index, sample, window, out)
        return write_image(d._plain_array(index, sample), window.flipped, out)

    @staticmethod
    def _resampled(d: Decoding, arr: np.ndarray, geometry: Geometry, out: np.ndarray | None) -> np.ndarray:
        """A decoded second image of a raw store through the geometry, with Pillow."""
        window = geometry.window
        flipped = window is not None and window.flipped
        if d.random_resized_crop is not None:
            assert window is not None  # a random resized crop augments: every sample has a window
            window = scaled_window(window, geometry.full, arr.shape[:2])
            return write_image(pil_window(arr, window, d.random_resized_crop, d.interpolation), flipped, out)
        if d.resize or d.center_crop:
            arr = as_hwc(apply_geometry(to_pil(arr), d.resize, None, d.center_crop, d.interpolation))
        return write_image(arr, flipped, out)

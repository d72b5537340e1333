"""The read-time decode path every packed dataset shares: decoding, the read-time resize and crop, and the
training augmentation (random resized crop and flip), from a :class:`~packer.formats.base.Sample` to an
(H, W, C) array. No torch: ``packer verify --deep`` decodes through it too.

:meth:`Decoding.decode_array` is the one entry point; :class:`packer.reading.dataset.PackedDataset` builds on it (and
adds tensors, batching and threads). Every format goes through it, so every format gives the same pixels for the same
stored bytes.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import simplejpeg

from .. import arguments
from ..errors import CorruptDataError, ImageError, PackerError, UsageError
from ..formats.base import Reader, Sample
from ..images.resample import resample
from ..images.transforms import (
    apply_geometry,
    as_hwc,
    as_pair,
    center_box,
    center_region,
    decode,
    geometry_shape,
    jpeg_size,
    open_image,
    parse_size,
    resize_crop,
    resize_crop_array,
    to_pil,
)
from .augment import (
    MARGIN,
    Window,
    crop_resize,
    image_size,
    pil_window,
    resized_window,
    sample_window,
    scaled_box,
    scaled_jpeg,
    scaled_window,
    uniform_stream,
    write_image,
)
from .indices import EpochIndex
from .scratch import decode_scratch

# a read-time size, or a function of the epoch that gives one (a resolution schedule)
Sized = int | str | tuple[int, int] | Callable[[int], Any]
# an epoch's scheduled sizes, ((name, size), ...): hashable, picklable, small
View = tuple[tuple[str, Any], ...]


def write_into(out: np.ndarray | None, arr: np.ndarray, mismatch: Callable[[tuple, tuple], str]) -> np.ndarray:
    """``arr`` written into ``out`` (a batch slot) and ``out`` returned, or ``arr`` as a contiguous array where
    there is no slot; a :class:`CorruptDataError` with ``mismatch(arr's shape, out's shape)`` where they differ."""
    if out is None:
        return np.ascontiguousarray(arr)
    if arr.shape != out.shape:
        raise CorruptDataError(mismatch(arr.shape, out.shape))
    out[...] = arr
    return out


class Decoding:
    """How samples of ``reader`` are decoded: the read-time geometry and augmentation (see
    :class:`packer.reading.dataset.PackedDataset` for the arguments).

    Args:
        reader: the dataset's storage reader.
        resize, center_crop, interpolation, decoder, random_resized_crop, scale, ratio, flip, seed: as
            :class:`packer.reading.dataset.PackedDataset` takes them.
    """

    def __init__(self, reader: Reader, resize: Sized | None = None, center_crop: Sized | None = None,
                 interpolation: str = "bilinear", decoder: str = "auto",
                 random_resized_crop: Sized | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = False, seed: int = 0):
        self.reader = reader
        self.spec = reader.spec
        given = {"random_resized_crop": random_resized_crop, "resize": resize, "center_crop": center_crop}
        # the sizes given as a function of the epoch (a resolution schedule); the others are fixed
        self.schedule: dict[str, Callable[[int], Any]] = {k: v for k, v in given.items() if callable(v)}
        self._lost: tuple[str, ...] = ()  # scheduled sizes whose function did not pickle into this process
        self._views: dict[View, Decoding] = {}
        self.interpolation = interpolation
        self.decoder = decoder
        self.max_pixels = self.spec.max_pixels
        if decoder not in ("auto", "fast", "pil"):
            raise ValueError("decoder must be 'auto', 'fast' or 'pil'")
        self._set_sizes({k: v for k, v in given.items() if k not in self.schedule})
        self.scale = arguments.crop_scale(scale)
        self.ratio = arguments.crop_ratio(ratio)
        self.flip = arguments.flag("flip", flip)
        self.seed = arguments.seed("seed", seed)
        self.epoch = 0
        if self.schedule:  # the first epoch's sizes: checked now, and what the attributes say until an epoch's
            self._set_sizes(dict(self.epoch_view(0) or ()))
        if self.random_resized_crop and (self.resize or self.center_crop):
            raise ValueError("random_resized_crop replaces resize and center_crop; give one or the other")
        if (self.resize or self.center_crop or self.augments) and self.spec.normalize:
            raise ValueError("read-time resize/crop/flip needs uint8 images; this dataset stores normalized floats")

    def _set_sizes(self, sizes: dict[str, Any]) -> None:
        """Set the read-time sizes named in ``sizes`` (``random_resized_crop``, ``resize``, ``center_crop``)."""
        if "random_resized_crop" in sizes:
            self.random_resized_crop = _height_width(sizes["random_resized_crop"])
        if "resize" in sizes:
            self.resize = parse_size(sizes["resize"])
        if "center_crop" in sizes:
            self.center_crop = as_pair(parse_size(sizes["center_crop"]))

    # -- resolution schedules ----------------------------------------------------------------------------------------
    def epoch_view(self, epoch: int) -> View | None:
        """The sizes a resolution schedule gives ``epoch``, as ``((name, size), ...)`` (None without a schedule):
        computed in the process that holds the schedule's functions (the loader's), and sent with each index of
        the epoch (:class:`~packer.loading.sampler.EpochIndex`'s ``view``) to the processes that decode.

        Raises:
            ValueError: (one line) a schedule that returns no valid size for ``epoch``, naming it.
            PackerError: the schedule's function did not pickle into this process and the index carried no view.
        """
        if not self.schedule and not self._lost:
            return None
        if self._lost:
            raise PackerError(f"the schedule of {', '.join(self._lost)} (a function of the epoch) did not pickle "
                              "into this process: read through packer.make_loader, which sends each epoch's size "
                              "with its indices, or give a picklable function (defined at module level)")
        view = []
        for name, fn in self.schedule.items():
            size = fn(epoch)
            try:
                checked = _height_width(size) if name == "random_resized_crop" else parse_size(size)
            except ValueError as exc:
                raise UsageError(f"{name}'s schedule gave {size!r} for epoch {epoch}: {exc}") from None
            if checked is None:
                raise UsageError(f"{name}'s schedule gave None for epoch {epoch}; it must give a size every epoch")
            view.append((name, checked))
        return tuple(view)

    def at(self, view: View | None) -> Decoding:
        """This decoding with the sizes of ``view`` (an :meth:`epoch_view`); itself for None."""
        if view is None:
            return self
        found = self._views.get(view)
        if found is None:
            found = copy.copy(self)
            found.schedule, found._lost, found._views = {}, (), {}
            found._set_sizes(dict(view))
            if len(self._views) >= 8:  # a schedule's few recent sizes
                self._views.pop(next(iter(self._views)))
            self._views[view] = found
        return found

    def for_epoch(self, epoch: int, view: View | None = None) -> Decoding:
        """The decoding of ``epoch``: at ``view`` when given (what an index carried), else at the schedule's."""
        if view is None and not self.schedule and not self._lost:
            return self
        return self.at(view if view is not None else self.epoch_view(epoch))

    def of(self, indices: list, epoch: int) -> Decoding:
        """The decoding of a batch of ``indices``: of the epoch an ``EpochIndex`` carries (at the sizes it
        carries), else of ``epoch``. Under a schedule a batch is of one epoch (one size): one of several is refused."""
        first = indices[0] if indices else None
        view = first.view if isinstance(first, EpochIndex) else None  # (a tensor has a view too, a method)
        decoding = self.for_epoch(getattr(first, "epoch", epoch), view)
        if decoding is not self:  # a schedule: every index of the batch must be of the first's epoch
            epochs = {getattr(i, "epoch", epoch) for i in indices}
            if len(epochs) > 1:
                raise UsageError(f"a batch of a dataset with a resolution schedule holds samples of one epoch (one "
                                 f"size); this one holds epochs {sorted(epochs)}")
        return decoding

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_views"] = {}
        kept, lost = {}, list(self._lost)
        for name, fn in self.schedule.items():
            try:
                pickle.dumps(fn)
                kept[name] = fn
            except Exception:  # a lambda or closure under spawn: the loader sends each epoch's sizes instead
                lost.append(name)
        state["schedule"], state["_lost"] = kept, tuple(lost)
        return state

    @property
    def augments(self) -> bool:
        """Whether reading applies a random resized crop or flip."""
        return bool(self.random_resized_crop or self.flip)

    @property
    def _is_raw(self) -> bool:
        return self.reader.is_raw

    def _stored_array(self, index: int, sample: Sample) -> np.ndarray:
        arr = self.reader.stored_array(index, sample)
        assert arr is not None  # asked only when the reader stores arrays (_is_raw)
        return arr

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
            a :class:`packer.reading.augment.Window` named tuple.
        """
        if epoch is None:
            epoch = getattr(index, "epoch", self.epoch)
        index = self.reader.check_index(index)
        self.reader.open()
        return self._window(index, self.reader.read(index), epoch)

    def output_shape(self) -> tuple[int, int, int] | None:
        """(H, W, C) of every decoded image when it is fixed, else None."""
        if self.random_resized_crop:
            return *self.random_resized_crop, self.spec.channels
        if self.center_crop:
            return self.center_crop[1], self.center_crop[0], self.spec.channels
        if isinstance(self.resize, tuple):
            return self.resize[1], self.resize[0], self.spec.channels
        shape = self.reader.manifest.get("shape")
        return tuple(shape) if shape and not self.resize else None

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

    # -- the decode path -------------------------------------------------------------------------------------------
    def decode_array(self, index: int, sample: Sample, out: np.ndarray | None = None, epoch: int = 0) -> np.ndarray:
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
            raise CorruptDataError(f"{self.reader.describe(index)}: image is {image.shape}, the dataset says "
                                   f"{out.shape}; re-pack or pass resize/center_crop")
        return write_image(image, window.flipped, out)

    def row_decoder(self) -> Callable[[int, Sample, np.ndarray, int], np.ndarray]:
        """:meth:`decode_array` for the rows of a batch, chosen once per batch rather than per image: the first
        of :data:`ROW_DECODERS` that serves this decoding, else :meth:`decode_array` itself. Each is the call to
        simplejpeg and a slice copied, for a case that is common and simple (JPEGs stored at the output size, or
        at the read-time resize with a centre crop to do): per-image Python holds the GIL that the other decode
        threads need, and :meth:`decode_array`'s general checks are a noticeable part of a 224 px decode
        (docs/benchmarks.md). Anything they do not decode exactly (another format or size, a damaged file)
        goes to :meth:`decode_array`, which gives the same pixels and the error that names the sample."""
        chosen = next((kind for kind in ROW_DECODERS if kind.serves(self)), None)
        return chosen(self) if chosen is not None else self.decode_array

    def _resized_crop(self, index: int, sample: Sample, window: Window, out: np.ndarray | None) -> np.ndarray:
        """The window resampled to the output size and mirrored when flipped, written into ``out`` when given:
        exactly torchvision's ``resized_crop`` then ``hflip`` on the decoded image (decoder pil), or the fast
        path (auto/fast): JPEGs decoded at a reduced DCT scale, OpenCV's resampler, within 30 dB of Pillow's."""
        name = self.reader.describe(index)
        size = self.random_resized_crop
        assert size is not None  # called only with a random_resized_crop
        full = self._full_size(index, sample)
        fast = self.decoder != "pil"
        if fast and not self._is_raw:
            # a packed sample with a crc32 was decoded whole at pack time, and the read checks its bytes: a damaged
            # tail below the window cannot go unnoticed by decoding only the window
            arr = self._scaled_jpeg(sample, name, full, lambda data: scaled_window(
                data, self.spec.mode, full, window, size, self.interpolation, out, partial=sample.crc32 is not None))
            if arr is not None:
                return arr
        if self._is_raw or fast:
            arr = self._stored_array(index, sample) if self._is_raw else decode(sample.payload, self.spec.mode, name,
                                                                                self.max_pixels)
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

    def _fast_resize_crop(self, index: int, sample: Sample, out: np.ndarray | None) -> np.ndarray | None:
        """``decoder="fast"``'s read-time resize and centre crop of an encoded image: a JPEG decodes at the
        smallest DCT scale that keeps it ``MARGIN`` times the resized size (others decode whole), then OpenCV's
        resampler turns only the region the crop keeps into the output, in ``out``. Within 30 dB of the default's
        pixels. None where the default path must do it: a crop that pads, an interpolation other than bilinear."""
        full = self._full_size(index, sample)
        region = center_box(full, self.resize, self.center_crop)
        if region is None or self.interpolation != "bilinear":
            return None
        box, size, (resized_h, resized_w) = region
        name = self.reader.describe(index)
        if out is not None and out.shape[:2] != size:
            raise CorruptDataError(f"{name}: image gives {size}, the dataset says {out.shape[:2]}; re-pack or pass "
                                   "resize/center_crop")
        arr = self._scaled_jpeg(sample, name, full, lambda data: scaled_jpeg(
            data, self.spec.mode, full, resized_h * MARGIN, resized_w * MARGIN))
        if arr is None:
            arr = decode(sample.payload, self.spec.mode, name, self.max_pixels)
            if arr.shape[:2] != full:
                raise CorruptDataError(f"{name}: image is {arr.shape[1]}x{arr.shape[0]}, the dataset says "
                                       f"{full[1]}x{full[0]}; re-pack")
        return resample(arr, scaled_box(arr, full, box), size, out)

    def _plain_array(self, index: int, sample: Sample, out: np.ndarray | None = None) -> np.ndarray:
        """The sample with the read-time resize/crop applied (no augmentation); see :meth:`decode_array`."""
        name = self.reader.describe(index)
        geometry = self.resize or self.center_crop
        if self._is_raw:
            arr = self._stored_array(index, sample)
            if geometry and self.decoder == "pil":
                arr = as_hwc(resize_crop(to_pil(arr), self.resize, self.center_crop, self.interpolation))
            elif geometry:
                return self._geometry(name, arr, out)
        elif self.decoder == "pil":
            img = open_image(bytes(sample.payload), name, self.max_pixels).convert(self.spec.mode)
            if geometry:
                img = apply_geometry(img, self.resize, None, self.center_crop, self.interpolation)
            arr = as_hwc(img)
        elif geometry:
            if self.decoder == "fast":
                fast = self._fast_resize_crop(index, sample, out)
                if fast is not None:
                    return fast
            return self._geometry(name, decode(sample.payload, self.spec.mode, name, self.max_pixels), out)
        else:
            return decode(sample.payload, self.spec.mode, name, self.max_pixels, out=out)
        return write_into(out, arr, lambda got, want: f"{name}: image is {got}, the dataset says {want}; re-pack "
                                                      "or pass resize/center_crop")

    def _geometry(self, name: str, arr: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The read-time resize and centre crop of a decoded image (:func:`resize_crop_array`: within one level of
        ``decoder="pil"``), written into ``out`` when given."""
        if out is not None and out.shape != geometry_shape(arr.shape, self.resize, self.center_crop):
            raise CorruptDataError(f"{name}: image is {arr.shape[1]}x{arr.shape[0]}, which does not give the "
                                   f"dataset's {out.shape}; re-pack or pass resize/center_crop")
        return resize_crop_array(arr, self.resize, self.center_crop, self.interpolation, out)


class RowDecoder:
    """A batch row's decode for one case :meth:`serves` recognises; anything it cannot decode exactly goes to
    the decoding's :meth:`~Decoding.decode_array`. Called as ``decoder(index, sample, out, epoch)``."""

    def __init__(self, decoding: Decoding):
        self.general = decoding.decode_array
        self.colorspace, self.channels = ("GRAY", 1) if decoding.spec.mode == "L" else ("RGB", 3)

    @staticmethod
    def serves(decoding: Decoding) -> bool:
        """Whether this decoder gives ``decoding``'s pixels (for the samples it takes; the rest fall back)."""
        raise NotImplementedError

    def __call__(self, index: int, sample: Sample, out: np.ndarray, epoch: int = 0) -> np.ndarray:
        raise NotImplementedError


class JpegIntoRow(RowDecoder):
    """packer's own JPEGs at the output size, decoded by simplejpeg straight into the row. Only packer's own
    encodes are sure to be YCbCr or grey without reading each header: decode() leaves a CMYK JPEG to Pillow,
    whose pixels simplejpeg's own conversion would not match."""

    @staticmethod
    def serves(decoding: Decoding) -> bool:
        return (not decoding.augments and decoding.decoder != "pil" and not decoding.reader.is_raw
                and not decoding.resize and not decoding.center_crop and decoding.spec.store == "jpeg")

    def __call__(self, index: int, sample: Sample, out: np.ndarray, epoch: int = 0) -> np.ndarray:
        try:
            # the row bounds the decode: a larger image raises, a smaller one comes back another shape
            if simplejpeg.decode_jpeg(sample.payload, colorspace=self.colorspace, buffer=out).shape == out.shape:
                return out
        except ValueError:
            pass
        return self.general(index, sample, out, epoch)


class CroppedJpegRow(RowDecoder):
    """JPEGs with a read-time centre crop (``decoder="auto"``): decoded whole into this thread's scratch buffer,
    then the crop's slice copied into the row, or the kept region resampled into it (:func:`resize_crop_array`,
    within one level of ``decoder="pil"``)."""

    def __init__(self, decoding: Decoding):
        super().__init__(decoding)
        self.resize, self.crop, self.max_pixels = decoding.resize, decoding.center_crop, decoding.max_pixels
        self.interpolation = decoding.interpolation
        self.fits_by_size: dict[tuple[int, int], bool] = {}  # whether an image of that size is decoded here

    @staticmethod
    def serves(decoding: Decoding) -> bool:
        return (not decoding.augments and decoding.decoder == "auto" and not decoding.reader.is_raw
                and bool(decoding.center_crop))

    def __call__(self, index: int, sample: Sample, out: np.ndarray, epoch: int = 0) -> np.ndarray:
        size = jpeg_size(sample.payload)
        if size is None:  # not a JPEG
            return self.general(index, sample, out, epoch)
        fits = self.fits_by_size.get(size)
        if fits is None:  # within the pixel limit, and a crop that does not pad (padding is decode_array's)
            fits = self.fits_by_size.setdefault(size, size[0] * size[1] <= self.max_pixels
                                                and center_region(size, self.resize, self.crop) is not None)
        if fits:
            try:
                scratch = decode_scratch(size[0] * size[1] * self.channels)
                arr = simplejpeg.decode_jpeg(sample.payload, colorspace=self.colorspace, buffer=scratch)
            except ValueError:
                arr = None
            if arr is not None and arr.shape[:2] == size:
                return resize_crop_array(arr.reshape(*size, self.channels), self.resize, self.crop,
                                         self.interpolation, out)
        return self.general(index, sample, out, epoch)


# row_decoder's table: the first that serves a decoding decodes its batch rows; none: decode_array
ROW_DECODERS: tuple[type[RowDecoder], ...] = (JpegIntoRow, CroppedJpegRow)


def _height_width(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """An int or (height, width), torchvision's convention for ``RandomResizedCrop(size)``, as (height, width)."""
    if size is None:
        return None
    pair = tuple(as_pair(size)) if isinstance(size, (int, tuple, list)) else ()  # a longer tuple is refused below
    if len(pair) != 2 or not all(arguments.is_int(v) and v > 0 for v in pair):
        raise ValueError(f"random_resized_crop must be a positive int or (height, width), not {size!r}")
    return pair

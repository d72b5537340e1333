"""A Hugging Face ``datasets.Dataset`` as a pack source (``hf:NAME`` or a ``save_to_disk`` folder): its image
column, its labels and every other column as a field (:func:`packer.exports.hf.to_hf` reads a packed dataset back as
one).

Packing (``packer pack hf:PATH_OR_NAME DEST`` or ``packer.pack(dataset, DEST)``): PATH is a folder written by
``save_to_disk`` (a ``DatasetDict`` folder gives its ``--split``, default ``train``) or a folder of data files
``datasets.load_dataset`` reads (images, parquet); NAME is a Hub dataset already in the Hugging Face cache. The
image is the column ``--image-column`` names, default the first ``Image()`` feature; its stored bytes are packed
as they are (``store original`` keeps them exactly), or re-encoded as the transform says. The class is the
``ClassLabel`` column (``--label-column``, default the first), with the feature's names in the feature's order; a
sample whose class is -1 or missing is skipped and listed. Every other column becomes a field typed from its
feature: integers and ClassLabels int64, floats float32, strings text, binary bytes, a list of numbers a vector
(of fixed length when the feature says so), a further ``Image()`` a second image, anything else (dicts, lists of
strings, ``Json()``) JSON. An ``Image()`` column whose name contains ``mask`` is a mask, as an annotation table's
column is (its pixels uint8 or uint16 as its first row's file says; given the image's geometry by nearest
neighbour). A column of another kind (Audio, Video...) is left out with a warning; an empty cell skips its row.

Reading back (:func:`to_hf`): a ``datasets.Dataset`` built with ``Dataset.from_generator`` (written to the
Hugging Face cache as it goes, so memory stays bounded): the image as an ``Image()`` feature holding the stored
bytes (a PNG of the pixels for ``store raw``), the class as a ``ClassLabel`` with the dataset's classes, the
fields as ``Value`` and ``List`` features, masks as ``Image()`` features of their stored one-channel PNGs (mode
``L`` or ``I;16``, the exact values), JSON fields with the source's own feature when packed from a Hugging Face
dataset, else as ``Json()`` (text on a ``datasets`` without it).

``datasets`` is an optional dependency (``pip install 'packer-data[hf]'``); nothing here imports it before it
is needed.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError, SourceError, UsageError, warn
from ..fields import Field, encode, extra_fields
from ..images.masks import MASK_MODES, convert_mask_bytes, mask_mode, not_a_mask
from ..images.transforms import (
    Encoded,
    TransformSpec,
    checked_sides,
    convert_bytes,
    convert_file,
    read_source_file,
)
from .base import SampleReader, Source, image_size

PREFIX = "hf:"
DEFAULT_SPLIT = "train"
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?\Z")
_SIDE_STORES = {"raw": "png"}  # a second image of a raw-pixel dataset is stored lossless but encoded
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool")
_FLOATS = ("float16", "float32", "float64", "double", "float")


def is_hf(src: object) -> bool:
    """Whether ``src`` names a Hugging Face dataset: ``hf:...`` text, or a ``datasets`` object."""
    if isinstance(src, str):
        return src.startswith(PREFIX)
    module = sys.modules.get("datasets")
    return module is not None and isinstance(src, (module.Dataset, module.DatasetDict))


def import_datasets():
    try:
        import datasets
    except ImportError:
        raise UsageError("Hugging Face datasets need the datasets package: pip install 'packer-data[hf]'") from None
    return datasets


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _load_folder(datasets, path: Path):
    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, pyarrow errors...
        raise SourceError(f"{path}: not a readable save_to_disk folder ({_one_line(exc)}); write it again with "
                          "dataset.save_to_disk") from None


def _load_hub(datasets, name: str, src: str):
    try:
        return datasets.load_dataset(name)
    except Exception as exc:
        raise SourceError(f"{src}: no such folder, and not a dataset datasets.load_dataset can read offline "
                          f"({_one_line(exc)}); download it first with datasets.load_dataset({name!r}), or give the "
                          "folder written by save_to_disk") from None


def _pick_split(datasets, loaded, split: str | None, where: str) -> tuple[Any, str | None]:
    if isinstance(loaded, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise UsageError(f"{where}: a streaming dataset cannot be packed; load it without streaming=True")
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        chosen = split or (DEFAULT_SPLIT if DEFAULT_SPLIT in loaded or len(names) != 1 else names[0])
        if chosen not in loaded:
            raise UsageError(f"--split {chosen}: {where} has no split {chosen!r} (splits: {', '.join(names)})")
        return loaded[chosen], chosen
    if split is not None and str(loaded.split) != split:
        raise UsageError(f"--split {split}: {where} is a single Dataset ({loaded.split or 'no'} split), not a "
                         "DatasetDict; drop --split")
    return loaded, None if loaded.split is None else str(loaded.split)


def feature_type(feature: Any) -> str:
    return type(feature).__name__


def _field_of(name: str, feature: Any) -> Field | None:
    """The field a column of ``feature`` packs as; None for a kind of column that is not packed."""
    kind = feature_type(feature)
    if kind == "Value":
        dtype = str(feature.dtype)
        if dtype in _INTS:
            return Field(name, "int64")
        if dtype in _FLOATS:
            return Field(name, "float32")
        if dtype in ("string", "large_string"):
            return Field(name, "text")
        if dtype in ("binary", "large_binary"):
            return Field(name, "bytes")
        return None
    if kind == "ClassLabel":
        return Field(name, "int64")
    if kind == "Image":  # a mask when its name says so, as an annotation table's column (its pixels: from a row)
        return Field(name, "mask", (), "uint8") if "mask" in name.lower() else Field(name, "image")
    if kind == "Json":  # datasets' own JSON feature (what packer.to_hf gives a JSON field)
        return Field(name, "json")
    if kind in ("Sequence", "List", "LargeList"):
        inner = feature.feature
        if feature_type(inner) == "Value" and str(inner.dtype) in _INTS + _FLOATS:
            length = getattr(feature, "length", -1)
            return Field(name, "int64" if str(inner.dtype) in _INTS else "float32",
                         (length,) if length and length > 0 else None)
    if _jsonable(feature):
        return Field(name, "json")
    return None


def _per_row(dataset, name: str, values) -> np.ndarray:
    """``values(chunk)`` (a numpy array per arrow chunk of column ``name``) for every row, in the dataset's row
    order: computed on the stored table, then an indices mapping (a shuffled or selected dataset) applied to the
    small result, never to the column (that would copy every image)."""
    chunks = dataset.data.column(name).chunks
    out = np.concatenate([values(chunk) for chunk in chunks]) if chunks else np.zeros(0, np.int64)
    indices = getattr(dataset, "_indices", None)
    if indices is not None:
        out = out[indices.column(0).to_numpy()]
    return out


def _labels(chunk) -> np.ndarray:
    return chunk.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def _lengths(chunk) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.fill_null(pc.binary_length(chunk.field("bytes")), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _jsonable(feature: Any) -> bool:
    """Whether values of ``feature`` are plain JSON (no images, audio, binary or timestamps inside)."""
    kind = feature_type(feature)
    if isinstance(feature, dict):
        return all(_jsonable(f) for f in feature.values())
    if isinstance(feature, list):
        return all(_jsonable(f) for f in feature)
    if kind in ("Sequence", "List", "LargeList"):
        return _jsonable(feature.feature)
    if kind == "Value":
        return str(feature.dtype) in _INTS + _FLOATS + ("string", "large_string")
    return kind == "ClassLabel"


class HfReader(SampleReader):
    """Converts one row of a ``datasets.Dataset`` (images not decoded). Picklable: a dataset read from disk
    pickles as its file paths, one in memory as its table."""

    def __init__(self, dataset, image: str, label: str | None, fields: list[Field], columns: dict[str, str]):
        self.dataset, self.image, self.label, self.fields, self.columns = dataset, image, label, fields, columns

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        name = self.name(index)
        row = self.dataset[index]
        encoded = checked_sides(_image(row[self.image], name, spec), name)
        label = -1
        if self.label is not None:
            label = row[self.label]
            if label is None or label < 0:
                raise ImageError(name, f"no class (column {self.label!r} holds {label}); give it one or drop the row")
        extras = tuple(self._extra(field, row[self.columns[field.name]], name, spec, row[self.image])
                       for field in self.fields)
        return f"{name}.{'png' if encoded.ext == 'raw' else encoded.ext}", int(label), encoded, extras

    def _extra(self, field: Field, value: Any, name: str, spec: TransformSpec, image: Any = None) -> bytes:
        if value is None:
            raise ImageError(name, f"column {self.columns[field.name]!r} is empty; fill it or drop the row")
        if field.kind == "mask":
            return convert_mask_bytes(_cell_bytes(value, f"{name} {field.name}"), f"{name} {field.name}", spec,
                                      field.pixels or "uint8", image_size(_cell_bytes(image, name), name))
        if field.kind == "image":
            side = replace(spec, store=_SIDE_STORES.get(spec.store, spec.store), normalize=False, dtype="uint8")
            return _image(value, f"{name} {field.name}", side).payload
        try:
            return encode(field, value)
        except (TypeError, ValueError) as exc:
            raise ImageError(name, f"column {self.columns[field.name]!r}: {_one_line(exc)}") from None

    def name(self, index: int) -> str:
        return f"{index:08d}"


def _cell_bytes(cell: dict | None, name: str) -> bytes:
    """The file bytes of a cell of an ``Image(decode=False)`` column: its bytes, else the file its path names."""
    if not cell or (cell.get("bytes") is None and not cell.get("path")):
        raise ImageError(name, "no image in this row; give it one or drop the row")
    if cell.get("bytes") is not None:
        return bytes(cell["bytes"])
    return read_source_file(cell["path"], name)


def _image(cell: dict | None, name: str, spec: TransformSpec) -> Encoded:
    """A cell of an ``Image(decode=False)`` column converted: its bytes, else the file its path names."""
    if cell and cell.get("bytes") is None and cell.get("path"):
        return convert_file(cell["path"], name, spec)
    return convert_bytes(_cell_bytes(cell, name), name, spec)


class HfSource(Source):
    """A ``datasets.Dataset`` (see the module's documentation)."""

    kind = "hf"

    def __init__(self, src: Any, split: str | None = None, image_column: str | None = None,
                 label_column: str | None = None):
        datasets = import_datasets()
        dataset, self.name, folder, self.split = _loaded(src, split)
        features = dataset.features
        columns = ", ".join(f"{k} ({feature_type(v)})" for k, v in features.items()) or "none"
        image = image_column or next((k for k, v in features.items() if feature_type(v) == "Image"), None)
        if image is None:
            raise SourceError(f"{self.name}: no Image column (columns: {columns}); cast one with "
                              "dataset.cast_column(NAME, datasets.Image()), or name it with --image-column")
        for option, column in (("--image-column", image), ("--label-column", label_column)):
            if column is not None and column not in features:
                raise UsageError(f"{option} {column}: {self.name} has no column {column!r} (columns: {columns})")
        if feature_type(features[image]) != "Image":
            raise UsageError(f"--image-column {image}: is a {feature_type(features[image])} column, not an Image() "
                             f"one (columns: {columns})")
        label = label_column or next((k for k, v in features.items() if feature_type(v) == "ClassLabel"), None)
        if label is not None and feature_type(features[label]) != "ClassLabel":
            raise UsageError(f"--label-column {label}: is a {feature_type(features[label])} column, not a "
                             "ClassLabel; cast it with dataset.class_encode_column")
        classes = list(features[label].names) if label is not None else []
        labels = np.zeros(0, np.int64)
        if label is not None:
            labels = _per_row(dataset, label, _labels)
            if len(labels) and (labels < 0).all():
                warn(f"{self.name}: column {label!r} holds no class (all -1, an unlabelled split); packed without one")
                label, classes = None, []
        super().__init__(folder if folder is not None else Path("."), classes, len(dataset))
        self.folder, self.image, self.label = folder, image, label
        try:
            schema = [Field("image", "image")] + ([Field(label, "class")] if label is not None else [])
        except ValueError as exc:
            raise SourceError(f"{self.name}: {exc} (dataset.rename_column)") from None
        self.columns: dict[str, str] = {}
        self.json_features: dict[str, Any] = {}
        for column, feature in features.items():
            if column in (image, label):
                continue
            try:
                field = _field_of(column, feature)
            except ValueError as exc:
                raise SourceError(f"{self.name}: {exc} (dataset.rename_column)") from None
            if field is None:
                warn(f"{self.name}: column {column!r} ({feature_type(feature)}) is not packed: packer keeps images, "
                     "numbers, text, lists and dicts")
                continue
            if field.name == "image":
                raise SourceError(f"{self.name}: column 'image' is not the image column ({image!r}) but the image is "
                                  "stored as 'image'; rename it with dataset.rename_column")
            if field.kind == "json":
                self.json_features[column] = datasets.Features({column: feature}).to_dict()[column]
            if field.kind == "mask":
                field = self._mask_pixels(dataset, field)
            schema.append(field)
            self.columns[column] = column
        self.schema = schema
        present: np.ndarray | list[int] = (np.bincount(labels[labels >= 0], minlength=len(classes))
                                           if label is not None else [])
        self.empty_classes = [c for c, n in zip(classes, present, strict=False) if n == 0]
        used = [image, *([label] if label else []), *self.columns]
        self.dataset = dataset.select_columns(used)
        for column in used:
            if feature_type(features[column]) == "Image":
                self.dataset = self.dataset.cast_column(column, datasets.Image(decode=False))

    def _mask_pixels(self, dataset, field: Field) -> Field:
        """A mask column's pixel type (uint8 or uint16), from its first row's header."""
        cell = dataset.cast_column(field.name, import_datasets().Image(decode=False))[0][field.name] \
            if len(dataset) else None
        if cell is None:
            return field
        where = f"{self.name} column {field.name!r}"
        mode = mask_mode(io.BytesIO(_cell_bytes(cell, where)), where)
        if mode not in MASK_MODES:
            raise UsageError(f"{where}: {not_a_mask(mode)}")
        return Field(field.name, "mask", (), MASK_MODES[mode])

    def sizes(self) -> np.ndarray:
        try:
            lengths = _per_row(self.dataset, self.image, _lengths)
        except Exception:  # a layout this estimate does not know: a guess (sizes only size the output)
            return np.full(self.count, 100_000, np.int64)
        known = lengths[lengths > 0]
        return np.where(lengths > 0, lengths, int(known.mean()) if len(known) else 100_000).astype(np.int64)

    def fingerprint(self) -> str:
        parts = [getattr(self.dataset, "_fingerprint", ""), self.image, self.label, self.split, self.count]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()

    def reader(self) -> SampleReader:
        return HfReader(self.dataset, self.image, self.label, extra_fields(self.schema), self.columns)

    def where(self, relpath: str) -> str:
        return f"row {relpath.split('.', 1)[0].lstrip('0') or '0'} of {self.name}"

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "root": str(self.folder.resolve()) if self.folder is not None else None,
                "dataset": self.name, "split": self.split, "image_column": self.image,
                "label_column": self.label, "json_features": self.json_features}

    @property
    def key(self) -> str:
        if self.folder is not None:
            return f"{PREFIX}{self.folder.resolve()}"
        return self.name if self.name.startswith(PREFIX) else f"datasets.Dataset {self.fingerprint()[:16]}"

    def dest_problem(self, dest: Path) -> str | None:
        if self.folder is None:
            return None
        return super().dest_problem(dest)


def _loaded(src: Any, split: str | None) -> tuple[Any, str, Path | None, str | None]:
    """``(dataset, name, folder, split)``: the ``datasets.Dataset`` that ``src`` names (``hf:PATH_OR_NAME``, a
    ``Dataset`` or a ``DatasetDict``), how messages name it, its folder (None for a Hub name or an object) and
    the split taken (None for a lone ``Dataset`` without one). One-line errors for a missing dataset or split."""
    datasets = import_datasets()
    folder = None
    if isinstance(src, str):
        name = src[len(PREFIX):]
        if not name:
            raise UsageError("hf: give a dataset folder or a Hub name after hf:, such as hf:./my_dataset")
        path = Path(name).expanduser()
        if path.is_dir():
            folder = path
            saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
            loaded = _load_folder(datasets, path) if saved else _load_hub(datasets, str(path), src)
        elif path.exists() or not _HUB_NAME.match(name):
            raise SourceError(f"{src}: no such folder; give a folder written by save_to_disk, or the name of a Hub "
                              "dataset already downloaded")
        else:
            loaded = _load_hub(datasets, name, src)
        where = src
    else:
        loaded, where = src, f"the datasets.{type(src).__name__}"
    dataset, chosen = _pick_split(datasets, loaded, split, where)
    return dataset, where, folder, chosen

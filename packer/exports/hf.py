"""A packed dataset read back as a Hugging Face ``datasets.Dataset`` (:func:`to_hf`), each field as its own
feature."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PackerError
from ..fields import NUMERIC, Field, extra_fields, label_field
from ..formats import open_reader
from ..images.transforms import to_pil
from ..reading.fields import decode_value
from ..sources.hf import feature_type, import_datasets

if TYPE_CHECKING:  # the hf extra; imported when used
    import datasets


# -- reading a packed dataset back as a datasets.Dataset ------------------------------------------------------------
def _hf_feature(datasets, field: Field, source: dict) -> Any:
    if field.kind in NUMERIC:
        value = datasets.Value(field.kind)
        return value if field.shape == () else datasets.List(value, length=field.shape[0] if field.shape else -1)
    if field.kind == "text":
        return datasets.Value("string")
    if field.kind == "bytes":
        return datasets.Value("binary")
    if field.kind in ("image", "mask"):
        return datasets.Image()
    recorded = (source.get("json_features") or {}).get(field.name) if source.get("kind") == "hf" else None
    if recorded is not None:
        return datasets.Features.from_dict({field.name: recorded})[field.name]
    json_feature = getattr(datasets, "Json", None)  # datasets' JSON feature, where this datasets has one
    return json_feature() if json_feature is not None else datasets.Value("string")


def _features(datasets, reader):
    recorded = reader.manifest.get("source")  # what the dataset was packed from
    source = recorded if isinstance(recorded, dict) else {}
    schema = reader.schema
    label = label_field(schema)
    image = source.get("image_column") if source.get("kind") == "hf" else None
    features = {image or "image": datasets.Image()}
    if label is not None:
        features[label.name] = datasets.ClassLabel(names=list(reader.classes))
    for field in extra_fields(schema):
        features[field.name] = _hf_feature(datasets, field, source)
    return datasets.Features(features)


def _rows(root: str, digest: str):
    """The generator :func:`to_hf` hands to ``Dataset.from_generator``: one row per stored sample, in order
    (``digest``, the manifest's, makes the cache entry change with the dataset)."""
    datasets = import_datasets()
    reader = open_reader(root)
    features = _features(datasets, reader)
    names = list(features)
    label = label_field(reader.schema)
    extras = extra_fields(reader.schema)
    # given as the stored JSON text: a Json() feature parses text that is JSON (the value "5" stays a string)
    json_as_text = {f.name for f in extras if f.kind == "json" and feature_type(features[f.name]) in ("Value", "Json")}
    reader.open()
    for i in range(len(reader)):
        data, stored_label = reader.raw_sample(i)
        row: dict[str, Any] = {names[0]: {"bytes": _png(data) if isinstance(data, np.ndarray) else data,
                                          "path": None}}
        if label is not None:
            row[label.name] = stored_label
        raw = reader.read_fields(i, verify=True)
        for field in extras:
            value = raw[field.name]
            if field.dense:
                row[field.name] = {"bytes": bytes(value), "path": None}
            elif field.name in json_as_text:
                row[field.name] = bytes(value).decode("utf-8")
            else:
                decoded = decode_value(field, value, reader.describe(i))
                row[field.name] = decoded.tolist() if isinstance(decoded, np.ndarray) else decoded
        yield row


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    to_pil(array).save(out, "PNG")
    return out.getvalue()


def to_hf(dest: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """The packed dataset ``dest`` as a ``datasets.Dataset`` (see the module's documentation).

    Args:
        dest: the packed dataset (any format; a URL is fetched into packer's cache first).
        cache_dir: the Hugging Face cache folder the rows are written to (default: datasets' own).

    Returns:
        A ``datasets.Dataset`` with one row per stored sample, in stored order. Its columns are the image
        (``Image()``, with the stored bytes), the class (``ClassLabel``) when the dataset has one, and each field.

    Raises:
        PackerError: ``dest`` is not a packed dataset, or stores normalized arrays (not images).
    """
    from ..remote.entry import local_dataset  # a URL is resolved here, at the entry point

    datasets = import_datasets()
    root = Path(local_dataset(dest)).resolve()
    reader = open_reader(root)
    if reader.spec.normalize:
        raise PackerError(f"{dest}: stores normalized {reader.spec.dtype} arrays, which are not images; to_hf needs "
                          "a dataset of pixels or encoded images")
    features = _features(datasets, reader)
    digest = hashlib.sha256(json.dumps(reader.manifest, sort_keys=True, default=str).encode()).hexdigest()
    return datasets.Dataset.from_generator(_rows, features=features, gen_kwargs={"root": str(root), "digest": digest},
                                           cache_dir=None if cache_dir is None else str(cache_dir),
                                           fingerprint=hashlib.sha256(f"{root}\0{digest}".encode()).hexdigest()[:32])

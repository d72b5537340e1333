"""Fields: what one sample holds beyond its image, and how each value is stored.

A dataset's schema is a list of :class:`Field`. The first is always the primary image, named ``image``; a
dataset packed from class folders has exactly one more, its class (``label``), and reads as ``(image, label)``
as it always did. A dataset packed from an annotation table or from foreign shards may have any fields: a class
(strings mapped to indices in sorted order, as ImageFolder does), numbers, vectors, text, JSON, raw bytes, and
further images or masks. The manifest records the schema under ``fields``; a manifest without it is the
image-and-class schema.

Stored bytes are plain, so that other tools read them without packer: numbers and vectors are the
little-endian bytes of their numpy array (``<i8``/``<f4``), text is UTF-8, JSON is ``json.dumps(sort_keys=True)``
in UTF-8, a mask is a PNG (mode ``L`` for uint8, ``I;16`` for uint16) whose values are the mask's exact values,
a second image is an encoded image like the primary one. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .errors import ManifestError

KINDS = ("image", "mask", "class", "int64", "float32", "text", "json", "bytes")
NUMERIC = {"int64": "<i8", "float32": "<f4"}
MASK_PIXELS = ("uint8", "uint16")
MAX_CLASSES = 100_000  # integer labels (tables, foreign shards) are 0 to 99,999: the classes fit a manifest
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*\Z")
_TYPE = re.compile(r"(image|mask|class|int64|float32|text|json|bytes)(?:\[([0-9]*|uint8|uint16)\])?\Z")


@dataclass(frozen=True)
class Field:
    """One field of a sample.

    Attributes:
        name: the key in ``ds[i]`` and in the stored layout: letters, digits, ``_`` and ``-``.
        kind: one of :data:`KINDS`.
        shape: numbers only: ``()`` a scalar, ``(n,)`` a vector of n, ``None`` a vector of any length.
        pixels: masks only: ``"uint8"`` or ``"uint16"``.
    """

    name: str
    kind: str
    shape: tuple[int, ...] | None = ()
    pixels: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"field name {self.name!r}: use letters, digits, '_' and '-' (rename the column)")
        if self.kind not in KINDS:
            raise ValueError(f"field {self.name!r}: unknown type {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind not in NUMERIC and self.shape != ():
            raise ValueError(f"field {self.name!r}: only int64 and float32 fields have a shape")
        if self.shape is not None and (len(self.shape) > 1 or any(n < 1 for n in self.shape)):
            raise ValueError(f"field {self.name!r}: shape {self.shape} is not () or (n,) with n >= 1")
        if (self.pixels is not None) != (self.kind == "mask") or (self.pixels and self.pixels not in MASK_PIXELS):
            raise ValueError(f"field {self.name!r}: pixels must be uint8 or uint16 for a mask, absent otherwise")

    @property
    def dense(self) -> bool:
        """Whether the field is pixels (an image or mask) that read-time geometry and augmentation apply to."""
        return self.kind in ("image", "mask")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe form the manifest stores."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind in NUMERIC:
            out["shape"] = None if self.shape is None else list(self.shape)
        if self.pixels:
            out["pixels"] = self.pixels
        return out

    @classmethod
    def from_dict(cls, entry: object, where: str = "manifest.json") -> Field:
        """The field a manifest entry describes; a :class:`ManifestError` naming ``where`` if it is malformed."""
        try:
            if not isinstance(entry, dict) or set(entry) - {"name", "kind", "shape", "pixels"}:
                raise ValueError(f"field entry {entry!r} is not {{name, kind[, shape][, pixels]}}")
            shape = entry.get("shape", [])
            if shape is not None and not (isinstance(shape, list) and all(type(n) is int for n in shape)):
                raise ValueError(f"field {entry.get('name')!r}: shape {shape!r} is not a list of integers")
            # name, kind and pixels as read: __post_init__ rejects any that is missing or not a string
            return cls(cast(str, entry.get("name")), cast(str, entry.get("kind")),
                       None if shape is None else tuple(shape), entry.get("pixels"))
        except ValueError as exc:
            raise ManifestError(f"{where}: {exc}; the manifest is damaged, re-pack") from None


def encode(field: Field, value: Any) -> bytes:
    """The stored bytes of ``value`` (numbers, text, JSON, bytes); images and masks are encoded as images are."""
    if field.kind in NUMERIC:
        array = np.asarray(value, NUMERIC[field.kind])
        if field.shape is not None and array.shape != field.shape:
            raise ValueError(f"{field.name}: {array.shape} values, the field holds {field.shape}")
        if field.shape is None and array.ndim != 1:
            raise ValueError(f"{field.name}: expected a list of numbers")
        return array.tobytes()
    if field.kind == "text":
        return str(value).encode("utf-8")
    if field.kind == "json":
        return json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False).encode("utf-8")
    if field.kind == "class":
        return str(int(value)).encode("ascii")
    return bytes(value)


def decode(field: Field, data: bytes | memoryview) -> Any:
    """The value of stored bytes: int or float (scalars), a numpy array (vectors), str, a JSON value, or bytes
    (images, masks and bytes fields: their decoding is the reader's). ValueError when they do not fit."""
    if field.kind in NUMERIC:
        dtype = np.dtype(NUMERIC[field.kind])
        if len(data) % dtype.itemsize or (field.shape is not None and
                                          len(data) != dtype.itemsize * math.prod(field.shape)):
            held = f"{field.kind}{list(field.shape or [])}"
            raise ValueError(f"{field.name}: {len(data)} stored bytes do not hold {held}")
        array = np.frombuffer(data, dtype).astype(dtype.newbyteorder("="))
        return array[0].item() if field.shape == () else array
    if field.kind == "text":
        return bytes(data).decode("utf-8")
    if field.kind == "json":
        return json.loads(bytes(data))
    if field.kind == "class":
        return int(bytes(data))
    return bytes(data)


def fields_crc32(extras: Sequence[bytes | memoryview]) -> int:
    """The checksum of a sample's extra fields as stored: crc32 over each value's length and bytes, in order."""
    crc = 0
    for value in extras:
        crc = zlib.crc32(len(value).to_bytes(8, "little"), crc)
        crc = zlib.crc32(value, crc)
    return crc


# -- schemas -----------------------------------------------------------------------------------------------------
PAIR_SCHEMA = (Field("image", "image"), Field("label", "class"))


def schema_of(manifest: dict, where: str = "manifest.json") -> list[Field]:
    """The schema a manifest records (its ``fields``), or the image-and-class schema of a manifest without one."""
    if "fields" not in manifest:
        return list(PAIR_SCHEMA)
    entries = manifest["fields"]
    if not isinstance(entries, list) or not entries:
        raise ManifestError(f"{where}: 'fields' is not a list of fields; the manifest is damaged, re-pack")
    schema = [Field.from_dict(entry, where) for entry in entries]
    check_schema(schema, where)
    return schema


def check_schema(schema: Sequence[Field], where: str) -> None:
    """A schema starts with the ``image`` field, names each field once and has at most one class."""
    problem = schema_problem(schema)
    if problem:
        raise ManifestError(f"{where}: {problem} ({', '.join(f.name for f in schema)}); the manifest is damaged, "
                            "re-pack")


def schema_problem(schema: Sequence[Field]) -> str | None:
    """Why a dataset with ``schema`` could not be opened (what :func:`check_schema` refuses), or None: the pack
    side asks before it writes anything."""
    names = [f.name for f in schema]
    repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if not schema or schema[0] != Field("image", "image"):
        return "the first field must be the image named 'image'"
    if repeated is not None:
        return f"field name {repeated!r} repeats"
    if sum(f.kind == "class" for f in schema) > 1:
        return "more than one class field"
    return None


def is_pair_schema(schema: Sequence[Field]) -> bool:
    """Exactly the image and one class: such a dataset reads as ``(image, label)``."""
    return len(schema) == 2 and schema[0].kind == "image" and schema[1].kind == "class"


def label_field(schema: Sequence[Field]) -> Field | None:
    """The class field, if the schema has one."""
    return next((f for f in schema if f.kind == "class"), None)


def extra_fields(schema: Sequence[Field]) -> list[Field]:
    """Every field but the primary image and the class, in schema order: the values that travel as a sample's
    ``extras`` (the image and the label have their own places in every format)."""
    label = label_field(schema)
    return [f for f in schema[1:] if f is not label]


# -- the --field option -----------------------------------------------------------------------------------------
def parse_field_option(text: str) -> Field:
    """``--field NAME:TYPE``: TYPE is a kind, and a number field may add ``[n]`` (n values) or ``[]`` (any
    number), a mask ``[uint8]`` or ``[uint16]`` (its pixel type): ``caption:text``, ``box:float32[4]``,
    ``tags:int64[]``, ``seg:mask``, ``seg:mask[uint16]`` (without it, a table finds a mask's pixel type from its
    first mask file). ValueError, in one line, when it is malformed."""
    name, sep, kind = text.partition(":")
    match = _TYPE.match(kind.strip())
    if not sep or not match:
        raise ValueError(f"--field {text!r}: expected NAME:TYPE with TYPE one of {', '.join(KINDS)} "
                         "(int64 and float32 may add [n] or [], mask [uint8] or [uint16])")
    kind, size = match.group(1), match.group(2)
    pixels = size in MASK_PIXELS
    if size is not None and (kind == "mask") != pixels or (size is not None and kind not in (*NUMERIC, "mask")):
        raise ValueError(f"--field {text!r}: only int64 and float32 take [n] or [], and only mask [uint8] or "
                         "[uint16]")
    if pixels:
        return Field(name.strip(), "mask", (), size)
    shape = () if size is None else (None if size == "" else (int(size),))
    return Field(name.strip(), kind, shape, "uint8" if kind == "mask" else None)

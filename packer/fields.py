"""PROVISIONAL stand-in for F1's packer/fields.py (issue 24, FIELDS.md contract), so that the read side runs
and is tested before it lands; the merge of f24-core replaces this file with F1's."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KINDS = ("image", "mask", "class", "int64", "float32", "text", "json", "bytes")


@dataclass(frozen=True)
class Field:
    name: str
    kind: str
    shape: tuple[int, ...] | None = ()
    pixels: str | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "shape": None if self.shape is None else list(self.shape),
                "pixels": self.pixels}

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> Field:
        shape = d.get("shape", [])
        return cls(d["name"], d["kind"], None if shape is None else tuple(shape), d.get("pixels"))


def encode(field: Field, value: object) -> bytes:
    if field.kind in ("int64", "float32"):
        return np.asarray(value, "<i8" if field.kind == "int64" else "<f4").tobytes()
    if field.kind == "text":
        return value.encode("utf-8")
    if field.kind == "json":
        return json.dumps(value, sort_keys=True).encode("utf-8")
    return bytes(value)


def decode(field: Field, data: bytes | memoryview) -> object:
    data = bytes(data)
    if field.kind in ("int64", "float32"):
        arr = np.frombuffer(data, "<i8" if field.kind == "int64" else "<f4")
        return arr[0].item() if field.shape == () else arr.reshape(field.shape or (-1,)).copy()
    if field.kind == "text":
        return data.decode("utf-8")
    if field.kind == "json":
        return json.loads(data)
    if field.kind == "class":
        return int(np.frombuffer(data, "<i8")[0])
    return data


def schema_of(manifest: dict) -> list[Field]:
    if "fields" in manifest:
        return [Field.from_dict(d, "manifest") for d in manifest["fields"]]
    return [Field("image", "image"), Field("label", "class")]


def is_pair_schema(schema: Sequence[Field]) -> bool:
    return len(schema) == 2 and schema[0].kind == "image" and schema[1].kind == "class"


def label_field(schema: Sequence[Field]) -> Field | None:
    return next((f for f in schema if f.kind == "class"), None)


def extra_fields(schema: Sequence[Field]) -> list[Field]:
    label = label_field(schema)
    return [f for f in schema if f.name != "image" and f is not label]

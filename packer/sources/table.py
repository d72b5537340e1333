"""Annotation tables as a source: a CSV (header row), TSV or JSON Lines file with one row per sample.

One column holds the image path (``image_column``, default ``image``), relative to ``root`` (default: the
table's folder). ``label_column`` names the class: strings become classes in sorted order with their
``class_to_idx`` (ImageFolder's rule), integers are kept as class indices. Every other column becomes a field,
typed from its values (:func:`packer.fields.infer_field`) or as ``--field NAME:TYPE`` says; a column of image
paths is a second image, or a mask when its name contains ``mask`` or ``--field NAME:mask`` says so.

The table is read and every cell checked before anything is converted: a missing column, a cell that does not
fit its column's type, an empty cell, or an image path given twice is one error naming the table, line and
column. An image that cannot be read is skipped and listed, as in an image folder.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import ImageError, SourceError, UsageError
from ..fields import Field, cell_value, encode, extra_fields, infer_field, parse_field_option
from ..images.masks import convert_mask, mask_pixels
from ..images.transforms import Encoded, TransformSpec, convert_file
from .base import SampleReader, Source

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson")
_SIDE_STORES = {"raw": "png"}  # a second image of a raw-pixel dataset is stored lossless but encoded


def is_table(path: Path) -> bool:
    """Whether ``path`` names an annotation table (by its suffix)."""
    return path.suffix.lower() in TABLE_SUFFIXES and path.is_file()


def read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of every row of a table; a :class:`SourceError` for one that is malformed."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            if path.suffix.lower() in (".jsonl", ".ndjson"):
                return _json_rows(path, f)
            reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            rows = []
            for row in reader:
                if None in row or None in row.values():
                    cells = sum(k is not None and v is not None for k, v in row.items()) + len(row.get(None) or [])
                    raise SourceError(f"{path} line {reader.line_num}: {cells} cells where the header has "
                                      f"{len(reader.fieldnames or [])}; fix the row")
                rows.append((reader.line_num, row))
            return rows
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: not UTF-8 text ({exc.reason}); save the table as UTF-8") from None
    except csv.Error as exc:
        raise SourceError(f"{path}: not a valid table ({exc})") from None


def _json_rows(path: Path, lines) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SourceError(f"{path} line {number}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise SourceError(f"{path} line {number}: a JSON Lines row is an object of column: value")
        rows.append((number, row))
    return rows


def _columns(rows: Sequence[tuple[int, dict]]) -> list[str]:
    """Every column, in the order first seen."""
    return list(dict.fromkeys(name for _, row in rows for name in row))


class TableReader(SampleReader):
    """Converts one row: its image, its label and its fields (numbers and text already encoded by the scan)."""

    def __init__(self, root: str, schema: list[Field], paths: list[str], labels: np.ndarray,
                 cells: list[tuple[bytes | str, ...]]):
        self.root, self.schema, self.paths, self.labels, self.cells = root, schema, paths, labels, cells
        self.extra = extra_fields(schema)

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        relpath = self.paths[index]
        path = os.path.join(self.root, relpath)
        encoded = convert_file(path, relpath, spec)
        try:
            extras = tuple(self._extra(field, cell, spec, path, relpath)
                           for field, cell in zip(self.extra, self.cells[index], strict=True))
        except ImageError as exc:  # a row's second image or mask: the row is skipped, named by its image
            raise ImageError(relpath, f"{exc.path}: {exc.reason}") from None
        return relpath, int(self.labels[index]), encoded, extras

    def _extra(self, field: Field, cell: bytes | str, spec: TransformSpec, path: str, relpath: str) -> bytes:
        if isinstance(cell, bytes):  # numbers, text and JSON: encoded by the scan (images and masks are paths)
            return cell
        if field.kind == "mask":
            return convert_mask(os.path.join(self.root, cell), cell, spec, field.pixels or "uint8",
                                _size(path, relpath))
        side = replace(spec, store=_SIDE_STORES.get(spec.store, spec.store), normalize=False, dtype="uint8")
        return convert_file(os.path.join(self.root, cell), cell, side).payload

    def name(self, index: int) -> str:
        return self.paths[index]


def _size(path: str, name: str) -> tuple[int, int]:
    try:
        with Image.open(path) as img:
            return img.size
    except (OSError, ValueError) as exc:
        raise ImageError(name, f"cannot read the image ({exc})") from None


class TableSource(Source):
    """An annotation table (see the module's documentation)."""

    kind = "table"

    def __init__(self, table: str | os.PathLike, image_column: str = "image", root: str | os.PathLike | None = None,
                 label_column: str | None = None, field: Sequence[str] = ()):
        self.table = Path(table)
        image_root = Path(root) if root is not None else self.table.parent
        if not image_root.is_dir():
            raise SourceError(f"{image_root}: no such folder (--root: the folder image paths are relative to)")
        rows = read_rows(self.table)
        self.json_lines = self.table.suffix.lower() in (".jsonl", ".ndjson")
        if not rows:
            raise SourceError(f"{self.table}: the table has no rows; nothing to pack")
        columns = _columns(rows)
        where = f"{self.table}"
        forced = {}
        for text in field:
            try:
                spec = parse_field_option(text)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            if spec.name not in columns:
                raise UsageError(f"--field {text}: {where} has no column {spec.name!r} (columns: {', '.join(columns)})")
            forced[spec.name] = spec
        for option, name in (("--image-column", image_column), ("--label-column", label_column)):
            if name is not None and name not in columns:
                raise UsageError(f"{option} {name}: {where} has no column {name!r} (columns: {', '.join(columns)})")
        paths = [self._cell(line, row, image_column, str) for line, row in rows]
        self._check_unique(rows, paths)
        labels, classes = self._labels(rows, label_column)
        super().__init__(image_root, classes, len(rows))
        self.image_root = image_root
        schema = [Field("image", "image")] + ([Field(label_column, "class")] if label_column else [])
        others = [c for c in columns if c not in (image_column, label_column)]
        for name in others:
            try:
                column = forced.get(name) or infer_field(name, [row.get(name) for _, row in rows])
            except ValueError as exc:
                raise UsageError(f"{where}: {exc}") from None
            if name not in forced and column.kind == "image" and "mask" in name.lower():
                column = Field(name, "mask", (), "uint8")
            schema.append(column)
        self.schema = [self._mask_pixels(f, rows, image_root) for f in schema]
        self.paths, self.labels = paths, labels
        self.cells = [self._row_cells(line, row) for line, row in rows]
        self.empty_classes = [c for c, n in zip(classes, np.bincount(labels, minlength=len(classes)), strict=True)
                              if n == 0] if label_column else []

    def _cell(self, line: int, row: dict, column: str, kind: type) -> Any:
        value = row.get(column)
        if value in (None, ""):
            raise SourceError(f"{self.table} line {line}, column {column!r}: the cell is empty; fill or drop the row")
        return kind(value)

    def _check_unique(self, rows: Sequence[tuple[int, dict]], paths: list[str]) -> None:
        first: dict[str, int] = {}
        for (line, _), path in zip(rows, paths, strict=True):
            key = os.path.normpath(path)
            if key in first:
                raise SourceError(f"{self.table} lines {first[key]} and {line}: the same image {path!r} twice; "
                                  "give each image one row")
            first[key] = line

    def _labels(self, rows: Sequence[tuple[int, dict]], column: str | None) -> tuple[np.ndarray, list[str]]:
        """Class indices and class names: strings sorted (ImageFolder), integers kept; -1 without a column."""
        if column is None:
            return np.full(len(rows), -1, np.int64), []
        cells = [(line, row.get(column)) for line, row in rows]
        for line, cell in cells:
            if cell in (None, ""):
                raise SourceError(f"{self.table} line {line}, column {column!r}: no label; fill or drop the row")
        field = Field(column, "int64")
        if all(isinstance(c, int) or (isinstance(c, str) and c.strip().lstrip("-").isdigit()) for _, c in cells):
            values = [cell_value(field, c) for _, c in cells]
            bad = next(((line, v) for (line, _), v in zip(cells, values, strict=True) if v < 0), None)
            if bad:
                raise SourceError(f"{self.table} line {bad[0]}, column {column!r}: label {bad[1]} is negative; "
                                  "class indices are 0, 1, 2...")
            return np.array(values, np.int64), [str(i) for i in range(max(values) + 1)]
        names = [str(c) for _, c in cells]
        classes = sorted(set(names))
        index = {c: i for i, c in enumerate(classes)}
        return np.array([index[n] for n in names], np.int64), classes

    def _mask_pixels(self, field: Field, rows: Sequence[tuple[int, dict]], root: Path) -> Field:
        if field.kind != "mask":
            return field
        first = next(row[field.name] for _, row in rows if row.get(field.name) not in (None, ""))
        return Field(field.name, "mask", (), mask_pixels(str(root / first), str(first)))

    def _row_cells(self, line: int, row: dict) -> tuple[bytes | str, ...]:
        """A row's extra fields: numbers, text and JSON as stored bytes, image and mask paths as they are."""
        out: list[bytes | str] = []
        for field in self.schema[1:]:
            if field.kind == "class":
                continue
            try:
                value = cell_value(field, row.get(field.name), text=not self.json_lines)
                out.append(str(value) if field.dense else encode(field, value))
            except ValueError as exc:
                raise SourceError(f"{self.table} line {line}, column {field.name!r}: {exc}; fix the cell, or force "
                                  f"the column's type with --field {field.name}:TYPE") from None
        return tuple(out)

    def sizes(self) -> np.ndarray:
        out = np.zeros(self.count, np.int64)
        for i, path in enumerate(self.paths):
            try:
                out[i] = os.stat(self.image_root / path).st_size
            except OSError:
                pass  # converting it says what is wrong
        return out

    def fingerprint(self) -> str:
        h = hashlib.sha256(str(self.image_root.resolve()).encode())
        with open(self.table, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    def reader(self) -> SampleReader:
        return TableReader(str(self.image_root), self.schema, self.paths, self.labels, self.cells)

    def where(self, relpath: str) -> str:
        return f"{relpath} in {self.image_root}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "table": str(self.table.resolve())}

    @property
    def key(self) -> str:
        return str(self.table.resolve())

    def dest_problem(self, dest: Path) -> str | None:
        """DEST may be inside the images' folder (``out/`` beside the table), not the folder or above it."""
        root, dest_r = self.image_root.resolve(), dest.resolve()
        if dest_r == root or root.is_relative_to(dest_r) or dest_r == self.table.resolve().parent:
            return f"{dest}: the destination would contain the table or its images; choose a folder of its own"
        return None

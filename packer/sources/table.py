"""Annotation tables as a source: a CSV (header row), TSV or JSON Lines file with one row per sample.

One column holds the image path (``image_column``, default ``image``), relative to ``root`` (default: the
table's folder) or absolute, and inside ``root`` either way (:mod:`packer.sources.table_paths`). ``label_column``
names the class: strings become classes in sorted order with their ``class_to_idx`` (ImageFolder's rule),
integers are kept as class indices (0 to 99,999). Every other column becomes a field, typed once from all its
values (:mod:`packer.sources.table_values`) or as ``--field NAME:TYPE`` says; a column of image paths is a second
image, or a mask when its name contains ``mask`` or ``--field NAME:mask`` says so.

The table is read and every cell checked before any image is opened: a repeated column, a missing column, a cell
that does not fit its column's type, an empty cell, an image path given twice, or a path outside the root is one
error naming the table, line and column, and nothing is written. A row whose image or mask is missing or not a
regular file is skipped and listed, and so is one whose image or mask cannot be decoded, as in an image folder.
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError, SourceError, UsageError
from ..fields import Field, encode, extra_fields, parse_field_option, schema_problem
from ..images.masks import MASK_MODES, convert_mask, mask_mode, not_a_mask
from ..images.transforms import Encoded, TransformSpec, checked_sides, convert_bytes, convert_file, read_source_file
from .base import SampleReader, Source, image_size
from .table_paths import Outside, Root
from .table_values import LabelError, cell_value, class_labels, infer_field, is_empty, loads

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson")
_SIDE_STORES = {"raw": "png"}  # a second image of a raw-pixel dataset is stored lossless but encoded
_MOVED_OUT = "leads outside --root now (a link changed while packing); restore the link, or pack again"


def is_table(path: Path) -> bool:
    """Whether ``path`` names an annotation table (by its suffix)."""
    return path.suffix.lower() in TABLE_SUFFIXES and path.is_file()


def read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of every row of a table; a :class:`SourceError` for one that is malformed, or for a
    column named twice."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            if path.suffix.lower() in (".jsonl", ".ndjson"):
                return _json_rows(path, f)
            reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            header = reader.fieldnames or []
            repeated = next((name for i, name in enumerate(header) if name in header[:i]), None)
            if repeated is not None:
                raise SourceError(f"{path} line 1: column {repeated!r} appears twice in the header; rename one")
            rows = []
            for row in reader:
                if None in row or None in row.values():
                    cells = sum(k is not None and v is not None for k, v in row.items()) + len(row.get(None) or [])
                    raise SourceError(f"{path} line {reader.line_num}: {cells} cells where the header has "
                                      f"{len(header)}; fix the row")
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
            row = loads(line)
        except ValueError as exc:
            raise SourceError(f"{path} line {number}: not JSON ({exc}); fix the row") from None
        if not isinstance(row, dict):
            raise SourceError(f"{path} line {number}: a JSON Lines row is an object of column: value")
        rows.append((number, row))
    return rows


def _columns(rows: Sequence[tuple[int, dict]]) -> list[str]:
    """Every column, in the order first seen."""
    return list(dict.fromkeys(name for _, row in rows for name in row))


class TableReader(SampleReader):
    """Converts one row: its image, its label and its fields (numbers and text already encoded by the scan)."""

    def __init__(self, root: Root, schema: list[Field], paths: list[str], labels: np.ndarray,
                 cells: list[tuple[bytes | str, ...]]):
        self.root, self.schema, self.paths, self.labels, self.cells = root, schema, paths, labels, cells
        self.extra = extra_fields(schema)
        self.masks = any(f.kind == "mask" for f in self.extra)

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        relpath = self.paths[index]
        data = read_source_file(self._path(relpath), relpath)
        encoded = checked_sides(convert_bytes(data, relpath, spec), relpath)
        size = image_size(data, relpath) if self.masks else (0, 0)
        try:
            extras = tuple(self._extra(field, cell, spec, size)
                           for field, cell in zip(self.extra, self.cells[index], strict=True))
        except ImageError as exc:  # a row's second image or mask: the row is skipped, named by its image
            raise ImageError(relpath, f"{exc.path}: {exc.reason}") from None
        return relpath, int(self.labels[index]), encoded, extras

    def _path(self, cell: str) -> str:
        try:
            return self.root.resolve(cell)
        except Outside:
            raise ImageError(cell, _MOVED_OUT) from None

    def _extra(self, field: Field, cell: bytes | str, spec: TransformSpec, size: tuple[int, int]) -> bytes:
        if isinstance(cell, bytes):  # numbers, text and JSON: encoded by the scan (images and masks are paths)
            return cell
        if field.kind == "mask":
            return convert_mask(self._path(cell), cell, spec, field.pixels or "uint8", size, field.name)
        side = replace(spec, store=_SIDE_STORES.get(spec.store, spec.store), normalize=False, dtype="uint8")
        return convert_file(self._path(cell), cell, side).payload

    def name(self, index: int) -> str:
        return self.paths[index]


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
        for option, name in (("--image-column", image_column), ("--label-column", label_column)):
            if name is not None and name not in columns:
                raise UsageError(f"{option} {name}: {self.table} has no column {name!r} (columns: "
                                 f"{', '.join(columns)})")
        if label_column == image_column:
            raise UsageError(f"--label-column {label_column}: that is the image column; name the class column")
        forced = self._forced(field, columns, image_column, label_column)
        schema = self._schema(rows, columns, image_column, label_column, forced)
        labels, classes = self._labels(rows, label_column)
        lines = [line for line, _ in rows]
        paths = [self._path_cell(line, row.get(image_column), image_column) for line, row in rows]
        cells = [self._row_cells(line, row, schema) for line, row in rows]
        self.image_root = image_root
        self.paths_root = Root(image_root)
        relpaths = [self.paths_root.relpath(p) for p in paths]
        self._check_unique(lines, relpaths)
        kept, sizes, errors = self._check_files(lines, paths, relpaths, cells, schema, image_column)
        super().__init__(image_root, classes, len(kept))
        self.errors = errors
        self.paths = [relpaths[i] for i in kept]
        self.labels = labels[kept] if len(kept) else np.zeros(0, np.int64)
        self.cells = [cells[i] for i in kept]
        self._sizes = np.array([sizes[i] for i in kept], np.int64)
        self.schema = schema
        pixels_given = {name for name in forced if any(t.replace(" ", "").startswith(f"{name}:mask[") for t in field)}
        self.schema = [self._mask_pixels(f, pixels_given, cells, lines, kept) for f in schema]
        self.empty_classes = [c for c, n in zip(classes, np.bincount(self.labels, minlength=len(classes)),
                                                strict=True) if n == 0] if label_column else []

    # -- the schema ----------------------------------------------------------------------------------------------
    def _forced(self, options: Sequence[str], columns: list[str], image_column: str,
                label_column: str | None) -> dict[str, Field]:
        """The ``--field NAME:TYPE`` options, by column; a :class:`UsageError` for one a table cannot have."""
        forced: dict[str, Field] = {}
        for text in options:
            try:
                spec = parse_field_option(text)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            problem = (
                f"{self.table} has no column {spec.name!r} (columns: {', '.join(columns)})"
                if spec.name not in columns else
                f"given twice ({forced[spec.name].kind} and {spec.kind}); give each column one type"
                if spec.name in forced else
                "that is the image column (--image-column)" if spec.name == image_column else
                f"that is the class column (--label-column); drop --field {spec.name}:{spec.kind}"
                if spec.name == label_column and spec.kind != "class" else
                f"a table's class is the column --label-column names (one class a dataset); pass --label-column "
                f"{spec.name} instead" if spec.kind == "class" and spec.name != label_column else
                "a table cell is text; type the column text or json" if spec.kind == "bytes" else None)
            if problem:
                raise UsageError(f"--field {text}: {problem}")
            forced[spec.name] = spec
        forced.pop(label_column or "", None)
        return forced

    def _schema(self, rows: Sequence[tuple[int, dict]], columns: list[str], image_column: str,
                label_column: str | None, forced: dict[str, Field]) -> list[Field]:
        """Every column's field, typed once; a :class:`UsageError` for a schema no dataset could be opened with."""
        if image_column != "image" and "image" in columns:
            raise UsageError(f"--image-column {image_column}: {self.table} also has a column named 'image', which "
                             "would be a field named like the primary image; rename that column, or drop it")
        try:
            schema = [Field("image", "image")] + ([Field(label_column, "class")] if label_column else [])
            for name in columns:
                if name in (image_column, label_column):
                    continue
                column = forced.get(name) or infer_field(name, [row.get(name) for _, row in rows],
                                                         text=not self.json_lines)
                if name not in forced and column.kind == "image" and "mask" in name.lower():
                    column = Field(name, "mask", (), "uint8")
                schema.append(column)
        except ValueError as exc:
            raise UsageError(f"{self.table}: {exc}") from None
        problem = schema_problem(schema)
        if problem:
            raise UsageError(f"{self.table}: {problem}; rename the column")
        return schema

    def _labels(self, rows: Sequence[tuple[int, dict]], column: str | None) -> tuple[np.ndarray, list[str]]:
        """Class indices and class names (:func:`packer.sources.table_values.class_labels`); -1 without a
        column."""
        if column is None:
            return np.full(len(rows), -1, np.int64), []
        try:
            indices, classes = class_labels([(line, row.get(column)) for line, row in rows], not self.json_lines)
        except LabelError as exc:
            raise SourceError(f"{self.table} line {exc.line}, column {column!r}: {exc}") from None
        return np.array(indices, np.int64), classes

    # -- the cells -----------------------------------------------------------------------------------------------
    def _path_cell(self, line: int, value: object, column: str) -> str:
        if is_empty(value):
            raise SourceError(f"{self.table} line {line}, column {column!r}: the cell is empty; fill or drop the "
                              "row")
        try:
            path = cell_value(Field("image", "image"), value, text=not self.json_lines)
        except ValueError as exc:
            raise SourceError(f"{self.table} line {line}, column {column!r}: {exc}; write the image's path") \
                from None
        if "\0" in path:
            raise SourceError(f"{self.table} line {line}, column {column!r}: the path holds a NUL character; fix "
                              "the cell")
        return path

    def _row_cells(self, line: int, row: dict, schema: list[Field]) -> tuple[bytes | str, ...]:
        """A row's extra fields: numbers, text and JSON as stored bytes, image and mask paths as they are."""
        out: list[bytes | str] = []
        for field in extra_fields(schema):
            value = row.get(field.name)
            try:
                if field.dense:
                    out.append(self._path_cell(line, value, field.name))
                    continue
                out.append(encode(field, cell_value(field, value, text=not self.json_lines)))
            except ValueError as exc:
                advice = "" if ";" in str(exc) else (f"; fix the cell, or force the column's type with --field "
                                                     f"{field.name}:TYPE")
                raise SourceError(f"{self.table} line {line}, column {field.name!r}: {exc}{advice}") from None
        return tuple(out)

    def _check_unique(self, lines: list[int], relpaths: list[str]) -> None:
        first: dict[str, int] = {}
        for line, path in zip(lines, relpaths, strict=True):
            if path in first:
                raise SourceError(f"{self.table} lines {first[path]} and {line}: the same image {path!r} twice; "
                                  "give each image one row")
            first[path] = line

    # -- the files -----------------------------------------------------------------------------------------------
    def _check_files(self, lines: list[int], paths: list[str], relpaths: list[str],
                     cells: list[tuple[bytes | str, ...]], schema: list[Field],
                     image_column: str) -> tuple[list[int], list[int], list[tuple[str, str]]]:
        """Every path of every row inside the root (else a :class:`UsageError`, before any file is opened), and
        each a regular file: the rows kept, each row's image size, and the rows skipped with why."""
        dense = [(k, f.name) for k, f in enumerate(extra_fields(schema)) if f.dense]
        kept, sizes, errors = [], [], []
        for i, line in enumerate(lines):
            problem = None
            size = 0
            for column, cell in [(image_column, paths[i])] + [(name, str(cells[i][k])) for k, name in dense]:
                try:
                    found = self.paths_root.file_size(self.paths_root.resolve(cell))
                except Outside:
                    raise UsageError(f"{self.table} line {line}, column {column!r}: {cell!r} is outside --root "
                                     f"{self.image_root} (the folder the table's paths are in); move the file "
                                     "inside it, or pass --root with a folder that holds every file (--root / "
                                     "accepts any path)") from None
                if isinstance(found, str):
                    problem = problem or f"line {line}, column {column!r}: {cell}: {found}"
                elif column == image_column:
                    size = found
            if problem:
                errors.append((relpaths[i], problem))
            else:
                kept.append(i)
            sizes.append(size)
        if not kept:
            raise SourceError(f"{self.table}: no row names an image that can be read ({errors[0][1]}); nothing to "
                              "pack")
        return kept, sizes, errors

    def _mask_pixels(self, field: Field, pixels_given: set[str], cells: list[tuple[bytes | str, ...]],
                     lines: list[int], kept: list[int]) -> Field:
        """A mask column's pixel type: as ``--field NAME:mask[uint16]`` gives it, else its first readable mask
        file's. A first mask that is no mask (a float or colour image) refuses the column; one that cannot be read
        is left for its row to be skipped."""
        if field.kind != "mask" or field.name in pixels_given:
            return field
        k = next(k for k, f in enumerate(extra_fields(self.schema)) if f.name == field.name)
        for i in kept:
            cell = str(cells[i][k])
            try:
                mode = mask_mode(self.paths_root.resolve(cell), cell)
            except (ImageError, Outside):
                continue
            if mode not in MASK_MODES:
                raise UsageError(f"{self.table} line {lines[i]}, column {field.name!r}: {cell}: {not_a_mask(mode)}")
            return Field(field.name, "mask", (), MASK_MODES[mode])
        return field

    # -- the Source interface ------------------------------------------------------------------------------------
    def sizes(self) -> np.ndarray:
        return self._sizes

    def fingerprint(self) -> str:
        h = hashlib.sha256(str(self.image_root.resolve()).encode())
        with open(self.table, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    def reader(self) -> SampleReader:
        return TableReader(self.paths_root, self.schema, self.paths, self.labels, self.cells)

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

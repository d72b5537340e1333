"""A table's cells as typed values: each column's field inferred once from all its cells, then every cell checked
against that field before anything is written, so that a cell that does not fit is named and the column never
changes type on its account.

A CSV or TSV cell is text, parsed by the column's type; a JSON Lines cell is a JSON value, typed by its JSON type
(a JSON string is text even when it holds digits). The rules (the README's "Annotation tables" section):

- integers (``int64``): every cell an integer; one outside int64 is an error, not a reason to make the column
  float;
- numbers (``float32``): every cell a number, NaN and +-Infinity included (float32 holds them); a finite number
  beyond float32's range is an error;
- JSON lists of numbers (``int64``/``float32`` vectors): of fixed length ``[n]``, n the first row's count, a row of
  another count being an error that says how to ask for lists of any length (``--field NAME:TYPE[]``); a column
  holding an empty list is of any length;
- JSON objects and other JSON (``json``), and in JSON Lines any column whose cells mix JSON types: stored as
  JSON, every value exact; NaN, Infinity, nesting deeper than :data:`MAX_JSON_DEPTH` and repeated keys are
  errors (JSON cannot hold them, or would lose one);
- image paths (a second ``image``, a ``mask`` by name); anything else ``text``.

Class labels (:func:`class_labels`): names (strings, sorted into classes as ImageFolder does) or indices (integers
from 0 to :data:`packer.fields.MAX_CLASSES` - 1); a JSON ``true``, a number with a fraction, or a digit that is
not ASCII (``²``) is an error naming its line.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..fields import MAX_CLASSES, NUMERIC, Field

MAX_JSON_DEPTH = 100  # JSON values nest at most this deep: every reader parses them back, in any thread
MAX_INT_DIGITS = 4000  # within Python's int/str conversion limit (4300), so that every reader parses them back
INT64_RANGE = (-(2**63), 2**63 - 1)
FLOAT32_MAX = float(np.finfo(np.float32).max)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_INT = re.compile(r"[+-]?[0-9]+\Z")  # ASCII digits only: int() also takes '²'-like and other scripts' digits
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|nan|inf|infinity)\Z", re.IGNORECASE)


def is_empty(cell: object) -> bool:
    """An empty CSV cell, or a JSON ``null`` or missing key."""
    return cell is None or cell == ""


def _int_text(cell: object, text: bool) -> str | None:
    """The digits of an integer cell (of any size), or None: a JSON integer, or a text cell of ASCII digits."""
    if isinstance(cell, bool):
        return None
    if isinstance(cell, int):
        return str(cell)
    if text and isinstance(cell, str) and _INT.match(cell.strip()):
        return cell.strip()
    return None


def _is_float(cell: object, text: bool) -> bool:
    if isinstance(cell, bool):
        return False
    if isinstance(cell, (int, float)):
        return True
    return text and isinstance(cell, str) and bool(_FLOAT.match(cell.strip()))


def to_int64(cell: object, text: bool = True) -> int:
    """An integer cell's value; ValueError saying why when it is not an integer or not within int64."""
    digits = _int_text(cell, text)
    if digits is None:
        raise ValueError(f"{_shown(cell)} is not an integer")
    if len(digits.lstrip("+-")) > 19 or not INT64_RANGE[0] <= int(digits) <= INT64_RANGE[1]:
        raise ValueError(f"{_shown(cell)} is outside int64 (-2**63 to 2**63-1)")
    return int(digits)


def to_float32(cell: object, text: bool = True) -> float:
    """A number cell's value (NaN and +-Infinity included); ValueError when it is not a number or is finite and
    beyond float32's range."""
    if not _is_float(cell, text):
        raise ValueError(f"{_shown(cell)} is not a number")
    digits = _int_text(cell, text)
    if digits is not None and len(digits.lstrip("+-")) > 39:  # float() of a huge integer overflows
        raise ValueError(f"{_shown(cell)} is beyond float32's range (+-3.4e38)")
    value = float(cell)  # type: ignore[arg-type]
    if math.isfinite(value) and abs(value) > FLOAT32_MAX:
        raise ValueError(f"{_shown(cell)} is beyond float32's range (+-3.4e38)")
    return value


def _shown(cell: object, limit: int = 40) -> str:
    """A cell as messages quote it: its repr, cut to ``limit`` characters (a cell may hold a megabyte)."""
    text = repr(cell) if isinstance(cell, str) else _dumps(cell)
    return text if len(text) <= limit else f"{text[:limit - 12]}...({len(text)} characters)"


def _dumps(value: object) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return repr(value)


# -- JSON --------------------------------------------------------------------------------------------------------
def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {_shown(key)} appears twice in one object")
        out[key] = value
    return out


def _json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def loads(text: str | bytes) -> Any:
    """JSON text parsed, refusing repeated keys and integers of more than :data:`MAX_INT_DIGITS` digits; NaN and
    Infinity are read (a float32 takes them; :func:`check_json` refuses them in a JSON field). ValueError,
    saying why, also for nesting too deep to parse."""
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_int=_json_int)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None


def check_json(value: Any) -> None:
    """ValueError unless ``value`` is storable JSON: no NaN or Infinity, at most :data:`MAX_JSON_DEPTH` levels,
    strings that are valid Unicode (no lone surrogates)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{item} is not JSON (JSON has no NaN or Infinity)")
        if isinstance(item, str):
            check_text(item)
        elif isinstance(item, dict):
            stack += [(k, depth) for k in item] + [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]


def check_text(text: str) -> None:
    """ValueError when ``text`` cannot be written as UTF-8 (a lone surrogate, from a JSON ``\\ud800`` escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{_shown(text)} is not valid Unicode (a lone surrogate)") from None


def _json_cell(cell: object, text: bool) -> object:
    """A cell's JSON value if it is a JSON list or object (a CSV cell's text parsed), else None."""
    if isinstance(cell, (list, dict)):
        return cell
    if text and isinstance(cell, str) and cell[:1] in ("[", "{"):
        try:
            return loads(cell)
        except ValueError:
            return None
    return None


# -- columns -----------------------------------------------------------------------------------------------------
def _number_list(value: object) -> bool:
    return isinstance(value, list) and all(_is_float(v, False) for v in value)


def infer_field(name: str, cells: Sequence[object], text: bool = True) -> Field:
    """The field a table column's cells fit (see the module's rules); ``text``: CSV cells (text), else JSON Lines
    values. Empty cells are left out here and reported by the table source."""
    present = [c for c in cells if not is_empty(c)]
    if not present:
        return Field(name, "text")
    if all(_int_text(c, text) is not None for c in present):
        return Field(name, "int64")
    if all(_is_float(c, text) for c in present):
        return Field(name, "float32")
    parsed = [_json_cell(c, text) for c in present]
    if all(p is not None for p in parsed):
        if all(_number_list(p) for p in parsed) and any(parsed):
            lists: list[list] = parsed  # type: ignore[assignment]
            kind = "int64" if all(_int_text(v, False) is not None for p in lists for v in p) else "float32"
            return Field(name, kind, None if any(not p for p in lists) else (len(lists[0]),))
        return Field(name, "json")
    strings = [c for c in present if isinstance(c, str)]
    if len(strings) == len(present):
        if all(c.lower().endswith(IMAGE_SUFFIXES) for c in strings):
            return Field(name, "image")
        return Field(name, "text")
    return Field(name, "json")  # JSON Lines values of several JSON types: kept as JSON, each value exact


def cell_value(field: Field, cell: object, text: bool = True) -> Any:
    """A table cell as its field's value; ValueError saying why when it does not fit the field's type.
    ``text``: the cell is a CSV cell's text (numbers and JSON are parsed from it), not a JSON Lines value."""
    if is_empty(cell):
        raise ValueError("the cell is empty")
    if field.kind in NUMERIC:
        convert = to_int64 if field.kind == "int64" else to_float32
        if field.shape == ():
            return convert(cell, text)
        value = _parsed(cell) if text and isinstance(cell, str) else cell
        if not isinstance(value, list):
            raise ValueError(f"{_shown(cell)} is not a JSON list of "
                             f"{'integers' if field.kind == 'int64' else 'numbers'}")
        numbers = [convert(v, False) for v in value]
        if field.shape is not None and len(numbers) != field.shape[0]:
            raise ValueError(f"{len(numbers)} values where the column holds {field.shape[0]} (the first row's "
                             f"count); fix the row, or pass --field {field.name}:{field.kind}[] for lists of any "
                             "length")
        return numbers
    if field.kind == "json":
        value = _parsed(cell) if text and isinstance(cell, str) else cell
        check_json(value)
        return value
    if field.kind in ("image", "mask"):
        if not isinstance(cell, str):
            raise ValueError(f"{_shown(cell)} is not a file path")
        check_text(cell)
        return cell
    if isinstance(cell, str):
        check_text(cell)
        return cell
    check_json(cell)
    return json.dumps(cell, ensure_ascii=False, sort_keys=True)  # a JSON value forced to text: its JSON text


def _parsed(cell: str) -> Any:
    try:
        return loads(cell)
    except ValueError as exc:
        raise ValueError(f"{_shown(cell)} is not JSON ({exc})") from None


# -- class labels ------------------------------------------------------------------------------------------------
def class_labels(cells: Sequence[tuple[int, object]], text: bool) -> tuple[list[int], list[str]]:
    """Class indices and class names of a label column's ``(line, cell)`` pairs: every cell an integer
    (indices, 0 to :data:`MAX_CLASSES` - 1, kept: the classes are '0'...'max'), else names (strings, sorted).

    Raises:
        LabelError: a cell that is neither, naming its line.
    """
    for line, cell in cells:
        if is_empty(cell):
            raise LabelError(line, "no label; fill or drop the row")
        if not isinstance(cell, (str, int)) or isinstance(cell, bool):
            raise LabelError(line, f"label {_shown(cell)} is not a class name (text) or index (an integer)")
    digits = [_int_text(c, True) for _, c in cells]
    if all(d is not None for d in digits):
        indices = []
        for (line, cell), d in zip(cells, digits, strict=True):
            if d.startswith("-") and d.strip("-0"):  # type: ignore[union-attr]
                raise LabelError(line, f"label {_shown(cell)} is negative; class indices are 0, 1, 2...")
            if len(d.lstrip("+-").lstrip("0")) > 6 or int(d) >= MAX_CLASSES:  # type: ignore[union-attr,arg-type]
                raise LabelError(line, f"label {_shown(cell)} is beyond the largest class index packer keeps "
                                       f"({MAX_CLASSES - 1:,}); number the classes from 0")
            indices.append(int(d))  # type: ignore[arg-type]
        return indices, [str(i) for i in range(max(indices) + 1)]
    for line, cell in cells:
        if isinstance(cell, str) and cell.strip().isnumeric():  # '²', '٣': digits, but not an index's
            raise LabelError(line, f"label {_shown(cell)} looks like a number but is not an integer of the digits "
                                   "0-9; write class indices as 0, 1, 2... or class names as text")
    if not text:  # JSON Lines: integers and strings in one column are two kinds of label
        kinds = [isinstance(c, int) for _, c in cells]
        if any(kinds):
            line, cell = next(pair for pair, is_int in zip(cells, kinds, strict=True) if is_int != kinds[0])
            raise LabelError(line, f"label {_shown(cell)} is {'an index' if not kinds[0] else 'a name'} where the "
                                   "first row's is not; a label column holds class names or class indices")
    names = [str(c) for _, c in cells]
    for (line, _), name in zip(cells, names, strict=True):
        try:
            check_text(name)
        except ValueError as exc:
            raise LabelError(line, str(exc)) from None
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    return [index[n] for n in names], classes


class LabelError(ValueError):
    """A label cell that is no class: its line and why."""

    def __init__(self, line: int, reason: str):
        super().__init__(reason)
        self.line = line

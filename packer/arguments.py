"""Checks of public arguments, made where they are passed, and the words messages use for them.

Each check raises :class:`~packer.errors.UsageError` (a ``ValueError``) in one line that names the argument, so
that a bad value fails at the call and not at the first batch. :func:`spelled` names an option in the words of
the interface in use: ``overwrite=True`` from Python, ``--overwrite`` from the command line (which calls
:func:`command_line`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from numbers import Real
from typing import Any

from .errors import UsageError

INT64_MAX = 2**63 - 1
# ratio limits beyond which a random resized crop's window has no pixel on one side, or its area overflows
RATIO_LIMITS = (1e-6, 1e6)

_COMMAND_LINE: ContextVar[bool] = ContextVar("packer_command_line", default=False)
_NAMES: ContextVar[dict[str, str]] = ContextVar("packer_names", default={})  # noqa: B039 (never mutated)


@contextmanager
def command_line() -> Iterator[None]:
    """Within it :func:`spelled` uses flags (``--overwrite``): the ``packer`` command runs in it."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


@contextmanager
def shown_as(path: str | os.PathLike, name: str) -> Iterator[None]:
    """Within it, messages about ``path`` (an internal folder, such as a URL's staging folder) name it ``name``,
    what the caller gave (:func:`shown`)."""
    token = _NAMES.set({**_NAMES.get(), os.fspath(path): name})
    try:
        yield
    finally:
        _NAMES.reset(token)


def shown(path: str | os.PathLike) -> str:
    """How messages name ``path``: as the caller gave it, or the name :func:`shown_as` set."""
    return _NAMES.get().get(os.fspath(path), os.fspath(path))


def spelled(name: str, value: Any = True) -> str:
    """How the caller spells option ``name`` set to ``value``: ``--name`` (``--no-name`` for False, ``--name V``)
    on the command line, ``name=value`` from Python."""
    if not _COMMAND_LINE.get():
        return f"{name}={value!r}"
    flag = "--" + name.replace("_", "-")
    if value is True:
        return flag
    if value is False:
        return "--no-" + flag[2:]
    return f"{flag} {value}"


def is_int(value: Any) -> bool:
    """An int and not a bool (``True`` is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(name: str, value: Any, least: int, most: int = INT64_MAX) -> int:
    """``value`` if it is an int from ``least`` to ``most``, else a one-line error naming ``name``."""
    if not is_int(value) or not least <= value <= most:
        bound = f"from {least} to {most}" if most != INT64_MAX else f"of at least {least}"
        raise UsageError(f"{name} must be an int {bound}, not {value!r}")
    return value


def optional_int(name: str, value: Any, least: int) -> int | None:
    """:func:`int_at_least`, with None allowed (a default chosen later)."""
    return None if value is None else int_at_least(name, value, least)


def seed(name: str, value: Any) -> int:
    """A seed: an int from 0 to 2**63-1 (what torch's and numpy's generators take)."""
    return int_at_least(name, value, 0)


def flag(name: str, value: Any) -> bool:
    """A bool (numpy's too), else a one-line error naming ``name``."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise UsageError(f"{name} must be True or False, not {value!r}")
    return bool(value)


def number_range(name: str, value: Any, lowest: float = 0.0, highest: float = math.inf) -> tuple[float, float]:
    """A ``(min, max)`` pair of finite numbers with ``lowest < min <= max <= highest``, as floats."""
    if (isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2
            or not all(isinstance(v, Real) and not isinstance(v, bool) for v in value)):
        raise UsageError(f"{name} must be two numbers (min, max), not {value!r}")
    low, high = float(value[0]), float(value[1])
    if not (math.isfinite(low) and math.isfinite(high) and lowest < low <= high <= highest):
        limits = f"above {lowest:g}" + (f" and at most {highest:g}" if highest != math.inf else "")
        raise UsageError(f"{name} must be finite numbers {limits} with min <= max (scale and ratio are (min, max) "
                         f"ranges, as in torchvision), not {value!r}")
    return low, high


def crop_scale(value: Any) -> tuple[float, float]:
    """``random_resized_crop``'s ``scale``: the window's area as a fraction of the image's, ``0 < min <= max``."""
    return number_range("scale", value, 0.0, 1e6)


def crop_ratio(value: Any) -> tuple[float, float]:
    """``random_resized_crop``'s ``ratio``: the window's width / height, within :data:`RATIO_LIMITS`."""
    low, high = number_range("ratio", value, 0.0)
    if low < RATIO_LIMITS[0] or high > RATIO_LIMITS[1]:
        raise UsageError(f"ratio must lie within {RATIO_LIMITS[0]:g} and {RATIO_LIMITS[1]:g} (a window of no "
                         f"pixel on one side otherwise), not {value!r}")
    return low, high


SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
              "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | str | None) -> int | None:
    """A positive number of bytes, given as an int or a string such as ``"256MB"`` or ``"10GiB"``; None stays
    None. Anything else is a :class:`UsageError` (a ValueError)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in SIZE_UNITS:
            raise UsageError(f"{value!r} is not a size like 256MB")
        size = int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
    if size < 1:
        raise UsageError(f"{value!r} is not a positive size; give one like 256MB")
    return size

"""The errors packer raises, and its warnings. Every error carries a one-line message that names the file and says
what to do."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sized
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


def warn(message: str) -> None:
    """One line on stderr; warnings print even with --quiet, on their own line above any progress bar."""
    from tqdm import tqdm

    tqdm.write(f"packer: warning: {message}", file=sys.stderr)
    sys.stderr.flush()


class PackerError(Exception):
    """Base class: the CLI prints ``str(error)`` on one line and exits non-zero, with no traceback."""

    exit_code = 1


class UsageError(PackerError, ValueError):
    """Bad input: an option value, or options that do not go together (exit 2). A ValueError too, as Python
    callers of :func:`packer.pack` have always caught it."""

    exit_code = 2


class SourceError(PackerError):
    """The source folder is missing, empty, or not an image folder."""

    exit_code = 2


class NothingPackedError(SourceError):
    """Not one source image could be read, so there is no dataset to write."""


class ImageError(PackerError):
    """One source image could not be read or decoded."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self):  # workers send it to the main process: rebuild it from both arguments
        return type(self), (self.path, self.reason)


class DestinationError(PackerError):
    """The destination exists and is not empty, or cannot be written."""

    exit_code = 2


class DestinationBusyError(PackerError):
    """Another packer process holds the lock on the destination: it is being written."""


class IncompleteDatasetError(PackerError):
    """The destination has no manifest: its conversion did not finish."""


class ManifestError(PackerError):
    """The manifest is malformed, or from a newer packer."""


class CorruptDataError(PackerError):
    """A packed data file or record does not match what the manifest says."""


class UrlError(PackerError):
    """A URL that cannot be understood (unknown scheme, a mangled ``s3:/...``), or remote storage that refuses
    access: nothing local is written in its place."""

    exit_code = 2


class RemoteError(PackerError):
    """Remote storage failed after retries, or served an object that does not match the manifest."""


class Crossed:
    """A :class:`PackerError` raised in a DataLoader worker process, handed to the main process in place of a
    batch, so that it is raised there as itself, in one line (torch would re-raise it as a new error of the same
    class whose message is "Caught ... in DataLoader worker process 0" and the worker's whole traceback)."""

    __slots__ = ("error",)

    def __init__(self, error: PackerError):
        self.error = error

    def __reduce__(self):
        return Crossed, (self.error,)


def carried(iterator: Iterator[T]) -> Iterator[T | Crossed]:
    """``iterator``'s items; a :class:`PackerError` it raises becomes a last :class:`Crossed` item (in a worker)."""
    try:
        yield from iterator
    except PackerError as exc:
        yield Crossed(exc)


class uncrossed(Generic[T]):  # noqa: N801 - used as a function
    """``iterator``'s items, raising the error of a :class:`Crossed` one (in the main process). Anything else
    (``len``, the iterator's attributes) is the wrapped iterator's."""

    def __init__(self, iterator: Iterator[T | Crossed]):
        self.iterator = iterator

    def __iter__(self) -> uncrossed[T]:
        return self

    def __next__(self) -> T:
        item = next(self.iterator)
        if isinstance(item, Crossed):
            raise item.error
        return item

    def __len__(self) -> int:
        return len(cast(Sized, self.iterator))  # asked only of a sized iterator (a DataLoader's); else TypeError

    def __getattr__(self, name: str) -> Any:
        if name == "iterator":
            raise AttributeError(name)
        return getattr(self.iterator, name)

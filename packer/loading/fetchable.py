"""A data file that is read where it lies (a ``Path``) or fetched first (a :class:`Fetchable`).

URLs are resolved at the public entry points (:func:`packer.stream` makes one :class:`Fetchable` per remote
shard, see :class:`packer.remote.resolve.RemoteFile`); below them, code that reads a file sequentially asks
:func:`fetched` for a local path and never learns where the bytes came from."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Fetchable(Protocol):
    """A file whose local copy exists only while :meth:`local` is entered; ``str()`` is what messages name (a
    remote file's URL). It must be picklable: DataLoader workers fetch with their own."""

    def local(self) -> AbstractContextManager[Path]:
        """A context whose value is the local copy's path, held until the context is left."""
        ...


@contextlib.contextmanager
def fetched(file: Path | Fetchable) -> Iterator[Path]:
    """A local path for ``file``: itself, or a :class:`Fetchable`'s local copy, held while inside."""
    if isinstance(file, Fetchable):
        with file.local() as path:
            yield path
    else:
        yield file

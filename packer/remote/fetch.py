"""Reading remote bytes with retries: whole small objects (a manifest), or a data file in ranged chunks checked
against the size and sha256 its manifest records."""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import PackerError, RemoteError
from .fs import is_transient, storage_error

CHUNK = 64 << 20  # bytes per ranged GET: few requests per file, bounded memory
T = TypeVar("T")
STATS = {"requests": 0, "bytes": 0}  # this process's reads, for packer bench


def _cat(fs: Any, url: str, start: int | None = None, end: int | None = None) -> bytes:
    """One GET (ranged when ``start`` is given), counted."""
    STATS["requests"] += 1
    data = fs.cat_file(url, start=start, end=end)
    STATS["bytes"] += len(data)
    return data


def attempts() -> int:
    return max(1, int(os.environ.get("PACKER_RETRIES", "5")))


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (1, 2...): exponential with jitter, capped."""
    base = float(os.environ.get("PACKER_RETRY_BACKOFF", "0.2"))
    return min(base * 2 ** (attempt - 1), 10.0) * (0.5 + random.random())


def retrying(call: Callable[[], T], url: str, what: str = "read") -> T:
    """``call()``, retried with backoff on transient failures; any other failure, or the last one, is one line."""
    tries = attempts()
    for attempt in range(1, tries + 1):
        try:
            return call()
        except PackerError:
            raise
        except Exception as exc:  # noqa: BLE001 - every storage library raises its own kinds
            if attempt == tries or not is_transient(exc):
                error = storage_error(exc, url, what)
                if is_transient(exc):
                    error = RemoteError(f"{error} (after {tries} attempts)")
                raise error from None
            time.sleep(backoff(attempt))
    raise AssertionError("unreachable")


def read_bytes(fs: Any, url: str) -> bytes:
    """The whole (small) object at ``url``."""
    return retrying(lambda: _cat(fs, url), url)


def download(fs: Any, url: str, target: Path, size: int, sha256: str) -> None:
    """Write the object at ``url`` into ``target`` (a reserved file, overwritten) and check it against ``size``
    and ``sha256``. Transport failures are retried; a mismatch (or a short object) is fetched once more, then a
    :class:`RemoteError` naming the URL: wrong bytes are never kept."""
    for attempt in (1, 2):
        digest, got = hashlib.sha256(), 0
        with open(target, "r+b" if target.exists() else "wb") as f:
            for start in range(0, size, CHUNK):
                end = min(start + CHUNK, size)
                data = retrying(lambda s=start, e=end: _cat(fs, url, s, e), url)
                digest.update(data)
                f.write(data)
                got += len(data)
                if len(data) != end - start:  # the object is shorter than the manifest says
                    break
            f.truncate(got)
        if got == size and digest.hexdigest() == sha256:
            return
        if attempt == 2:
            what = (f"has {got} of the {size} bytes the manifest says" if got != size
                    else "has a sha256 that differs from the manifest's")
            raise RemoteError(f"{url}: {what} (fetched twice); the remote object is damaged or was replaced: "
                              "re-pack or re-upload the dataset")

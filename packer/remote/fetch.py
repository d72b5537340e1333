"""Reading remote bytes with retries: whole small objects (a manifest), or a data file in ranged chunks checked
against the size and sha256 its manifest records."""

from __future__ import annotations

import functools
import hashlib
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import PackerError, RemoteError
from .fs import is_transient, storage_error
from .presigned import can_get_plainly, can_presign, plain_range, presigned_range

CHUNK = 64 << 20  # bytes per ranged GET: few requests per file, bounded memory
T = TypeVar("T")
STATS = {"requests": 0, "bytes": 0}  # this process's reads, for packer bench


def _is_http(fs: Any) -> bool:
    return any(p in ("http", "https") for p in ([fs.protocol] if isinstance(fs.protocol, str) else fs.protocol))


def _stream(fs: Any, url: str, start: int | None, limit: int) -> bytes:
    """An HTTP GET (ranged from ``start``) read as a stream, at most ``limit + 1`` bytes whatever the server
    says or sends: ``cat_file`` reads a whole body into memory, however long."""
    headers = {"Range": f"bytes={start}-{start + limit - 1}"} if start is not None else {}
    with fs.open(url, "rb", block_size=0, size=limit or 1, headers=headers) as f:
        status = getattr(f.r, "status", 206)
        if start and status != 206:
            raise RemoteError(f"{url}: the server ignored a Range request (HTTP {status}); serve the dataset "
                              "from storage that supports ranged reads")
        if start is not None and status != 206:
            limit -= 1  # the whole object from its start: its first ``limit`` bytes are the range asked for
        parts, got = [], 0
        while got <= limit:
            block = f.read(min(1 << 20, limit + 1 - got))
            if not block:
                break
            parts.append(block)
            got += len(block)
    return b"".join(parts)


def _cat(fs: Any, url: str, start: int | None = None, end: int | None = None, limit: int | None = None) -> bytes:
    """One GET (ranged when ``start`` is given), counted; never more than ``end - start`` (or ``limit``) bytes
    plus one are read into memory, so a longer answer is seen as one without growing past it. An S3 range goes
    through its presigned URL, an HTTP(S) range through the URL itself, on this process's kept-alive connections
    (:mod:`.presigned`) where they can, and through ``fs`` when that does not answer it."""
    STATS["requests"] += 1
    data = _fetch(fs, url, start, end, limit)
    STATS["bytes"] += len(data)
    return data


def _fetch(fs: Any, url: str, start: int | None, end: int | None, limit: int | None) -> bytes:
    if start is not None and end is not None:
        direct = presigned_range if can_presign(fs) else plain_range if can_get_plainly(fs) else None
        if direct is not None:
            data = direct(fs, url, start, end)
            if data is not None:
                return data
            STATS["requests"] += 1  # read again through fs
    most = (end - start) if start is not None and end is not None else limit
    if most is not None and _is_http(fs):
        return _stream(fs, url, start, most)
    if start is None and limit is not None:
        return fs.cat_file(url, start=0, end=limit + 1)
    return fs.cat_file(url, start=start, end=end)


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


def read_bytes(fs: Any, url: str, limit: int | None = None) -> bytes:
    """The whole (small) object at ``url``; with ``limit``, one larger than that is a :class:`RemoteError`
    (from its stated size when the storage gives one, else after ``limit + 1`` bytes), never read whole."""
    if limit is None:
        return retrying(lambda: _cat(fs, url), url)
    size = retrying(lambda: fs.size(url), url)
    data = b"" if size is not None and size > limit else retrying(lambda: _cat(fs, url, limit=limit), url)
    if (size is not None and size > limit) or len(data) > limit:
        said = f"{size:,} bytes" if size is not None and size > limit else f"over {limit:,} bytes"
        raise RemoteError(f"{url}: {said}, over the {limit:,}-byte limit on manifests and indexes; the remote "
                          "object is not a packer manifest (or raise PACKER_MAX_MANIFEST_BYTES)")
    return data


def download(fs: Any, url: str, target: Path, size: int, sha256: str) -> None:
    """Write the object at ``url`` into ``target`` (a reserved file, overwritten) and check it against ``size``
    and ``sha256``. Transport failures are retried; a mismatch (or a short object) is fetched once more, then a
    :class:`RemoteError` naming the URL: wrong bytes are never kept."""
    for attempt in (1, 2):
        digest, got = hashlib.sha256(), 0
        with open(target, "r+b" if target.exists() else "wb") as f:
            for start in range(0, size, CHUNK):
                end = min(start + CHUNK, size)
                data = retrying(functools.partial(_cat, fs, url, start, end), url)
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

"""fsspec filesystems, made lazily in each process, and storage errors as one line saying what to set.

fsspec's async filesystems (s3fs, HTTP) hold an event loop and connections that do not survive a fork (fsspec
#835, s3fs #914), so a filesystem is keyed by the process id: a DataLoader worker makes its own on first use."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from ..errors import PackerError, RemoteError, UrlError
from ..install_hints import pip_hint

_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}
_LOCK = threading.Lock()


def _new_lock() -> None:
    """In a forked child: a lock of its own (a thread of the parent may have held this one as it forked)."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}


def _options(protocol: str, storage_options: dict | None) -> dict:
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        # botocore reads AWS_ENDPOINT_URL itself in recent versions; passed explicitly so that every version does
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get("client_kwargs", {}):
            options["endpoint_url"] = endpoint
    return options


def filesystem(protocol: str, storage_options: dict | None = None) -> Any:
    """This process's fsspec filesystem for ``protocol`` with ``storage_options`` (S3 settings also come from
    the standard ``AWS_*`` variables).

    Raises:
        UrlError: the package that implements ``protocol`` is not installed (it says which extra to install).
    """
    options = _options(protocol, storage_options)
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=repr))
    with _LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            import fsspec

            try:
                fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
            except ImportError as exc:
                extra = _EXTRAS.get(protocol)
                hint = pip_hint(extra) if extra else "install the fsspec package for it"
                raise UrlError(f"{protocol}:// needs a package that is not installed ({exc}); {hint}") from None
            _FILESYSTEMS[key] = fs
    return fs


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def unreachable(exc: BaseException) -> BaseException | None:
    """The connection failure behind ``exc`` (refused, reset, a name that does not resolve, a timeout), if that is
    what it is: fsspec's HTTP filesystem reports a request that never reached a server as ``FileNotFoundError``,
    the failure as its cause. None for an answer from a server (a 404 is a status in the chain)."""
    seen: BaseException | None = exc
    while seen is not None:
        if _status(seen) is not None:
            return None
        names = " ".join(c.__name__ for c in type(seen).__mro__)
        if isinstance(seen, (ConnectionError, TimeoutError)) or "Connector" in names or "gaierror" in names:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help: 500/502/503/504, 408/429, connection resets, timeouts, bodies cut short, a
    server that could not be reached."""
    if unreachable(exc) is not None:
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return False
    status = _status(exc)
    if status is not None:
        return status in (408, 429, 500, 502, 503, 504)  # not 501: the server will never do it
    names = " ".join(c.__name__ for c in type(exc).__mro__)
    return isinstance(exc, (OSError, TimeoutError)) or any(
        word in names for word in ("Timeout", "Connection", "Payload", "ClientError"))


def storage_error(exc: BaseException, url: str, what: str = "read") -> PackerError:
    """A storage failure as one line that names ``url`` and says what to set or do."""
    name = type(exc).__name__
    status = _status(exc)
    text = " ".join(str(exc).split())[:200]
    if name in ("NoCredentialsError", "PartialCredentialsError") or "credentials" in text.lower():
        return UrlError(f"{url}: no credentials for this storage; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                        "(or AWS_PROFILE), or pass storage_options={'key': ..., 'secret': ...}")
    if isinstance(exc, PermissionError) or status in (401, 403):
        return UrlError(f"{url}: access denied (403) to {what}; check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                        "AWS_PROFILE (and AWS_ENDPOINT_URL for an S3-compatible store), and the bucket's policy")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return UrlError(f"{url}: no such bucket; create it, or check the URL (and AWS_ENDPOINT_URL)")
    cause = unreachable(exc)
    if cause is not None:
        why = " ".join(str(cause).split())[:200] or type(cause).__name__
        return RemoteError(f"{url}: cannot connect ({type(cause).__name__}: {why}); check the URL and the network, "
                           "and that the server is up, then retry")
    if isinstance(exc, FileNotFoundError) or status == 404:
        return UrlError(f"{url}: not found; check the bucket and path")
    return PackerError(f"{url}: cannot {what} ({name}: {text}); check the network and the storage, then retry")

"""Ranged GETs of S3 objects through presigned URLs and a urllib3 connection pool: the cheap path for the many
small ranges a dataset read a block at a time fetches.

s3fs's own ranged read goes through aiobotocore (request signing, event hooks, response parsing) and hops to its
event-loop thread and back: it costs a few times the CPU of a plain HTTP GET of the same range, spent in the
process that also feeds the GPU (``benchmarks/peers/remote_peers.py`` measures the difference). Here an object's
URL is presigned once by s3fs itself (``fs.url``: the same credentials, endpoint and addressing as its reads) and
re-signed well before it expires; each range is then one GET on a pooled connection. (botocore presigns with
SigV2 in the regions that accept it, SigV4 elsewhere; a bucket that refuses the URL answers 403, and the reads
go through s3fs.)

s3fs stays the authority: this path is taken only for options it reproduces exactly (credentials, endpoint,
anonymous access; no proxy, no other client or request settings), and any answer other than the range asked for
(an error status, a connection failure, a server that ignores Range) returns None, for the caller to read the
range through s3fs, whose retries and errors then apply. After a few failures that retrying would not mend (a
status other than 5xx) the path is off for that filesystem in that process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

EXPIRES = 3600  # seconds a presigned URL is valid; re-signed after half of that
FAILURES = 3  # failed GETs after which a filesystem's reads go through s3fs alone, in this process
TIMEOUT = 60.0  # seconds to connect and between reads: botocore's defaults
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_PLAIN_OPTIONS = {"endpoint_url", "key", "secret", "token", "anon", "profile", "skip_instance_cache"}
_PLAIN_CLIENT_KWARGS = {"endpoint_url", "region_name"}

_LOCK = threading.Lock()
# (the filesystem's options, url) -> (signed at, presigned URL): a forked DataLoader worker inherits them, and
# reads those objects without making a filesystem of its own (aiobotocore's client costs a reader's first GET
# about 0.1 s of CPU)
_SIGNED: dict[tuple[str, str], tuple[float, str]] = {}
_FAILED: dict[tuple[int, str], int] = {}  # (pid, the filesystem's options) -> failed GETs
_POOLS: dict[int, Any] = {}  # pid -> urllib3.PoolManager


def _new_lock() -> None:
    """In a forked child: a lock of its own (a thread of the parent may have held this one as it forked)."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)


def _options(fs: Any) -> str:
    return json.dumps(getattr(fs, "storage_options", {}) or {}, sort_keys=True, default=repr)


def can_presign(fs: Any) -> bool:
    """Whether ranges of ``fs``'s objects may be read through presigned URLs: an S3 filesystem with plain options
    (see the module's docstring), no proxy set, urllib3 importable and fewer than ``FAILURES`` failures so far."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if not {"s3", "s3a"} & set(protocols) or not callable(getattr(fs, "url", None)):
        return False
    options = getattr(fs, "storage_options", {}) or {}
    client = options.get("client_kwargs") or {}
    if set(options) - _PLAIN_OPTIONS - {"client_kwargs"} or set(client) - _PLAIN_CLIENT_KWARGS:
        return False
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return False
    if _FAILED.get((os.getpid(), _options(fs)), 0) >= FAILURES:
        return False
    try:
        import urllib3  # noqa: F401 - botocore's own dependency: present wherever s3fs is
    except ImportError:
        return False
    return True


def _pool() -> Any:
    import urllib3

    with _LOCK:
        pool = _POOLS.get(os.getpid())
        if pool is None:
            from botocore.httpsession import get_cert_path

            bundle = os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)
            pool = _POOLS[os.getpid()] = urllib3.PoolManager(
                maxsize=16, cert_reqs="CERT_REQUIRED", ca_certs=bundle, retries=False,
                timeout=urllib3.Timeout(connect=TIMEOUT, read=TIMEOUT))
    return pool


def _presigned(fs: Any, url: str) -> str:
    key = (_options(fs), url)
    with _LOCK:
        found = _SIGNED.get(key)
    if found is not None and time.monotonic() - found[0] < EXPIRES / 2:
        return found[1]
    signed = fs.url(url, expires=EXPIRES)
    with _LOCK:
        _SIGNED[key] = (time.monotonic(), signed)
    return signed


def _failed(fs: Any, url: str, counted: bool = True) -> None:
    """Forget ``url``'s presigned URL (it may have expired early: re-signed next time); ``counted``: a failure
    retrying will not mend (a status other than 5xx), toward ``FAILURES``."""
    with _LOCK:
        _SIGNED.pop((_options(fs), url), None)
        if counted:
            key = (os.getpid(), _options(fs))
            _FAILED[key] = _FAILED.get(key, 0) + 1


def presigned_range(fs: Any, url: str, start: int, end: int) -> bytes | None:
    """Bytes ``[start, end)`` of the S3 object ``url`` (``s3://bucket/key``) through its presigned URL, or None
    when the GET did not answer exactly that range (the caller reads it through ``fs``). Call only where
    :func:`can_presign`. Never reads more than the range into memory: the body is read only once the answer's
    Content-Length says it is the range's length."""
    try:
        signed = _presigned(fs, url)
    except Exception:  # noqa: BLE001 - s3fs raises its own kinds; the caller's read through s3fs reports them
        _failed(fs, url)
        return None
    want = end - start
    try:
        answer = _pool().request("GET", signed, headers={"Range": f"bytes={start}-{end - 1}"},
                                 preload_content=False, redirect=False)
    except Exception:  # noqa: BLE001 - urllib3's connection and protocol errors: transient
        _failed(fs, url, counted=False)
        return None
    data, counted = None, answer.status < 500  # a 5xx is transient; any other answer but the range is not
    headers = answer.headers
    try:
        if (answer.status == 206 and headers.get("Content-Length") == str(want)
                and headers.get("Content-Range", "").startswith(f"bytes {start}-{end - 1}/")):
            data = answer.read()  # Content-Length bytes, no more
    except Exception:  # noqa: BLE001 - a body cut short: transient
        data, counted = None, False
    if data is None or len(data) != want:
        answer.close()  # the connection's state is unknown: it is not reused
        answer.release_conn()
        _failed(fs, url, counted)
        return None
    answer.release_conn()
    return data

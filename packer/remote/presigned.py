"""Ranged GETs of S3 objects through presigned URLs (and of HTTP(S) URLs as they are) on kept-alive
``http.client`` connections: the cheap path for the many small ranges a dataset read a block at a time fetches.

s3fs's own ranged read goes through aiobotocore (request signing, event hooks, response parsing) and hops to its
event-loop thread and back: it costs a few times the CPU of a plain HTTP GET of the same range, spent in the
process that also feeds the GPU (``benchmarks/peers/remote_peers.py`` measures the difference). Here an object's
URL is presigned once by s3fs itself (``fs.url``: the same credentials, endpoint and addressing as its reads) and
re-signed well before it expires; each range is then one GET on a kept-alive connection of this process
(``http.client`` itself: urllib3's pool, which botocore uses, parses and re-encodes the signed URL on every
request and costs about half as much CPU again per GET). (botocore presigns with
SigV2 in the regions that accept it, SigV4 elsewhere; a bucket that refuses the URL answers 403, and the reads
go through s3fs.)

s3fs stays the authority: this path is taken only for options it reproduces exactly (credentials, endpoint,
anonymous access; no proxy, no other client or request settings), and any answer other than the range asked for
(an error status, a connection failure, a server that ignores Range) returns None, for the caller to read the
range through s3fs, whose retries and errors then apply. After a few failures that retrying would not mend (a
status other than 5xx) the path is off for that filesystem in that process.

An HTTP(S) dataset's ranges take the same path with the URL itself (:func:`plain_range`): fsspec's HTTP
filesystem reads a range through aiohttp on its event-loop thread, several times the CPU of a GET here
(``benchmarks/range_get_cost.py`` measures both); HTTPS is verified with the system's certificates,
as aiohttp's default. fsspec stays the authority there too: only for a filesystem without options and a URL
without credentials, and any other answer (a redirect, which fsspec follows) falls back to it.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import ssl
import threading
import time
import urllib.parse
from typing import Any

EXPIRES = 3600  # seconds a presigned URL is valid; re-signed after half of that
FAILURES = 3  # failed GETs after which a filesystem's reads go through s3fs alone, in this process
TIMEOUT = 60.0  # seconds to connect and between reads: botocore's defaults
IDLE = 16  # kept-alive connections kept per server, per process
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_PLAIN_OPTIONS = {"endpoint_url", "key", "secret", "token", "anon", "profile", "skip_instance_cache"}
_PLAIN_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_PLAIN_HTTP_OPTIONS = {"skip_instance_cache"}

_LOCK = threading.Lock()
# (the filesystem's options, url) -> (signed at, its server, its request target): a forked DataLoader worker
# inherits them, and reads those objects without making a filesystem of its own (aiobotocore's client costs a
# reader's first GET about 0.1 s of CPU)
# a server: (scheme, host, port, trust), trust "aws" (S3: botocore's certificates) or "system" (a plain HTTPS URL:
# the system's, as aiohttp's default)
Server = tuple[str, str, int, str]
_SIGNED: dict[tuple[str, str], tuple[float, Server, str]] = {}
_FAILED: dict[tuple[int, str], int] = {}  # (pid, the filesystem's options) -> failed GETs
# (pid, server) -> idle kept-alive connections: a forked child never uses its parent's
_IDLE: dict[tuple[int, Server], list[http.client.HTTPConnection]] = {}
_TLS: dict[tuple[int, str], ssl.SSLContext] = {}  # (pid, trust) -> the context HTTPS connections verify with


def _after_fork() -> None:
    """In a forked child: a lock of its own (a thread of the parent may have held this one as it forked), and
    its copies of the parent's idle connections closed (never used here: a child would otherwise keep each one
    open for as long as it lives, after the parent or the server let it go). Closing a copy sends nothing: the
    parent's connection stays open."""
    global _LOCK
    _LOCK = threading.Lock()
    for idle in _IDLE.values():
        for connection in idle:
            connection.close()
    _IDLE.clear()


os.register_at_fork(after_in_child=_after_fork)


def _options(fs: Any) -> str:
    return json.dumps(getattr(fs, "storage_options", {}) or {}, sort_keys=True, default=repr)


def _protocols(fs: Any) -> set[str]:
    return set(fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def _still_on(fs: Any) -> bool:
    """No proxy variable set (only the filesystem's own client applies one), and fewer than ``FAILURES``
    failures for ``fs``'s options in this process."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return False
    return _FAILED.get((os.getpid(), _options(fs)), 0) < FAILURES


def can_presign(fs: Any) -> bool:
    """Whether ranges of ``fs``'s objects may be read through presigned URLs: an S3 filesystem with plain options
    (see the module's docstring), no proxy set, and fewer than ``FAILURES`` failures so far."""
    if not {"s3", "s3a"} & _protocols(fs) or not callable(getattr(fs, "url", None)):
        return False
    options = getattr(fs, "storage_options", {}) or {}
    client = options.get("client_kwargs") or {}
    if set(options) - _PLAIN_OPTIONS - {"client_kwargs"} or set(client) - _PLAIN_CLIENT_KWARGS:
        return False
    return _still_on(fs)


def _tls(trust: str) -> ssl.SSLContext:
    """The certificates HTTPS connections are verified with: for S3 (``trust="aws"``) botocore's
    (``AWS_CA_BUNDLE``, else its bundle), for a plain URL the system's."""
    with _LOCK:
        context = _TLS.get((os.getpid(), trust))
        if context is None:
            bundle = None
            if trust == "aws":
                from botocore.httpsession import get_cert_path

                bundle = os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)
            context = _TLS[(os.getpid(), trust)] = ssl.create_default_context(cafile=bundle)
    return context


def _dropped(connection: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection was closed (or sent something unasked): not to be reused."""
    if connection.sock is None:
        return False  # not connected: the next request connects
    poll = select.poll()
    poll.register(connection.sock, select.POLLIN)
    return bool(poll.poll(0))


def _connection(server: Server) -> tuple[http.client.HTTPConnection, bool]:
    """An idle connection to ``server`` of this process, or a new one; and whether it was used before."""
    with _LOCK:
        idle = _IDLE.get((os.getpid(), server), [])
        while idle:
            connection = idle.pop()
            if not _dropped(connection):
                return connection, connection.sock is not None
            connection.close()
    scheme, host, port, trust = server
    if scheme == "https":
        return http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=_tls(trust)), False
    return http.client.HTTPConnection(host, port, timeout=TIMEOUT), False


def _keep(server: Server, connection: http.client.HTTPConnection) -> None:
    with _LOCK:
        idle = _IDLE.setdefault((os.getpid(), server), [])
        if len(idle) < IDLE:
            idle.append(connection)
            return
    connection.close()


def _presigned(fs: Any, url: str) -> tuple[Server, str]:
    """``url``'s presigned URL: its server and request target (path and query)."""
    key = (_options(fs), url)
    with _LOCK:
        found = _SIGNED.get(key)
    if found is not None and time.monotonic() - found[0] < EXPIRES / 2:
        return found[1], found[2]
    where = _server_and_target(fs.url(url, expires=EXPIRES), "aws")
    if where is None:
        raise ValueError(f"{url}: not an HTTP(S) presigned URL")
    server, target = where
    with _LOCK:
        _SIGNED[key] = (time.monotonic(), server, target)
    return server, target


def _get(server: Server, target: str, headers: dict[str, str]
         ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """One GET on a kept-alive connection; once more on a new one when a reused connection fails (the server
    may have closed it as it was taken)."""
    connection, reused = _connection(server)
    try:
        connection.request("GET", target, headers=headers)
        return connection, connection.getresponse()
    except (OSError, http.client.HTTPException):
        connection.close()
        if not reused:
            raise
    connection, _ = _connection(server)
    try:
        connection.request("GET", target, headers=headers)
        return connection, connection.getresponse()
    except BaseException:
        connection.close()
        raise


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
        server, target = _presigned(fs, url)
    except Exception:  # noqa: BLE001 - s3fs raises its own kinds; the caller's read through s3fs reports them
        _failed(fs, url)
        return None
    return _range(fs, url, server, target, start, end)


def sign_ahead(fs: Any, urls: list[str]) -> None:
    """Presign ``urls`` now, where :func:`can_presign`: a DataLoader worker forked afterwards reads them with the
    URLs its parent signed, where one left to sign a URL itself first makes an S3 client of its own (the costliest
    step of a worker's first GET). A URL that does not sign is left to be signed, or read through s3fs, when it
    is read."""
    if not can_presign(fs):
        return
    for url in urls:
        try:
            _presigned(fs, url)
        except Exception:  # noqa: BLE001 - s3fs raises its own kinds; the read reports them (presigned_range)
            return


def can_get_plainly(fs: Any) -> bool:
    """Whether ranges of ``fs``'s URLs may be read here with the URL itself: an HTTP(S) filesystem without
    options (no headers, authentication or client settings, which only fsspec's client applies), no proxy set,
    and fewer than ``FAILURES`` failures so far."""
    if not {"http", "https"} & _protocols(fs) or set(getattr(fs, "storage_options", {}) or {}) - _PLAIN_HTTP_OPTIONS:
        return False
    return _still_on(fs)


def plain_range(fs: Any, url: str, start: int, end: int) -> bytes | None:
    """Bytes ``[start, end)`` of the HTTP(S) ``url``, as :func:`presigned_range` reads them (None: the caller reads
    them through ``fs``, which also follows redirects). Call only where :func:`can_get_plainly`; a URL with a user
    name or password in it is left to ``fs``."""
    where = _server_and_target(url, "system")
    return None if where is None else _range(fs, url, *where, start, end)


def _server_and_target(url: str, trust: str) -> tuple[Server, str] | None:
    """The server (with ``trust``) and request target (path and query) of an HTTP(S) ``url``; None for any other
    URL, and for one with a user name or password in it (only the filesystem's client sends those)."""
    split = urllib.parse.urlsplit(url)
    if split.scheme not in ("http", "https") or not split.hostname or split.username or split.password:
        return None
    port = split.port or (443 if split.scheme == "https" else 80)
    return (split.scheme, split.hostname, port, trust), (split.path or "/") + (f"?{split.query}" if split.query else "")


def _range(fs: Any, url: str, server: Server, target: str, start: int, end: int) -> bytes | None:
    """One ranged GET of ``target`` on ``server``: its body when the answer is exactly the range, else None (the
    connection is not reused, and a failure retrying would not mend is counted against ``fs``)."""
    want = end - start
    try:
        connection, answer = _get(server, target, {"Range": f"bytes={start}-{end - 1}"})
    except Exception:  # noqa: BLE001 - connection and protocol errors: transient
        _failed(fs, url, counted=False)
        return None
    data, counted = None, answer.status < 500  # a 5xx is transient; any other answer but the range is not
    try:
        if (answer.status == 206 and answer.getheader("Content-Length") == str(want)
                and (answer.getheader("Content-Range") or "").startswith(f"bytes {start}-{end - 1}/")):
            data = answer.read()  # Content-Length bytes, no more
    except Exception:  # noqa: BLE001 - a body cut short: transient
        data, counted = None, False
    if data is None or len(data) != want or not answer.isclosed():
        answer.close()
        connection.close()  # the connection's state is unknown: it is not reused
        _failed(fs, url, counted)
        return None
    _keep(server, connection)
    return data

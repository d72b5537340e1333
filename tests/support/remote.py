"""Local stand-ins for remote storage, started by the tests, bound to 127.0.0.1 only: moto's S3 server, a
Range-capable HTTP file server that counts requests, and a fault-injecting proxy (500s, resets, bodies cut
short, latency) in front of either."""

from __future__ import annotations

import collections
import http.client
import http.server
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from packer.remote.cache import Cache
from support.packed import Poll

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def check_marked_remote() -> None:
    """Under pytest, a test that starts a server is marked ``remote`` (conftest records the running test's marks);
    the benchmarks that start these servers are not tests."""
    conftest = sys.modules.get("conftest")
    if conftest is not None and "remote" not in conftest.RUNNING_MARKS:
        raise AssertionError("this test starts a server: mark it remote")


class Served:
    """A server running on a thread; ``url``; ``requests`` counts ``(method, path)``, ``ranges`` a file server's
    ranged GETs by ``(path, Range header)``, ``sent`` the body bytes sent (a file server's); ``stop()``."""

    def __init__(self, handler: type, **attrs):
        check_marked_remote()
        self.requests: collections.Counter = collections.Counter()
        self.ranges: collections.Counter = collections.Counter()
        self.sent = 0
        self.lock = threading.Lock()
        self.latency = 0.0
        self.in_flight = self.most_in_flight = 0  # a proxy's requests being answered at once, and their most
        handler = type(handler.__name__, (handler,), {"served": self, **attrs})
        self.server = _Server((HOST, 0), handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{HOST}:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, method: str, path: str, ranged: str | None = None) -> None:
        with self.lock:
            self.requests[(method, path)] += 1
            if ranged and method == "GET":
                self.ranges[(path, ranged)] += 1

    def gets(self, suffix: str) -> int:
        """GET requests for paths ending with ``suffix``."""
        return sum(n for (method, path), n in self.requests.items() if method == "GET" and path.endswith(suffix))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RangeFiles(http.server.BaseHTTPRequestHandler):
    """GET and HEAD of the files under ``root``, with single ``Range: bytes=a-b`` requests answered 206."""

    root: Path
    served: Served
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms delayed-ACK wait

    def log_message(self, *args) -> None:
        pass

    def _file(self) -> Path | None:
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = (self.root / rel).resolve()
        return path if path.is_file() and path.is_relative_to(self.root.resolve()) else None

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        self.served.count(self.command, self.path, self.headers.get("Range"))
        path = self._file()
        if path is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = path.read_bytes()
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match:
            start = int(match.group(1))
            end = min(int(match.group(2)) + 1 if match.group(2) else len(data), len(data))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            data = data[start:end]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if body:
            with self.served.lock:
                self.served.sent += len(data)
            self.wfile.write(data)


def serve_files(root: Path) -> Served:
    return Served(RangeFiles, root=Path(root))


def serving(root: Path) -> Iterator[Served]:
    """:func:`serve_files` for a fixture's life: ``yield from serving(root)``."""
    served = serve_files(root)
    try:
        yield served
    finally:
        served.stop()


class CachePoll(Poll):
    """The most bytes the cache at ``root`` held, sampled while the block runs."""

    def __init__(self, root: Path):
        super().__init__()
        self.cache = Cache(root)

    def sample(self) -> int:
        # under the cache's eviction lock, which every reservation, rename and eviction takes: without it a count,
        # listing the folders one after another, may find a download in tmp/ and again in objects/ once renamed
        with self.cache._eviction_locked():
            return self.cache.used()


class FaultProxy(http.server.BaseHTTPRequestHandler):
    """Forwards every request to ``upstream`` (host, port). ``faults`` (a deque shared by the proxy) holds what
    the next GETs suffer: ``"500"``, ``"reset"`` (the connection closed with RST, nothing sent), ``"truncate"``
    (the upstream answer with half its body, then the connection closed), ``"stall"`` (nothing for 2 s, then
    the connection closed), ``"norange"`` (forwarded without its Range header: the whole object) or ``"close"``
    (the answer in full, then the kept-alive connection closed, unannounced);
    ``latency`` seconds are added to every request; ``most_in_flight`` counts the requests answered at once."""

    upstream: tuple[str, int]
    served: Served
    faults: collections.deque
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms delayed-ACK wait

    def log_message(self, *args) -> None:
        pass

    def _forward(self) -> None:
        self.served.count(self.command, self.path)
        with self.served.lock:
            self.served.in_flight += 1
            self.served.most_in_flight = max(self.served.most_in_flight, self.served.in_flight)
        try:
            self._answer()
        finally:
            with self.served.lock:
                self.served.in_flight -= 1

    def _answer(self) -> None:
        time.sleep(self.served.latency)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        fault = self.faults.popleft() if self.command == "GET" and self.faults else None
        if fault == "stall":
            time.sleep(2.0)
            self.close_connection = True
            return
        if fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault == "500":
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        dropped = ("connection", "keep-alive", "expect", *(("range",) if fault == "norange" else ()))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        conn.request(self.command, self.path, body=body, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive", "date",
                                   "server"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        if fault == "truncate":
            self.send_header("Connection", "close")
        self.close_connection = fault in ("truncate", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data[: len(data) // 2] if fault == "truncate" else data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


def fault_proxy(upstream_url: str, latency: float = 0.0) -> Served:
    host, port = upstream_url.removeprefix("http://").split(":")
    proxy = Served(FaultProxy, upstream=(host, int(port)), faults=collections.deque())
    proxy.latency = latency
    proxy.faults = proxy.server.RequestHandlerClass.faults
    return proxy


class S3Server:
    """moto's S3 server on 127.0.0.1, with ``AWS_*`` variables pointing at it while it runs."""

    ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}

    def __init__(self, buckets: tuple[str, ...] = ("bucket",)):
        from moto.server import ThreadedMotoServer

        check_marked_remote()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
        self.server.start()
        self.url = f"http://{HOST}:{self.port}"
        self.saved = {k: os.environ.get(k) for k in [*self.ENV, "AWS_ENDPOINT_URL", "AWS_PROFILE"]}
        os.environ.update(self.ENV, AWS_ENDPOINT_URL=self.url)
        os.environ.pop("AWS_PROFILE", None)
        import boto3

        client = boto3.client("s3", endpoint_url=self.url)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)

    def stop(self) -> None:
        self.server.stop()
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

"""A small S3 server for the remote benchmark: the objects are the files under a folder, answered by the S3 calls
the three tools make (GetObject with or without a Range, HeadObject, HeadBucket, ListObjectsV2,
GetBucketLocation), each after ``latency`` seconds, its body sent with ``sendfile``. No authentication, no
writes: the driver copies each dataset into the folder.

Why: moto (``--server moto``) answers every request in Python on the benchmark's own cores, and the tests'
latency proxy copies every body once more; on a 2-core machine the two used 0.9-1.3 CPU-seconds of a packer read
of two epochs (this server 0.2), which an object store spends on its own machines. This server's cost per request is
its HTTP parsing, kept small: the request's headers are split into a dict, where ``http.server`` parses them with
the ``email`` package, and a bucket's folder is resolved once (the two: 0.30-0.31 ms of CPU a ranged GET of 0.6 MB,
against 0.46-0.50). Path-style URLs only (``http://127.0.0.1:PORT/BUCKET/KEY``, what boto3, botocore and s3fs use
for an IP endpoint)."""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import functools
import http.server
import os
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from xml.sax.saxutils import escape

from support.remote import Served

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _Headers(dict):
    """A request's headers by lower-case name (the last of a repeated one): what the handlers read of them."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


def _etag(st: os.stat_result) -> str:
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}"'


class S3Files(http.server.BaseHTTPRequestHandler):
    """Bucket ``B``'s object ``K`` is the file ``root/B/K``."""

    root: Path
    served: Served
    raw_requestline: bytes  # set by http.server before parse_request
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # the headers and the body go in two writes: no 40 ms delayed-ACK wait

    def log_message(self, *args) -> None:
        pass

    def parse_request(self) -> bool:
        """The request line and headers of an HTTP/1.x request, without ``http.server``'s ``email`` parsing; a
        malformed request line is a 400. Keep-alive unless HTTP/1.0 or ``Connection: close``."""
        self.close_connection = True
        self.requestline = self.raw_requestline.decode("latin-1").rstrip("\r\n")
        words = self.requestline.split()
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            self.command, self.request_version = "", "HTTP/1.0"
            self.send_error(400, f"Bad request line {self.requestline!r}")
            return False
        self.command, self.path, self.request_version = words
        headers = _Headers()
        while (line := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        self.headers = headers  # type: ignore[assignment]
        self.close_connection = (self.request_version != "HTTP/1.1"
                                 or (headers.get("Connection") or "").lower() == "close")
        return True

    def _split(self) -> tuple[str, str, dict[str, str]]:
        url = urllib.parse.urlsplit(self.path)
        bucket, _, key = urllib.parse.unquote(url.path).lstrip("/").partition("/")
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        return bucket, key, query

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, what: str) -> None:
        body = f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{escape(what)}" \
               "</Message></Error>"
        self._reply(status, body.encode(), {"Content-Type": "application/xml"})

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self.served.count(self.command, self.path)
        time.sleep(self.served.latency)
        bucket, key, query = self._split()
        folder = self.root / bucket
        if not bucket or not folder.is_dir():
            self._error(404, "NoSuchBucket", bucket)
        elif not key:
            self._bucket(folder, query)
        else:
            self._object(folder, key)

    def _bucket(self, folder: Path, query: dict[str, str]) -> None:
        xml = {"Content-Type": "application/xml"}
        if "location" in query:
            self._reply(200, b'<?xml version="1.0" encoding="UTF-8"?><LocationConstraint/>', xml)
        elif self.command == "HEAD":
            self._reply(200)
        else:
            self._reply(200, self._listing(folder, query).encode(), xml)

    def _listing(self, folder: Path, query: dict[str, str]) -> str:
        """ListObjectsV2 (and V1's core): keys under ``prefix``, folded at ``delimiter``, ``max-keys`` a page."""
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        after = query.get("continuation-token") or query.get("start-after") or query.get("marker") or ""
        limit = int(query.get("max-keys") or 1000)
        keys = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        entries: list[tuple[str, bool]] = []  # (key or common prefix, is a prefix)
        for key in keys:
            if not key.startswith(prefix) or key <= after:
                continue
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            item = (key[:cut + len(delimiter)], True) if cut >= 0 else (key, False)
            if not entries or entries[-1] != item:
                entries.append(item)
        page, truncated = entries[:limit], len(entries) > limit
        parts = [f"<Name>{escape(folder.name)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}"
                 f"</KeyCount><MaxKeys>{limit}</MaxKeys><IsTruncated>{str(truncated).lower()}</IsTruncated>"]
        if delimiter:
            parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        if truncated:
            parts.append(f"<NextContinuationToken>{escape(page[-1][0])}</NextContinuationToken>"
                         f"<NextMarker>{escape(page[-1][0])}</NextMarker>")
        for name, is_prefix in page:
            if is_prefix:
                parts.append(f"<CommonPrefixes><Prefix>{escape(name)}</Prefix></CommonPrefixes>")
                continue
            st = (folder / name).stat()
            stamp = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
            parts.append(f"<Contents><Key>{escape(name)}</Key><LastModified>{stamp:%Y-%m-%dT%H:%M:%S.000Z}"
                         f"</LastModified><ETag>{escape(_etag(st))}</ETag><Size>{st.st_size}</Size>"
                         "<StorageClass>STANDARD</StorageClass></Contents>")
        return ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
                f'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{"".join(parts)}</ListBucketResult>')

    def _object(self, folder: Path, key: str) -> None:
        path = folder / key
        try:
            if not path.resolve().is_relative_to(_resolved(folder)):
                raise FileNotFoundError(key)
            f = open(path, "rb")  # noqa: SIM115 - closed below, after sendfile
        except OSError:
            self._error(404, "NoSuchKey", key)
            return
        with f:
            st = os.fstat(f.fileno())
            start, end, status = 0, st.st_size, 200
            asked = _RANGE.match(self.headers.get("Range", "").strip())
            if asked and (asked[1] or asked[2]):
                if asked[1]:
                    start, end = int(asked[1]), min(st.st_size, int(asked[2]) + 1 if asked[2] else st.st_size)
                else:  # the last N bytes
                    start = max(0, st.st_size - int(asked[2]))
                if start >= st.st_size or end <= start:
                    self._error(416, "InvalidRange", f"bytes {asked[0]} of {st.st_size}")
                    return
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", _etag(st))
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
            self.end_headers()
            if self.command == "GET":
                self.wfile.flush()
                self.connection.sendfile(f, start, end - start)


@functools.cache
def _resolved(folder: Path) -> Path:
    return folder.resolve()


def serve(root: Path, latency: float = 0.0) -> Served:
    """The server on 127.0.0.1 (a thread of this process): ``url``, ``gets(suffix)``, ``stop()``; buckets are the
    folders of ``root``."""
    served = Served(S3Files, root=Path(root))
    served.latency = latency
    served.server.handle_error = lambda request, address: None  # a reader closing a connection is not news
    return served


_CHILD = """
import sys, time
sys.path[:0] = [{peers!r}, {tests!r}]
from pathlib import Path
import s3_lite
served = s3_lite.serve(Path({root!r}), {latency!r})
print(served.url, flush=True)
time.sleep(24 * 3600)
"""


@contextlib.contextmanager
def served_in_child(root: Path, latency: float = 0.0) -> Iterator[tuple[str, int]]:
    """:func:`serve` in a child process, so that the caller's CPU is the client's alone: yields the server's URL
    and the child's pid (whose CPU is the server's); the child is killed as the block ends."""
    here = Path(__file__).resolve().parent
    code = _CHILD.format(peers=str(here), tests=str(here.parent.parent / "tests"), root=str(root), latency=latency)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        yield child.stdout.readline().strip(), child.pid
    finally:
        child.kill()
        child.wait()

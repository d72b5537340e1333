"""Ranged GETs of S3 objects through presigned URLs (packer.remote.presigned), against moto behind the fault
proxy: the same bytes as s3fs reads, s3fs whenever that path does not answer the range, and s3fs alone where the
path cannot reproduce its settings; and of HTTP(S) URLs as they are, against a file server behind the proxy, with
fsspec in the same places."""

from __future__ import annotations

import os
import stat

import pytest
from support.remote import S3Server, fault_proxy, serve_files

from packer.remote import presigned
from packer.remote.fetch import _cat
from packer.remote.fs import filesystem

BLOB = os.urandom(300_000)


@pytest.fixture(scope="module")
def proxied():
    s3 = S3Server()
    import boto3

    boto3.client("s3", endpoint_url=s3.url).put_object(Bucket="bucket", Key="blob", Body=BLOB)
    proxy = fault_proxy(s3.url)
    yield proxy
    proxy.stop()
    s3.stop()


def signed_gets(proxy) -> int:
    return sum(n for (method, path), n in proxy.requests.items() if method == "GET" and "Signature=" in path)


def unsigned_gets(proxy) -> int:
    return sum(n for (method, path), n in proxy.requests.items() if method == "GET" and "Signature=" not in path)


def fresh_fs(proxy, **options):
    """A filesystem no earlier test turned the path off for (its failures are counted by its options)."""
    return filesystem("s3", {"endpoint_url": proxy.url, "client_kwargs": {"region_name": "us-east-1"}, **options})


def test_a_range_is_one_get_of_its_presigned_url(proxied):
    fs = fresh_fs(proxied, key="testing", secret="testing")
    assert presigned.can_presign(fs)
    signed, unsigned = signed_gets(proxied), unsigned_gets(proxied)
    assert _cat(fs, "s3://bucket/blob", 1_000, 201_000) == BLOB[1_000:201_000]
    assert _cat(fs, "s3://bucket/blob", 299_999, 300_000) == BLOB[-1:]
    assert (signed_gets(proxied) - signed, unsigned_gets(proxied) - unsigned) == (2, 0)


@pytest.mark.parametrize("fault", ["500", "reset", "truncate"])
def test_a_failed_get_is_read_again_through_s3fs_and_keeps_the_path(proxied, fault):
    fs = fresh_fs(proxied, key="testing", secret="testing")
    proxied.faults.append(fault)
    unsigned = unsigned_gets(proxied)
    assert _cat(fs, "s3://bucket/blob", 10, 20_010) == BLOB[10:20_010]
    assert unsigned_gets(proxied) - unsigned == 1  # the retry went through s3fs
    assert presigned.can_presign(fs)  # a transient failure does not turn the path off


@pytest.mark.parametrize("seen", [True, False])
def test_a_connection_the_server_closed_is_not_a_failure(proxied, monkeypatch, seen):
    """A server closes idle kept-alive connections when it likes: seen closed when taken, the connection is not
    used; closed as it was taken (``seen=False``: not looked at), the GET goes once more on a new one. Either way
    the range is signed GETs alone, and the path stays on."""
    fs = fresh_fs(proxied, key="testing", secret="testing")
    if not seen:
        monkeypatch.setattr(presigned, "_dropped", lambda connection: False)
    proxied.faults.append("close")
    assert _cat(fs, "s3://bucket/blob", 0, 100) == BLOB[:100]  # answered in full; the proxy then closes
    signed, unsigned = signed_gets(proxied), unsigned_gets(proxied)
    assert _cat(fs, "s3://bucket/blob", 100, 20_100) == BLOB[100:20_100]
    assert (signed_gets(proxied) - signed, unsigned_gets(proxied) - unsigned) == (1, 0)
    assert presigned.can_presign(fs)


def test_a_server_that_ignores_range_turns_the_path_off_after_a_few_answers(proxied):
    fs = fresh_fs(proxied, anon=False)
    for _ in range(presigned.FAILURES):
        assert presigned.can_presign(fs)
        proxied.faults.append("norange")
        assert _cat(fs, "s3://bucket/blob", 5, 105) == BLOB[5:105]
    assert not presigned.can_presign(fs)
    signed = signed_gets(proxied)
    assert _cat(fs, "s3://bucket/blob", 0, 100) == BLOB[:100]
    assert signed_gets(proxied) == signed


def test_settings_it_cannot_reproduce_keep_s3fs(proxied, monkeypatch):
    assert not presigned.can_presign(fresh_fs(proxied, requester_pays=True))
    assert not presigned.can_presign(fresh_fs(proxied, client_kwargs={"verify": False}))
    assert not presigned.can_presign(filesystem("http"))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert not presigned.can_presign(fresh_fs(proxied, key="testing", secret="testing"))


def _sockets_open(sockets: list[tuple[int, int]]) -> list[int]:
    """Which of ``(fd, inode)`` are still that socket in this process."""
    found = []
    for fd, inode in sockets:
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:
            found.append(fd)
    return found


def _read_in_child(options: dict, inherited: list[tuple[int, int]], queue) -> None:
    still_open = _sockets_open(inherited)  # before this child makes a connection of its own
    fs = filesystem("s3", options)  # a filesystem of the child's own, with the parent's options
    fs.url = None  # the child may not sign: it reads with the URL its parent signed
    queue.put((still_open, presigned.presigned_range(fs, "s3://bucket/blob", 7, 77)))


def test_a_forked_worker_reads_with_the_urls_its_parent_signed(proxied):
    """The child reads with its own connection and closes its copies of the parent's idle ones, which the parent
    goes on using (closing a copy sends nothing)."""
    import multiprocessing

    fs = fresh_fs(proxied, key="testing", secret="testing")
    assert _cat(fs, "s3://bucket/blob", 0, 10) == BLOB[:10]  # signed here
    idle = [c for (pid, _), kept in presigned._IDLE.items() if pid == os.getpid() for c in kept]
    sockets = [(c.sock.fileno(), os.fstat(c.sock.fileno()).st_ino) for c in idle if c.sock is not None]
    assert sockets
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(fs.storage_options, sockets, queue))
    child.start()
    assert queue.get(timeout=30) == ([], BLOB[7:77])
    child.join(10)
    assert _cat(fs, "s3://bucket/blob", 10, 20) == BLOB[10:20]
    after = [c for (pid, _), kept in presigned._IDLE.items() if pid == os.getpid() for c in kept]
    assert set(map(id, idle)) <= set(map(id, after)) and _sockets_open(sockets) == [fd for fd, _ in sockets]


# --------------------------------------------------------------------------------------------------------------
# HTTP(S) URLs, read as they are
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_proxied(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    (root / "blob").write_bytes(BLOB)
    files = serve_files(root)
    proxy = fault_proxy(files.url)
    yield proxy
    proxy.stop()
    files.stop()


@pytest.fixture
def no_failures(monkeypatch):
    """Failures counted afresh: an HTTP filesystem without options has one key in the whole process."""
    monkeypatch.setattr(presigned, "_FAILED", {})


def idle_to(proxy) -> list:
    return presigned._IDLE.get((os.getpid(), ("http", "127.0.0.1", proxy.port, "system")), [])


def test_an_http_range_is_one_get_of_the_url_on_a_kept_alive_connection(http_proxied, no_failures):
    fs = filesystem("http")
    assert presigned.can_get_plainly(fs) and not presigned.can_presign(fs)
    gets = http_proxied.gets("/blob")
    assert _cat(fs, f"{http_proxied.url}/blob", 1_000, 201_000) == BLOB[1_000:201_000]
    kept = list(idle_to(http_proxied))
    assert _cat(fs, f"{http_proxied.url}/blob", 299_999, 300_000) == BLOB[-1:]
    assert http_proxied.gets("/blob") - gets == 2 and kept and idle_to(http_proxied) == kept  # one connection


@pytest.mark.parametrize("fault", ["500", "reset", "truncate"])
def test_a_failed_http_get_is_read_again_through_fsspec_and_keeps_the_path(http_proxied, no_failures, fault):
    fs = filesystem("http")
    http_proxied.faults.append(fault)
    gets = http_proxied.gets("/blob")
    assert _cat(fs, f"{http_proxied.url}/blob", 10, 20_010) == BLOB[10:20_010]
    assert http_proxied.gets("/blob") - gets == 2  # the failed GET, then fsspec's
    assert presigned.can_get_plainly(fs)


def test_an_http_server_that_ignores_range_turns_the_path_off_after_a_few_answers(http_proxied, no_failures):
    fs = filesystem("http")
    for _ in range(presigned.FAILURES):
        assert presigned.can_get_plainly(fs)
        http_proxied.faults.append("norange")
        assert _cat(fs, f"{http_proxied.url}/blob", 5, 105) == BLOB[5:105]
    assert not presigned.can_get_plainly(fs)
    assert _cat(fs, f"{http_proxied.url}/blob", 0, 100) == BLOB[:100]  # through fsspec alone


def test_http_settings_only_fsspec_applies_keep_fsspec(http_proxied, no_failures, monkeypatch):
    assert not presigned.can_get_plainly(filesystem("http", {"client_kwargs": {"headers": {"X-Token": "t"}}}))
    assert presigned.plain_range(filesystem("http"), f"http://user:pw@127.0.0.1:{http_proxied.port}/blob", 0, 9) is None
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    assert not presigned.can_get_plainly(filesystem("http"))


def test_a_blocked_dataset_signs_its_files_as_it_opens(proxied, tmp_path, monkeypatch):
    """RemoteBlocks.sign_ahead presigns every data file's URL in the process that opens the dataset, so that the
    workers a loader forks afterwards read with them instead of making an S3 client of their own; a dataset of
    more than SIGN_AT_OPEN files signs none up front."""
    from packer.remote import ranges
    from packer.remote.url import parse_url

    options = {"endpoint_url": proxied.url, "client_kwargs": {"region_name": "us-east-1"}, "key": "testing",
               "secret": "sign-ahead"}  # options of its own: no other test signed with them
    key = presigned._options(filesystem("s3", options))
    manifest = {"files": [{"path": f"shard-{i}.tar", "bytes": 10, "sha256": "0" * 64} for i in range(3)]}
    store = ranges.RemoteBlocks(parse_url("s3://bucket/ds"), manifest, options, tmp_path, 100)
    monkeypatch.setattr(ranges, "SIGN_AT_OPEN", 2)
    store.sign_ahead()
    assert [url for options_key, url in presigned._SIGNED if options_key == key] == []
    monkeypatch.setattr(ranges, "SIGN_AT_OPEN", 3)
    store.sign_ahead()
    signed = sorted(url for options_key, url in presigned._SIGNED if options_key == key)
    assert signed == [f"s3://bucket/ds/shard-{i}.tar" for i in range(3)]

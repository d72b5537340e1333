"""Packed datasets on object storage and HTTP, against servers the tests start on 127.0.0.1: moto's S3, a
Range-capable file server, and a fault-injecting proxy. What is read over a URL must be exactly what the same
dataset gives locally."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import snapshot, stored_samples, write_image
from support.processes import assert_ok, assert_one_line_error, torchrun
from support.remote import S3Server, fault_proxy, serve_files

import packer
import packer.remote
from packer.errors import DestinationError, RemoteError, UrlError, UsageError
from packer.formats import Reader, get_format
from packer.remote.cache import Cache, CacheFull, when_room
from packer.verify import verify

FORMATS = ("lmdb", "hdf5", "wds")
PACK = {"lmdb": {}, "hdf5": {}, "wds": {"shard_samples": 4}}


@pytest.fixture(scope="module", autouse=True)
def cache_env(tmp_path_factory):
    """The default cache (and upload staging) in a temporary folder, and quick retries."""
    saved = {k: os.environ.get(k) for k in ("PACKER_CACHE_DIR", "PACKER_RETRY_BACKOFF")}
    os.environ["PACKER_CACHE_DIR"] = str(tmp_path_factory.mktemp("packer-cache"))
    os.environ["PACKER_RETRY_BACKOFF"] = "0.01"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def remote_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote") / "src"
    for c, name in enumerate(("ant", "bee", "cat")):
        for i in range(6):
            write_image(root / name / f"{i}.jpg", 40, 30, seed=10 * c + i)  # one size: packer.stream batches
    return root


@pytest.fixture(scope="module")
def local_packs(tmp_path_factory, remote_src) -> Path:
    """The folder holding ``lmdb/``, ``hdf5/`` and ``wds/``, packed locally (and served over HTTP)."""
    root = tmp_path_factory.mktemp("local-packs")
    for fmt in FORMATS:
        packer.pack(remote_src, root / fmt, fmt, progress=False, workers=1, **PACK[fmt])
    return root


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_packs(s3, remote_src) -> dict[str, str]:
    urls = {}
    for fmt in FORMATS:
        urls[fmt] = f"s3://bucket/packs/{fmt}"
        packer.pack(remote_src, urls[fmt], fmt, progress=False, workers=1, **PACK[fmt])
    return urls


@pytest.fixture(scope="module")
def http_packs(local_packs):
    server = serve_files(local_packs)
    yield server
    server.stop()


def digest(samples) -> str:
    return hashlib.sha256(repr(samples).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------------------
# URLs that cannot be understood
# --------------------------------------------------------------------------------------------------------------
def test_mangled_or_unknown_url_is_an_error_never_a_local_folder(run_packer, remote_src, tmp_path, monkeypatch):
    proc = run_packer("pack", remote_src, "s3:/bucket/ds", "--format", "wds", cwd=tmp_path)
    assert_one_line_error(proc, "s3:/bucket/ds", "lost its '//'", code=2)
    monkeypatch.chdir(tmp_path)
    for dest in ("s3:", "foo://bucket/ds", Path("gs://bucket/ds"), "https://host/ds"):
        with pytest.raises(UrlError) as error:
            packer.pack(remote_src, dest, "wds", progress=False)
        assert error.value.exit_code == 2 and "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []
    assert packer.remote.parse_url("data:set") is None  # a local name with a colon stays local
    with pytest.raises(UrlError, match="lost its '//'"):
        packer.open_dataset(Path("s3://bucket/ds"))  # Path() made it s3:/bucket/ds
    with pytest.raises(UrlError, match="unknown URL scheme 'nope'"):
        packer.read_manifest("nope://x/y")


# --------------------------------------------------------------------------------------------------------------
# Round trips: what a URL gives is what the local dataset gives
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_s3_pack_then_read_verify_export_give_the_local_samples(fmt, s3_packs, local_packs, tmp_path, run_packer):
    url = s3_packs[fmt]
    assert stored_samples(url) == stored_samples(local_packs / fmt)
    ds = packer.open_dataset(url, cache_dir=tmp_path / "cache")
    local = packer.open_dataset(local_packs / fmt)
    assert all((ds[i][0] == local[i][0]).all() and ds[i][1] == local[i][1] for i in range(len(ds)))
    assert verify(url, deep=True) == []
    packer.export(url, tmp_path / "out", progress=False)
    packer.export(local_packs / fmt, tmp_path / "out-local", progress=False)
    assert snapshot(tmp_path / "out") == snapshot(tmp_path / "out-local")
    proc = run_packer("info", url)
    assert_ok(proc)
    assert proc.stdout.startswith(f"{url}: 18 images, 3 classes, {fmt}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_http_read_and_verify_give_the_local_samples(fmt, http_packs, local_packs, run_packer):
    url = f"{http_packs.url}/{fmt}"
    assert stored_samples(url) == stored_samples(local_packs / fmt)
    assert verify(url, deep=True) == []
    if fmt == "wds":  # the command once: each run starts a Python
        proc = run_packer("verify", url, "--deep")
        assert_ok(proc)
        assert proc.stdout.strip() == f"{url}: ok (every sample and field decoded)"


def test_repack_from_a_url(s3_packs, local_packs, tmp_path):
    packer.pack(s3_packs["wds"], tmp_path / "re", "lmdb", progress=False, workers=1)
    assert stored_samples(tmp_path / "re") == stored_samples(local_packs / "wds")


def batches(loader) -> list:
    return [(images.numpy().tobytes(), labels.tolist()) for images, labels in loader]


def test_stream_over_s3_within_a_cache_limit_below_the_dataset(s3_packs, local_packs, tmp_path):
    shards = packer.read_manifest(local_packs / "wds")["files"]
    biggest = max(f["bytes"] for f in shards if f["path"].endswith(".tar"))
    total = sum(f["bytes"] for f in shards)
    limit = 2 * biggest
    assert limit < total
    cache = tmp_path / "cache"
    remote = packer.stream(s3_packs["wds"], 5, shuffle=False, num_workers=0, cache_dir=cache, cache_limit=limit)
    local = packer.stream(local_packs / "wds", 5, shuffle=False, num_workers=0)
    expected = batches(local)
    assert batches(remote) == expected
    assert Cache(cache).used() <= limit
    assert batches(remote) == expected  # a second epoch, fetching again what was evicted
    uncached = packer.stream(s3_packs["wds"], 5, shuffle=False, num_workers=0, cache_dir=tmp_path / "unused",
                             cache=False)
    assert batches(uncached) == expected
    assert not (tmp_path / "unused").exists()
    if get_format("wds")[1].layout.__func__ is Reader.layout.__func__:  # no byte-range hooks yet
        with pytest.raises(UsageError, match="cannot be read a block at a time; raise cache_limit"):
            packer.open_dataset(s3_packs["wds"], cache_dir=cache, cache_limit=limit)
        return
    blocked = packer.open_dataset(s3_packs["wds"], cache_dir=cache, cache_limit=limit, decode=False)  # by blocks
    whole = packer.open_dataset(local_packs / "wds", decode=False)
    assert [blocked[i] for i in range(len(blocked))] == [whole[i] for i in range(len(whole))]
    assert Cache(cache).used() <= limit


# --------------------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------------------
def test_second_epoch_with_the_server_stopped(local_packs, tmp_path):
    server = serve_files(local_packs)
    ds = packer.open_dataset(f"{server.url}/wds", cache_dir=tmp_path / "cache", resize=24, center_crop=24)
    loader = packer.make_loader(ds, batch_size=6, num_workers=2, shuffle=False)
    first = [(images.clone(), labels.clone()) for images, labels in loader]
    server.stop()
    second = list(loader)  # worker processes open the cached files again: no network
    assert len(second) == len(first) == 3
    assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(first, second, strict=True))


CHILD = """
import hashlib, sys
import packer
ds = packer.open_dataset(sys.argv[1], cache_dir=sys.argv[2], decode=False, verify=True)
print(hashlib.sha256(repr([ds.raw_sample(i) for i in range(len(ds))]).encode()).hexdigest())
"""


def test_two_processes_share_one_cache_and_fetch_each_file_once(local_packs, tmp_path):
    server = serve_files(local_packs)
    try:
        url, cache = f"{server.url}/wds", tmp_path / "cache"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, url, str(cache)], stdout=subprocess.PIPE,
                                  text=True, env=env) for _ in range(2)]
        outs = [p.communicate(timeout=120)[0].strip() for p in procs]
        assert [p.returncode for p in procs] == [0, 0]
        ds = packer.open_dataset(local_packs / "wds", decode=False)
        expected = digest([ds.raw_sample(i) for i in range(len(ds))])
        assert outs == [expected, expected]
        for entry in packer.read_manifest(local_packs / "wds")["files"]:
            assert server.gets(f"/wds/{entry['path']}") == 1, entry["path"]
    finally:
        server.stop()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reader_keeps_reading_while_another_opens_the_same_url(fmt, http_packs, local_packs, tmp_path):
    """A second rank or process pinning the same cached files (the LRU clock) is not a repack of the first's."""
    url, cache = f"{http_packs.url}/{fmt}", tmp_path / "cache"
    first = packer.open_dataset(url, cache_dir=cache, decode=False)  # opens its data files on first read
    time.sleep(0.01)  # a clock tick the file systems' timestamps can tell apart
    second = packer.open_dataset(url, cache_dir=cache, decode=False)  # pins every cached file again
    local = packer.open_dataset(local_packs / fmt, decode=False)
    expected = [local.raw_sample(i) for i in range(len(local))]
    assert [first.raw_sample(i) for i in range(len(first))] == expected
    assert [second.raw_sample(i) for i in range(len(second))] == expected


def test_eviction_is_lru_and_skips_pinned_files(tmp_path):
    cache = Cache(tmp_path / "cache", limit=250)
    blobs = {n: bytes([n]) * 100 for n in range(4)}
    shas = {n: hashlib.sha256(b).hexdigest() for n, b in blobs.items()}

    def get(n):
        return cache.obtain(shas[n], 100, lambda path: path.write_bytes(blobs[n]))

    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 1000)
    pinned = get(0)  # held: never evicted
    get(1).release()
    get(2).release()  # evicts 1, the oldest not held
    assert cache.pin(shas[1]) is None and pinned.path.read_bytes() == blobs[0]
    get(3).release()  # evicts 2
    assert cache.pin(shas[2]) is None and cache.pin(shas[0]) is not None
    assert cache.used() <= 250 and outside.read_bytes() == b"x" * 1000
    assert {p.name for p in (tmp_path / "cache" / "objects").iterdir()} == {shas[0], shas[3]}  # one folder
    get(1).release()  # evicts 3
    assert cache.pin(shas[1]).path.read_bytes() == blobs[1] and cache.pin(shas[3]) is None
    with pytest.raises(RemoteError, match="cannot fit"):
        Cache(tmp_path / "cache", limit=150).obtain("f" * 64, 100, lambda path: None)


def test_a_full_cache_waits_for_room_and_an_object_over_the_limit_fails_at_once(tmp_path):
    """A reader (a stream's shard, a block) whose object finds every cached byte pinned by another reader waits
    for it to let go; an object larger than the whole limit is one line at once, not a wait."""
    cache = Cache(tmp_path / "cache", limit=150)
    blobs = [bytes([n]) * 100 for n in range(2)]
    shas = [hashlib.sha256(b).hexdigest() for b in blobs]
    held = cache.obtain(shas[0], 100, lambda path: path.write_bytes(blobs[0]))
    with pytest.raises(CacheFull):
        cache.obtain(shas[1], 100, lambda path: path.write_bytes(blobs[1]))
    threading.Timer(0.3, held.release).start()
    started = time.monotonic()
    pin = when_room(lambda: cache.obtain(shas[1], 100, lambda path: path.write_bytes(blobs[1])))
    assert pin is not None and pin.path.read_bytes() == blobs[1] and time.monotonic() - started >= 0.25
    assert when_room(lambda: cache.obtain(shas[0], 100, lambda path: None), wait=False) is None  # pinned: no room
    started = time.monotonic()
    with pytest.raises(RemoteError, match="cannot fit an object of 200 bytes within cache_limit 150; raise") as error:
        when_room(lambda: cache.obtain("e" * 64, 200, lambda path: None))
    assert not isinstance(error.value, CacheFull) and time.monotonic() - started < 1


EVICT_ALL = """
import sys
from packer.remote.cache import Cache, CacheFull
cache = Cache(sys.argv[1], limit=100)
print("ready", flush=True)
try:
    with cache._eviction_locked():
        cache._make_room(100)  # room for 100 bytes: every object not pinned goes
except CacheFull:
    pass
"""


def test_an_object_just_fetched_is_pinned_before_another_process_may_evict_it(tmp_path, monkeypatch):
    """flock(2) converts a lock by dropping it first: the reservation's exclusive lock becomes the fetcher's shared
    pin while it holds the node's eviction lock, which an eviction needs, so another process cannot delete the
    object in between. Simulated: the conversion drops the lock, and another process evicts everything not pinned
    meanwhile (it waits for the eviction lock); the object stays, pinned."""
    import fcntl

    import packer.remote.cache as cache_module

    root, blob = tmp_path / "cache", b"b" * 100
    sha, real, evictor = hashlib.sha256(blob).hexdigest(), cache_module.lock_file, []

    def converting(fd: int, exclusive: bool = True, blocking: bool = True) -> bool:
        if not exclusive and not evictor:  # the reservation's lock becoming the pin
            fcntl.flock(fd, fcntl.LOCK_UN)  # what flock(2) does first
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            evictor.append(subprocess.Popen([sys.executable, "-c", EVICT_ALL, str(root)], env=env,
                                            stdout=subprocess.PIPE, text=True))
            assert evictor[0].stdout.readline().strip() == "ready"
            time.sleep(0.5)  # the other process evicts now, unless it waits for the eviction lock
        return real(fd, exclusive, blocking)

    monkeypatch.setattr(cache_module, "lock_file", converting)
    pin = Cache(root, limit=100).obtain(sha, 100, lambda path: path.write_bytes(blob))
    assert evictor[0].wait(timeout=60) == 0
    evictor[0].stdout.close()
    assert pin.path.read_bytes() == blob and Cache(root).pin(sha) is not None


def test_objects_of_the_older_layout_are_counted_and_evicted_not_read(tmp_path):
    """A cache filled before objects lay in one folder (``objects/ab/<sha256>``): its objects count toward the
    limit and go first when they are the least recently used (an emptied prefix folder with them); the object is
    fetched again into the one folder. A file that is not an object is counted, never deleted."""
    cache = Cache(tmp_path / "cache", limit=300)
    old, new = hashlib.sha256(b"old").hexdigest(), hashlib.sha256(b"new").hexdigest()
    (tmp_path / "cache" / "objects" / old[:2]).mkdir()
    (tmp_path / "cache" / "objects" / old[:2] / old).write_bytes(b"o" * 100)
    (tmp_path / "cache" / "objects" / "notes.txt").write_bytes(b"n" * 100)
    assert cache.used() == 200 and cache.pin(old) is None  # counted, not read
    cache.obtain(new, 150, lambda path: path.write_bytes(b"w" * 150)).release()  # 350 > 300: the old one goes
    assert not (tmp_path / "cache" / "objects" / old[:2]).exists()
    assert (tmp_path / "cache" / "objects" / "notes.txt").read_bytes() == b"n" * 100
    pin = cache.pin(new)
    assert cache.used() == 250 and pin.path == tmp_path.resolve() / "cache" / "objects" / new
    pin.release()
    cache.obtain(old, 100, lambda path: path.write_bytes(b"o" * 100)).release()  # the new one goes, not the note
    assert sorted(p.name for p in (tmp_path / "cache" / "objects").iterdir()) == sorted([old, "notes.txt"])


def test_threads_of_one_process_make_room_one_at_a_time(tmp_path):
    """A process opens the eviction lock once, and its threads share that descriptor, which a flock cannot tell
    apart: 8 threads fetching at once (the fetch-ahead's) still reserve room one at a time, within the limit."""
    cache = Cache(tmp_path / "cache", limit=1000)
    seen = []

    def fetch(path: Path) -> None:
        with cache._eviction_locked():  # a scan is a snapshot only under the lock: one taken without it may see
            seen.append(cache.used())  # a file evicted meanwhile and the reservation that replaced it
        time.sleep(0.01)
        with open(path, "r+b") as f:  # into the reservation, as packer's fetches write: "wb" would empty it first,
            f.write(b"x" * 250)  # and a scan in between would count it as room

    def get(n: int) -> None:
        when_room(lambda: cache.obtain(hashlib.sha256(bytes([n])).hexdigest(), 250, fetch, inherited=False)).release()

    threads = [threading.Thread(target=get, args=(n,)) for n in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 24 and max(seen) <= 1000 and cache.used() <= 1000


def test_one_fetch_of_an_object_at_a_time_and_no_lock_file_left_behind(tmp_path):
    """Eight threads (each its own open of the lock file, as processes have) want the same object; its first
    fetcher fails, so a waiter must fetch it: never two at once, though each fetcher removes its lock file as it
    lets go while the others wait on it. Once all are done, the cache holds no lock files (one per object ever
    fetched would pile up over weeks of reading a block at a time)."""
    cache = Cache(tmp_path / "cache")
    guard, active, peak, calls = threading.Lock(), [0], [0], []

    def fetch(blob: bytes, path: Path) -> None:
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            calls.append(blob)
            first = calls.count(blob) == 1
        time.sleep(0.02)
        with guard:
            active[0] -= 1
        if first:
            raise OSError("the first fetch of each object fails")
        path.write_bytes(blob)

    def get(blob: bytes, start: threading.Barrier, n: int) -> None:
        start.wait()
        time.sleep(0.005 * n)  # some wait on the first fetcher's lock file, some come after it was removed
        with contextlib.suppress(OSError):
            cache.obtain(hashlib.sha256(blob).hexdigest(), len(blob), lambda path: fetch(blob, path)).release()

    for n in range(10):
        blob, start = bytes([n]) * 100, threading.Barrier(8)
        threads = [threading.Thread(target=get, args=(blob, start, k)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert calls.count(blob) == 2 and cache.pin(hashlib.sha256(blob).hexdigest()).path.read_bytes() == blob
    assert peak[0] == 1 and list((tmp_path / "cache" / "locks").iterdir()) == []


# --------------------------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------------------------
def test_damaged_object_is_named_and_never_read(local_packs, tmp_path, run_packer):
    served = tmp_path / "served"
    import shutil

    shutil.copytree(local_packs / "hdf5", served / "hdf5")
    data = served / "hdf5" / "data.h5"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    server = serve_files(served)
    try:
        url = f"{server.url}/hdf5"
        with pytest.raises(RemoteError, match=f"{url}/data.h5: has a sha256 that differs"):
            packer.open_dataset(url, cache_dir=tmp_path / "cache")
        assert server.gets("/hdf5/data.h5") == 2  # fetched once more, then refused
        proc = run_packer("verify", url)
        assert proc.returncode == 1
        assert f"{url}/data.h5: has a sha256 that differs" in proc.stdout
        sha = packer.read_manifest(local_packs / "hdf5")["files"][0]["sha256"]
        assert not Cache(tmp_path / "cache").object_path(sha).exists()
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []
    finally:
        server.stop()


def test_a_timeout_is_retried(local_packs, tmp_path):
    import aiohttp

    server = serve_files(local_packs)
    proxy = fault_proxy(server.url)
    try:
        proxy.faults.append("stall")
        options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=0.5)}}
        ds = packer.open_dataset(f"{proxy.url}/hdf5", storage_options=options, cache_dir=tmp_path, decode=False)
        assert not proxy.faults and proxy.gets("/hdf5/manifest.json") == 2  # the first GET timed out
        local = packer.open_dataset(local_packs / "hdf5", decode=False)
        assert [ds.raw_sample(i) for i in range(len(ds))] == [local.raw_sample(i) for i in range(len(local))]
    finally:
        proxy.stop()
        server.stop()


def test_stream_over_http_in_worker_processes(http_packs, local_packs, tmp_path):
    remote = packer.stream(f"{http_packs.url}/wds", 4, num_workers=2, seed=1, cache_dir=tmp_path)
    assert batches(remote) == batches(packer.stream(local_packs / "wds", 4, num_workers=2, seed=1))


def test_retries_recover_from_500s_resets_and_short_bodies(local_packs, tmp_path):
    server = serve_files(local_packs)
    proxy = fault_proxy(server.url)
    try:
        proxy.faults.extend(["500", "reset", "truncate", "500", "truncate"])
        url = f"{proxy.url}/lmdb"
        assert stored_samples(url) == stored_samples(local_packs / "lmdb")
        assert not proxy.faults
    finally:
        proxy.stop()
        server.stop()


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------
def test_upload_refuses_an_existing_dataset_and_resume_resends_only_what_differs(s3, s3_packs, remote_src,
                                                                                 monkeypatch):
    import s3fs

    with pytest.raises(DestinationError, match="already holds a packed dataset; pass overwrite=True"):
        packer.pack(remote_src, s3_packs["hdf5"], "hdf5", progress=False, workers=1)
    url = "s3://bucket/up/wds"
    packer.pack(remote_src, url, "wds", progress=False, workers=1, **PACK["wds"])
    fs = s3fs.S3FileSystem(endpoint_url=s3.url, skip_instance_cache=True)
    fs.rm_file("bucket/up/wds/shard-000002.tar")  # an upload interrupted before this shard
    proxy = fault_proxy(s3.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        packer.pack(remote_src, url, "wds", progress=False, workers=1, resume=True, **PACK["wds"])
    finally:
        proxy.stop()
    puts = sorted(path for (method, path), n in proxy.requests.items() for _ in range(n) if method == "PUT")
    assert puts == ["/bucket/up/wds/manifest.json", "/bucket/up/wds/shard-000002.tar"]
    assert stored_samples(url) == stored_samples(s3_packs["wds"])
    fs.pipe_file("bucket/up/wds/notes.txt", b"mine")
    packer.pack(remote_src, url, "wds", progress=False, workers=1, overwrite=True, shard_samples=9)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find("bucket/up/wds")) == [
        "manifest.json", "notes.txt", "shard-000000.tar", "shard-000001.tar", "wds_index.npy"]  # 4 shards fewer
    assert stored_samples(url) == stored_samples(s3_packs["wds"])


def test_resume_after_a_finished_conversion_whose_upload_stopped_says_it_uploads(s3, s3_packs, remote_src, capfd):
    """The state a kill -9 during the upload leaves: the staging folder finished, the URL holding some files and
    no manifest. --resume says what it does, naming the URL, never the internal staging folder."""
    import s3fs

    url = "s3://bucket/killed/wds"
    packer.pack(remote_src, url, "wds", progress=False, workers=1, **PACK["wds"])
    fs = s3fs.S3FileSystem(endpoint_url=s3.url, skip_instance_cache=True)
    fs.rm_file("bucket/killed/wds/manifest.json")
    fs.rm_file("bucket/killed/wds/shard-000001.tar")
    cache = Cache()
    staging = cache.root / "staging" / cache.view(url).name
    packer.pack(remote_src, staging, "wds", progress=False, workers=1, **PACK["wds"])  # what the kill left
    capfd.readouterr()
    packer.pack(remote_src, url, "wds", progress=False, workers=1, resume=True, **PACK["wds"])
    err = capfd.readouterr().err
    assert "staging" not in err and "nothing to resume" not in err, err
    assert url in err and "uploading" in err, err
    assert stored_samples(url) == stored_samples(s3_packs["wds"])


def test_pack_storage_options_reach_the_filesystem_and_are_refused_for_a_folder(s3, s3_packs, remote_src, tmp_path):
    proxy = fault_proxy(s3.url)  # AWS_ENDPOINT_URL still names the server: only storage_options lead here
    try:
        packer.pack(remote_src, "s3://bucket/opts/lmdb", "lmdb", progress=False, workers=1,
                    storage_options={"endpoint_url": proxy.url}, cache_dir=tmp_path / "cache")
    finally:
        proxy.stop()
    assert ("PUT", "/bucket/opts/lmdb/manifest.json") in proxy.requests
    assert stored_samples("s3://bucket/opts/lmdb") == stored_samples(s3_packs["lmdb"])
    with pytest.raises(UsageError, match="storage_options and cache_dir are for a URL destination"):
        packer.pack(remote_src, tmp_path / "local", "lmdb", progress=False, storage_options={"anon": True})
    assert not (tmp_path / "local").exists()


def test_missing_bucket_and_missing_credentials_say_what_to_set(s3, remote_src, run_packer, tmp_path):
    proc = run_packer("info", "s3://no-such-bucket/ds")
    assert_one_line_error(proc, "s3://no-such-bucket/ds", code=2)
    env = {k: os.environ.pop(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    try:
        proc = run_packer("info", "s3://bucket/packs/wds", cwd=tmp_path)
    finally:
        os.environ.update(env)
    message = assert_one_line_error(proc, "s3://bucket/packs/wds", code=2)
    assert "AWS_ACCESS_KEY_ID" in message


def test_bench_a_url_counts_what_each_epoch_fetches(http_packs, local_packs, run_packer):
    url = f"{http_packs.url}/hdf5"
    proc = run_packer("bench", url, "--batch-size", "6", "--read-resize", "24", "--read-crop", "24")
    assert_ok(proc)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "samples/s" not in line}
    manifest = (local_packs / "hdf5" / "manifest.json").stat().st_size
    data = sum(f["bytes"] for f in packer.read_manifest(local_packs / "hdf5")["files"])
    assert rows["cold (empty cache)"][2:] == [f"{manifest + data:,}", "2"]  # the manifest, then data.h5
    assert rows["warm (second epoch)"][2:] == ["0", "0"]
    assert rows["local files, page cache dropped"][2:] == rows["local files, second epoch"][2:] == ["0", "0"]


@pytest.mark.distributed
def test_torchrun_pack_to_s3_each_rank_uploads_its_part(s3, remote_src, local_packs):

    url = "s3://bucket/dist/wds"
    result = torchrun("pack", remote_src, url, "--format", "wds", "--shard-samples", "4", "--quiet", "--workers", "1")
    assert result.returncode == 0, result.stderr
    manifest = packer.read_manifest(url)
    assert [p["path"] for p in manifest["parts"]] == ["part-00000", "part-00001"]
    assert stored_samples(url) == stored_samples(local_packs / "wds")
    import s3fs

    listed = s3fs.S3FileSystem(endpoint_url=s3.url, skip_instance_cache=True).find("bucket/dist/wds")
    assert sorted(p.removeprefix("bucket/dist/wds/") for p in listed) == sorted(
        ["manifest.json", *(f["path"] for f in manifest["files"])])  # the ranks' "uploaded" notes are gone

"""Readers sharing a small cache (issue 44): what one needs now waits for room while the others make progress, and
fetches ahead of need make way for it; readers that each fit alone fit together; a cache folder that cannot be
written is one line; a URL whose server cannot be reached says so, not that there is no dataset."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import noise_folder
from support.packed import free_port
from support.remote import serve_files

import packer
import packer.remote.cache as cache_module
from packer.errors import PackerError
from packer.remote.cache import STUCK_AFTER, Cache, CacheFull, when_room

pytestmark = pytest.mark.usefixtures("quick_retries")


def blob(n: int, size: int = 100) -> tuple[str, bytes]:
    data = bytes([n]) * size
    return hashlib.sha256(data).hexdigest(), data


def obtain(cache: Cache, n: int, size: int = 100):
    sha, data = blob(n, size)
    return cache.obtain(sha, len(data), lambda path: path.write_bytes(data))


def test_fetches_ahead_make_way_for_a_reader_that_waits(tmp_path):
    cache = Cache(tmp_path / "cache", limit=200)
    obtain(cache, 0).release()  # cached, evictable
    held = obtain(cache, 1)  # pinned by a reader
    ahead = when_room(lambda: obtain(cache, 2), wait=False)  # room by evicting 0: a fetch ahead takes it
    assert ahead is not None
    ahead.release()
    with cache.waiting():  # a reader (of any process) waits for room: a fetch ahead does not take it
        assert when_room(lambda: obtain(cache, 3), wait=False) is None
    waited = when_room(lambda: obtain(cache, 3))  # the reader itself evicts what is not pinned
    assert waited is not None and waited.path.read_bytes() == blob(3)[1]
    held.release()
    assert list((tmp_path / "cache" / "waiting").iterdir()) == []  # each waiter removed its file as it let go


def test_a_reader_stuck_for_a_while_is_told_apart_from_one_that_just_began_to_wait(tmp_path):
    """Blocks fetched ahead are let go only for a reader that has waited ``STUCK_AFTER`` seconds: room normally
    comes as the readers' batches go by, and a loader that let go whenever its own decoder waited a moment would
    fetch ahead no more."""
    cache = Cache(tmp_path / "cache", limit=200)
    with cache.waiting():
        assert cache.others_wait() and not cache.others_wait(STUCK_AFTER)
        [path] = (tmp_path / "cache" / "waiting").iterdir()
        began = time.time() - STUCK_AFTER - 1
        os.utime(path, (began, began))  # as if it began waiting a while ago
        assert cache.others_wait(STUCK_AFTER)
    assert not cache.others_wait(), "the waiter removed its file as it let go"


def test_a_reader_waits_while_others_make_progress(tmp_path, monkeypatch):
    """Another reader fetches a block and lets go of the one before, every 0.1 s for 1.2 s, always holding one:
    the reader that needs 200 of the 250 bytes cannot fit meanwhile, but as what the cache holds changes it waits
    past WAIT_FOR_ROOM, and gets the room once the other is done."""
    monkeypatch.setattr(cache_module, "WAIT_FOR_ROOM", 0.3)
    cache = Cache(tmp_path / "cache", limit=250)
    other = Cache(tmp_path / "cache", limit=250)  # another reader's (its own descriptors)
    held = [obtain(other, 0)]

    def churn() -> None:
        for n in range(1, 13):
            time.sleep(0.1)
            fresh = obtain(other, n)
            held.pop().release()
            held.append(fresh)
        held.pop().release()

    thread = threading.Thread(target=churn)
    thread.start()
    started = time.monotonic()
    pin = when_room(lambda: obtain(cache, 100, size=200))
    waited = time.monotonic() - started
    thread.join()
    assert pin is not None and pin.path.read_bytes() == blob(100, 200)[1]
    assert waited > 1.0  # past WAIT_FOR_ROOM, while the other made progress
    pin.release()


def test_a_reader_gives_up_when_nothing_comes_or_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "WAIT_FOR_ROOM", 0.3)
    cache = Cache(tmp_path / "cache", limit=100)
    held = obtain(cache, 0)
    started = time.monotonic()
    with pytest.raises(CacheFull, match="none came or went for 0 s") as exc:
        when_room(lambda: obtain(cache, 1))
    assert 0.3 <= time.monotonic() - started < 5 and "\n" not in str(exc.value)
    held.release()


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` made read-only: a read-only bind mount where this process may mount (root), else its
    permissions (a user's); skipped where neither holds."""
    if os.geteuid() == 0:
        made = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True)
        if made.returncode != 0:
            made = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True)
            if made.returncode == 0:
                subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        if made.returncode != 0:
            pytest.skip("root, and no mount: a read-only folder cannot be made here")
        try:
            yield
        finally:
            subprocess.run(["umount", str(folder)], check=True)
        return
    folder.chmod(0o555)
    for sub in folder.iterdir():
        sub.chmod(0o555)
    try:
        yield
    finally:
        for sub in folder.iterdir():
            sub.chmod(0o755)
        folder.chmod(0o755)


@pytest.mark.remote
def test_a_cache_folder_that_cannot_be_written_is_one_line(tmp_path):
    src = noise_folder(tmp_path / "src", 6, 8, "png")
    packer.pack(src, tmp_path / "packs" / "ds", "lmdb", progress=False, workers=1)
    cache = tmp_path / "cache"
    Cache(cache)  # its folders made, as an earlier run left them
    server = serve_files(tmp_path / "packs")
    try:
        with read_only(cache), pytest.raises(PackerError, match=r"cannot write the cache folder .*; set "
                                                                r"PACKER_CACHE_DIR or pass cache_dir to a writable "
                                                                r"folder") as exc:
            packer.open_dataset(f"{server.url}/ds", cache_dir=cache)
    finally:
        server.stop()
    assert "\n" not in str(exc.value) and str(cache) in str(exc.value)


def test_a_forked_child_never_closes_a_descriptor_it_did_not_open(tmp_path):
    """A DataLoader worker forked from a process that evicted from a bounded cache closes its copy of the
    eviction lock as it starts, and the number goes to the worker's next file (torch's socket that passes a
    batch's memory back): dropping the cache there must not close it a second time."""
    cache = Cache(tmp_path / "cache", limit=150)
    obtain(cache, 0).release()
    obtain(cache, 1).release()  # evicts blob 0: the eviction lock's descriptor is open
    evict_fd = cache._eviction[1]
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when its file under that number survives the cache's finalizer
        code = 1
        try:
            r, _ = os.pipe()
            os.dup2(r, evict_fd)  # the number, free in the child, taken by a file of its own
            del cache
            gc.collect()
            os.fstat(evict_fd)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.fstat(evict_fd)  # the parent's own is open


def test_a_server_that_cannot_be_reached_is_named_as_such(run_packer):
    url = f"http://127.0.0.1:{free_port()}/ds"  # nothing listens there: the connection is refused
    result = run_packer("info", url)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "cannot connect" in result.stderr and "no manifest.json" not in result.stderr
    assert "packer pack SRC http" not in result.stderr


@pytest.mark.remote
def test_a_missing_dataset_over_http_is_not_offered_a_pack(tmp_path, run_packer):
    (tmp_path / "empty").mkdir()
    server = serve_files(tmp_path)
    try:
        result = run_packer("info", f"{server.url}/empty")
    finally:
        server.stop()
    assert result.returncode == 2 and "no packed dataset here (no manifest.json)" in result.stderr, result.stderr
    assert "packer pack" not in result.stderr  # http(s) is read-only for packer


READER = """
import json, sys
import packer
ds = packer.open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))
loader = packer.make_loader(ds, batch_size=16, num_workers=1, shuffle=True, seed=int(sys.argv[4]))
print(json.dumps(sum(len(labels) for _, labels in loader)))
"""


@pytest.mark.remote
@pytest.mark.slow
def test_three_readers_that_each_fit_a_small_cache_fit_it_together(tmp_path):
    """Three processes read three datasets a block at a time through one cache sized for one of them: each alone
    holds up to the whole cache fetched ahead; together their fetches ahead make way for the blocks the others'
    decoders wait for, and every sample is read."""
    src = noise_folder(tmp_path / "src", 360, 16, "png")
    for fmt in ("lmdb", "hdf5", "wds"):
        packer.pack(src, tmp_path / "packs" / fmt, fmt, store="raw", progress=False, workers=1,
                    **({"shard_samples": 60} if fmt == "wds" else {}))
    smallest = min(sum(e["bytes"] for e in packer.read_manifest(tmp_path / "packs" / f)["files"])
                   for f in ("lmdb", "hdf5", "wds"))
    cache, limit = tmp_path / "cache", smallest // 4  # every dataset over it: each is read a block at a time
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    server = serve_files(tmp_path / "packs")
    try:
        for fmt in ("lmdb", "hdf5", "wds"):  # the layouts, computed once
            ds = packer.open_dataset(f"{server.url}/{fmt}", cache_dir=cache, cache_limit=limit)
            assert type(ds.reader).__name__ == "BlockedReader"
        procs = [subprocess.Popen([sys.executable, "-c", READER, f"{server.url}/{fmt}", str(cache), str(limit), str(k)],
                                  text=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for k, fmt in enumerate(("lmdb", "hdf5", "wds"))]
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        server.stop()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(f"{fmt}: {err[-3000:]}" for fmt, (_, err) in
                                                               zip(("lmdb", "hdf5", "wds"), outs, strict=True))
    assert [json.loads(out) for out, _ in outs] == [360, 360, 360]
    assert Cache(cache).used() <= limit

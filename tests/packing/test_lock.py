"""One writer per DEST: real ``packer pack`` processes into the same DEST.

The first run is held mid-conversion deterministically, with no timing: its source has many undecodable files,
each skipped with a warning on stderr, and the test does not read that pipe until it wants the run to go on. The
warnings outgrow the pipe, so the run blocks inside its conversion (DEST locked, journal written) and cannot
finish until the test reads them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import snapshot, write_image

import packer
from packer.packing.lock import OutputLock, lock_path

MARKER = ".packer-in-progress"
BAD = 1500  # undecodable files: their warnings (about 150 bytes each) are several times a pipe's 64 KiB
TIMEOUT = 300  # seconds; only a hang reaches it


@pytest.fixture(scope="module")
def noisy_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("noisy")
    for i in range(8):
        write_image(root / ("cat" if i % 2 else "dog") / f"good{i}.png", 20, 16, seed=i)
    for i in range(BAD):
        (root / "cat" / f"bad{i:04d}.jpg").write_bytes(b"not an image")
    return root


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "packer", *map(str, args)]


def start_held(src: Path, dest: Path, *extra: str) -> subprocess.Popen:
    """Start ``packer pack`` with its stderr unread, and return once it has DEST locked and its journal
    written; it then blocks on its warnings until its stderr is read."""
    proc = subprocess.Popen(cli("pack", src, dest, "--format", "lmdb", "--quiet", "--workers", "2", *extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    while not (dest / MARKER).exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first run never started converting"
        time.sleep(0.05)
    return proc


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=TIMEOUT)


def assert_busy(proc: subprocess.CompletedProcess, folder: Path, pid: int) -> None:
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"packer: error: {folder} is being written by another packer process (pid {pid} on {socket.gethostname()}); "
        "wait for it or stop it"]


def assert_verifies(dest: Path) -> None:
    proc = run("verify", dest, "--deep")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_second_writer_fails_at_once_and_the_first_finishes(noisy_src, tmp_path):
    dest = tmp_path / "ds"
    first = start_held(noisy_src, dest)
    try:
        for extra in (["--overwrite"], ["--resume"], []):
            assert_busy(run("pack", noisy_src, dest, "--format", "hdf5", "--quiet", *extra), dest, first.pid)
        assert (dest / MARKER).exists()  # --overwrite deleted nothing
    finally:
        _, err = first.communicate(timeout=TIMEOUT)  # reading its warnings lets it go on
    assert first.returncode == 0, err.splitlines()[-3:]
    assert_verifies(dest)
    assert packer.read_manifest(dest)["count"] == 8
    assert not lock_path(dest).exists()  # removed on release: nothing is left next to DEST


def test_a_killed_writer_releases_dest_and_resume_finishes(noisy_src, tmp_path):
    dest = tmp_path / "ds"
    first = start_held(noisy_src, dest)
    try:
        assert_busy(run("pack", noisy_src, dest, "--format", "lmdb", "--quiet", "--overwrite"), dest, first.pid)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.communicate(timeout=TIMEOUT)
    assert first.returncode == -signal.SIGKILL
    assert lock_path(dest).exists()  # left by the killed run, and no obstacle: the kernel released its lock
    again = run("pack", noisy_src, dest, "--format", "lmdb", "--quiet", "--workers", "2", "--resume")
    assert again.returncode == 0, again.stderr.splitlines()[-3:]
    assert_verifies(dest)
    assert packer.read_manifest(dest)["count"] == 8


def test_overwrite_never_deletes_a_part_another_rank_writes(tmp_path):
    """A rank of an earlier distributed run still writing its part (here: this test holds that part's lock) keeps
    ``--overwrite`` from emptying DEST."""
    src, dest = tmp_path / "src", tmp_path / "ds"
    for i in range(4):
        write_image(src / ("cat" if i % 2 else "dog") / f"{i}.png", 20, 16, seed=i)
    packer.pack(src, dest, "lmdb", workers=1, progress=False)
    (dest / "part-00001").mkdir()
    (dest / "part-00001" / MARKER).write_text('{"options": {}}')
    before = snapshot(dest)
    with OutputLock(dest, "part-00001"):
        assert_busy(run("pack", src, dest, "--format", "lmdb", "--quiet", "--overwrite"), dest / "part-00001",
                    os.getpid())
    assert snapshot(dest) == before
    assert packer.pack(src, dest, "lmdb", workers=1, overwrite=True, progress=False)["count"] == 4
    assert not (dest / "part-00001").exists()


def test_a_busy_dest_is_refused_before_a_remote_source_is_fetched(tmp_path):
    """A second writer fails on the lock first: the URL of its source (here a port nothing listens on) is not
    even tried."""
    dest = tmp_path / "ds"
    dest.mkdir()
    with OutputLock(dest):
        with pytest.raises(packer.errors.DestinationBusyError, match="is being written by another packer process"):
            packer.pack("http://127.0.0.1:9/packed", dest, "lmdb", progress=False)


def test_the_lock_is_the_same_however_dest_is_spelled(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert lock_path(tmp_path / "link" / "ds") == lock_path(tmp_path / "real" / "ds") == lock_path(
        tmp_path / "real" / "sub" / ".." / "ds")
    assert lock_path(tmp_path / ("n" * 250)).parent == tmp_path  # a name near the limit still gets a lock file
    assert lock_path(tmp_path / "ds", "part-00001") != lock_path(tmp_path / "ds.part-00001")


def test_a_dest_reached_through_a_symlink_and_by_its_real_path_is_one_dest(noisy_src, tmp_path):
    """Issue 23's data loss: A packs through a symbolic link, B ``--overwrite``s the same folder by its real path
    (and by a symlinked parent, ``..`` and a relative spelling) while A runs: each B is refused with the busy
    line, and A's output is intact."""
    lk = tmp_path / "lk"
    (lk / "real" / "D").mkdir(parents=True)
    (lk / "real" / "sub").mkdir()
    (lk / "L").symlink_to("real/D")
    (lk / "P").symlink_to("real")
    first = start_held(noisy_src, lk / "L")
    try:
        for spelling in (lk / "real" / "D", lk / "P" / "D", lk / "real" / "sub" / ".." / "D"):
            assert_busy(run("pack", noisy_src, spelling, "--format", "lmdb", "--quiet", "--overwrite"), spelling,
                        first.pid)
        relative = subprocess.run(cli("pack", noisy_src, "real/D", "--format", "lmdb", "--quiet", "--overwrite"),
                                  capture_output=True, text=True, timeout=TIMEOUT, cwd=lk)
        assert relative.returncode == 1, relative.stderr
        assert len(relative.stderr.splitlines()) == 1
        assert f"is being written by another packer process (pid {first.pid} " in relative.stderr
        assert (lk / "real" / "D" / MARKER).exists()  # no --overwrite deleted anything
    finally:
        _, err = first.communicate(timeout=TIMEOUT)
    assert first.returncode == 0, err.splitlines()[-3:]
    assert_verifies(lk / "real" / "D")
    assert packer.read_manifest(lk / "real" / "D")["count"] == 8


def test_the_lock_follows_symlinked_parents_and_dotdot_physically(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "to_b").symlink_to(tmp_path / "a" / "b")
    # ``c/to_b/..`` is ``a`` on disk, not ``c``: the lock goes where the folder is
    assert lock_path(tmp_path / "c" / "to_b" / ".." / "ds") == lock_path(tmp_path / "a" / "ds")
    assert lock_path(tmp_path / "c" / "to_b" / "ds", "part-00001") == lock_path(tmp_path / "a" / "b" / "ds",
                                                                                 "part-00001")
    here = os.getcwd()
    os.chdir(tmp_path / "c")
    try:
        assert lock_path("to_b/ds") == lock_path(tmp_path / "a" / "b" / "ds")
    finally:
        os.chdir(here)


@pytest.mark.remote
def test_a_second_upload_to_the_same_url_is_refused_while_the_first_runs(noisy_src, tmp_path):
    from support.remote import S3Server

    server = S3Server()
    env = dict(os.environ, PACKER_CACHE_DIR=str(tmp_path / "cache"), PACKER_RETRY_BACKOFF="0.01")
    url = "s3://bucket/busy"
    try:
        first = subprocess.Popen(cli("pack", noisy_src, url, "--format", "lmdb", "--quiet", "--workers", "2"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + TIMEOUT
        while not list((tmp_path / "cache" / "staging").glob(f"*/{MARKER}")):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first upload never started converting"
            time.sleep(0.05)
        try:
            for extra in (["--overwrite"], ["--resume"], []):
                second = subprocess.run(cli("pack", noisy_src, url, "--format", "lmdb", "--quiet", *extra),
                                        capture_output=True, text=True, timeout=TIMEOUT, env=env)
                assert second.returncode == 1, second.stderr
                assert second.stderr.splitlines() == [
                    f"packer: error: {url} is being uploaded by another packer process (pid {first.pid} on "
                    f"{socket.gethostname()}); wait for it or stop it"]
        finally:
            _, err = first.communicate(timeout=TIMEOUT)
        assert first.returncode == 0, err.splitlines()[-3:]
        info = subprocess.run(cli("verify", url), capture_output=True, text=True, timeout=TIMEOUT, env=env)
        assert info.returncode == 0, info.stdout + info.stderr
    finally:
        server.stop()

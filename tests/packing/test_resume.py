"""Interrupted conversions: the real ``packer pack`` is killed (SIGKILL, or Ctrl-C) part-way, the folder it leaves
is reported as unfinished, and ``--resume`` finishes it with exactly what an uninterrupted run gives: the same
samples in the same order, labels, relative paths and stored bytes, and for WebDataset the same shard bytes.

Kill points come from the progress journal ``DEST/.packer-in-progress``: LMDB checkpoints every
``PACKER_COMMIT_SAMPLES`` samples and WebDataset at every shard, so the test kills once the journal records a given
number of durable samples. HDF5 never checkpoints (its resume starts again), so it is killed by progress of its
temporary blob.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import stored_samples
from PIL import Image

import packer
from packer.cli import main as cli_main
from packer.errors import IncompleteDatasetError

FORMATS = ("lmdb", "hdf5", "wds")
MARKER = ".packer-in-progress"
N_IMAGES = 300
CHECKPOINT = 10  # samples per LMDB commit and per WebDataset shard
TIMEOUT = 300  # seconds; only a hang reaches it
# The same command per format; each stores differently, so resuming is checked for re-encoded and raw data too.
OPTIONS = {
    "lmdb": ["--store", "jpeg", "--resize", "56", "--quality", "85"],
    "hdf5": [],
    "wds": ["--shard-samples", str(CHECKPOINT), "--store", "raw", "--resize", "40", "--center-crop", "32"],
}
ENV = {"PACKER_COMMIT_SAMPLES": str(CHECKPOINT)}


# --------------------------------------------------------------------------------------------------------------
# running and killing packer
# --------------------------------------------------------------------------------------------------------------

def make_source(root: Path, n: int = N_IMAGES) -> Path:
    rng = np.random.default_rng(42)
    for i in range(n):
        size = (int(rng.integers(64, 129)), int(rng.integers(64, 129)))
        img = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize(size, Image.Resampling.BICUBIC)
        path = root / f"class{i % 3}" / f"img{i:04d}.{'png' if i % 4 == 0 else 'jpg'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path)
    return root


def pack_cmd(src: Path, dest: Path, fmt: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "packer", "pack", str(src), str(dest), "--format", fmt, "--quiet",
            "--workers", "2", *OPTIONS[fmt], *extra]


def journal(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def durable(dest: Path) -> int:
    """Samples the journal says are durable (-1: no journal yet)."""
    j = journal(dest)
    if j is None:
        return -1
    return (j.get("writer") or {}).get("count", 0)


def run(cmd: list[str], dest: Path, stop: Callable[[Path], bool] | None = None, sig=signal.SIGKILL,
        env: dict | None = None) -> dict:
    """Run ``cmd`` in its own process group; once ``stop(dest)`` holds, send ``sig`` to the whole group (the
    workers too, as a terminal would). Returns rc, stdout, stderr and whether it was stopped."""
    logs = dest.parent / f".{dest.name}-{time.monotonic_ns()}"
    logs.mkdir(parents=True)
    with open(logs / "out", "w") as out, open(logs / "err", "w") as err:
        # Ctrl-C with its default action, as in a terminal's foreground job: a shell that starts a non-interactive
        # background job (how a CI runner may start this suite) hands it SIGINT ignored, which Python keeps.
        # Only for SIGINT: preexec_fn is unsafe with threads, and the SIGKILL runs start from the fixture's.
        default_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sig == signal.SIGINT else None
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **ENV, **(env or {})},
                                start_new_session=True, preexec_fn=default_sigint)
        stopped = False
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            if stop is not None and not stopped and stop(dest):
                os.killpg(proc.pid, sig)
                stopped = True
            time.sleep(0.002)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"packer did not finish in {TIMEOUT}s: {' '.join(cmd)}")
    if sig != signal.SIGKILL and stopped:
        wait_group_gone(proc.pid)
    result = {"rc": proc.returncode, "stdout": (logs / "out").read_text(), "stderr": (logs / "err").read_text(),
              "stopped": stopped}
    shutil.rmtree(logs)
    return result


def wait_group_gone(pgid: int) -> None:
    """After Ctrl-C the worker processes must end too."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail("worker processes were still running 60 s after Ctrl-C")


def killed_run(cmd, dest, stop, **kw) -> dict:
    r = run(cmd, dest, stop, **kw)
    assert r["stopped"], f"the conversion ended (exit {r['rc']}) before the kill point:\n{r['stderr']}"
    return r


def at_least(n: int) -> Callable[[Path], bool]:
    return lambda dest: durable(dest) >= n


def blob_bytes(at_least_bytes: int) -> Callable[[Path], bool]:
    """HDF5: its temporary blob holds this many payload bytes (and the journal exists)."""
    def stop(dest: Path) -> bool:
        try:
            return (dest / MARKER).exists() and (dest / "data.h5.blob.tmp").stat().st_size >= at_least_bytes
        except OSError:
            return False
    return stop


def source_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.rglob("*") if p.is_file())


def kill_points(fmt: str, src: Path) -> list[Callable[[Path], bool]]:
    """Where the first run and the first resume are killed."""
    if fmt == "hdf5":
        return [blob_bytes(1), blob_bytes(source_bytes(src) // 2)]
    return [at_least(CHECKPOINT), at_least(15 * CHECKPOINT)]


# --------------------------------------------------------------------------------------------------------------
# what a dataset holds
# --------------------------------------------------------------------------------------------------------------



def digest(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def manifest(dest: Path) -> dict:
    return json.loads((dest / "manifest.json").read_text())


SAME_KEYS = ("format", "format_version", "count", "classes", "class_to_idx", "store", "transform", "shape", "dtype",
             "order", "checksum", "skipped", "hidden_skipped", "empty_classes", "shards", "class_counts")


def assert_same_dataset(dest: Path, reference: Path, fmt: str) -> None:
    got, want = manifest(dest), manifest(reference)
    for key in SAME_KEYS:
        assert got.get(key) == want.get(key), key
    assert got["resumed"] is True and want["resumed"] is False
    assert got["source"]["images"] == want["source"]["images"] == N_IMAGES
    # what `packer info` shows, counted across the interruptions (the journal keeps the durable samples' counts)
    assert sum(got["class_counts"]) == N_IMAGES
    a, b = stored_samples(dest), stored_samples(reference)
    assert len(a) == len(b) == N_IMAGES
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x == y, f"sample {i} differs: {x[:2]} vs {y[:2]}"
    if fmt == "wds":  # shards and index: byte for byte
        assert {f["path"]: f["sha256"] for f in got["files"]} == {f["path"]: f["sha256"] for f in want["files"]}
        data = {k: v for k, v in digest(dest).items() if k != "manifest.json"}  # (its timestamps differ)
        assert data == {k: v for k, v in digest(reference).items() if k != "manifest.json"}
    assert not (dest / MARKER).exists()
    leftovers = [p.name for p in dest.iterdir() if p.name.endswith((".tmp", ".partial"))]
    assert not leftovers, leftovers


def assert_incomplete(dest: Path) -> None:
    """What a killed conversion leaves: a journal and no manifest; readers, info and verify say to --resume."""
    assert (dest / MARKER).exists() and not (dest / "manifest.json").exists()
    with pytest.raises(IncompleteDatasetError, match="--resume"):
        packer.open_dataset(dest)
    for args in (["info", str(dest)], ["verify", str(dest)], ["verify", "--deep", str(dest)]):
        r = CliRunner().invoke(cli_main, args)
        assert isinstance(r.exception, SystemExit) or r.exception is None, repr(r.exception)
        assert r.exit_code != 0, (args, r.stdout)
        assert r.stderr.startswith("packer: error: ") and r.stderr.count("\n") == 1, r.stderr
        assert str(dest) in r.stderr and "--resume" in r.stderr, r.stderr


# --------------------------------------------------------------------------------------------------------------
# fixtures: the reference runs and a first interrupted run per format, started together
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("resume-src") / "images")


@pytest.fixture(scope="module")
def runs(source, tmp_path_factory):
    """{fmt: (reference future, interrupted future)}: each future gives (dest, run result). Two at a time."""
    base = tmp_path_factory.mktemp("resume-runs")
    pool = ThreadPoolExecutor(2)

    def reference(fmt):
        dest = base / f"reference-{fmt}"
        r = run(pack_cmd(source, dest, fmt), dest)
        assert r["rc"] == 0, r["stderr"]
        return dest, r

    def interrupted(fmt):
        dest = base / f"interrupted-{fmt}"
        return dest, killed_run(pack_cmd(source, dest, fmt), dest, kill_points(fmt, source)[0])

    futures = {fmt: (pool.submit(reference, fmt), pool.submit(interrupted, fmt)) for fmt in FORMATS}
    yield futures
    pool.shutdown(wait=True)


def reference(runs, fmt) -> Path:
    return runs[fmt][0].result(timeout=4 * TIMEOUT)[0]


def interrupted_copy(runs, fmt, tmp_path: Path) -> Path:
    """A copy of the first interrupted run of ``fmt``, to resume or to refuse."""
    dest = tmp_path / "ds"
    shutil.copytree(runs[fmt][1].result(timeout=4 * TIMEOUT)[0], dest)
    return dest


# --------------------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_kill_resume_kill_resume(fmt, source, runs, tmp_path):
    """Killed after the first checkpoint, resumed and killed again much later, resumed to the end: the result is
    the uninterrupted run's, sample for sample (and shard for shard)."""
    dest = interrupted_copy(runs, fmt, tmp_path)
    assert_incomplete(dest)
    first = durable(dest)
    if fmt != "hdf5":
        assert first >= CHECKPOINT and first % CHECKPOINT == 0, first

    r = killed_run(pack_cmd(source, dest, fmt, "--resume"), dest, kill_points(fmt, source)[1])
    if fmt == "hdf5":
        assert "converting again from the first image" in r["stderr"], r["stderr"]
    else:
        assert f"resuming {dest} after {first} samples" in r["stderr"], r["stderr"]
    assert_incomplete(dest)
    second = durable(dest)
    if fmt != "hdf5":
        assert second >= 15 * CHECKPOINT > first, (first, second)

    r = run(pack_cmd(source, dest, fmt, "--resume"), dest)
    assert r["rc"] == 0, r["stderr"]
    assert "Traceback" not in r["stderr"]
    if fmt != "hdf5":
        assert f"resuming {dest} after {second} samples" in r["stderr"], r["stderr"]
    assert_same_dataset(dest, reference(runs, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_killed_run_has_complete_files_only_under_final_names(fmt, runs, tmp_path):
    """What a SIGKILL leaves: no manifest, so readers, info and verify say it is unfinished; each WebDataset shard
    under its final name is complete (the uninterrupted run's, byte for byte) and any other has a .tmp name; HDF5
    has written only its .tmp files (data.h5 is written whole at the end)."""
    dest = interrupted_copy(runs, fmt, tmp_path)
    assert_incomplete(dest)
    finished = reference(runs, fmt)
    names = sorted(p.name for p in dest.iterdir())
    if fmt == "wds":
        final = [n for n in names if n.startswith("shard-") and n.endswith(".tar")]
        assert final, names
        for name in final:
            assert (dest / name).read_bytes() == (finished / name).read_bytes(), name
        assert all(n.endswith(".tmp") for n in names if n.startswith("shard-") and n not in final), names
    if fmt == "hdf5":
        assert "data.h5" not in names and "data.h5.blob.tmp" in names, names


def test_resume_before_first_checkpoint(source, runs, tmp_path):
    """Killed before anything was durable (the journal holds no writer state): --resume starts from the first
    image, says so, and still ends identical."""
    dest = tmp_path / "ds"
    killed_run(pack_cmd(source, dest, "lmdb"), dest, lambda d: durable(d) == 0)
    assert_incomplete(dest)
    first = durable(dest)  # 0, unless the first commit landed between the decision to kill and the kill
    r = run(pack_cmd(source, dest, "lmdb", "--resume"), dest)
    assert r["rc"] == 0, r["stderr"]
    if first == 0:
        assert "no finished part to keep" in r["stderr"] and "from the first image" in r["stderr"], r["stderr"]
    else:
        assert f"resuming {dest} after {first} samples" in r["stderr"], r["stderr"]
    assert_same_dataset(dest, reference(runs, "lmdb"), "lmdb")


def test_resume_finished_dataset_is_a_no_op(source, runs, tmp_path):
    dest = tmp_path / "ds"
    shutil.copytree(reference(runs, "wds"), dest)
    before = digest(dest)
    r = run(pack_cmd(source, dest, "wds", "--resume"), dest)
    assert r["rc"] == 0, r["stderr"]
    assert "already a finished dataset" in r["stderr"] and "nothing to resume" in r["stderr"], r["stderr"]
    assert digest(dest) == before


def test_resume_with_nothing_to_resume_starts_afresh(source, runs, tmp_path):
    dest = tmp_path / "new" / "ds"
    r = run(pack_cmd(source, dest, "hdf5", "--resume"), dest)
    assert r["rc"] == 0, r["stderr"]
    assert "nothing to resume" in r["stderr"] and "starting afresh" in r["stderr"], r["stderr"]
    got, want = manifest(dest), manifest(reference(runs, "hdf5"))
    assert got["resumed"] is False and got["count"] == want["count"]
    assert stored_samples(dest) == stored_samples(reference(runs, "hdf5"))


CHANGES = {
    "lmdb": (["--quality", "50"], "transform"),
    "hdf5": (["--resize", "48"], "transform"),
    "wds": (["--shard-samples", "20"], "shard_samples"),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_with_other_options_is_refused(fmt, source, runs, tmp_path):
    dest = interrupted_copy(runs, fmt, tmp_path)
    before = digest(dest)
    extra, what = CHANGES[fmt]
    cmd = pack_cmd(source, dest, fmt, "--resume")
    if "--shard-samples" in extra:
        i = cmd.index("--shard-samples")
        cmd[i + 1] = extra[1]
    else:
        cmd += extra
    r = run(cmd, dest)
    assert r["rc"] != 0 and "Traceback" not in r["stderr"], r["stderr"]
    errors = [line for line in r["stderr"].splitlines() if line.startswith("packer: error: ")]
    assert len(errors) == 1 and str(dest) in errors[0] and f"different {what}" in errors[0], r["stderr"]
    assert digest(dest) == before, "a refused --resume changed DEST"


def test_resume_with_changed_source_is_refused(tmp_path):
    """A file modified or added since the interruption: --resume refuses, DEST untouched; put back exactly as it
    was, the source resumes."""
    src = make_source(tmp_path / "src", n=120)
    dest = tmp_path / "ds"
    killed_run(pack_cmd(src, dest, "lmdb"), dest, at_least(CHECKPOINT))
    before = digest(dest)
    victim = src / "class1" / "img0001.jpg"
    original, stat = victim.read_bytes(), victim.stat()

    def refused(what: str) -> None:
        r = run(pack_cmd(src, dest, "lmdb", "--resume"), dest)
        assert r["rc"] != 0 and "Traceback" not in r["stderr"], (what, r["stderr"])
        errors = [line for line in r["stderr"].splitlines() if line.startswith("packer: error: ")]
        assert len(errors) == 1 and str(dest) in errors[0] and "different" in errors[0], (what, r["stderr"])
        assert digest(dest) == before, f"a refused --resume ({what}) changed DEST"

    victim.write_bytes(original + b"\0" * 7)  # modified
    refused("modified file")
    victim.write_bytes(original)
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    extra = src / "class2" / "zzz_new.png"
    Image.new("RGB", (70, 70)).save(extra)  # added
    refused("added file")
    extra.unlink()
    r = run(pack_cmd(src, dest, "lmdb", "--resume"), dest)
    assert r["rc"] == 0 and "resuming" in r["stderr"], r["stderr"]
    assert manifest(dest)["count"] == 120


def test_ctrl_c_while_the_pool_is_fed_is_raised_between_steps_not_inside_them():
    """A KeyboardInterrupt raised inside the executor's submit can leave its work queue's lock held, and the
    shutdown that follows waits on it forever (seen once in this suite: a Ctrl-C'd pack still waiting 5 minutes
    later). While a conversion feeds and reads its pool, Ctrl-C is noted and raised where the loop checks, or as
    the loop ends."""
    from packer.packing.convert import _ctrl_c_between_steps

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal's foreground job
    try:
        reached = []
        with pytest.raises(KeyboardInterrupt), _ctrl_c_between_steps() as check:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs signal handlers here: the default one would have raised
            reached.append("after the signal")
            check()
        assert reached == ["after the signal"]
        with pytest.raises(KeyboardInterrupt), _ctrl_c_between_steps():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            reached.append("the loop's end")
        assert reached[-1] == "the loop's end" and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ctrl_c_exits_130_and_resumes(fmt, source, runs, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it): exit 130, a message that says --resume, no
    traceback, no worker left behind; the folder then resumes to the uninterrupted result."""
    dest = tmp_path / "ds"
    stop = blob_bytes(source_bytes(source) // 3) if fmt == "hdf5" else at_least(3 * CHECKPOINT)
    r = killed_run(pack_cmd(source, dest, fmt), dest, stop, sig=signal.SIGINT)
    assert r["rc"] == 130, (r["rc"], r["stderr"])
    assert "Traceback" not in r["stderr"], r["stderr"]
    lines = r["stderr"].splitlines()
    assert lines and all(line.startswith("packer: ") for line in lines), r["stderr"]
    assert "--resume" in lines[-1] and "interrupted" in lines[-1], r["stderr"]
    assert_incomplete(dest)
    r = run(pack_cmd(source, dest, fmt, "--resume"), dest)
    assert r["rc"] == 0, r["stderr"]
    assert_same_dataset(dest, reference(runs, fmt), fmt)

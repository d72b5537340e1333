"""`--resume` recovers every kill (issue 44): a real `packer pack` killed with SIGKILL at random moments (the
first second included, and a `--resume` killed in turn) leaves a DEST that is never taken for a dataset, and
`--resume` then finishes it to the same samples and files as a clean run. The narrow windows a random kill rarely
hits (a progress record written but not yet renamed into place; a manifest beside its progress record; DEST being
emptied by `--overwrite`) are each built by hand and recovered by every command that should."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import stored_samples
from support.processes import assert_ok, packer_limited

import packer
from packer.errors import PackerError
from packer.manifest import JOURNAL, MANIFEST

FORMATS = ("lmdb", "hdf5", "wds")
OPTIONS = ("--store", "png", "--resize", "64", "--workers", "1", "--shard-samples", "16", "--quiet")
ENV = {**os.environ, "PACKER_COMMIT_SAMPLES": "16", "OMP_NUM_THREADS": "1"}


def pack(src: Path, dest: Path, fmt: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "packer", "pack", str(src), str(dest), "--format", fmt, *OPTIONS,
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finished(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def killed_at(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.communicate()


def content(dest: Path) -> tuple:
    manifest = json.loads((dest / MANIFEST).read_text())
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() and p.name != MANIFEST)
    return stored_samples(dest), manifest["count"], manifest["skipped"], files


def never_mistaken(dest: Path, clean: tuple) -> None:
    """After a kill: a DEST with a finished manifest holds the finished dataset; any other opens as no dataset."""
    if (dest / MANIFEST).is_file() and not (dest / JOURNAL).exists():
        assert content(dest) == clean
        return
    if dest.exists():
        with pytest.raises(PackerError) as info:
            packer.open_dataset(dest)
        assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def clean(sample_data, tmp_path_factory) -> dict:
    """Each format packed without a kill, and how long it took."""
    out = {}
    for fmt in FORMATS:
        dest = tmp_path_factory.mktemp("clean") / fmt
        started = time.monotonic()
        finished(pack(sample_data, dest, fmt))
        out[fmt] = (content(dest), time.monotonic() - started)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_after_kill_9_at_random_moments_equals_a_clean_run(sample_data, tmp_path, clean, fmt):
    expected, seconds = clean[fmt]
    rng = random.Random(f"44-{fmt}")
    scenarios = [[rng.uniform(0.05, 1.0)],  # the first second: imports, the scan, DEST's preparation
                 [rng.uniform(0.3, seconds), rng.uniform(0.3, seconds)]]  # a run, then its --resume, killed
    for n, kills in enumerate(scenarios):
        dest = tmp_path / f"run{n}"
        for k, moment in enumerate(kills):
            killed_at(pack(sample_data, dest, fmt, *(("--resume",) if k else ())), moment)
            never_mistaken(dest, expected)
        finished(pack(sample_data, dest, fmt, "--resume"))
        assert content(dest) == expected, kills


# -- the narrow windows, built by hand --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [(), ("--overwrite",), ("--resume",)])
def test_a_progress_record_killed_before_its_rename_is_started_afresh_by_every_command(sample_data, tmp_path, clean,
                                                                                     mode):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / (JOURNAL + ".tmp")).write_text('{"options": {"format": "hd')  # killed while writing it
    assert_ok(packer_limited("pack", sample_data, dest, "--format", "hdf5", *OPTIONS, *mode))
    assert content(dest) == clean["hdf5"][0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_kill_while_overwrite_emptied_dest_is_finished_by_resume(sample_data, tmp_path, clean, fmt):
    """--overwrite writes its progress record before it deletes the old dataset: killed in between, DEST holds
    the record and some old files, and --resume finishes with none of them left."""
    old = tmp_path / "old"
    finished(pack(sample_data, old, fmt, "--shard-samples", "4", "--resize", "48"))  # other files, more shards
    template = tmp_path / "template"
    finished(pack(sample_data, template, fmt))
    record = json.loads((template / MANIFEST).read_text())["options"]
    dest = tmp_path / "out"
    shutil.copytree(old, dest)
    (dest / MANIFEST).unlink()  # the manifest goes first
    (dest / JOURNAL).write_text(json.dumps({"options": record, "position": 0, "skipped": [], "writer": None}))
    finished(pack(sample_data, dest, fmt, "--resume"))
    assert content(dest) == clean[fmt][0]


def test_a_manifest_beside_its_progress_record_is_resumed_not_taken_as_finished(sample_data, tmp_path, clean):
    """Killed after the manifest's rename and before the progress record's removal (or while --overwrite emptied
    a finished DEST): --resume continues from the record."""
    dest = tmp_path / "out"
    finished(pack(sample_data, dest, "wds"))
    record = json.loads((dest / MANIFEST).read_text())["options"]
    (dest / JOURNAL).write_text(json.dumps({"options": record, "position": 0, "skipped": [], "writer": None}))
    for shard in sorted(dest.glob("shard-*.tar"))[::2]:
        shard.unlink()  # what an --overwrite in progress had deleted
    finished(pack(sample_data, dest, "wds", "--resume"))
    assert content(dest) == clean["wds"][0]

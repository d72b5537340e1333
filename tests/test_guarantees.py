"""The README's Guarantees, each checked where no other test file does: a file-size limit filling the "disk"
(unprivileged), LMDB map growth, no write after the manifest, EXIF orientation, DEST and SRC nested, --max-pixels
at and above Pillow's limit, and the jpeg store's PSNR bound on sample_data.
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import snapshot, stored_samples, write_image
from PIL import Image, ImageOps
from support.packed import hwc, psnr, reference

import packer
from packer.cli import main as cli_main

FORMATS = ("lmdb", "hdf5", "wds")


def cli(*args) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr); an exception other than SystemExit fails the test."""
    r = CliRunner().invoke(cli_main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r.exit_code, r.stdout, r.stderr


def one_line_error(err: str) -> str:
    assert err.startswith("packer: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> Path:
    """12 small images in 3 classes, JPEG and PNG."""
    root = tmp_path_factory.mktemp("guarantees-src")
    for i in range(12):
        write_image(root / f"c{i % 3}" / f"img{i:02d}.{'png' if i % 4 == 0 else 'jpg'}", 40 + i, 30 + i, seed=i)
    return root


# --------------------------------------------------------------------------------------------------------------
# a full "disk": a file-size limit (RLIMIT_FSIZE), which needs no privileges
# --------------------------------------------------------------------------------------------------------------

FSIZE_LIMIT = 200_000  # bytes per file: the small images fit, the large ones at the end do not
FULL_DISK_ARGS = ["--store", "raw", "--no-shuffle", "--shard-samples", "5", "--workers", "1", "--quiet"]


def limited_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.RLIM_INFINITY))


def pack_process(*args, limit: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PACKER_COMMIT_SAMPLES="5")
    return subprocess.run([sys.executable, "-m", "packer", "pack", *map(str, args)], capture_output=True, text=True,
                          encoding="utf-8", env=env, timeout=300, preexec_fn=limited_file_size if limit else None)


@pytest.fixture(scope="module")
def full_disk_source(tmp_path_factory) -> Path:
    """20 small images, then 4 of 200x200 (120 KB each stored raw) that push every format's files past the limit."""
    root = tmp_path_factory.mktemp("full-disk-src")
    for i in range(20):
        write_image(root / "a_small" / f"{i:02d}.png", 24, 24, seed=i)
    for i in range(4):
        write_image(root / "b_large" / f"{i:02d}.png", 200, 200, seed=100 + i)
    return root


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_disk_is_one_line_then_resume_gives_the_uninterrupted_result(fmt, full_disk_source, tmp_path):
    dest = tmp_path / "ds"
    r = pack_process(full_disk_source, dest, "--format", fmt, *FULL_DISK_ARGS, limit=True)
    assert r.returncode == 1, (r.returncode, r.stderr)
    line = one_line_error(r.stderr)
    # LMDB reports every failed write as EIO, so only the others can say which limit it was
    advice = ("lift any file-size limit (ulimit -f)" if fmt == "lmdb"
              else "(File too large); a file outgrew the file-size limit")
    assert f"{dest}: write failed (" in line and advice in line and line.endswith("--resume\n"), line
    assert not (dest / "manifest.json").exists() and (dest / ".packer-in-progress").exists()

    r = pack_process(full_disk_source, dest, "--format", fmt, *FULL_DISK_ARGS, "--resume", limit=False)
    assert r.returncode == 0, r.stderr
    # LMDB keeps its committed transactions and WebDataset its complete shards; HDF5 starts again
    kept = "from the first image" if fmt == "hdf5" else f"resuming {dest} after "
    assert kept in r.stderr, r.stderr
    reference_dest = tmp_path / "uninterrupted"
    packer.pack(full_disk_source, reference_dest, fmt, store="raw", shuffle=False, shard_samples=5, workers=1,
                progress=False)
    assert stored_samples(dest) == stored_samples(reference_dest)
    assert len(stored_samples(dest)) == 24


# --------------------------------------------------------------------------------------------------------------
# LMDB grows its map by itself
# --------------------------------------------------------------------------------------------------------------

def test_lmdb_map_grows_past_a_small_initial_map(full_disk_source, tmp_path, monkeypatch):
    """A pack about eight times the initial map: the map doubles as needed and every record is kept."""
    reference_dest = tmp_path / "default-map"
    packer.pack(full_disk_source, reference_dest, "lmdb", store="raw", workers=1, progress=False)
    initial = 64 << 10
    monkeypatch.setenv("PACKER_LMDB_MAP_BYTES", str(initial))
    dest = tmp_path / "small-map"
    packer.pack(full_disk_source, dest, "lmdb", store="raw", workers=1, progress=False)
    assert (dest / "data.mdb").stat().st_size > 4 * initial
    assert stored_samples(dest) == stored_samples(reference_dest)


# --------------------------------------------------------------------------------------------------------------
# a packed file is never written after its manifest exists
# --------------------------------------------------------------------------------------------------------------

def file_states(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (and ``root`` itself) with its mtime, and each file's size and sha256: a write,
    a rewrite with the same bytes, or a file created and deleted again all change it."""
    out = {".": (root.stat().st_mtime_ns,)}
    for path in sorted(root.rglob("*")):
        st = path.stat()
        content = (st.st_size, hashlib.sha256(path.read_bytes()).hexdigest()) if path.is_file() else ()
        out[str(path.relative_to(root))] = (st.st_mtime_ns, *content)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_write_after_the_manifest(fmt, small_source, tmp_path):
    dest = tmp_path / "ds"
    options = ["--format", fmt, "--store", "png", "--resize", "24", "--shard-samples", "5", "--workers", "1",
               "--quiet"]
    rc, _, err = cli("pack", small_source, dest, *options)
    assert rc == 0, err
    before = file_states(dest)

    for kwargs in ({"verify": True}, {"decode": False}, {"resize": 16, "center_crop": 12}):
        ds = packer.open_dataset(dest, **kwargs)
        for i in range(len(ds)):
            ds[i]
    for args in (["verify", dest], ["verify", "--deep", dest], ["info", dest], ["info", "--json", dest]):
        rc, _, err = cli(*args)
        assert rc == 0, (args, err)
    rc, _, err = cli("pack", small_source, dest, *options, "--resume")
    assert rc == 0 and "already a finished dataset" in err, err
    assert file_states(dest) == before


# --------------------------------------------------------------------------------------------------------------
# EXIF orientation: kept as stored by default (as ImageFolder), applied with --exif-transpose
# --------------------------------------------------------------------------------------------------------------

def test_exif_orientation_is_kept_by_default_and_applied_with_the_flag(tmp_path):
    src = tmp_path / "src"
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: shown turned 90 degrees clockwise
    path = write_image(src / "cat" / "rotated.jpg", 48, 32, seed=5, quality=95, exif=exif.tobytes())
    with Image.open(path) as img:
        as_stored = np.asarray(img.convert("RGB"))
        upright = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
    assert as_stored.shape == (32, 48, 3) and upright.shape == (48, 32, 3)

    cases = {"default": ([], as_stored), "png": (["--store", "png"], as_stored),
             "transposed": (["--store", "png", "--exif-transpose"], upright)}
    for name, (args, expected) in cases.items():
        rc, _, err = cli("pack", src, tmp_path / name, "--format", "lmdb", "--quiet", *args)
        assert rc == 0, err
        image, _ = packer.open_dataset(tmp_path / name)[0]
        assert np.array_equal(hwc(image), expected), name


# --------------------------------------------------------------------------------------------------------------
# DEST inside SRC, and SRC inside DEST: refused, nothing written
# --------------------------------------------------------------------------------------------------------------

def test_nested_source_and_destination_are_refused(small_source, tmp_path):
    src = tmp_path / "src"
    packer.pack(small_source, tmp_path / "packed", "lmdb", workers=1, progress=False)
    (tmp_path / "packed").rename(src)  # a packed dataset is a source too (a repack)
    (tmp_path / "into-src").symlink_to(src, target_is_directory=True)
    before = snapshot(tmp_path)

    attempts = [  # (DEST, extra options, what the message says)
        (src / "inner", [], "inside the source folder"),
        (tmp_path / "into-src" / "inner", [], "inside the source folder"),  # a link that leads into SRC
        (src, ["--overwrite"], "would contain the source"),  # SRC is DEST: --overwrite would delete the source
        (tmp_path, ["--overwrite"], "would contain the source"),  # SRC inside DEST
    ]
    for dest, args, words in attempts:
        rc, _, err = cli("pack", src, dest, "--format", "hdf5", "--quiet", *args)
        assert rc == 2, (dest, rc, err)
        assert words in one_line_error(err) and str(dest) in err, err
        assert snapshot(tmp_path) == before, dest


# --------------------------------------------------------------------------------------------------------------
# --max-pixels: packer refuses at the limit, before decoding, also above Pillow's own limit
# --------------------------------------------------------------------------------------------------------------

def test_max_pixels_refuses_at_the_limit_and_honours_a_limit_above_pillows(tmp_path, monkeypatch, recwarn):
    src = tmp_path / "src"
    write_image(src / "a" / "at_limit.png", 100, 60)  # 6,000 pixels
    write_image(src / "a" / "one_over.png", 6001, 1)
    write_image(src / "b" / "small.png", 20, 20)
    manifest = packer.pack(src, tmp_path / "limited", "lmdb", max_pixels=6000, workers=1, progress=False)
    assert [e["path"] for e in manifest["skipped"]] == ["a/one_over.png"]
    assert manifest["skipped"][0]["error"].endswith("6001x1 is over the 6,000-pixel limit (a decompression bomb?); "
                                                    "raise --max-pixels if the image is genuine")

    # Pillow's own limit set below these images (it warns over it and refuses at twice it): --max-pixels decides
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    manifest = packer.pack(src, tmp_path / "above-pillow", "lmdb", max_pixels=6001, workers=1, progress=False)
    assert manifest["count"] == 3 and manifest["skipped"] == []
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]
    assert Image.MAX_IMAGE_PIXELS == 1000  # restored after each image


def test_a_process_forked_while_pillows_limit_is_lifted_decodes_with_the_limit_back(tmp_path):
    """Lifting Pillow's limit takes a lock: a DataLoader worker forked while another thread held it (here: this
    thread, at the moment of the fork) must neither wait for the lock forever nor keep Pillow's limit lifted."""
    from packer.images import transforms

    data = write_image(tmp_path / "x.png", 64, 64).read_bytes()
    pillow_limit = Image.MAX_IMAGE_PIXELS
    with transforms._PILLOW_LIMIT:  # as _open_checked holds it
        transforms._lifted_from.append(pillow_limit)
        Image.MAX_IMAGE_PIXELS = None
        pid = os.fork()
        if pid == 0:
            ok = Image.MAX_IMAGE_PIXELS == pillow_limit and transforms.open_image(data, "x.png").size == (64, 64)
            os._exit(0 if ok else 3)
        Image.MAX_IMAGE_PIXELS = transforms._lifted_from.pop()
    deadline = time.monotonic() + 60  # generous: only a child stuck on the lock reaches it
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    if not done[0]:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked process waited forever for the lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0


# --------------------------------------------------------------------------------------------------------------
# the jpeg store's closeness, as the README states it
# --------------------------------------------------------------------------------------------------------------

# The worst image of sample_data at the default quality (90), measured: 28.8 dB at 56 px, 31.2 at 112, 33.6 at 224.
PSNR_BOUNDS = {(64, 56): 28.5, (128, 112): 31.0, (256, 224): 33.5}


@pytest.mark.parametrize(("resize", "crop"), list(PSNR_BOUNDS))
def test_jpeg_store_psnr_bound_on_sample_data(resize, crop, sample_data, tmp_path):
    dest = tmp_path / "ds"
    manifest = packer.pack(sample_data, dest, "lmdb", store="jpeg", resize=resize, center_crop=crop, workers=2,
                           progress=False)
    assert manifest["transform"]["quality"] == 90 and manifest["count"] == 150
    ds = packer.open_dataset(dest)
    worst = min(psnr(hwc(ds[i][0]), reference(sample_data / ds.relpath(i), resize, (crop, crop)))
                for i in range(len(ds)))
    assert worst > PSNR_BOUNDS[(resize, crop)], worst


PEAK_OF_PACK = """
import resource, sys
from packer.cli import main
try:
    main(sys.argv[1:], prog_name="packer")
except SystemExit as exc:
    if exc.code:
        raise
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _tiny_tree(root: Path, count: int, originals: list[Path]) -> Path:
    for i in range(count):
        folder = root / f"c{i % 5}"
        folder.mkdir(parents=True, exist_ok=True)
        os.link(originals[i % len(originals)], folder / f"{i:06d}.jpg")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_conversion_memory_does_not_grow_with_the_dataset(fmt, tmp_path):
    """Peak RSS of a pack 4x larger stays near the smaller one's: only a per-image index grows (tens of bytes)."""
    originals = [write_image(tmp_path / "originals" / f"{k}.jpg", 8, 8, seed=k) for k in range(4)]
    peaks, env = [], {**os.environ, "PYTHONPATH": str(Path(packer.__file__).parents[1])}
    for count in (2000, 8000):
        src = _tiny_tree(tmp_path / f"src-{count}", count, originals)
        proc = subprocess.run([sys.executable, "-c", PEAK_OF_PACK, "pack", str(src), str(tmp_path / f"{fmt}-{count}"),
                               "--format", fmt, "--store", "original", "--workers", "1", "--quiet"],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        peaks.append(int(proc.stdout.split()[-1]) / 1024)
    assert peaks[1] < peaks[0] * 1.3, f"{fmt}: peak RSS {peaks[0]:.0f} MB at 2,000 images, {peaks[1]:.0f} at 8,000"

"""The command line's promises: ``--overwrite`` deletes only what packer wrote, every error is one line with the
exit code it documents (2 for bad input, 1 for other failures), and the defects of issue 15 stay fixed.

Commands run for real: click's CliRunner for option parsing, ``python -m packer`` in a subprocess where a
process must die or exit, real packed datasets (tiny synthetic images) everywhere else."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import snapshot, write_image
from PIL import Image

import packer
from packer.cli import main
from packer.errors import DestinationError, ImageError, SourceError
from packer.images.transforms import TransformSpec, convert_file


def one_error_line(stderr: str, *names: str) -> str:
    """stderr holds exactly one line, packer's error, naming every one of ``names``; no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("packer: error: "), stderr
    assert "Traceback" not in stderr
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


def run_cli(*args, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """Two classes, three small images each."""
    root = tmp_path_factory.mktemp("guarantees") / "src"
    for c, cls in enumerate(("cat", "dog")):
        for i in range(3):
            write_image(root / cls / f"img{i}.{'png' if i % 2 else 'jpg'}", 40 + i, 30, seed=10 * c + i)
    return root


@pytest.fixture(scope="module")
def other_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("guarantees-other") / "src"
    for i in range(2):
        write_image(root / "bird" / f"b{i}.jpg", 36, 36, seed=50 + i)
    return root


def pack(source: Path, dest: Path, fmt: str = "lmdb", **kwargs) -> dict:
    return packer.pack(source, dest, fmt, workers=1, progress=False, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# --overwrite deletes only what packer wrote
# --------------------------------------------------------------------------------------------------------------
def test_issue_reproduction_keeps_the_thesis(src, tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text('{"name":"my web app"}\n')
    (app / "thesis.txt").write_text("precious\n")
    before = snapshot(app)
    proc = run_cli("pack", src, app, "--format", "lmdb", "--overwrite", "--quiet")
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc.stderr, app, "not a packer dataset", "thesis.txt")
    assert snapshot(app) == before


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_a_user_file_inside_a_dataset_blocks_overwrite(src, tmp_path, fmt):
    dest = tmp_path / "ds"
    pack(src, dest, fmt)
    (dest / "notes.txt").write_text("mine")
    (dest / "part-00000").mkdir()
    (dest / "part-00000" / "mine.bin").write_bytes(b"\0")
    before = snapshot(dest)
    with pytest.raises(DestinationError, match="notes.txt") as info:
        pack(src, dest, fmt, overwrite=True)
    assert "part-00000/mine.bin" in str(info.value)
    assert snapshot(dest) == before


def test_many_unexpected_entries_are_named_then_counted(src, tmp_path):
    dest = tmp_path / "ds"
    pack(src, dest)
    for i in range(7):
        (dest / f"user{i}.txt").write_text("x")
    with pytest.raises(DestinationError, match=r"user0\.txt, user1\.txt, user2\.txt, user3\.txt and 3 more"):
        pack(src, dest, overwrite=True)
    assert len(list(dest.glob("user*.txt"))) == 7


@pytest.mark.parametrize("manifest", ['{"name": "my web app"}', "not json", '{"format": "lmdb"}', "[]"])
def test_a_manifest_that_is_not_packers_blocks_overwrite(src, tmp_path, manifest):
    dest = tmp_path / "ds"
    dest.mkdir()
    (dest / "manifest.json").write_text(manifest)
    (dest / "data.mdb").write_bytes(b"not mine")
    with pytest.raises(DestinationError, match="not a packer dataset"):
        pack(src, dest, overwrite=True)
    assert (dest / "data.mdb").read_bytes() == b"not mine"


@pytest.mark.parametrize(("fmt", "leftovers"), [
    ("lmdb", ["lock.mdb", "loader.json", "manifest.json.tmp"]),
    ("hdf5", ["data.h5.blob.tmp", "data.h5.paths.tmp"]),
    ("wds", ["shard-000099.tar.tmp", "wds_index.partial", ".packer-in-progress.tmp"]),
])
def test_packers_own_files_are_replaced(src, other_src, tmp_path, fmt, leftovers):
    dest = tmp_path / "ds"
    pack(src, dest, fmt)
    for name in leftovers:
        (dest / name).write_bytes(b"left by packer")
    manifest = pack(other_src, dest, fmt, overwrite=True)
    assert manifest["count"] == 2
    assert not any((dest / name).exists() for name in leftovers)


def test_an_interrupted_conversion_is_replaced(src, tmp_path):
    dest = tmp_path / "ds"
    pack(src, dest, "wds")
    (dest / "manifest.json").unlink()
    (dest / ".packer-in-progress").write_text(json.dumps({"options": {"format": "wds"}, "position": 0}))
    assert pack(src, dest, "wds", overwrite=True)["count"] == 6


def test_a_distributed_dataset_is_replaced(src, tmp_path):
    dest = tmp_path / "ds"
    pack(src, dest, "lmdb")
    part = dest / "part-00001"
    part.mkdir()
    for name in ("data.mdb", "part.json", ".packer-in-progress"):
        (part / name).write_bytes(b"{}")
    assert pack(src, dest, "lmdb", overwrite=True)["count"] == 6
    assert not part.exists()


def test_a_symlinked_dest_is_never_followed_to_delete(src, tmp_path):
    real = tmp_path / "real"
    pack(src, real)
    link = tmp_path / "link"
    link.symlink_to(real)
    before = snapshot(real)
    proc = run_cli("pack", src, link, "--format", "lmdb", "--overwrite", "--quiet")
    assert proc.returncode == 2
    one_error_line(proc.stderr, link, "symbolic link")
    assert snapshot(real) == before and link.is_symlink()


@pytest.mark.parametrize("where", ["proc", "below-a-file", "long-name"])
def test_a_dest_that_cannot_be_created_is_one_line(src, tmp_path, where):
    dest = {"proc": Path("/proc/packer-cannot-be-here/ds"), "below-a-file": tmp_path / "file.bin" / "ds",
            "long-name": tmp_path / ("n" * 300)}[where]
    (tmp_path / "file.bin").write_bytes(b"keep")
    proc = run_cli("pack", src, dest, "--format", "lmdb", "--quiet")
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc.stderr, dest)
    assert (tmp_path / "file.bin").read_bytes() == b"keep"


# --------------------------------------------------------------------------------------------------------------
# Every usage error is one line, exit 2
# --------------------------------------------------------------------------------------------------------------
USAGE_ERRORS = [
    (["pack", "S", "D", "--format", "zip"], "--format"),
    (["pack", "S", "D"], "--format"),
    (["pack", "S"], "DEST"),
    (["pack"], "SRC"),
    (["pack", "S", "D", "--format", "lmdb", "--store", "gif"], "--store"),
    (["pack", "S", "D", "--format", "lmdb", "--resize", "0"], "--resize"),
    (["pack", "S", "D", "--format", "lmdb", "--resize", "abc"], "--resize"),
    (["pack", "S", "D", "--format", "lmdb", "--resize", "20x0"], "--resize"),
    (["pack", "S", "D", "--format", "lmdb", "--max-size", "0"], "--max-size"),
    (["pack", "S", "D", "--format", "lmdb", "--center-crop", "-3"], "--center-crop"),
    (["pack", "S", "D", "--format", "lmdb", "--interpolation", "cubic"], "--interpolation"),
    (["pack", "S", "D", "--format", "lmdb", "--quality", "0"], "--quality"),
    (["pack", "S", "D", "--format", "lmdb", "--quality", "101"], "--quality"),
    (["pack", "S", "D", "--format", "lmdb", "--mode", "CMYK"], "--mode"),
    (["pack", "S", "D", "--format", "lmdb", "--mean", "a,b"], "--mean"),
    (["pack", "S", "D", "--format", "lmdb", "--std", ""], "--std"),
    (["pack", "S", "D", "--format", "lmdb", "--dtype", "int8"], "--dtype"),
    (["pack", "S", "D", "--format", "lmdb", "--workers", "0"], "--workers"),
    (["pack", "S", "D", "--format", "lmdb", "--seed", "x"], "--seed"),
    (["pack", "S", "D", "--format", "wds", "--shard-size", "0"], "--shard-size"),
    (["pack", "S", "D", "--format", "wds", "--shard-size", "lots"], "--shard-size"),
    (["pack", "S", "D", "--format", "wds", "--shard-samples", "0"], "--shard-samples"),
    (["pack", "S", "D", "--format", "lmdb", "--max-pixels", "0"], "--max-pixels"),
    (["pack", "S", "D", "--format", "lmdb", "--bogus"], "--bogus"),
    (["pack", "S", "D", "--format"], "--format"),
    (["info"], "DEST"),
    (["info", "D", "--bogus"], "--bogus"),
    (["export", "D"], "OUT"),
    (["export", "D", "O", "--bogus"], "--bogus"),
    (["verify"], "DEST"),
    (["verify", "D", "--deep=x"], "--deep"),
    (["bench", "--batch-size", "0"], "--batch-size"),
    (["bench", "--epochs", "0"], "--epochs"),
    (["bench", "--step-ms", "-1"], "--step-ms"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--prefetch-factor", "0"], "--prefetch-factor"),
    (["bench", "--disk-test-mb", "-1"], "--disk-test-mb"),
    (["bench", "--bogus"], "--bogus"),
    (["frobnicate"], "frobnicate"),
    (["--bogus"], "--bogus"),
]


@pytest.mark.parametrize(("args", "named"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_are_one_line_exit_2(args, named):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stdout == ""
    line = one_error_line(result.stderr, named)
    assert "--help" in line  # where to read more


def test_usage_error_in_a_real_process(tmp_path):
    proc = run_cli("pack", tmp_path, tmp_path / "d", "--format", "zip")
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_error_line(proc.stderr).startswith("packer: error: --format: 'zip' is not one of")


# --------------------------------------------------------------------------------------------------------------
# Defects of issue 15
# --------------------------------------------------------------------------------------------------------------
def test_resume_on_a_finished_dest_checks_source_and_options(src, other_src, tmp_path):
    dest = tmp_path / "ds"
    assert run_cli("pack", src, dest, "--format", "lmdb", "--quiet").returncode == 0
    before = snapshot(dest)
    for args in ([other_src, dest, "--format", "lmdb"], [src, dest, "--format", "hdf5"],
                 [src, dest, "--format", "lmdb", "--resize", "32"], [other_src, dest, "--format", "hdf5"]):
        proc = run_cli("pack", *args, "--resume", "--quiet")
        assert proc.returncode == 2, (args, proc.stderr)
        one_error_line(proc.stderr, dest, "finished dataset", "--overwrite")
    assert snapshot(dest) == before
    proc = run_cli("pack", src, dest, "--format", "lmdb", "--resume", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "already a finished dataset" in proc.stderr
    assert snapshot(dest) == before


def test_export_into_the_source_folder_is_refused(src, tmp_path):
    dest = tmp_path / "ds"
    pack(src, dest, store="png", resize=16)
    before = snapshot(src)
    for out in (src, src / "cat", src.parent):
        proc = run_cli("export", dest, out, "--overwrite", "--quiet")
        assert proc.returncode == 2, proc.stderr
        one_error_line(proc.stderr, out, "source folder")
    assert snapshot(src) == before


@pytest.mark.parametrize("extra", ["notes.txt", "cat/notes.txt", "cat/deep/readme.md", "top.jpg"])
def test_export_overwrite_only_replaces_a_previous_export(src, tmp_path, extra):
    dest = tmp_path / "ds"
    pack(src, dest)
    out = tmp_path / "out"
    packer.export(dest, out, progress=False)
    (out / extra).parent.mkdir(parents=True, exist_ok=True)
    (out / extra).write_text("mine")
    before = snapshot(out)
    proc = run_cli("export", dest, out, "--overwrite", "--quiet")
    assert proc.returncode == 2
    one_error_line(proc.stderr, out, extra)
    assert snapshot(out) == before
    (out / extra).unlink()
    assert run_cli("export", dest, out, "--overwrite", "--quiet").returncode == 0
    assert sorted(p.name for p in out.rglob("*.*")) == sorted(p.name for p in src.rglob("*.*"))


def test_a_symlinked_out_is_refused(src, tmp_path):
    dest = tmp_path / "ds"
    pack(src, dest)
    real = tmp_path / "real"
    packer.export(dest, real, progress=False)
    link = tmp_path / "link"
    link.symlink_to(real)
    before = snapshot(real)
    proc = run_cli("export", dest, link, "--overwrite", "--quiet")
    assert proc.returncode == 2
    one_error_line(proc.stderr, link, "symbolic link")
    assert snapshot(real) == before


@pytest.mark.parametrize("args", [
    ["--std", "0,0,0"], ["--std", "0.2,-0.1,0.3"], ["--mean", "0.5,0.5,0.5,0.5"], ["--mean", "0.5,0.5"],
    ["--mean", "nan,0,0"], ["--std", "inf,1,1"], ["--mode", "L", "--mean", "0.1,0.2,0.3"],
])
def test_normalisation_options_are_checked_up_front(src, tmp_path, args):
    dest = tmp_path / "ds"
    proc = run_cli("pack", src, dest, "--format", "lmdb", "--normalize", "--quiet", *args)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc.stderr, args[-2])
    assert not dest.exists()


def test_mode_l_normalises_with_one_value_per_channel(src, tmp_path):
    manifest = pack(src, tmp_path / "ds", normalize=True, mode="L", mean=(0.5,), std=(0.25,))
    assert list(manifest["transform"]["mean"]) == [0.5] and list(manifest["transform"]["std"]) == [0.25]


@pytest.mark.parametrize(("size", "args"), [((1, 20000), ["--resize", "256", "--store", "raw"]),
                                            ((20000, 10), ["--resize", "256"])])
def test_an_image_that_resizes_too_large_is_skipped(src, tmp_path, size, args):
    folder = tmp_path / "src"
    for path in src.rglob("*.*"):
        (folder / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        (folder / path.relative_to(src)).write_bytes(path.read_bytes())
    strip = folder / "cat" / "strip.png"
    Image.new("L", size).save(strip, optimize=True)
    if size == (1, 20000):
        assert strip.stat().st_size < 400  # the issue's 157-byte PNG: a tiny file
    dest = tmp_path / "ds"
    proc = run_cli("pack", folder, dest, "--format", "lmdb", "--workers", "1", "--quiet", *args)
    assert proc.returncode == 0, proc.stderr
    assert "cat/strip.png" in proc.stderr and "pixel limit" in proc.stderr
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["count"] == 6
    assert [e["path"] for e in manifest["skipped"]] == ["cat/strip.png"]


def test_max_pixels_bounds_the_output_too(src, tmp_path):
    # 40x30 images resized to 200 give 266x200 pixels: over a limit of 40,000 although every source is under it
    with pytest.raises(SourceError, match="none of the 6 images"):
        pack(src, tmp_path / "ds", resize=200, store="png", max_pixels=40_000)
    assert pack(src, tmp_path / "ds", resize=200, store="png", max_pixels=60_000)["count"] == 6


def test_a_killed_worker_is_one_line_and_resume_continues(src, tmp_path):
    dest = tmp_path / "ds"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from packer.sources import folder as sources
        convert = sources.FolderSampleReader.convert
        parent = os.getpid()

        def dying(self, index, spec):
            if os.getpid() != parent and index == 4:
                os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
            return convert(self, index, spec)

        sources.FolderSampleReader.convert = dying
        from packer.cli import main
        sys.argv = ["packer", "pack", {str(src)!r}, {str(dest)!r}, "--format", "lmdb", "--workers", "2", "--quiet"]
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    one_error_line(proc.stderr, dest, "worker", "died", "--resume")
    proc = run_cli("pack", src, dest, "--format", "lmdb", "--workers", "2", "--resume", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((dest / "manifest.json").read_text())["count"] == 6


@pytest.mark.parametrize("store", ["raw", "png"])
def test_export_of_x_jpg_and_x_png_keeps_both(tmp_path, store):
    folder = tmp_path / "src"
    write_image(folder / "cat" / "x.jpg", 20, 20, seed=1)
    write_image(folder / "cat" / "x.png", 20, 20, seed=2)
    write_image(folder / "cat" / "x.jpg.png", 20, 20, seed=3)
    dest = tmp_path / "ds"
    pack(folder, dest, store=store, resize="16x16")
    out = tmp_path / "out"
    result = packer.export(dest, out, progress=False)
    assert result["count"] == 3
    exported = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert len(exported) == 3 and "cat/x.png" in exported and "cat/x.jpg.png" in exported
    ds = packer.open_dataset(dest, decode=False)
    stored = {ds.relpath(i): ds.raw_sample(i)[0] for i in range(len(ds))}
    with Image.open(out / "cat" / "x.png") as img:  # x.png keeps its own name and its own pixels
        pixels = img.tobytes()
    expected = stored["cat/x.png"]
    if store == "png":
        expected = Image.open(io.BytesIO(bytes(expected)))
    assert pixels == expected.tobytes()


def test_a_failed_export_leaves_no_out(src, tmp_path):
    dest = tmp_path / "ds"
    pack(src, dest, "hdf5", store="png", resize="16x16")
    import h5py

    with h5py.File(dest / "data.h5", "r+") as f:  # damage the last sample: export fails after writing others
        offsets = f["offsets"][:]
        f["images"][offsets[-2] + 40] ^= 0xFF
    out = tmp_path / "out"
    proc = run_cli("export", dest, out, "--quiet")
    assert proc.returncode == 1, proc.stderr
    one_error_line(proc.stderr)
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # neither OUT nor its partial sibling


def test_info_on_an_image_folder_says_so(src):
    proc = run_cli("info", src)
    assert proc.returncode == 1
    line = one_error_line(proc.stderr, src, "image folder", "packer pack")
    assert "did not finish" not in line


def test_decode_errors_hold_no_addresses(src, tmp_path):
    folder = tmp_path / "src"
    write_image(folder / "cat" / "ok.jpg", 20, 20)
    (folder / "cat" / "junk.jpg").write_bytes(b"this is not an image at all")
    first = pack(folder, tmp_path / "a", store="jpeg", resize=16)
    second = pack(folder, tmp_path / "b", store="jpeg", resize=16)
    assert first["skipped"] == second["skipped"] and len(first["skipped"]) == 1
    assert "0x" not in first["skipped"][0]["error"] and "BytesIO" not in first["skipped"][0]["error"]


def test_a_deleted_file_is_reported_as_deleted(tmp_path):
    path = write_image(tmp_path / "gone.jpg", 20, 20)
    path.unlink()
    with pytest.raises(ImageError) as info:
        convert_file(str(path), "cat/gone.jpg", TransformSpec())
    assert "deleted" in info.value.reason and "permission" not in info.value.reason


@pytest.mark.parametrize(("kwargs", "named"), [({"resize": 0}, "--resize"), ({"center_crop": "0x4"}, "--center-crop"),
                                               ({"shard_size": 0}, "--shard-size"),
                                               ({"shard_samples": 0}, "--shard-samples")])
def test_bad_sizes_name_their_option_in_python_too(src, tmp_path, kwargs, named):
    with pytest.raises(ValueError, match=named):
        packer.pack(src, tmp_path / "ds", "wds", progress=False, **kwargs)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("existing", [False, True])
def test_a_pack_that_read_nothing_can_run_again(tmp_path, existing):
    folder = tmp_path / "src"
    for cls in ("cat", "dog"):
        (folder / cls).mkdir(parents=True)
        (folder / cls / "broken.jpg").write_bytes(b"\xff\xd8 not really")
    dest = tmp_path / "ds"
    if existing:
        dest.mkdir()
    for _ in range(2):  # the same command again fails the same way, not on a DEST left behind
        proc = run_cli("pack", folder, dest, "--format", "wds", "--quiet")
        assert proc.returncode == 2, proc.stderr
        assert "none of the 2 images could be read" in proc.stderr and "Traceback" not in proc.stderr
        assert dest.exists() == existing and (not existing or not any(dest.iterdir()))

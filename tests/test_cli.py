"""The real ``packer`` command, run in a subprocess (``python -m packer``): exit codes, one-line errors without
tracebacks, warnings, options, ``packer info``. Packed output is checked with the independent readers of
test_pack (py-lmdb, h5py, tarfile, webdataset), never with packer's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import imagefolder_reference, write_image
from support.processes import assert_ok, assert_one_line_error
from support.readers import FORMATS, check_packed, read_manifest, read_wds_tar

import packer
from packer.errors import UsageError


@pytest.fixture(scope="module")
def cli_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "src"
    for i in range(6):
        write_image(root / "ant" / f"a{i}.jpg", 50 + 3 * i, 70 - 2 * i, seed=i)
        write_image(root / "bee" / "sub dir" / f"b{i}.PNG", 64, 40 + i, seed=20 + i)
    write_image(root / "bee" / "café ünï.jpg", 44, 44, seed=40)
    write_image(root / "bee" / "gray.jpg", 60, 52, seed=41, mode="L")
    (root / "zz_empty").mkdir()
    return root


# --------------------------------------------------------------------------------------------------------------
# The command itself
# --------------------------------------------------------------------------------------------------------------
def test_version(run_packer):
    proc = run_packer("--version")
    assert_ok(proc)
    assert packer.__version__ in proc.stdout


def test_python_dash_m_help(run_packer):
    proc = run_packer("--help")
    assert_ok(proc)
    assert "pack" in proc.stdout and "info" in proc.stdout
    proc = run_packer("pack", "--help")
    assert_ok(proc)
    for option in ("--format", "--store", "--resize", "--max-size", "--center-crop", "--mode", "--shuffle",
                   "--seed", "--shard-size", "--shard-samples", "--strict", "--overwrite", "--include-hidden",
                   "--workers", "--normalize"):
        assert option in proc.stdout


def test_console_script(tmp_path):
    script = Path(sys.executable).parent / "packer"
    if not script.exists():
        pytest.skip("the packer console script is not installed next to this interpreter")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and packer.__version__ in proc.stdout


# --------------------------------------------------------------------------------------------------------------
# Packing through the CLI
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_each_format(run_packer, cli_src, tmp_path, fmt):
    dest = tmp_path / "out"
    proc = run_packer("pack", cli_src, dest, "--format", fmt, "--store", "raw", "--resize", "40x30",
                      "--center-crop", "32", "--quiet", "--workers", "2")
    assert_ok(proc)
    assert "14 images" in proc.stdout and "3 classes" in proc.stdout
    assert "zz_empty" in proc.stderr and "index 2" in proc.stderr  # the empty class warning
    manifest, _ = check_packed(dest, fmt, cli_src, store="raw", resize=(40, 30), crop=(32, 32))
    assert manifest["shape"] == [32, 32, 3] and manifest["empty_classes"] == ["zz_empty"]


CLI_OPTION_CASES = [
    ("hdf5", ["--store", "png", "--resize", "36", "--max-size", "40", "--mode", "L", "--interpolation", "nearest"],
     {"store": "png", "resize": 36, "max_size": 40, "mode": "L", "interpolation": "nearest"}),
    ("wds", ["--normalize", "--dtype", "float32", "--mean", "0.5,0.5,0.5", "--std", "0.25,0.25,0.25",
             "--center-crop", "24x20", "--max-size", "30"],
     {"store": "raw", "normalize": True, "dtype": "float32", "mean": (0.5,) * 3, "std": (0.25,) * 3,
      "crop": (24, 20), "max_size": 30}),
]


@pytest.mark.parametrize(("fmt", "args", "expect"), CLI_OPTION_CASES, ids=["png-L", "normalize"])
def test_pack_options(run_packer, cli_src, tmp_path, fmt, args, expect):
    dest = tmp_path / "out"
    assert_ok(run_packer("pack", cli_src, dest, "--format", fmt, "--quiet", *args))
    check_packed(dest, fmt, cli_src, **expect)


def test_workers_give_identical_shards(run_packer, cli_src, tmp_path):
    for n in ("1", "2"):
        assert_ok(run_packer("pack", cli_src, tmp_path / n, "--format", "wds", "--store", "jpeg", "--resize", "33",
                             "--workers", n, "--quiet"))
    names = sorted(p.name for p in (tmp_path / "1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "2").iterdir())
    assert sum(n.endswith(".tar") for n in names) >= 8  # the default makes at least 8 shards
    for name in names:
        if name != "manifest.json":
            assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name
    check_packed(tmp_path / "2", "wds", cli_src, store="jpeg", resize=33)


def test_shuffle_and_seed(run_packer, cli_src, tmp_path):
    """Same seed, same order is checked through the API in test_pack; here: the flags reach it."""
    scan_order = [rel for rel, _ in imagefolder_reference(cli_src)[2]]
    for name, args in {"default": [], "plain": ["--no-shuffle", "--seed", "7"]}.items():
        assert_ok(run_packer("pack", cli_src, tmp_path / name, "--format", "wds", "--quiet", *args))
    order = {name: [r.relpath for r in read_wds_tar(tmp_path / name, read_manifest(tmp_path / name))]
             for name in ("default", "plain")}
    assert sorted(order["default"]) == sorted(scan_order) and order["default"] != scan_order
    assert order["plain"] == scan_order
    assert read_manifest(tmp_path / "default")["order"] == {"shuffle": True, "seed": 0}
    # lmdb: scan order unless --shuffle
    assert_ok(run_packer("pack", cli_src, tmp_path / "lmdb", "--format", "lmdb", "--quiet", "--shuffle",
                         "--seed", "7"))
    shuffled = [r.relpath for r in check_packed(tmp_path / "lmdb", "lmdb", cli_src, store="original",
                                                ordered=False)[1]]
    assert shuffled != scan_order
    assert read_manifest(tmp_path / "lmdb")["order"] == {"shuffle": True, "seed": 7}


def test_shard_size(run_packer, cli_src, tmp_path):
    assert_ok(run_packer("pack", cli_src, tmp_path / "b", "--format", "wds", "--shard-size", "30KB", "--quiet"))
    manifest = read_manifest(tmp_path / "b")
    sizes = [(tmp_path / "b" / s["path"]).stat().st_size for s in manifest["shards"]]
    assert max(sizes) <= 30_000, sizes
    check_packed(tmp_path / "b", "wds", cli_src, store="original")


def test_hidden_entries(run_packer, tmp_path):
    src = tmp_path / "src"
    write_image(src / "cat" / "ok.jpg", seed=1)
    write_image(src / "cat" / ".hidden.png", seed=2)
    write_image(src / "cat" / ".thumbs" / "t.jpg", seed=3)
    write_image(src / ".ipynb_checkpoints" / "c.jpg", seed=4)
    (src / "cat" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    proc = run_packer("pack", src, tmp_path / "skip", "--format", "hdf5", "--quiet")
    assert_ok(proc)
    warnings = [line for line in proc.stderr.splitlines() if "hidden" in line]
    assert len(warnings) == 1 and "4 hidden" in warnings[0] and "--include-hidden" in warnings[0]
    manifest, _ = check_packed(tmp_path / "skip", "hdf5", src, store="original")
    assert manifest["hidden_skipped"] == 4 and manifest["count"] == 1

    proc = run_packer("pack", src, tmp_path / "keep", "--format", "hdf5", "--quiet", "--include-hidden")
    assert_ok(proc)
    assert "hidden" not in proc.stderr
    manifest, _ = check_packed(tmp_path / "keep", "hdf5", src, store="original", include_hidden=True)
    assert manifest["count"] == 4 and manifest["classes"] == [".ipynb_checkpoints", "cat"]


# --------------------------------------------------------------------------------------------------------------
# Unreadable images, bad sources, existing destinations
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture
def broken_src(tmp_path) -> Path:
    root = tmp_path / "broken"
    for i in range(3):
        write_image(root / "a" / f"ok{i}.jpg", seed=i)
        write_image(root / "b" / f"ok{i}.png", seed=10 + i)
    full = (root / "a" / "ok0.jpg").read_bytes()
    (root / "a" / "truncated café.jpg").write_bytes(full[: len(full) // 2])
    (root / "b" / "empty.jpg").write_bytes(b"")
    (root / "b" / "text.png").write_text("hello, I am not a PNG\n")
    return root


BROKEN = ("a/truncated café.jpg", "b/empty.jpg", "b/text.png")


def test_unreadable_images_are_skipped_with_a_warning(run_packer, broken_src, tmp_path, tree_snapshot):
    store = "jpeg"
    before = tree_snapshot(broken_src)
    proc = run_packer("pack", broken_src, tmp_path / "out", "--format", "wds", "--store", store, "--quiet")
    assert_ok(proc)
    assert "3 skipped" in proc.stdout
    for rel in BROKEN:
        lines = [line for line in proc.stderr.splitlines() if str(broken_src / rel) in line]
        assert len(lines) == 1 and lines[0].startswith("packer: warning: skipped"), proc.stderr
    manifest, _ = check_packed(tmp_path / "out", "wds", broken_src, store=store, skipped=BROKEN)
    assert sorted(e["path"] for e in manifest["skipped"]) == sorted(BROKEN)
    assert all(isinstance(e["error"], str) and e["error"] for e in manifest["skipped"])
    assert tree_snapshot(broken_src) == before


def test_strict_fails_on_the_first_unreadable_image(run_packer, broken_src, tmp_path, tree_snapshot):
    before = tree_snapshot(broken_src)
    dest = tmp_path / "out"
    proc = run_packer("pack", broken_src, dest, "--format", "hdf5", "--strict", "--quiet")
    error = assert_one_line_error(proc)
    assert any(str(broken_src / rel) in error for rel in BROKEN), error
    assert not (dest / "manifest.json").exists()
    assert tree_snapshot(broken_src) == before


def _no_class_folder(root: Path) -> Path:
    write_image(root / "top.jpg")
    return root


def _no_images(root: Path) -> Path:
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "notes.txt").write_text("no images here")
    (root / "dog").mkdir()
    return root


def _a_file(root: Path) -> Path:
    return write_image(root / "just_a_file.jpg")


@pytest.mark.parametrize("make_source", [lambda root: root / "does_not_exist", _no_class_folder, _no_images, _a_file],
                         ids=["missing", "no-class-folder", "no-images", "a-file"])
def test_bad_source(run_packer, tmp_path, tree_snapshot, make_source):
    (tmp_path / "given").mkdir()
    src = make_source(tmp_path / "given")
    before = tree_snapshot(tmp_path / "given")
    dest = tmp_path / "out"
    proc = run_packer("pack", src, dest, "--format", "lmdb", "--quiet")
    assert_one_line_error(proc, src, code=2)
    assert not dest.exists()
    assert tree_snapshot(tmp_path / "given") == before


def test_existing_user_folder_is_never_touched(run_packer, cli_src, tmp_path, tree_snapshot):
    dest = tmp_path / "mine"
    (dest / "sub").mkdir(parents=True)
    (dest / "thesis.txt").write_text("irreplaceable")
    (dest / "sub" / "data.bin").write_bytes(bytes(range(256)))
    before = tree_snapshot(dest)
    assert_one_line_error(run_packer("pack", cli_src, dest, "--format", "lmdb", "--quiet"), dest)
    assert tree_snapshot(dest) == before
    # --overwrite only ever replaces a packer dataset
    assert_one_line_error(run_packer("pack", cli_src, dest, "--format", "lmdb", "--quiet", "--overwrite"), dest)
    assert tree_snapshot(dest) == before


def test_existing_dataset_needs_overwrite(run_packer, cli_src, broken_src, tmp_path, tree_snapshot):
    fmt = "lmdb"
    dest = tmp_path / "out"
    assert_ok(run_packer("pack", cli_src, dest, "--format", fmt, "--quiet"))
    before = tree_snapshot(dest)
    proc = run_packer("pack", broken_src, dest, "--format", fmt, "--quiet")
    assert "--overwrite" in assert_one_line_error(proc, dest)
    assert tree_snapshot(dest) == before
    check_packed(dest, fmt, cli_src, store="original")
    assert_ok(run_packer("pack", broken_src, dest, "--format", fmt, "--quiet", "--overwrite"))
    check_packed(dest, fmt, broken_src, store="original", skipped=BROKEN)


def test_destination_inside_source_is_refused(run_packer, cli_src, tree_snapshot):
    before = tree_snapshot(cli_src)
    dest = cli_src / "ant" / "packed"
    assert_one_line_error(run_packer("pack", cli_src, dest, "--format", "wds", "--quiet"), dest)
    assert tree_snapshot(cli_src) == before


@pytest.mark.parametrize(("args", "shown"), [
    (["--resize", "abc"], "abc"),
    (["--center-crop", "20x0"], "20x0"),
    (["--store", "original", "--resize", "32"], "original"),
])
def test_bad_option_values_are_one_line_errors(run_packer, cli_src, tmp_path, args, shown):
    dest = tmp_path / "out"
    proc = run_packer("pack", cli_src, dest, "--format", "lmdb", "--quiet", *args)
    assert_one_line_error(proc, shown)
    assert not dest.exists()


@pytest.mark.parametrize("args", [["--max-size", "0"], ["--shard-size", "lots"], ["--format", "zip"], [],
                                  ["--workers", "0"]])
def test_usage_errors(run_packer, cli_src, tmp_path, args):
    cmd = ["pack", cli_src, tmp_path / "out", *(args if args == [] or args[0] == "--format" else
                                                ["--format", "lmdb", *args])]
    proc = run_packer(*cmd)
    assert_one_line_error(proc, args[0] if args else "--format", code=2)
    assert not (tmp_path / "out").exists()


def test_bad_input_in_python_is_a_usage_error_and_a_value_error(cli_src, tmp_path):
    for kwargs in ({"format": "zip"}, {"format": "lmdb", "store": "original", "resize": 32},
                   {"format": "wds", "shard_samples": 0}, {"format": "lmdb", "label_key": "cls"}):
        with pytest.raises(UsageError) as info:
            packer.pack(cli_src, tmp_path / "out", progress=False, **kwargs)
        assert isinstance(info.value, ValueError) and info.value.exit_code == 2
    with pytest.raises(TypeError, match="'bogus'"):
        packer.pack(cli_src, tmp_path / "out", "lmdb", bogus=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_bug_is_one_line_exit_1_with_the_traceback_only_under_packer_debug(debug):
    """Any exception that is not a PackerError is packer's bug, whatever its type (a ValueError too)."""
    code = "from packer.cli import handle_errors\nhandle_errors(lambda: int('x'))()"
    env = {k: v for k, v in os.environ.items() if k != "PACKER_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, **({"PACKER_DEBUG": debug} if debug else {})})
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[-1] == ("packer: internal error: ValueError: invalid literal for int() with base 10: 'x'; rerun "
                         "with PACKER_DEBUG=1 for the traceback and report it")
    if debug:
        assert lines[0] == "Traceback (most recent call last):"
    else:
        assert len(lines) == 1


# --------------------------------------------------------------------------------------------------------------
# packer info
# --------------------------------------------------------------------------------------------------------------
def test_info(run_packer, cli_src, tmp_path):
    fmt = "wds"
    dest = tmp_path / "out"
    assert_ok(run_packer("pack", cli_src, dest, "--format", fmt, "--store", "jpeg", "--resize", "32",
                         "--center-crop", "30", "--quiet", "--shard-samples", "5"))
    proc = run_packer("info", dest)
    assert_ok(proc)
    out = proc.stdout
    assert "14 images" in out and "3 classes" in out and fmt in out and "jpeg" in out
    assert "ant, bee, zz_empty" in out and packer.__version__ in out
    assert "3 shards" in out and [s["count"] for s in read_manifest(dest)["shards"]] == [5, 5, 4]
    proc = run_packer("info", dest, "--json")
    assert_ok(proc)
    assert json.loads(proc.stdout) == read_manifest(dest)


def test_info_errors(run_packer, tmp_path, cli_src):
    missing = tmp_path / "nowhere"
    assert_one_line_error(run_packer("info", missing), missing)
    half = tmp_path / "half"
    half.mkdir()
    (half / "data.mdb").write_bytes(b"\0" * 100)
    assert_one_line_error(run_packer("info", half), half)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    assert_one_line_error(run_packer("info", bad), bad)


def test_info_gives_class_counts_and_webdataset_a_brace_pattern(run_packer, cli_src, tmp_path):
    """`packer info` prints samples per class and in total, and on wds the shards as a brace pattern that the
    webdataset library expands as is."""
    import webdataset

    dest = tmp_path / "out"
    assert_ok(run_packer("pack", cli_src, dest, "--format", "wds", "--quiet", "--shard-samples", "5"))
    proc = run_packer("info", dest)
    assert_ok(proc)
    assert [line.split() for line in proc.stdout.split("samples per class:\n")[1].splitlines()[:4]] == [
        ["ant", "6"], ["bee", "8"], ["zz_empty", "0"], ["total", "14"]]
    pattern = next(line.split("webdataset: ", 1)[1] for line in proc.stdout.splitlines() if "webdataset: " in line)
    assert pattern == f"{dest}/shard-{{000000..000002}}.tar"
    assert sum(1 for _ in webdataset.WebDataset(pattern, shardshuffle=False)) == 14


def test_verify_shows_a_progress_bar_on_a_terminal_and_warnings_on_their_own_lines(cli_src, tmp_path):
    """On a terminal, `packer verify --deep` draws a bar on stderr; a warning printed while a bar is up gets a line
    of its own (tqdm.write), not the end of the bar's line."""
    import fcntl
    import pty
    import struct
    import termios

    dest = tmp_path / "out"
    packer.pack(cli_src, dest, format="lmdb", progress=False)
    code = ("import sys; from tqdm import tqdm; from packer.errors import warn; from packer.verify import verify\n"
            "bar = tqdm(total=2, desc='bar'); bar.update(1); warn('hello'); bar.close()\n"
            f"sys.exit(len(verify({str(dest)!r}, deep=True, progress=True)))\n")
    main_fd, child_fd = pty.openpty()
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    proc = subprocess.run([sys.executable, "-c", code], stderr=child_fd, stdout=subprocess.PIPE, timeout=120)
    os.close(child_fd)
    out = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(main_fd)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "checking files" in text and "decoding samples" in text and "/14 [" in text, text
    warning = next(line for line in text.split("\n") if "packer: warning: hello" in line)
    assert warning.rstrip("\r").split("\r")[-1] == "packer: warning: hello", text  # the bar was cleared first

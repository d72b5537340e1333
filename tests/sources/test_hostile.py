"""Hostile and broken inputs to ``packer pack``, one table, one test each.

Every case runs the real CLI in a subprocess and checks: the exit code (0 when the bad file is skipped and others
remain; non-zero with --strict or when the problem is fatal), a one-line message on stderr that names the file,
no traceback, the source tree unchanged (hashed before and after) and an existing DEST unchanged.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from conftest import stored_samples
from PIL import Image

import packer
from packer import WdsDataset
from packer.errors import CorruptDataError
from packer.formats.wds.foreign import scan_shards

TIMEOUT = 120  # seconds: generous; only a hang would reach it


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------

def image(path: Path, size=(32, 24), seed=0, fmt=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize(size, Image.Resampling.BICUBIC).save(
        path, fmt)
    return path


def good_source(root: Path, per_class: int = 3) -> Path:
    """Two classes of small JPEGs and PNGs: what remains when the hostile file is skipped."""
    for c, cls in enumerate(("cat", "dog")):
        for i in range(per_class):
            image(root / cls / f"img{i}.{'png' if i % 2 else 'jpg'}", seed=10 * c + i)
    return root


def tree_digest(root: Path) -> dict:
    """Everything about a tree that packing must not change: names (bytes), types, modes, contents, link targets."""
    out = {}
    base = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, base)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(f.read()).hexdigest(),
                                st.st_mtime_ns)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
    return out


def cli(*args, prefix=(), env=None) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "packer", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"packer hung (killed after {TIMEOUT}s); stderr: {err[-2000:]}")
    return proc.returncode, out, err


def check_stderr(err: str, kind: str, names: list[str]) -> str:
    """No traceback; every line is one of packer's one-line messages; one ``kind`` line names the file."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    for line in lines:
        assert line.startswith("packer: "), f"not a one-line packer message: {line!r} in\n{err}"
    hits = [line for line in lines if line.startswith(f"packer: {kind}:") and all(n in line for n in names)]
    assert hits, f"no 'packer: {kind}:' line naming {names} in:\n{err}"
    return hits[0]




def no_dac_override() -> list[str]:
    """A command prefix under which file permissions apply, even to root."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and setpriv is missing: root reads a chmod 000 file anyway")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}"]


# --------------------------------------------------------------------------------------------------------------
# the cases
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Case:
    """``build(tmp)`` makes the inputs and returns a context: src, dest, the name the message must contain
    (``name``), optional ``args``, ``prefix`` (command prefix), ``env``, ``good`` (images that must remain),
    and ``during(proc, ctx)`` (runs while packer runs)."""

    id: str
    build: Callable[[Path], dict]
    skipped: bool = False  # the file is skipped without --strict: exit 0, the others packed; --strict fails
    strict_too: bool = True  # also run with --strict (for skipped cases)
    rc: int | None = None  # fatal cases: the exit code
    words: tuple[str, ...] = ()  # more words the message must contain
    format: str = "lmdb"
    kind: str = "cli"  # "cli" runs packer pack; "shards" reads a tar through scan_shards
    extra: dict = field(default_factory=dict)


def with_source(make: Callable[[Path], tuple[str, ...] | str], good: int = 6, **ctx) -> Callable[[Path], dict]:
    """A good source plus whatever ``make(src)`` adds; it returns the name(s) the message must contain."""

    def build(tmp: Path) -> dict:
        src = good_source(tmp / "src")
        names = make(src)
        return {"src": src, "dest": tmp / "out" / "ds", "names": [names] if isinstance(names, str) else list(names),
                "good": good, **ctx}

    return build


def bomb(src: Path) -> str:
    """A tiny PNG whose IHDR (with a valid CRC) claims 50000 x 50000 pixels."""
    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, "PNG")
    png = bytearray(buf.getvalue())
    png[16:24] = struct.pack(">II", 50000, 50000)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    (src / "cat" / "bomb.png").write_bytes(bytes(png))
    return "cat/bomb.png"


def large_for_limit(src: Path) -> str:
    image(src / "dog" / "large.png", size=(200, 100))  # 20000 pixels, over --max-pixels 5000
    return "dog/large.png"


def unreadable(src: Path) -> str:
    path = image(src / "cat" / "secret.jpg")
    path.chmod(0)
    return "cat/secret.jpg"


def unreadable_folder(src: Path) -> str:
    image(src / "dog" / "locked" / "inside.jpg")
    (src / "dog" / "locked").chmod(0)
    return "dog/locked"


def fifo(src: Path) -> str:
    os.mkfifo(src / "cat" / "pipe.jpg")
    return "cat/pipe.jpg"


def device_link(src: Path) -> str:
    """A .jpg that is a link to /dev/zero: reading it would never end."""
    os.symlink("/dev/zero", src / "cat" / "endless.jpg")
    return "cat/endless.jpg"


def broken_link(src: Path) -> str:
    os.symlink("no-such-file.jpg", src / "dog" / "dangling.jpg")
    return "dog/dangling.jpg"


def link_to_own_folder(src: Path) -> str:
    os.symlink(".", src / "cat" / "loop")
    return "cat/loop"


def link_to_source_root(src: Path) -> str:
    os.symlink("..", src / "cat" / "loop")  # cat/loop/dog/... would pack dog's images again, labelled cat
    return "cat/loop"


def non_utf8_name(src: Path) -> tuple[str, ...]:
    shutil.copy(src / "cat" / "img0.jpg", os.path.join(os.fsencode(src / "cat"), b"bad\xff.jpg"))
    return "cat/bad", "UTF-8"


def non_utf8_class(src: Path) -> tuple[str, ...]:
    folder = os.path.join(os.fsencode(src), b"cl\xffass")
    os.mkdir(folder)
    shutil.copy(src / "cat" / "img0.jpg", os.path.join(folder, b"x.jpg"))
    return "cl", "UTF-8"


def truncated_jpeg(src: Path) -> str:
    path = image(src / "dog" / "cut.jpg", size=(64, 64), seed=5)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.7)])  # past the header: libjpeg itself sees the premature end
    return "dog/cut.jpg"


def zero_bytes(src: Path) -> str:
    (src / "cat" / "empty.jpg").write_bytes(b"")
    return "cat/empty.jpg"


def text_as_png(src: Path) -> str:
    (src / "dog" / "notes.png").write_text("this is not an image\n")
    return "dog/notes.png"


def too_wide(src: Path) -> str:
    Image.new("L", (70000, 1)).save(src / "cat" / "wide.png")
    return "cat/wide.png"


def vanishing_build(tmp: Path) -> dict:
    """Many images so that the last one is read well after the scan: it is deleted as soon as packer has
    scanned (its journal appears), before a worker reaches it."""
    src = tmp / "src"
    for i in range(240):
        image(src / ("cat" if i % 2 else "dog") / f"img{i:03d}.png", size=(24, 24), seed=i)
    last = image(src / "dog" / "zzz_last.jpg", seed=999)
    dest = tmp / "out" / "ds"

    def during(proc, ctx):
        marker = dest / ".packer-in-progress"
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        last.unlink()

    return {"src": src, "dest": dest, "names": ["dog/zzz_last.jpg"], "good": 240, "during": during,
            "args": ["--workers", "2"], "vanished": True}


def all_bad(tmp: Path) -> dict:
    src = tmp / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        (src / cls / "empty.jpg").write_bytes(b"")
    return {"src": src, "dest": tmp / "out" / "ds", "names": [str(src), "none of the 2 images"]}


def missing_src(tmp: Path) -> dict:
    return {"src": tmp / "nope", "dest": tmp / "out" / "ds", "names": [str(tmp / "nope"), "does not exist"]}


def src_is_file(tmp: Path) -> dict:
    path = image(tmp / "photo.jpg")
    return {"src": path, "dest": tmp / "out" / "ds", "names": [str(path), "not a folder"]}


def dest_is_packed(tmp: Path) -> dict:
    src = good_source(tmp / "src")
    dest = tmp / "existing"
    packer.pack(src, dest, "lmdb", progress=False, workers=1)
    return {"src": src, "dest": dest, "names": [str(dest), "--overwrite"], "existing": True}


def dest_foreign(tmp: Path) -> dict:
    src = good_source(tmp / "src")
    dest = tmp / "mine"
    dest.mkdir()
    (dest / "thesis.txt").write_text("precious\n")
    return {"src": src, "dest": dest, "names": [str(dest), "not a packer dataset"], "args": ["--overwrite"],
            "existing": True}


def dest_is_file(tmp: Path) -> dict:
    src = good_source(tmp / "src")
    dest = tmp / "file.bin"
    dest.write_bytes(b"keep me")
    return {"src": src, "dest": dest, "names": [str(dest), "not a folder"], "existing": True}


def dest_inside_src(tmp: Path) -> dict:
    src = good_source(tmp / "src")
    return {"src": src, "dest": src / "cat" / "packed", "names": ["packed", "inside the source"]}


def full_disk(fmt: str) -> Callable[[Path], dict]:
    """DEST on a 2 MiB tmpfs; 120 images stored raw need about 3.4 MB."""

    def build(tmp: Path) -> dict:
        src = tmp / "src"
        for i in range(120):
            image(src / f"c{i % 2}" / f"{i:03d}.png", size=(96, 96), seed=i)
        mnt = tmp / "small"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs to fill ({r.stderr.decode().strip()})")
        args = ["--store", "raw", "--shard-samples", "10"]
        return {"src": src, "dest": mnt / "ds", "names": [str(mnt / "ds"), "--resume"], "args": args,
                "env": {"PACKER_COMMIT_SAMPLES": "10"}, "mount": mnt}

    return build


def evil_shard(member: str) -> Callable[[Path], dict]:
    def build(tmp: Path) -> dict:
        path = tmp / "foreign-000000.tar"
        jpeg = io.BytesIO()
        Image.new("RGB", (8, 8)).save(jpeg, "JPEG")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in (("000000000.jpg", jpeg.getvalue()), ("000000000.cls", b"0"),
                               (member, jpeg.getvalue()), (member.rsplit(".", 1)[0] + ".cls", b"1")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return {"shard": path, "names": [str(path), member]}

    return build


CASES = [
    # packer's own check, from the header, at the limit (Pillow's own refusal would come at twice the limit)
    Case("decompression-bomb-header", with_source(bomb), skipped=True,
         words=("50000x50000 is over the 89,478,485-pixel limit",)),
    Case("over-max-pixels", with_source(large_for_limit, args=["--max-pixels", "5000"]), skipped=True,
         words=("200x100 is over the 5,000-pixel limit",)),
    Case("unreadable-file", with_source(unreadable, prefix="no-dac"), skipped=True, words=("ermission",)),
    Case("unreadable-folder", with_source(unreadable_folder, prefix="no-dac"), skipped=True,
         words=("ermission",)),
    Case("fifo-named-jpg", with_source(fifo), skipped=True, words=("not a regular file",)),
    Case("link-to-device", with_source(device_link), skipped=True, words=("not a regular file",)),
    Case("broken-symlink", with_source(broken_link), skipped=True, words=("symlink",)),
    Case("symlink-loop-own-folder", with_source(link_to_own_folder), skipped=True, words=("loop",)),
    Case("symlink-loop-source-root", with_source(link_to_source_root), skipped=True, words=("loop",)),
    Case("non-utf8-file-name", with_source(non_utf8_name), skipped=True),
    Case("non-utf8-class-folder", with_source(non_utf8_class), rc=2),
    Case("file-vanishes-during-run", vanishing_build, skipped=True, strict_too=False),
    Case("truncated-jpeg", with_source(truncated_jpeg), skipped=True),
    Case("zero-byte-file", with_source(zero_bytes), skipped=True, words=("empty",)),
    Case("text-named-png", with_source(text_as_png), skipped=True, words=("decode",)),
    Case("side-over-65535", with_source(too_wide), skipped=True, words=("65535",)),
    Case("every-image-bad", all_bad, rc=2),
    Case("missing-src", missing_src, rc=2),
    Case("src-is-a-file", src_is_file, rc=2),
    Case("dest-exists-packed-no-overwrite", dest_is_packed, rc=2),
    Case("dest-foreign-folder-with-overwrite", dest_foreign, rc=2),
    Case("dest-is-a-file", dest_is_file, rc=2),
    Case("dest-inside-src", dest_inside_src, rc=2),
    *[Case(f"full-disk-{fmt}", full_disk(fmt), rc=1, format=fmt) for fmt in ("lmdb", "hdf5", "wds")],
    Case("shard-member-dotdot", evil_shard("../evil.jpg"), kind="shards"),
    Case("shard-member-absolute", evil_shard("/abs.jpg"), kind="shards"),
    Case("shard-member-nested-dotdot", evil_shard("a/../../evil.jpg"), kind="shards"),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, request):
    """Builds every case, then runs their CLI processes two cases at a time on threads (each process is
    mostly one core importing torch), so the table takes about half the wall time; each test waits for its own."""
    pool = ThreadPoolExecutor(2)
    jobs: dict[str, object] = {}
    selected = {item.callspec.params["case"].id for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    for case in CASES:
        if case.kind != "cli" or case.id not in selected:
            continue
        try:
            ctx = case.build(tmp_path_factory.mktemp(case.id))
            if ctx.get("prefix") == "no-dac":
                ctx["prefix"] = no_dac_override()
        except pytest.skip.Exception as exc:
            jobs[case.id] = exc
            continue
        jobs[case.id] = (ctx, pool.submit(execute, case, ctx))
    yield jobs
    pool.shutdown(wait=True)
    for job in jobs.values():
        if isinstance(job, tuple) and "mount" in job[0]:
            subprocess.run(["umount", "-l", str(job[0]["mount"])], check=False)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile(case: Case, tmp_path: Path, launched):
    if case.kind == "shards":
        check_shard_refused(case.build(tmp_path))
        return
    job = launched[case.id]
    if isinstance(job, BaseException):
        raise job
    ctx, future = job
    check_case(case, ctx, future.result(timeout=4 * TIMEOUT))


def execute(case: Case, ctx: dict) -> dict:
    """Run packer on the case (and --strict beside it); record what the checks need. Runs on a thread."""
    src, dest = ctx["src"], ctx["dest"]
    prefix = ctx.get("prefix") or []
    res: dict = {"src_before": tree_digest(src) if src.is_dir() else None}
    if ctx.get("existing"):
        res["dest_before"] = tree_digest(dest) if dest.is_dir() else dest.read_bytes()
    base = ["pack", src, dest, "--format", case.format, "--quiet", *ctx.get("args", [])]
    runs = {"plain": cli(*base, prefix=prefix, env=ctx.get("env"))}
    if case.skipped and case.strict_too:  # the same input with --strict, at the same time
        ctx["strict_dest"] = dest.with_name(dest.name + "-strict")
        runs["strict"] = cli(*base[:2], ctx["strict_dest"], *base[3:], "--strict", prefix=prefix, env=ctx.get("env"))
    if "during" in ctx:
        ctx["during"](runs["plain"], ctx)
    for name, proc in runs.items():
        res[name] = finish(proc)
    res["src_after"] = tree_digest(src) if src.is_dir() else None
    if ctx.get("existing"):
        res["dest_after"] = tree_digest(dest) if dest.is_dir() else dest.read_bytes()
    if "mount" in ctx:  # full disk: is it resumable once there is space?
        res["journal_left"] = (dest / ".packer-in-progress").exists()
        res["manifest_left"] = (dest / "manifest.json").exists()
        subprocess.run(["mount", "-o", "remount,size=64m", str(ctx["mount"])], check=True)
        res["resume"] = finish(cli("pack", src, dest, "--format", case.format, "--quiet", "--resume",
                                   *ctx["args"], env=ctx.get("env")))
    return res


def check_case(case: Case, ctx: dict, res: dict) -> None:
    dest = ctx["dest"]
    rc, out, err = res["plain"]
    if case.skipped:
        if ctx.get("vanished") and rc == 0 and "zzz_last" not in err:
            pytest.skip("the vanishing file was read before it could be deleted (a slow machine?)")
        assert rc == 0, err
        line = check_stderr(err, "warning", ctx["names"])
        assert all(w in line for w in case.words), line
        manifest = json.loads((dest / "manifest.json").read_text())
        assert manifest["count"] == ctx["good"], manifest["count"]
        assert any(ctx["names"][0] in e["path"] for e in manifest["skipped"]), manifest["skipped"]
        got = stored_samples(dest)
        assert len(got) == ctx["good"] and not any(ctx["names"][0] in rel for rel, _, _ in got)
        if "strict" in res:
            rc_s, _, err_s = res["strict"]
            assert rc_s != 0, err_s
            line = check_stderr(err_s, "error", ctx["names"])
            assert all(w in line for w in case.words), line
            assert not (ctx["strict_dest"] / "manifest.json").exists()
    else:
        assert rc == case.rc, (rc, err)
        line = check_stderr(err, "error", ctx["names"])
        assert all(w in line for w in case.words), line
        if not ctx.get("existing") and "mount" not in ctx and Path(dest).is_dir():
            assert not (Path(dest) / "manifest.json").exists()
    if res["src_before"] is not None:
        before = res["src_before"]
        if ctx.get("vanished"):
            before = {k: v for k, v in before.items() if b"zzz_last" not in k}
        assert res["src_after"] == before, "the source tree changed"
    if ctx.get("existing"):
        assert res["dest_after"] == res["dest_before"], "the existing DEST changed"
    if "mount" in ctx:
        check_resumed_after_full_disk(case, ctx, res)


def check_resumed_after_full_disk(case: Case, ctx: dict, res: dict) -> None:
    """The stopped conversion left DEST resumable; once there is space it resumes and gives exactly what an
    uninterrupted run gives."""
    assert res["journal_left"] and not res["manifest_left"]
    rc, _, err = res["resume"]
    assert rc == 0 and "Traceback" not in err, err
    reference = ctx["mount"].parent / "reference"
    packer.pack(ctx["src"], reference, case.format, store="raw", shard_samples=10, progress=False, workers=1)
    assert stored_samples(ctx["dest"]) == stored_samples(reference)


def check_shard_refused(ctx: dict) -> None:
    shard = ctx["shard"]
    before = tree_digest(shard.parent)
    with pytest.raises(CorruptDataError) as info:
        scan_shards([shard])
    message = str(info.value)
    assert all(n in message for n in ctx["names"]) and "\n" not in message, message
    with pytest.raises(CorruptDataError):
        WdsDataset.from_shards([shard])
    assert tree_digest(shard.parent) == before
    assert not (shard.parent.parent / "evil.jpg").exists() and not Path("/abs.jpg").exists()

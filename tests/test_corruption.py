"""Damaged datasets: every kind of damage is found by ``packer verify`` (and ``--deep``), which names the file and,
where a per-sample checksum exists, the sample; readers raise the documented :class:`packer.PackerError` subclass
naming the file, never crash, hang, or return a wrong image or label.

Each case copies a small packed dataset, damages the copy, then inspects it. Reader checks on LMDB and HDF5 files
with structural damage run in a subprocess, where a crash (SIGBUS from a truncated memory map) cannot take the
test run down with it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import stored_samples
from PIL import Image

import packer
from packer.errors import CorruptDataError, IncompleteDatasetError, ManifestError
from packer.formats.lmdb.records import HEADER, MAGIC

FORMATS = ("lmdb", "hdf5", "wds")
K = 7  # the sample that gets damaged
HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------------------------------
# the packed datasets
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corruption-src")
    rng = np.random.default_rng(0)
    for cls in ("ant", "bee", "cow"):
        (root / cls).mkdir()
        for i in range(8):
            size = (int(rng.integers(40, 65)), int(rng.integers(40, 65)))
            img = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize(size)
            img.save(root / cls / f"{cls}{i}.{'png' if i % 3 == 0 else 'jpg'}")
    return root


@pytest.fixture(scope="module")
def packed(source, tmp_path_factory) -> Callable[[str], Path]:
    """``packed(fmt)``: ``source`` packed as ``fmt``, once per module."""
    done: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in done:
            dest = tmp_path_factory.mktemp(f"corruption-{fmt}") / "ds"
            packer.pack(source, dest, fmt, progress=False, workers=1, shard_samples=6 if fmt == "wds" else None)
            done[fmt] = dest
        return done[fmt]

    return get


# --------------------------------------------------------------------------------------------------------------
# damage
# --------------------------------------------------------------------------------------------------------------

def flip(path: Path, offset: int, xor: int = 0x5A) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ xor]))


def find_once(path: Path, needle: bytes) -> int:
    data = path.read_bytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the search pattern is not unique in the file"
    return at


def truncate(path: Path, fraction: float) -> int:
    size = int(path.stat().st_size * fraction)
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def payload_middle(payload: bytes) -> tuple[int, bytes]:
    """An offset into the payload and 32 bytes from there, near the end: the compressed pixels, unlike the
    headers and Huffman tables that every JPEG shares."""
    at = len(payload) - 48
    return at, payload[at:at + 32]


def other_label(label: int) -> int:
    return (label + 1) % 3


# Each damage function changes the copy in ``dest`` and returns what the checks expect:
#   file: the file every message must name; sample: the sample index they must name (None: any);
#   samples: several sample indices that verify must name; structural: also fails with verify=False;
#   error: the exception class readers raise; index: the sample to read (default K).

def lmdb_truncate(dest, ref):
    truncate(dest / "data.mdb", 0.5)
    return {"file": "data.mdb", "structural": True, "index": len(ref) - 1}


def lmdb_payload(dest, ref):
    mid, needle = payload_middle(ref[K][2])
    flip(dest / "data.mdb", find_once(dest / "data.mdb", needle) + 3)
    return {"file": "data.mdb", "sample": K}


def lmdb_header_for(dest, ref, k):
    reader = packer.open_dataset(dest, decode=False).reader
    reader.open()
    sample, rel = reader._get(k)
    h, w, c = sample.shape
    header = HEADER.pack(MAGIC, sample.label, sample.crc32, h, w, c, 0, len(rel.encode()), len(sample.payload))
    return find_once(dest / "data.mdb", header), sample.label


def lmdb_label(dest, ref):
    copy = dest.with_name("probe")  # locate the header in an identical copy: the dataset's own env stays unopened
    shutil.copytree(dest, copy)
    at, label = lmdb_header_for(copy, ref, K)
    with open(dest / "data.mdb", "r+b") as f:
        f.seek(at + 4)
        f.write(int(other_label(label)).to_bytes(4, "little"))
    return {"file": "data.mdb", "sample": K}


def lmdb_missing(dest, ref):
    (dest / "data.mdb").unlink()
    return {"file": "data.mdb", "structural": True}


def lmdb_garbage(dest, ref):
    size = (dest / "data.mdb").stat().st_size
    (dest / "data.mdb").write_bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes())
    return {"file": "data.mdb", "structural": True}


def hdf5_truncate(dest, ref):
    truncate(dest / "data.h5", 0.6)
    return {"file": "data.h5", "structural": True}


def hdf5_payload(dest, ref):
    with h5py.File(dest / "data.h5", "r") as f:
        at = f["images"].id.get_offset() + int(f["offsets"][K])
    mid, _ = payload_middle(ref[K][2])
    flip(dest / "data.h5", at + mid)
    return {"file": "data.h5", "sample": K}


def hdf5_label(dest, ref):
    with h5py.File(dest / "data.h5", "r") as f:
        at = f["labels"].id.get_offset() + 8 * K
        label = int(f["labels"][K])
    with open(dest / "data.h5", "r+b") as f:
        f.seek(at)
        f.write(other_label(label).to_bytes(8, "little"))
    return {"file": "data.h5", "sample": K}


def hdf5_missing(dest, ref):
    (dest / "data.h5").unlink()
    return {"file": "data.h5", "structural": True}


def wds_index(dest) -> np.ndarray:
    return np.load(dest / "wds_index.npy")


def wds_shard(dest, k) -> Path:
    manifest = json.loads((dest / "manifest.json").read_text())
    return dest / manifest["shards"][int(wds_index(dest)[k]["shard"])]["path"]


def wds_truncate(which: int) -> Callable:
    def damage(dest, ref):
        manifest = json.loads((dest / "manifest.json").read_text())
        shard_no = which % len(manifest["shards"])
        shard = dest / manifest["shards"][shard_no]["path"]
        cut = truncate(shard, 0.5)
        index = wds_index(dest)
        lost = [i for i in range(len(index))
                if index[i]["shard"] == shard_no and index[i]["offset"] + index[i]["size"] > cut]
        assert lost
        return {"file": shard.name, "samples": lost, "structural": True, "index": lost[0]}

    return damage


def wds_payload(dest, ref):
    row = wds_index(dest)[K]
    flip(wds_shard(dest, K), int(row["offset"]) + int(row["size"]) // 2)
    return {"file": wds_shard(dest, K).name, "sample": K}


def wds_cls(dest, ref):
    """The .cls member (what webdataset readers and ``packer.stream`` use) says another class."""
    shard = wds_shard(dest, K)
    with tarfile.open(shard) as tar:
        member = tar.getmember(f"{K:09d}.cls")
        assert tar.extractfile(member).read() == str(ref[K][1]).encode()
    with open(shard, "r+b") as f:
        f.seek(member.offset_data)
        f.write(str(other_label(ref[K][1])).encode())
    return {"file": shard.name, "sample": K, "reader_unaffected": True}


def wds_index_label(dest, ref):
    index = np.load(dest / "wds_index.npy", mmap_mode="r+")
    index[K]["label"] = other_label(int(index[K]["label"]))
    index.flush()
    del index
    # the file-level line names the index; the sample's own lines name the shard that holds it
    return {"file": "wds_index.npy", "sample": K, "sample_file": wds_shard(dest, K).name}


def wds_missing_shard(dest, ref):
    shard = wds_shard(dest, K)
    shard.unlink()
    return {"file": shard.name, "structural": True}


def wds_missing_index(dest, ref):
    (dest / "wds_index.npy").unlink()
    return {"file": "wds_index.npy", "structural": True}


def manifest_edit(change: Callable[[dict], object]) -> Callable:
    def damage(dest, ref):
        manifest = json.loads((dest / "manifest.json").read_text())
        result = change(manifest)
        text = result if isinstance(result, str) else json.dumps(manifest)
        (dest / "manifest.json").write_text(text)
        return {"file": "manifest.json", "structural": True, "error": ManifestError}

    return damage


def manifest_missing(dest, ref):
    (dest / "manifest.json").unlink()
    return {"file": str(dest), "structural": True, "error": IncompleteDatasetError, "words": ("--resume",)}


def manifest_count(dest, ref):
    """The manifest promises more samples than the data holds."""
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["count"] += 5
    (dest / "manifest.json").write_text(json.dumps(manifest))
    data = {"lmdb": "data.mdb", "hdf5": "data.h5", "wds": "wds_index.npy"}[manifest["format"]]
    return {"file": data, "structural": True, "index": len(ref) + 2}


def set_key(key, value):
    return manifest_edit(lambda m: m.__setitem__(key, value))


def drop_key(key):
    return manifest_edit(lambda m: m.pop(key))


@dataclass
class Case:
    id: str
    fmt: str
    damage: Callable
    isolate: bool = False  # run the checks in a subprocess (a crash is possible)


CASES = [
    Case("lmdb-truncated", "lmdb", lmdb_truncate, isolate=True),
    Case("lmdb-payload-byte", "lmdb", lmdb_payload),
    Case("lmdb-label", "lmdb", lmdb_label),
    Case("lmdb-missing-data", "lmdb", lmdb_missing, isolate=True),
    Case("lmdb-garbage-data", "lmdb", lmdb_garbage, isolate=True),
    Case("hdf5-truncated", "hdf5", hdf5_truncate, isolate=True),
    Case("hdf5-payload-byte", "hdf5", hdf5_payload),
    Case("hdf5-label", "hdf5", hdf5_label),
    Case("hdf5-missing-data", "hdf5", hdf5_missing, isolate=True),
    Case("wds-first-shard-truncated", "wds", wds_truncate(0)),
    Case("wds-last-shard-truncated", "wds", wds_truncate(-1)),
    Case("wds-payload-byte", "wds", wds_payload),
    Case("wds-cls-member", "wds", wds_cls),
    Case("wds-index-label", "wds", wds_index_label),
    Case("wds-missing-shard", "wds", wds_missing_shard),
    Case("wds-missing-index", "wds", wds_missing_index),
    *[Case(f"{fmt}-count-too-large", fmt, manifest_count) for fmt in FORMATS],
    *[Case(f"{fmt}-{name}", fmt, damage) for fmt in FORMATS for name, damage in [
        ("manifest-not-json", manifest_edit(lambda m: '{"format": "lmdb", "count": ')),
        ("manifest-not-object", manifest_edit(lambda m: "[1, 2, 3]")),
        ("manifest-missing-count", drop_key("count")),
        ("manifest-missing-files", drop_key("files")),
        ("manifest-count-is-string", set_key("count", "24")),
        ("manifest-classes-is-dict", set_key("classes", {"ant": 0})),
        ("manifest-transform-bad-store", set_key("transform", {"store": 5})),
        ("manifest-transform-unknown-key", set_key("transform", {"store": "original", "sharpen": True})),
        ("manifest-unknown-format", set_key("format", "zip")),
        ("manifest-shards-malformed", set_key("shards", [{"count": 6}])),
        ("manifest-shard-escapes", set_key("shards", [{"path": "/etc/passwd", "count": 6}])),
        ("manifest-format-version-999", set_key("format_version", 999)),
        ("manifest-file-escapes", manifest_edit(lambda m: m["files"].append({"path": "../x", "bytes": 1}))),
        ("manifest-missing", manifest_missing),
    ]],
]


# --------------------------------------------------------------------------------------------------------------
# inspection: the CLI (in-process through click's runner) and the readers
# --------------------------------------------------------------------------------------------------------------

def inspect(dest: str, index: int) -> dict:
    """What verify, verify --deep, info and the readers do with ``dest``; exceptions are recorded by type."""
    from click.testing import CliRunner

    from packer.cli import main

    out: dict = {}
    for name, args in (("verify", ["verify", dest]), ("deep", ["verify", dest, "--deep"]), ("info", ["info", dest])):
        r = CliRunner().invoke(main, args)
        crash = r.exception if r.exception is not None and not isinstance(r.exception, SystemExit) else None
        out[name] = {"rc": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
                     "crash": None if crash is None else f"{type(crash).__name__}: {crash}"}
    for verify in (True, False):
        try:
            ds = packer.open_dataset(dest, verify=verify)
            image, label = ds[index]
            out[f"read_{verify}"] = {"image": image.numpy().tobytes().hex()[:64], "label": int(label),
                                     "raw": bytes(ds.raw_sample(index)[0]).hex()}
        except Exception as exc:  # noqa: BLE001 - recorded and judged by the test
            out[f"read_{verify}"] = {"error": type(exc).__name__, "message": str(exc),
                                     "packer": isinstance(exc, packer.PackerError)}
    return out


def inspect_isolated(dest: Path, index: int) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import test_corruption as t; "
            f"print('RESULT' + json.dumps(t.inspect({str(dest)!r}, {index})))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"inspecting {dest} hung")
    assert r.returncode == 0, f"inspecting {dest} crashed the process (exit {r.returncode}):\n{r.stderr[-3000:]}"
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_corruption(case: Case, packed, tmp_path):
    ref = stored_samples(packed(case.fmt))
    dest = tmp_path / "ds"
    shutil.copytree(packed(case.fmt), dest)
    expect = case.damage(dest, ref)
    index = expect.get("index", K)
    res = inspect_isolated(dest, index) if case.isolate else inspect(str(dest), index)
    error = expect.get("error", CorruptDataError)
    named = [expect["file"], *expect.get("words", ())]

    # packer verify and verify --deep: exit 1, no crash, a line naming the file (and the sample)
    for mode in ("verify", "deep"):
        r = res[mode]
        assert r["crash"] is None, f"{mode} crashed: {r['crash']}"
        assert r["rc"] == 1, f"{mode} exit {r['rc']}:\n{r['stdout']}{r['stderr']}"
        lines = (r["stdout"] + r["stderr"]).splitlines()
        assert any(all(n in line for n in named) for line in lines), f"{mode} does not name {named}:\n{lines}"
        wanted = expect.get("samples") or ([expect["sample"]] if expect.get("sample") is not None else [])
        sample_file = expect.get("sample_file", expect["file"])
        for k in wanted:
            assert any(sample_file in line and f"sample {k}:" in line for line in lines), \
                f"{mode} does not name sample {k} of {sample_file}:\n" + "\n".join(lines)
    if error is not CorruptDataError and "unknown-format" not in case.id:
        # the manifest itself is damaged: info fails too, in one line (info does not need to know the format)
        r = res["info"]
        assert r["crash"] is None and r["rc"] == 1, r
        assert r["stderr"].startswith("packer: error: ") and r["stderr"].count("\n") == 1, r["stderr"]
        assert all(n in r["stderr"] for n in named), r["stderr"]

    # readers: verify=True raises the documented error naming the file (and sample); structural damage raises
    # even with verify=False; nothing else may come back
    modes = [True, False] if expect.get("structural") else [True]
    for verify in modes:
        r = res[f"read_{verify}"]
        if expect.get("reader_unaffected"):
            # the random-access reader does not use the damaged member: it must return the intact sample
            assert "error" not in r and r["label"] == ref[index][1] and bytes.fromhex(r["raw"]) == ref[index][2], r
            continue
        assert "error" in r, f"verify={verify}: damaged sample read without an error: {r}"
        assert r["packer"] and r["error"] == error.__name__, r
        assert expect.get("sample_file", expect["file"]) in r["message"] and "\n" not in r["message"], r["message"]
        if expect.get("sample") is not None:
            assert f"sample {index}" in r["message"], r["message"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_intact_copies_pass(fmt, packed, tmp_path):
    """The control: an undamaged copy passes verify and --deep, and reads back the same."""
    dest = tmp_path / "ds"
    shutil.copytree(packed(fmt), dest)
    res = inspect(str(dest), K)
    assert res["verify"]["rc"] == 0 and res["deep"]["rc"] == 0, res
    assert res["read_True"]["label"] == stored_samples(packed(fmt))[K][1]
    assert stored_samples(dest) == stored_samples(packed(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_samples_still_read(fmt, packed, tmp_path):
    """Damage to one sample's payload spoils only that sample: every other one still reads (verify=True)."""
    ref = stored_samples(packed(fmt))
    dest = tmp_path / "ds"
    shutil.copytree(packed(fmt), dest)
    {"lmdb": lmdb_payload, "hdf5": hdf5_payload, "wds": wds_payload}[fmt](dest, ref)
    ds = packer.open_dataset(dest, decode=False, verify=True)
    for i in range(len(ds)):
        if i == K:
            with pytest.raises(CorruptDataError, match=f"sample {K}"):
                ds.raw_sample(i)
        else:
            assert ds.raw_sample(i)[1] == ref[i][1] and bytes(ds.raw_sample(i)[0]) == ref[i][2]


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_label_without_verify(fmt, packed, tmp_path):
    """A documented limitation: without verify=True nothing checks a sample's label on read, so a damaged label
    reads back as the other class; verify=True (and `packer verify`) find it."""
    ref = stored_samples(packed(fmt))
    dest = tmp_path / "ds"
    shutil.copytree(packed(fmt), dest)
    {"lmdb": lmdb_label, "hdf5": hdf5_label, "wds": wds_index_label}[fmt](dest, ref)
    data, label = packer.open_dataset(dest, decode=False, verify=False).raw_sample(K)
    assert label == other_label(ref[K][1]) and bytes(data) == ref[K][2]
    with pytest.raises(CorruptDataError, match=f"sample {K}"):
        packer.open_dataset(dest, decode=False, verify=True).raw_sample(K)


@pytest.mark.parametrize("change", [
    lambda m: m.pop("store"), lambda m: m["transform"].pop("mode"), lambda m: m.__setitem__("source", [1]),
    lambda m: m.__setitem__("skipped", [{"file": "x"}]), lambda m: m.__setitem__("order", 3),
], ids=["no-store", "transform-no-mode", "source-is-list", "skipped-malformed", "order-is-int"])
def test_info_on_hand_edited_manifest(change, packed, tmp_path):
    """``packer info`` on a manifest that parses but lacks what it prints: one line and exit 1, no traceback."""
    from click.testing import CliRunner

    from packer.cli import main

    dest = tmp_path / "ds"
    shutil.copytree(packed("lmdb"), dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    change(manifest)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    r = CliRunner().invoke(main, ["info", str(dest)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 1, (r.exit_code, r.stdout, r.stderr)
    assert r.stderr.startswith("packer: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "manifest.json" in r.stderr


@pytest.mark.parametrize("threads", [1, 3])
def test_a_damaged_sample_in_a_threaded_batch_raises_and_the_next_batch_reads(packed, tmp_path, threads):
    """A batch decoded on several threads raises the damaged sample's error, as one thread does, once every
    thread has stopped; the dataset then reads the following batches correctly."""
    dest = tmp_path / "ds"
    shutil.copytree(packed("hdf5"), dest)
    ref = stored_samples(dest)
    hdf5_payload(dest, ref)
    ds = packer.open_dataset(dest, verify=True, threads=threads, resize=32, center_crop=32)
    with pytest.raises(CorruptDataError, match=rf"data\.h5.*sample {K}\b"):
        ds.read_batch(list(range(len(ds))))
    intact = [i for i in range(len(ds)) if i != K]
    batch = ds.read_batch(intact)
    reference = packer.open_dataset(packed("hdf5"), resize=32, center_crop=32)
    assert torch.equal(batch.images, reference.read_batch(intact).images)

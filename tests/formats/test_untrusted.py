"""A manifest is input, not trusted (issue 23): every reader checks what the manifest says against the data
files when a dataset opens, before anything is sized from it, and says what is wrong in one line naming the file;
remote manifests are read within a size cap, whatever the server says or sends."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
from conftest import write_image
from support.remote import Served

import packer
from packer.errors import CorruptDataError, ManifestError, PackerError, RemoteError
from packer.formats.lmdb.index import INDEX, save_index, scan_index
from packer.formats.lmdb.records import HEADER, key
from packer.manifest import file_entry

FORMATS = ("lmdb", "hdf5", "wds")
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("untrusted-src")
    for i in range(12):
        write_image(root / ("cat" if i % 2 else "dog") / f"{i:02d}.jpg", 40 + i, 36 + i, seed=i)
    return root


@pytest.fixture(scope="module")
def packs(src, tmp_path_factory):
    """One small dataset per (format, store), packed once; tests copy it before damaging it."""
    made: dict[tuple[str, str], Path] = {}

    def get(fmt: str, store: str = "original") -> Path:
        if (fmt, store) not in made:
            dest = tmp_path_factory.mktemp("untrusted") / f"{fmt}-{store}"
            extra = {"store": "raw", "resize": (32, 32)} if store == "raw" else {}
            shards = {"shard_samples": 4} if fmt == "wds" else {}
            packer.pack(src, dest, format=fmt, workers=1, progress=False, shuffle=False, **shards, **extra)
            made[fmt, store] = dest
        return made[fmt, store]

    return get


def copy(packs, tmp_path: Path, fmt: str, store: str = "original") -> Path:
    dest = tmp_path / "ds"
    shutil.copytree(packs(fmt, store), dest)
    return dest


def edit_manifest(dest: Path, **changes) -> None:
    path = dest / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def opened(dest: Path) -> int:
    """Open the dataset and ask its length, as a sampler does first."""
    return len(packer.open_dataset(dest))


def one_line_error(error: type, match: str, call, *args, **kwargs) -> str:
    with pytest.raises(error, match=match) as info:
        call(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, timeout=120)


def assert_cli_one_line(result: subprocess.CompletedProcess, words: str) -> None:
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "internal error" not in out and "Traceback" not in out, out
    assert any(words in line for line in out.splitlines()), out


# -- counts --------------------------------------------------------------------------------------------------------
def test_wds_count_of_a_trillion_is_refused_at_open_not_allocated(packs, tmp_path):
    dest = copy(packs, tmp_path, "wds")
    edit_manifest(dest, count=10**12)
    one_line_error(CorruptDataError, r"wds_index\.npy: holds 12 samples, the manifest says 1000000000000",
                   opened, dest)
    one_line_error(CorruptDataError, r"wds_index\.npy", lambda: next(iter(
        packer.make_loader(packer.open_dataset(dest), batch_size=4, num_workers=0, tuned=False))))
    assert_cli_one_line(cli("verify", str(dest)), "wds_index.npy")


def test_wds_shard_counts_that_lie_together_with_the_count(packs, tmp_path):
    dest = copy(packs, tmp_path, "wds")
    manifest = json.loads((dest / "manifest.json").read_text())
    shards = manifest["shards"]
    shards[0]["count"] += 10**12
    edit_manifest(dest, count=manifest["count"] + 10**12, shards=shards)
    one_line_error(CorruptDataError, "wds_index.npy", opened, dest)
    # the count right, the shards' counts moved between shards: the index says which shard holds what, and each
    # row is checked against the manifest's counts as it is read (opening reads no row): the sample the counts
    # moved is refused before it is returned, alone or in a batch, and verify checks every row
    dest2 = tmp_path / "ds2"
    shutil.copytree(packs("wds"), dest2)
    shards = json.loads((dest2 / "manifest.json").read_text())["shards"]
    shards[0]["count"], shards[1]["count"] = shards[0]["count"] + 1, shards[1]["count"] - 1
    edit_manifest(dest2, shards=shards)
    moved = shards[0]["count"] - 1  # shard 1's first sample, which the counts now put in shard 0
    ds = packer.open_dataset(dest2)
    assert ds[0] is not None
    words = rf"wds_index\.npy row {moved}: names shard 1, where the manifest's shard counts put sample {moved} in " \
        "shard 0"
    one_line_error(CorruptDataError, words, lambda: ds[moved])
    one_line_error(CorruptDataError, words, lambda: ds.read_batch([0, moved]))
    assert_cli_one_line(cli("verify", str(dest2)), "samples per shard")


@pytest.mark.parametrize(("column", "value", "words"), [
    ("label", 99, "label 99 is not a class index"), ("shape", (0, 5, 3), r"shape \(0, 5, 3\) is not an"),
    ("shard", 2, "names shard 2, where the manifest's shard counts put sample 5 in shard 1")])
def test_wds_index_row_damaged_is_refused_as_it_is_read(packs, tmp_path, column, value, words):
    """Opening reads no row of the shard index (it would read all of it): a damaged row is one line naming the
    index and the row when that sample is read, alone or in a batch, never a wrong label or an IndexError; the
    other samples still read, and ``packer verify`` checks every row."""
    dest = copy(packs, tmp_path, "wds")
    rows = np.load(dest / "wds_index.npy")
    rows[column][5] = value
    with open(dest / "wds_index.npy", "wb") as f:
        np.save(f, rows)
    ds = packer.open_dataset(dest)
    assert len(ds) == 12 and ds[4] is not None and len(ds.read_batch([0, 11])) == 2
    where = r"wds_index\.npy row 5: "
    one_line_error(CorruptDataError, where + words, lambda: ds[5])
    one_line_error(CorruptDataError, where if column == "shard" else where + words, lambda: ds.read_batch([4, 5]))
    one_line_error(CorruptDataError, "wds_index.npy", ds.reader.class_counts)
    assert_cli_one_line(cli("verify", str(dest)), "wds_index.npy")


def test_hdf5_label_damaged_is_refused_as_it_is_read(packs, tmp_path):
    """Opening reads no per-sample array of data.h5: a label out of range is one line naming the sample when it
    is read, and class counts, which read every label, refuse it too."""
    dest = copy(packs, tmp_path, "hdf5")
    with h5py.File(dest / "data.h5", "r+") as f:
        f["labels"][5] = 99
    ds = packer.open_dataset(dest)
    assert len(ds) == 12 and ds[4] is not None
    one_line_error(CorruptDataError, r"data\.h5 sample 5: label 99 is not a class index", lambda: ds[5])
    one_line_error(CorruptDataError, r"data\.h5 sample 5: label 99", lambda: ds.read_batch([4, 5]))
    one_line_error(CorruptDataError, "label 99", ds.reader.class_counts)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("count", [0, 13, 10**12])
def test_count_that_disagrees_with_the_data(packs, tmp_path, fmt, count):
    dest = copy(packs, tmp_path, fmt)
    edit_manifest(dest, count=count)
    # the shard counts add up to 12: the manifest contradicts itself, or the data does
    one_line_error((CorruptDataError, ManifestError), r"(12|manifest says)", opened, dest)


def test_lmdb_records_keyed_past_the_count(packs, tmp_path):
    dest = copy(packs, tmp_path, "lmdb")
    env = lmdb.open(str(dest), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        value = bytes(txn.get(key(11)))
        txn.delete(key(11))
        txn.put(key(10**9), value)
    env.close()
    one_line_error(CorruptDataError, r"data\.mdb: the records are not keyed 0\.\.11", opened, dest)


# -- shapes and dtypes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [[100000, 100000, 3], [-56, 56, 3], [56, 56], [0, 56, 3], [32, 32, 1], "32",
                                   [60000, 60000, 3], [32.0, 32, 3], [True, 32, 3]])
def test_manifest_shape_that_is_no_image_is_refused(packs, tmp_path, fmt, shape):
    dest = copy(packs, tmp_path, fmt, "raw")
    edit_manifest(dest, shape=shape)
    one_line_error(ManifestError, r"manifest\.json: 'shape'", opened, dest)


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_dtype_that_disagrees_with_the_transform(packs, tmp_path, fmt):
    dest = copy(packs, tmp_path, fmt, "raw")
    edit_manifest(dest, dtype="float64")
    one_line_error(ManifestError, r"'dtype' 'float64'", opened, dest)


def test_hdf5_images_of_another_shape_than_the_manifest(packs, tmp_path):
    dest = copy(packs, tmp_path, "hdf5", "raw")
    with h5py.File(dest / "data.h5", "r+") as f:
        images = f["images"][()]
        del f["images"]
        f.create_dataset("images", data=images[:, :16])
    one_line_error(CorruptDataError, r"data\.h5: 'images' is \(12, 16, 32, 3\)", opened, dest)


# -- HDF5 index arrays ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["shapes", "offsets", "crc32", "labels"])
def test_hdf5_index_array_shorter_than_labels(packs, tmp_path, name):
    dest = copy(packs, tmp_path, "hdf5")
    with h5py.File(dest / "data.h5", "r+") as f:
        values = f[name][()]
        del f[name]
        f.create_dataset(name, data=values[:5])
    one_line_error(CorruptDataError, r"data\.h5", opened, dest)
    assert_cli_one_line(cli("verify", str(dest)), "data.h5")
    assert_cli_one_line(cli("export", str(dest), str(tmp_path / "out")), "data.h5")


def test_hdf5_offsets_past_the_images(packs, tmp_path):
    dest = copy(packs, tmp_path, "hdf5")
    with h5py.File(dest / "data.h5", "r+") as f:
        f["offsets"][-1] = 10**15
    one_line_error(CorruptDataError, r"data\.h5: 'offsets' run past 'images'", opened, dest)


# -- labels --------------------------------------------------------------------------------------------------------
def set_labels(dest: Path, fmt: str, label: int) -> None:
    if fmt == "hdf5":
        with h5py.File(dest / "data.h5", "r+") as f:
            f["labels"][:] = label
    elif fmt == "wds":
        index = np.load(dest / "wds_index.npy")
        index["label"] = label
        np.save(dest / "wds_index.npy", index)
    else:
        env = lmdb.open(str(dest), subdir=True, lock=False)
        with env.begin(write=True) as txn:
            for i in range(12):
                value = bytearray(txn.get(key(i)))
                fields = list(HEADER.unpack_from(value))
                fields[1] = label
                value[:HEADER.size] = HEADER.pack(*fields)
                txn.put(key(i), bytes(value))
        env.close()
        # as packer writes a dataset: the index rebuilt from the records, the manifest naming both files' new bytes
        save_index(dest / INDEX, scan_index(dest, 12))
        refresh_files(dest, ["data.mdb", INDEX])


def refresh_files(dest: Path, names: list[str]) -> None:
    """The manifest's ``files`` entries of ``names`` (size, sha256) made those of the files now in ``dest``."""
    files = json.loads((dest / "manifest.json").read_text())["files"]
    assert set(names) <= {e["path"] for e in files}
    edit_manifest(dest, files=[file_entry(dest, e["path"]) if e["path"] in names else e for e in files])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("label", [-1, 2, 2**31 - 1])
def test_labels_out_of_range(packs, tmp_path, fmt, label):
    dest = copy(packs, tmp_path, fmt)
    set_labels(dest, fmt, label)
    one_line_error(CorruptDataError, f"label {label} is not a class index", lambda: packer.open_dataset(dest)[3])


@pytest.mark.parametrize("fmt", FORMATS)
def test_minus_one_is_the_label_of_a_dataset_without_class_labels(packs, tmp_path, fmt):
    lost = copy(packs, tmp_path / "lost", fmt)  # a class index where the manifest says there is no class
    set_labels(lost, fmt, 2)
    edit_manifest(lost, fields=[{"name": "image", "kind": "image"}])
    one_line_error(CorruptDataError, "label 2 is not a class index", lambda: packer.open_dataset(lost)[0])
    dest = copy(packs, tmp_path, fmt)
    set_labels(dest, fmt, -1)
    edit_manifest(dest, fields=[{"name": "image", "kind": "image"}])
    ds = packer.open_dataset(dest)
    assert all(list(ds[i]) == ["image"] for i in range(len(ds)))  # no class: the sample has no label entry
    assert [ds.reader.read(i).label for i in range(len(ds))] == [-1] * 12
    edit_manifest(dest, fields=[{"name": "image", "kind": "image"}, {"name": "label", "kind": "class"}])
    one_line_error(CorruptDataError, "label -1 is not a class index", lambda: packer.open_dataset(dest)[0])


# -- remote manifests ----------------------------------------------------------------------------------------------
class Liar(http.server.BaseHTTPRequestHandler):
    """``manifest.json`` said to be ``length`` bytes (HEAD ``head_length``), then ``sent`` bytes of JSON-ish
    filler sent at most; counts what it sent in ``served.sent``."""

    served: Served
    length: int
    head_length: int
    sent_cap: int
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self.served.count("HEAD", self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(self.head_length))
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        self.served.count("GET", self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(self.length))
        self.end_headers()
        block = b" " * (1 << 20)
        sent = 0
        try:
            while sent < self.sent_cap:
                self.wfile.write(block)
                sent += len(block)
        except OSError:
            pass
        self.served.sent = sent


def info_memory(url: str, cap: int | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """``packer info URL`` in a child; its result and its peak resident memory in bytes."""
    env = {**os.environ, "PACKER_RETRIES": "1"}
    if cap is not None:
        env["PACKER_MAX_MANIFEST_BYTES"] = str(cap)
    code = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'packer', 'info', "
            f"{url!r}], capture_output=True, text=True, timeout=120); print(r.returncode); print(r.stdout + r.stderr,"
            " end=''); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    return r, int(r.stderr.strip().splitlines()[-1]) * 1024


@pytest.mark.parametrize("head_length", [10**12, 100])
def test_remote_manifest_of_a_terabyte_is_one_line_and_bounded_memory(head_length):
    """A server that says 10^12 bytes is refused from its size; one that says 100 at HEAD and then streams
    forever is cut off at the cap (64 MiB by default: memory stays far below the 2.9 GB of the issue)."""
    served = Served(Liar, length=10**12, head_length=head_length, sent_cap=400 << 20)
    try:
        r, peak = info_memory(f"{served.url}/ds")
    finally:
        served.stop()
    out = r.stdout
    assert out.splitlines()[0] == "1", out + r.stderr
    lines = [line for line in out.splitlines()[1:] if line]
    assert len(lines) == 1 and "manifest.json" in lines[0] and "over the 67,108,864-byte limit" in lines[0], out
    assert peak < 400 << 20, f"packer info grew to {peak:,} bytes"


def test_remote_manifest_cap_is_overridable(tmp_path, packs):
    from support.remote import serve_files

    served = serve_files(packs("lmdb").parent)
    try:
        url = f"{served.url}/{packs('lmdb').name}"
        size = (packs("lmdb") / "manifest.json").stat().st_size
        env = {**os.environ, "PACKER_MAX_MANIFEST_BYTES": str(size - 1), "PACKER_RETRIES": "1"}
        r = subprocess.run([sys.executable, "-m", "packer", "info", url], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 1 and f"over the {size - 1:,}-byte limit" in r.stderr, r.stdout + r.stderr
        env["PACKER_MAX_MANIFEST_BYTES"] = str(size)
        r = subprocess.run([sys.executable, "-m", "packer", "info", url], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        served.stop()


def test_local_manifest_over_the_cap(packs, tmp_path, monkeypatch):
    dest = copy(packs, tmp_path, "lmdb")
    monkeypatch.setenv("PACKER_MAX_MANIFEST_BYTES", "100")
    one_line_error(ManifestError, r"manifest\.json: .* over the 100-byte limit", opened, dest)


def test_ranged_reads_stop_at_the_range_when_the_server_sends_more():
    from packer.remote.fetch import _cat
    from packer.remote.fs import filesystem

    served = Served(Liar, length=10**12, head_length=10**12, sent_cap=200 << 20)
    try:
        with pytest.raises(RemoteError, match="ignored a Range request"):
            _cat(filesystem("http"), f"{served.url}/x", 1 << 20, 2 << 20)
        data = _cat(filesystem("http"), f"{served.url}/x", 0, 1 << 20)  # a 200 from the start: its first bytes
        assert len(data) == 1 << 20
    finally:
        served.stop()


# -- the property test ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_mutated_datasets_read_right_or_fail_in_one_line(packs, tmp_path, fmt):
    """Hypothesis mutates the manifest and the format's index (HDF5 arrays, LMDB record headers and records,
    the WebDataset index) of a 12-image dataset; every ds[i], packer.verify and a loader epoch give the original
    samples or one line of PackerError, in a process limited to 3 GiB of address space."""
    worker = TESTS / "workers" / "untrusted_worker.py"
    r = subprocess.run([sys.executable, str(worker), fmt, str(packs(fmt)), str(tmp_path), "30", str(3 << 30)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
                            "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout + r.stderr)[-4000:]


def test_packer_error_is_what_every_check_raises():
    assert issubclass(CorruptDataError, PackerError) and issubclass(ManifestError, PackerError)

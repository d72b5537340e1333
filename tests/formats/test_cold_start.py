"""A cold start reads what it needs: with a dataset's files dropped from the page cache, ``packer info`` and a
first batch bring into it only the manifest, the index and the batch's own samples, not every record (LMDB's labels,
read from the records before its index existed) and not the kernel's read-ahead window around each sample.

Measured with mincore (what of a file the page cache holds), after ``POSIX_FADV_DONTNEED`` dropped it: no root
needed. Where the files' pages cannot be dropped or seen (another filesystem, another owner) the tests skip.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import noise_folder
from support.packed import FORMATS

import packer
from packer.bench.cache import evict, release_handles, resident_bytes
from packer.cli import main
from packer.formats import reader_class
from packer.formats.layout import LocalSource
from packer.formats.lmdb.index import INDEX, INDEX_DTYPE, scan_index
from packer.verify import verify

COUNT, SIDE = 600, 64  # raw 64x64 RGB noise: 12,288 bytes a sample, three pages; about 7.4 MB a format
BATCH = 16
PAGE = os.sysconf("SC_PAGE_SIZE")
SLACK = 64 * PAGE  # the tree's, the small arrays' and the headers' pages a read also touches


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cold")
    noise_folder(root / "src", COUNT, SIDE, "png")
    for fmt in FORMATS:
        packer.pack(root / "src", root / fmt, fmt, store="raw", progress=False, workers=1)
    # "parted": two copies of the LMDB pack under one manifest, as a 2-rank conversion leaves them
    parted, manifest = root / "parted", packer.read_manifest(root / "lmdb")
    for r in range(2):
        shutil.copytree(root / "lmdb", parted / f"part-{r:05d}", ignore=shutil.ignore_patterns("*.json"))
    files = [{**e, "path": f"part-{r:05d}/{e['path']}"} for r in range(2) for e in manifest["files"]]
    parts = [{"path": f"part-{r:05d}", "count": COUNT, "range": [r * COUNT, (r + 1) * COUNT]} for r in range(2)]
    (parted / "manifest.json").write_text(json.dumps({**manifest, "count": 2 * COUNT, "files": files, "parts": parts,
                                                      "class_counts": [2 * n for n in manifest["class_counts"]]}))
    return root


def data_files(dest: Path) -> list[Path]:
    """The files that hold the samples (data.mdb, data.h5, the shards): not the manifest or an index."""
    return [dest / e["path"] for e in packer.read_manifest(dest)["files"] if not e["path"].endswith(".npy")]


def resident(files: list[Path]) -> int:
    found = [resident_bytes(p) for p in files]
    if any(r is None for r in found):
        pytest.skip("mincore cannot tell which of these files' pages are cached here")
    return sum(r[0] for r in found)


def dropped(dest: Path) -> list[Path]:
    """Every file of ``dest`` out of the page cache (this process's maps of them closed first); its data files."""
    gc.collect()
    release_handles()
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    if not evict(files) or resident(files) > 2 * PAGE:
        pytest.skip("the page cache keeps these files' pages (no POSIX_FADV_DONTNEED here)")
    return data_files(dest)


def sample_pages(dest: Path, indices: np.ndarray) -> int:
    """Bytes of the pages that hold the samples ``indices`` (their ranges in the data files, from the format's
    layout)."""
    manifest = packer.read_manifest(dest)
    layout = reader_class(manifest, dest).layout(manifest, LocalSource(dest), str(dest))
    pages = {(int(layout.file[i]), p) for i in indices.tolist()
             for p in range(int(layout.start[i]) // PAGE, -(-int(layout.end[i]) // PAGE))}
    return len(pages) * PAGE


@pytest.mark.parametrize("fmt", [*FORMATS, "parted"])
def test_info_reads_the_index_not_the_samples(fmt, packs):
    data = dropped(packs / fmt)
    result = CliRunner().invoke(main, ["info", str(packs / fmt)])
    assert result.exit_code == 0, result.output
    total = re.search(r"^\s+total\s+([\d,]+)$", result.output, re.M)
    assert total and total.group(1) == f"{(2 if fmt == 'parted' else 1) * COUNT:,}", result.output
    size = sum(p.stat().st_size for p in data)
    assert resident(data) <= SLACK < size // 10, (resident(data), size)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_first_batch_reads_its_samples_not_the_pages_around_them(fmt, packs):
    data = dropped(packs / fmt)
    ds = packer.open_dataset(packs / fmt)
    indices = np.random.default_rng(7).choice(COUNT, BATCH, replace=False)
    batch = ds.read_batch(indices.tolist())
    assert len(batch) == BATCH
    found = resident(data)
    needed = sample_pages(packs / fmt, indices)  # after the batch: it reads the index
    assert found <= needed + SLACK, (found, needed)


def test_lmdb_index_holds_each_record_s_label_size_and_place(packs):
    """The index beside data.mdb is listed in the manifest with its checksum, and says what the records say."""
    dest = packs / "lmdb"
    entry = next(e for e in packer.read_manifest(dest)["files"] if e["path"] == INDEX)
    assert entry["bytes"] == (dest / INDEX).stat().st_size and len(entry["sha256"]) == 64
    rows = np.load(dest / INDEX)
    assert rows.dtype == INDEX_DTYPE and len(rows) == COUNT
    ds = packer.open_dataset(dest, decode=False)
    for i in (0, 1, 299, COUNT - 1):
        payload, label = ds[i]
        assert rows["label"][i] == label and rows["size"][i] == payload.nbytes == SIDE * SIDE * 3
    counts = ds.reader.class_counts()
    del ds, payload
    gc.collect()
    release_handles()  # py-lmdb opens a file once a process: packer's environment closed first
    # a plain py-lmdb reader: the values lie where the index says, and the index file does not bother it
    with lmdb.open(str(dest), readonly=True, lock=False) as env, env.begin(buffers=True) as txn:
        sizes = [len(value) for _, value in txn.cursor()]
        raw = (dest / "data.mdb").read_bytes()
        for i in (0, COUNT - 1):
            at = int(rows["offset"][i])
            assert raw[at:at + int(rows["record"][i])] == bytes(txn.get(b"%010d" % i))
    assert rows["record"].tolist() == sizes
    assert np.array_equal(counts, np.bincount(rows["label"], minlength=3))


def packed_without_the_index(dataset: Path, old: Path) -> Path:
    """A copy of the LMDB ``dataset`` at ``old`` as an earlier packer wrote it: no lmdb_index.npy, in the folder or
    its manifest, and no class counts in the manifest."""
    shutil.copytree(dataset, old)
    data = json.loads((old / "manifest.json").read_text())
    data["files"] = [e for e in data["files"] if e["path"] != INDEX]
    del data["class_counts"]
    (old / "manifest.json").write_text(json.dumps(data))
    (old / INDEX).unlink()
    return old


def test_lmdb_packed_before_the_index_is_scanned_once_and_kept_in_the_cache(packs, tmp_path):
    """A dataset without lmdb_index.npy (packed by an earlier packer): the first ``info`` says it reads each
    record's header once and keeps the result in the cache folder; the next reads it from there, silently."""
    old = packed_without_the_index(packs / "lmdb", tmp_path / "old")
    env = dict(os.environ, PACKER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    runs = [subprocess.run([sys.executable, "-m", "packer", "info", str(old)], capture_output=True, text=True,
                           env=env, timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert "packed without an LMDB index" in runs[0].stderr and f"{COUNT:,} records" in runs[0].stderr
    assert "packed without" not in runs[1].stderr
    assert runs[0].stdout == runs[1].stdout and f"{COUNT:>10,}" in runs[1].stdout
    cached = list((tmp_path / "cache" / "layouts").glob("lmdb-index-*.npy"))
    assert len(cached) == 1 and np.array_equal(np.load(cached[0]), np.load(packs / "lmdb" / INDEX))
    assert not (old / INDEX).exists()  # the dataset's folder is left as it was


def test_lmdb_packed_before_the_index_reads_the_same_samples_and_labels(packs, tmp_path, monkeypatch, capsys):
    """An older dataset opens and trains as before: the same batches, labels and class counts as with an index,
    and the scan is said once in a process however many readers open it."""
    monkeypatch.setenv("PACKER_CACHE_DIR", str(tmp_path / "cache"))
    old = packed_without_the_index(packs / "lmdb", tmp_path / "old")
    indices = np.random.default_rng(3).choice(COUNT, BATCH, replace=False).tolist()
    new = packer.open_dataset(packs / "lmdb", decode=False)
    for _ in range(2):
        ds = packer.open_dataset(old, decode=False)
        for (payload, label), (want, want_label) in zip(ds.read_batch(indices), new.read_batch(indices), strict=True):
            assert bytes(payload) == bytes(want) and label == want_label
        assert np.array_equal(ds.reader.class_counts(), new.reader.class_counts())
    assert capsys.readouterr().err.count("packed without an LMDB index") == 1


def test_lmdb_index_whose_bytes_changed_is_refused_naming_it(packs, tmp_path):
    """The index holds the labels that class counts give: a byte changed since packing (same size) is caught by its
    sha256 in the manifest, a one-line error naming the file, before anything uses the whole index (class counts,
    blocks, sizes). ``packer info`` answers from the manifest's counts, and a batch reads its samples' labels and
    bytes from their records, never from the index, so both still give the right answers."""
    dest = tmp_path / "lmdb"
    shutil.copytree(packs / "lmdb", dest)
    raw = bytearray((dest / INDEX).read_bytes())
    raw[-20] ^= 1  # the last row's label
    (dest / INDEX).write_bytes(bytes(raw))
    result = CliRunner().invoke(main, ["info", str(dest)])
    assert result.exit_code == 0, result.output
    assert re.search(r"^\s+total\s+600$", result.output, re.M), result.output
    ds, sound = packer.open_dataset(dest, decode=False), packer.open_dataset(packs / "lmdb", decode=False)
    for (payload, label), (want, want_label) in zip(ds.read_batch([0, 1, COUNT - 1]),
                                                    sound.read_batch([0, 1, COUNT - 1]), strict=True):
        assert bytes(payload) == bytes(want) and label == want_label
    for use in (ds.reader.class_counts, ds.reader.stored_sizes, lambda: ds.blocks(1 << 16)):
        with pytest.raises(packer.CorruptDataError, match=re.escape(str(dest / INDEX)) + ": sha256 differs") as caught:
            use()
        assert "\n" not in str(caught.value)


def test_lmdb_index_row_that_places_a_record_past_the_file_is_refused_as_it_is_read(packs, tmp_path):
    """A damaged row is not checked at open (that would read the whole index), but its read-ahead never reaches
    past data.mdb: reading that sample is one line naming the index and its row."""
    dest = tmp_path / "lmdb"
    shutil.copytree(packs / "lmdb", dest)
    rows = np.load(dest / INDEX)
    rows["record"][7] = 1 << 31
    with open(dest / INDEX, "wb") as f:
        np.save(f, rows)
    ds = packer.open_dataset(dest, decode=False)
    assert len(ds.read_batch([0, 1])) == 2
    with pytest.raises(packer.CorruptDataError, match=re.escape(f"{dest / INDEX} row 7: places its record")) as caught:
        ds.read_batch([6, 7])
    assert "\n" not in str(caught.value) and "re-pack" in str(caught.value)


def test_verify_deep_names_an_lmdb_index_that_disagrees_with_the_records(packs, tmp_path):
    dest = tmp_path / "lmdb"
    shutil.copytree(packs / "lmdb", dest)
    rows = np.load(dest / INDEX)
    rows["label"][5] = (rows["label"][5] + 1) % 3
    with open(dest / INDEX, "wb") as f:
        np.save(f, rows)
    problems = verify(dest)
    assert any(f"{dest / INDEX}: sha256 differs" in p for p in problems), problems
    assert any("disagree with the records, the first for sample 5" in p for p in problems), problems
    assert np.array_equal(scan_index(dest, COUNT), np.load(packs / "lmdb" / INDEX))


@pytest.mark.parametrize("fmt", [*FORMATS, "parted"])
def test_info_reads_the_manifest_alone(fmt, packs, tmp_path):
    """``packer info`` of a dataset packed with its class counts in the manifest reads no other file: with every
    file dropped from the page cache none comes back, and with the index (or every data file) gone it still gives
    each class's count."""
    dest = packs / fmt
    dropped(dest)
    result = CliRunner().invoke(main, ["info", str(dest)])
    assert result.exit_code == 0, result.output
    assert re.search(rf"^\s+total\s+{(2 if fmt == 'parted' else 1) * COUNT:,}$", result.output, re.M), result.output
    others = [p for p in dest.rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert resident(others) == 0
    bare = tmp_path / fmt
    shutil.copytree(dest, bare, ignore=lambda folder, names: [n for n in names if n.endswith((".npy", ".mdb", ".h5",
                                                                                                 ".tar"))])
    result = CliRunner().invoke(main, ["info", str(bare)])
    assert result.exit_code == 0 and "unreadable" not in result.output, result.output
    assert re.search(rf"^\s+class1\s+{(2 if fmt == 'parted' else 1) * COUNT // 3}$", result.output, re.M), result.output


def test_info_counts_the_data_where_the_manifest_s_class_counts_disagree_with_its_count(packs, tmp_path):
    """Class counts that do not add up to the manifest's count are not shown: info counts the data instead."""
    dest = tmp_path / "ds"
    shutil.copytree(packs / "hdf5", dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    right = list(manifest["class_counts"])
    manifest["class_counts"] = [n + 5 for n in right]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["info", str(dest)])
    assert result.exit_code == 0, result.output
    assert re.search(rf"^\s+total\s+{sum(right):,}$", result.output, re.M), result.output

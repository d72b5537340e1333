"""WebDataset member names that cannot collide (issue 44): every field's member is ``KEY.NAME.EXT``, two parts where
packer's own members (the image's extension, ``cls``, ``json``) have one, and the one caption is ``KEY.txt``;
``ds[i]``, ``packer.stream``, the plain ``webdataset`` library and ``export`` give the same value for every field
of every sample, whatever the fields are named; datasets packed before (format_version 2) read as they did."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset
from conftest import write_image
from PIL import Image
from support.roundtrip import (
    assert_same,
    by_index,
    by_stream,
    by_webdataset,
    decoded_stored,
    exported,
    rename_members_as_before,
    stored_values,
)

import packer
from packer.errors import PackerError
from packer.verify import verify

N = 6


def write_table(root: Path, columns: list[str], rows: list[list]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "t.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)
    return root / "t.csv"


@pytest.fixture(scope="module")
def colliding_table(tmp_path_factory) -> Path:
    """Columns named as packer's own members and webdataset's extensions: a text column ``cls`` (the only text
    one: the caption), JSON columns ``packer`` and ``json``, a second image ``jpg``, a mask, an int64 ``Count``
    (a ``.cls`` member of its own) and a float32 ``txt``."""
    root = tmp_path_factory.mktemp("names") / "src"
    rows = []
    for i in range(N):
        write_image(root / f"img{i}.jpg", 24 + i, 20, seed=i)
        write_image(root / f"alt{i}.jpg", 16, 16 + i, seed=50 + i)
        Image.fromarray((np.arange((20) * (24 + i)).reshape(20, 24 + i) % (i + 2)).astype(np.uint8)).save(
            root / f"m{i}.png")
        rows.append([f"img{i}.jpg", "ab"[i % 2], f"text {i} ü", json.dumps({"p": i}), json.dumps([i, "j"]),
                     f"alt{i}.jpg", f"m{i}.png", 10 ** i, 0.1 * i])
    return write_table(root, ["image", "label", "cls", "packer", "json", "jpg", "seg_mask", "Count", "txt"], rows)


@pytest.fixture(scope="module")
def colliding(colliding_table, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("names-wds") / "ds"
    packer.pack(colliding_table, dest, format="wds", label_column="label", shard_samples=4, progress=False)
    return dest


def test_fields_named_as_packer_and_webdataset_members_read_alike_everywhere(colliding, tmp_path):
    indexed = by_index(colliding)
    assert sorted(row["cls"] for row in indexed) == [f"text {i} ü" for i in range(N)]  # the text, not the class
    assert_same(indexed, by_stream(colliding), "stream")  # the class, packer's json, the image: each its own
    assert_same(decoded_stored(colliding), by_webdataset(colliding), "webdataset")
    _, rows = exported(colliding, tmp_path / "out")
    assert_same(decoded_stored(colliding), rows, "export")
    names = {n.split(".", 1)[1] for n in tarfile.open(colliding / "shard-000000.tar").getnames()}
    assert names == {"jpg", "cls", "json", "txt", "packer.json", "json.json", "jpg.jpg", "seg_mask.png",
                     "Count.cls", "txt.npy"}


def test_a_dataset_packed_before_reads_as_it_did(colliding, tmp_path):
    """format_version 2 named a field as its extension (a bare ``KEY.jpg`` beside the image, ``KEY.json`` with
    packer's own as ``KEY.packer.json`` beside a field ``packer``'s): ``ds[i]`` and ``stream`` read each by its
    place, as the index does, and agree."""
    import shutil

    before = tmp_path / "before"
    shutil.copytree(colliding, before)
    rename_members_as_before(before)
    names = tarfile.open(before / "shard-000000.tar").getnames()
    assert names.count("000000000.jpg") == 2 and names.count("000000000.packer.json") == 2  # as written before
    assert verify(before) == []
    assert_same(by_index(colliding), by_index(before), "ds[i] before")
    assert_same(by_index(colliding), by_stream(before), "stream before")


@pytest.fixture(scope="module")
def captioned(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("caption") / "src"
    rows = []
    for i in range(N):
        write_image(root / f"{i}.jpg", 32, 24, seed=i)
        rows.append([f"{i}.jpg", f"a photo of {i}", f"title {i}", json.dumps({"id": i})])
    return write_table(root, ["image", "caption", "title", "meta"], rows)


def test_the_caption_is_txt_for_img2dataset_and_open_clip(captioned, tmp_path, run_packer):
    dest = tmp_path / "one"
    # the one text column (title dropped by an lmdb-only column type would change the table: use two tables)
    table = captioned.parent / "one.csv"
    with open(captioned, newline="") as f, open(table, "w", newline="") as g:
        writer = csv.writer(g)
        for row in csv.reader(f):
            writer.writerow([row[0], row[1], row[3]])
    packer.pack(table, dest, format="wds", progress=False)
    urls = sorted(str(p) for p in dest.glob("shard-*.tar"))
    pairs = list(webdataset.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg", "txt"))
    assert sorted(text for _, text in pairs) == sorted(f"a photo of {i}" for i in range(N))
    assert all(isinstance(image, Image.Image) for image, _ in pairs)
    assert packer.read_manifest(dest)["caption"] == "caption"
    assert_same(by_index(dest), by_stream(dest), "stream")
    # two text columns: --caption-column picks one; the other keeps NAME.txt
    two = tmp_path / "two"
    result = run_packer("pack", captioned, two, "--format", "wds", "--caption-column", "title", "--quiet")
    assert result.returncode == 0, result.stderr
    names = {n.split(".", 1)[1] for n in tarfile.open(next(two.glob("shard-*.tar"))).getnames()}
    assert names == {"jpg", "json", "txt", "caption.txt", "meta.json"}
    urls = sorted(str(p) for p in two.glob("shard-*.tar"))
    assert sorted(t for _, t in webdataset.WebDataset(urls, shardshuffle=False).to_tuple("jpg", "txt")) == \
        sorted(f"title {i}".encode() for i in range(N))
    assert_same(by_index(two), by_stream(two), "stream")
    # a caption column that is not a text column: one line, exit 2, nothing written
    result = run_packer("pack", captioned, tmp_path / "bad", "--format", "wds", "--caption-column", "meta")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--caption-column meta: not a text field" in result.stderr and not (tmp_path / "bad").exists()


def member_value(name: str, k: int) -> bytes:
    """A foreign member's bytes by its extension: JSON, a PNG, else text."""
    if name.endswith(".json"):
        return json.dumps(f"{name} {k}").encode()
    if name.endswith(".png"):
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 4, 3), k, np.uint8)).save(buf, "PNG")
        return buf.getvalue()
    return f"{name} {k}".encode()


def foreign_shard(path: Path, members: list[str]) -> Path:
    """A shard another tool wrote: three keys, each with a PNG image, a class and ``members`` (text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for k in range(3):
            buf = io.BytesIO()
            Image.fromarray(np.full((8, 8, 3), 40 * k, np.uint8)).save(buf, "PNG")
            for name, data in [("png", buf.getvalue()), ("cls", str(k).encode())] + \
                    [(m, member_value(m, k)) for m in members]:
                info = tarfile.TarInfo(f"k{k}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_foreign_member_names_are_fields_or_one_line(tmp_path, run_packer):
    long = "y" * 90 + ".txt"
    shard = foreign_shard(tmp_path / "src" / "a.tar", ["-x.txt", "caption.txt", "caption.json", "image.png", long])
    dest = tmp_path / "lmdb"
    result = run_packer("pack", shard, dest, "--format", "lmdb", "--quiet")
    assert result.returncode == 0, result.stderr
    reader = packer.open_dataset(dest)
    assert [f.name for f in reader.fields] == ["image", "label", "_-x", "caption", "caption_txt", "image_png",
                                               "y" * 90]
    assert reader[1]["_-x"] == "-x.txt 1" and reader[2]["y" * 90] == f"{long} 2"
    # WebDataset's tar headers hold names of up to 100 bytes: the 90-character one is refused, in one line
    result = run_packer("pack", shard, tmp_path / "wds", "--format", "wds")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "has a name of 90 characters" in result.stderr and not (tmp_path / "wds").exists()
    ds = packer.WdsDataset.from_shards([shard])
    assert len(ds) == 3 and ds[2][1] == 2


def test_names_that_differ_only_in_case_are_refused_in_wds(tmp_path, run_packer):
    rows = []
    for i in range(3):
        write_image(tmp_path / "src" / f"{i}.png", 16, 16, seed=i)
        rows.append([f"{i}.png", f"a{i}", f"b{i}"])
    table = write_table(tmp_path / "src", ["image", "Note", "note"], rows)
    result = run_packer("pack", table, tmp_path / "wds", "--format", "wds")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "fields 'Note' and 'note' differ only in case" in result.stderr and not (tmp_path / "wds").exists()
    assert run_packer("pack", table, tmp_path / "lmdb", "--format", "lmdb").returncode == 0  # lmdb stores them


def test_stored_bytes_are_what_webdataset_reads(colliding):
    """The image and every field under the names the format documents are the stored bytes, byte for byte."""
    stored = stored_values(colliding)
    members = [m for m in by_webdataset(colliding)]
    for s, m in zip(stored, members, strict=True):
        assert s["image"] == m["image"] and s["jpg"] == m["jpg"] and s["seg_mask"] == m["seg_mask"]


def test_a_damaged_label_member_in_a_stream_is_one_line(colliding, tmp_path):
    import shutil

    dest = tmp_path / "ds"
    shutil.copytree(colliding, dest)
    shard = dest / "shard-000000.tar"
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        member = tar.getmember("000000001.cls")
    data[member.offset_data] = ord("x")
    shard.write_bytes(bytes(data))
    with pytest.raises(PackerError, match=r"sample 000000001: its \.cls member is not an integer label") as exc:
        list(packer.stream(dest, batch_size=2, shuffle=False, num_workers=0))
    assert "\n" not in str(exc.value)

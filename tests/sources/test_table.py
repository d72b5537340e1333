"""Annotation tables as a source: every column packed as a field into every format, read back exactly (through
packer's reader and through the plain libraries), and every malformed table refused in one line."""

from __future__ import annotations

import csv
import io
import json
import shutil
import struct
import tarfile
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
import webdataset
from conftest import write_image
from PIL import Image

import packer
from packer.fields import decode
from packer.formats import open_reader
from packer.verify import verify

FORMATS = ("lmdb", "hdf5", "wds")
SUBJECTS = ("zebra", "apple", "moon")
N = 9


def _mask(width: int, height: int, seed: int) -> np.ndarray:
    """Blocky class indices 0..4, plus 255 (ignore) in one corner: values a smoothing resample would change."""
    rng = np.random.default_rng(seed)
    mask = np.kron(rng.integers(0, 5, (height // 8 + 1, width // 8 + 1)), np.ones((8, 8), int))[:height, :width]
    mask[:4, :4] = 255
    return mask.astype(np.uint8)


def _rows(root: Path) -> list[dict]:
    rows = []
    for i in range(N):
        w, h = 64 + 8 * i, 48 + 4 * (i % 3)
        write_image(root / "images" / f"img{i}.jpg", w, h, seed=i)
        Image.fromarray(_mask(w, h, i)).save(root / "masks" / f"img{i}.png") if (root / "masks").is_dir() else None
        rows.append({"image": f"images/img{i}.jpg", "subject": SUBJECTS[i % 3], "caption": f"picture {i}, of \"it\"",
                     "score": i / 4, "count": i * 1000, "box": [i, i + 1, 2.5, 3.0], "tags": list(range(i % 3)),
                     "meta": {"i": i, "odd": bool(i % 2)}, "seg_mask": f"masks/img{i}.png"})
    return rows


@pytest.fixture(scope="session")
def table(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A CSV table of 9 images with every kind of column, and its rows as Python values."""
    root = tmp_path_factory.mktemp("table")
    (root / "masks").mkdir()
    rows = _rows(root)
    with open(root / "train.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
    return root / "train.csv", rows


@pytest.fixture(scope="session")
def packed(table, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("packed")
    return {fmt: _pack(table[0], out / fmt, fmt) for fmt in FORMATS}


def _pack(src: Path, dest: Path, fmt: str, **options) -> Path:
    packer.pack(src, dest, fmt, label_column="subject", max_size=40, progress=False, **options)
    return dest


def _by_relpath(reader) -> dict[str, int]:
    reader.open()
    return {reader.relpath(i): i for i in range(len(reader))}


def _expected_mask(root: Path, relpath: str, size: tuple[int, int]) -> np.ndarray:
    source = Image.open(root / relpath)
    return np.asarray(source.resize(size, Image.Resampling.NEAREST))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_column_reads_back_exactly(packed, table, fmt):
    src, rows = table
    reader = open_reader(packed[fmt])
    assert [(f.name, f.kind) for f in reader.schema] == [
        ("image", "image"), ("subject", "class"), ("caption", "text"), ("score", "float32"), ("count", "int64"),
        ("box", "float32"), ("tags", "int64"), ("meta", "json"), ("seg_mask", "mask")]
    assert reader.classes == sorted(SUBJECTS)  # ImageFolder's rule: sorted names
    index = _by_relpath(reader)
    assert sorted(index) == sorted(r["image"] for r in rows)
    for row in rows:
        i = index[row["image"]]
        sample = reader.read(i)
        assert reader.classes[sample.label] == row["subject"]
        values = {f.name: decode(f, v) for f, v in zip(reader.extra_fields, reader.read_fields(i, verify=True).values(),
                                                         strict=True)}
        assert values["caption"] == row["caption"] and values["count"] == row["count"]
        assert values["score"] == pytest.approx(row["score"]) and values["meta"] == row["meta"]
        assert values["box"].tolist() == row["box"] and values["tags"].tolist() == row["tags"]
        mask = np.asarray(Image.open(io.BytesIO(values["seg_mask"])))
        h, w, _ = sample.shape
        assert mask.shape == (h, w)  # lines up with its image
        assert np.array_equal(mask, _expected_mask(src.parent, row["seg_mask"], (w, h)))
        assert set(np.unique(mask)) <= set(np.unique(np.asarray(Image.open(src.parent / row["seg_mask"]))))


def test_plain_libraries_read_the_fields(packed, table, tmp_path):
    _, rows = table
    by_caption = {r["caption"]: r for r in rows}
    # webdataset: members named as it decodes them
    shards = sorted(str(p) for p in packed["wds"].glob("shard-*.tar"))
    seen = 0
    for sample in webdataset.WebDataset(shards, shardshuffle=False).decode("pil"):
        row = by_caption[sample["txt"]]  # the one text field is KEY.txt, as img2dataset and open_clip read it
        assert sample["meta.json"] == row["meta"] and sample["count.cls"] == row["count"]
        assert sample["box.npy"].tolist() == row["box"] and sample["tags.npy"].tolist() == row["tags"]
        assert sample["cls"] == sorted(SUBJECTS).index(row["subject"])
        assert sample["seg_mask.png"].size == sample["jpg"].size
        seen += 1
    assert seen == N
    # h5py: typed arrays for fixed-shape numbers, values + offsets for the rest
    with h5py.File(packed["hdf5"] / "data.h5", "r") as f:
        relpaths = [p.decode() for p in f["relpaths"][()]]
        captions = f["fields/caption/values"][()].tobytes()
        offsets = f["fields/caption/offsets"][()]
        for i, relpath in enumerate(relpaths):
            row = next(r for r in rows if r["image"] == relpath)
            assert captions[offsets[i]:offsets[i + 1]].decode() == row["caption"]
            assert f["fields/count"][i] == row["count"] and f["fields/box"][i].tolist() == row["box"]
    # py-lmdb: the record layout the module documents
    copy = tmp_path / "lmdb"  # a fresh path: py-lmdb opens a file once a process, and packer's reader has it
    shutil.copytree(packed["lmdb"], copy)
    env = lmdb.open(str(copy), readonly=True, lock=False)
    with env.begin() as txn:
        value = txn.get(b"%010d" % 0)
    magic, _, _, _, _, _, _, path_len, size = struct.unpack_from("<4siIHHBBHI", value)
    assert magic == b"PKR2"
    at = 24 + path_len + size
    _, n = struct.unpack_from("<II", value, at)
    lengths = struct.unpack_from(f"<{n}I", value, at + 8)
    start = at + 8 + 4 * n
    caption = value[start:start + lengths[0]].decode()
    relpath = value[24:24 + path_len].decode()
    assert caption == next(r for r in rows if r["image"] == relpath)["caption"]


def test_jsonl_with_integer_labels_and_a_root(tmp_path):
    root = tmp_path / "data"
    (root / "masks").mkdir(parents=True)
    rows = _rows(root)
    table = tmp_path / "ann" / "train.jsonl"
    table.parent.mkdir()
    table.write_text("".join(json.dumps({**r, "label": i % 2}) + "\n" for i, r in enumerate(rows)))
    dest = tmp_path / "out"
    packer.pack(table, dest, "lmdb", root=root, label_column="label", field=("caption:json",), progress=False)
    reader = open_reader(dest)
    assert reader.classes == ["0", "1"]
    fields = {f.name: f for f in reader.schema}
    assert fields["caption"].kind == "json" and fields["box"].kind == "float32" and fields["box"].shape == (4,)
    index = _by_relpath(reader)
    for i, row in enumerate(rows):
        assert reader.read(index[row["image"]]).label == i % 2


def test_a_table_without_a_label_packs_and_repacks_with_its_fields(table, tmp_path):
    src, rows = table
    packer.pack(src, tmp_path / "a", "hdf5", progress=False)
    packer.pack(tmp_path / "a", tmp_path / "b", "wds", progress=False)
    reader = open_reader(tmp_path / "b")
    assert reader.classes == [] and "subject" in [f.name for f in reader.schema]
    assert reader.schema[1].kind == "text"  # the subject column, typed from its values
    index = _by_relpath(reader)
    first = rows[0]
    fields = reader.read_fields(index[first["image"]], verify=True)
    assert bytes(fields["caption"]).decode() == first["caption"]
    names = tarfile.open(next((tmp_path / "b").glob("shard-*.tar"))).getnames()
    assert any(n.endswith(".count.cls") for n in names)
    assert not [n for n in names if n.split(".", 1)[1] == "cls"]  # no class, no .cls member
    assert verify(tmp_path / "b", deep=True) == []


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, args, message", [
    ("path,label\nimages/img0.jpg,a\n", (), "no column 'image' (columns: path, label)"),
    ("image,label\nimages/img0.jpg,a\n", ("--label-column", "klass"), "--label-column klass"),
    ("image,n\nimages/img0.jpg,1\nimages/img1.jpg,oops\n", ("--field", "n:int64"), "line 3, column 'n': 'oops' is not"),
    ("image,box\nimages/img0.jpg,\"[1,2]\"\nimages/img1.jpg,\"[1,2]\"\n", ("--field", "box:float32[3]"),
     "line 2, column 'box'"),
    ("image\nimages/img0.jpg\nimages/./img0.jpg\n", (), "lines 2 and 3: the same image"),
    ("image,label\nimages/img0.jpg,\n", ("--label-column", "label"), "line 2, column 'label': no label"),
    ("image,label\nimages/img0.jpg,a\n", ("--field", "nope:text"), "has no column 'nope'"),
    ("image,label\nimages/img0.jpg,a\n", ("--field", "label:string"), "--field 'label:string'"),
    ("image,label\n", (), "the table has no rows"),
    ("image,label\nimages/img0.jpg,a,extra\n", (), "line 2: 3 cells where the header has 2"),
])
def test_a_malformed_table_is_one_line_naming_the_row_and_column(tmp_path, run_packer, text, args, message):
    write_image(tmp_path / "images" / "img0.jpg")
    write_image(tmp_path / "images" / "img1.jpg")
    src = _write(tmp_path / "t.csv", text)
    result = run_packer("pack", src, tmp_path / "out", "--format", "lmdb", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_jsonl_row_that_is_not_an_object_names_its_line(tmp_path, run_packer):
    src = _write(tmp_path / "t.jsonl", '{"image": "a.jpg"}\n[1, 2]\n')
    result = run_packer("pack", src, tmp_path / "out", "--format", "wds")
    assert result.returncode == 2 and "t.jsonl line 2" in result.stderr


def test_an_unreadable_image_or_mask_is_skipped_and_listed(tmp_path, run_packer):
    (tmp_path / "masks").mkdir()
    rows = _rows(tmp_path)[:3]
    (tmp_path / "images" / "img1.jpg").write_bytes(b"not a jpeg")
    Image.fromarray(np.zeros((5, 5), np.uint8)).save(tmp_path / "masks" / "img2.png")  # not its image's size
    src = tmp_path / "t.csv"
    with open(src, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["image", "seg_mask"])
        writer.writeheader()
        writer.writerows({"image": r["image"], "seg_mask": r["seg_mask"]} for r in rows)
    result = run_packer("pack", src, tmp_path / "out", "--format", "hdf5")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["count"] == 1
    assert {s["path"] for s in manifest["skipped"]} == {"images/img1.jpg", "images/img2.jpg"}
    assert "masks/img2.png: mask is 5x5, its image 80x56" in json.dumps(manifest["skipped"])


@pytest.fixture(scope="session")
def laion_shards(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two LAION/CC3M-style shards written by webdataset: .jpg + .txt + .json, no label."""
    root = tmp_path_factory.mktemp("laion")
    samples = []
    for s in range(2):
        with webdataset.TarWriter(str(root / f"laion-{s}.tar")) as sink:
            for i in range(4):
                key = f"{s:02d}{i:04d}"
                buf = io.BytesIO()
                write_image(root / "tmp.jpg", 40 + i, 30, seed=s * 10 + i)
                buf.write((root / "tmp.jpg").read_bytes())
                sample = {"__key__": key, "jpg": buf.getvalue(), "txt": f"a photo of astronaut {s}-{i}",
                          "json": {"url": f"http://x/{key}.jpg", "width": 40 + i}}
                sink.write(sample)
                samples.append(sample)
    return root, samples


@pytest.mark.parametrize("fmt", FORMATS)
def test_foreign_shards_keep_every_member_as_a_field(laion_shards, tmp_path, run_packer, fmt):
    root, samples = laion_shards
    result = run_packer("pack", f"{root}/laion-*.tar", tmp_path / "out", "--format", fmt)
    assert result.returncode == 0, result.stderr
    reader = open_reader(tmp_path / "out")
    assert [(f.name, f.kind) for f in reader.schema] == [("image", "image"), ("json", "json"), ("txt", "text")]
    assert reader.classes == []
    by_relpath = _by_relpath(reader)
    for sample in samples:
        i = by_relpath[next(p for p in by_relpath if p.endswith(f"/{sample['__key__']}.jpg"))]
        fields = reader.read_fields(i, verify=True)
        assert bytes(fields["txt"]).decode() == sample["txt"]
        assert json.loads(bytes(fields["json"])) == sample["json"]
        assert bytes(reader.read(i).payload) == sample["jpg"]  # store original: the exact bytes
    if fmt == "wds":  # and the output is what webdataset users expect: .jpg + .txt, every other field NAME.EXT
        names = tarfile.open(next((tmp_path / "out").glob("shard-*.tar"))).getnames()
        assert {n.split(".", 1)[1] for n in names} == {"jpg", "txt", "json", "json.json"}


def test_a_label_key_still_picks_the_class_and_must_be_an_integer(laion_shards, tmp_path, run_packer):
    root, _ = laion_shards
    result = run_packer("pack", f"{root}/laion-*.tar", tmp_path / "out", "--format", "lmdb", "--label-key", "txt")
    assert result.returncode != 0 and "is not an integer class index" in result.stderr
    result = run_packer("pack", f"{root}/laion-*.tar", tmp_path / "out", "--format", "lmdb",
                        "--label-key", "json:width")
    assert result.returncode == 0, result.stderr
    reader = open_reader(tmp_path / "out")
    assert reader.classes == [str(i) for i in range(44)] and label_names(reader) == {"json", "txt"}


def label_names(reader) -> set[str]:
    return {f.name for f in reader.extra_fields}

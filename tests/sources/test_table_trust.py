"""A table from a stranger (issue 44, the pack side): its paths stay inside --root, only regular files are opened,
every value is checked before anything is written (one line naming the row and column, exit 2, no DEST), a
column's type never changes on account of one row, and masks are stored exactly or refused. Each case runs the real
`packer pack` in its own process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image
from PIL import Image
from support.processes import assert_ok, assert_one_line_error, packer_limited

import packer
from packer.fields import decode
from packer.formats import open_reader

GiB = 1 << 30


@pytest.fixture
def root(tmp_path) -> Path:
    """Three images and their masks in ``data/``, and a file outside it."""
    data = tmp_path / "data"
    for i in range(3):
        write_image(data / "images" / f"img{i}.png", 24, 16, seed=i)
        Image.fromarray(np.full((16, 24), i, np.uint8)).save(data / "masks" / f"img{i}.png") \
            if (data / "masks").mkdir(parents=True, exist_ok=True) is None else None
    write_image(tmp_path / "secret.png", 24, 16, seed=9)
    return data


def table(root: Path, rows: list[dict], name: str = "t.jsonl") -> Path:
    path = root / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        header = list(rows[0])
        path.write_text(",".join(header) + "\n" + "".join(",".join(str(r[h]) for h in header) + "\n" for r in rows))
    return path


def refused(src: Path, dest: Path, *args: str, line: int | None = None, column: str | None = None,
            memory: int | None = 3 * GiB) -> str:
    """``packer pack SRC DEST ARGS`` fails in one line (exit 2) naming the line and column, and leaves no DEST."""
    proc = packer_limited("pack", src, dest, "--format", "lmdb", "--quiet", *args, memory=memory)
    names = ([f"line {line}"] if line else []) + ([f"column {column!r}"] if column else [])
    message = assert_one_line_error(proc, *names, code=2)
    assert not dest.exists(), os.listdir(dest)
    return message


# -- paths stay inside the root ---------------------------------------------------------------------------------
@pytest.mark.parametrize("column", ["image", "seg_mask"])
@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_a_path_outside_the_root_is_refused_before_anything_is_read(root, tmp_path, column, how):
    outside = {"dotdot": "../secret.png", "absolute": str(tmp_path / "secret.png"), "link": "images/link.png"}[how]
    if how == "link":
        os.symlink(tmp_path / "secret.png", root / "images" / "link.png")
    rows = [{"image": f"images/img{i}.png", "seg_mask": f"masks/img{i}.png"} for i in range(3)]
    rows[1][column] = outside
    message = refused(table(root, rows), tmp_path / "out", line=2, column=column)
    assert "outside --root" in message and "--root /" in message


def test_the_refusal_says_nothing_about_what_exists_outside_the_root(root, tmp_path):
    def message(cell: str) -> str:
        rows = [{"image": "images/img0.png"}, {"image": cell}]
        return refused(table(root, rows), tmp_path / "out", line=2, column="image").replace(cell, "CELL")

    assert message("../secret.png") == message("../no-such-file.png") == message("../../etc")


def test_absolute_paths_inside_the_root_are_fine_and_root_slash_accepts_any(root, tmp_path):
    rows = [{"image": str(root / "images" / "img0.png")}, {"image": "images/img1.png"}]
    assert_ok(packer_limited("pack", table(root, rows), tmp_path / "a", "--format", "wds", "--quiet"))
    assert {open_reader(tmp_path / "a").relpath(i) for i in range(2)} == {"images/img0.png", "images/img1.png"}
    rows = [{"image": str(root / "images" / "img0.png")}, {"image": str(tmp_path / "secret.png")}]
    assert_ok(packer_limited("pack", table(root, rows), tmp_path / "b", "--format", "wds", "--root", "/",
                             "--quiet"))
    assert len(packer.open_dataset(tmp_path / "b")) == 2


def test_a_fifo_a_folder_or_a_missing_file_skips_its_row_and_never_hangs(root, tmp_path):
    os.mkfifo(root / "masks" / "fifo.png")
    os.mkfifo(root / "images" / "fifo.png")
    (root / "images" / "folder.png").mkdir()
    rows = [{"image": "images/img0.png", "seg_mask": "masks/fifo.png"},  # the first mask: its header is read
            {"image": "images/fifo.png", "seg_mask": "masks/img1.png"},
            {"image": "images/folder.png", "seg_mask": "masks/img2.png"},
            {"image": "images/never.png", "seg_mask": "masks/img2.png"},
            {"image": "images/img2.png", "seg_mask": "masks/img2.png"}]
    proc = packer_limited("pack", table(root, rows), tmp_path / "out", "--format", "hdf5", "--quiet", timeout=120)
    assert_ok(proc)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["count"] == 1
    why = {s["path"]: s["error"] for s in manifest["skipped"]}
    assert set(why) == {"images/img0.png", "images/fifo.png", "images/folder.png", "images/never.png"}
    assert "not a regular file" in why["images/fifo.png"] and "not a regular file" in why["images/img0.png"]
    assert "no such file" in why["images/never.png"] and "moved" not in why["images/never.png"]
    assert all(w.startswith("line ") and "cannot read it" in w for w in why.values()), why


def test_a_folder_source_follows_its_links_as_imagefolder_does_a_table_does_not(tmp_path):
    """Decided and documented (README, "Folder semantics"): an image folder is read as ImageFolder reads it, its
    links followed wherever they lead; only a table's paths are held inside the root."""
    write_image(tmp_path / "elsewhere" / "x.png", 20, 20)
    write_image(tmp_path / "src" / "cat" / "a.png", 20, 20, seed=1)
    os.symlink(tmp_path / "elsewhere" / "x.png", tmp_path / "src" / "cat" / "x.png")
    assert_ok(packer_limited("pack", tmp_path / "src", tmp_path / "out", "--format", "lmdb", "--quiet"))
    assert len(packer.open_dataset(tmp_path / "out")) == 2
    (tmp_path / "src" / "t.csv").write_text("image\ncat/a.png\ncat/x.png\n")
    refused(tmp_path / "src" / "t.csv", tmp_path / "out2", line=3, column="image")


# -- every value checked before it is written -------------------------------------------------------------------
CASES = [
    ("t.csv", "image,caption,caption\nimages/img0.png,a,b\n", (), 1, "caption"),
    ("t.jsonl", '{"image": "images/img0.png", "a": 1, "a": 2}\n', (), 1, None),
    ("t.csv", "image,label\nimages/img0.png,0\nimages/img1.png,99999999999\n", ("--label-column", "label"), 3,
     "label"),
    ("t.csv", "image,label\nimages/img0.png,0\nimages/img1.png,2000000\n", ("--label-column", "label"), 3, "label"),
    ("t.jsonl", '{"image": "images/img0.png", "label": true}\n', ("--label-column", "label"), 1, "label"),
    ("t.csv", "image,label\nimages/img0.png,\u00b2\n", ("--label-column", "label"), 2, "label"),
    ("t.jsonl", '{"image": "images/img0.png", "n": 16777217}\n{"image": "images/img1.png", "n": 18446744073709551616}'
     "\n", (), 2, "n"),
    ("t.csv", "image,n\nimages/img0.png,1\nimages/img1.png," + "7" * 5000 + "\n", (), 3, "n"),
    ("t.jsonl", '{"image": "images/img0.png", "m": ' + "[" * 5000 + "]" * 5000 + "}\n", (), 1, None),
    ("t.csv", 'image,m\nimages/img0.png,"' + "[" * 5000 + "]" * 5000 + '"\n', ("--field", "m:json"), 2, "m"),
    ("t.jsonl", '{"image": "images/img0.png", "m": {"a": NaN}}\n', (), 1, "m"),
    ("t.jsonl", '{"image": "images/img0.png", "box": [1, 2, 3, 4]}\n{"image": "images/img1.png", "box": [1, 2, 3, 4, '
     "5]}\n", (), 2, "box"),
    ("t.csv", "image,n\nimages/img0.png,1e39\n", (), 2, "n"),
]


@pytest.mark.parametrize("name, text, args, line, column", CASES)
def test_a_value_that_cannot_be_stored_is_one_line_naming_its_row_and_column(root, tmp_path, name, text, args, line,
                                                                             column):
    src = root / name
    src.write_text(text, encoding="utf-8")
    refused(src, tmp_path / "out", *args, line=line, column=column)


@pytest.mark.parametrize("text, args, words", [
    ("image,caption\nimages/img0.png,a\n", ("--field", "caption:bytes"), ["--field caption:bytes"]),
    ("image,caption\nimages/img0.png,a\n", ("--field", "caption:text", "--field", "caption:json"), ["given twice"]),
    ("image,n\nimages/img0.png,1\n", ("--field", "n:class"), ["--label-column n"]),
    ("img,image\nimages/img0.png,images/img1.png\n", ("--image-column", "img"), ["--image-column img", "'image'"]),
    ("image,label\nimages/img0.png,a\n", ("--label-column", "label", "--field", "label:text"),
     ["--field label:text"]),
])
def test_a_schema_no_dataset_could_be_opened_with_is_refused_by_pack(root, tmp_path, text, args, words):
    src = root / "t.csv"
    src.write_text(text)
    message = refused(src, tmp_path / "out", *args)
    assert all(word in message for word in words), message


def test_a_field_name_too_long_for_a_tar_header_is_refused_up_front(root, tmp_path):
    src = root / "t.csv"
    src.write_text(f"image,{'a' * 90}\nimages/img0.png,7\n")
    proc = packer_limited("pack", src, tmp_path / "out", "--format", "wds", "--quiet")
    assert_one_line_error(proc, "a" * 20, code=2)
    assert not (tmp_path / "out").exists()
    assert_ok(packer_limited("pack", src, tmp_path / "lmdb", "--format", "lmdb", "--quiet"))


@pytest.mark.parametrize("name, kind", [("png", "mask"), ("cls", "int64"), ("jpg", "image"), ("json", "json"),
                                        ("packer", "text"), ("packer", "json")])
def test_a_field_named_like_a_webdataset_member_is_refused_or_kept_apart(root, tmp_path, name, kind):
    """A field named as the image's extension, the class or packer's json member never lands where they are
    read (``ds[i]`` and ``stream`` agree): refused before anything is written, or stored under a name of its
    own."""
    Image.open(root / "images" / "img1.png").convert("RGB").save(root / "images" / "second.jpg", quality=90)
    value = {"mask": "masks/img0.png", "int64": "7", "image": "images/second.jpg", "json": '"{""a"": 1}"',
             "text": "words"}[kind]
    src = root / "t.csv"
    src.write_text(f"image,label,{name}\nimages/img0.png,cat,{value}\nimages/img2.png,dog,{value}\n")
    proc = packer_limited("pack", src, tmp_path / "out", "--format", "wds", "--quiet", "--label-column", "label",
                          "--field", f"{name}:{kind}")
    if proc.returncode:
        assert_one_line_error(proc, repr(name), code=2)
        assert not (tmp_path / "out").exists()
        return
    ds = packer.open_dataset(tmp_path / "out")
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["label"] == ds.classes.index({"images/img0.png": "cat"}.get(ds.relpath(i), "dog"))
        assert np.array_equal(sample["image"].permute(1, 2, 0).numpy(),
                              np.asarray(Image.open(root / ds.relpath(i)).convert("RGB")))
        got = sample[name]
        want = {"int64": 7, "json": {"a": 1}, "text": "words"}.get(kind)
        if want is not None:
            assert (got.item() if hasattr(got, "item") else got) == want
        else:
            shown = got.permute(1, 2, 0).numpy() if kind == "image" else got.numpy()
            stored = np.asarray(Image.open(root / value).convert("RGB")) if kind == "image" else \
                np.asarray(Image.open(root / value))
            assert np.array_equal(shown, stored)
    batch = next(iter(packer.stream(tmp_path / "out", batch_size=len(ds), shuffle=False, num_workers=0)))
    for i in range(len(ds)):  # the sequential reader finds each member where ds[i] does
        sample = ds[i]
        assert int(batch["label"][i]) == sample["label"]
        assert np.array_equal(np.asarray(batch["image"][i]), np.asarray(sample["image"]))
        got = batch[name][i]
        assert (got == sample[name]) if kind in ("json", "text") else \
            np.array_equal(np.asarray(got), np.asarray(sample[name]))


def test_one_huge_integer_does_not_make_a_column_float(root, tmp_path):
    """The column stays int64 and its one bad row is named (above); the good ones read back exactly."""
    src = table(root, [{"image": "images/img0.png", "n": 16777217, "m": {"a": [1, "x"]}, "code": "007"},
                       {"image": "images/img1.png", "n": -(2**63), "m": "plain text", "code": "8"}])
    assert_ok(packer_limited("pack", src, tmp_path / "out", "--format", "hdf5", "--quiet"))
    reader = open_reader(tmp_path / "out")
    reader.open()
    fields = {f.name: f for f in reader.schema}
    assert (fields["n"].kind, fields["m"].kind, fields["code"].kind) == ("int64", "json", "text")
    got = {reader.relpath(i): {f.name: decode(f, v) for f, v in zip(reader.extra_fields, reader.read_extras(i),
                                                                        strict=True)} for i in range(2)}
    assert got["images/img0.png"] == {"n": 16777217, "m": {"a": [1, "x"]}, "code": "007"}
    assert got["images/img1.png"] == {"n": -(2**63), "m": "plain text", "code": "8"}


def test_nan_and_infinity_are_float32_values(root, tmp_path):
    src = root / "t.csv"
    src.write_text("image,y\nimages/img0.png,nan\nimages/img1.png,-inf\nimages/img2.png,1.7\n")
    assert_ok(packer_limited("pack", src, tmp_path / "out", "--format", "lmdb", "--quiet"))
    ds = packer.open_dataset(tmp_path / "out")
    values = {ds.relpath(i): float(ds[i]["y"]) for i in range(3)}
    assert math.isnan(values["images/img0.png"]) and values["images/img1.png"] == -math.inf
    assert values["images/img2.png"] == float(np.float32(1.7))


def test_integer_labels_are_bounded_and_unused_classes_are_one_warning(root, tmp_path):
    src = table(root, [{"image": "images/img0.png", "label": 0}, {"image": "images/img1.png", "label": 99_999}])
    proc = packer_limited("pack", src, tmp_path / "out", "--format", "lmdb", "--label-column", "label", "--quiet",
                          memory=3 * GiB)
    assert_ok(proc)
    assert len(proc.stderr.splitlines()) == 1 and "99,998 of the 100,000 classes have no images" in proc.stderr
    ds = packer.open_dataset(tmp_path / "out")
    assert len(ds.classes) == 100_000 and sorted(int(ds[i][1]) for i in range(2)) == [0, 99_999]


# -- masks -----------------------------------------------------------------------------------------------------
def _mask(path: Path, values: np.ndarray, mode: str | None = None) -> str:
    Image.fromarray(values, mode).save(path) if mode else Image.fromarray(values).save(path)
    return str(path.relative_to(path.parents[1]))


def test_a_float_mask_is_refused_first_in_one_line_then_row_by_row(root, tmp_path):
    first = _mask(root / "masks" / "f.tif", np.full((16, 24), 1.7, np.float32))
    rows = [{"image": f"images/img{i}.png", "seg_mask": f"masks/img{i}.png"} for i in range(3)]
    message = refused(table(root, [{**rows[0], "seg_mask": first}] + rows[1:]), tmp_path / "out", line=1,
                      column="seg_mask")
    assert "float mask" in message
    proc = packer_limited("pack", table(root, rows[:2] + [{**rows[2], "seg_mask": first}]), tmp_path / "out",
                          "--format", "lmdb", "--quiet")
    assert_ok(proc)
    skipped = json.loads((tmp_path / "out" / "manifest.json").read_text())["skipped"]
    assert [s["path"] for s in skipped] == ["images/img2.png"] and "float mask" in skipped[0]["error"]


def test_a_later_mask_of_another_depth_is_kept_exactly_or_refused_with_advice_that_works(root, tmp_path):
    fits = (np.arange(16 * 24).reshape(16, 24) % 200).astype(np.uint16)
    wide = fits + 300
    rows = [{"image": "images/img0.png", "seg_mask": "masks/img0.png"},
            {"image": "images/img1.png", "seg_mask": _mask(root / "masks" / "fits.png", fits)},
            {"image": "images/img2.png", "seg_mask": _mask(root / "masks" / "wide.png", wide)}]
    src = table(root, rows)
    proc = packer_limited("pack", src, tmp_path / "a", "--format", "wds", "--quiet")
    assert_ok(proc)
    skipped = json.loads((tmp_path / "a" / "manifest.json").read_text())["skipped"]
    assert [s["path"] for s in skipped] == ["images/img2.png"]
    advice = re.search(r"pass (--field \S+)", skipped[0]["error"]).group(1)
    ds = packer.open_dataset(tmp_path / "a")
    masks = {ds.relpath(i): ds[i]["seg_mask"].numpy() for i in range(len(ds))}
    assert np.array_equal(masks["images/img1.png"], fits)  # 16-bit values that fit: kept exactly, as uint8
    flag, value = advice.split(" ", 1)
    assert_ok(packer_limited("pack", src, tmp_path / "b", "--format", "wds", "--quiet", flag, value))
    ds = packer.open_dataset(tmp_path / "b")
    masks = {ds.relpath(i): ds[i]["seg_mask"].numpy() for i in range(len(ds))}
    assert len(masks) == 3 and np.array_equal(masks["images/img2.png"], wide)
    assert np.array_equal(masks["images/img0.png"], np.zeros((16, 24)))


def test_an_unreadable_first_mask_skips_its_row_not_the_conversion(root, tmp_path):
    (root / "masks" / "bad.png").write_bytes(b"not a png at all")
    rows = [{"image": "images/img0.png", "seg_mask": "masks/bad.png"},
            {"image": "images/img1.png", "seg_mask": "masks/img1.png"}]
    assert_ok(packer_limited("pack", table(root, rows), tmp_path / "out", "--format", "lmdb", "--quiet"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["count"] == 1 and [s["path"] for s in manifest["skipped"]] == ["images/img0.png"]


# -- the folder source ------------------------------------------------------------------------------------------
def test_a_class_folder_passed_as_src_warns_about_the_images_beside_its_folders(tmp_path):
    for i in range(3):
        write_image(tmp_path / "cat" / f"{i}.jpg", 20, 20, seed=i)
    write_image(tmp_path / "cat" / "kittens" / "k.jpg", 20, 20)
    proc = subprocess.run([os.sys.executable, "-m", "packer", "pack", tmp_path / "cat", tmp_path / "out",
                           "--format", "lmdb", "--quiet"], capture_output=True, text=True)
    assert_ok(proc)
    warnings = [line for line in proc.stderr.splitlines() if "beside its 1 class folder" in line]
    assert len(warnings) == 1 and "3 images" in warnings[0] and "0.jpg" in warnings[0], proc.stderr

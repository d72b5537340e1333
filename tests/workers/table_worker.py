"""The property test of tests/sources/test_table_properties.py, run in its own process under an address-space
limit: ``python table_worker.py WORKDIR EXAMPLES LIMIT_BYTES``.

Hypothesis writes random annotation tables (CSV or JSON Lines): column names (plain, unicode, long, repeated,
packer's and webdataset's own), values (integers of any size, floats with NaN and Infinity, text, empty cells,
JSON nested shallow or deep, lists of fixed and varying length, booleans), image paths (images of several modes
and sizes, missing files, files that are no image, FIFOs, folders, paths outside the root) and masks (8- and
16-bit, float, of the wrong size, missing), and packs each into a random format. Then either the pack succeeded
and every packed row reads back (``ds[i]``) as the table says, under the type the manifest gives its column
(numbers exactly, floats as float32; images and masks pixel for pixel), and every row without a defect is packed;
or it failed with one line of a usage error (exit 2) and left no DEST that could be taken for a dataset. A
MemoryError fails. Exit 0 when every example held; a failure prints the falsifying example."""

from __future__ import annotations

import resource
import sys

WORKDIR, EXAMPLES, LIMIT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))  # before torch and numpy map anything

import csv  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from PIL import Image  # noqa: E402

import packer  # noqa: E402
from packer.errors import PackerError  # noqa: E402

WORK = Path(WORKDIR)
ROOT = WORK / "root"
_counter = itertools.count()
OUTCOMES = {"packed": 0, "refused": 0}

# -- the files the tables name (made once) ----------------------------------------------------------------------
IMAGE_MODES = [("RGB", 12, 9), ("L", 7, 11), ("RGBA", 10, 10), ("P", 9, 6), ("I;16", 8, 8), ("RGB", 1, 1)]
GOOD = [f"images/img{k}.png" for k in range(len(IMAGE_MODES))]
BAD = {"missing": "images/missing.png", "not an image": "images/text.png", "fifo": "images/fifo.png",
       "folder": "images/folder.png", "outside": "../outside.png"}


def _make_files() -> None:
    rng = np.random.default_rng(0)
    (ROOT / "images").mkdir(parents=True)
    (ROOT / "masks").mkdir()
    for k, (mode, w, h) in enumerate(IMAGE_MODES):
        if mode == "I;16":
            img = Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
        else:
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
        img.save(ROOT / GOOD[k])
        Image.fromarray(rng.integers(0, 6, (h, w), dtype=np.uint8)).save(ROOT / "masks" / f"L{k}.png")
        Image.fromarray(rng.integers(0, 200, (h, w), dtype=np.uint16)).save(ROOT / "masks" / f"small16_{k}.png")
        Image.fromarray(rng.integers(300, 60000, (h, w), dtype=np.uint16)).save(ROOT / "masks" / f"big16_{k}.png")
        Image.fromarray(rng.random((h, w), dtype=np.float32)).save(ROOT / "masks" / f"float{k}.tif")
    Image.fromarray(np.zeros((3, 3), np.uint8)).save(ROOT / "masks" / "wrong.png")
    (ROOT / "images" / "text.png").write_text("no image here")
    os.mkfifo(ROOT / "images" / "fifo.png")
    (ROOT / "images" / "folder.png").mkdir()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(WORK / "outside.png")


_make_files()


# -- random tables ------------------------------------------------------------------------------------------------
NAMES = st.one_of(st.sampled_from(["caption", "score", "n", "box", "meta", "tags", "json", "cls", "png", "txt",
                                   "label", "image", "seg_mask", "a" * 90, "naïve", "two words", ""]),
                  st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,12}", fullmatch=True))
SMALL_INTS = st.integers(-(2**63), 2**63 - 1)
WILD_INTS = st.one_of(st.integers(-(2**70), 2**70), st.just(2**64), st.just(99999999999), st.just(int("7" * 4000)))
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
TEXT = st.text(max_size=12)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(allow_nan=False,
                                                                                       allow_infinity=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=6)


class Deep:
    """A JSON list nested ``depth`` deep, written out as text (Python's json would not write it)."""

    def __init__(self, depth: int):
        self.text = "[" * depth + "]" * depth

    def __repr__(self) -> str:
        return f"Deep({len(self.text) // 2})"


DEEP = st.sampled_from([150, 5000]).map(Deep)


def column_cells(data, rows: int) -> list:
    """One column's cells: most of one kind, sometimes one odd cell of another."""
    kind = data.draw(st.sampled_from(["int", "float", "text", "fixed", "varying", "json", "bool", "mixed"]))
    length = data.draw(st.integers(1, 4))
    cell = {"int": SMALL_INTS, "float": FLOATS, "text": TEXT, "json": JSON, "bool": st.booleans(),
            "fixed": st.lists(st.integers(-9, 9) | st.floats(-10, 10), min_size=length, max_size=length),
            "varying": st.lists(st.integers(-9, 9), max_size=4),
            "mixed": st.one_of(SMALL_INTS, TEXT, JSON)}[kind]
    cells = [data.draw(cell) for _ in range(rows)]
    if data.draw(st.integers(0, 3)) == 0:  # one odd cell
        odd = data.draw(st.one_of(WILD_INTS, FLOATS, st.just(""), st.none(), DEEP, JSON, st.just("²"),
                                  st.just({"a": float("nan")})))
        cells[data.draw(st.integers(0, rows - 1))] = odd
    return cells


def csv_text(value: object) -> str:
    if isinstance(value, Deep):
        return value.text
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_table(path: Path, header: list[str], rows: list[list]) -> None:
    if path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows([[csv_text(v) for v in row] for row in rows])
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                deep = {f"@deep{k}@": v.text for k, v in enumerate(row) if isinstance(v, Deep)}
                line = json.dumps({h: (f"@deep{k}@" if isinstance(v, Deep) else v)
                                   for k, (h, v) in enumerate(zip(header, row, strict=True)) if v is not None})
                for token, text in deep.items():
                    line = line.replace(json.dumps(token), text)
                f.write(line + "\n")


# -- what a packed value must be ----------------------------------------------------------------------------------
def _value(cell: object, text: bool) -> object:
    """The cell as its JSON value: a CSV cell's text parsed where it is JSON, else the text."""
    if text and isinstance(cell, str):
        try:
            return json.loads(cell)
        except ValueError:
            return cell
    return cell


def expected(field: dict, cell: object, text: bool, classes: list[str]):
    kind = field["kind"]
    if kind == "text":
        assert isinstance(cell, str), f"{cell!r} stored as text"
        return cell
    if kind == "json":
        return _value(cell, text)
    if kind in ("int64", "float32"):
        value = _value(cell, text) if field.get("shape") != [] else cell
        value = float(value) if kind == "float32" and field.get("shape") == [] else value
        if kind == "int64" and field.get("shape") == []:
            return int(value)
        return np.asarray(value, np.float32 if kind == "float32" else np.int64).tolist()
    raise AssertionError(kind)


def same(got: object, want: object) -> bool:
    if isinstance(got, float) or isinstance(want, float):
        a, b = np.float32(got), np.float32(want)
        return bool(a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
    return got == want and type(got) is type(want) or (isinstance(got, int) and isinstance(want, int) and got == want)


def pixels(path: Path, mask: bool = False) -> np.ndarray:
    with Image.open(path) as img:
        if mask:
            return np.asarray(img.convert("L") if img.mode == "1" else img).astype(np.int64)
        return np.asarray(img.convert("RGB"))


def check_packed(dest: Path, header: list[str], rows: list[list], text: bool, label: str | None,
                 clean_rows: set[str]) -> None:
    manifest = json.loads((dest / "manifest.json").read_text())
    fields = {f["name"]: f for f in manifest.get("fields", [])}
    ds = packer.open_dataset(dest)
    by_path = {row[header.index("image")]: row for row in rows}
    packed = set()
    for i in range(len(ds)):
        rel = ds.relpath(i)
        packed.add(rel)
        row = by_path[rel]
        sample = ds[i]
        if isinstance(sample, tuple):
            sample = {"image": sample[0], label: sample[1]}
        assert np.array_equal(sample["image"].permute(1, 2, 0).numpy(), pixels(ROOT / rel)), rel
        for name, cell in zip(header, row, strict=True):
            if name == "image":
                continue
            got = sample[name]
            if name == label:
                indices = all(str(r[header.index(name)]).isdigit() for r in rows)
                want = int(str(cell)) if indices else manifest["classes"].index(str(cell))
                assert int(got) == want, (name, got, cell)
                continue
            field = fields[name]
            if field["kind"] == "mask":
                assert np.array_equal(got.numpy(), pixels(ROOT / cell, True)), name
            elif field["kind"] == "image":
                assert np.array_equal(got.permute(1, 2, 0).numpy(), pixels(ROOT / cell)), name
            else:
                got = got.tolist() if hasattr(got, "tolist") else got
                want = expected(field, csv_text(cell) if text else cell, text, manifest["classes"])
                assert same(got, want), (name, field, cell, got, want)
    missing = clean_rows - packed
    assert not missing, f"rows with nothing wrong were not packed: {missing} ({manifest['skipped']})"


def check_failed(exc: BaseException, dest: Path) -> None:
    assert isinstance(exc, PackerError), f"{type(exc).__name__}: {exc}"
    assert "\n" not in str(exc) and str(exc), repr(str(exc))
    assert exc.exit_code == 2, f"exit {exc.exit_code}: {exc}"
    if dest.exists():
        try:
            packer.open_dataset(dest)
        except PackerError:
            return
        raise AssertionError(f"{dest} left after a failed pack, and it opens as a dataset")


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_tables(data) -> None:
    n = data.draw(st.integers(1, 4), label="rows")
    text = data.draw(st.booleans(), label="csv")
    fmt = data.draw(st.sampled_from(["lmdb", "hdf5", "wds"]), label="format")
    images = data.draw(st.lists(st.sampled_from(GOOD), min_size=n, max_size=n, unique=True), label="images")
    defects = {}
    if data.draw(st.integers(0, 2)) == 0:
        k = data.draw(st.integers(0, n - 1))
        kind = data.draw(st.sampled_from(sorted(BAD)))
        defects[images[k]] = kind
        images[k] = BAD[kind]
    header, columns = ["image"], [images]
    masks = data.draw(st.booleans(), label="masks")
    if masks:
        choices = []
        for img in images:
            k = GOOD.index(img) if img in GOOD else 0
            pick = data.draw(st.sampled_from(["L", "L", "L", "small16", "big16", "float", "wrong", "missing"]))
            if pick != "L":
                defects.setdefault(img, f"mask {pick}")
            choices.append({"L": f"masks/L{k}.png", "small16": f"masks/small16_{k}.png", "missing": "masks/no.png",
                            "big16": f"masks/big16_{k}.png", "float": f"masks/float{k}.tif",
                            "wrong": "masks/wrong.png"}[pick])
        header.append("seg_mask")
        columns.append(choices)
    for _ in range(data.draw(st.integers(0, 3), label="columns")):
        name = data.draw(NAMES)
        if name in header and not text:
            continue  # a JSON Lines row is an object: one value a key (a key twice is tested in test_table_trust)
        header.append(name)
        columns.append(column_cells(data, n))
    label = None
    if data.draw(st.booleans(), label="labelled") and (text or "klass" not in header):
        label = "klass"
        header.append(label)
        columns.append(data.draw(st.one_of(st.lists(st.integers(0, 5), min_size=n, max_size=n),
                                           st.lists(st.sampled_from(["cat", "dog", "0", "ünï"]), min_size=n,
                                                    max_size=n))))
    if text and len(header) > 1 and data.draw(st.integers(0, 5)) == 0:  # a column named twice
        header.append(header[-1])
        columns.append(columns[-1])
    rows = [list(r) for r in zip(*columns, strict=True)]
    case = WORK / f"case{next(_counter)}"
    case.mkdir()
    src = ROOT / ("t.csv" if text else "t.jsonl")
    write_table(src, header, rows)
    dest = case / "out"
    options = {"label_column": label} if label else {}
    try:
        packer.pack(src, dest, fmt, progress=False, workers=1, **options)
    except MemoryError:
        raise AssertionError("MemoryError: a value was sized from without a bound") from None
    except BaseException as exc:
        check_failed(exc, dest)
        OUTCOMES["refused"] += 1
    else:
        clean = {img for img in images if img not in defects and img in GOOD}
        check_packed(dest, header, rows, text, label, clean)
        OUTCOMES["packed"] += 1
    finally:
        shutil.rmtree(case, ignore_errors=True)
        src.unlink(missing_ok=True)


if __name__ == "__main__":
    test_tables()
    print(json.dumps(OUTCOMES))
    print("ok")

"""The property test of tests/sources/test_table_roundtrip.py, run in its own process under an address-space limit:
``python roundtrip_worker.py WORKDIR EXAMPLES LIMIT_BYTES``.

Hypothesis writes random annotation tables (CSV or JSON Lines; column names and values: unicode, huge, negative,
NaN, nested, empty, repeated; names packer's own members and webdataset's extensions take; images and masks of
random modes and sizes) and packs each into every format. A pack either fails with one line (a ``PackerError``),
or gives a dataset that opens, whose every field of every sample is the same through ``ds[i]``, ``packer.stream``
(WebDataset), the plain library (py-lmdb, h5py, webdataset) and ``export``; that ``packer verify --deep`` finds
sound; and whose export, packed again with the command export prints, holds the same samples and fields, byte for
byte. Exit 0 when every example held; a failure prints the falsifying example and exits non-zero; a MemoryError
is a failure too.
"""

from __future__ import annotations

import resource
import sys

WORKDIR, EXAMPLES, LIMIT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))  # before torch and numpy map anything

import csv  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from PIL import Image  # noqa: E402
from support.roundtrip import (  # noqa: E402
    assert_same,
    by_index,
    by_stream,
    class_samples,
    decoded_stored,
    exported,
    plain_values,
    stored_values,
)

import packer  # noqa: E402
from packer.cli import main as cli  # noqa: E402
from packer.errors import PackerError  # noqa: E402
from packer.fields import label_field, schema_of  # noqa: E402
from packer.formats import open_reader  # noqa: E402
from packer.verify import verify  # noqa: E402

FORMATS = ("lmdb", "hdf5", "wds")
_counter = itertools.count()

# mostly names a field may have (some that packer's members and webdataset's extensions take, one too long for a
# tar header), now and then one it may not (unicode, a dot, a leading dash, none)
NAMES = st.one_of(st.sampled_from(["caption", "Caption", "cls", "json", "jpg", "png", "packer", "txt", "npy",
                                   "label", "seg_mask", "score", "image_2", "_x", "x" * 70]),
                  st.sampled_from(["caption", "cls", "json", "txt", "packer"]),
                  st.text(alphabet="abcXYZ_09", min_size=1, max_size=8),
                  st.sampled_from(["名前", "-x", "a.b", ""]))
INTS = st.one_of(st.sampled_from([0, -1, 7, 2**63 - 1, -(2**63), 2**63, 10**30]), st.integers(-(2**40), 2**40))
FLOATS = st.one_of(st.sampled_from([1.7, -0.0, 1e-45, 3.4028235e38, 1e39, float("nan"), float("inf")]),
                   st.floats(width=32))
TEXT = st.text(max_size=12)
JSON = st.recursive(st.none() | st.booleans() | INTS | st.floats(allow_nan=False) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)
MODES = ("RGB", "L", "RGBA", "P", "I;16", "1", "CMYK")
MASK_MODES = ("L", "P", "I;16", "1")


@st.composite
def images(draw, folder: Path, name: str, modes=MODES, size: tuple[int, int] | None = None) -> str:
    """An image file of a random mode, size and format in ``folder``; its name."""
    mode = draw(st.sampled_from(modes))
    width, height = size or (draw(st.integers(1, 24)), draw(st.integers(1, 24)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    else:
        img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)
    formats = {"CMYK": ["jpg", "tif"], "I;16": ["png", "tif"]}.get(
        mode, ["png", "tif", "bmp"] + (["jpg"] if mode in ("RGB", "L") else []))
    fmt = draw(st.sampled_from(formats))
    path = folder / f"{name}.{fmt}"
    img.save(path)
    return path.name


@st.composite
def tables(draw) -> tuple[Path, dict]:
    """A table in a fresh folder, with its images and masks; and the pack options to use."""
    folder = Path(WORKDIR) / f"src-{next(_counter)}"
    folder.mkdir(parents=True)
    rows = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(["int", "float", "text", "json", "vector", "image", "mask"]), max_size=4))
    names = draw(st.lists(NAMES, min_size=len(kinds), max_size=len(kinds)))
    labelled = draw(st.sampled_from([None, "names", "ints"]))
    table: list[dict] = []
    for r in range(rows):
        row: dict = {"image": draw(images(folder, f"img{r}"))}
        with Image.open(folder / row["image"]) as img:
            size = img.size
        if labelled == "names":
            row["label"] = draw(st.sampled_from(["a", "b", "ü", "10"]))
        elif labelled == "ints":
            row["label"] = draw(st.integers(0, 3))
        for c, (kind, name) in enumerate(zip(kinds, names, strict=True)):
            if kind == "image":
                value: object = draw(images(folder, f"side{r}-{c}"))
            elif kind == "mask":
                same = draw(st.booleans()) or draw(st.booleans())
                value = draw(images(folder, f"mask{r}-{c}", MASK_MODES, size if same else None))
            else:
                value = draw({"int": INTS, "float": FLOATS, "text": TEXT, "json": JSON,
                              "vector": st.lists(INTS | FLOATS, max_size=3)}[kind])
            row[name if name not in row else f"{name}_{c}"] = value
        table.append(row)
    columns = list(dict.fromkeys(k for row in table for k in row))
    repeated = draw(st.booleans()) and len(columns) > 2  # a CSV header may name a column twice
    if repeated:
        header = [*columns, columns[-1]]
        table = [{**row, "\0again": row.get(columns[-1])} for row in table]
        columns = [*columns, "\0again"]
    if draw(st.booleans()) and not repeated:
        path = folder / "t.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in table), encoding="utf-8")
    else:
        path = folder / "t.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header if repeated else columns)
            for row in table:
                writer.writerow([cell(row.get(c)) for c in columns])
    options = {"store": draw(st.sampled_from(["original", "png", "jpeg", "raw"]))}
    if labelled:
        options["label_column"] = "label"
    return path, options


def cell(value: object) -> str:
    if isinstance(value, (list, dict)) or value is None or isinstance(value, bool):
        return json.dumps(value)
    return str(value)


def one_line(exc: BaseException) -> None:
    assert isinstance(exc, PackerError), f"{type(exc).__name__}: {exc}"
    assert "\n" not in str(exc) and str(exc), repr(str(exc))


def labels_by_name(dest: Path, rows: list[dict]) -> list[dict]:
    """The rows with the class as its name (a re-pack from a table names classes as the table does)."""
    manifest = packer.read_manifest(dest)
    label = label_field(schema_of(manifest))
    if label is None:
        return rows
    return [{**row, label.name: manifest["classes"][row[label.name]]} for row in rows]


def check_dataset(dest: Path, fmt: str) -> None:
    """Every way of reading ``dest`` agrees; its export packs back to the same samples."""
    indexed = by_index(dest)
    assert len(indexed) == packer.read_manifest(dest)["count"]
    stored = stored_values(dest)
    if fmt == "wds":
        assert_same(indexed, by_stream(dest), "stream")
        assert_same(decoded_stored(dest), plain_values(dest), "webdataset")
    else:
        assert_same(stored, plain_values(dest), fmt)
    assert verify(dest, deep=True) == [], verify(dest, deep=True)
    out = dest.parent / f"{dest.name}-export"
    try:
        result, rows = exported(dest, out)
    except PackerError as exc:  # a bytes field or a non-finite float (no place in a CSV cell), in one line
        one_line(exc)
        assert "holds bytes" in str(exc) or "cannot carry back" in str(exc), exc
        return
    again = dest.parent / f"{dest.name}-again"
    if rows is None:  # image and class only: class folders, packed back as a folder (pixels kept: raw or bytes)
        store = "raw" if open_reader(dest).spec.store == "raw" else "original"
        packer.pack(out, again, format=fmt, workers=1, progress=False, store=store)
        assert class_samples(dest) == class_samples(again), "export, then pack (class folders)"
        shutil.rmtree(out)
        shutil.rmtree(again)
        return
    assert_same(decoded_stored(dest), rows, "export")
    args = [str(again) if a == "NEW" else a for a in shlex.split(result["command"])[2:]]
    run = CliRunner().invoke(cli, ["pack", *args, "--quiet"])
    assert run.exit_code == 0, f"{result['command']}: {run.output}"
    assert_same(labels_by_name(dest, stored), labels_by_name(again, stored_values(again)), "export, then pack")
    shutil.rmtree(out)
    shutil.rmtree(again)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(tables())
def test_tables_round_trip(table) -> None:
    path, options = table
    for fmt in FORMATS:
        dest = path.parent.parent / f"{path.parent.name}-{fmt}"  # beside the source: export refuses inside it
        try:
            packer.pack(path, dest, format=fmt, workers=1, progress=False, **options)
        except PackerError as exc:
            one_line(exc)
            if (dest / "manifest.json").exists():  # never a dataset that does not open
                len(packer.open_dataset(dest))
            continue
        except MemoryError:
            raise AssertionError("MemoryError packing") from None
        check_dataset(dest, fmt)
        shutil.rmtree(dest)
    shutil.rmtree(path.parent)


if __name__ == "__main__":
    test_tables_round_trip()
    print("ok")

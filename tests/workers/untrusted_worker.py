"""The property test of tests/test_untrusted.py, run in its own process under an address-space limit:
``python untrusted_worker.py FORMAT DATASET WORKDIR EXAMPLES LIMIT_BYTES``.

Hypothesis mutates a copy of DATASET (its manifest, and the format's index: HDF5 arrays, LMDB record headers
and records, the WebDataset index) and checks that every read (``ds[i]``), ``packer.verify`` and one loader
epoch either give the original samples or raise a PackerError whose message is one line. Exit 0 when every
example held; a failure prints the falsifying example and exits non-zero. A MemoryError is a failure too."""

from __future__ import annotations

import resource
import sys

FMT, DATASET, WORKDIR, EXAMPLES, LIMIT = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))  # before torch and numpy map anything

import itertools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import packer  # noqa: E402
from packer.errors import PackerError  # noqa: E402
from packer.verify import verify  # noqa: E402

INTS = st.one_of(st.sampled_from([0, 1, 2, 3, -1, -56, 255, 65535, 65536, 100_000, 2**31, 10**12, 2**63 - 1]),
                 st.integers(-(2**64), 2**64))
OPTIONS = {"center_crop": 32, "verify": True}  # one output shape: the loader batches; crc32 and labels checked
_counter = itertools.count()


def one_line(exc: BaseException) -> None:
    assert isinstance(exc, PackerError), f"{type(exc).__name__}: {exc}"
    assert "\n" not in str(exc) and str(exc), repr(str(exc))


def samples(dest: Path) -> list[tuple[bytes, int]]:
    """Every sample as (pixels, label), read one by one and through one loader epoch (the same list twice)."""
    ds = packer.open_dataset(dest, **OPTIONS)
    one = [(ds[i][0].numpy().tobytes(), int(ds[i][1])) for i in range(len(ds))]
    loader = packer.make_loader(ds, batch_size=5, shuffle=False, num_workers=0, tuned=False)
    batched = [(image.numpy().tobytes(), int(label)) for images, labels in loader
               for image, label in zip(images, labels, strict=True)]
    assert batched == one, "the loader's epoch differs from ds[i]"
    return one


ORIGINAL = samples(Path(DATASET))


def check(dest: Path) -> None:
    try:
        got = samples(dest)
    except PackerError as exc:
        one_line(exc)
    except MemoryError:
        raise AssertionError("MemoryError: something was allocated from a lie") from None
    else:
        assert got == ORIGINAL, "a mutated dataset read as other samples, with no error"
    try:
        problems = verify(dest)
    except PackerError as exc:
        one_line(exc)
    else:
        assert all("\n" not in p for p in problems), problems


def fresh() -> Path:
    dest = Path(WORKDIR) / f"ex{next(_counter)}"
    shutil.copytree(DATASET, dest)
    return dest


def clip(value: int, dtype: np.dtype) -> int:
    info = np.iinfo(dtype)
    return int(min(max(value, info.min), info.max))


# -- mutations ------------------------------------------------------------------------------------------------------
def mutate_manifest(dest: Path, data) -> None:
    path = dest / "manifest.json"
    m = json.loads(path.read_text())
    key = data.draw(st.sampled_from(["count", "shape", "dtype", "shard_count", "file_bytes", "classes", "fields"]))
    if key == "count":
        m["count"] = data.draw(INTS)
    elif key == "shape":
        m["shape"] = data.draw(st.one_of(st.lists(INTS, min_size=0, max_size=4), st.none(), st.just("x")))
    elif key == "dtype":
        m["dtype"] = data.draw(st.sampled_from(["uint8", "float16", "float64", "int64", "object", ""]))
    elif key == "shard_count" and m.get("shards"):
        m["shards"][data.draw(st.integers(0, len(m["shards"]) - 1))]["count"] = data.draw(INTS)
    elif key == "file_bytes":
        m["files"][data.draw(st.integers(0, len(m["files"]) - 1))]["bytes"] = data.draw(INTS)
    elif key == "classes":
        m["classes"] = m["classes"][:-1]
        m["class_to_idx"] = {c: i for i, c in enumerate(m["classes"])}
    else:
        m["fields"] = data.draw(st.sampled_from([[], [{"name": "image", "kind": "image"}], "x"]))
    path.write_text(json.dumps(m))


def mutate_hdf5(dest: Path, data) -> None:
    import h5py

    with h5py.File(dest / "data.h5", "r+") as f:
        name = data.draw(st.sampled_from(["labels", "shapes", "offsets", "crc32"]))
        values = f[name][()]
        if data.draw(st.booleans()):  # shorter or longer
            cut = data.draw(st.integers(-3, 3))
            values = values[:max(0, len(values) + cut)] if cut < 0 else np.concatenate([values, values[:cut]])
        elif len(values):
            flat = values.reshape(-1)
            flat[data.draw(st.integers(0, len(flat) - 1))] = clip(data.draw(INTS), values.dtype)
        del f[name]
        f.create_dataset(name, data=values)


def mutate_lmdb(dest: Path, data) -> None:
    import lmdb

    from packer.formats.lmdb.records import HEADER, key

    env = lmdb.open(str(dest), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        n = txn.stat()["entries"]
        i = data.draw(st.integers(0, n - 1))
        value = bytearray(txn.get(key(i)))
        kind = data.draw(st.sampled_from(["header", "delete", "extra", "cut", "garbage"]))
        if kind == "header":
            fields = list(HEADER.unpack_from(value))
            field = data.draw(st.integers(1, 8))  # label, crc32, height, width, channels, reserved, lengths
            dtype = [None, np.int32, np.uint32, np.uint16, np.uint16, np.uint8, np.uint8, np.uint16, np.uint32][field]
            fields[field] = clip(data.draw(INTS), np.dtype(dtype))
            value[:HEADER.size] = HEADER.pack(*fields)
            txn.put(key(i), bytes(value))
        elif kind == "delete":
            txn.delete(key(i))
        elif kind == "extra":
            txn.put(key(data.draw(st.sampled_from([n, n + 5, 10**9]))), bytes(value))
        elif kind == "cut":
            txn.put(key(i), bytes(value[:data.draw(st.integers(0, len(value) - 1))]))
        else:
            txn.put(key(i), data.draw(st.binary(max_size=64)))
    env.close()
    (dest / "lock.mdb").unlink(missing_ok=True)


def mutate_wds(dest: Path, data) -> None:
    path = dest / "wds_index.npy"
    index = np.load(path)
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(-3, 3))
        index = index[:max(0, len(index) + cut)] if cut < 0 else np.concatenate([index, index[:cut]])
    else:
        i = data.draw(st.integers(0, len(index) - 1))
        field = data.draw(st.sampled_from(["shard", "offset", "size", "json_offset", "json_size", "label", "crc32",
                                           "shape"]))
        dtype = index.dtype[field].base
        if field == "shape":
            index[i]["shape"][data.draw(st.integers(0, 2))] = clip(data.draw(INTS), dtype)
        else:
            index[field][i] = clip(data.draw(INTS), dtype)
    np.save(path, index, allow_pickle=False)


MUTATE = {"hdf5": mutate_hdf5, "lmdb": mutate_lmdb, "wds": mutate_wds}


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_mutated(data) -> None:
    dest = fresh()
    try:
        if data.draw(st.booleans(), label="manifest"):
            mutate_manifest(dest, data)
        else:
            MUTATE[FMT](dest, data)
        check(dest)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    test_mutated()
    print("ok")

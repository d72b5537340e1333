"""A damaged field is one line (issue 44): bytes of a text, JSON or number field changed in the data file, read by
``ds[i]``, ``packer.stream``, ``export`` or a DataLoader worker process, are a ``PackerError`` naming the dataset,
sample and field, never a raw UnicodeDecodeError/JSONDecodeError nor torch's multi-line worker traceback; one
changed byte in ``wds_index.npy``'s header is one line too."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.fields import SCHEMA, write_dataset

import packer
from packer.errors import PackerError

FORMATS = ("lmdb", "hdf5", "wds")
SCHEMA_NO_BYTES = [f for f in SCHEMA if f.kind != "bytes"]  # what a table export can carry
SAMPLE = 3
# what each damage changes, in place and keeping the length: (field, the stored bytes, what replaces them)
DAMAGES = {
    "caption": (b"a photo of sample 3 \xc3\xbc", b"a photo of sample 3 \xff\xfe"),  # no longer UTF-8
    "meta": (b'{"id": 3, "nested"', b'{"id"; 3, "nested"'),  # no longer JSON
}


def data_file(dest: Path) -> Path:
    return next(p for p in dest.iterdir() if p.name in ("data.mdb", "data.h5", "shard-000000.tar"))


def damaged(tmp_path_factory, fmt: str, field: str) -> Path:
    dest = tmp_path_factory.mktemp(f"damaged-{fmt}-{field}") / "ds"
    write_dataset(dest, fmt, SCHEMA_NO_BYTES)
    before, after = DAMAGES[field]
    path = data_file(dest)
    data = path.read_bytes()
    assert data.count(before) == 1, f"{path}: the stored {field} of sample {SAMPLE} is found once"
    path.write_bytes(data.replace(before, after))
    return dest


@pytest.fixture(scope="module", params=[(f, name) for f in FORMATS for name in DAMAGES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def dataset(request, tmp_path_factory) -> tuple[Path, str]:
    fmt, field = request.param
    return damaged(tmp_path_factory, fmt, field), field


def one_line(exc: pytest.ExceptionInfo, dest: Path, field: str) -> None:
    message = str(exc.value)
    assert isinstance(exc.value, PackerError), f"{type(exc.value).__name__}: {message}"
    assert "\n" not in message and "Caught" not in message, message
    assert str(dest) in message and re.search(rf"sample 0*{SAMPLE}\b", message) and f"field {field!r}" in message, \
        message


def test_a_damaged_field_read_by_index_is_one_line(dataset):
    dest, field = dataset
    ds = packer.open_dataset(dest)
    ds[SAMPLE - 1]  # the others read
    with pytest.raises(PackerError) as exc:
        ds[SAMPLE]
    one_line(exc, dest, field)


@pytest.mark.parametrize("engine", ["pool", "torch"])
def test_a_damaged_field_read_by_a_worker_process_is_one_line(dataset, engine):
    dest, field = dataset
    ds = packer.open_dataset(dest)
    extra = {"worker_init_fn": lambda worker: None} if engine == "torch" else {}  # one's own: torch's workers
    loader = packer.make_loader(ds, batch_size=4, shuffle=False, num_workers=1, tuned=False, **extra)
    assert loader.plan.engine == engine
    with pytest.raises(PackerError) as exc:
        list(loader)
    one_line(exc, dest, field)


def test_a_damaged_field_read_by_stream_is_one_line(tmp_path_factory):
    for field in DAMAGES:
        dest = damaged(tmp_path_factory, "wds", field)
        with pytest.raises(PackerError) as exc:
            list(packer.stream(dest, batch_size=4, shuffle=False, num_workers=1))
        one_line(exc, dest, field)


def test_a_damaged_field_exported_is_one_line(dataset, tmp_path):
    dest, field = dataset
    with pytest.raises(PackerError) as exc:
        packer.export(dest, tmp_path / "out", progress=False)
    one_line(exc, dest, field)
    assert not (tmp_path / "out").exists()
    result = subprocess.run([sys.executable, "-m", "packer", "export", str(dest), str(tmp_path / "out2"), "--quiet"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("packer: error: ") and f"field {field!r}" in result.stderr


def test_verify_names_the_damaged_field(dataset):
    from packer.verify import verify

    dest, field = dataset
    problems = verify(dest, deep=True)
    assert any(f"sample {SAMPLE}" in p for p in problems), problems


@pytest.mark.parametrize("at", [10, 60, 120])
def test_one_changed_byte_in_the_shard_index_header_is_one_line(tmp_path, at):
    dest = tmp_path / "ds"
    write_dataset(dest, "wds", SCHEMA)
    path = dest / "wds_index.npy"
    data = bytearray(path.read_bytes())
    data[at] = ord("(")  # an unfinished literal: numpy's header parser raises tokenize.TokenError
    path.write_bytes(bytes(data))
    with pytest.raises(PackerError) as exc:
        len(packer.open_dataset(dest))
    assert "\n" not in str(exc.value) and "wds_index.npy" in str(exc.value)
    result = subprocess.run([sys.executable, "-m", "packer", "verify", str(dest)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "internal error" not in result.stderr + result.stdout, result.stderr
    assert "wds_index.npy" in result.stdout
    shutil.rmtree(dest)

"""Every public argument is checked where it is passed, and messages say what is true in the caller's words.

Each bad value below is a one-line ``ValueError`` (``packer.PackerError`` too) naming the argument at the call
(``open_dataset``, ``make_loader``, ``stream``, ``load_state_dict``, ``to_device``), or a usage error (exit 2)
naming the flag from the CLI; a worker's error reaches the caller as itself, in one line.
"""

from __future__ import annotations

import inspect
import io
import json
import math
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import noise_folder
from PIL import Image
from support.processes import one_line_value_error

import packer
from packer.errors import DestinationError, IncompleteDatasetError, PackerError

COUNT = 24
BATCH = 4


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """24 distinct 20x20 JPEGs in 3 classes, packed in every format (wds in 4 shards)."""
    root = tmp_path_factory.mktemp("arguments")
    out = {"src": noise_folder(root / "src", COUNT, 20, "jpg")}
    for fmt in ("lmdb", "hdf5", "wds"):
        out[fmt] = root / fmt
        extra = {"shard_samples": 6} if fmt == "wds" else {}
        packer.pack(root / "src", out[fmt], fmt, progress=False, workers=1, **extra)
    return out



# -- open_dataset -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"random_resized_crop": 32.5}, "random_resized_crop"),
    ({"random_resized_crop": 0}, "random_resized_crop"),
    ({"random_resized_crop": (8, 8, 8)}, "random_resized_crop"),
    ({"random_resized_crop": "16"}, "random_resized_crop"),
    ({"random_resized_crop": 16, "scale": (0.1, 0.5, 1.0)}, "scale"),
    ({"random_resized_crop": 16, "scale": (0.5, 0.1)}, "scale"),
    ({"random_resized_crop": 16, "scale": (0, 1)}, "scale"),
    ({"random_resized_crop": 16, "scale": (0.1, math.nan)}, "scale"),
    ({"random_resized_crop": 16, "scale": "ab"}, "scale"),
    ({"random_resized_crop": 16, "ratio": (1e9, 1e10)}, "ratio"),
    ({"random_resized_crop": 16, "ratio": (1e-12, 1e-11)}, "ratio"),
    ({"random_resized_crop": 16, "ratio": (1, math.inf)}, "ratio"),
    ({"random_resized_crop": 16, "ratio": (True, 2)}, "ratio"),
    ({"flip": "yes"}, "flip"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"threads": 0}, "threads"),
    ({"decode": None}, "decode"),
    ({"transform": 3}, "transform"),
    ({"locking": True}, "locking"),  # an HDF5 option on an LMDB dataset
    ({"readahead": "no"}, "readahead"),
])
def test_open_dataset_refuses_a_bad_argument_at_the_call(packs, kwargs, name):
    one_line_value_error(lambda: packer.open_dataset(packs["lmdb"], **kwargs), name)


@pytest.mark.parametrize("ratio", [(1e-6, 1e-5), (1e5, 1e6), (3 / 4, 4 / 3)])
def test_extreme_ratios_within_the_limits_read(packs, ratio):
    """The limits themselves read: the fallback window keeps at least one pixel on each side."""
    ds = packer.open_dataset(packs["lmdb"], random_resized_crop=8, ratio=ratio)
    for i in range(3):
        image, _ = ds[i]
        assert tuple(image.shape) == (3, 8, 8)


def test_open_dataset_has_an_explicit_documented_signature():
    parameters = inspect.signature(packer.open_dataset).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    doc = packer.open_dataset.__doc__
    for name in parameters:
        assert name in doc, name
    for name in ("transform", "random_resized_crop", "scale", "ratio", "flip", "seed", "readahead", "locking",
                 "storage_options", "cache_dir", "cache_limit"):
        assert name in parameters, name


def test_reader_options_still_reach_their_reader(packs):
    assert len(packer.open_dataset(packs["lmdb"], readahead=False)) == COUNT
    assert len(packer.open_dataset(packs["hdf5"], locking=False)) == COUNT


def test_stream_has_an_explicit_documented_signature():
    parameters = inspect.signature(packer.stream).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert all(name in packer.stream.__doc__ for name in parameters)


# -- make_loader, stream, to_device -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"batch_size": 0}, "batch_size"), ({"batch_size": 2.5}, "batch_size"), ({"batch_size": True}, "batch_size"),
    ({"seed": -1}, "seed"), ({"seed": "3"}, "seed"), ({"shuffle": "no"}, "shuffle"),
    ({"drop_last": 1}, "drop_last"), ({"threads": 0}, "threads"), ({"prefetch_batches": -1}, "prefetch_batches"),
    ({"tuned": None}, "tuned"),
])
def test_make_loader_refuses_a_bad_argument_at_the_call(packs, kwargs, name):
    ds = packer.open_dataset(packs["hdf5"])
    one_line_value_error(lambda: packer.make_loader(ds, **kwargs), name)


@pytest.mark.parametrize("kwargs, name", [
    ({"batch_size": 0}, "batch_size"), ({"batch_size": "4"}, "batch_size"), ({"num_workers": -1}, "num_workers"),
    ({"seed": -2}, "seed"), ({"buffer": 0}, "buffer"), ({"mode": "CMYK"}, "mode"), ({"drop_last": "x"}, "drop_last"),
])
def test_stream_refuses_a_bad_argument_at_the_call(packs, kwargs, name):
    args = dict({"batch_size": BATCH, "num_workers": 0}, **kwargs)
    one_line_value_error(lambda: packer.stream(packs["wds"], **args), name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_to_device_cuda_without_cuda_is_one_line(packs):
    loader = packer.make_loader(packer.open_dataset(packs["hdf5"]), batch_size=BATCH, num_workers=0)
    message = one_line_value_error(lambda: packer.to_device(loader, "cuda"), "'cuda'", "no CUDA")
    assert "torch.cuda.Stream" not in message
    with pytest.raises(PackerError):
        packer.to_device(loader, "cuda:0")


def test_to_device_unknown_device_is_one_line(packs):
    loader = packer.make_loader(packer.open_dataset(packs["hdf5"]), batch_size=BATCH, num_workers=0)
    one_line_value_error(lambda: packer.to_device(loader, "gpu"), "'gpu'")
    images, labels = next(iter(packer.to_device(loader, "cpu")))
    assert images.device.type == "cpu" and len(labels) == BATCH


# -- load_state_dict: key by key, type by type --------------------------------------------------------------------

def loader_state(packs):
    loader = packer.make_loader(packer.open_dataset(packs["hdf5"]), batch_size=BATCH, num_workers=0)
    return loader, loader.state_dict()


@pytest.mark.parametrize("change, words", [
    ({"epoch": "3"}, ("epoch=",)), ({"epoch": 1.7}, ("epoch=",)), ({"epoch": 10**30}, ("epoch=",)),
    ({"epoch": -1}, ("epoch=",)), ({"epoch": True}, ("epoch=",)),
    ({"samples_seen": 33.9}, ("samples_seen=",)), ({"samples_seen": -4}, ("samples_seen=",)),
    ({"samples_seen": COUNT + 1}, ("samples_seen=",)),
    ({"world_size": 0}, ("world_size=",)), ({"world_size": -3}, ("world_size=",)),
    ({"world_size": 2.0}, ("world_size",)),
    ({"extra": 1}, ("unknown key", "'extra'")), ({"seed": "0"}, ("seed=",)), ({"shuffle": 1}, ("shuffle=",)),
    ({"version": 2}, ("not a packer loader state",)),
])
def test_a_damaged_loader_state_is_one_line_naming_the_key(packs, change, words):
    loader, state = loader_state(packs)
    one_line_value_error(lambda: loader.load_state_dict(dict(state, **change)), *words)


@pytest.mark.parametrize("key", ["epoch", "samples_seen", "world_size", "batch_size"])
def test_a_missing_key_is_named(packs, key):
    loader, state = loader_state(packs)
    state.pop(key)
    one_line_value_error(lambda: loader.load_state_dict(state), "has no", repr(key))


def test_a_refused_state_leaves_the_loader_as_it_was(packs):
    loader, state = loader_state(packs)
    whole = [labels.tolist() for _, labels in loader]
    with pytest.raises(ValueError):
        loader.load_state_dict(dict(state, epoch=10**30))
    loader.set_epoch(0)
    assert [labels.tolist() for _, labels in loader] == whole


@pytest.mark.parametrize("change, words", [
    ({"epoch": "1"}, ("epoch=",)), ({"samples_seen": 2.5}, ("samples_seen=",)),
    ({"samples_seen": 10**6}, ("samples_seen=",)), ({"kind": "loader"}, ("kind=",)), ({"more": 0}, ("unknown key",)),
    ({"window": "0"}, ("window=",)), ({"world_size": 0}, ("world_size=",)),
])
def test_a_damaged_stream_state_is_one_line_naming_the_key(packs, change, words):
    loader = packer.stream(packs["wds"], BATCH, num_workers=0)
    state = loader.state_dict()
    one_line_value_error(lambda: loader.load_state_dict(dict(state, **change)), *words)
    state.pop("epoch")
    one_line_value_error(lambda: loader.load_state_dict(state), "has no", "'epoch'")


def test_one_resume_protocol():
    """make_loader's loaders and stream share packer.state: one check, one counting iterator, one Stateful."""
    from packer import state
    from packer.loading import loader, sampler
    from packer.loading import stream as streaming

    for module in (loader, sampler, streaming):
        source = inspect.getsource(module)
        assert "_MUST_MATCH" not in source or module is not loader
        assert "class Received" not in source and "_CountingIterator" not in source
        assert re.search(r"from \.+state import", source)
    assert "def check_state" not in inspect.getsource(sampler) + inspect.getsource(streaming)
    assert issubclass(loader.PrefetchLoader, state.Stateful) and issubclass(streaming.StreamLoader, state.Stateful)


# -- errors across processes --------------------------------------------------------------------------------------

def damaged_shard_copy(packs, tmp_path) -> Path:
    """A copy of the wds dataset whose second shard's images are not images (each member keeps its size)."""
    import shutil

    dest = tmp_path / "wds"
    shutil.copytree(packs["wds"], dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    shard = dest / manifest["shards"][1]["path"]
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            if member.name.endswith(".jpg"):
                data = b"not a jpeg".ljust(len(data), b"\0")
            tar.addfile(member, io.BytesIO(data))
    return dest


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_a_stream_worker_reaches_the_caller_as_itself(packs, tmp_path, workers):
    dest = damaged_shard_copy(packs, tmp_path)
    with pytest.raises(PackerError) as info:
        for _ in packer.stream(dest, BATCH, shuffle=False, num_workers=workers):
            pass
    message = str(info.value)
    assert "\n" not in message and "DataLoader worker" not in message and "Traceback" not in message, message


def test_an_error_in_a_torch_worker_of_make_loader_reaches_the_caller_as_itself(packs, tmp_path):
    """torch's workers (persistent_workers=False: not packer's pool) over a dataset with a damaged image."""
    dest = damaged_shard_copy(packs, tmp_path)
    loader = packer.make_loader(packer.open_dataset(dest), batch_size=BATCH, shuffle=False, num_workers=2,
                                persistent_workers=False)
    assert loader.worker_pool is None
    with pytest.raises(PackerError) as info:
        for _ in loader:
            pass
    message = str(info.value)
    assert "\n" not in message and "DataLoader worker" not in message, message


@pytest.mark.remote
def test_stream_cache_limit_below_one_shard_per_worker_says_what_to_pass(packs, tmp_path):
    from support.remote import serve_files

    served = serve_files(packs["wds"].parent)
    try:
        for workers in (0, 2):
            message = one_line_value_error(lambda w=workers: packer.stream(
                f"{served.url}/wds", BATCH, num_workers=w, cache_dir=tmp_path / "cache", cache_limit=1000),
                "cache_limit=", "worker")
            assert "read it with packer.stream" not in message and "DataLoader" not in message
    finally:
        served.stop()


# -- messages in the words of the interface used ------------------------------------------------------------------

@pytest.mark.slow
def test_pack_into_an_existing_dest_names_the_argument_from_python_and_the_flag_from_the_cli(packs, tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "x.txt").write_text("x")
    with pytest.raises(DestinationError) as info:
        packer.pack(packs["src"], dest, "lmdb", progress=False)
    assert "overwrite=True" in str(info.value) and "--overwrite" not in str(info.value)
    proc = subprocess.run([sys.executable, "-m", "packer", "pack", str(packs["src"]), str(dest), "--format", "lmdb",
                           "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and "overwrite=True" not in proc.stderr
    # after the CLI ran in this process (click's runner), Python callers still get Python's words
    from click.testing import CliRunner

    from packer.cli import main

    CliRunner().invoke(main, ["pack", str(packs["src"]), str(dest), "--format", "lmdb", "--quiet"])
    with pytest.raises(DestinationError, match="overwrite=True"):
        packer.pack(packs["src"], dest, "lmdb", progress=False)


@pytest.mark.parametrize("flag, value", [("--seed", "-1"), ("--seed", str(2**63)), ("--workers", "0"),
                                         ("--max-pixels", "0"), ("--shard-samples", "0")])
def test_out_of_range_cli_options_are_usage_errors_naming_the_flag(packs, tmp_path, flag, value):
    proc = subprocess.run([sys.executable, "-m", "packer", "pack", str(packs["src"]), str(tmp_path / "o"),
                           "--format", "wds", flag, value], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and flag in proc.stderr and "internal error" not in proc.stderr


def test_pack_seed_out_of_range_from_python_names_the_argument(packs, tmp_path):
    one_line_value_error(lambda: packer.pack(packs["src"], tmp_path / "o", "lmdb", seed=-1, progress=False),
                         "seed=-1")


def test_verify_and_info_say_what_a_non_dataset_is(tmp_path, packs):
    other = tmp_path / "other"
    (other / "deep" / "down").mkdir(parents=True)
    (other / "notes.txt").write_text("x")
    Image.new("RGB", (4, 4)).save(other / "deep" / "down" / "a.jpg")
    file = tmp_path / "README.md"
    file.write_text("# hi")
    for args, words, never in ((["verify", str(other)], ("no manifest.json",), "image folder"),
                               (["info", str(file)], ("is a file",), "no such"),
                               (["verify", str(file)], ("is a file",), "no such"),
                               (["info", str(packs["src"])], ("is an image folder",), "did not finish")):
        proc = subprocess.run([sys.executable, "-m", "packer", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
        assert all(w in proc.stderr for w in words) and never not in proc.stderr, (args, proc.stderr)
    with pytest.raises(IncompleteDatasetError, match="is a file"):
        packer.open_dataset(file)

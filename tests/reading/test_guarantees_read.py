"""The reader side of the README's promises, and regressions of issue 15's reader defects.

- A dataset reads the data files that go with its manifest: a DEST repacked with ``--overwrite`` is read anew
  by a new ``open_dataset`` (LMDB used to pair the new manifest with the old, deleted ``data.mdb``), an open
  reader keeps reading the files it opened, and a dataset whose files were replaced before it read them refuses
  in one line instead of pairing its manifest with another conversion's data.
- Shards from other tools: labels that are not class indices are refused naming the shard and the member; link
  members and repeated members are listed in ``skipped``, never dropped or chosen silently.
- Nothing is unpickled: pickles and object arrays fed to every reader and to a repack source are refused or
  skipped (a pickle that would create a marker file when unpickled must leave no marker).
- HDF5 files are read with locking off: while another process holds the file (open for reading, or with an
  exclusive lock), with ``HDF5_USE_FILE_LOCKING`` unset, in a real second process.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_image
from PIL import Image

import packer
from packer.errors import CorruptDataError, ManifestError, PackerError
from packer.formats.wds.foreign import scan_shards
from packer.loading.sampler import EpochIndex
from packer.sources.detect import open_source
from packer.verify import verify

FORMATS = ("lmdb", "hdf5", "wds")
REPO = Path(__file__).resolve().parents[2]


def make_source(root: Path, classes: tuple[str, ...], seed: int, per_class: int = 3) -> Path:
    """``per_class`` 80x60 images per class (JPEG and PNG), seeded so that two sources differ."""
    for c, cls in enumerate(classes):
        for i in range(per_class):
            ext = "png" if i == 1 else "jpg"
            write_image(root / cls / f"{cls}{i}.{ext}", 80, 60, seed=seed + 10 * c + i, quality=95)
    return root


@pytest.fixture(scope="module")
def src_a(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("src-a"), ("ant", "bee"), seed=100)


@pytest.fixture(scope="module")
def src_b(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("src-b"), ("cow", "dog", "emu"), seed=300)


@pytest.fixture(scope="module")
def src_c(tmp_path_factory) -> Path:
    """As many images as ``src_a``, in other classes: a stale manifest's count would match its data."""
    return make_source(tmp_path_factory.mktemp("src-c"), ("cow", "dog"), seed=500)


def pack(src: Path, dest: Path, fmt: str, **options) -> dict:
    if fmt == "wds":
        options.setdefault("shard_samples", 2)  # several shards, so a reader maps some and not others
    return packer.pack(src, dest, fmt, workers=1, progress=False, **options)


def contents(ds) -> list[tuple[str, int, bytes]]:
    """(relpath, label, decoded pixels) of every sample."""
    return [(ds.relpath(i), ds[i][1], ds[i][0].numpy().tobytes()) for i in range(len(ds))]


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


# -- a repacked DEST (defects 1 and 7) ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_new_open_after_overwrite_reads_the_new_data(src_a, src_b, tmp_path, fmt):
    """Pack, read, repack the same DEST (--overwrite, another geometry and store), open again in this process:
    the new manifest's shape, and with another source the new images under the new class names."""
    dest = tmp_path / "ds"
    pack(src_a, dest, fmt)
    first = packer.open_dataset(dest)
    assert tuple(first[0][0].shape) == (3, 60, 80)
    pack(src_a, dest, fmt, overwrite=True, resize=64, center_crop=64, store="png")
    again = packer.open_dataset(dest, verify=True)
    assert again.manifest["shape"] == [64, 64, 3]
    assert all(tuple(again[i][0].shape) == (3, 64, 64) for i in range(len(again)))

    pack(src_b, dest, fmt, overwrite=True, shuffle=False)
    other = packer.open_dataset(dest, verify=True)
    assert other.classes == ["cow", "dog", "emu"] and len(other) == 9
    for i in range(len(other)):
        rel = other.relpath(i)
        image, label = other[i]
        assert other.classes[label] == rel.split("/")[0]
        assert np.array_equal(image.permute(1, 2, 0).numpy(), pixels(src_b / rel)), rel
    assert verify(dest, deep=True) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_open_reader_keeps_reading_what_it_opened(src_a, src_b, tmp_path, fmt):
    """A reader that has read keeps its files when DEST is repacked under it: it returns its own samples, or
    (WebDataset shards it had not mapped yet) refuses in one line; never another conversion's data."""
    dest = tmp_path / "ds"
    pack(src_a, dest, fmt, shuffle=False)
    ds = packer.open_dataset(dest)
    before = contents(packer.open_dataset(dest))
    assert ds[0][1] == before[0][1]  # opened: LMDB env, HDF5 file, WebDataset index and the first shard
    pack(src_b, dest, fmt, overwrite=True, shuffle=False)
    refused = 0
    for i in range(len(ds)):
        try:
            got = (ds.relpath(i), ds[i][1], ds[i][0].numpy().tobytes())
        except CorruptDataError as exc:
            assert fmt == "wds" and "replaced" in str(exc) and "\n" not in str(exc), exc
            refused += 1
            continue
        assert got == before[i], i
    assert refused < len(ds)
    if fmt != "wds":
        assert refused == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_dataset_whose_files_were_replaced_before_its_first_read_refuses(src_a, src_c, tmp_path, fmt):
    """Created (manifest read) but not yet read when DEST is repacked, with as many images of other classes:
    its manifest no longer describes the files, so reading refuses in one line naming the file, instead of
    serving the new images under the old class names."""
    dest = tmp_path / "ds"
    pack(src_a, dest, fmt)
    stale = packer.open_dataset(dest)
    pack(src_c, dest, fmt, overwrite=True)
    for read in (lambda: stale[0], lambda: stale.__getitems__([0, 1]), lambda: stale.relpath(0)):
        with pytest.raises(CorruptDataError, match="replaced") as info:
            read()
        message = str(info.value)
        assert "\n" not in message and str(dest) in message and "open the dataset again" in message
    fresh = packer.open_dataset(dest)
    assert fresh.classes == ["cow", "dog"] and fresh.relpath(0).split("/")[0] in fresh.classes


def test_forked_worker_reads_the_file_its_parent_opened(src_a, src_b, tmp_path):
    """LMDB: a DataLoader worker forked after DEST was repacked keeps reading the environment its parent opened
    (the parent's dataset), not the new data.mdb."""
    dest = tmp_path / "ds"
    pack(src_a, dest, "lmdb")
    ds = packer.open_dataset(dest)
    before = contents(ds)
    pack(src_b, dest, "lmdb", overwrite=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    got = [(int(label), image.numpy().tobytes()) for image, label in loader]
    assert got == [(label, data) for _, label, data in before]


def test_lmdb_environments_of_replaced_files_are_closed_when_unused(src_a, tmp_path):
    """An environment whose file was replaced stays open while a dataset reads it, and is closed (its deleted
    file's space given back) once no dataset uses it and a newer one is opened."""
    from packer.formats.lmdb import reader as lmdb_format

    dest = tmp_path / "ds"
    pack(src_a, dest, "lmdb")
    old = packer.open_dataset(dest)
    old[0]
    old_env = old.reader.env
    pack(src_a, dest, "lmdb", overwrite=True, resize=64, center_crop=64)
    new = packer.open_dataset(dest)
    new[0]
    assert new.reader.env is not old_env
    assert old[0][0].shape == (3, 60, 80)  # still in use: still open
    del old
    pack(src_a, dest, "lmdb", overwrite=True, store="png")
    newest = packer.open_dataset(dest)
    newest[0]
    assert old_env not in [e.env for e in lmdb_format._ENVS.values()]
    with pytest.raises(Exception):  # noqa: B017, PT011 - py-lmdb's own error for a closed environment
        old_env.stat()
    assert new[1][0].shape == (3, 64, 64)


# -- counts and indices (defect 11) -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_count_lowered_is_refused(src_a, tmp_path, fmt):
    dest = tmp_path / "ds"
    pack(src_a, dest, fmt)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["count"] -= 2
    (dest / "manifest.json").write_text(json.dumps(manifest))
    ds = packer.open_dataset(dest)
    with pytest.raises(CorruptDataError, match="the manifest says 4") as info:
        ds[0]
    data = {"lmdb": "data.mdb", "hdf5": "data.h5", "wds": "wds_index.npy"}[fmt]
    assert data in str(info.value) and "\n" not in str(info.value)
    assert any(data in line for line in verify(dest))


@pytest.fixture(scope="module")
def readers(src_a, tmp_path_factory):
    """One dataset per reader class: every packed format, and FolderDataset."""
    out = {"folder": packer.FolderDataset(src_a)}
    for fmt in FORMATS:
        dest = tmp_path_factory.mktemp(f"idx-{fmt}") / "ds"
        pack(src_a, dest, fmt)
        out[fmt] = packer.open_dataset(dest)
    return out


@pytest.mark.parametrize("which", ["folder", *FORMATS])
def test_non_integer_index_is_a_type_error(readers, which):
    ds = readers[which]
    expected_image, expected_label = ds[1]
    for bad in (1.5, 1.0, "1", None):
        with pytest.raises(TypeError):
            ds[bad]
        with pytest.raises(TypeError):
            ds.__getitems__([0, bad])
        with pytest.raises(TypeError):
            ds.relpath(bad)
    for good in (np.int64(1), np.int32(1), EpochIndex(1, epoch=3), torch.tensor(1), 1 - len(ds)):
        image, label = ds[good]
        assert label == expected_label and torch.equal(image, expected_image)
    assert [label for _, label in ds.__getitems__([np.int64(1), EpochIndex(1, epoch=0)])] == [expected_label] * 2


# -- verify --deep names the values that differ (defect 10) -------------------------------------------------------

def test_verify_deep_after_a_shape_edit_names_both_shapes(src_a, tmp_path):
    dest = tmp_path / "ds"
    pack(src_a, dest, "lmdb", resize=40, center_crop=32, store="png")
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["shape"] == [32, 32, 3]
    manifest["shape"] = [33, 32, 3]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    problems = verify(dest, deep=True)
    assert len(problems) == 6, problems
    for line in problems:
        assert "(32, 32, 3)" in line and "(33, 32, 3)" in line, line


# -- shards from other tools (defects 6 and 9) ----------------------------------------------------------------------

def jpeg_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 10, 3), seed % 256, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes | tarfile.TarInfo]]) -> Path:
    """A tar of regular members (name, bytes), and prepared TarInfo entries (links) as given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            if isinstance(data, tarfile.TarInfo):
                tar.addfile(data)
                continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def link(name: str, target: str, kind: bytes) -> tuple[str, tarfile.TarInfo]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return name, info


def sample(key: str, label, seed: int = 0, label_member: str = "cls") -> list[tuple[str, bytes]]:
    payload = (json.dumps({"label": label}) if label_member == "json" else str(label)).encode()
    return [(f"{key}.jpg", jpeg_bytes(seed)), (f"{key}.{label_member}", payload)]


@pytest.mark.parametrize(("label", "member"), [
    ("2000000000", "a.cls"), ("3000000", "a.cls"), ("-1", "a.cls"), ("1.7", "a.cls"), ("true", "a.cls"),
    ("1.7", "a.json"), ("true", "a.json"), ("-3", "a.json"), ('"x"', "a.json"), ("2000000000", "a.json"),
], ids=["cls-2e9", "cls-3e6", "cls-negative", "cls-float", "cls-word", "json-float", "json-true",
        "json-negative", "json-string", "json-2e9"])
def test_labels_that_are_not_class_indices_are_refused(tmp_path, label, member):
    """Refused in one line naming the shard and the member, by from_shards, scan_shards and a repack source;
    never read as another label (1.7 or true as 1), nor made into billions of classes."""
    kind = member.rsplit(".", 1)[1]
    shard = write_tar(tmp_path / "shards" / "s-0.tar", [*sample("z", 0, label_member=kind),
                                                        *sample("a", json.loads(label) if kind == "json" else label,
                                                                label_member=kind)])
    label_key = "json:label" if kind == "json" else "cls"
    for call in (lambda: packer.WdsDataset.from_shards([shard], label_key=label_key),
                 lambda: scan_shards([shard], label_key=label_key),
                 lambda: open_source(shard, label_key=label_key)):
        with pytest.raises(PackerError) as info:
            call()
        message = str(info.value)
        assert str(shard) in message and member in message and "\n" not in message, message


def test_class_cap_boundary(tmp_path):
    """Labels up to MAX_SHARD_CLASSES - 1 make that many classes; one more is refused; a class list given to
    from_shards sets the bound instead."""
    from packer.formats.wds.foreign import MAX_SHARD_CLASSES

    top = write_tar(tmp_path / "top.tar", [*sample("a", 0), *sample("b", MAX_SHARD_CLASSES - 1)])
    assert len(packer.WdsDataset.from_shards([top]).classes) == MAX_SHARD_CLASSES
    over = write_tar(tmp_path / "over.tar", [*sample("a", 0), *sample("b", MAX_SHARD_CLASSES)])
    with pytest.raises(PackerError, match="b.cls"):
        packer.WdsDataset.from_shards([over])
    names = [f"c{i}" for i in range(MAX_SHARD_CLASSES + 1)]
    assert packer.WdsDataset.from_shards([over], classes=names)[1][1] == MAX_SHARD_CLASSES


def test_labels_beyond_given_classes_are_refused(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [*sample("a", 0), *sample("b", 2)])
    with pytest.raises(PackerError, match=r"b\.cls.*2 classes|2 classes.*b\.cls") as info:
        packer.WdsDataset.from_shards([shard], classes=["x", "y"])
    assert str(shard) in str(info.value)


def test_link_and_repeated_members_are_listed_as_skipped(tmp_path, capsys):
    """Symlink and hardlink members, and a key whose image (or label) appears twice, are listed in ``skipped``
    with the shard and member (and warned about once); every other sample reads."""
    members = [*sample("a", 0, seed=1),
               link("b.jpg", "a.jpg", tarfile.SYMTYPE), ("b.cls", b"1"),
               link("c.jpg", "a.jpg", tarfile.LNKTYPE), ("c.cls", b"1"),
               *sample("d", 1, seed=2), ("d.jpg", jpeg_bytes(3)),
               *sample("e", 1, seed=4), ("e.cls", b"0"),
               *sample("f", 0, seed=5)]
    shard = write_tar(tmp_path / "shards" / "s-0.tar", members)
    ds = packer.WdsDataset.from_shards([shard])
    assert [ds.relpath(i) for i in range(len(ds))] == ["s-0.tar/a.jpg", "s-0.tar/f.jpg"]
    assert [ds[i][1] for i in range(len(ds))] == [0, 0]
    skipped = dict(ds.skipped)
    assert sorted(skipped) == ["s-0.tar/b.jpg", "s-0.tar/c.jpg", "s-0.tar/d.jpg", "s-0.tar/e.cls"]
    assert "symbolic link" in skipped["s-0.tar/b.jpg"] and "hard link" in skipped["s-0.tar/c.jpg"]
    assert "twice" in skipped["s-0.tar/d.jpg"] and "twice" in skipped["s-0.tar/e.cls"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4" in err and str(shard) in err, err
    # keys left without an image are listed too (b and c lost theirs to the links)
    relpaths = scan_shards([shard]).relpaths
    assert relpaths.tolist() == ["s-0.tar/a.jpg", "s-0.tar/f.jpg"]
    # a repack source lists the same entries, and they reach the manifest's "skipped"
    manifest = packer.pack(tmp_path / "shards", tmp_path / "out", "lmdb", workers=1, progress=False)
    listed = {e["path"]: e["error"] for e in manifest["skipped"]}
    assert sorted(listed) == sorted(skipped) and listed == skipped
    assert manifest["count"] == 2


# -- nothing is unpickled --------------------------------------------------------------------------------------------

class Marker:
    """Unpickling it creates the file it names: the proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "UNPICKLED"
    yield path
    assert not path.exists(), "a pickle was unpickled"


def pickled_npy(marker: Path) -> bytes:
    """An object-dtype .npy whose unpickling creates ``marker``."""
    buf = io.BytesIO()
    np.save(buf, np.array([Marker(str(marker)), 1], dtype=object), allow_pickle=True)
    data = buf.getvalue()
    assert not marker.exists()
    return data


def test_shard_members_holding_pickles_are_refused(tmp_path, marker):
    """A pickled .npy is refused naming the shard and member; .pyd/.pickle members are never read: a key
    whose only payload is one is listed as skipped (no image), a key with an image too reads its image."""
    pickle_bytes = pickle.dumps(Marker(str(marker)))
    good = write_tar(tmp_path / "good" / "g.tar", [
        *sample("a", 0), ("a.pyd", pickle_bytes), ("b.pickle", pickle_bytes), ("b.cls", b"1"),
        ("c.pyd", pickle_bytes), ("c.cls", b"0")])
    ds = packer.WdsDataset.from_shards([good])
    assert len(ds) == 1 and ds[0][1] == 0
    assert sorted(rel for rel, _ in ds.skipped) == ["g.tar/b", "g.tar/c"]
    bad = write_tar(tmp_path / "bad" / "p.tar", [("a.npy", pickled_npy(marker)), ("a.cls", b"0")])
    for call in (lambda: packer.WdsDataset.from_shards([bad]), lambda: open_source(bad),
                 lambda: packer.pack(bad, tmp_path / "out", "lmdb", workers=1, progress=False)):
        with pytest.raises(PackerError) as info:
            call()
        assert str(bad) in str(info.value) and "a.npy" in str(info.value) and "\n" not in str(info.value)


def replace_member(shard: Path, name: str, data: bytes) -> None:
    """Rewrite ``shard`` with member ``name`` holding ``data`` (other members unchanged)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, payload in members:
            if member.name == name:
                payload = data
                member.size = len(data)
            tar.addfile(member, io.BytesIO(payload))


@pytest.fixture(scope="module")
def raw_wds(src_a, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("raw-wds") / "ds"
    pack(src_a, dest, "wds", store="raw", resize=16, center_crop=16, shuffle=False)
    return dest


def test_packed_raw_dataset_with_pickled_npy_is_never_unpickled(raw_wds, tmp_path, marker):
    """A raw WebDataset whose .npy member was replaced by a pickled object array: the random-access reader,
    verify --deep, packer.stream and a repack refuse or skip it; none unpickles it."""
    dest = tmp_path / "ds"
    shutil.copytree(raw_wds, dest)
    shard = dest / "shard-000000.tar"
    replace_member(shard, "000000000.npy", pickled_npy(marker))
    ds = packer.open_dataset(dest, verify=True)
    with pytest.raises(CorruptDataError):
        for i in range(len(ds)):
            ds[i]
    assert verify(dest, deep=True)
    with pytest.raises(CorruptDataError, match="000000000") as info:
        for _ in packer.stream(dest, 2, shuffle=False, num_workers=0):
            pass
    assert "\n" not in str(info.value)
    manifest = packer.pack(dest, tmp_path / "out", "lmdb", workers=1, progress=False)
    assert manifest["count"] < len(ds) and manifest["skipped"]


def test_pickled_shard_index_and_object_dtype_are_refused(raw_wds, src_a, tmp_path, marker):
    """The index a WebDataset reader loads, and the dtype a raw reader builds arrays with, never unpickle."""
    dest = tmp_path / "ds"
    shutil.copytree(raw_wds, dest)
    (dest / "wds_index.npy").write_bytes(pickled_npy(marker))
    with pytest.raises(CorruptDataError, match="wds_index.npy"):
        packer.open_dataset(dest)[0]
    with pytest.raises(PackerError, match="wds_index.npy"):
        open_source(dest)
    for fmt in ("lmdb", "hdf5"):
        raw = tmp_path / fmt
        pack(src_a, raw, fmt, store="raw", resize=16, center_crop=16)
        manifest = json.loads((raw / "manifest.json").read_text())
        manifest["transform"]["dtype"] = "object"
        (raw / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ManifestError, match="manifest.json"):
            packer.open_dataset(raw)
        with pytest.raises(ManifestError, match="manifest.json"):
            open_source(raw)


# -- HDF5 locking ------------------------------------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import fcntl, sys, time, h5py
    path, how = sys.argv[1], sys.argv[2]
    if how == "h5py":      # another reader with HDF5's own locks on
        f = h5py.File(path, "r", locking=True)
    else:                  # what a writer (or a stuck NFS client) holds: an exclusive lock
        f = open(path, "rb")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()
""")

READER = textwrap.dedent("""
    import sys, packer
    from packer.verify import verify
    dest = sys.argv[1]
    ds = packer.open_dataset(dest, verify=True)
    labels = [ds[i][1] for i in range(len(ds))]
    assert verify(dest, deep=True) == [], verify(dest, deep=True)
    print("read", labels)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["h5py", "exclusive"])
def test_hdf5_reads_while_another_process_holds_the_file(src_a, tmp_path, how):
    """A reader, verify and a repack in a second process, with HDF5_USE_FILE_LOCKING unset, while a third
    process holds the file. With HDF5 locking on, the exclusive holder makes every one of them fail."""
    dest = tmp_path / "ds"
    pack(src_a, dest, "hdf5")
    env = {k: v for k, v in os.environ.items() if k != "HDF5_USE_FILE_LOCKING"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(dest / "data.h5"), how], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        reader = subprocess.run([sys.executable, "-c", READER, str(dest)], capture_output=True, text=True, env=env,
                                timeout=300)
        assert reader.returncode == 0, reader.stderr
        assert reader.stdout.strip() == "read [0, 0, 0, 1, 1, 1]"
        repack = subprocess.run([sys.executable, "-m", "packer", "pack", str(dest), str(tmp_path / "copy"),
                                 "--format", "lmdb", "--quiet"], capture_output=True, text=True, env=env, timeout=300)
        assert repack.returncode == 0, repack.stderr
    finally:
        holder.communicate("", timeout=60)
    assert json.loads((tmp_path / "copy" / "manifest.json").read_text())["count"] == 6


def test_hdf5_lock_holder_does_block_a_locking_reader(src_a, tmp_path):
    """The control for the test above: the holder's exclusive lock does stop a reader that takes HDF5 locks,
    so the test above would fail if packer's reader took them."""
    dest = tmp_path / "ds"
    pack(src_a, dest, "hdf5")
    env = {k: v for k, v in os.environ.items() if k != "HDF5_USE_FILE_LOCKING"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(dest / "data.h5"), "exclusive"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = "import sys, packer; ds = packer.open_dataset(sys.argv[1], locking=True); ds[0]"
        locked = subprocess.run([sys.executable, "-c", code, str(dest)], capture_output=True, text=True, env=env,
                                timeout=300)
    finally:
        holder.communicate("", timeout=60)
    assert locked.returncode != 0 and "lock" in locked.stderr.lower(), locked.stderr

"""Every field of every sample of a packed dataset, as each way of reading it gives them: ``ds[i]``, ``packer.stream``,
the plain libraries (py-lmdb, h5py, webdataset: the stored bytes under the names the format documents), and an
export's table and files; and the export-then-pack round trip with the command export prints. The values are made
comparable (images as HWC uint8 arrays or their stored bytes, masks as arrays, numbers as Python lists and scalars),
so that a test asserts the ways agree with ``==``."""

from __future__ import annotations

import csv
import io
import json
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

import packer
from packer.fields import Field, extra_fields, label_field, schema_of
from packer.formats import close_all, open_reader


def comparable(field: Field, value: Any) -> Any:
    """A value as ``ds[i]``, ``stream`` or the export give it, made comparable: images HWC uint8, masks (H, W)
    arrays, numbers lists or scalars (float32 kept as float32 values), the rest as it is."""
    if hasattr(value, "numpy"):
        value = value.numpy()
    if field.kind == "class":
        return int(value)
    if field.kind == "image":
        arr = np.asarray(value)
        return arr.transpose(1, 2, 0) if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[2] not in (1, 3) \
            else arr
    if field.kind == "mask":
        return np.asarray(value)
    if field.kind in ("int64", "float32"):
        return np.asarray(value, "<i8" if field.kind == "int64" else "<f4").tolist()
    return value


def same(a: Any, b: Any) -> bool:
    """Equality of :func:`comparable` values (arrays by shape, dtype kind and every element); a NaN stored is the
    same as a NaN read."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        floats = a.dtype.kind == "f" and b.dtype.kind == "f"
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=floats)
    if isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating)) and np.isnan(a) and np.isnan(b):
        return True
    return a == b


def assert_same(expected: list[dict], got: list[dict], what: str) -> None:
    assert len(expected) == len(got), f"{what}: {len(got)} samples, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert set(e) == set(g), f"{what} sample {i}: fields {sorted(g)}, expected {sorted(e)}"
        for name in e:
            assert same(e[name], g[name]), f"{what} sample {i} field {name!r}: {g[name]!r} != {e[name]!r}"


def schema(dest: Path) -> list[Field]:
    return schema_of(packer.read_manifest(dest))


def by_index(dest: Path) -> list[dict]:
    """Every sample as ``ds[i]`` gives it (a dict of every field)."""
    fields = schema(dest)
    ds = packer.open_dataset(dest, fields=[f.name for f in fields])
    out = []
    for i in range(len(ds)):
        item = ds[i]
        out.append({f.name: comparable(f, v) for f, v in zip(fields, item, strict=True)})
    return out


def by_stream(dest: Path) -> list[dict]:
    """Every sample as ``packer.stream`` gives it, in the packed order (one sample a batch)."""
    fields = schema(dest)
    loader = packer.stream(dest, batch_size=1, shuffle=False, num_workers=0, fields=[f.name for f in fields])
    out = []
    for batch in loader:
        out.append({f.name: comparable(f, v[0]) for f, v in zip(fields, batch, strict=True)})
    return out


def stored_values(dest: Path) -> list[dict]:
    """Every sample's stored bytes: the image's and each field's as packer's reader finds them, the label."""
    reader = open_reader(dest)
    label = label_field(reader.schema)
    out = []
    for i in range(len(reader)):
        data, stored_label = reader.raw_sample(i)
        row: dict[str, Any] = {"image": data if isinstance(data, np.ndarray) else bytes(data)}
        if label is not None:
            row[label.name] = stored_label
        row.update({k: bytes(v) for k, v in reader.read_fields(i, verify=True).items()})
        out.append(row)
    return out


def wds_members(dest: Path) -> list[dict[str, bytes]]:
    """Every sample of a WebDataset dataset as the ``webdataset`` library groups its members (no decoding),
    in shard order: ``{suffix: bytes}``."""
    import webdataset

    manifest = packer.read_manifest(dest)
    urls = [str(dest / s["path"]) for s in manifest["shards"]]
    keep = ("__key__", "__url__", "__local_path__")
    return [{k: v for k, v in sample.items() if k not in keep}
            for sample in webdataset.WebDataset(urls, shardshuffle=False)]


def by_webdataset(dest: Path) -> list[dict]:
    """Every sample's stored values read by the plain ``webdataset`` library under the names the format documents
    (the image under its extension, the class ``cls``, a field ``NAME.EXT``, the caption ``txt``), each decoded
    as webdataset's own decoders do (``.cls`` an int, ``.json`` JSON, ``.txt`` text, ``.npy`` an array); images
    and masks as their stored bytes."""
    import webdataset

    manifest = packer.read_manifest(dest)
    fields = schema_of(manifest)
    label = label_field(fields)
    caption = manifest.get("caption")
    out = []
    for members in wds_members(dest):
        image = [k for k in members if "." not in k and k not in ("cls", "json", "txt")]
        assert len(image) == 1, f"one image member, not {sorted(members)}"
        data = members[image[0]]  # raw pixels are a .npy member: read as webdataset's npy decoder does
        row: dict[str, Any] = {"image": np.load(io.BytesIO(data), allow_pickle=False) if image[0] == "npy" else data}
        if label is not None:
            row[label.name] = int(members["cls"])
        by_lower = {k.lower(): v for k, v in members.items()}
        for field in extra_fields(fields):
            ext = {"text": "txt", "json": "json", "bytes": "bin", "mask": "png"}.get(field.kind)
            if field.kind in ("int64", "float32"):
                ext = "cls" if field.kind == "int64" and field.shape == () else "npy"
            if field.name == caption:
                key = "txt"
            elif ext is None:  # a second image: under its own extension
                key = next(k for k in by_lower if k.startswith(field.name.lower() + "."))
            else:
                key = f"{field.name.lower()}.{ext}"
            data = by_lower[key]
            if field.kind in ("image", "mask", "bytes"):
                row[field.name] = data
            else:
                decoded = webdataset.autodecode.Decoder([])({"__key__": "k", key: data})[key]
                row[field.name] = comparable(field, decoded)
        out.append(row)
    return out


def decoded_stored(dest: Path) -> list[dict]:
    """:func:`stored_values` with every value that is not an image or mask decoded as :func:`by_webdataset` does."""
    fields = schema(dest)
    out = []
    for row in stored_values(dest):
        for field in extra_fields(fields):
            if field.kind not in ("image", "mask", "bytes"):
                row[field.name] = comparable(field, packer.fields.decode(field, row[field.name]))
        out.append(row)
    return out


def exported_image(path: Path, raw: bool) -> bytes | np.ndarray:
    """An exported image as :func:`stored_values` gives the stored one: the file's bytes, or for a dataset of raw
    pixels (exported as lossless PNGs) its pixels, (H, W, C)."""
    if not raw:
        return path.read_bytes()
    with Image.open(path) as image:
        arr = np.asarray(image)
    return arr[..., None] if arr.ndim == 2 else arr


def exported(dest: Path, out: Path) -> tuple[dict, list[dict] | None]:
    """Export ``dest`` to ``out`` and read the export back: ``(export()'s result, every row's values)``, images
    and masks as the bytes of the files the table names, the class as its index; None for the rows of a dataset
    of images and classes only, exported as class folders."""
    result = packer.export(dest, out, progress=False)
    if "table" not in result:  # image and class only: class folders, no table (see :func:`class_samples`)
        return result, None
    fields = schema(dest)
    label = label_field(fields)
    classes = packer.read_manifest(dest)["classes"]
    raw = open_reader(dest).spec.store == "raw"
    with open(result["table"], newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    values = []
    for row in rows:
        got: dict[str, Any] = {"image": exported_image(out / row["image"], raw)}
        if label is not None:
            got[label.name] = classes.index(row[label.name])
        for field in extra_fields(fields):
            cell = row[field.name]
            if field.kind in ("image", "mask"):
                got[field.name] = (out / cell).read_bytes()
            elif field.kind == "text":
                got[field.name] = cell
            elif field.kind == "json":
                got[field.name] = json.loads(cell)
            elif field.shape == ():
                got[field.name] = comparable(field, int(cell) if field.kind == "int64" else float(cell))
            else:
                got[field.name] = comparable(field, json.loads(cell))
        values.append(got)
    return result, values


def pack_back(result: dict, new: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the command an export printed (``result["command"]``), as pasted into a shell, with NEW replaced."""
    args = shlex.split(result["command"])
    assert args[:2] == ["packer", "pack"], result["command"]
    args = [str(new) if a == "NEW" else a for a in args[2:]]
    return subprocess.run([sys.executable, "-m", "packer", "pack", *args, "--quiet"], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def pixels(data: bytes | np.ndarray) -> np.ndarray:
    """The pixels of stored image bytes (or a stored array), as Pillow reads them."""
    if isinstance(data, np.ndarray):
        return data
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img)


def rename_members_as_before(dest: Path) -> None:
    """Rewrite the WebDataset dataset ``dest`` as packer wrote it before format_version 3: a field named as its
    extension (``txt``, ``jpg``) has the bare member ``KEY.EXT``, packer's json is ``KEY.packer.json`` beside a
    field named ``json``, the caption is ``KEY.NAME.txt``; the manifest says format_version 2. Members keep their
    offsets (each header is one 512-byte block), so the index stays right."""
    manifest_path = dest / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    fields = extra_fields(schema_of(manifest))
    meta = "packer.json" if any(f.name == "json" for f in fields) else "json"
    for shard in manifest["shards"]:
        path = dest / shard["path"]
        with tarfile.open(path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            place: dict[str, int] = {}
            labelled = {m.name.partition(".")[0] for m, _ in members if m.name.partition(".")[2] == "cls"}
            for member, data in members:
                key, _, suffix = member.name.partition(".")
                n = place[key] = place.get(key, -1) + 1  # image, cls (labelled), json, then the fields in order
                first_field = 3 if key in labelled else 2
                if n == first_field - 1:
                    member.name = f"{key}.{meta}"
                elif n >= first_field:
                    field = fields[n - first_field]
                    ext = suffix.rpartition(".")[2]
                    member.name = f"{key}.{ext if field.name == ext else f'{field.name}.{ext}'}"
                tar.addfile(member, io.BytesIO(data))
    from packer.manifest import file_entry

    manifest["files"] = [file_entry(dest, e["path"]) if e["path"].endswith(".tar") else e for e in manifest["files"]]
    manifest["format_version"] = 2
    manifest.pop("caption", None)
    manifest_path.write_text(json.dumps(manifest))


def plain_values(dest: Path) -> list[dict]:
    """Every sample's image, label and fields as the plain library of its format reads them, by the layout the
    README documents: py-lmdb's records (``PKR1``/``PKR2``: the header, the path, the payload, then the fields'
    crc32, count, lengths and values), h5py's arrays (``fields/NAME`` typed, or ``values`` and ``offsets``), the
    ``webdataset`` library's members (:func:`by_webdataset`, decoded as it decodes them). Compare with
    :func:`stored_values` (LMDB, HDF5) or :func:`decoded_stored` (WebDataset)."""
    import struct

    import h5py
    import lmdb

    manifest = packer.read_manifest(dest)
    fields = schema_of(manifest)
    label, extras = label_field(fields), extra_fields(fields)
    if manifest["format"] == "wds":
        return by_webdataset(dest)
    rows: list[dict] = []
    if manifest["format"] == "lmdb":
        header = struct.Struct("<4siIHHBBHI")
        close_all()  # packer's readers share one environment a process; py-lmdb opens its own
        env = lmdb.open(str(dest), readonly=True, lock=False)
        try:
            with env.begin() as txn:
                values = [bytes(v) for _, v in txn.cursor()]
        finally:
            env.close()
        for value in values:
            magic, stored_label, _, h, w, c, _, path_len, size = header.unpack_from(value)
            at = header.size + path_len
            payload = value[at:at + size]
            row: dict[str, Any] = {"image": payload if manifest["transform"]["store"] != "raw" else
                                   np.frombuffer(payload, manifest["dtype"]).reshape(h, w, c)}
            if label is not None:
                row[label.name] = stored_label
            if magic == b"PKR2":
                at += size + 4
                (n,) = struct.unpack_from("<I", value, at)
                lengths = struct.unpack_from(f"<{n}I", value, at + 4)
                at += 4 + 4 * n
                for field, length in zip(extras, lengths, strict=True):
                    row[field.name] = value[at:at + length]
                    at += length
            rows.append(row)
        return rows
    with h5py.File(dest / "data.h5", "r") as f:
        labels, shapes = f["labels"][()], f["shapes"][()]
        images, offsets = f["images"], f["offsets"][()] if "offsets" in f else None
        for i in range(len(labels)):
            if offsets is None:
                image: Any = images[i]
            else:
                image = images[offsets[i]:offsets[i + 1]].tobytes()
                if manifest["transform"]["store"] == "raw":
                    image = np.frombuffer(image, manifest["dtype"]).reshape(tuple(shapes[i]))
            row = {"image": image}
            if label is not None:
                row[label.name] = int(labels[i])
            for field in extras:
                stored = f["fields"][field.name]
                if isinstance(stored, h5py.Dataset):
                    row[field.name] = stored[i].tobytes()
                else:
                    ends = stored["offsets"]
                    row[field.name] = stored["values"][ends[i]:ends[i + 1]].tobytes()
            rows.append(row)
    return rows


def class_samples(dest: Path) -> list[tuple[str, bytes]]:
    """Every sample of an image-and-class dataset as (class name, decoded pixels), sorted: what a class-folder
    export packed back must hold, in whatever order the folder gives."""
    classes = packer.read_manifest(dest)["classes"]
    fields = schema(dest)
    label = label_field(fields)
    rows = by_index(dest)
    return sorted((classes[row[label.name]] if label is not None else "", row["image"].tobytes()) for row in rows)

"""``export()``: write a packed dataset back out as an image folder, ``OUT/<class>/.../<image>``.

Each sample is written at its relative path (``OUT/<relpath>``), prefixed with its class folder where the path
does not already start with it (samples repacked from WebDataset shards), so that ImageFolder and ``packer pack``
read the same labels back. What is written is the stored bytes: the original files when the dataset stores
``original`` (so export then pack gives byte-identical samples), the JPEG or PNG re-encodings otherwise (the
extension changed to match where it did not), and for ``raw`` datasets a lossless PNG of the stored pixels
(extension ``.png``). Every class gets its folder, even an empty one, so class indices survive the round trip.
A renamed sample never takes the name of another (``x.jpg`` stored as PNG beside ``x.png`` becomes ``x.jpg.png``).

OUT is written as a hidden sibling folder and renamed to OUT at the end, so a failed export leaves no
half-written OUT. It may not be, hold or be inside the dataset or the folder it was packed from, and
``overwrite`` replaces only a previous export: class folders holding nothing but image files
(:func:`packer.packing.dest.export_problems`).

A dataset with fields (packed from an annotation table or foreign shards) is exported as a table instead:
``OUT/annotations.csv``, one row per sample, beside the images it names: the image at its relative path, each
mask or second image at ``OUT/<field>/<image's path><its suffix>`` (``mask/a/x.jpg.png``: the stored bytes,
masks lossless PNG), the class by name, numbers as they are (float32 values in the shortest text that reads
back to the same float32: ``1.7``), vectors and JSON as JSON text. Every path is unique by construction: where
an image's path takes the table's name or a field's folder (as a file or a folder), the table or the folder
takes the next free name (``annotations-2.csv``, ``mask-2``). The result's ``command`` (``packer pack TABLE NEW
--format FMT --no-shuffle --field ...``) packs it back to the same samples in the same order, with the stored
bytes where the store keeps them. A ``bytes`` field has no place in a CSV cell, and is refused.

(The module is ``packer.exports.folder``, not ``packer.export``: a submodule of that name would shadow the
``packer.export`` function once imported.)
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import shlex
import shutil
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from ..errors import CorruptDataError, DestinationError, PackerError
from ..fields import NUMERIC, Field, extra_fields, is_pair_schema, label_field, schema_of
from ..formats import open_reader
from ..formats.base import Reader
from ..images.transforms import EXTENSION_BY_FORMAT, TransformSpec, is_image_file, to_pil
from ..manifest import is_safe_name, is_safe_relpath
from ..packing.dest import check_output, export_problems, prepare_output
from ..reading.fields import decode_value
from ..system import usable_cores

SUFFIXES = {"jpeg": (".jpg", ".jpeg"), "png": (".png",), "raw": (".png",)}
TABLE = "annotations.csv"


def _partial_folder(out: Path) -> Path:
    """A new folder beside OUT to export into, renamed to OUT at the end: a failure never leaves a half-written
    OUT."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name[:100]}.", suffix=".partial", dir=out.parent))
    except OSError as exc:
        raise DestinationError(f"{out}: cannot create a folder beside it ({exc.strerror or exc}); choose another "
                               "destination") from None


def _check_out(out: Path, dest: Path, manifest: dict, overwrite: bool, files: tuple[str, ...] = ()) -> None:
    """Refuse an OUT that export must not write: inside or around the dataset or its source folder, a link, or
    (with ``overwrite``) a folder holding anything but what export writes. Deletes nothing."""
    out_r = out.resolve()
    for folder, what in ((dest, "the dataset"), (_source_root(manifest), "the dataset's source folder")):
        if folder is None:
            continue
        folder_r = folder.resolve()
        if out_r == folder_r or out_r.is_relative_to(folder_r) or folder_r.is_relative_to(out_r):
            raise DestinationError(f"{out}: must not contain, or be inside, {what} {folder}; choose another "
                                   "folder")
    if out.is_symlink():
        raise DestinationError(f"{out}: is a symbolic link; give the real folder, or a new one")
    check_output(out, overwrite, lambda path: export_problems(path, is_image_file, files), "previous export")


def _source_root(manifest: dict) -> Path | None:
    root = (manifest.get("source") or {}).get("root") if isinstance(manifest.get("source"), dict) else None
    return Path(root) if isinstance(root, str) and root else None


def _unused_name(target: str, suffix: str, taken) -> str:
    """A name for ``target`` re-encoded as ``suffix`` that no other sample uses: ``x.png``, else ``x.jpg.png``,
    else ``x.jpg-2.png``..."""
    candidates = itertools.chain([str(PurePosixPath(target).with_suffix(suffix)), target + suffix],
                                 (f"{target}-{k}{suffix}" for k in itertools.count(2)))
    return next(c for c in candidates if not taken(c))


def _write(path: Path, data: bytes | np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, np.ndarray):
        to_pil(data).save(path, "PNG")
    else:
        with open(path, "wb") as f:
            f.write(data)


def export(dest: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False, workers: int | None = None,
           progress: bool = True) -> dict[str, Any]:
    """Write the packed dataset ``dest`` (any format) out as the image folder ``out``.

    Each sample goes to ``out/<class>/<relative path>`` as its stored bytes (the original files when stored
    ``original``, so export then pack gives byte-identical samples; a lossless PNG of the pixels for ``raw``),
    every class gets a folder, and ``out`` is written under a hidden name and renamed at the end, so a failed
    export leaves none. A dataset with fields is written as a table, ``out/annotations.csv``, beside the files
    it names (see the module docstring).

    Args:
        dest: the packed dataset, a folder or a URL (fetched into packer's cache first).
        out: the folder to write: new or empty, or a previous export with ``overwrite``. It may not be, hold or
            lie inside the dataset or the folder it was packed from.
        overwrite: replace ``out`` when it is a previous export (class folders holding only image files).
        workers: threads that write the files (default: the usable cores).
        progress: show a progress bar on stderr.

    Returns:
        ``{"out", "count", "classes", "renamed"}`` (renamed: how many samples' extensions changed to match their
        encoding); for a table also ``"table"`` (its path) and ``"command"`` (the ``packer pack`` command that
        packs it back).

    Raises:
        DestinationError: ``out`` exists and is not a previous export, or is inside the dataset or its source.
        PackerError: ``dest`` is not a packed dataset, stores normalized arrays, or has a ``bytes`` field.
    """
    from ..remote.entry import local_dataset  # a URL is resolved here, at the entry point

    dest, out = Path(local_dataset(dest)), Path(out)
    reader = open_reader(dest)
    store = reader.spec.store
    if reader.spec.normalize:
        raise PackerError(f"{dest}: stores normalized {reader.spec.dtype} arrays, which are not images; export needs "
                          "a dataset of pixels or encoded images")
    schema = list(getattr(reader, "schema", None) or schema_of(reader.manifest))
    if not is_pair_schema(schema):
        return _export_table(reader, dest, out, schema, overwrite, progress)
    classes = reader.classes
    for name in classes:
        if not is_safe_name(name):
            raise CorruptDataError(f"{dest}: class name {name!r} cannot be a folder name; refusing to export")
    _check_out(out, dest, reader.manifest, overwrite)
    relpaths = [reader.relpath(i) for i in range(len(reader))]
    kept = set(relpaths)  # the names samples keep: a renamed one must not take one of them
    class_names = set(classes)

    def taken(name: str) -> bool:
        head, _, rest = name.partition("/")
        return name in written or name in kept or (head in class_names and rest in kept)

    workers = workers or usable_cores()
    written: set[str] = set()
    renamed = 0
    partial = _partial_folder(out)
    bar = tqdm(total=len(reader), unit="img", disable=not progress, desc=f"exporting {reader.format}",
               dynamic_ncols=True)
    try:
        for name in classes:
            (partial / name).mkdir(exist_ok=True)
        with ThreadPoolExecutor(workers, thread_name_prefix="packer-export") as pool:
            pending: deque = deque()
            for i, rel in enumerate(relpaths):
                data, label = reader.raw_sample(i)  # checked, in this thread: format handles are not shared
                if not 0 <= label < len(classes):
                    raise CorruptDataError(f"{reader.describe(i)}: label {label} is not a class index; "
                                           "run `packer verify`")
                if not is_safe_relpath(rel, normalized=True):
                    raise CorruptDataError(f"{reader.describe(i)}: relative path {rel!r} is absolute or has '..'; "
                                           "refusing to export it")
                target = rel if rel.split("/", 1)[0] == classes[label] and "/" in rel else f"{classes[label]}/{rel}"
                allowed = SUFFIXES.get(store)
                if allowed and PurePosixPath(target).suffix.lower() not in allowed:
                    target = _unused_name(target, allowed[0], taken)
                    renamed += 1
                if target in written:
                    raise PackerError(f"{reader.describe(i)}: two samples would be written to {out / target}; the "
                                      "dataset holds the same relative path twice")
                written.add(target)
                pending.append(pool.submit(_write, partial / target, data))
                if len(pending) >= 4 * workers:
                    pending.popleft().result()
                    bar.update()
            while pending:
                pending.popleft().result()
                bar.update()
        prepare_output(out, overwrite, lambda path: export_problems(path, is_image_file), "previous export")
        os.replace(partial, out)  # onto the empty OUT
    except OSError as exc:
        raise PackerError(f"{out}: write failed ({exc.strerror or exc}); free space or fix permissions, then export "
                          "again") from None
    finally:
        bar.close()
        shutil.rmtree(partial, ignore_errors=True)  # gone already when the export succeeded
    return {"out": str(out), "count": len(reader), "classes": len(classes), "renamed": renamed}


def _number_text(kind: str, value: float) -> str:
    """One number as the table's text: an int64 as its digits, a float32 as the shortest text that reads back to
    the same float32 (``1.7``, not ``1.7000000476837158``)."""
    if kind == "float32":
        return str(np.float32(value))  # numpy's shortest round-trip repr of the float32
    return str(int(value))


def _cell(field: Field, value: object) -> str:
    """A decoded field value as the table's text: what the table source reads back as the same value."""
    if field.kind == "text":
        assert isinstance(value, str)  # a text field decodes to its str
        return value
    if field.kind == "json":
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    if field.kind in NUMERIC:
        arr = np.asarray(value)
        if field.kind == "float32" and not np.isfinite(arr).all():
            raise CorruptDataError(f"field {field.name!r} holds {arr.tolist()}, which a table cell cannot carry back "
                                   "(a table's numbers are finite); read it with packer.open_dataset instead of "
                                   "exporting it")
        if arr.ndim:
            return "[" + ", ".join(_number_text(field.kind, v) for v in arr.tolist()) + "]"
        return _number_text(field.kind, arr.item())
    raise PackerError(f"field {field.name!r} holds {field.kind}, which a CSV cell cannot carry; read it with "
                      "packer.open_dataset instead of exporting it")


def _image_suffix(data: bytes) -> str:
    """The file extension of encoded image bytes, from their header (``.png`` when Pillow cannot tell)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return "." + EXTENSION_BY_FORMAT.get(image.format or "", (image.format or "png").lower())
    except (OSError, ValueError, Image.DecompressionBombError):  # its header alone says what it is
        return ".png"


def pack_command(out: Path, schema: list[Field], spec: TransformSpec, fmt: str, table: str = TABLE) -> str:
    """The ``packer pack`` command that packs an exported table back to the same samples, in the same order
    (``--no-shuffle``), each field's type given so that no value is typed from its text, the mode of a dataset
    not in RGB, and ``--store raw`` for a dataset of raw pixels, whose export holds lossless PNGs of them."""
    label = label_field(schema)
    parts = ["packer", "pack", str(out / table), "NEW", "--format", fmt, "--no-shuffle"]
    parts += ["--store", "raw"] if spec.store == "raw" else []
    parts += ["--mode", spec.mode] if spec.mode != "RGB" else []
    if label is not None:
        parts += ["--label-column", label.name]
    for field in extra_fields(schema):
        size = "" if field.kind not in NUMERIC or field.shape == () else f"[{field.shape[0] if field.shape else ''}]"
        parts += ["--field", f"{field.name}:{field.kind}{size}"]
    return shlex.join(parts)


def _free_name(name: str, taken: set[str]) -> str:
    """``name`` if no exported path takes it (as a file or a folder), else ``annotations-2.csv``,
    ``mask-2``...; added to ``taken``."""
    path = PurePosixPath(name)
    candidates = itertools.chain([name], (f"{path.stem}-{k}{path.suffix}" for k in itertools.count(2)))
    chosen = next(c for c in candidates if c not in taken)
    taken.add(chosen)
    return chosen


def _table_layout(reader: Reader, extras: list[Field]) -> tuple[list[str], int, str, dict[str, str]]:
    """Where a table export writes each thing, every path unique by construction: each image at its relative
    path (renamed where its store changed its encoding, never onto another's), the table and one folder per
    image or mask field at names no image path takes as a file or a folder; a field's file of sample ``i`` is
    ``FOLDER/<image's path><its own suffix>`` (``mask/a/x.jpg.png``), unique as the image paths are.

    Returns:
        The image paths by sample, how many were renamed, the table's name and each dense field's folder."""
    relpaths = [reader.relpath(i) for i in range(len(reader))]
    for i, rel in enumerate(relpaths):
        if not is_safe_relpath(rel, normalized=True):
            raise CorruptDataError(f"{reader.describe(i)}: relative path {rel!r} is absolute or has '..'; refusing "
                                   "to export it")
    kept, written = set(relpaths), set()
    allowed = SUFFIXES.get(reader.spec.store)
    targets, renamed = [], 0
    for i, rel in enumerate(relpaths):
        target = rel
        if allowed and PurePosixPath(rel).suffix.lower() not in allowed:
            target = _unused_name(rel, allowed[0], lambda name: name in written or name in kept)
            renamed += 1
        if target in written:
            raise PackerError(f"{reader.describe(i)}: two samples would be exported to {target!r}; the dataset holds "
                              "the same relative path twice")
        written.add(target)
        targets.append(target)
    taken = {str(parent) for t in targets for parent in PurePosixPath(t).parents} | written
    table = _free_name(TABLE, taken)
    folders = {f.name: _free_name(f.name, taken) for f in extras if f.dense}
    return targets, renamed, table, folders


def _export_table(reader: Reader, dest: Path, out: Path, schema: list[Field], overwrite: bool,
                  progress: bool) -> dict[str, Any]:
    """Export a dataset with fields as images and a table (see the module docstring and :func:`_table_layout`)."""
    extras = extra_fields(schema)
    label = label_field(schema)
    for field in extras:
        if field.kind == "bytes":
            raise PackerError(f"{dest}: field {field.name!r} holds bytes, which a CSV cell cannot carry; read it "
                              "with packer.open_dataset instead of exporting it")
    targets, renamed, table_name, folders = _table_layout(reader, extras)
    _check_out(out, dest, reader.manifest, overwrite, (table_name,))
    columns = ["image", *([label.name] if label is not None else []), *(f.name for f in extras)]
    partial = _partial_folder(out)
    bar = tqdm(total=len(reader), unit="img", disable=not progress, desc=f"exporting {reader.format}",
               dynamic_ncols=True)
    try:
        with open(partial / table_name, "w", newline="", encoding="utf-8") as table:
            rows = csv.DictWriter(table, columns)
            rows.writeheader()
            for i, target in enumerate(targets):
                data, stored_label = reader.raw_sample(i)
                _write(partial / target, data)
                row = {"image": target}
                if label is not None:
                    if not 0 <= stored_label < len(reader.classes):
                        raise CorruptDataError(f"{reader.describe(i)}: label {stored_label} is not a class index; "
                                               "run `packer verify`")
                    row[label.name] = reader.classes[stored_label]
                raw = reader.read_fields(i)  # each field decoded (a damaged one named), then their checksum checked
                for field in extras:
                    if field.dense:
                        payload = bytes(raw[field.name])
                        path = f"{folders[field.name]}/{target}{_image_suffix(payload)}"
                        _write(partial / path, payload)
                        row[field.name] = path
                    else:
                        value = decode_value(field, raw[field.name], reader.describe(i))
                        try:
                            row[field.name] = _cell(field, value)
                        except CorruptDataError as exc:
                            raise CorruptDataError(f"{reader.describe(i)}: {exc}") from None
                reader.check_fields(i, list(raw.values()))
                rows.writerow(row)
                bar.update()
        prepare_output(out, overwrite, lambda path: export_problems(path, is_image_file, (table_name,)),
                       "previous export")
        os.replace(partial, out)
    except OSError as exc:
        raise PackerError(f"{out}: write failed ({exc.strerror or exc}); free space or fix permissions, then export "
                          "again") from None
    finally:
        bar.close()
        shutil.rmtree(partial, ignore_errors=True)
    return {"out": str(out), "count": len(reader), "classes": len(reader.classes), "renamed": renamed,
            "table": str(out / table_name),
            "command": pack_command(out, schema, reader.spec, reader.format, table_name)}

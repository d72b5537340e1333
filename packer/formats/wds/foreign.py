"""WebDataset shards other tools wrote (``webdataset.ShardWriter``, img2dataset...): their scan into an index,
grouping members by key as webdataset does, and what each member becomes (see :mod:`packer.formats.wds`)."""

from __future__ import annotations

import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CorruptDataError, PackerError
from ...fields import MAX_CLASSES, Field
from ...manifest import is_safe_relpath
from .members import IMAGE_EXTS, INDEX_DTYPE, sample_key

# Labels of shards from other tools become classes "0".."largest label": the cap (packer.fields.MAX_CLASSES, which
# a table's integer labels share) keeps a stray huge label from making billions of classes (a MemoryError) or
# millions (a manifest of tens of MB, parsed at every open, and hundreds of MB of memory: docs/benchmarks.md).
# Common class-labelled sets fit (ImageNet-21k: 21,841 classes; iNaturalist 2021: 10,000);
# WdsDataset.from_shards(classes=...) takes a longer class list without the cap.
MAX_SHARD_CLASSES = MAX_CLASSES
_LINK_KINDS = {tarfile.SYMTYPE: "symbolic link", tarfile.LNKTYPE: "hard link"}


_IMAGE = "\0image"  # in a sample's members: which extension is its image


def scan_shards(paths: list[Path], label_key: str | None = "cls", skipped: list[tuple[str, str]] | None = None,
                classes: int | None = None) -> ForeignShards:
    """Index shards written by any WebDataset tool: one row per sample that has an image member.

    The label comes from the ``cls`` member, or with ``label_key="json:NAME"`` from a field of the ``json``
    member; it must be a class index: an integer (or a string of digits) from 0 to ``classes - 1``
    (default: below :data:`MAX_SHARD_CLASSES`). With ``label_key=None`` the label is the ``cls`` member where
    the shards have one, and there is none (label -1) where no sample has one. Every other member is kept as a
    field (:func:`shard_field`); a sample without a member that others have is skipped.

    Refused with an error naming the shard and the member: member names with absolute paths or ``..``; a
    missing label; a label that is not a class index (negative, ``1.7``, ``true``, over the cap). Left out and
    appended to ``skipped`` as ``("SHARD/MEMBER", why)``: link members (symbolic or hard; webdataset readers
    skip them too) and other members that are not regular files; every member of a key whose image or label
    member appears twice (which copy is meant is unknown); a key with no image member ("SHARD/KEY"); a key
    without a field member other keys have."""
    skipped = [] if skipped is None else skipped
    limit = MAX_SHARD_CLASSES if classes is None else classes
    found = [(shard_id, path, key, members) for shard_id, path in enumerate(paths)
             for key, members in _shard_samples(path, skipped)]
    if label_key is None:
        label_key = "cls" if any("cls" in members for *_, members in found) else None
    label_ext = None if label_key is None or label_key.startswith("json:") else label_key
    exts = sorted({e for *_, members in found for e in members if e not in (label_ext, members[_IMAGE])} - {_IMAGE})
    fields = shard_fields(exts, reserved=("image", "label") if label_key is not None else ("image",))
    rows, relpaths, offsets = [], [], []
    for shard_id, path, key, members in found:
        missing = next((e for e in exts if e not in members), None)
        if missing is not None:
            skipped.append((f"{path.name}/{key}", f"no .{missing} member, which other samples have; skipped"))
            continue
        with open(path, "rb") as f:
            label = -1 if label_key is None else _read_label(f, members, label_key, path, key, limit,
                                                            classes is not None)
            img = members[members[_IMAGE]]
            offset, size, arr_shape = img.offset_data, img.size, (0, 0, 0)
            if members[_IMAGE] == "npy":
                f.seek(offset)
                arr_shape, header_len = _npy_header(f.read(min(size, 4096)), f"{path}: member {img.name!r}")
                offset, size = offset + header_len, size - header_len
        rows.append((shard_id, offset, size, 0, 0, label, 0, arr_shape))
        relpaths.append(f"{path.name}/{img.name}")
        offsets.append([(members[e].offset_data, members[e].size) for e in exts])
    index = np.array(rows, dtype=INDEX_DTYPE) if rows else np.zeros(0, INDEX_DTYPE)
    members_index = np.array(offsets, dtype=np.uint64).reshape(len(rows), len(exts), 2)
    return ForeignShards(index, np.array(relpaths, dtype=str), members_index, fields, label_key is not None)


def shard_field(ext: str, name: str | None = None) -> Field:
    """The field a foreign member becomes, by its extension: ``txt`` text, ``json`` JSON, ``cls`` an integer,
    an image extension a second image, anything else bytes; ``caption.txt`` is the text field ``caption``.
    ``name`` overrides the name (:func:`shard_fields` makes each unique)."""
    base, _, last = ext.rpartition(".")
    kind = {"txt": "text", "text": "text", "json": "json", "cls": "int64"}.get(last)
    if kind is None:
        kind = "image" if last in IMAGE_EXTS and last != "npy" else "bytes"
    return Field(name or _field_name(base or last), kind)


def _field_name(text: str) -> str:
    """A field name made of a member's suffix: letters, digits, ``_`` and ``-``, starting with no ``-``."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    return name if name[:1] not in ("", "-") else "_" + name


def shard_fields(exts: list[str], reserved: tuple[str, ...] = ()) -> list[Field]:
    """The fields of foreign members with these extensions (:func:`shard_field`), named so that no two names
    are equal, even but for case, nor one of ``reserved`` (``image``, ``label``): ``caption.txt`` is
    ``caption``; beside ``caption.json`` the second is ``caption_json``, then ``caption_json_2``..."""
    taken = {r.lower() for r in reserved}
    fields = []
    for ext in exts:
        base, _, last = ext.rpartition(".")
        candidates = [_field_name(base or last), _field_name(ext.replace(".", "_"))]
        name = next((c for c in candidates if c.lower() not in taken), None)
        k = 2
        while name is None or name.lower() in taken:
            name, k = f"{candidates[1]}_{k}", k + 1
        taken.add(name.lower())
        fields.append(shard_field(ext, name))
    return fields


def _shard_samples(path: Path, skipped: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    """``(key, {extension: member, "\\0image": the image's extension})`` of each sample of a shard with an image."""
    try:
        tar = tarfile.open(path, "r:")
    except (OSError, tarfile.TarError) as exc:
        raise CorruptDataError(f"{path}: not a readable tar shard ({exc})") from None
    samples: dict[str, dict[str, Any]] = {}
    repeated: dict[str, str] = {}  # key -> the member name seen twice
    noted: set[str] = set()  # keys that already have an entry in skipped
    with tar:
        try:
            for member in tar:
                if not is_safe_relpath(member.name):
                    raise CorruptDataError(f"{path}: member {member.name!r} has an absolute path or '..'; "
                                           "refusing to read this shard")
                if member.isdir():
                    continue
                parsed = sample_key(member.name)
                if not member.isfile():
                    kind = _LINK_KINDS.get(member.type, "special file")
                    skipped.append((f"{path.name}/{member.name}",
                                    f"a {kind} in the shard, not a file; skipped (only regular members are read)"))
                    noted.add(parsed[0] if parsed else member.name)
                    continue
                if parsed is None:
                    continue
                k, ext = parsed
                if ext in samples.setdefault(k, {}):
                    repeated.setdefault(k, member.name)
                samples[k][ext] = member
            # the index keeps what it needs; the TarInfos of a big shard need not stay (typeshed leaves members out)
            tar.members = []  # type: ignore[attr-defined]
        except tarfile.TarError as exc:
            raise CorruptDataError(f"{path}: damaged tar shard ({exc}); re-create it") from None
    out = []
    for k, members in samples.items():
        image_ext = next((e for e in IMAGE_EXTS if e in members), None)
        if k in repeated:
            skipped.append((f"{path.name}/{repeated[k]}", "appears twice in the shard; which copy is meant "
                                                          "is unknown, so the sample is skipped"))
            continue
        if image_ext is None:
            if k not in noted:
                skipped.append((f"{path.name}/{k}", f"no image member ({', '.join(IMAGE_EXTS)}); skipped"))
            continue
        members[_IMAGE] = image_ext
        out.append((k, members))
    return out


def _read_label(f: Any, members: dict, label_key: str, path: Path, key: str, limit: int, given: bool) -> int:
    """The label of sample ``key``: a class index below ``limit`` (``given``: the caller's class count)."""
    name, field = ("json", label_key[5:]) if label_key.startswith("json:") else (label_key, None)
    member = members.get(name)
    try:
        if member is None:
            raise KeyError(f"no {name!r} member")
        f.seek(member.offset_data)
        data = f.read(member.size)
        value = json.loads(data)[field] if field is not None else data.decode("ascii").strip()
    except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
        where = f"{path}: member {member.name!r}" if member is not None else f"{path}: sample {key!r}"
        raise PackerError(f"{where}: no integer label under {label_key!r} ({exc}); pass --label-key") from None
    where = f"{path}: member {member.name!r}"
    # an int, or digits as text: never a bool (True is 1), a float (1.7 is not 1) or anything int() would coerce
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PackerError(f"{where}: label {value!r} is not an integer class index; labels are 0, 1, 2...")
    if value < 0:
        raise PackerError(f"{where}: label {value} is negative; labels are class indices 0, 1, 2...")
    if value >= limit:
        if given:
            raise PackerError(f"{where}: label {value} is not an index into the {limit} classes given")
        raise PackerError(f"{where}: label {value} is over the {limit:,} classes packer makes from shard labels "
                          "(one per integer up to the largest); relabel the shards with class indices, or give the "
                          "classes to WdsDataset.from_shards")
    return value


def _npy_header(data: bytes, where: str) -> tuple[tuple[int, int, int], int]:
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):  # numpy's public readers; versions 3.0+ only matter for unicode field names
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version[0]}.{version[1]}")
    except Exception as exc:  # numpy's header parser raises ValueError, tokenize.TokenError, SyntaxError...
        raise CorruptDataError(f"{where}: not a valid .npy member ({exc})") from None
    if fortran or dtype != np.uint8 or len(shape) not in (2, 3):
        raise CorruptDataError(f"{where}: .npy member must be a C-order uint8 (H, W[, C]) array")
    return (shape[0], shape[1], shape[2] if len(shape) == 3 else 1), f.tell()


@dataclass(frozen=True)
class ForeignShards:
    """The index :func:`scan_shards` built of shards packer did not write: a row per sample, its relative path,
    the (offset, size) of each field's member, the fields, and whether samples have a label."""

    index: np.ndarray
    relpaths: np.ndarray
    members: np.ndarray  # (samples, fields, 2) uint64
    fields: list[Field]
    labelled: bool

"""The members of a WebDataset sample as packer writes them: their names and bytes, so that the ``webdataset``
library decodes each by its extension, the index row that locates them (see :mod:`packer.formats.wds`), the one
rule that groups a shard's members into samples (:func:`sample_key`, for shards of any writer), the parsing of a
sample's members from a shard's bytes or a range of them (:func:`payload_sample`, :func:`field_members`,
:func:`packer_info`: the local reader's and the ranged hooks'), and the reading of a packed shard's samples from
start to end (:func:`read_shard`, for ``packer.stream``)."""

from __future__ import annotations

import io
import json
import mmap
import tarfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from ...errors import CorruptDataError, PackerError, UsageError
from ...fields import NUMERIC, Field, extra_fields
from ...images.transforms import EXTENSION_BY_FORMAT
from ..advice import NPY_ERRORS, map_npy
from ..base import Sample, StreamSample

# a row of wds_index.npy (and of the index built of shards other tools wrote): where a sample's members are
INDEX_DTYPE = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("size", "<u8"), ("json_offset", "<u8"),
                        ("json_size", "<u4"), ("label", "<i8"), ("crc32", "<u4"), ("shape", "<u2", (3,))])
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "npy")
INDEX = "wds_index.npy"  # the shard index: one INDEX_DTYPE row a sample
PARTIAL_INDEX = "wds_index.partial"  # index rows of the finished shards, while converting


def shard_name(i: int) -> str:
    """The name of shard ``i``: ``shard-000000.tar``."""
    return f"shard-{i:06d}.tar"


def sample_key(name: str) -> tuple[str, str] | None:
    """(key, lower-case extension) of a member name: the key is everything up to the first dot of the base name
    (webdataset's rule), with its folder; None for a name without a dot."""
    base = name.rsplit("/", 1)[-1]
    if "." not in base:
        return None
    key, ext = base.split(".", 1)
    return name[: len(name) - len(base)] + key, ext.lower()


# Field members (see the package's docstring). Datasets of format_version 3 and later name every field's member
# NAME.EXT: two dot-separated parts, where packer's own members (the image's extension, cls, json) have one, so
# none can take another's name, nor one that the webdataset library reads as the image or the class. One text
# field, the caption, is named txt instead (img2dataset's and open_clip's convention): the only other one-part
# name. Earlier datasets (format_version 2) named a field as its extension when the two were equal (a bare
# "txt" or "jpg") and packer's own json "packer.json" beside a field named json; they are read by position, as
# before, so they read as they always did.
NAMED_FIELDS_VERSION = 3
MAX_FIELD_NAME = 64  # a member name is KEY.NAME.EXT in the 100 bytes of a plain tar header
CAPTION_EXT = "txt"


def field_ext(field: Field, image_ext: str = "png") -> str:
    """The extension of an extra field's member: the one the ``webdataset`` library decodes it by; an image
    field's is its encoded format's."""
    if field.kind in NUMERIC:
        return "cls" if field.kind == "int64" and field.shape == () else "npy"
    return {"text": "txt", "json": "json", "bytes": "bin", "mask": "png", "image": image_ext}[field.kind]


def member_suffix(field: Field, image_ext: str = "png", caption: str | None = None) -> str:
    """The member name after the key of an extra field (format_version 3): ``NAME.EXT``, or ``txt`` for the
    field named ``caption``."""
    return CAPTION_EXT if field.name == caption else f"{field.name}.{field_ext(field, image_ext)}"


def names_field(field: Field, suffix: str) -> bool:
    """Whether a member named ``KEY.SUFFIX`` may hold ``field`` in a dataset of any format_version: ``NAME.EXT``,
    the bare ``NAME`` of version 2, or ``txt`` for a text field (the caption). Case is ignored, as the
    ``webdataset`` library lowercases member names; which member holds which field is their order."""
    suffix, name = suffix.lower(), field.name.lower()
    return suffix == name or suffix.startswith(name + ".") or (field.kind == "text" and suffix == CAPTION_EXT)


def caption_field(schema: Sequence[Field], caption: str | None = None, where: object = "") -> str | None:
    """The text field written as ``KEY.txt``: ``caption`` (``--caption-column``), which must name a text
    field, else the schema's only text field; None when there is none or several."""
    texts = [f.name for f in extra_fields(schema) if f.kind == "text"]
    if caption is None:
        return texts[0] if len(texts) == 1 else None
    if caption not in texts:
        raise UsageError(f"{where}--caption-column {caption}: not a text field (text fields: "
                         f"{', '.join(texts) or 'none'}); name one of them, or leave it out")
    return caption


def check_schema(schema: Sequence[Field], caption: str | None = None, where: object = "") -> str | None:
    """The rule of the field names WebDataset members can hold, checked before anything is written: each at most
    :data:`MAX_FIELD_NAME` characters, none equal to another but for case (the ``webdataset`` library lowercases
    member names). Returns :func:`caption_field`'s choice. ``where`` (``"TABLE: "``) begins each message.

    Raises:
        UsageError: one line naming the column and what to do.
    """
    seen: dict[str, str] = {}
    for field in extra_fields(schema):
        if len(field.name) > MAX_FIELD_NAME:
            raise UsageError(f"{where}field {field.name[:20]!r}... has a name of {len(field.name)} characters; "
                             f"WebDataset member names hold field names of at most {MAX_FIELD_NAME}: rename its "
                             "column or member (or pack with --format lmdb or hdf5)")
        other = seen.setdefault(field.name.lower(), field.name)
        if other != field.name:
            raise UsageError(f"{where}fields {other!r} and {field.name!r} differ only in case, which WebDataset "
                             "member names cannot tell apart (webdataset lowercases them): rename one")
    return caption_field(schema, caption, where)


def image_ext(value: bytes) -> str:
    """The extension of an encoded image (a second image or mask field), from its header."""
    try:
        with Image.open(io.BytesIO(value)) as image:
            return EXTENSION_BY_FORMAT.get(image.format or "", "png")
    except (OSError, ValueError, Image.DecompressionBombError):  # its header alone says what it is
        return "png"


def member_bytes(field: Field, value: bytes) -> bytes:
    """An extra field's member: its stored bytes, except numbers kept as webdataset decodes them (digits for an
    integer, .npy for the rest)."""
    if field.kind not in NUMERIC:
        return value
    dtype = NUMERIC[field.kind]
    array = np.frombuffer(value, dtype)
    if field.kind == "int64" and field.shape == ():
        return str(int(array[0])).encode("ascii")
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array if field.shape is None else array.reshape(field.shape), allow_pickle=False)
    return buf.getvalue()


def stored_bytes(field: Field, member: bytes | memoryview, where: str) -> bytes | memoryview:
    """The inverse of :func:`member_bytes`."""
    if field.kind not in NUMERIC:
        return member
    try:
        if field.kind == "int64" and field.shape == ():
            return np.array([int(bytes(member))], "<i8").tobytes()
        array = np.lib.format.read_array(io.BytesIO(bytes(member)), allow_pickle=False)
        return np.ascontiguousarray(array, NUMERIC[field.kind]).tobytes()
    except Exception as exc:  # numpy's .npy parser raises several kinds
        raise CorruptDataError(f"{where}: member of field {field.name!r} is damaged ({exc}); re-pack") from None


def load_index(path: Path) -> tuple[np.ndarray, mmap.mmap]:
    """The shard index at ``path`` and its map, mapped for random access (a row read is a page read) and never
    unpickled (:func:`~packer.formats.advice.map_npy`); :class:`CorruptDataError` naming it, in one line,
    whatever is damaged in its header, or when its size is not what its header says."""
    try:
        return map_npy(path)
    except NPY_ERRORS as exc:
        reason = " ".join(str(exc).split())[:200]
        raise CorruptDataError(f"{path}: cannot read the shard index ({type(exc).__name__}: {reason}); re-pack") \
            from None


def npy_bytes(payload: bytes, shape: tuple[int, ...], dtype: str) -> tuple[bytes, int]:
    """The .npy file of a raw payload, and the length of its header."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.frombuffer(payload, dtype=dtype).reshape(shape), allow_pickle=False)
    data = buf.getvalue()
    return data, len(data) - len(payload)


def member_header(block: bytes) -> tuple[str, int] | None:
    """The name and size of the tar member whose 512-byte header is ``block``: packer's members have plain ustar
    headers, parsed here directly (``TarInfo.frombuf`` costs more than decoding a small mask); any other header
    (a long name, a base-256 size) through ``tarfile``. ``None`` when it is no valid header."""
    if block[156:157] in (b"0", b"\0") and block[124] in b"01234567" and block[135:136] in (b"\0", b" ") \
            and not block[345:346].strip(b"\0"):
        checksum = sum(block[:148]) + sum(block[156:]) + 8 * 32
        try:
            if int(block[148:156].split(b"\0", 1)[0].strip() or b"-1", 8) == checksum:
                return block[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape"), int(block[124:135], 8)
        except ValueError:
            return None
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.TarError:
        return None
    return info.name, info.size
def payload_sample(shard: memoryview | mmap.mmap, at: int, size: int, label: int, crc32: int | None, shape: tuple,
                   where: object, index: int) -> Sample:
    """Sample ``index`` whose payload is ``size`` bytes at ``at`` of ``shard`` (a shard's bytes, or a range of
    them); :class:`CorruptDataError` naming ``where`` (the shard) when they end early."""
    if at + size > len(shard):
        raise CorruptDataError(f"{where} sample {index}: shard is truncated; run `packer verify` and re-pack")
    return Sample(memoryview(shard)[at:at + size], label, shape, crc32)


def packer_info(member: bytes | memoryview, where: object) -> dict:
    """Packer's json member of a sample (``relpath``, ``label``, ``fields_crc32``...), parsed; ``where`` names the
    sample in the error when it is not a JSON object."""
    try:
        info = json.loads(bytes(member))
        if isinstance(info, dict):
            return info
    except ValueError:
        pass
    raise CorruptDataError(f"{where}: damaged json member; re-pack")


def fields_checksum_of(info: dict) -> int | None:
    """The fields' checksum a sample's json member records (None: none recorded)."""
    crc = info.get("fields_crc32")
    return crc if isinstance(crc, int) else None


def after_json(json_offset: int, json_size: int) -> int:
    """Where the member after a sample's json member begins: the json's data rounded up to whole tar blocks."""
    return -(-(json_offset + json_size) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def field_members(shard: memoryview, at: int, fields: Sequence[Field], where: str) -> tuple[memoryview | bytes, ...]:
    """The stored bytes of ``fields``, one member each from the header at ``at`` of ``shard`` (a shard's bytes,
    or a range of them), in order: each header must name its field (:func:`names_field`)."""
    values = []
    block = tarfile.BLOCKSIZE
    for field in fields:
        header = member_header(bytes(shard[at:at + block])) if at + block <= len(shard) else None
        start = at + block
        suffix = "" if header is None else header[0].rpartition("/")[2].partition(".")[2]
        if header is None or not names_field(field, suffix) or start + header[1] > len(shard):
            raise CorruptDataError(f"{where}: no member for field {field.name!r} where the index says; "
                                   "run `packer verify` and re-pack")
        values.append(stored_bytes(field, shard[start:start + header[1]], where))
        at = start + -(-header[1] // block) * block
    return tuple(values)


def read_shard(path: Path, extras: Sequence[Field] = (), where: object = None,
               wanted: Callable[[int], bool] | None = None,
               stored: Sequence[Field] | None = None) -> Iterator[StreamSample | None]:
    """The samples of a shard packer wrote, read from start to end (``tar`` order): members grouped by
    :func:`sample_key`, each sample's read by their order (:func:`streamed_sample`): ``stored`` are the
    dataset's extra fields (default ``extras``), ``extras`` those to give. ``where`` names the shard in messages
    (default ``path``). A sample ``wanted`` declines (given its place in the shard, from 0) is None: its
    members' headers are read, their data skipped."""
    where = path if where is None else where
    stored = extras if stored is None else stored
    key: str | None = None
    members: list[tuple[str, bytes]] = []
    place, keep = -1, True
    try:
        with tarfile.open(path, "r:") as tar:
            while (member := tar.next()) is not None:
                tar.members.clear()  # type: ignore[attr-defined]  # tarfile keeps every member's TarInfo: a shard of tiny images holds millions
                parsed = sample_key(member.name) if member.isfile() else None
                if parsed is None:
                    continue
                if parsed[0] != key:
                    if key is not None:
                        yield streamed_sample(where, key, members, stored, extras) if keep else None
                    key, members, place = parsed[0], [], place + 1
                    keep = wanted is None or wanted(place)
                if keep:
                    data = tar.extractfile(member)
                    members.append((parsed[1], data.read() if data is not None else b""))
    except (OSError, tarfile.TarError) as exc:
        raise PackerError(f"{where}: damaged tar shard ({exc}); run `packer verify`") from None
    if key is not None:
        yield streamed_sample(where, key, members, stored, extras) if keep else None


def streamed_sample(where: object, key: str, members: Sequence[tuple[str, bytes]], stored: Sequence[Field],
                    extras: Sequence[Field]) -> StreamSample:
    """Sample ``key`` of a shard packer wrote, from its members (``(lower-case suffix, bytes)``) in the order it
    wrote them: the image, the ``cls`` label (where the dataset has a class), packer's json, then one member per
    field of ``stored`` (each named as :func:`names_field` allows); ``extras``' values are given. By order, as
    the index reads them, so a stream gives what ``ds[i]`` gives whatever the fields are named."""
    name = f"{where} sample {key}"
    if not members or members[0][0] not in IMAGE_EXTS:
        raise CorruptDataError(f"{name}: its first member is not an image; run `packer verify`")
    labelled = len(members) > 1 and members[1][0] == "cls"
    meta = 2 if labelled else 1
    if len(members) <= meta or members[meta][0] not in ("json", "packer.json"):
        raise CorruptDataError(f"{name}: no packer json member after its image and label; run `packer verify`")
    found = members[meta + 1:]
    if len(found) != len(stored):
        raise CorruptDataError(f"{name}: holds {len(found)} field members, the manifest says {len(stored)}; "
                               "run `packer verify`")
    values: dict[str, bytes | memoryview] = {}
    wanted = {f.name for f in extras}
    for field, (suffix, data) in zip(stored, found, strict=True):
        if not names_field(field, suffix):
            raise CorruptDataError(f"{name}: member .{suffix} where field {field.name!r} should be; run "
                                   "`packer verify`")
        if field.name in wanted:
            values[field.name] = stored_bytes(field, data, name)
    label = -1
    if labelled:
        try:
            label = int(members[1][1].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise CorruptDataError(f"{name}: its .cls member is not an integer label; run `packer verify`") from None
    return StreamSample(key, members[0][1], members[0][0], label, values)

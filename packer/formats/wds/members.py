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

from ...errors import CorruptDataError, PackerError
from ...fields import NUMERIC, Field
from ...images.transforms import EXTENSION_BY_FORMAT
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


def member_suffix(field: Field, image_ext: str = "png") -> str:
    """The member name after the key of an extra field: ``NAME.EXT``, or ``EXT`` for a field named as its
    extension. An image field's extension is its encoded format's."""
    if field.kind in NUMERIC:
        ext = "cls" if field.kind == "int64" and field.shape == () else "npy"
    else:
        ext = {"text": "txt", "json": "json", "bytes": "bin", "mask": "png", "image": image_ext}[field.kind]
    return ext if field.name == ext else f"{field.name}.{ext}"


MEMBER_NAME_BYTES = 100  # a ustar header's name: packer's members have no folder to move into its prefix
KEY_CHARS = 12  # a sample's key: its output position in (at least) 9 digits; 12 allows a trillion samples
FIELD_IMAGE_EXTS = tuple(dict.fromkeys(EXTENSION_BY_FORMAT.values()))  # what a second image or mask is stored as


def meta_ext(extra: Sequence[Field]) -> str:
    """The extension of packer's own json member: ``json``, or ``packer.json`` beside a field named ``json``."""
    return "packer.json" if any(f.name == "json" for f in extra) else "json"


def schema_problem(extra: Sequence[Field], labelled: bool) -> str | None:
    """Why samples with the extra fields ``extra`` cannot be written as WebDataset members that every reader
    (packer, ``webdataset``, ``tar``) tells apart, or None: a member name longer than a tar header holds, or a
    field's member that could have the name of the image (any image extension), the class (``cls``), packer's
    json member or another field's member. Asked before anything is written."""
    taken = {ext: "the image" for ext in IMAGE_EXTS} | {"cls": "the class", meta_ext(extra): "packer's json member"}
    if not labelled:
        taken["cls"] = "webdataset's class member"
    for field in extra:
        suffixes = {member_suffix(field, ext) for ext in FIELD_IMAGE_EXTS} if field.dense else {member_suffix(field)}
        for suffix in sorted(suffixes):
            if len(f"{'0' * KEY_CHARS}.{suffix}".encode()) > MEMBER_NAME_BYTES:
                return (f"field {field.name!r}: its member name ({'0' * 9}.{suffix}) is longer than a tar header "
                        f"holds ({MEMBER_NAME_BYTES} bytes); shorten the column's name to at most "
                        f"{MEMBER_NAME_BYTES - KEY_CHARS - 1 - len(suffix) + len(field.name)} characters")
            if suffix in taken:
                return (f"field {field.name!r} would be stored as the member KEY.{suffix}, the name of "
                        f"{taken[suffix]}; rename the column")
        taken |= {suffix: f"field {field.name!r}" for suffix in suffixes}
    return None


def field_member(field: Field, members: dict[str, bytes]) -> str | None:
    """Which of a sample's members (named by what follows the key) holds ``field``: ``NAME.EXT``, or ``EXT`` for
    a field named as its extension (the inverse of :func:`member_suffix`)."""
    if field.name in members:
        return field.name
    return next((m for m in members if m.startswith(field.name + ".")), None)


def image_ext(value: bytes) -> str:
    """The extension of an encoded image (a second image or mask field), from its header."""
    try:
        with Image.open(io.BytesIO(value)) as image:
            return EXTENSION_BY_FORMAT.get(image.format or "", "png")
    except (OSError, ValueError):
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
    or a range of them), in order: each header must name its field (``KEY.NAME.EXT`` or ``KEY.EXT``)."""
    values = []
    block = tarfile.BLOCKSIZE
    for field in fields:
        header = member_header(bytes(shard[at:at + block])) if at + block <= len(shard) else None
        start = at + block
        suffix = "" if header is None else header[0].partition(".")[2]
        if (header is None or not (suffix == field.name or suffix.startswith(field.name + "."))
                or start + header[1] > len(shard)):
            raise CorruptDataError(f"{where}: no member for field {field.name!r} where the index says; "
                                   "run `packer verify` and re-pack")
        values.append(stored_bytes(field, shard[start:start + header[1]], where))
        at = start + -(-header[1] // block) * block
    return tuple(values)


def read_shard(path: Path, extras: Sequence[Field] = (), where: object = None,
               wanted: Callable[[int], bool] | None = None) -> Iterator[StreamSample | None]:
    """The samples of a shard packer wrote, read from start to end (``tar`` order): members grouped by
    :func:`sample_key`; ``extras``' bytes are their members' (:func:`field_member`). ``where`` names the shard in
    messages (default ``path``). A sample ``wanted`` declines (given its place in the shard, from 0) is None: its
    members' headers are read, their data skipped."""
    where = path if where is None else where
    key: str | None = None
    members: dict[str, bytes] = {}
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
                        yield _streamed(where, key, members, extras) if keep else None
                    key, members, place = parsed[0], {}, place + 1
                    keep = wanted is None or wanted(place)
                if keep:
                    data = tar.extractfile(member)
                    members[parsed[1]] = data.read() if data is not None else b""
    except (OSError, tarfile.TarError) as exc:
        raise PackerError(f"{where}: damaged tar shard ({exc}); run `packer verify`") from None
    if key is not None:
        yield _streamed(where, key, members, extras) if keep else None


def _streamed(where: object, key: str, members: dict[str, bytes], extras: Sequence[Field]) -> StreamSample:
    """Sample ``key`` of a shard read sequentially, from its members by extension."""
    ext = next((e for e in IMAGE_EXTS if e in members), None)
    if ext is None or ("cls" not in members and not extras):
        raise PackerError(f"{where}: sample {key} has no image or no .cls label; run `packer verify`")
    values: dict[str, bytes | memoryview] = {}
    for field in extras:
        member = field_member(field, members)
        if member is None:
            raise PackerError(f"{where}: sample {key} has no member for field {field.name!r}; run `packer verify`")
        values[field.name] = stored_bytes(field, members[member], f"{where} sample {key}")
    label = int(members["cls"]) if "cls" in members else -1
    return StreamSample(key, members[ext], ext, label, values)

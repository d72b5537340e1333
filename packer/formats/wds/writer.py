"""The WebDataset writer: samples appended to tar shards in order, the shard index written beside them, and a
conversion's parts merged (see the package's docstring for the layout)."""

from __future__ import annotations

import io
import json
import math
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import PackerError
from ...fields import Field, fields_crc32, label_field
from ...images.transforms import Encoded
from ...manifest import file_entry, fsync_dir
from ..base import Writer, prefixed_entries
from .members import (
    INDEX,
    INDEX_DTYPE,
    NAMED_FIELDS_VERSION,
    PARTIAL_INDEX,
    check_schema,
    image_ext,
    member_bytes,
    member_suffix,
    npy_bytes,
    shard_name,
)

DEFAULT_SHARD_BYTES = 256 << 20
MIN_SHARDS = 8  # enough that 8 DataLoader workers or ranks each get a shard


def default_shard_samples(count: int, estimated_bytes: int, shard_bytes: int) -> int:
    """Samples per shard: at least MIN_SHARDS shards where there are that many samples, none over shard_bytes."""
    shards = max(MIN_SHARDS, math.ceil(estimated_bytes / shard_bytes))
    # the most samples per shard that still gives that many shards: ceil(count / shards) alone can give fewer
    # (14 samples, 2 per shard: 7 shards)
    return max(1, min(math.ceil(count / shards), (count - 1) // (shards - 1)))


class WdsWriter(Writer):
    RESUMES_FROM = "its last complete shard"
    READ_IN_ORDER = True  # shards are read sequentially (webdataset, packer.stream)
    FILES = ("shard-[0-9][0-9][0-9][0-9][0-9][0-9].tar", "shard-[0-9][0-9][0-9][0-9][0-9][0-9].tar.tmp", INDEX,
             PARTIAL_INDEX)

    def __init__(self, dest: Path, spec, expected_count: int, options: dict[str, Any]):
        super().__init__(dest, spec, expected_count, options)
        schema = options.get("schema") or ()
        self.has_label = not schema or label_field(schema) is not None
        self.caption = check_schema(schema, options.get("caption")) if schema else None
        self.shard_bytes = options.get("shard_bytes") or (None if options.get("shard_samples") else DEFAULT_SHARD_BYTES)
        self.shard_samples = options.get("shard_samples") or default_shard_samples(
            expected_count, options.get("estimated_bytes", 0), self.shard_bytes or DEFAULT_SHARD_BYTES)
        self.classes = options.get("classes", [])
        self.key_offset = int(options.get("key_offset") or 0)  # a rank's part numbers its keys from its first sample
        self.index = np.zeros(max(expected_count, 1), INDEX_DTYPE)
        self.shards: list[dict[str, Any]] = []
        self.tar: tarfile.TarFile | None = None
        self.in_shard = 0

    def _add(self, name: str, data: bytes) -> int:
        """Add one member; return the offset of its data in the shard."""
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o644, 0, 0, "", ""
        assert self.tar is not None  # a shard is started before its members are added
        start = self.tar.offset + tarfile.BLOCKSIZE
        self.tar.addfile(info, io.BytesIO(data))
        # tarfile keeps every member's TarInfo: a shard of tiny images holds millions (typeshed leaves members out)
        self.tar.members.clear()  # type: ignore[attr-defined]
        return start

    def _size_after(self, *member_sizes: int) -> int:
        """The shard's file size if it ended after members of these sizes: each member is a header block and its
        data padded to whole blocks; the end of the archive adds two zero blocks, then pads to a whole record."""
        block = tarfile.BLOCKSIZE
        assert self.tar is not None  # asked of the shard being written
        end = self.tar.offset + sum(block + -(-n // block) * block for n in member_sizes) + 2 * block
        return -(-end // tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    def _start_shard(self) -> None:
        self._finish_shard()
        path = self.dest / (shard_name(len(self.shards)) + ".tmp")
        self.tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)
        self.shards.append({"path": shard_name(len(self.shards)), "count": 0})
        self.in_shard = 0

    def _finish_shard(self) -> None:
        """Close the open shard, make it durable under its final name, and append its index rows."""
        if self.tar is None:
            return
        self.tar.close()
        final = self.dest / self.shards[-1]["path"]
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.shards[-1]["count"] = self.in_shard
        self.tar = None
        with open(self.dest / PARTIAL_INDEX, "ab") as f:
            f.write(self.index[self.count - self.in_shard:self.count].tobytes())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.dest)

    def state(self) -> dict[str, Any]:
        shards = self.shards if self.tar is None else self.shards[:-1]
        return {"count": sum(s["count"] for s in shards), "shards": shards}

    def restore(self, state: dict[str, Any]) -> int:
        count, shards = int(state["count"]), list(state["shards"])
        keep = {s["path"] for s in shards}
        for path in self.dest.glob("shard-*.tar*"):
            if path.name not in keep:
                path.unlink()
        partial = self.dest / PARTIAL_INDEX
        rows = np.fromfile(partial, dtype=INDEX_DTYPE) if partial.exists() else np.zeros(0, INDEX_DTYPE)
        if len(rows) < count or any(not (self.dest / s["path"]).exists() for s in shards):
            raise PackerError(f"{self.dest}: the finished shards do not match the progress record; "
                              "start again with --overwrite")
        with open(partial, "r+b") as f:
            f.truncate(count * INDEX_DTYPE.itemsize)
        self.index[:count] = rows[:count]
        self.shards, self.count = shards, count
        return count

    def write(self, label: int, relpath: str, item: Encoded, extras: tuple[bytes, ...] = ()) -> int | None:
        keyname = f"{self.key_offset + self.count:09d}"
        if item.ext == "raw":
            data, header = npy_bytes(item.payload, item.shape, self.spec.dtype)
            ext = "npy"
        else:
            data, header, ext = item.payload, 0, item.ext
        info: dict[str, Any] = {"relpath": relpath, "label": label, "shape": list(item.shape)}
        if self.has_label:
            info["class"] = self.classes[label] if 0 <= label < len(self.classes) else str(label)
        members = [(f"{keyname}.{ext}", data)]
        if self.has_label:
            members.append((f"{keyname}.cls", str(label).encode("ascii")))
        if self.extra_fields:
            info["fields_crc32"] = fields_crc32(extras)
        meta = json.dumps(info, sort_keys=True, ensure_ascii=False).encode("utf-8")
        members.append((f"{keyname}.json", meta))
        for field, value in zip(self.extra_fields, extras, strict=True):  # a second image: under its own format
            suffix = member_suffix(field, image_ext(value) if field.kind == "image" else "", self.caption)
            members.append((f"{keyname}.{suffix}", member_bytes(field, value)))
        full = self.tar is not None and (
            self.in_shard >= self.shard_samples
            or (self.shard_bytes and self._size_after(*(len(m) for _, m in members)) > self.shard_bytes))
        durable = None
        if self.tar is None or full:
            durable = self.count if self.tar is not None else None
            self._start_shard()
        offsets = [self._add(name, member) for name, member in members]
        offset, json_offset = offsets[0] + header, offsets[len(members) - len(extras) - 1]
        if self.count >= len(self.index):
            self.index = np.resize(self.index, 2 * len(self.index))
        self.index[self.count] = (len(self.shards) - 1, offset, len(item.payload), json_offset, len(meta), label,
                                  item.crc32, item.shape)
        self.in_shard += 1
        self.shards[-1]["count"] = self.in_shard
        self.count += 1
        return durable

    def close(self) -> dict[str, Any]:
        self._finish_shard()
        np.save(self.dest / INDEX, self.index[: self.count], allow_pickle=False)
        (self.dest / PARTIAL_INDEX).unlink(missing_ok=True)
        files = [file_entry(self.dest, s["path"]) for s in self.shards] + [file_entry(self.dest, INDEX)]
        return {"files": files, "shards": self.shards, **self.naming()}

    def naming(self) -> dict[str, Any]:
        """What the manifest says of the fields' member names: a dataset with fields is format_version 3 (see
        :data:`~.members.NAMED_FIELDS_VERSION`; packers that read only 2 refuse it rather than misread it), and
        ``caption`` names the field written as ``KEY.txt``."""
        if not self.extra_fields:
            return {}
        return {"format_version": NAMED_FIELDS_VERSION, **({"caption": self.caption} if self.caption else {})}

    @classmethod
    def check_schema(cls, schema: Sequence[Field], options: dict[str, Any] | None = None, where: object = "") -> None:
        """The field names WebDataset members can hold (:func:`~.members.check_schema`), and the caption
        ``options["caption"]`` names."""
        check_schema(schema, (options or {}).get("caption"), where)

    def abort(self) -> None:
        if self.tar is not None:
            self.tar.close()

    @classmethod
    def merge_parts(cls, parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
        first = next(iter(parts.values()), {})  # every part names its members alike
        naming: dict[str, Any] = {k: first[k] for k in ("format_version", "caption") if k in first}
        return {**prefixed_entries(parts, ("files", "shards")), **naming}

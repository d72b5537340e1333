"""WebDataset: POSIX tar shards ``DEST/shard-000000.tar``... that the ``webdataset`` library and ``tar`` read.

Each sample is three adjacent members named by a dot-free key, the 9-digit sample index:
``000000042.jpg`` (the image, under its format's lower-case extension; ``.npy`` for raw arrays),
``000000042.cls`` (the label as ASCII digits) and ``000000042.json`` (``relpath``, ``label``, ``class``,
``shape``). Members have mtime 0, owner 0 and mode 0644, so two conversions give identical bytes. In a
distributed conversion each rank's part (``part-00000/shard-000000.tar``...) numbers its keys from its first
position in the output order, so keys stay unique across parts.

For random access packer also writes ``wds_index.npy``: one row per sample with its shard and the byte offset
and size of its image payload (for ``.npy``, of the pixels after the header) and of its json member. Shards are
written under ``.tmp`` names and renamed once complete.
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptDataError, PackerError
from ..manifest import file_entry, fsync_dir
from ..transforms import Encoded
from .base import PackedDataset, Sample, Writer, register

INDEX = "wds_index.npy"
PARTIAL_INDEX = "wds_index.partial"  # index rows of the finished shards, while converting
INDEX_DTYPE = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("size", "<u8"), ("json_offset", "<u8"),
                        ("json_size", "<u4"), ("label", "<i8"), ("crc32", "<u4"), ("shape", "<u2", (3,))])
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "npy")
DEFAULT_SHARD_BYTES = 256 << 20
MIN_SHARDS = 8  # enough that 8 DataLoader workers or ranks each get a shard


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def default_shard_samples(count: int, estimated_bytes: int, shard_bytes: int) -> int:
    """Samples per shard: at least MIN_SHARDS shards where there are that many samples, none over shard_bytes."""
    shards = max(MIN_SHARDS, math.ceil(estimated_bytes / shard_bytes))
    # the most samples per shard that still gives that many shards: ceil(count / shards) alone can give fewer
    # (14 samples, 2 per shard: 7 shards)
    return max(1, min(math.ceil(count / shards), (count - 1) // (shards - 1)))


def npy_bytes(payload: bytes, shape: tuple[int, ...], dtype: str) -> tuple[bytes, int]:
    """The .npy file of a raw payload, and the length of its header."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.frombuffer(payload, dtype=dtype).reshape(shape), allow_pickle=False)
    data = buf.getvalue()
    return data, len(data) - len(payload)


class WdsWriter(Writer):
    RESUMES_FROM = "its last complete shard"
    def __init__(self, dest: Path, spec, expected_count: int, options: dict[str, Any]):
        super().__init__(dest, spec, expected_count, options)
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
        start = self.tar.offset + tarfile.BLOCKSIZE
        self.tar.addfile(info, io.BytesIO(data))
        return start

    def _size_after(self, *member_sizes: int) -> int:
        """The shard's file size if it ended after members of these sizes: each member is a header block and its
        data padded to whole blocks; the end of the archive adds two zero blocks, then pads to a whole record."""
        block = tarfile.BLOCKSIZE
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

    def write(self, label: int, relpath: str, item: Encoded) -> int | None:
        keyname = f"{self.key_offset + self.count:09d}"
        if item.ext == "raw":
            data, header = npy_bytes(item.payload, item.shape, self.spec.dtype)
            ext = "npy"
        else:
            data, header, ext = item.payload, 0, item.ext
        meta = json.dumps({"relpath": relpath, "label": label,
                           "class": self.classes[label] if label < len(self.classes) else str(label),
                           "shape": list(item.shape)}, sort_keys=True, ensure_ascii=False).encode("utf-8")
        full = self.tar is not None and (
            self.in_shard >= self.shard_samples
            or (self.shard_bytes and self._size_after(len(data), len(str(label)), len(meta)) > self.shard_bytes))
        durable = None
        if self.tar is None or full:
            durable = self.count if self.tar is not None else None
            self._start_shard()
        offset = self._add(f"{keyname}.{ext}", data) + header
        self._add(f"{keyname}.cls", str(label).encode("ascii"))
        json_offset = self._add(f"{keyname}.json", meta)
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
        return {"files": files, "shards": self.shards}

    def abort(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _safe_member(name: str) -> bool:
    return not (name.startswith("/") or ".." in name.split("/") or "\\" in name)


def scan_shards(paths: list[Path], label_key: str = "cls") -> tuple[np.ndarray, list[str]]:
    """Index shards written by any WebDataset tool: one row per sample that has an image member and a label.

    The label comes from the ``cls`` member (an integer), or with ``label_key="json:NAME"`` from a field of the
    ``json`` member. Member names with absolute paths or ``..`` are refused."""
    rows, relpaths = [], []
    for shard_id, path in enumerate(paths):
        try:
            tar = tarfile.open(path, "r:")
        except (OSError, tarfile.TarError) as exc:
            raise CorruptDataError(f"{path}: not a readable tar shard ({exc})") from None
        with tar:
            samples: dict[str, dict[str, tarfile.TarInfo]] = {}
            order: list[str] = []
            try:
                for member in tar:
                    if not member.isfile():
                        continue
                    if not _safe_member(member.name):
                        raise CorruptDataError(f"{path}: member {member.name!r} has an absolute path or '..'; "
                                               "refusing to read this shard")
                    base = member.name.rsplit("/", 1)[-1]
                    if "." not in base:
                        continue
                    prefix = member.name[: len(member.name) - len(base)]
                    key, ext = base.split(".", 1)
                    k = prefix + key
                    if k not in samples:
                        samples[k] = {}
                        order.append(k)
                    samples[k][ext.lower()] = member
            except tarfile.TarError as exc:
                raise CorruptDataError(f"{path}: damaged tar shard ({exc}); re-create it") from None
            for k in order:
                members = samples[k]
                image_ext = next((e for e in IMAGE_EXTS if e in members), None)
                if image_ext is None:
                    continue
                label = _read_label(tar, members, label_key, f"{path}:{k}")
                img = members[image_ext]
                offset, size = img.offset_data, img.size
                if image_ext == "npy":
                    header = tar.extractfile(img).read(min(size, 4096))
                    arr_shape, header_len = _npy_header(header, f"{path}:{img.name}")
                    offset, size = offset + header_len, size - header_len
                else:
                    arr_shape = (0, 0, 0)
                rows.append((shard_id, offset, size, 0, 0, label, 0, arr_shape))
                relpaths.append(f"{path.name}/{img.name}")
    index = np.array(rows, dtype=INDEX_DTYPE) if rows else np.zeros(0, INDEX_DTYPE)
    return index, relpaths


def _read_label(tar: tarfile.TarFile, members: dict, label_key: str, where: str) -> int:
    try:
        if label_key.startswith("json:"):
            meta = json.loads(tar.extractfile(members["json"]).read())
            return int(meta[label_key[5:]])
        return int(tar.extractfile(members[label_key]).read().strip())
    except (KeyError, ValueError, TypeError) as exc:
        raise PackerError(f"{where}: no integer label under {label_key!r} ({exc}); pass --label-key") from None


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


class WdsDataset(PackedDataset):
    """Random access over WebDataset shards, through byte offsets recorded at pack time: exact ``len()``,
    shuffling and ``DistributedSampler`` work as for the other formats. Shards are memory-mapped per process.

    Shards written by other tools (``webdataset.ShardWriter``, img2dataset...) are read with
    :meth:`from_shards`. For sequential or remote reading through the ``webdataset`` library, see
    :func:`packer.stream`."""

    def __init__(self, root, **kwargs):
        super().__init__(root, **kwargs)
        self._count = int(self.manifest["count"])
        self.shard_paths = [self.root / s["path"] for s in self.manifest.get("shards", [])]
        self.index = None
        self.maps: list | None = None
        self._foreign: tuple[np.ndarray, np.ndarray] | None = None  # (index, relpaths) of foreign shards
        self._has_crc = "crc32" in self.manifest.get("checksum", "crc32")

    @classmethod
    def from_shards(cls, paths: list[str | os.PathLike], label_key: str = "cls", classes: list[str] | None = None,
                    **kwargs) -> WdsDataset:
        """Random access to shards packer did not write: one sample per key with an image member (jpg, png,
        webp, bmp, tif, ppm or uint8 npy) and an integer label from ``label_key`` (``cls``, or ``json:FIELD``).
        The index is built once, from the tar headers. Classes default to ``"0"``..``"max label"``."""
        paths = [Path(p) for p in paths]
        if not paths:
            raise PackerError("from_shards needs at least one shard path")
        index, relpaths = scan_shards(paths, label_key)
        if len(index) == 0:
            raise PackerError(f"{paths[0]}: no samples with an image and a {label_key!r} label in these shards")
        if classes is None:
            classes = [str(i) for i in range(int(index["label"].max()) + 1)]
        root = Path(os.path.commonpath([str(p.resolve().parent) for p in paths]))
        manifest = {"format": "wds", "count": len(index), "classes": list(classes),
                    "class_to_idx": {c: i for i, c in enumerate(classes)}, "transform": {"store": "original"},
                    "shape": None, "checksum": "none",
                    "shards": [{"path": os.path.relpath(p.resolve(), root)} for p in paths]}
        dataset = cls(root, manifest=manifest, **kwargs)
        dataset._foreign = (index, np.array(relpaths, dtype=str))
        return dataset

    def __len__(self) -> int:
        return self._count

    def _handles(self) -> tuple[str, ...]:
        return ("index", "maps")

    def _open(self) -> None:
        self.maps = [None] * len(self.shard_paths)
        if self._foreign is not None:
            self.index = self._foreign[0]
            return
        try:
            index = np.load(self.root / INDEX, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CorruptDataError(f"{self.root / INDEX}: cannot read the shard index ({exc}); re-pack") from None
        if index.dtype != INDEX_DTYPE or len(index) != self._count:
            raise CorruptDataError(f"{self.root / INDEX}: index does not match the manifest; re-pack")
        self.index = index

    def _map(self, shard: int) -> mmap.mmap:
        m = self.maps[shard]
        if m is None:
            path = self.shard_paths[shard]
            try:
                with open(path, "rb") as f:
                    m = self.maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise CorruptDataError(f"{path}: cannot map shard ({exc}); run `packer verify`") from None
        return m

    def _read(self, index: int) -> Sample:
        row = self.index[index]
        shard = int(row["shard"])
        if shard >= len(self.shard_paths):
            raise CorruptDataError(f"{self._describe(index)}: index names a missing shard; re-pack")
        m = self._map(shard)
        a, size = int(row["offset"]), int(row["size"])
        if a + size > len(m):
            raise CorruptDataError(f"{self.shard_paths[shard]} sample {index}: shard is truncated; "
                                   "run `packer verify` and re-pack")
        crc = int(row["crc32"]) if self._has_crc else None
        return Sample(memoryview(m)[a:a + size], int(row["label"]), tuple(int(x) for x in row["shape"]), crc)

    def relpath(self, index: int) -> str:
        index = self._check_index(index)
        if self._foreign is not None:
            return str(self._foreign[1][index])
        self._ensure_open()
        row = self.index[index]
        a, size = int(row["json_offset"]), int(row["json_size"])
        try:
            return json.loads(bytes(self._map(int(row["shard"]))[a:a + size]))["relpath"]
        except (ValueError, KeyError):
            raise CorruptDataError(f"{self._describe(index)}: damaged json member; re-pack") from None

    def _describe(self, index: int) -> str:
        if self.index is not None and 0 <= index < len(self.index):
            shard = int(self.index[index]["shard"])
            if shard < len(self.shard_paths):
                return f"{self.shard_paths[shard]} sample {index}"
        return f"{self.root} sample {index}"


register("wds", WdsWriter, WdsDataset)

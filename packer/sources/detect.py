"""What ``packer pack`` converts: an image folder, a dataset packer already packed, or WebDataset shards.

:func:`open_source` tells them apart. Each :class:`Source` gives the classes, the samples in their natural order
(``len``, labels and relative paths), each sample's size in bytes (to estimate the output and to balance ranks),
a fingerprint (a resumed conversion must see the same source), and a picklable :class:`SampleReader` that a worker
process uses to read sample ``i`` and convert it.

- :class:`FolderSource`: ``SRC/<class>/**/<image>``, scanned with ImageFolder's rules (:func:`packer.scan_folder`).
- :class:`PackedSource`: a folder with a ``manifest.json`` (any format, also one converted by several ranks), read
  through its reader (:func:`packer.formats.open_reader`): the stored bytes, or the stored array for ``raw``.
- :class:`ShardsSource`: ``.tar`` shards written by any WebDataset tool (``webdataset.ShardWriter``, img2dataset),
  a folder of them, a single one, or a glob; read through the reader the registry gives for them
  (:func:`packer.formats.foreign_reader`) with a ``label_key``.

A repacked sample keeps the relative path it has in its source, so repacking keeps relpaths, and with
``store=original`` the exact stored bytes.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError, PackerError, SourceError, UsageError, warn
from ..fields import label_field
from ..formats import Reader, foreign_reader, open_reader
from ..images.transforms import MAX_SIDE, Encoded, TransformSpec, convert_array, convert_bytes, convert_file
from ..manifest import JOURNAL, MANIFEST
from .base import SampleReader, Source
from .folder import scan_folder
from .table import TableSource, is_table


# -- image folders -----------------------------------------------------------------------------------------------
class FolderSampleReader(SampleReader):
    """The source images of an image folder, read and converted one by one for a conversion."""

    def __init__(self, root: str, samples: list[tuple[str, int]]):
        self.root = root
        self.samples = samples

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        relpath, label = self.samples[index]
        return relpath, label, convert_file(os.path.join(self.root, relpath), relpath, spec), ()

    def name(self, index: int) -> str:
        return self.samples[index][0]


class FolderSource(Source):
    """An ImageFolder, scanned with :func:`packer.scan_folder`."""

    kind = "folder"

    def __init__(self, root: str | os.PathLike, include_hidden: bool = False):
        scan = scan_folder(root, include_hidden=include_hidden)
        super().__init__(Path(root), scan.classes, len(scan.samples))
        self.samples = scan.samples
        self.hidden_skipped = scan.hidden_skipped
        self.empty_classes = scan.empty_classes
        self.errors = scan.errors
        self._stats: tuple[np.ndarray, str] | None = None

    def _stat(self) -> tuple[np.ndarray, str]:
        """One pass over the files: their sizes, and a digest of what the scan found (paths, labels, sizes,
        mtimes)."""
        if self._stats is None:
            sizes = np.zeros(len(self.samples), np.int64)
            h = hashlib.sha256(json.dumps([self.classes, self.errors]).encode())
            for i, (rel, label) in enumerate(self.samples):
                try:
                    st = os.stat(self.root / rel)
                    sizes[i] = st.st_size
                    h.update(f"{rel}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
                except OSError:
                    h.update(f"{rel}\0{label}\0missing\n".encode())
            self._stats = sizes, h.hexdigest()
        return self._stats

    def sizes(self) -> np.ndarray:
        return self._stat()[0]

    def fingerprint(self) -> str:
        return self._stat()[1]

    def reader(self) -> SampleReader:
        return FolderSampleReader(str(self.root), self.samples)

    def where(self, relpath: str) -> str:
        return str(self.root / relpath)


# -- packed datasets and shards ------------------------------------------------------------------------------------
class DatasetReader(SampleReader):
    """Reads the stored bytes (or array) of a packed dataset or of foreign shards and converts them."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def convert(self, index: int, spec: TransformSpec) -> tuple[str, int, Encoded, tuple[bytes, ...]]:
        reader = self.reader
        relpath = f"sample {index}"
        try:
            reader.open()
            relpath = reader.relpath(index)
            sample = reader.checked(index, reader.read(index))
            # the fields as stored (second images and masks too: repacking keeps them, it does not re-transform)
            extras = tuple(bytes(v) for v in reader.read_fields(index, verify=True).values())
            array = reader.stored_array(index, sample)
            if array is not None:
                encoded = convert_array(array, relpath, spec)
            else:
                encoded = convert_bytes(bytes(sample.payload), relpath, spec)
        except ImageError as exc:
            raise ImageError(relpath, exc.reason) from None
        except PackerError as exc:  # a damaged record or shard: skipped (or fatal with --strict) like a bad image
            raise ImageError(relpath, str(exc)) from None
        if max(encoded.shape[:2]) > MAX_SIDE:
            raise ImageError(relpath, f"{encoded.shape[1]}x{encoded.shape[0]} has a side over {MAX_SIDE} pixels; "
                                      "shrink it (--max-size)")
        return relpath, sample.label, encoded, extras


class PackedSource(Source):
    """A dataset packed by packer (any format): samples are read back as stored, checksums checked."""

    kind = "packed"

    def __init__(self, root: str | os.PathLike):
        root = Path(root)
        reader = open_reader(root)
        reader.open()  # a damaged or unreadable data file is one error here, not one skipped line per sample
        manifest = reader.manifest
        super().__init__(root, reader.classes, len(reader))
        if reader.spec.normalize:
            raise SourceError(f"{root}: stores normalized {reader.spec.dtype} arrays, which cannot be turned back "
                              "into pixels; re-pack from the original image folder")
        self.stored_reader = reader
        self.manifest = manifest
        self.schema = list(reader.schema)
        self.stored = reader.spec.store
        self.mode = reader.spec.mode
        self.shape = manifest.get("shape")
        self.shuffled = bool((manifest.get("order") or {}).get("shuffle"))
        self.empty_classes = list(manifest.get("empty_classes") or [])
        if self.count == 0:
            raise SourceError(f"{root}: the dataset holds no samples; nothing to pack")

    def sizes(self) -> np.ndarray:
        total = sum(int(f.get("bytes", 0)) for f in self.manifest["files"])
        return np.full(self.count, max(1, total // max(1, self.count)), np.int64)

    def fingerprint(self) -> str:
        m = self.manifest
        return hashlib.sha256(json.dumps([m["format"], m["count"], m["classes"], m["files"]],
                                         sort_keys=True).encode()).hexdigest()

    def reader(self) -> SampleReader:
        return DatasetReader(self.stored_reader)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "format": self.manifest["format"], "store": self.stored,
                "transform": self.manifest["transform"]}

    @property
    def default_store(self) -> str | None:
        return "raw" if self.stored == "raw" else None

    def check(self, spec: TransformSpec) -> None:
        if self.stored == "raw" and spec.store == "original":
            raise SourceError(f"{self.root}: stores decoded pixels (store raw), so there are no original file bytes "
                              "to keep; choose --store raw (the default for this source), png or jpeg")


class ShardsSource(Source):
    """``.tar`` shards from any WebDataset writer: one sample per key with an image member and an integer label
    read from ``label_key`` (``cls``, ``txt``, ``json:FIELD``...)."""

    kind = "shards"

    def __init__(self, paths: list[Path], label_key: str | None = None, pattern: str | None = None):
        reader = foreign_reader(paths, label_key=label_key)
        super().__init__(reader.root, reader.classes, len(reader))
        self.errors = list(reader.skipped)  # link and repeated members: warned about and listed in the manifest
        self.stored_reader = reader
        self.paths = [Path(p) for p in paths]
        self.label_key = label_key or ""
        self.schema = list(reader.schema)
        if label_field(self.schema) is None:
            warn(f"{paths[0]}: no sample has a .cls member, so the samples get no class; pass --label-key "
                 "(txt, json:FIELD...) to take one from another member")
        self.pattern = pattern
        present = reader.class_counts() if self.classes else []
        self.empty_classes = [c for c, n in zip(self.classes, present, strict=False) if n == 0]

    def sizes(self) -> np.ndarray:
        sizes = self.stored_reader.stored_sizes()
        return sizes if sizes is not None else np.ones(self.count, np.int64)

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.label_key.encode())
        for path in self.paths:
            st = os.stat(path)
            h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def reader(self) -> SampleReader:
        return DatasetReader(self.stored_reader)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "shards": [str(p.resolve()) for p in self.paths], "label_key": self.label_key}

    @property
    def key(self) -> str:
        return self.pattern or super().key


# -- telling them apart --------------------------------------------------------------------------------------------
def _shards_in(folder: Path) -> list[Path] | None:
    """The .tar files of a folder of shards: .tar files and no (visible) sub-folders. None if it is not one."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    if any(e.is_dir() and not e.name.startswith(".") for e in entries):
        return None
    tars = sorted(folder / e.name for e in entries if e.name.endswith(".tar") and e.is_file())
    return tars or None


def open_source(src: str | os.PathLike | Any, include_hidden: bool = False, label_key: str | None = None,
                table: dict[str, Any] | None = None, hf: dict[str, Any] | None = None) -> Source:
    """The :class:`Source` that ``src`` names:

    - ``hf:PATH_OR_NAME``, a ``datasets.Dataset`` or ``DatasetDict``: a Hugging Face dataset (``hf``: the keyword
      arguments of :class:`packer.sources.hf.HfSource`: ``split``, ``image_column``, ``label_column``);
    - a ``.csv``, ``.tsv`` or ``.jsonl`` file: an annotation table (``table``: the keyword arguments of
      :class:`packer.sources.table.TableSource`: ``image_column``, ``root``, ``label_column``, ``field``);
    - a folder with ``manifest.json``: a packed dataset;
    - a ``.tar`` file, a glob such as ``'shards/*.tar'``, or a folder that holds ``.tar`` files and no
      sub-folders: WebDataset shards (labels from ``label_key``, default ``cls``);
    - any other folder: an image folder (``include_hidden`` keeps names starting with '.')."""
    from .hf import is_hf

    if is_hf(src):
        return _hf_source(src, label_key, table, hf)
    if (hf or {}).get("split") is not None:
        raise UsageError("--split is for a Hugging Face SRC (hf:PATH_OR_NAME)")
    text = os.fspath(src)  # a URL was resolved by pack(), the entry point: this is a local path or pattern
    path = Path(text)
    shards: list[Path] | None = None
    pattern = None
    if not path.exists() and glob.has_magic(text):
        shards = sorted(Path(p) for p in glob.glob(text) if os.path.isfile(p))
        pattern = os.path.abspath(text)
        if not shards:
            raise SourceError(f"{text}: no files match this pattern")
    elif path.is_file() and path.suffix.lower() == ".tar":
        shards = [path]
    elif is_table(path):
        if label_key is not None:
            raise UsageError("--label-key is for WebDataset shards; a table's label is --label-column")
        return TableSource(path, **(table or {}))
    elif path.is_dir():
        if (path / MANIFEST).exists():
            if label_key is not None:
                raise UsageError("--label-key is for WebDataset shards; a packed dataset keeps its labels")
            return PackedSource(path)
        if (path / JOURNAL).exists():
            raise SourceError(f"{path}: an unfinished packer conversion (no {MANIFEST}); finish it with `packer pack "
                              "... --resume` before packing from it")
        shards = _shards_in(path)
    if shards is not None:
        return ShardsSource(shards, label_key=label_key, pattern=pattern)
    if label_key is not None:
        raise UsageError("--label-key is for WebDataset shards; an image folder's labels are its class folders")
    return FolderSource(path, include_hidden=include_hidden)


def _hf_source(src: Any, label_key: str | None, table: dict[str, Any] | None, hf: dict[str, Any] | None) -> Source:
    from .hf import HfSource

    if label_key is not None:
        raise UsageError("--label-key is for WebDataset shards; a Hugging Face dataset's class is --label-column")
    if table and (table.get("root") is not None or table.get("field")):
        raise UsageError("--root and --field are for annotation tables; a Hugging Face dataset's columns are typed "
                         "from its features")
    return HfSource(src, **(hf or {}))
